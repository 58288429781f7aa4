"""GPU slots: a per-host global concurrency limit, created on first use, never oversubscribed."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from prefect.client.orchestration import get_client

from flows.gpu import ensure_gpu_limit, gpu_limit_name, gpu_slot, local_device_count

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

    def hold() -> None:
        with gpu_slot(name, timeout_s=60):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.4)
            with lock:
                active[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert peak[0] == 2
    assert active[0] == 0
