"""`crucible deploy` (serve) outlasts a Prefect outage (issue 37): Prefect's own runner gives up
after 3 failed polls and exits; serve keeps polling with a bounded back-off, one log line per
failed poll, and serves again once the API answers.

Real parts: the real `crucible deploy` process against the test harness's Prefect server,
reached through a TCP relay that the test cuts (connection refused, as while the server or its
database is down) and restores. The client's own retries are turned off
(`PREFECT_CLIENT_MAX_RETRIES=0`) so that every poll of the outage fails at once.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


class _Relay:
    """Forwards 127.0.0.1:<port> to `target` until `cut()`; `restore()` listens again on the
    same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._server: socket.socket | None = None
        self._open: list[socket.socket] = []
        self.restore()

    def restore(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        self._server = None
        for conn in self._open:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._open.clear()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _wait_for_line(log: Path, needle: str, proc: subprocess.Popen[bytes]) -> None:
    while needle not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


@contextmanager
def _serve(tmp_path: Path, *, cut: bool = False) -> Iterator[tuple[_Relay, subprocess.Popen[bytes],
                                                                    Path]]:
    """(relay, process, log): the real `crucible deploy` reaching the test harness's Prefect
    server through a relay (already cut with `cut`); on leaving, serve is stopped with SIGTERM
    (killed if it has not stopped within 60 s) and the relay cut."""
    from prefect.settings import PREFECT_API_URL

    harness = urlsplit(str(PREFECT_API_URL.value()))
    relay = _Relay((harness.hostname or "127.0.0.1", harness.port or 80))
    if cut:
        relay.cut()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PREFECT_API_URL": f"http://127.0.0.1:{relay.port}{harness.path}",
           "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_CLIENT_MAX_RETRIES": "0",
           "PREFECT_HOME": str(tmp_path / "prefect-home")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "deploy"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    try:
        yield relay, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if relay._server is not None:
            relay.cut()


@pytest.mark.timeout(400)
def test_serve_keeps_polling_through_an_outage_and_serves_again(prefect_harness: None,
                                                                 tmp_path: Path) -> None:
    with _serve(tmp_path) as (relay, proc, log):
        _wait_for_line(log, "Your deployments are being served", proc)
        relay.cut()
        # Prefect's runner exits after its 3rd failed poll; serve goes on
        _wait_for_line(log, "failed poll 5", proc)
        relay.restore()
        _wait_for_line(log, "Prefect API reachable again", proc)
        assert proc.poll() is None


@pytest.mark.timeout(300)
def test_serve_applies_its_deployments_through_an_outage_at_start(prefect_harness: None,
                                                                  tmp_path: Path) -> None:
    """The Prefect server is unreachable while serve applies its deployments (a database
    restart answers 503, a dead server refuses): serve tries again with a bounded back-off, a
    log line per try, and serves once the server is back."""
    with _serve(tmp_path, cut=True) as (relay, proc, log):
        _wait_for_line(log, "applying the deployments failed", proc)
        _wait_for_line(log, "attempt 2", proc)
        relay.restore()
        _wait_for_line(log, "Your deployments are being served", proc)
        assert proc.poll() is None


def test_what_counts_as_an_outage_when_applying_the_deployments() -> None:
    import httpx

    from flows.deploy import _transient

    request = httpx.Request("POST", "http://prefect/api/deployments/")

    def status(code: int) -> httpx.HTTPStatusError:
        return httpx.HTTPStatusError("x", request=request,
                                     response=httpx.Response(code, request=request))

    assert _transient(httpx.ConnectError("refused", request=request))
    assert _transient(status(503)) and _transient(status(500))
    assert not _transient(status(422)) and not _transient(ValueError("bad parameters"))
    try:
        try:
            raise status(503)
        except httpx.HTTPStatusError as inner:
            raise RuntimeError("apply failed") from inner
    except RuntimeError as wrapped:
        assert _transient(wrapped)
