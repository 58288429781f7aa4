"""The `train-run` flow: one training run, registered with the API, reported through it, resumable.

Recipe: resolve the config (preset + overrides) -> replay what earlier runs left in the spools
-> register the run (or reuse the record a sweep or an earlier attempt made; a final state an
earlier attempt left in the spools is set aside first) -> post a link to the run's dashboard page
as a Prefect artifact -> train while holding a GPU slot, with
the registry client as the metric/event callback and checkpoints in the configured store -> mark
the run completed with its results, or failed with the reason.

States in the registry: `queued` from registration until the run holds a GPU slot ("waiting for
gpu:HOST (held by RUN)" in the log while a sibling holds it), `running` while it trains, then
`completed` or `failed`. A flow run cancelled in Prefect (the UI, `prefect flow-run cancel`) or
crashed (its process killed) runs the flow's `on_cancellation` / `on_crashed` hook - in the
worker's runner when the run's process was killed - which releases the run's GPU slot at once
and records the run `cancelled` / `failed` through its spool, like any final state, so no
record it still owes is lost.

Nothing is claimed before it is true: the final state goes through the run's spool folder
(`crucible.registry.replay.record_finish`) and is recorded only once every metric and event the run
reported has reached the registry. When some are still owed (the registry was down at the end),
`finish-run` fails transiently and each retry replays first; after the last retry the flow
returns status "running" with `owed_records`, the registry shows "training finished; N records
owed", and the next replay anywhere on this work folder (a later flow or reporter,
`crucible api replay`) delivers them and records the run as completed.

Retries: the `train` task retries only transient errors (`flows.errors`), and every attempt after
the first resumes from the last checkpoint. Because the run's folder and store are derived from
its registry id, a re-run of the whole flow (a Prefect flow retry, or "Retry" in the UI) finds the
same record and checkpoints and resumes too. Metrics and events are keyed deterministically, so
the steps replayed since the checkpoint are stored once.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as runtime_flow_run

from crucible.config import Config, apply_overrides
from crucible.data import check_config_budget
from crucible.events import Callback, Event, Metric
from crucible.grid.names import FINAL_STATUSES
from crucible.ids import validate_id
from crucible.presets import get_preset
from crucible.registry.connect import make_callback, make_client, run_page
from crucible.registry.identity import code_version, config_fingerprint
from crucible.registry.reporting import (
    ApiUnavailable,
    RecordsOwed,
    describe,
    final_changes,
    record_finish,
    replay_spools,
    supersede_finish,
)
from flows.errors import SimulatedCrash, is_transient, retry_only_transient
from flows.gpu import gpu_slot, release_slots
from flows.processes import flow_process, run_folder_lock, training_journal
from flows.settings import FlowSettings

__all__ = ["train_run", "resolve_config", "run_store_url", "TRAIN_RETRIES", "post_run_link"]

_log = logging.getLogger(__name__)

TRAIN_RETRIES = 3
_RETRY_DELAYS_S = [1, 5, 20]
_CRASH_MARKER = ".crash-injected"


def run_store_url(base: str | None, fingerprint: str) -> str | None:
    """Where one run's checkpoints live under a shared store: `<base>/runs/<fingerprint[:16]>`.

    None (no shared store) leaves the trainer's default, a folder inside the run's own folder.
    """
    if not base:
        return None
    return f"{base.rstrip('/')}/runs/{fingerprint[:16]}"


def resolve_config(preset: str, overrides: list[str], store_url: str | None = None,
                   s3_endpoint_url: str | None = None) -> Config:
    """The run's validated config: the preset, then `overrides`, then the store location
    (which is per run, see `run_store_url`). Raises ConfigError naming the bad key, or when
    the token budget needs more than one pass over the data (unless data.allow_repeat)."""
    config = apply_overrides(get_preset(preset), list(overrides))
    check_config_budget(config)   # a budget larger than the data: refuse before anything runs
    store = run_store_url(store_url, config_fingerprint(config))
    if store is None:
        return config
    extra = [f"store.url={store}"]
    if s3_endpoint_url and store.startswith("s3://"):
        extra.append(f"store.endpoint_url={s3_endpoint_url}")
    return apply_overrides(config, extra)


class _AttemptCallback:
    """The registry callback of one attempt: closes it once (the trainer closes it on success,
    the task on failure) and, when `crash_after` is set, raises `SimulatedCrash` at the flush
    after that global step, once per run folder (a marker file remembers it), so the retried
    attempt runs through."""

    def __init__(self, inner: Callback, crash_after: int | None, marker: Path) -> None:
        self.inner, self.crash_after, self.marker = inner, crash_after, marker
        self._last_step = -1
        self._closed = False

    def metric(self, item: Metric) -> None:
        self._last_step = max(self._last_step, item.global_step)
        self.inner.metric(item)

    def event(self, item: Event) -> None:
        self.inner.event(item)

    def flush(self) -> None:
        self.inner.flush()
        if self.crash_after is None:
            return
        if self._last_step >= self.crash_after and not self.marker.exists():
            self.marker.write_text(str(self._last_step))
            raise SimulatedCrash(f"simulated worker crash after global step {self._last_step}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.inner.close()
            client = getattr(self.inner, "client", None)   # the ApiCallback's own HTTP client
            if client is not None:
                client.close()


def post_run_link(settings: FlowSettings, run_id: str, description: str) -> None:
    """The flow run's link artifact to its run's dashboard page."""
    create_link_artifact(link=run_page(settings, run_id), link_text=f"Run {run_id[:8]}",
                         key=f"run-{run_id[:8]}-dashboard".lower(), description=description)


@task(name="replay-spools", cache_policy=NO_CACHE)
def drain_spools(settings: FlowSettings) -> dict[str, int]:
    """Deliver what earlier runs left in the spools under `settings.spool_root`, and record the
    final state of those that no longer owe anything; bounded by `settings.replay_timeout_s`,
    and an unreachable registry only ends it early. Returns {run id: records still owed}."""
    with make_client(settings) as client:
        report = replay_spools(client, settings.spool_root, timeout_s=settings.replay_timeout_s)
    logger = get_run_logger()
    if report.delivered or report.finished or report.owed:
        logger.info("spools under %s: %d records delivered, %d run(s) finished, %d still owe "
                    "records", settings.spool_root, report.delivered, len(report.finished),
                    len(report.owed))
    for path, why in report.unreadable.items():
        logger.warning("cannot read %s (%s): skipped, its run stays unfinished", path, why)
    for path, lines in report.rejected.items():
        logger.warning("%d spooled batches refused by the API, kept in %s", lines, path)
    return report.owed


@task(name="register-run", retries=3, retry_delay_seconds=[1, 5, 20],
      retry_condition_fn=retry_only_transient, cache_policy=NO_CACHE)
def register_run(config: Config, sweep_id: str | None, run_id: str | None,
                 settings: FlowSettings) -> str:
    """The registry id of this run: `run_id` when a sweep pre-registered it, else the record an
    earlier attempt of this same Prefect flow run created, else a new record. Marked queued
    (for its GPU slot) once the final state an earlier attempt left in the spools is set aside
    (waiting up to `settings.replay_timeout_s` for a replay recording it right now), so that no
    replay applies it to this attempt."""
    flow_run_id = str(runtime_flow_run.id) if runtime_flow_run.id else None
    with make_client(settings) as client:
        return _register(client, config, sweep_id, run_id, flow_run_id,
                         before_running=lambda registered: supersede_finish(
                             settings.spool_root, registered, wait_s=settings.replay_timeout_s))


def _register(client: Any, config: Config, sweep_id: str | None, run_id: str | None,
              flow_run_id: str | None, *,
              before_running: Callable[[str], object] = lambda _run_id: None) -> str:
    fingerprint = config_fingerprint(config)
    if run_id is None and flow_run_id is not None:
        for run in client.list_runs(config_hash=fingerprint, sweep_id=sweep_id):
            if run.get("prefect_flow_run_id") == flow_run_id:
                run_id = str(run["id"])
                break
    if run_id is None:
        created = client.create_run(config=config.to_dict(), sweep_id=sweep_id,
                                    config_hash=fingerprint, code_version=code_version())
        run_id = str(created["id"])
    before_running(validate_id(run_id, field="run_id"))
    # an earlier attempt's reason ("...; N records owed") does not describe this one
    client.update_run(run_id, status="queued", status_reason=None,
                      prefect_flow_run_id=flow_run_id)
    return run_id


@task(name="train", retries=TRAIN_RETRIES, retry_delay_seconds=_RETRY_DELAYS_S,
      retry_condition_fn=retry_only_transient, cache_policy=NO_CACHE)
def train_task(config: Config, run_id: str, out_dir: Path, settings: FlowSettings,
               crash_after_global_steps: int | None = None,
               alignment: bool = False) -> dict[str, Any]:
    """Train while holding a GPU slot; returns the trainer's summary (with the final model's
    alignment report when `alignment`: what a study asks of its baselines).

    Always asks the trainer to resume: it continues from the run folder's last checkpoint when
    there is one (a retried attempt, a re-run flow) and starts afresh otherwise.
    """
    from crucible.preflight import check_can_start

    logger = get_run_logger()
    if settings.torch_threads is not None:
        import torch

        torch.set_num_threads(settings.torch_threads)
    # on the worker that trains: its device and folders (ConfigError: not retried); its
    # memory only in the slot, where no run ahead of it in the queue still trains
    check_can_start(config, out_dir=out_dir, out_field="CRUCIBLE_WORK_DIR run folder",
                    memory_check=False)
    flow_run_id = str(runtime_flow_run.id) if runtime_flow_run.id else None
    # one process trains a run folder at a time: an orphan of an earlier flow run (its server
    # stopped or killed) may still train this cell; wait for it, then take what it wrote
    with run_folder_lock(out_dir, logger):
        done = _finished_summary(out_dir, run_id)
        if done is not None:
            logger.info("run %s was trained to its end by another process: its summary is "
                        "kept, nothing is trained again", run_id)
            return done
        return _train_in_slot(config, run_id, out_dir, settings, crash_after_global_steps,
                              flow_run_id, logger, alignment)


def _finished_summary(out_dir: Path, run_id: str) -> dict[str, Any] | None:
    """The summary a finished training of this run left in its folder, else None."""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("run_key") == f"run-{run_id}" \
        else None


def _train_in_slot(config: Config, run_id: str, out_dir: Path, settings: FlowSettings,
                   crash_after_global_steps: int | None, flow_run_id: str | None,
                   logger: Any, alignment: bool = False) -> dict[str, Any]:
    from crucible.preflight import check_memory
    from crucible.train import train  # torch-heavy: only where training happens

    callback = _AttemptCallback(make_callback(settings, run_id), crash_after_global_steps,
                                out_dir / _CRASH_MARKER)
    try:
        with gpu_slot(run=run_id, flow_run_id=flow_run_id, log=logger) as slot:
            with make_client(settings) as client:
                client.update_run(run_id, status="running")
            if not settings.skip_memory_check:   # MemoryBusy (it fits alone) is retried
                check_memory(config, shared=True)
            logger.info("training run %s (%s) in %s, slot %s",
                        run_id, config_fingerprint(config)[:12], out_dir, slot)
            with training_journal(out_dir, flow_run_id):
                return train(config, out_dir=out_dir, callback=callback, resume=True,
                             progress=False, run_key=f"run-{run_id}", alignment=alignment)
    finally:
        callback.close()


@task(name="finish-run", retries=3, retry_delay_seconds=[1, 5, 20],
      retry_condition_fn=retry_only_transient, cache_policy=NO_CACHE)
def finish_run(run_id: str, settings: FlowSettings, summary: dict[str, Any] | None = None,
               reason: str | None = None) -> None:
    """Mark the run completed with its results (`summary`) or failed with `reason`, once every
    record it reported has reached the registry (each attempt replays the run's spools first).

    Raises `RecordsOwed` (transient, so the task is retried) while records are still owed or
    the registry cannot be reached; the final state then waits in the spool for the next replay.
    """
    with make_client(settings) as client:
        record_finish(client, settings.spool_root, run_id,
                      final_changes(summary=summary, reason=reason),
                      timeout_s=settings.replay_timeout_s)


_FINAL = tuple(sorted(FINAL_STATUSES))
# how long a hook waits for a run's spool to settle: a dying process may still hold it, and its
# final state waits on disk for the next replay anyway
_HOOK_SETTLE_S = 5.0


def end_flow_runs(settings: FlowSettings, flow_run_ids: list[str], runs: list[dict[str, Any]],
                  status: str, reason: str) -> None:
    """What the hooks of a cancelled or crashed flow run do: release the GPU slots its flow runs
    (`flow_run_ids`) hold on this host, then record each of `runs` (registry records) that has no
    final state yet as `status` with `reason`: at once, and through its spool (`record_finish`),
    so records it still owes are replayed and counted on it, now or by the next replay. A run
    that finished training and only owes records (`running` with `owed_records`) is left as it
    is: its final state already waits in its spool."""
    released = release_slots(flow_run_ids)
    if released:
        _log.info("released %d GPU slot(s) of flow run(s) %s", released, ", ".join(flow_run_ids))
    with make_client(settings) as client:
        for run in runs:
            if run.get("status") in _FINAL or run.get("owed_records"):
                continue
            changes = {"status": status, "status_reason": reason}
            try:
                client.update_run(str(run["id"]), **changes)
                record_finish(client, settings.spool_root, str(run["id"]), changes,
                              timeout_s=min(_HOOK_SETTLE_S, settings.replay_timeout_s))
            except ApiUnavailable as exc:   # waits in the spool for the next replay
                _log.warning("run %s: %s", run["id"], exc)


def _own_runs(settings: FlowSettings, flow_run: Any) -> list[dict[str, Any]]:
    """The registry record(s) of a train-run flow run: its `run_id` parameter, else the run
    registered with its flow run id."""
    params = flow_run.parameters or {}
    with make_client(settings) as client:
        if params.get("run_id"):
            return [client.get_run(str(params["run_id"]))]
        return [run for run in client.list_runs(sweep_id=params.get("sweep_id"))
                if run.get("prefect_flow_run_id") == str(flow_run.id)]


def _state_hook(status: str, lead: str) -> Callable[[Any, Any, Any], None]:
    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        settings = FlowSettings()
        reason = f"{lead}: {state.message}" if state.message else lead
        end_flow_runs(settings, [str(flow_run.id)], _own_runs(settings, flow_run), status,
                      reason[:4000])
    hook.__name__ = f"mark_run_{status}"
    return hook


@flow(name="train-run", log_prints=False, validate_parameters=True,
      on_cancellation=[_state_hook("cancelled", "flow run cancelled")],
      on_crashed=[_state_hook("failed", "flow run crashed")])
def train_run(preset: str = "smoke", overrides: list[str] | None = None,
              sweep_id: str | None = None, run_id: str | None = None,
              store_url: str | None = None,
              crash_after_global_steps: int | None = None,
              alignment: bool = False) -> dict[str, Any]:
    """Train one run of `preset` with `overrides` (`key.path=value`) and record it in the registry.

    `store_url` is the shared object store (checkpoints go to `<store_url>/runs/<fingerprint>`);
    empty uses the worker's CRUCIBLE_STORE_URL, else a folder inside the run folder.
    `crash_after_global_steps` (testing) simulates a worker crash once, to exercise resume.
    `alignment`: record the final model's alignment report in the summary (a study's sweep asks
    it of its baselines; `crucible.alignment`).
    Returns {run_id, status, owed_records, final_val_loss, reason}: status "completed", or
    "running" when training finished but `owed_records` records have not reached the registry
    yet (the next replay completes the run); raises (the flow run fails) on failure.
    """
    # ids become folder names and store keys: refuse '../..', '/abs' or 'a/b' before anything
    if run_id is not None:
        validate_id(run_id, field="run_id")
    if sweep_id is not None:
        validate_id(sweep_id, field="sweep_id")
    settings = FlowSettings()
    flow_run_id = str(runtime_flow_run.id) if runtime_flow_run.id else None
    with flow_process(settings.work_dir, flow_run_id, "train-run"):
        return _train_run(settings, preset, overrides or [], sweep_id, run_id, store_url,
                          crash_after_global_steps, alignment)


def _train_run(settings: FlowSettings, preset: str, overrides: list[str], sweep_id: str | None,
               run_id: str | None, store_url: str | None,
               crash_after_global_steps: int | None, alignment: bool = False) -> dict[str, Any]:
    config = resolve_config(preset, overrides, store_url or settings.store_url,
                            settings.s3_endpoint_url)
    drain_spools(settings)
    run_id = validate_id(register_run(config, sweep_id, run_id, settings), field="run_id")
    post_run_link(settings, run_id, "This run's dashboard page (loss curves, fault timeline), "
                                    "served by the Crucible API.")
    out_dir = settings.work_dir.resolve() / "runs" / run_id
    try:
        summary = train_task(config, run_id, out_dir, settings, crash_after_global_steps,
                             alignment)
    except Exception as exc:
        reason = describe(exc)
        kind = "transient, retries exhausted" if is_transient(exc) else "deterministic, not retried"
        get_run_logger().error("run %s failed (%s): %s", run_id, kind, reason)
        try:
            finish_run(run_id, settings, reason=reason)
        except ApiUnavailable as owed:     # recorded by the next replay; the cause matters more
            get_run_logger().warning("%s", owed)
        raise
    try:
        finish_run(run_id, settings, summary=summary)
    except ApiUnavailable as exc:
        owed = exc.owed if isinstance(exc, RecordsOwed) else None
        get_run_logger().warning("run %s: %s", run_id, exc)
        return {"run_id": run_id, "status": "running", "owed_records": owed,
                "final_val_loss": summary.get("final_val_loss"), "reason": str(exc)}
    return {"run_id": run_id, "status": "completed", "owed_records": 0,
            "final_val_loss": summary.get("final_val_loss"), "reason": None}
