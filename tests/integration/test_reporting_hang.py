"""A hung registry never stalls training: the trainer's callback calls return while the
reporter's sender is stuck inside a request that the API never answers, `close()` returns with
the rest in the spool, and a later replay delivers every record exactly once to the real API."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from crucible.registry.reporting import (
    ApiCallback,
    ApiClient,
    RecordsOwed,
    record_finish,
    replay_spools,
)
from tests.integration.reporting_helpers import PER_STEP, emit, spool_while_down

pytestmark = pytest.mark.integration


class _HungApi:
    """A real TCP server that accepts connections, reads each request and never answers (until
    `release()`, which closes the connections): an API stuck on a lock or a dead disk."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.requests: list[str] = []
        self.request_seen = threading.Event()
        self._released = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                conn.close()
                return
            head += chunk
        self._held.append(conn)
        self.requests.append(head.split(b"\r\n", 1)[0].decode())
        self.request_seen.set()
        self._released.wait()
        conn.close()

    def unanswered(self) -> int:
        """Requests whose client is still waiting for an answer (its connection is open)."""
        waiting = 0
        for conn in self._held:
            try:    # b"" once the client has closed; unread body bytes or nothing: still there
                waiting += conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
            except BlockingIOError:
                waiting += 1
            except OSError:
                pass
        return waiting

    def release(self) -> None:
        self._released.set()
        self._server.close()


def _replay_all(client: ApiClient, root) -> int:
    """Replay until nothing is left (a sender that was stuck lets go of its spool once its
    request ends); returns the records delivered."""
    delivered = 0
    for _ in range(300):
        report = replay_spools(client, root)
        delivered += report.delivered
        if report.complete:
            return delivered
        time.sleep(0.1)
    raise AssertionError(f"spools under {root} still hold records: {report}")


def _assert_stored_once(client: ApiClient, run_id: str, steps: range) -> None:
    metrics = client.list_metrics(run_id)
    assert sorted((m["name"], m["global_step"], m["replica"] or 0) for m in metrics) == sorted(
        [("train_loss", s, r) for s in steps for r in range(2)]
        + [("val_loss", s, 0) for s in steps])
    assert sorted(e["global_step"] for e in client.list_events(run_id)) == list(steps)


@pytest.fixture
def real(api_server):
    with ApiClient(api_server.url, api_server.token) as client:
        yield client


@pytest.fixture
def hung():
    server = _HungApi()
    yield server
    server.release()


def test_a_hung_api_never_blocks_the_training_thread(real, hung, tmp_path):
    run_id = real.create_run({"seed": 7})["id"]
    with ApiClient(hung.url, "token", timeout_s=600, retries=0) as client:
        callback = ApiCallback(client, run_id, tmp_path, batch_size=50, flush_interval_s=0.0,
                               queue_batches=4, close_timeout_s=0.5)
        emit(callback, range(1))
        assert hung.request_seen.wait(60)       # the sender is inside a POST never answered
        emit(callback, range(1, 60))           # ... and the training thread goes on
        assert hung.requests == [f"POST /api/v1/runs/{run_id}/metrics:batch HTTP/1.1"]
        assert hung.unanswered() == 1           # while that request is still pending
        assert not callback.wait_handled(0)
        assert callback.spooled                 # the full queue spilled to disk, not to the API
        callback.close()                        # bounded: returns with the sender still stuck
        assert hung.unanswered() == 1
        assert callback.owed_records == 60 * PER_STEP
        hung.release()
    assert _replay_all(real, tmp_path) == 60 * PER_STEP
    _assert_stored_once(real, run_id, range(60))


def test_replaying_old_spools_happens_off_the_training_thread(api_server, real, hung, tmp_path):
    earlier = real.create_run({"seed": 8})["id"]
    assert spool_while_down(api_server, real, earlier, tmp_path, range(5)) == 5 * PER_STEP
    run_id = real.create_run({"seed": 9})["id"]
    with ApiClient(hung.url, "token", timeout_s=600, retries=0) as client:
        callback = ApiCallback(client, run_id, tmp_path, flush_interval_s=0.0,
                               close_timeout_s=0.5)
        assert hung.request_seen.wait(60)       # its sender is replaying the earlier spool
        assert hung.requests == [f"POST /api/v1/runs/{earlier}/metrics:batch HTTP/1.1"]
        emit(callback, range(20))              # the training thread does not wait for it
        assert hung.unanswered() == 1
        callback.close()
        assert callback.owed_records == 20 * PER_STEP
        hung.release()
    _replay_all(real, tmp_path)
    _assert_stored_once(real, earlier, range(5))
    _assert_stored_once(real, run_id, range(20))


def test_a_settle_stuck_on_a_hung_api_does_not_keep_a_retry_from_recording(real, hung,
                                                                              tmp_path):
    """finish-run's first attempt hangs inside its PATCH; its retry, through another client,
    still writes the run's final state, and the next replay records that newest one."""
    run_id = real.create_run({"seed": 10})["id"]
    first = {"status": "completed", "status_reason": None, "final_val_loss": 2.1}
    newest = {**first, "final_val_loss": 2.2}
    stuck: list[BaseException] = []

    def first_attempt() -> None:
        with ApiClient(hung.url, "token", timeout_s=600, retries=0) as client:
            try:
                record_finish(client, tmp_path, run_id, first, timeout_s=600)
            except RecordsOwed as exc:
                stuck.append(exc)

    attempt = threading.Thread(target=first_attempt)
    attempt.start()
    assert hung.request_seen.wait(60)      # its PATCH is never answered
    assert hung.requests == [f"PATCH /api/v1/runs/{run_id} HTTP/1.1"]
    with pytest.raises(RecordsOwed):        # the final state waits on disk for the next replay
        record_finish(real, tmp_path, run_id, newest, timeout_s=0.5)
    hung.release()
    attempt.join()
    assert len(stuck) == 1
    assert replay_spools(real, tmp_path).finished == [run_id]
    run = real.get_run(run_id)
    assert (run["status"], run["final_val_loss"]) == ("completed", 2.2)
