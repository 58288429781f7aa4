"""Shared by the registry-reporting tests: what a trainer reports, a run whose reporter closes
while the API is down (its records left in a spool), and a proxy that answers what no client can
read."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from crucible.events import Event, Metric
from crucible.registry.reporting import ApiCallback, ApiClient

PER_STEP = 4        # what `emit` reports per global step: 2 train_loss, 1 val_loss, 1 event


def emit(callback: Any, steps: range) -> None:
    """What a trainer does: per global step, metrics per replica, an event, then flush."""
    for step in steps:
        for replica in range(2):
            callback.metric(Metric("train_loss", step, 3.0 - step * 0.01, tokens=64 * step,
                                   replica=replica))
        callback.metric(Metric("val_loss", step, 2.5 - step * 0.01))
        callback.event(Event("bypass", step, replica=step % 2, stage=1, detail={"step": step}))
        callback.flush()


def spool_while_down(api_server: Any, client: ApiClient, run_id: str, root: Path,
                     steps: range) -> int:
    """Report `steps` of run `run_id` while the API is stopped, close the reporter at once and
    start the API again; returns how many records the reporter left in its spool."""
    api_server.stop()
    try:
        callback = ApiCallback(client, run_id, root, close_timeout_s=0.0)
        emit(callback, steps)
        callback.close()
    finally:
        api_server.start()
    assert callback.owed_records is not None
    return callback.owed_records


class FlakyProxy:
    """A real HTTP proxy in front of the API that, while `broken` names a kind of answer, sends
    that instead of forwarding: "html" (a 200 with a proxy's maintenance page), "bad-gzip" (a
    200 whose body does not decode). With `broken` None it forwards every request."""

    _ANSWERS = {"html": ({"Content-Type": "text/html"}, b"<html>down for maintenance</html>"),
                "bad-gzip": ({"Content-Type": "application/json", "Content-Encoding": "gzip"},
                             b"this is not gzip")}

    def __init__(self, upstream: str) -> None:
        self.broken: str | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.broken is not None:
                    (headers, content), status = proxy._ANSWERS[proxy.broken], 200
                else:
                    answer = httpx.request(self.command, upstream + self.path, content=body,
                                           headers={k: v for k, v in self.headers.items()
                                                    if k.lower() not in ("host", "connection")})
                    headers = {"Content-Type": answer.headers.get("content-type", "")}
                    content, status = answer.content, answer.status_code
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(content))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PATCH = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
