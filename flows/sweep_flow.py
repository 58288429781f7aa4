"""The `failure-sweep` flow: a grid of `train-run`s compared against their p = 0 baselines.

Recipe: resolve every cell's config (a bad one fails the sweep before anything is written) ->
register the sweep (or continue the one with the same name and spec: tags and notes aside, see
`SweepSpec.identity`) and every cell's run, with the sweep's tags -> post a link to the sweep's
dashboard page -> run the cells, at most `max_concurrent_runs` at a time, in this flow run or as
runs of the `train-run` deployment (each cell also waits for a GPU slot on its host), with a live
progress bar -> with `max_seeds`, rounds of seeds by precision (seeds added to every cell whose paired 95%
half-width is above `target_half_width`, widest first, until each meets it or has `max_seeds`)
-> post the robustness table (its columns are the REST names of
`GET /api/v1/sweeps/{id}/robustness`) and the claims table (`GET /api/v1/sweeps/{id}/claims`,
`crucible.stats.claim_rows`) as Prefect artifacts.

Names in Prefect: the sweep's flow run is named after the sweep (`spec.name`, also for a run
started from the UI's form); each cell's flow run, in this process or of the deployment, is named
`<sweep> · <cell label>` (as is its run in the registry) and tagged `sweep:<name>`,
`sweep-id:<first 8 of the sweep id>`, `cell:<label>`, `arm:<arm>`, `strategy:<strategy or
baseline>`, `p:<p>`, plus `tag:<t>` for each of the sweep's tags, so the Prefect UI's runs list
filters by sweep or cell. The sweep's own flow run gets the `sweep:`, `sweep-id:` and `tag:` tags.

Re-running a sweep skips every cell whose run already completed with the same resolved config
(fingerprint) and code version, and resumes the others from their checkpoints.

Spools: the sweep replays the work folder's spools when it starts (a run whose records arrive
now is completed, and then skipped) and again after its cells (a cell that ended owing records
to an unreachable registry may be complete by then). A cell whose run still owes records counts
as neither completed nor failed: the outcome's "owed", and the registry shows it as running,
left out of the robustness numbers, until the next replay delivers them.

Cancel and crash: the flow's `on_cancellation` / `on_crashed` / `on_failure` hooks record the
sweep `cancelled` / `failed` / `failed`; on cancel and crash every cell without a final state
(pending, queued or running) becomes `cancelled` / `failed` too, and the GPU slots of its cells'
flow runs on this host are released at once (see `flows.run_flow.end_flow_runs`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_client, get_run_logger, task
from prefect import tags as prefect_tags
from prefect.artifacts import (
    create_link_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run as runtime_flow_run

from crucible.config import Config, ConfigError
from crucible.grid.cells import Cell, extra_cells
from crucible.grid.names import FINAL_STATUSES
from crucible.grid.spec import ANNOTATIONS, SweepSpec, identity_of
from crucible.registry.client import ApiError, ApiUnavailable
from crucible.registry.connect import make_client, sweep_page
from crucible.registry.identity import code_version, config_fingerprint
from crucible.registry.reporting import describe
from crucible.stats import claim_rows, robustness, seeds_wanted
from flows.errors import retry_only_transient
from flows.processes import end_prefect_flow_runs, flow_process
from flows.run_flow import drain_spools, end_flow_runs, resolve_config, train_run
from flows.settings import FlowSettings
from flows.study_results import (
    finished,
    has_result,
    keep_all,
    keep_study_result,
    keeper,
    seeded_key,
    with_result_files,
)

__all__ = ["failure_sweep", "find_sweep", "extra_cells", "TRAIN_RUN_DEPLOYMENT", "robustness_rows",
           "ROBUSTNESS_COLUMNS", "cell_run_name", "cell_tags"]

_log = logging.getLogger(__name__)

TRAIN_RUN_DEPLOYMENT = "train-run/train-run"
_MAX_RUN_NAME = 200         # api.schemas.RunCreate.name
_NAME_JOIN = " · "
# the robustness table artifact's columns: the REST names (api.analysis_schemas.RobustnessItem)
# without the per-seed lists, so the artifact, the API and the dashboards' CSVs agree
ROBUSTNESS_COLUMNS = ("compression", "strategy", "label", "duration", "p", "mean_pct",
                      "ci_low_pct", "ci_high_pct", "n_seeds")


@dataclass
class _Planned:
    """A cell with its resolved config and registry record."""

    cell: Cell
    overrides: list[str]
    config: Config
    fingerprint: str
    run_id: str | None = None
    done: bool = False


def _plan(spec: SweepSpec, settings: FlowSettings,
          cells: list[Cell] | None = None) -> list[_Planned]:
    """Resolve every cell's config up front (default: the spec's grid); raises ConfigError
    before anything is registered."""
    store = spec.store_url or settings.store_url
    planned: list[_Planned] = []
    for cell in spec.cells() if cells is None else cells:
        overrides = cell.overrides(spec)
        config = resolve_config(spec.preset, overrides, store, settings.s3_endpoint_url)
        planned.append(_Planned(cell, overrides, config, config_fingerprint(config)))
    try:
        spec.refuse_duplicates((p.cell, p.fingerprint) for p in planned)
    except ValueError as exc:
        raise ConfigError(f"spec.{exc}") from None
    return planned


def _items(result: Any) -> list[dict[str, Any]]:
    """List responses may be a page `{"items": [...]}` or a plain list."""
    return list(result["items"]) if isinstance(result, dict) else list(result)


@task(name="register-sweep", retries=3, retry_delay_seconds=[1, 5, 20],
      retry_condition_fn=retry_only_transient, cache_policy=NO_CACHE)
def register_sweep(spec: SweepSpec, planned: list[_Planned],
                   settings: FlowSettings) -> tuple[str, dict[str, tuple[str, bool]]]:
    """Create (or continue) the sweep record and one run record per cell that has none yet.

    Returns the sweep id and, per fingerprint, (run id, already completed): a cell whose run
    completed with the same fingerprint and code version is not run again.
    """
    with make_client(settings) as client:
        return _register(client, spec, planned)


def _register(client: Any, spec: SweepSpec,
              planned: list[_Planned]) -> tuple[str, dict[str, tuple[str, bool]]]:
    tags = list(spec.tags)
    sweep_id = find_sweep(client, spec.name, spec.identity())
    stored = spec.model_dump(mode="json")
    if sweep_id is None:
        sweep_id = str(client.create_sweep(spec.name, stored, tags=tags,
                                           notes=spec.notes)["id"])
    flow_run_id = str(runtime_flow_run.id) if runtime_flow_run.id else None
    # a re-run continues the sweep: its tags are added, its notes (if any) replace the old ones,
    # and what the claims read (margins, target, references, claims) is this run's
    annotations = {**({"add_tags": tags} if tags else {}),
                   **({"notes": spec.notes} if spec.notes else {}),
                   "spec_annotations": {k: stored[k] for k in ANNOTATIONS
                                        if k in stored and k not in ("tags", "notes")}}
    client.update_sweep(sweep_id, status="running", prefect_flow_run_id=flow_run_id,
                        **annotations)
    version = code_version()
    known = {run["config_hash"]: run for run in _items(client.list_runs(sweep_id=sweep_id))
             if run.get("code_version") == version}
    records: dict[str, tuple[str, bool]] = {}
    for item in planned:
        run = known.get(item.fingerprint)
        if run is None:
            run = client.create_run(config=item.config.to_dict(), sweep_id=sweep_id,
                                    name=cell_run_name(spec, item.cell),
                                    config_hash=item.fingerprint, code_version=version,
                                    tags=tags, label=item.cell.key.label)
        elif not set(tags) <= set(run.get("tags") or []):
            client.update_run(str(run["id"]), add_tags=tags)
        records[item.fingerprint] = (str(run["id"]), run.get("status") == "completed")
    return sweep_id, records


def find_sweep(client: Any, name: str, identity: dict[str, Any]) -> str | None:
    """The newest sweep with this exact name and spec identity (`SweepSpec.identity()`: tags
    and notes aside), so a re-run continues it."""
    found, cursor = None, None
    while True:  # sweeps come oldest first, keyset-paginated; `name` keeps those containing it
        page = client.request("GET", "/api/v1/sweeps",
                              params={"limit": 100, "cursor": cursor, "name": name})
        for sweep in page["items"]:
            stored = identity_of(sweep.get("spec") or {})
            if sweep.get("name") == name and stored == identity:
                found = str(sweep["id"])
        cursor = page.get("next_cursor")
        if cursor is None:
            return found


def cell_run_name(spec: SweepSpec, cell: Cell) -> str:
    """The name of a cell's Prefect flow run and registry run: `<sweep> · <cell label>`, the
    sweep's name shortened (ending in "…") where the whole would pass the registry's 200
    characters for a run's name."""
    room = _MAX_RUN_NAME - len(_NAME_JOIN) - len(cell.label)
    sweep = spec.name if len(spec.name) <= room else spec.name[:room - 1] + "…"
    return f"{sweep}{_NAME_JOIN}{cell.label}"


def cell_tags(spec: SweepSpec, sweep_id: str, cell: Cell) -> list[str]:
    """The Prefect tags of a cell's flow run (module docstring). Prefect 3 puts no rule on a
    tag's characters or length; these stay on one line as the sweep's name does."""
    return [f"sweep:{spec.name}", f"sweep-id:{sweep_id[:8]}", f"cell:{cell.label}",
            f"arm:{cell.arm}", f"strategy:{cell.strategy or 'baseline'}", f"p:{cell.p:g}",
            *(f"tag:{tag}" for tag in spec.tags)]


def _sweep_tags(spec: SweepSpec, sweep_id: str) -> list[str]:
    return [f"sweep:{spec.name}", f"sweep-id:{sweep_id[:8]}", *(f"tag:{t}" for t in spec.tags)]


def _sweep_run_name() -> str:
    """The sweep flow run's name: its sweep's (`flow_run_name` runs before the flow body, with
    the validated parameters, also for a deployment run started from the UI's form)."""
    context = FlowRunContext.get()
    spec = (context.parameters if context else {}).get("spec")
    if isinstance(spec, SweepSpec):
        return spec.name
    if isinstance(spec, dict) and isinstance(spec.get("name"), str):
        return spec["name"]
    return SweepSpec().name


@task(name="run-cell", cache_policy=NO_CACHE)
def run_cell(label: str, preset: str, overrides: list[str], sweep_id: str, run_id: str,
             store_url: str | None, use_deployment: bool, *, flow_run_name: str | None = None,
             tags: list[str] | None = None, alignment: bool = False) -> dict[str, Any]:
    """Run one cell to its end in a flow run named `flow_run_name` (default: `label`) with the
    Prefect `tags` (`alignment`: the run records its alignment report); returns {run_id, status, reason} and never raises for a failed run (the run
    flow has already retried what was worth retrying and recorded the reason)."""
    parameters = {"preset": preset, "overrides": overrides, "sweep_id": sweep_id,
                  "run_id": run_id, "store_url": store_url, "alignment": alignment}
    name = flow_run_name or label
    if use_deployment:
        from prefect.deployments import run_deployment

        flow_run = run_deployment(TRAIN_RUN_DEPLOYMENT, parameters=parameters, timeout=None,
                                  flow_run_name=name, tags=tags or [])
        ok = flow_run.state is not None and flow_run.state.is_completed()
        reason = None if ok else (flow_run.state.message if flow_run.state else "no state")
        cancelled = flow_run.state is not None and flow_run.state.is_cancelled()
        status = "completed" if ok else "cancelled" if cancelled else "failed"
        return {"run_id": run_id, "status": status, "reason": reason}
    try:
        # a subflow run takes the tags of its context; a callable name is not a format template
        # (a sweep named "exp{1}" stays as it is)
        with prefect_tags(*(tags or [])):
            return train_run.with_options(flow_run_name=lambda: name)(**parameters)
    except Exception as exc:  # recorded in the registry by the run flow; the sweep goes on
        get_run_logger().warning("cell %s failed: %s", label, describe(exc))
        return {"run_id": run_id, "status": "failed", "reason": describe(exc)}


def _run_cells(spec: SweepSpec, sweep_id: str, todo: list[_Planned], settings: FlowSettings,
               on_done: Any) -> list[dict[str, Any]]:
    """Submit cells keeping at most `spec.max_concurrent_runs` in flight; `on_done(result)` is
    called as each finishes."""
    store = spec.store_url or settings.store_url
    queue = list(todo)
    in_flight: list[PrefectFuture[dict[str, Any]]] = []
    results: list[dict[str, Any]] = []
    while queue or in_flight:
        while queue and len(in_flight) < spec.max_concurrent_runs:
            item = queue.pop(0)
            in_flight.append(run_cell.with_options(task_run_name=f"cell {item.cell.label}").submit(
                item.cell.label, spec.preset, item.overrides, sweep_id, item.run_id, store,
                spec.use_deployment, flow_run_name=cell_run_name(spec, item.cell),
                tags=cell_tags(spec, sweep_id, item.cell),
                # a study's baselines: the alignment hypothesis is tested on their reports
                alignment=spec.files is not None and item.cell.strategy is None))
        finished = next(as_completed(in_flight))
        in_flight.remove(finished)
        result = finished.result()
        results.append(result)
        on_done(result)
    return results


def robustness_rows(robustness: dict[str, Any]) -> list[dict[str, Any]]:
    """The robustness summary (`GET /api/v1/sweeps/{id}/robustness`) as table rows with the
    REST field names (`ROBUSTNESS_COLUMNS`): one per arm x strategy x p > 0 (a baseline's
    increase against itself is 0 by definition), percentages rounded to 3 decimals."""
    def pct(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    rows = []
    for item in robustness.get("items", []):
        if item["p"] == 0:
            continue
        row = {column: item[column] for column in ROBUSTNESS_COLUMNS}
        rows.append({**row, "mean_pct": pct(row["mean_pct"]),
                     "ci_low_pct": pct(row["ci_low_pct"]), "ci_high_pct": pct(row["ci_high_pct"])})
    return sorted(rows, key=lambda r: (r["compression"], r["strategy"], r["p"]))


def _artifact_key(sweep_id: str, what: str) -> str:
    # artifact keys allow lowercase letters, digits and dashes only
    return f"sweep-{sweep_id[:8]}-{what}".lower()


def _sweep_of(client: Any, flow_run_id: str) -> dict[str, Any] | None:
    """The sweep record that flow run `flow_run_id` registered (the newest, if several)."""
    found, cursor = None, None
    while True:
        page = client.request("GET", "/api/v1/sweeps", params={"limit": 100, "cursor": cursor})
        found = next((s for s in reversed(page["items"])
                      if s.get("prefect_flow_run_id") == flow_run_id), found)
        cursor = page.get("next_cursor")
        if cursor is None:
            return found


def _end_sweep(flow_run: Any, state: Any, *, status: str, lead: str, cells: bool) -> None:
    """Record the sweep of `flow_run` as `status` unless it has a final state; with `cells`,
    end its unfinished cells the same way and release their GPU slots."""
    settings = FlowSettings()
    reason = (f"{lead}: {state.message}" if state.message else lead)[:4000]
    with make_client(settings) as client:
        sweep = _sweep_of(client, str(flow_run.id))
        if sweep is None:                       # ended before it registered anything
            return
        runs = _items(client.list_runs(sweep_id=str(sweep["id"]))) if cells else []
        if sweep.get("status") not in FINAL_STATUSES:
            client.update_sweep(str(sweep["id"]), status=status)
    if cells:
        cell_flow_runs = [str(r["prefect_flow_run_id"]) for r in runs
                          if r.get("prefect_flow_run_id")]
        end_flow_runs(settings, [str(flow_run.id), *cell_flow_runs], runs, status, reason)
        # the cells' flow runs ran in the sweep's process (or its deployment runs were
        # orphaned): nobody else ends them in Prefect
        end_prefect_flow_runs(cell_flow_runs, cancelled=status == "cancelled", reason=reason)


def _on_cancelled(flow: Any, flow_run: Any, state: Any) -> None:
    _end_sweep(flow_run, state, status="cancelled", lead="sweep cancelled", cells=True)


def _on_crashed(flow: Any, flow_run: Any, state: Any) -> None:
    _end_sweep(flow_run, state, status="failed", lead="sweep crashed", cells=True)


def _on_failed(flow: Any, flow_run: Any, state: Any) -> None:
    # the cells recorded their own outcome; only a sweep that failed before its end stays open
    _end_sweep(flow_run, state, status="failed", lead="sweep failed", cells=False)


@flow(name="failure-sweep", flow_run_name=_sweep_run_name, log_prints=False,
      validate_parameters=True, on_cancellation=[_on_cancelled], on_crashed=[_on_crashed],
      on_failure=[_on_failed])
def failure_sweep(spec: SweepSpec = SweepSpec()) -> dict[str, Any]:  # noqa: B008 - UI default
    """Run a failure-rate sweep (see `SweepSpec`) and post its robustness summary.

    Returns {sweep_id, runs, completed, failed, cancelled, owed, skipped, in_results, rows,
    precision_rounds} (cancelled: cells whose own flow run was cancelled; in_results: a
    study's cells not run because their result file exists; precision_rounds: per round of
    seeds by precision {round, cells, runs}, empty without `max_seeds`); the flow run fails
    (after posting the artifacts) if any cell failed.

    A study (`spec.files` set, as `crucible study run` does): cells whose result file
    `<results_dir>/<cell id>.json` exists are not run, and every cell whose run completes (or
    had completed) gets its slim summary written there (`crucible.study.runner.keep_result`).
    """
    settings = FlowSettings()
    flow_run_id = str(runtime_flow_run.id) if runtime_flow_run.id else None
    with flow_process(settings.work_dir, flow_run_id, "failure-sweep"):
        return _sweep(spec, settings)


def _sweep(spec: SweepSpec, settings: FlowSettings) -> dict[str, Any]:
    logger = get_run_logger()
    planned = _plan(spec, settings, spec.runs_now())
    in_results = len(planned)
    planned = [item for item in planned if not has_result(spec, item.cell)]
    in_results -= len(planned)
    drain_spools(settings)     # runs completed by this replay are skipped below
    sweep_id, records = register_sweep(spec, planned, settings)
    for item in planned:
        item.run_id, item.done = records[item.fingerprint]
        if item.done:
            keep_study_result(spec, item, settings)
    todo = [item for item in planned if not item.done]
    skipped = len(planned) - len(todo)
    logger.info("sweep %s: %d cells, %d already completed", sweep_id, len(planned), skipped)
    _tag_flow_run(_sweep_tags(spec, sweep_id))
    _post_dashboard_link(sweep_id, spec, settings)

    progress_id = create_progress_artifact(
        progress=100.0 * skipped / max(len(planned), 1),
        key=_artifact_key(sweep_id, "progress"),
        description=f"Cells of sweep {spec.name} finished ({len(planned)} in all)")
    finished = [skipped]
    keep = keeper(spec, {item.run_id: item for item in planned}, settings)

    def on_done(result: dict[str, Any]) -> None:
        finished[0] += 1
        update_progress_artifact(progress_id, 100.0 * finished[0] / len(planned))
        keep(result)

    results = _run_cells(spec, sweep_id, todo, settings, on_done)
    drain_spools(settings)     # cells that ended owing records may be complete now
    results = _registry_status(results, settings)
    if spec.files is not None:
        keep_all(spec, todo, settings)
    rounds: list[dict[str, Any]] = []
    # `run_seeds` / `run_cells`: the grid's other cells may still be to run; then no round, and
    # no "completed"
    partial = spec.partial and _cells_left(spec, sweep_id, settings) > 0
    if spec.max_seeds is not None and not partial \
            and not any(r["status"] == "failed" for r in results):
        rounds = _precision_rounds(spec, sweep_id, planned, settings)
        results += [r for item in rounds for r in item.pop("results")]
    failed = [r for r in results if r["status"] == "failed"]
    cancelled = [r for r in results if r["status"] == "cancelled"]   # one cell cancelled
    owed = [r for r in results if r["status"] not in FINAL_STATUSES]
    if owed:
        logger.warning("%d run(s) of sweep %s still owe records to the registry (%s); they "
                       "count once the next replay delivers them (`crucible api replay`)",
                       len(owed), sweep_id, ", ".join(r["run_id"] for r in owed[:5]))
    rows = _publish(sweep_id, spec, settings)
    with make_client(settings) as client:
        # with `run_seeds`, the grid's other cells are still to run: the sweep is not complete
        client.update_sweep(sweep_id, status="failed" if failed else
                            "pending" if partial else "completed")
    outcome = {"sweep_id": sweep_id,
               "runs": len(planned) + sum(item["runs"] for item in rounds),
               "completed": len(results) - len(failed) - len(owed) - len(cancelled),
               "failed": len(failed), "cancelled": len(cancelled), "owed": len(owed),
               "skipped": skipped, "in_results": in_results, "rows": rows,
               "precision_rounds": rounds}
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(planned)} cells of sweep {sweep_id} failed: "
                           + "; ".join(f"{r['run_id']}: {r['reason']}" for r in failed[:5]))
    return outcome


def _precision_rounds(spec: SweepSpec, sweep_id: str, planned: list[_Planned],
                      settings: FlowSettings) -> list[dict[str, Any]]:
    """Seeds by precision (`SweepSpec.max_seeds`): after each round, add seeds to the cells
    whose paired 95% half-width is above `target_half_width`, widest first, run them, and
    repeat until every cell meets the target or has `max_seeds` seeds; stops early when a cell
    of a round fails. Returns per round {round, cells, runs, results}."""
    logger = get_run_logger()
    rounds: list[dict[str, Any]] = []
    known = list(planned)
    for number in range(1, spec.max_seeds + 1):       # each round adds a seed to some cell
        with make_client(settings) as client:
            runs = _items(client.list_runs(sweep_id=sweep_id))
            merged = with_result_files(spec, runs)     # a study's seeds kept only as files count
            if merged is None:
                items = client.robustness(sweep_id)["items"]
            else:
                runs, items = merged, robustness(merged)["items"]
        wanted = seeds_wanted(items, target=spec.target_half_width, max_seeds=spec.max_seeds)
        cells = extra_cells(spec, wanted, runs)
        if not cells:
            break
        extra = _plan(spec, settings, cells)
        known += extra
        _, records = register_sweep(spec, known, settings)
        for item in extra:
            item.run_id, item.done = records[item.fingerprint]
        todo = [item for item in extra if not item.done and not has_result(spec, item.cell)]
        logger.info("sweep %s, precision round %d: %d cell(s) above ±%g points get seeds; "
                    "%d run(s)", sweep_id, number, len(wanted), spec.target_half_width,
                    len(todo))
        results = _run_cells(spec, sweep_id, todo, settings,
                             keeper(spec, {item.run_id: item for item in extra}, settings))
        drain_spools(settings)
        results = _registry_status(results, settings)
        rounds.append({"round": number, "cells": len(wanted), "runs": len(extra),
                       "results": results})
        if not todo or any(r["status"] != "completed" for r in results):
            break
    return rounds


def _cells_left(spec: SweepSpec, sweep_id: str, settings: FlowSettings) -> int:
    """Cells of the whole grid with neither a usable run in the sweep (nothing owed) nor a
    result file."""
    with make_client(settings) as client:
        runs = _items(client.list_runs(sweep_id=sweep_id))
    done = {seeded_key(run) for run in runs if finished(run)}
    return sum(1 for c in spec.cells() if (c.key, c.seed) not in done and not has_result(spec, c))


def _registry_status(results: list[dict[str, Any]],
                     settings: FlowSettings) -> list[dict[str, Any]]:
    """Each cell's result with the registry's status of its run (a failed cell stays failed):
    the flow's own view cannot know that a later replay completed a run, nor, for a cell run
    as a deployment, that its run still owes records."""
    with make_client(settings) as client:
        return [r if r["status"] in ("failed", "cancelled") else
                {**r, "status": client.get_run(r["run_id"])["status"]} for r in results]


def _tag_flow_run(tags: list[str]) -> None:
    """Add `tags` to this flow run (its tags are fixed when it is created, before the sweep
    it runs is known)."""
    flow_run_id = runtime_flow_run.id
    if not flow_run_id:
        return
    with get_client(sync_client=True) as prefect:
        current = prefect.read_flow_run(flow_run_id).tags
        prefect.update_flow_run(flow_run_id, tags=sorted({*current, *tags}))


def _post_dashboard_link(sweep_id: str, spec: SweepSpec, settings: FlowSettings) -> None:
    """Post the link to the sweep's dashboard page, live from the first cell on."""
    create_link_artifact(
        link=sweep_page(settings, sweep_id), link_text=f"Dashboard of {spec.name}",
        key=_artifact_key(sweep_id, "dashboard"),
        description="Live robustness dashboard of this sweep, served by the Crucible API.")


def _publish(sweep_id: str, spec: SweepSpec, settings: FlowSettings) -> list[dict[str, Any]]:
    """Post the robustness table; returns its rows."""
    with make_client(settings) as client:
        rows = robustness_rows(client.robustness(sweep_id))
        try:
            claims = claim_rows(client.claims(sweep_id))
        except ApiError as exc:   # 422: several failure durations, no one set of claims
            if isinstance(exc, ApiUnavailable) or exc.status_code != 422:
                raise
            get_run_logger().info("no claims table for sweep %s: %s", sweep_id, exc.detail)
            claims = []
    if claims:
        create_table_artifact(
            table=claims, key=_artifact_key(sweep_id, "claims"),
            description=f"Sweep {spec.name}: the blog's claims decided on paired 95% intervals "
                        "(points of the baseline's loss): verdict per claim, each comparison's "
                        "interval against the blog's value (reference), its half-width against "
                        "the target, and the seeds its measured sd says would settle it.")
    create_table_artifact(
        table=rows, key=_artifact_key(sweep_id, "robustness"),
        description=f"Sweep {spec.name}: mean relative validation-loss increase (%) against "
                    "each arm's own p = 0 baseline (mean_pct), 95% interval over seeds "
                    "(ci_low_pct, ci_high_pct); the columns are the REST API's names.")
    return rows
