"""`crucible cost RUN_OR_SWEEP --deployment FILE`: what a run (or every run of a sweep) would
cost on a deployment (crucible.pricing.cost, crucible.pricing.cost_sweep), printed as a table,
written as `cost.json` beside each run's `summary.json` (atomically) and, with a registry configured
(`--api` or CRUCIBLE_API_URL), sent to it (`PUT /api/v1/runs/{id}/costs/{deployment}`).

RUN_OR_SWEEP is a run folder (it holds summary.json), a sweep folder (run folders inside it;
`costs.json` with the sweep's record is written there), a study's results folder
(results/NAME: one summary per cell, priced and printed, nothing written beside the committed
data), a study spec (studies/NAME.toml: its results folder) or, with a registry configured and
no such path here, a registry sweep's name or id, or a run's id (the summaries the registry
holds; the records go back to it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["register"]

MAX_SUMMARY_BYTES = 64 * 1024 * 1024


def _read(path: Path) -> dict[str, Any] | None:
    try:
        if path.stat().st_size > MAX_SUMMARY_BYTES:
            return None
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and "config" in value else None


def _runs(path: Path) -> tuple[str, list[tuple[str, Path | None, dict[str, Any], str]]]:
    """(kind, [(name, run folder or None, summary, label)]) of RUN_OR_SWEEP; raises ValueError
    with the fix when it is none of the four."""
    if path.is_file() and path.suffix == ".toml":
        from crucible.study.data import StudyData
        from crucible.study.runner import load_results
        from crucible.study.spec import StudyError, load_spec

        try:
            spec = load_spec(path)
            data = StudyData(spec, load_results(spec))
        except StudyError as exc:
            raise ValueError(str(exc)) from None
        return "study", [(f"{key.name}-s{seed}", None, summary, key.label)
                         for key in data.keys for seed, summary in sorted(data.runs(key).items())]
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder; pass a run folder (with summary.json), a "
                         "sweep folder of run folders, results/NAME or studies/NAME.toml")
    own = _read(path / "summary.json")
    if own is not None:
        return "run", [(path.name, path, own, "")]
    found = []
    for child in sorted(p for p in path.iterdir() if p.is_dir()):
        summary = _read(child / "summary.json")
        if summary is not None:
            found.append((child.name, child, summary, ""))
    if found:
        return "sweep", found
    files = [(p.stem, None, s, "") for p in sorted(path.glob("*.json"))
             for s in [_read(p)] if s is not None]
    if files:
        return "results", files
    raise ValueError(f"{path}: holds no summary.json, no run folder with one and no result "
                     "files; pass the --out folder of a finished run or a folder of them")


def _money(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:,.4f} {unit}" if value < 1 else \
        f"{value:,.2f} {unit}"


def _print_runs(priced: list[tuple[str, dict[str, Any]]], deployment: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cost on {deployment.name} ({deployment.pricing.replace('_', ' ')}, "
                        f"{deployment.price_per_hour:g} {deployment.currency} per "
                        "accelerator-hour)")
    for name in ("run", "strategy", "p", "final val loss", "wall-clock", "measured",
                 "waits", "accelerator-h", "busy", "cost"):
        table.add_column(name, justify="left" if name in ("run", "strategy") else "right",
                         no_wrap=True)
    for name, cost in priced:
        faults = cost["_config"]["faults"]
        measured = cost.get("measured_wall_s")
        loss = cost.get("final_val_loss")
        table.add_row(name, str(faults.get("strategy")), f"{faults.get('p', 0):g}",
                      "-" if loss is None else f"{loss:.4f}", f"{cost['wall_s']:,.1f} s",
                      "-" if measured is None else f"{measured:,.1f} s",
                      f"{cost['breakdown_s']['wait_s']:,.0f} s",
                      f"{cost['accelerator_hours']:,.3f}", f"{100 * cost['busy_fraction']:.0f}%",
                      _money(cost["cost"], cost["currency"]))
    Console(width=160).print(table)


def _print_sweep(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from crucible.grid.key import BASELINE_NAME

    unit = record["currency"]
    table = Table(title="per cell (means over seeds)")
    for name in ("arm", "strategy", "variant", "p", "n", "cost", "final val loss",
                 "baseline's loss reached", "loss on the baseline's budget"):
        table.add_column(name, no_wrap=True)
    for cell in record["cells"]:
        target = cell["target"]
        reached = ("-" if cell["strategy"] == BASELINE_NAME else
                   f"{target['reached']} of {target['of']}"
                   + (f", {_money(target['cost']['mean'], unit)}" if target["reached"] else ""))
        at_budget = cell["loss_at_budget"]["mean"]
        table.add_row(cell["arm"], cell["strategy"], cell["label"] or "-", f"{cell['p']:g}",
                      str(cell["cost"]["n"]), _money(cell["cost"]["mean"], unit),
                      f"{cell['final_val_loss']['mean']:.4f}", reached,
                      "-" if at_budget is None else f"{at_budget:.4f}")
    console = Console(width=160)
    console.print(table)
    for row in record["cheapest"]:
        where = f"{row['arm']}{' ' + row['label'] if row['label'] else ''}, p = {row['p']:g}"
        if row["strategy"] is None:
            console.print(f"cheapest at {where}: none priced")
        elif row["by"] == "target":
            console.print(f"cheapest at {where}: {row['strategy']} "
                          f"({_money(row['cost'], unit)} to the baseline's loss)")
        else:
            console.print(f"cheapest at {where}: {row['strategy']} (no strategy reaches the "
                          f"baseline's loss in every seed; lowest loss on the baseline's "
                          f"budget, {row['loss_at_budget']:.4f})")


def _client(api_url: str) -> Any:
    from crucible.registry.client import ApiClient
    from crucible.registry.settings import ClientSettings

    settings = ClientSettings(api_url=api_url)
    return ApiClient(settings.api_url, settings.token)


def _registry_runs(api_url: str, ref: str) -> tuple[list[tuple[str, None, dict[str, Any], str]],
                                                    dict[str, str]]:
    """The finished runs of registry sweep `ref` (id or name), or the one run `ref`, with the
    summaries the registry holds; and their names -> run ids. Raises ValueError, ApiError."""
    from crucible.registry.client import ApiError, ApiUnavailable

    with _client(api_url) as client:
        try:
            runs = client.list_runs(sweep_id=client.get_sweep(ref)["id"])
        except ApiUnavailable:
            raise
        except ApiError:
            try:
                runs = [client.get_run(ref)]
            except ApiUnavailable:
                raise
            except ApiError:
                raise ValueError(f"{ref}: no such folder, and no sweep or run of that name or "
                                 f"id in the registry at {api_url}") from None
    found, ids = [], {}
    for run in runs:
        if not run.get("summary"):
            continue
        name = run.get("name") or run["id"]
        summary = {"config": run["config"], **run["summary"]}
        found.append((name, None, summary, run.get("label") or ""))
        ids[name] = run["id"]
    if not found:
        raise ValueError(f"{ref}: no run of it in the registry has a summary yet (finished runs "
                         "only)")
    return found, ids


def _post(api_url: str, priced: list[tuple[str, Path | None, str | None, dict[str, Any]]]
          ) -> list[str]:
    """Send each run's record to the registry: (name, folder, run id) where the id is known or
    the folder's registry.json names a run of this API; returns the lines to print. Raises
    ApiError / ApiUnavailable."""
    lines = []
    with _client(api_url) as client:
        for name, folder, run_id, cost in priced:
            run_id = run_id or _read_registry(folder, client.base_url)
            if run_id is None:
                lines.append(f"{folder or name}: not a registry run of {api_url}: not sent")
                continue
            client.put_run_cost(run_id, cost)
            lines.append(f"{folder or name}: sent to registry run {run_id}")
    return lines


def _read_registry(folder: Path | None, api_url: str) -> str | None:
    if folder is None:
        return None
    try:
        record = json.loads((folder / "registry.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("api_url", "").rstrip("/") != api_url:
        return None
    return str(record.get("run_id")) if record.get("run_id") else None


def register(app: Any) -> None:
    """Add `crucible cost` to the `crucible` command line."""
    import typer

    @app.command("cost")
    def cost_cmd(
        target: Path = typer.Argument(..., metavar="RUN_OR_SWEEP",
                                      help="a run folder, a sweep folder of run folders, "
                                           "results/NAME, studies/NAME.toml, or with --api a "
                                           "registry sweep (name or id) or run id"),
        deployment_path: Path = typer.Option(..., "--deployment",
                                             help="a deployment file, e.g. "
                                                  "infra/deployments/cloud-8x4-spot.toml"),
        as_json: bool = typer.Option(False, "--json", help="print the records as JSON"),
        write: bool = typer.Option(True, "--write/--no-write",
                                   help="write cost.json beside each summary.json (and "
                                        "costs.json in a sweep folder)"),
        api_url: str | None = typer.Option(None, "--api", envvar="CRUCIBLE_API_URL",
                                           help="also send each run's record to this registry"),
        no_api: bool = typer.Option(False, "--no-api", help="do not send to the registry"),
    ) -> None:
        """What a run, or every run of a sweep, would cost on a deployment: wall-clock,
        accelerator-hours (idle and waiting accelerators count) and money, from what the runs
        recorded; for a sweep also the time and money to the no-failure baseline's loss and
        the cheapest strategy at each p (docs/OPERATIONS.md, "Cost of a run")."""
        from crucible.pricing.cost import CostError, run_cost
        from crucible.pricing.cost_sweep import CostRow, cell_key, sweep_costs
        from crucible.pricing.deployment import DeploymentError, load_deployment
        from crucible.runfiles import write_json_atomic

        def fail(message: str) -> typer.Exit:
            typer.echo(f"error: {message}", err=True)
            return typer.Exit(code=2)

        from crucible.registry.client import ApiError, ApiUnavailable

        ids: dict[str, str] = {}
        try:
            deployment = load_deployment(deployment_path)
            if not target.exists() and api_url and not no_api:
                kind = "registry"
                runs, ids = _registry_runs(api_url, str(target))
            else:
                kind, runs = _runs(target)
        except (DeploymentError, ValueError) as exc:
            raise fail(str(exc)) from None
        except ApiUnavailable as exc:
            raise fail(f"cannot reach the registry at {api_url} ({exc.detail})") from None
        except ApiError as exc:
            raise fail(f"the registry at {api_url} refused: {exc}") from None
        priced = []
        for name, folder, summary, label in runs:
            try:
                cost = run_cost(summary, deployment)
            except CostError as exc:
                raise fail(f"{folder or name}: {exc}") from None
            priced.append((name, folder, summary, label, cost))
        record = None
        if kind != "run":
            record = sweep_costs(CostRow(key=cell_key(summary, label),
                                         seed=int(summary.get("seed", 0)), name=name, cost=cost)
                                 for name, _, summary, label, cost in priced)
        if write and kind in ("run", "sweep"):
            for _, folder, _, _, cost in priced:
                write_json_atomic(folder / "cost.json", cost)
            if record is not None:
                write_json_atomic(target / "costs.json", record)
        if as_json:
            typer.echo(json.dumps(record if record is not None else priced[0][4], indent=2,
                                  sort_keys=True))
        else:
            _print_runs([(name, {**cost, "_config": summary["config"]})
                         for name, _, summary, _, cost in priced], deployment)
            if record is not None:
                _print_sweep(record)
            if write and kind in ("run", "sweep"):
                typer.echo(f"wrote {len(priced)} cost.json"
                           + (f" and {target / 'costs.json'}" if record is not None else ""))
        if api_url and not no_api and kind in ("run", "sweep", "registry"):
            try:
                for line in _post(api_url, [(name, folder, ids.get(name), cost)
                                            for name, folder, _, _, cost in priced]):
                    typer.echo(line)
            except ApiUnavailable as exc:
                raise fail(f"cannot reach the registry at {api_url} ({exc.detail}); the costs "
                           "are written locally; run again when it is up, or pass --no-api"
                           ) from None
            except ApiError as exc:
                raise fail(f"the registry at {api_url} refused the costs: {exc}") from None
