"""The train-run flow: deterministic errors fail once with the reason; a crashed attempt is
retried, resumes from its checkpoint and ends where an uninterrupted run ends."""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterName,
)

from crucible.registry.reporting import ApiClient
from flows.run_flow import train_run

pytestmark = pytest.mark.integration

TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64", "faults.p=0.5", "faults.duration=1",
        "pipeline.compression=ssn"]


@contextmanager
def _trainer_messages() -> Iterator[list[str]]:
    """Messages the trainer logs inside the block (a handler on its own logger: Prefect's
    logging set-up replaces the root handlers that pytest's caplog relies on)."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("crucible.train"), _Collect(logging.INFO)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _train_attempts(flow_run_id: str, timeout_s: float = 30.0) -> list[int]:
    """How many times each `train` task run of the flow run ran (task runs reach the Prefect
    API through its event stream, so wait until they are there and final)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as prefect:
            task_runs = prefect.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="train")))
        done = task_runs and all(t.state is not None and t.state.is_final() for t in task_runs)
        if done or time.monotonic() > deadline:
            return [task_run.run_count for task_run in task_runs]
        time.sleep(0.5)


def test_deterministic_error_is_not_retried_and_run_is_marked_failed(
        prefect_harness: None, flow_client: ApiClient) -> None:
    state = train_run(preset="smoke", overrides=TINY + ["train.global_steps=2",
                                                        "model.init_std=1e30"],
                      return_state=True)
    assert state.is_failed()
    runs = [r for r in flow_client.list_runs(status="failed")
            if r["prefect_flow_run_id"] == str(state.state_details.flow_run_id)]
    assert len(runs) == 1
    assert runs[0]["status_reason"].startswith("TrainingDiverged: non-finite training loss")
    assert _train_attempts(str(state.state_details.flow_run_id)) == [1]


def test_bad_override_fails_before_anything_is_registered(prefect_harness: None,
                                                          flow_client: ApiClient) -> None:
    before = len(flow_client.list_runs())
    state = train_run(preset="smoke", overrides=["faults.p=2"], return_state=True)
    assert state.is_failed()
    assert "faults.p must be a probability in [0, 1]" in state.message
    assert len(flow_client.list_runs()) == before


@pytest.mark.slow
def test_crashed_run_resumes_from_checkpoint_to_the_same_loss(
        prefect_harness: None, flow_client: ApiClient) -> None:
    overrides = TINY + ["train.global_steps=5", "train.checkpoint_every=2",
                        "train.eval_every=2"]
    clean = train_run(preset="smoke", overrides=overrides)
    with _trainer_messages() as messages:
        state = train_run(preset="smoke", overrides=overrides, crash_after_global_steps=3,
                          return_state=True)
    crashed = state.result()
    assert _train_attempts(str(state.state_details.flow_run_id)) == [2]
    assert any(re.search(r"resumed .* from global step [1-9]", m) for m in messages), \
        f"the retry must resume from a checkpoint, not start again: {messages}"
    assert crashed["final_val_loss"] == clean["final_val_loss"]

    def records(run_id: str) -> tuple[list[tuple], list[tuple]]:
        metrics = sorted((m["name"], m["global_step"], m["replica"], m["value"])
                         for m in flow_client.list_metrics(run_id))
        events = sorted((e["id"], e["kind"], e["global_step"])
                        for e in flow_client.list_events(run_id))
        return metrics, events

    clean_metrics, clean_events = records(clean["run_id"])
    crashed_metrics, crashed_events = records(crashed["run_id"])
    assert crashed_metrics == clean_metrics                     # nothing lost, nothing twice
    assert crashed_events == clean_events and clean_events
    assert flow_client.get_run(crashed["run_id"])["status"] == "completed"
