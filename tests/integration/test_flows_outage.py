"""The registry goes down mid-run and comes back just after training ended: the real `train-run`
flow, against the real API (uvicorn) on Postgres, never records the run as completed while any
of its records is missing, and records it as completed once every metric and event the trainer
produced is stored exactly once."""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterName,
    TaskRunFilter,
    TaskRunFilterName,
)
from sqlalchemy import create_engine, text

from cli.embedded import flow_environment
from crucible.registry.reporting import ApiClient
from flows.run_flow import train_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64", "faults.p=0.5", "faults.duration=1",
        "pipeline.compression=ssn", "train.global_steps=40"]
_WAIT_S = 300.0
_STATE = text("SELECT r.id::text, r.status, r.owed_records, "
              "(SELECT count(*) FROM metrics m WHERE m.run_id = r.id), "
              "(SELECT count(*) FROM events e WHERE e.run_id = r.id) FROM runs r")


def _wait_for(what: str, ready: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


class _Watcher:
    """Samples every run's (status, owed_records, stored metrics, stored events) straight from
    Postgres while the flow runs, so a state the registry held only briefly is seen too."""

    def __init__(self, database_url: str) -> None:
        self._engine = create_engine(database_url)
        self.samples: list[tuple[str, str, int | None, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.1)

    def sample(self) -> list[tuple[str, str, int | None, int, int]]:
        with self._engine.connect() as conn:
            rows = [tuple(row) for row in conn.execute(_STATE)]
        self.samples.extend(rows)   # type: ignore[arg-type]
        return rows                 # type: ignore[return-value]

    def stop(self) -> None:
        """Stop polling and take one last sample: the flow has returned, and a state it reached
        in the last moments before (finish-run's update) may have landed between two polls."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()
        self._engine.dispose()


def _max_step(work: Path) -> int:
    steps = [-1]
    for path in work.glob("runs/*/metrics.jsonl"):
        steps += [json.loads(line)["global_step"] for line in path.read_text().splitlines()
                  if line.endswith("}")]
    return max(steps)


def _train_task_over(flow_run_name: str) -> bool:
    with get_client(sync_client=True) as prefect:
        flow_runs = prefect.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])))
        if not flow_runs:
            return False
        task_runs = prefect.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[str(flow_runs[0].id)])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="train-")))
    return any(t.state is not None and t.state.is_final() for t in task_runs)


def _outage(api_server: Any, work: Path, flow_run_name: str, watcher: _Watcher,
            seen: dict[str, Any]) -> None:
    """Stop the API once the trainer has reported a few global steps; start it again once the
    flow's `train` task is over (training ended, its reporter closed)."""
    try:
        _wait_for("the trainer's first global steps", lambda: _max_step(work) >= 3)
        api_server.stop()
        seen["stopped_after_step"] = _max_step(work)
        _wait_for("the end of the train task", lambda: _train_task_over(flow_run_name))
        seen["before_restart"] = watcher.sample()
        api_server.start()
    except BaseException as exc:    # noqa: BLE001 - re-raised by the test
        seen["error"] = exc
        api_server.start()


def _local_records(run_dir: Path) -> tuple[set[tuple[Any, ...]], set[str]]:
    """What the trainer produced, from the run folder's own (de-duplicated) jsonl files."""
    metrics = {(m["name"], m["global_step"], m["replica"], m["value"]) for m in
               map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    events = {e["id"] for e in map(json.loads, (run_dir / "events.jsonl").read_text()
                                   .splitlines())}
    return metrics, events


@pytest.mark.timeout(900)
def test_api_down_mid_run_completes_the_run_only_once_every_record_arrived(
        prefect_harness: None, api_server: Any, pg_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRUCIBLE_TORCH_THREADS", "1")
    work = tmp_path / "work"
    name = f"outage-{uuid.uuid4().hex[:8]}"
    watcher = _Watcher(pg_url)
    seen: dict[str, Any] = {}
    outage = threading.Thread(target=_outage, args=(api_server, work, name, watcher, seen),
                              daemon=True)
    try:
        with flow_environment(api_server.url, api_server.token, work):
            outage.start()
            result = train_run.with_options(flow_run_name=name)(preset="smoke", overrides=TINY)
            outage.join(timeout=_WAIT_S)
    finally:
        watcher.stop()
    if "error" in seen:
        raise seen["error"]
    run_id = result["run_id"]
    metrics, events = _local_records(work / "runs" / run_id)
    assert seen["stopped_after_step"] < 39, "the API must go down while training runs"

    # when the API came back, training had ended but the registry lacked records
    [before] = [s for s in seen["before_restart"] if s[0] == run_id]
    assert before[1] != "completed"
    assert before[3] < len(metrics) and before[4] < len(events)

    # never "completed" while a record was missing, at any moment the watcher saw
    samples = [s for s in watcher.samples if s[0] == run_id]
    completed = [s for s in samples if s[1] == "completed"]
    assert completed
    assert all(s[2:] == (0, len(metrics), len(events)) for s in completed), completed[:3]

    # in the end: completed, owing nothing, every record exactly once
    assert (result["status"], result["owed_records"]) == ("completed", 0)
    with ApiClient(api_server.url, api_server.token) as client:
        run = client.get_run(run_id)
        stored_metrics = client.list_metrics(run_id)
        stored_events = client.list_events(run_id)
    assert (run["status"], run["owed_records"]) == ("completed", 0)
    assert len(stored_metrics) == len(metrics)
    assert {(m["name"], m["global_step"], m["replica"], m["value"])
            for m in stored_metrics} == metrics
    assert len(stored_events) == len(events)
    assert {e["id"] for e in stored_events} == events
    assert list(work.rglob("*.spool.jsonl")) == [] and list(work.rglob("finish.jsonl")) == []
