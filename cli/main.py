"""The `crucible` command line: the one place where the library, the registry, the flows and the
dashboards meet.

    crucible presets
    crucible run --preset NAME [--set key.path=value ...] [--out DIR] [--resume | --overwrite]
                 [--api URL | --no-api] [--name N] [--tag T ...] [--note TEXT]
    crucible sweep ... | crucible deploy ...      (flows)
    crucible launch --nproc R [--preset NAME] --out DIR [--kill R@STEP ...]   (distributed)
    crucible report SWEEP --out FILE.html         (dashboards; SWEEP = name or UUID)
    crucible cost RUN_OR_SWEEP --deployment FILE  (wall-clock, accelerator-hours, money)
    crucible api ... | crucible db upgrade        (registry)

Exit codes: 0 success, 2 bad input or a run this machine cannot start (one `error:` line names
the key or option and the fix; docs/OPERATIONS.md, "Before a run starts"), 1 failure (a
diverged run, an object store that stopped answering: one line, `--resume` continues).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import typer

__all__ = ["app", "main"]

app = typer.Typer(help="Crucible: fault-tolerance experiments for low-bandwidth pipelined "
                       "LLM training.", no_args_is_help=True, add_completion=False)


def _setup_logging() -> None:
    level = os.environ.get("CRUCIBLE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=code)


def _si(n: float) -> str:
    """A count in K/M/B, e.g. 3.55B tokens."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


@app.command()
def presets(as_json: bool = typer.Option(
        False, "--json", help="machine-readable output: a list of objects with each preset's "
                              "name, description and sizes")) -> None:
    """List the named configurations with their sizes and expected time on this CPU.

    One block per preset, wrapped to the terminal (80 columns when piped): the name and what it
    is for, then its sizes. Use a name with `crucible run --preset NAME`."""
    import shutil
    import textwrap

    from crucible.presets import PRESETS, parameter_count, tokens_per_global_step

    rows = []
    for name, info in PRESETS.items():
        cfg = info.build()
        rows.append({"name": name, "description": info.description, "parameters": parameter_count(cfg),
                     "replicas": cfg.replicas, "stages": cfg.pipeline.stages,
                     "layers": cfg.model.layers, "d_model": cfg.model.d_model,
                     "seq_len": cfg.model.seq_len, "inner_steps": cfg.sparseloco.inner_steps,
                     "global_steps": cfg.train.global_steps,
                     "tokens": tokens_per_global_step(cfg) * cfg.train.global_steps,
                     "expected_cpu": info.expected_cpu})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    # plain wrapped text rather than a table: a table squeezed into 80 columns cuts names
    width = min(shutil.get_terminal_size((80, 24)).columns, 100)
    blocks = []
    for r in rows:
        sizes = (f"{_si(r['parameters'])} parameters, {r['replicas']} replicas x {r['stages']} "
                 f"stages, {r['layers']} layers, d_model {r['d_model']}, seq_len {r['seq_len']}, "
                 f"H={r['inner_steps']}, {r['global_steps']} global steps, {_si(r['tokens'])} "
                 f"tokens; expected on a CPU: {r['expected_cpu']}")
        blocks.append("\n".join([
            *textwrap.wrap(f"{r['name']}: {r['description']}", width, break_long_words=False,
                           break_on_hyphens=False),
            *textwrap.wrap(sizes, width, initial_indent="    ", subsequent_indent="    ",
                           break_long_words=False, break_on_hyphens=False)]))
    typer.echo("\n\n".join(blocks))


def _preset_help() -> str:
    from crucible.presets import PRESETS

    return f"named configuration, one of: {', '.join(PRESETS)} (`crucible presets` describes them)"


@app.command()
def run(preset: str = typer.Option("smoke", "--preset", help=_preset_help()),
        overrides: list[str] = typer.Option([], "--set", help="key.path=value (repeatable)"),
        out: Path | None = typer.Option(
            None, "--out", help="output folder (default: a new runs/<UTC time>-<preset>); a "
                                "folder holding another run is refused unless --resume or "
                                "--overwrite"),
        resume: bool = typer.Option(False, "--resume", help="continue the run in --out from its "
                                                            "last checkpoint (same preset and --set)"),
        overwrite: bool = typer.Option(False, "--overwrite",
                                       help="replace the run in --out: delete its records, model "
                                            "and local store first (nothing else in the folder)"),
        progress: bool = typer.Option(True, "--progress/--no-progress",
                                      help="show a progress bar on a terminal (train loss, "
                                           "tokens/s, stages down)"),
        skip_memory_check: bool = typer.Option(
            False, "--skip-memory-check",
            help="start even when the estimated peak memory exceeds what this machine has "
                 "left (docs/OPERATIONS.md, Memory estimate)"),
        api: str | None = typer.Option(
            None, "--api", envvar="CRUCIBLE_API_URL",
            help="report the run to the Crucible registry at this base URL (e.g. "
                 "http://127.0.0.1:8000; write token from CRUCIBLE_API_TOKEN): its metrics and "
                 "events appear on the dashboards. The registry must answer when the run "
                 "starts (else exit 2, nothing trained); an outage later is spooled and "
                 "replayed"),
        no_api: bool = typer.Option(False, "--no-api",
                                    help="do not report to the registry, even with "
                                         "CRUCIBLE_API_URL set"),
        name: str | None = typer.Option(None, "--name", help="the run's name in the registry "
                                                             "(default: the --out folder's)"),
        tags: list[str] = typer.Option([], "--tag", help="tag of the run in the registry "
                                                         "(repeatable; 1-64 characters from "
                                                         "A-Za-z0-9._:/+=-)"),
        note: str | None = typer.Option(None, "--note", help="free-text notes on the run in the "
                                                              "registry"),
        alignment: bool = typer.Option(False, "--alignment",
                                       help="add the final model's alignment report to the "
                                            "summary (per inner stage: CKA, update ratio, "
                                            "bypass damage; what a study records of its "
                                            "baselines; about 7% of a MAPL run)"),
        ) -> None:
    """Train one run locally, write OUT/summary.json and print its headline numbers (final val
    loss +- s.e., tokens, failures, bytes uploaded, wall time).

    Before anything is written, the run is checked against this machine: the device exists,
    OUT (and a file:// store) can be written, and the estimated peak memory fits. OUT never
    mixes two runs: one that holds another run is refused (exit 2) unless --resume continues it
    with the same configuration or --overwrite replaces it.

    With --api (or CRUCIBLE_API_URL) the run is also registered with the registry (name, tags,
    notes, config), reported live and marked completed or failed; its dashboard page is printed
    at the start and the end."""
    _setup_logging()
    api_url = None if no_api else (api or None)
    registry_options = _registry_options(api_url, tags, note)
    from crucible.checkpoint import CheckpointError
    from crucible.config import ConfigError, apply_overrides
    from crucible.faults import FaultPlanError
    from crucible.presets import get_preset
    from crucible.store import StoreError

    if resume and overwrite:
        raise _fail("--resume and --overwrite exclude each other: --resume continues the run in "
                    "--out, --overwrite replaces it")
    if resume and out is None:
        raise _fail("--resume needs --out: the folder of the run to continue")
    config = summary = reported = None
    new_dir = out is None
    try:
        config = apply_overrides(get_preset(preset), overrides)
        from crucible.preflight import check_can_start
        from crucible.train import TrainingDiverged, train

        if out is None:
            out = _new_run_dir(preset)
        else:
            _check_run_folder(out, config.to_json(), resume=resume, overwrite=overwrite)
        check_can_start(config, out_dir=out, memory_check=not skip_memory_check)
        if overwrite:
            _clear_run_folder(out)
        if registry_options is not None:
            reported = _register_run(registry_options, config, out, name=name or out.name,
                                     resume=resume)
        summary = _train_reported(reported, lambda: train(
            config, out_dir=out, resume=resume, progress=progress and sys.stderr.isatty(),
            callback=reported.callback if reported else None, alignment=alignment))
    except (ConfigError, FaultPlanError) as exc:
        raise _fail(str(exc)) from None
    except CheckpointError as exc:
        raise _fail(str(exc)) from None
    except StoreError as exc:
        endpoint = config.store.endpoint_url if config is not None else None
        raise _fail(_store_failure(exc, endpoint, out), code=1) from None
    except TrainingDiverged as exc:
        raise _fail(str(exc), code=1) from None
    finally:
        if summary is None and new_dir and out is not None and out.is_dir() \
                and not any(out.iterdir()):
            out.rmdir()   # a run refused before it wrote anything leaves no empty folder
    _print_summary(summary)
    typer.echo(f"summary: {out / 'summary.json'}")
    if reported is not None:
        from crucible.registry.reporting import ApiError

        try:
            owed = reported.finish(summary)
        except ApiError as exc:     # refused (not unreachable: that is spooled, `owed`)
            raise _fail(f"the registry refused the run's final state: {exc}; the run's files "
                        f"are in {out}", code=1) from None
        if owed is not None:
            typer.echo(f"warning: the registry has not recorded this run's end yet ({owed} "
                       f"records owed, kept in {reported.settings.spool_root}); it shows the "
                       "run as running until `crucible api replay` (or any later run) delivers "
                       "them", err=True)
        typer.echo(f"run page: {reported.page}")


def _registry_options(api_url: str | None, tags: list[str],
                      note: str | None) -> dict | None:
    """What `crucible run` needs to report to the registry ({settings, tags, notes}), or None
    without a registry; exit 2 naming the option for a bad tag, note or URL."""
    from pydantic import ValidationError

    from crucible.grid.tags import check_notes, check_tags

    try:
        tags, note = check_tags(tags, field="--tag"), check_notes(note, field="--note")
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if api_url is None:
        if tags or note:
            raise _fail("--tag and --note are recorded in the registry: give --api URL or set "
                        "CRUCIBLE_API_URL (and leave out --no-api)")
        return None
    if not api_url.startswith(("http://", "https://")):
        raise _fail(f"--api (or CRUCIBLE_API_URL)={api_url!r} must start with http:// or "
                    "https://, e.g. http://127.0.0.1:8000")
    from crucible.registry.settings import ReporterSettings

    try:
        settings = ReporterSettings(api_url=api_url)
    except ValidationError as exc:
        raise _fail("; ".join(str(error["msg"]) for error in exc.errors())) from None
    return {"settings": settings, "tags": tags, "notes": note}


def _register_run(options: dict, config, out: Path, *, name: str,  # noqa: ANN001 - a Config
                  resume: bool):  # noqa: ANN202 - a crucible.registry.standalone.StandaloneRun
    """Register the run with the registry before it trains; exit 2 when the registry cannot be
    reached or refuses (nothing is trained)."""
    from crucible.registry.reporting import ApiError, ApiUnavailable
    from crucible.registry.standalone import start_run

    settings = options["settings"]
    try:
        reported = start_run(settings, config, out, name=name, tags=options["tags"],
                             notes=options["notes"], resume=resume)
    except ApiUnavailable as exc:
        raise _fail(f"cannot reach the registry at {settings.api_url} ({exc.detail}); start it "
                    "(`crucible api`, infra/stack.sh), fix --api or CRUCIBLE_API_URL, or "
                    "pass --no-api to train without reporting. Nothing was trained") from None
    except ApiError as exc:
        if exc.status_code in (401, 403):
            raise _fail(f"the registry at {settings.api_url} refused the token ({exc.detail}); "
                        "set CRUCIBLE_API_TOKEN to a write token (`crucible api token create`)"
                        ) from None
        raise _fail(f"the registry at {settings.api_url} refused the run: {exc}") from None
    typer.echo(f"run page: {reported.page} (registry run {reported.run_id})")
    return reported


def _train_reported(reported, train_fn):  # noqa: ANN001, ANN202 - StandaloneRun, a callable
    """`train_fn()`; when the run is reported, a run that raises is recorded failed (cancelled
    on Ctrl-C) with its reason before the error goes on."""
    if reported is None:
        return train_fn()
    from crucible.registry.reporting import describe

    try:
        return train_fn()
    except KeyboardInterrupt:
        reported.end("cancelled", "interrupted (Ctrl-C)")
        raise
    except BaseException as exc:
        reported.end("failed", describe(exc))
        raise


def _summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The run's headline numbers from its summary.json, as (what, value) rows."""
    def loss(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    stderr = summary["val_loss_stderr"]
    final = loss(summary["final_val_loss"]) + ("" if stderr is None else f" +- {stderr:.4f} s.e.")
    initial = summary["initial_val_loss"]   # None: train.eval_initial=false, no row
    return [*([] if initial is None else [("initial val loss", loss(initial))]),
            ("final val loss", final),
            ("tokens processed", f"{summary['tokens_processed']:,}"),
            ("failures", str(len(summary["faults"]))),
            ("bytes uploaded", f"{summary['bytes']['upload']:,}"),
            ("wall time", f"{summary['wall_s']:.1f} s")]


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("value", no_wrap=True, justify="right")
    for row in _summary_rows(summary):
        table.add_row(*row)
    Console().print(table)


# what `train()` writes into its folder; any of the first four means the folder holds a run
_RUN_MARKERS = ("run.json", "summary.json", "metrics.jsonl", "events.jsonl")
_RUN_FILES = (*_RUN_MARKERS, "model.pt", "val_windows.pt", "registry.json")


def _new_run_dir(preset: str) -> Path:
    """A new folder runs/<UTC time>-<preset>, created here so that two runs started in the same
    second get two folders (-2, -3, ... after the second)."""
    from datetime import UTC, datetime

    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%SZ")
    Path("runs").mkdir(exist_ok=True)
    for n in range(1, 1000):
        path = Path("runs") / (f"{stamp}-{preset}" + ("" if n == 1 else f"-{n}"))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise _fail(f"runs/{stamp}-{preset}-1..999 all exist; pass --out with a new folder")


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _check_run_folder(out: Path, config_json: str, *, resume: bool, overwrite: bool) -> None:
    """Refuse (exit 2) an --out that would mix two runs: one holding another run without
    --resume or --overwrite, or a --resume whose configuration differs from the run's
    (the checkpoint check in `train()` only covers a run that wrote a checkpoint)."""
    from crucible.checkpoint import same_configuration

    held = [name for name in _RUN_MARKERS if (out / name).exists()] if out.is_dir() else []
    if not held or overwrite:
        return
    if not resume:
        raise _fail(f"--out='{out}' already holds a run ({', '.join(held)}); continue it with "
                    "--resume, replace it with --overwrite, or pass another --out")
    recorded = None
    for name in ("run.json", "summary.json"):   # older runs: the config only in summary.json
        record = _read_json(out / name)
        if record is not None and isinstance(record.get("config"), dict):
            recorded = json.dumps(record["config"])
            break
    if recorded is not None and not same_configuration(recorded, config_json):
        raise _fail(f"--out='{out}' holds a run with a different configuration; --resume it with "
                    "the same preset and --set values, replace it with --overwrite, or pass "
                    "another --out")


def _clear_run_folder(out: Path) -> None:
    """Delete what a run wrote into `out` (--overwrite): its records, model and its local store
    folder when that lies inside `out`. Other files in `out` are left alone."""
    import shutil
    from urllib.parse import unquote, urlparse

    from crucible.config import ConfigError
    from crucible.ids import validate_id

    for name in ("run.json", "summary.json"):
        record = _read_json(out / name) or {}
        url, key = record.get("store_url"), record.get("run_key")
        if not (isinstance(url, str) and url.startswith("file://") and isinstance(key, str)):
            continue
        try:
            key = validate_id(key, field=f"run_key in {out / name}")
        except ConfigError:   # an edited key: never a path to delete
            continue
        root = Path(unquote(urlparse(url).path)).resolve()
        if root.is_relative_to(out.resolve()) and root != out.resolve():
            shutil.rmtree(root / key, ignore_errors=True)
            if root.is_dir() and not any(root.iterdir()):
                root.rmdir()
    for name in _RUN_FILES:
        (out / name).unlink(missing_ok=True)


def _store_failure(exc: Exception, endpoint_url: str | None, out: Path) -> str:
    """One line for a store that failed: what failed, where (the S3Store in the message names
    bucket and prefix), and how to go on."""
    endpoint = endpoint_url or "the default AWS endpoint"
    where = f" (endpoint {endpoint})" if "s3://" in str(exc) else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"object store failed{where}: {first}. Checkpoints already written are kept: fix "
            f"the store, then `crucible run --resume --out {out}` with the same preset and "
            "--set values continues from the last one")


def _rescore(fn, run_dir: Path, eval_tokens: int | None,  # noqa: ANN001 - a bypass function
             as_json: bool) -> dict | None:
    """Run a re-scoring of a finished run (exit 2 on bad input); print JSON and return None
    with `as_json`, else return the result for the caller's table."""
    _setup_logging()
    from crucible.config import ConfigError

    if eval_tokens is not None and eval_tokens < 0:
        raise _fail(f"--eval-tokens must be >= 0 (0 scores the whole held-out split), got "
                    f"{eval_tokens}")
    try:
        result = fn(run_dir, eval_tokens=eval_tokens)
    except (ConfigError, ValueError) as exc:   # ValueError: e.g. a cuda run on a CPU host
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return None
    return result


@app.command("launch", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(ctx: typer.Context) -> None:
    """A distributed run: one process per replica under torch.distributed.elastic, exchanging
    SparseLoCo contributions only through the store, with planned SIGKILLs (`crucible launch
    --help`; docs/OPERATIONS.md, "Distributed mode")."""
    from cli.launch import launch_main

    raise typer.Exit(launch_main(list(ctx.args)))


@app.command("evaluate")
def evaluate_cmd(
        run_dir: Path = typer.Argument(..., help="the --out folder of a finished `crucible run`"),
        eval_tokens: int | None = typer.Option(None, "--eval-tokens",
                                               help="held-out tokens to score (0 = the whole "
                                                    "held-out split; default: the run's own)"),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
        ) -> None:
    """Re-score a finished run's final model on the held-out set: loss, its standard error,
    tokens scored and seconds taken."""
    from crucible.bypass import evaluate_run

    result = _rescore(evaluate_run, run_dir, eval_tokens, as_json)
    if result is None:
        return
    spread = ("" if result["val_loss_stderr"] is None else
              f" +- {result['val_loss_stderr']:.5f} s.e. ({result['stderr_pct']:.3f}% of it)")
    typer.echo(f"{run_dir}: val loss {result['val_loss']:.4f}{spread} on "
               f"{result['eval_tokens']} held-out tokens in {result['eval_s']:.1f} s")


@app.command("bypass-damage")
def bypass_damage_cmd(
        run_dir: Path = typer.Argument(..., help="the --out folder of a finished `crucible run`"),
        eval_tokens: int | None = typer.Option(None, "--eval-tokens",
                                               help="held-out tokens to score (default: the "
                                                    "run's train.eval_tokens)"),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
        ) -> None:
    """Instant damage of skipping each inner stage of a trained model (forward only), for every
    way the next stage can read the bypassed message (MAPL: identity, sender, receiver)."""
    from crucible.bypass import bypass_damage

    result = _rescore(bypass_damage, run_dir, eval_tokens, as_json)
    if result is None:
        return
    codec = result["config"]["pipeline"]["compression"]
    typer.echo(f"{run_dir}: codec {codec}, intact val loss {result['intact']:.4f} on "
               f"{result['eval_tokens']} held-out tokens")
    typer.echo("stage  decode     val loss   damage (+- 1 s.e.)")
    for row in result["rows"]:
        typer.echo(f"{row['stage']:>5}  {row['decode']:<9} {row['val_loss']:9.4f}   "
                   f"{row['damage_pct']:+7.2f}%"
                   + ("" if row["damage_stderr_pct"] is None
                      else f" (+- {row['damage_stderr_pct']:.2f})"))


def _register_packages() -> None:
    import importlib

    for module in ("api.cli", "cli.flows", "cli.report"):
        importlib.import_module(module).register(app)
    from cli.study import register as register_study  # crucible study run|render

    register_study(app)
    from cli.cost import register as register_cost  # crucible cost

    register_cost(app)


def main() -> None:
    _register_packages()
    app()


if __name__ == "__main__":
    main()
