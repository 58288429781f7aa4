"""The `distributed-run` flow: one run in distributed mode (a process per replica), registered and
reported like a `train-run`.

Recipe: resolve the config (preset + overrides + `replicas=nproc`, refused before anything is
registered if the distributed mode cannot run it) -> replay the spools -> register the run
(`flows.run_flow.register_run`, so a sweep's pre-registered id and an earlier attempt's record
are reused the same way) -> post the dashboard link -> hold this host's GPU slot, mark the run
`running` and call `crucible.distributed.launch.launch` (one torch.distributed.elastic agent per
replica on this worker host, planned SIGKILLs from `kills`) -> send the merged `metrics.jsonl`
and `events.jsonl` to the registry -> record the merged summary and the final state through
`flows.run_flow.finish_run` (`crucible.registry.reporting.record_finish`: only once every record arrived).

The run folder is `<work dir>/runs/<run id>/launch-<k>`: each attempt of the same registry run
(a Prefect retry of the flow) gets a fresh folder, because `merge` reads every replica folder it
finds and a stale one from an earlier attempt would be counted. There are no task retries: a
distributed run does not resume from a checkpoint (a replica restarts from the store's global
weights inside one launch; a new launch starts over).

The GPU slot: the run holds one slot of `gpu:<host>` (like a train-run), so it never trains
beside another run on a one-slot host, while its R processes take GPU r mod n of the host
(`launch`): on a multi-GPU host that also serves train-runs, give distributed runs a work pool
of their own hosts. Several hosts, one pod per replica: `infra/k8s/render.py`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as runtime_flow_run

from crucible.config import Config, ConfigError
from crucible.distributed.liveness import DEFAULT_LEASE_S, DEFAULT_RESTARTS, check_recovery
from crucible.ids import validate_id
from crucible.registry.connect import make_callback, make_client
from crucible.registry.reporting import ApiUnavailable, RecordsOwed, describe
from flows.gpu import gpu_slot
from flows.processes import flow_process
from flows.run_flow import (
    drain_spools,
    end_flow_runs,
    finish_run,
    post_run_link,
    register_run,
    resolve_config,
)
from flows.settings import FlowSettings

__all__ = ["distributed_run", "parse_kills", "resolve_distributed_config"]


def parse_kills(kills: list[str], *, rejoin: bool) -> list[dict[str, Any]]:
    """`["1@3", ...]` -> the launcher's kill records; ConfigError naming the parameter."""
    field = "kills" if rejoin else "kills_forever"
    out = []
    for text in kills:
        replica, sep, step = str(text).partition("@")
        if not sep or not replica.isdigit() or not step.isdigit():
            raise ConfigError(f"{field}: {text!r} is not REPLICA@GLOBAL_STEP; write e.g. 1@3")
        out.append({"replica": int(replica), "global_step": int(step), "rejoin": rejoin})
    return out


def resolve_distributed_config(preset: str, overrides: list[str], nproc: int,
                               kills: list[dict[str, Any]], store_url: str | None,
                               s3_endpoint_url: str | None, *, pipeline: bool = False) -> Config:
    """The run's config with `replicas = nproc`; raises ConfigError for what the distributed mode
    (or with `pipeline`, the pipeline mode) refuses (a strategy, method or setting it cannot
    run, a kill outside the run; the pipeline mode's kills are the fault plan's)."""
    from crucible.distributed.launch import check_kills
    from crucible.distributed.pipeline.stage_model import check_pipeline
    from crucible.distributed.worker import check_distributed

    if nproc < 1:
        raise ConfigError(f"nproc must be >= 1 (one process per replica), got {nproc}")
    config = resolve_config(preset, [*overrides, f"replicas={nproc}"], store_url,
                            s3_endpoint_url)
    if pipeline:
        check_pipeline(config)
        if kills:
            raise ConfigError("kills and kills_forever kill whole replicas; with pipeline=true "
                              "the fault plan's stage failures are the kills (set faults.p and "
                              "faults.strategy)")
        return config
    check_distributed(config)
    check_kills(kills, config)
    return config


def _launch_folder(run_dir: Path) -> Path:
    """`run_dir/launch-<k>`, the first k not used by an earlier attempt."""
    k = 1
    while (run_dir / f"launch-{k}").exists():
        k += 1
    return run_dir / f"launch-{k}"


@task(name="launch-distributed", cache_policy=NO_CACHE)
def launch_task(config: Config, run_id: str, out_dir: Path, kills: list[dict[str, Any]],
                settings: FlowSettings, *, restarts: int = DEFAULT_RESTARTS,
                lease_s: float = DEFAULT_LEASE_S, pipeline: bool = False) -> dict[str, Any]:
    """Hold a GPU slot, mark the run running, launch the replicas (with `pipeline`, a process
    per stage-replica); returns the merged summary."""
    from crucible.distributed.launch import launch  # torch-heavy: only where it runs
    from crucible.distributed.pipeline.launch import launch_pipeline

    logger = get_run_logger()
    flow_run_id = str(runtime_flow_run.id) if runtime_flow_run.id else None
    with gpu_slot(run=run_id, flow_run_id=flow_run_id, log=logger) as slot:
        with make_client(settings) as client:
            client.update_run(run_id, status="running")
        if pipeline:
            logger.info("pipeline run %s: %d x %d stage processes in %s, slot %s", run_id,
                        config.replicas, config.pipeline.stages, out_dir, slot)
            return launch_pipeline(config, out_dir=out_dir, restarts=restarts)
        logger.info("distributed run %s: %d replica processes in %s, slot %s, kills %s",
                    run_id, config.replicas, out_dir, slot, kills or "none")
        return launch(config, out_dir=out_dir, kills=kills, restarts=restarts, lease_s=lease_s)


@task(name="report-records", cache_policy=NO_CACHE)
def report_records(run_id: str, out_dir: Path, settings: FlowSettings) -> int:
    """Send the merged metrics and events to the registry (through the run's spool: what does
    not arrive now waits there, and `finish_run` waits for it); returns how many."""
    from crucible.events import JsonlCallback

    callback = make_callback(settings, run_id)
    files = JsonlCallback(out_dir)
    try:
        return files.resend(callback)
    finally:
        files.close()
        try:
            callback.close()
        finally:
            client = getattr(callback, "client", None)
            if client is not None:
                client.close()


def _mark(status: str, lead: str):
    """A cancellation / crash hook: release the slot, mark the run (train-run's hooks)."""
    def hook(flow_obj: Any, flow_run: Any, state: Any) -> None:
        settings = FlowSettings()
        params = flow_run.parameters or {}
        with make_client(settings) as client:
            if params.get("run_id"):
                runs = [client.get_run(str(params["run_id"]))]
            else:
                runs = [r for r in client.list_runs(sweep_id=params.get("sweep_id"))
                        if r.get("prefect_flow_run_id") == str(flow_run.id)]
        reason = f"{lead}: {state.message}" if state.message else lead
        end_flow_runs(settings, [str(flow_run.id)], runs, status, reason[:4000])
    hook.__name__ = f"mark_run_{status}"
    return hook


@flow(name="distributed-run", log_prints=False, validate_parameters=True,
      on_cancellation=[_mark("cancelled", "flow run cancelled")],
      on_crashed=[_mark("failed", "flow run crashed")])
def distributed_run(preset: str = "smoke", overrides: list[str] | None = None, nproc: int = 2,
                    kills: list[str] | None = None, kills_forever: list[str] | None = None,
                    store_url: str | None = None, sweep_id: str | None = None,
                    run_id: str | None = None, restarts: int = DEFAULT_RESTARTS,
                    lease_s: float = DEFAULT_LEASE_S, pipeline: bool = False) -> dict[str, Any]:
    """Run `preset` with `overrides` in distributed mode, one process per replica (`nproc`
    replicas), on this worker host, and record it in the registry.

    `kills` (`REPLICA@GLOBAL_STEP`, e.g. `1@3`) SIGKILL that replica at the start of that step;
    its elastic agent restarts it and it rejoins from the store. `kills_forever` likewise, and
    the replica does not come back. `restarts`: per replica, restarts for unplanned deaths of
    its worker or agent; `lease_s`: the heartbeat lease after which peers stop waiting for a
    silent replica (crucible.distributed.launch). `store_url` is the shared object store the
    contributions travel through (`<store_url>/runs/<fingerprint>`; empty: the worker's
    CRUCIBLE_STORE_URL, else a folder in the run folder). Returns {run_id, status,
    owed_records, final_val_loss, reason, out_dir, contributions, recoveries, lost}; a replica
    that never came back is in `lost` (the run completes without it); raises (the flow run
    fails) when no replica finished. `pipeline`: one process per stage of every replica
    (`crucible launch --pipeline`): the fault plan's stage failures are real kills, and
    `recoveries` and `lost` name stage-replicas.
    """
    if run_id is not None:
        validate_id(run_id, field="run_id")
    if sweep_id is not None:
        validate_id(sweep_id, field="sweep_id")
    settings = FlowSettings()
    flow_run_id = str(runtime_flow_run.id) if runtime_flow_run.id else None
    with flow_process(settings.work_dir, flow_run_id, "distributed-run"):
        return _distributed_run(settings, preset, overrides or [], nproc, kills or [],
                                kills_forever or [], store_url, sweep_id, run_id, restarts,
                                lease_s, pipeline)


def _distributed_run(settings: FlowSettings, preset: str, overrides: list[str], nproc: int,
                     kills: list[str], kills_forever: list[str], store_url: str | None,
                     sweep_id: str | None, run_id: str | None, restarts: int,
                     lease_s: float, pipeline: bool = False) -> dict[str, Any]:
    planned = (parse_kills(kills, rejoin=True)
               + parse_kills(kills_forever, rejoin=False))
    check_recovery(restarts=restarts, lease_s=lease_s)
    config = resolve_distributed_config(preset, overrides, nproc, planned,
                                        store_url or settings.store_url,
                                        settings.s3_endpoint_url, pipeline=pipeline)
    drain_spools(settings)
    run_id = validate_id(register_run(config, sweep_id, run_id, settings), field="run_id")
    post_run_link(settings, run_id, "This distributed run's dashboard page, served by the "
                                    "Crucible API.")
    out_dir = _launch_folder(settings.work_dir.resolve() / "runs" / run_id)
    try:
        summary = launch_task(config, run_id, out_dir, planned, settings, restarts=restarts,
                              lease_s=lease_s, pipeline=pipeline)
        report_records(run_id, out_dir, settings)
    except Exception as exc:
        reason = describe(exc)
        get_run_logger().error("distributed run %s failed: %s", run_id, reason)
        try:
            finish_run(run_id, settings, reason=reason)
        except ApiUnavailable as owed:
            get_run_logger().warning("%s", owed)
        raise
    if pipeline:
        part = summary["pipeline"]
        recoveries = [{"replica": x["replica"], "stage": x["stage"], "lives": x["lives"]}
                      for x in part["stages"] if x["lives"] > 1]
        lost = part["lost"]
    else:
        recoveries, lost = summary["distributed"]["recoveries"], summary["distributed"]["lost"]
    result = {"run_id": run_id, "out_dir": str(out_dir),
              "final_val_loss": summary.get("final_val_loss"),
              "contributions": summary.get("contributions"),
              "recoveries": recoveries, "lost": lost}
    try:
        finish_run(run_id, settings, summary=summary)
    except ApiUnavailable as exc:
        owed = exc.owed if isinstance(exc, RecordsOwed) else None
        get_run_logger().warning("run %s: %s", run_id, exc)
        return result | {"status": "running", "owed_records": owed, "reason": str(exc)}
    return result | {"status": "completed", "owed_records": 0, "reason": None}
