"""State must be true: a cancelled or queued run says so in the registry, and a cancelled run's
GPU slot is free at once, not when its lease expires.

Cancellation is driven the way Prefect drives it for a worker's run: the flow run is set to
Cancelling through the API, and the runner's `HookRunner` runs the flow's `on_cancellation`
hooks (the run's own process would be killed; here its training is held, then stopped with
the termination signal that process would get).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.exceptions import TerminationSignal
from prefect.runner._hook_runner import HookRunner
from prefect.states import Cancelling

import crucible.train
from crucible.grid.spec import SweepSpec
from crucible.registry.reporting import ApiClient
from flows.gpu import gpu_limit_name, gpu_slot, slot_holders
from flows.run_flow import train_run
from flows.sweep_flow import failure_sweep

pytestmark = pytest.mark.integration

TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64", "train.global_steps=2"]


class _HeldTraining:
    """Stands in for `crucible.train.train` in the first `hold` calls: records the run it
    trains, blocks until `stop` is set, then ends as a killed process's run does (the
    termination signal); later calls train for real."""

    def __init__(self, real: Any, hold: int = 1) -> None:
        self.real, self.hold = real, hold
        self.runs: list[str] = []
        self.started, self.stop = threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if len(self.runs) >= self.hold:
            return self.real(*args, **kwargs)
        self.runs.append(kwargs["run_key"].removeprefix("run-"))
        self.started.set()
        self.stop.wait(timeout=240)
        raise TerminationSignal(signal.SIGTERM)


def _start(call: Any, out: list[Any]) -> threading.Thread:
    """Run `call()` in a thread; its state, or the termination signal that ended it, goes to
    `out`."""
    def target() -> None:
        try:
            out.append(call())
        except TerminationSignal as exc:    # what ends a run whose process is killed
            out.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _cancel(flow: Any, flow_run_id: str) -> None:
    """What a runner does when the UI cancels a flow run: Cancelling, then the flow's hooks."""
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(message="cancelled in the UI"),
                                  force=True)
        flow_run = client.read_flow_run(flow_run_id)

    async def resolve(_flow_run: Any) -> Any:
        return flow

    asyncio.run(HookRunner(resolve_flow=resolve).run_cancellation_hooks(flow_run,
                                                                        flow_run.state))


def _active_slots() -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(gpu_limit_name()).active_slots


@pytest.mark.timeout(300)
def test_cancelled_run_is_recorded_cancelled_and_frees_its_slot_at_once(
        prefect_harness: None, flow_client: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    held = _HeldTraining(crucible.train.train)
    monkeypatch.setattr(crucible.train, "train", held)
    states: list[Any] = []
    worker = _start(lambda: train_run(preset="smoke", overrides=[*TINY, "seed=11"],
                                      return_state=True), states)
    try:
        assert held.started.wait(timeout=180), "the run never started training"
        run = flow_client.get_run(held.runs[0])
        assert run["status"] == "running"
        assert _active_slots() == 1
        _cancel(train_run, run["prefect_flow_run_id"])
        # its process still "holds" the slot, yet the slot is free now, not in 300 s
        assert _active_slots() == 0 and not slot_holders()
        assert flow_client.get_run(held.runs[0])["status"] == "cancelled"
        with gpu_slot(timeout_s=60) as name:      # a second run gets it
            assert name == gpu_limit_name()
    finally:
        held.stop.set()
        worker.join(timeout=180)
    run = flow_client.get_run(held.runs[0])
    assert run["status"] == "cancelled", run      # the killed run's crash does not overwrite it
    assert run["status_reason"].startswith("flow run cancelled")
    assert _active_slots() == 0


class _LogWatch(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle, self.lines, self.seen = needle, [], threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.needle in message:
            self.lines.append(message)
            self.seen.set()


@pytest.mark.timeout(300)
def test_a_run_waiting_for_the_slot_is_queued_and_says_who_holds_it(
        prefect_harness: None, flow_client: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    held = _HeldTraining(crucible.train.train)
    monkeypatch.setattr(crucible.train, "train", held)
    watch = _LogWatch("waiting for gpu:")
    logging.getLogger("prefect.task_runs").addHandler(watch)
    first: list[Any] = []
    second: list[Any] = []
    waiter = None
    holder = _start(lambda: train_run(preset="smoke", overrides=[*TINY, "seed=12"],
                                      return_state=True), first)
    try:
        assert held.started.wait(timeout=180), "the first run never started training"
        waiter = _start(lambda: train_run(preset="smoke", overrides=[*TINY, "seed=13"],
                                          return_state=True), second)
        assert watch.seen.wait(timeout=180), "the second run never waited for the slot"
        assert watch.lines[0] == f"waiting for {gpu_limit_name()} (held by {held.runs[0]})"
        queued = [r for r in flow_client.list_runs() if r["status"] == "queued"]
        assert len(queued) == 1 and queued[0]["seed"] == 13
        _cancel(train_run, flow_client.get_run(held.runs[0])["prefect_flow_run_id"])
    finally:
        held.stop.set()
        logging.getLogger("prefect.task_runs").removeHandler(watch)
        holder.join(timeout=180)
    assert waiter is not None
    waiter.join(timeout=240)
    assert second and second[0].is_completed(), second
    assert flow_client.get_run(second[0].result()["run_id"])["status"] == "completed"


@pytest.mark.timeout(300)
def test_cancelled_sweep_marks_itself_and_every_unfinished_cell_cancelled(
        prefect_harness: None, flow_client: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    held = _HeldTraining(crucible.train.train, hold=99)
    monkeypatch.setattr(crucible.train, "train", held)
    spec = SweepSpec(name="cancel-me", arms=["ssn"], strategies=["skip"],
                     failure_probabilities=[0.5], seeds=[0], global_steps=2, duration=1,
                     overrides=TINY[:-1], max_concurrent_runs=1)
    states: list[Any] = []
    worker = _start(lambda: failure_sweep(spec=spec, return_state=True), states)
    try:
        assert held.started.wait(timeout=180), "no cell started training"
        running = flow_client.get_run(held.runs[0])
        sweep = flow_client.get_sweep(running["sweep_id"])
        cells = flow_client.list_runs(sweep_id=sweep["id"])
        assert len(cells) >= 2 and {c["status"] for c in cells} == {"pending", "running"}
        _cancel(failure_sweep, sweep["prefect_flow_run_id"])
        assert flow_client.get_sweep(sweep["id"])["status"] == "cancelled"
        assert {c["status"] for c in flow_client.list_runs(sweep_id=sweep["id"])} == {
            "cancelled"}
        assert _active_slots() == 0 and not slot_holders()
        # the cell's flow run ran inside the sweep's (killed) process: nobody else ends it,
        # and Prefect must not show it Running for ever
        with get_client(sync_client=True) as client:
            cell_state = client.read_flow_run(running["prefect_flow_run_id"]).state
        assert cell_state.type.name == "CANCELLED"
        assert cell_state.message.startswith("sweep cancelled")
    finally:
        held.stop.set()
        worker.join(timeout=240)
    assert flow_client.get_sweep(sweep["id"])["status"] == "cancelled"
