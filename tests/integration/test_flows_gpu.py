"""GPU slots: a per-host global concurrency limit, created on first use, never oversubscribed,
granted in arrival order, freed at once when its holder's process is killed; a run measures the
memory it may use only once it holds its slot."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client

import crucible.memory
import crucible.train
import flows.run_flow
from crucible.registry.reporting import ApiClient
from flows.gpu import (
    ensure_gpu_limit,
    gpu_limit_name,
    gpu_slot,
    local_device_count,
    release_dead_holders,
    release_slots,
    slot_holders,
)
from flows.run_flow import train_run

pytestmark = pytest.mark.integration


def test_limit_is_named_per_host_and_sized_by_devices(prefect_harness: None) -> None:
    assert gpu_limit_name() == f"gpu:{socket.gethostname()}"
    assert local_device_count() == 1          # this CPU machine: one job at a time
    slots = ensure_gpu_limit()
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(gpu_limit_name())
    assert slots == limit.limit == 1


def test_existing_limit_is_left_as_the_operator_set_it(prefect_harness: None) -> None:
    name = "gpu:operator-host"
    assert ensure_gpu_limit(name, slots=3) == 3
    assert ensure_gpu_limit(name, slots=1) == 3


def test_holders_never_exceed_the_slots(prefect_harness: None) -> None:
    name = "gpu:busy-host"
    ensure_gpu_limit(name, slots=2)
    active, peak, lock = [0], [0], threading.Lock()
    both = threading.Event()   # two holders at once: the two slots were granted together

    def hold() -> None:
        with gpu_slot(name, timeout_s=60):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
                if active[0] == 2:
                    both.set()
            # hold until a second holder is in (or long enough that a second slot, if it is
            # granted at all, is granted meanwhile): a loaded host's slower grant must not let
            # the first release before the second is granted
            both.wait(timeout=10)
            time.sleep(0.2)
            with lock:
                active[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert peak[0] == 2
    assert active[0] == 0


TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64", "train.global_steps=2"]


@pytest.mark.timeout(300)
def test_a_queued_run_is_not_refused_for_memory_its_sibling_holds(
        prefect_harness: None, flow_client: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs, one slot (this CPU machine): the second waits for the slot while the first
    trains. While a run trains it holds the machine's memory (`available` reports 1 MiB
    left, as a big run would leave it); the second run must measure once the slot is its own,
    not while it queues behind the first."""
    training, slot_calls = [0], [0]
    go_on = threading.Event()    # the second run queued for the slot, or gave up before
    real_train, real_available, real_slot = (crucible.train.train, crucible.memory.available,
                                             flows.run_flow.gpu_slot)

    def train(*args: Any, **kwargs: Any) -> dict[str, Any]:
        training[0] += 1
        try:   # hold the memory until the second run queues for the slot
            go_on.wait(timeout=120)
            return real_train(*args, **kwargs)
        finally:
            training[0] -= 1

    def available() -> tuple[int | None, str]:
        return (1 << 20, "MemAvailable") if training[0] else real_available()

    @contextmanager
    def slot(*args: Any, **kwargs: Any) -> Iterator[str]:
        slot_calls[0] += 1
        if slot_calls[0] == 2:
            go_on.set()
        with real_slot(*args, **kwargs) as name:
            yield name

    monkeypatch.setattr(crucible.train, "train", train)
    monkeypatch.setattr(crucible.memory, "available", available)
    monkeypatch.setattr(flows.run_flow, "gpu_slot", slot)
    first: list[Any] = []
    sibling = threading.Thread(target=lambda: first.append(
        train_run(preset="smoke", overrides=TINY, return_state=True)))
    sibling.start()
    deadline = time.monotonic() + 120
    while not training[0] and sibling.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert training[0], "the first run never started training"
    try:
        second = train_run(preset="smoke", overrides=[*TINY, "seed=2"], return_state=True)
    finally:
        go_on.set()
        sibling.join(timeout=180)
    assert first and first[0].is_completed(), first
    assert second.is_completed(), second.message
    assert flow_client.get_run(second.result()["run_id"])["status"] == "completed"


@pytest.mark.timeout(300)
def test_memory_other_programs_hold_for_now_is_waited_for_not_a_failure(
        prefect_harness: None, flow_client: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """In its slot, the run finds 1 MiB available (another program holds the rest) the first
    time it looks: it would fit this machine alone, so the attempt is retried, not failed."""
    looks: list[int] = []
    real_available = crucible.memory.available

    def available() -> tuple[int | None, str]:
        looks.append(1)
        return (1 << 20, "MemAvailable") if len(looks) == 1 else real_available()

    monkeypatch.setattr(crucible.memory, "available", available)
    state = train_run(preset="smoke", overrides=[*TINY, "seed=3"], return_state=True)
    assert state.is_completed(), state.message
    assert len(looks) == 2                      # refused once, then measured again and run
    assert flow_client.get_run(state.result()["run_id"])["status"] == "completed"


# --- slots of dead holders, arrival order, one server's holders (issue 37) -------------------

_HOLDER = """
import sys, time
from flows.gpu import gpu_slot
with gpu_slot(sys.argv[1], run="victim", flow_run_id=sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


def _active(name: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


@contextmanager
def _holder_process(name: str, flow_run_id: str) -> Iterator[subprocess.Popen[str]]:
    """A real process holding a slot of `name` for flow run `flow_run_id`, on this test's
    Prefect server; yielded once it holds the slot."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, name, flow_run_id], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(240)
def test_a_sigkilled_holders_slot_is_released_by_the_crash_hook(prefect_harness: None) -> None:
    """The worker killed the run's process (SIGKILL) before the crash hook runs: the hook's
    `release_slots` must release exactly that dead holder's slot, not skip it."""
    name = "gpu:killed-holder-host"
    ensure_gpu_limit(name, slots=1)
    flow_run_id = str(uuid.uuid4())
    with _holder_process(name, flow_run_id) as proc:
        assert _active(name) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert release_slots([flow_run_id]) == 1
    assert _active(name) == 0
    assert slot_holders(name) == []


@pytest.mark.timeout(240)
def test_a_sigkilled_holders_slot_goes_to_the_next_waiter_without_a_hook(
        prefect_harness: None) -> None:
    """No hook ran (serve itself was killed): the next run on the host finds the holder dead
    and takes its slot at once, well inside the 300 s lease."""
    name = "gpu:killed-no-hook-host"
    ensure_gpu_limit(name, slots=1)
    with _holder_process(name, str(uuid.uuid4())) as proc:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with gpu_slot(name, timeout_s=60, run="next"):
        assert [h["run"] for h in slot_holders(name)] == ["next"]
        assert _active(name) == 1
    assert _active(name) == 0


@pytest.mark.timeout(240)
def test_slots_are_granted_in_arrival_order(prefect_harness: None) -> None:
    name = "gpu:fifo-host"
    ensure_gpu_limit(name, slots=1)
    queue = Path(os.environ["CRUCIBLE_GPU_SLOTS_DIR"]) / "queue"
    granted: list[int] = []
    lock = threading.Lock()

    def tickets() -> int:
        return sum(1 for p in queue.glob("*.json") if name in p.read_text())

    def wait(index: int) -> None:
        with gpu_slot(name, timeout_s=180, run=f"run-{index}"):
            with lock:
                granted.append(index)

    threads = []
    with gpu_slot(name, timeout_s=60, run="first"):
        for index in range(4):
            threads.append(threading.Thread(target=wait, args=(index,)))
            threads[-1].start()
            while tickets() < index + 1:      # this waiter queued before the next arrives
                time.sleep(0.02)
    for thread in threads:
        thread.join(timeout=200)
    assert granted == [0, 1, 2, 3]


def test_held_by_names_only_this_servers_runs(prefect_harness: None) -> None:
    """Another Prefect server's holder on the same host (another stack) is neither named nor
    released, even when its process is gone."""
    name = "gpu:shared-host"
    ensure_gpu_limit(name, slots=2)
    folder = Path(os.environ["CRUCIBLE_GPU_SLOTS_DIR"])
    other = {"limit": name, "server": "http://127.0.0.1:1/api", "run": "theirs",
             "flow_run_id": None, "lease_id": str(uuid.uuid4())}
    live_other = folder / f"{other['lease_id']}.json"
    live_other.write_text(json.dumps({**other, "pid": os.getpid()}))
    dead_other = folder / f"{uuid.uuid4()}.json"
    dead_other.write_text(json.dumps({**other, "pid": 2 ** 22 + 1}))   # no such process
    try:
        with gpu_slot(name, timeout_s=60, run="ours"):
            assert [h["run"] for h in slot_holders(name)] == ["ours"]
            assert release_dead_holders(name) == 0
        assert live_other.exists() and dead_other.exists()
    finally:
        live_other.unlink()
        dead_other.unlink()
