"""The flows' commands on the `crucible` command line (registered by cli.main); they start the
flows (`flows`) and, for `crucible sweep`, the embedded stack (`cli.embedded`).

- `crucible sweep [--preset smoke] [--arm ssn --arm mapl] [--strategy skip ...] [--p 0.1 ...]
  [--seed 0 ...] [--duration N] [--global-steps N] [--set key=value ...] [--name N] [--tag T ...]
  [--note TEXT] [--demo]`: runs the `failure-sweep` flow on the embedded stack (ephemeral
  Prefect, SQLite registry, local store), prints the robustness table (one-seed cells marked
  against the study's noise floor), a pointer to docs/RESULTS.md and, as its last line,
  `report: PATH` (the offline dashboard).
  Exit 2 for a bad option (the message names it), 1 when some cells failed (the report is still
  written), 0 otherwise.
- `crucible deploy [--pool NAME [--image IMG] [--source PATH]] [--limit N]`: creates the
  `train-run` and `failure-sweep` deployments on the Prefect server in `PREFECT_API_URL` and
  serves them from this process, or registers them on a work pool.
- `crucible reconcile [--stop] [--unrecorded] [--reason TEXT]`: marks the flow runs of this host
  whose process is dead `Crashed` (with `--stop`: ends the live ones first, and marks them
  `Cancelled`), running their flows' hooks, so Prefect and the registry say what happened
  (`flows.processes`; `infra/stack.sh start` and `stop` run it).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

__all__ = ["register", "sweep", "deploy", "reconcile"]

_log = logging.getLogger(__name__)


# the option that sets a SweepSpec field, for error messages (others keep the field's name)
_OPTION_OF = {"tags": "--tag", "notes": "--note"}


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "spec"


def _spec_from_options(demo: bool, values: dict[str, Any]) -> Any:
    """Build the SweepSpec (the demo grid when `demo`, options given explicitly win; `--set`
    adds to the demo's own overrides, after them)."""
    from pydantic import ValidationError

    from crucible.grid.spec import DEMO_SPEC, SweepSpec

    data = dict(DEMO_SPEC) if demo else {}
    given = {key: value for key, value in values.items() if value not in (None, [])}
    if "overrides" in given:
        given["overrides"] = [*data.get("overrides", []), *given["overrides"]]
    data.update(given)
    try:
        return SweepSpec(**data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_OPTION_OF.get(str(err['loc'][0]) if err['loc'] else '', _loc(err['loc']))}: "
            f"{err['msg'].removeprefix('Value error, ')}" for err in exc.errors())
        typer.echo(f"error: {problems}", err=True)
        raise typer.Exit(code=2) from None


RESULTS_POINTER = ("the study's numbers, with 95% intervals over seeds: docs/RESULTS.md "
                   "(`crucible study render studies/table1-d128.toml`; the complete d_model 64 "
                   "study: docs/RESULTS-d64.md)")


def _cell_text(cell: dict[str, Any] | None, p: float, floor: float | None) -> str:
    """One cell of the sweep's table: the interval when there is one; a one-seed value is
    marked against the noise floor the study measured (or as having no interval)."""
    if cell is None:
        return "-"
    if p == 0:
        return "0 (baseline)"
    mean = cell["mean_pct"]
    if cell["ci_low_pct"] is not None:
        return f"{mean:+.2f}% [{cell['ci_low_pct']:+.2f}, {cell['ci_high_pct']:+.2f}]"
    if floor is None:
        return f"{mean:+.2f}% (1 seed, no interval)"
    if abs(mean) < floor:
        return f"{mean:+.2f}% (1 seed; below noise ±{floor:.1f})"
    return f"{mean:+.2f}% (1 seed; noise ±{floor:.1f})"


def _caption(one_seed: bool, floor: float | None) -> str | None:
    if not one_seed:
        return None
    if floor is None:
        return ("1 seed: no interval, and no noise floor to compare with (the failure study's "
                "results/table1 is absent); see docs/RESULTS-d64.md")
    return (f"1 seed: no interval. ±{floor:.1f} points is the one-seed noise floor the failure "
            "study measured with its own preset (docs/RESULTS-d64.md); a shorter preset's noise is "
            "likely larger, so a value below it cannot be told from 0")


def _print_table(table: dict[str, Any], title: str) -> None:
    """The Table-1 shape: one row per p, one column per arm/strategy, mean % (95% interval).
    One-seed cells have no interval: they are marked against the noise floor that the
    committed failure study measured (crucible.study.noise_floor)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from crucible import study

    one_seed = any(cell is not None and cell["ci_low_pct"] is None and row["p"] != 0
                   for row in table["rows"] for cell in row["cells"].values())
    floor = study.noise_floor() if one_seed else None
    view = Table(title=title, caption=_caption(one_seed, floor))
    view.add_column("p")
    for column in table["columns"]:
        view.add_column(escape(str(column)), justify="right")    # mapl/skip[label]: not markup
    for row in table["rows"]:
        cells = [_cell_text(row["cells"].get(column), row["p"], floor)
                 for column in table["columns"]]
        view.add_row(f"{row['p']:g}", *cells)
    Console().print(view)


def claim_lines(claims: dict[str, Any] | None) -> list[str]:
    """The claims a sweep speaks to (those with a comparison run), each comparison's paired 95%
    interval and what it says. A comparison whose interval the noise leaves open reads
    "unresolved", with the seeds that would decide it if its mean and sd held, and one with a
    single seed has no interval and no verdict: never a finding."""
    if not claims:
        return []
    lines = []
    for claim in claims["claims"]:
        if claim["verdict"] == "not run yet":
            continue
        lines.append(f"({claim['tag']}) {claim['title']}: {claim['verdict']}")
        for c in claim["comparisons"]:
            if c["mean"] is None:       # not run yet
                continue
            n = c["n_seeds"]
            interval = (f"[{c['ci_low']:+.2f}, {c['ci_high']:+.2f}]"
                        if c["ci_low"] is not None else "(no interval)")
            more = (f"; about {c['seeds_to_decide']} seeds would decide it"
                    if c["status"] == "unresolved" and c.get("seeds_to_decide") else "")
            status = "no verdict below 2 seeds" if c["status"] == "missing" else c["status"]
            lines.append(f"    {c['label']}: {c['mean']:+.2f} points {interval}, "
                         f"{n} seed{'' if n == 1 else 's'}: {status}{more}")
    if lines:
        lines.insert(0, "claims, on paired 95% intervals (points of the baseline's loss):")
    return lines


def _check_here(spec: Any, work_dir: Path, out: Path | None, *, memory_check: bool) -> None:
    """The embedded sweep trains here: refuse (ConfigError) a cell this machine cannot run and
    output locations that cannot be written, before Prefect or the registry start."""
    from crucible.config import ConfigError
    from crucible.preflight import check_spec_here, check_writable_dir

    check_spec_here(spec, memory_check=memory_check)
    check_writable_dir(work_dir, field="--work-dir")
    if out is not None:
        check_writable_dir(out.parent, field="folder of --out")
        if out.is_dir():
            raise ConfigError(f"--out={str(out)!r} is a folder; give the report's file path, "
                              "e.g. report.html")


def sweep(
    preset: str | None = typer.Option(None, "--preset", help="smoke | small | paper-178m"),
    arms: list[str] = typer.Option([], "--arm", help="compression arm (repeatable): none, ssn, mapl"),
    strategies: list[str] = typer.Option([], "--strategy",
                                         help="skip, drop, drop_extend, reroute (repeatable)"),
    ps: list[float] = typer.Option([], "--p", help="failure probability in [0, 1] (repeatable)"),
    seeds: list[int] = typer.Option([], "--seed", help="seed (repeatable)"),
    duration: int | None = typer.Option(None, "--duration", help="global steps a failure lasts"),
    global_steps: int | None = typer.Option(None, "--global-steps", help="training length"),
    overrides: list[str] = typer.Option([], "--set", help="key.path=value for every cell"),
    store: str | None = typer.Option(None, "--store", help="file:///path or s3://bucket/prefix"),
    max_concurrent: int | None = typer.Option(None, "--max-concurrent",
                                              help="most cells in flight at once"),
    name: str | None = typer.Option(None, "--name", help="the sweep's name"),
    tags: list[str] = typer.Option([], "--tag", help="tag of the sweep and its runs "
                                                     "(repeatable; 1-64 characters from "
                                                     "A-Za-z0-9._:/+=-); also Prefect tag "
                                                     "tag:<t> of its flow runs"),
    note: str | None = typer.Option(None, "--note", help="free-text notes on the sweep"),
    demo: bool = typer.Option(False, "--demo", help="the demo grid: skip and drop at p = 0.2 "
                                                    "+ baselines, 3 seeds, the study's preset "
                                                    "at 4 replicas (about 3 minutes)"),
    work_dir: Path = typer.Option(Path("crucible-work"), "--work-dir",
                                  help="registry, Prefect state, run folders and the report"),
    out: Path | None = typer.Option(None, "--out", help="report path (default in --work-dir)"),
    torch_threads: int = typer.Option(1, "--torch-threads", min=1,
                                      help="torch threads per run (1 suits a shared CPU)"),
    skip_memory_check: bool = typer.Option(
        False, "--skip-memory-check",
        help="start cells even when their estimated peak memory exceeds what this machine has "
             "left (docs/OPERATIONS.md, Memory estimate)"),
) -> None:
    """Run a failure sweep through Prefect on the embedded stack, then write its report.

    Before anything starts, every distinct cell is checked against this machine (device,
    memory estimate) and --work-dir and --out against the file system: exit 2 naming the
    option or key."""
    spec = _spec_from_options(demo, {
        "preset": preset, "arms": arms, "strategies": strategies, "failure_probabilities": ps,
        "seeds": seeds, "duration": duration, "global_steps": global_steps,
        "overrides": overrides, "store_url": store, "max_concurrent_runs": max_concurrent,
        "name": name, "tags": tags, "notes": note})
    from cli.embedded import run_sweep_embedded
    from crucible.config import ConfigError

    try:
        _check_here(spec, work_dir, out, memory_check=not skip_memory_check)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"sweep {spec.name}: {len(spec.cells())} runs of preset {spec.preset} "
               f"(work folder {work_dir})")
    try:
        result = run_sweep_embedded(spec, work_dir, out, torch_threads=torch_threads,
                                    skip_memory_check=skip_memory_check)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    # Prefect logs its server shutdown at exit; keep `report: PATH` the last line
    logging.getLogger("prefect").setLevel(logging.WARNING)
    _print_table(result.table, f"{spec.name}: val-loss increase (%) vs p=0 [95% CI]")
    for line in claim_lines(result.claims):
        typer.echo(line)
    if result.message:
        typer.echo(f"some cells failed: {result.message}", err=True)
    typer.echo(RESULTS_POINTER)
    typer.echo(f"report: {result.report_path}")
    if result.outcome is None:
        raise typer.Exit(code=1)


def deploy(
    pool: str | None = typer.Option(None, "--pool", help="register on this work pool instead "
                                                         "of serving from this process"),
    image: str | None = typer.Option(None, "--image", help="container image (Kubernetes/"
                                                           "Docker pools)"),
    source: str | None = typer.Option(None, "--source", help="where workers find the code "
                                                             "(default: this checkout)"),
    limit: int | None = typer.Option(None, "--limit", help="most flow runs served at once"),
) -> None:
    """Create the train-run, failure-sweep and distributed-run deployments on the Prefect server
    (PREFECT_API_URL) and serve them, or register them on a work pool (--pool)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per poll otherwise
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        typer.echo("error: PREFECT_API_URL is not set; point it at your Prefect server, e.g. "
                   "export PREFECT_API_URL=http://127.0.0.1:4200/api (see docs/OPERATIONS.md)",
                   err=True)
        raise typer.Exit(code=2)
    from flows.deploy import deploy_to_pool, serve_deployments

    if pool:
        ids = deploy_to_pool(pool, image=image, source=source)
        typer.echo(f"deployed train-run, failure-sweep and distributed-run to work pool {pool}: {', '.join(ids)}")
        return
    serve_deployments(limit=limit)


def reconcile(
    stop: bool = typer.Option(False, "--stop", help="end every live flow-run process of this "
                                                    "host (its process group) first, and mark "
                                                    "the flow runs Cancelled, not Crashed"),
    unrecorded: bool = typer.Option(False, "--unrecorded", help="also end open flow runs with "
                                                                "no process record: only while "
                                                                "no runner serves this server"),
    reason: str | None = typer.Option(None, "--reason", help="the reason recorded in Prefect "
                                                             "and the registry"),
    grace_s: float = typer.Option(30.0, "--grace-s", min=0, help="with --stop: seconds between "
                                                                  "SIGTERM and SIGKILL"),
) -> None:
    """Mark the flow runs whose process on this host is gone Crashed (--stop: end the live ones
    and mark them Cancelled) in Prefect and, through their hooks, in the registry."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        typer.echo("error: PREFECT_API_URL is not set; point it at the Prefect server whose flow "
                   "runs to reconcile (eval \"$(infra/stack.sh env)\")", err=True)
        raise typer.Exit(code=2)
    from flows.processes import end_processes
    from flows.processes import reconcile as reconcile_runs
    from flows.settings import FlowSettings

    work_dir = FlowSettings().work_dir
    died = "its process died with no hook run (found by crucible reconcile)"
    # what died before this command is Crashed, also with --stop: only what it ends is Cancelled
    for name in reconcile_runs(work_dir, reason=died, unrecorded=unrecorded and not stop):
        typer.echo(f"crashed: flow run {name} ({died})")
    if not stop:
        return
    for record in end_processes(work_dir, grace_s=grace_s):
        typer.echo(f"ended {record['flow']} flow run {record['flow_run_id']} "
                   f"(pid {record['pid']})")
    why = reason or "stopped with the stack (infra/stack.sh stop)"
    for name in reconcile_runs(work_dir, cancelled=True, reason=why, unrecorded=unrecorded):
        typer.echo(f"cancelled: flow run {name} ({why})")


def register(app: typer.Typer) -> None:
    """Add this package's commands to the `crucible` command line."""
    app.command("sweep")(sweep)
    app.command("deploy")(deploy)
    app.command("reconcile")(reconcile)
