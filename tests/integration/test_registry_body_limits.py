"""Bodies are refused before they are read: a write without a valid token gets its 401 before any
body byte is received, and a body over its endpoint's limit gets a 413 as soon as the limit is
passed (or at once, from its Content-Length).

The app is driven at the ASGI level with a body that would be 1 GiB, counting how many chunks the
server pulls; the real uvicorn server is probed over a socket with headers only.
"""
from __future__ import annotations

import concurrent.futures
import json
import socket
import uuid

import anyio
import pytest

from api.middleware import BODY_LIMITS
from api.schemas import MAX_INT, MAX_SMALL
from tests.fixtures.postgres import REGISTRY_TOKEN

pytestmark = pytest.mark.integration

V1 = "/api/v1"
CHUNK = 64 * 1024
HUGE = 1024**3  # what the client would send if nothing stopped it
AUTH = [(b"authorization", f"Bearer {REGISTRY_TOKEN}".encode())]


def _drive(app, *, method: str, path: str, headers: list[tuple[bytes, bytes]],
           declared: int | None = None) -> tuple[int, int, bytes]:
    """Send `method path` with a 1 GiB body of 64 KiB chunks (never declared unless `declared`);
    return the status, how many chunks the app pulled and the response body."""
    pulled = 0
    status = 0
    body = b""

    async def receive():
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b" " * CHUNK,
                "more_body": pulled * CHUNK < HUGE}

    async def send(message):
        nonlocal status, body
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body += message.get("body", b"")

    extra = [(b"content-length", str(declared).encode())] if declared is not None else []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "server": ("testserver", 80),
             "client": ("127.0.0.1", 5000),
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         *headers, *extra]}
    # a loop of its own, in a thread of its own: an earlier test may leave the main thread's
    # event loop running (Prefect's harness, Playwright), and anyio.run refuses to nest
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(anyio.run, app, scope, receive, send).result()
    return status, pulled, body


@pytest.mark.parametrize("headers", [[], [(b"authorization", b"Bearer wrong")]],
                         ids=["no-token", "wrong-token"])
@pytest.mark.parametrize("method,path", [
    ("POST", f"{V1}/runs/{uuid.UUID(int=1, version=4)}/metrics:batch"),
    ("POST", f"{V1}/runs/{uuid.UUID(int=2, version=4)}/events:batch"),
    ("POST", f"{V1}/sweeps"),
    ("PATCH", f"{V1}/runs/{uuid.UUID(int=3, version=4)}"),
])
def test_write_without_a_valid_token_gets_401_before_its_body_is_read(
        registry_app, headers, method, path):
    status, pulled, body = _drive(registry_app, method=method, path=path, headers=headers)
    assert status == 401, body
    assert pulled == 0
    assert "token" in json.loads(body)["detail"]


@pytest.mark.parametrize("endpoint,path", [
    ("metrics", f"{V1}/runs/{uuid.UUID(int=4, version=4)}/metrics:batch"),
    ("events", f"{V1}/runs/{uuid.UUID(int=5, version=4)}/events:batch"),
    ("documents", f"{V1}/sweeps"),
])
def test_streamed_body_over_the_endpoint_limit_gets_413_once_the_limit_is_passed(
        registry_app, endpoint, path):
    status, pulled, body = _drive(registry_app, method="POST", path=path, headers=AUTH)
    assert status == 413, body
    limit = BODY_LIMITS[endpoint]
    assert pulled == limit // CHUNK + 1  # the chunk that passed the limit, not one more
    assert str(limit) in json.loads(body)["detail"]


def test_declared_body_over_the_endpoint_limit_gets_413_without_reading(registry_app):
    path = f"{V1}/runs/{uuid.uuid4()}/metrics:batch"
    status, pulled, _ = _drive(registry_app, method="POST", path=path, headers=AUTH,
                               declared=BODY_LIMITS["metrics"] + 1)
    assert (status, pulled) == (413, 0)


def test_endpoint_limits_hold_the_widest_full_batches(registry):
    """10,000 metric items with every field at its widest, indented, fit the metrics limit
    (benchmarks/body_sizes.py measures the same body for docs/OPERATIONS.md)."""
    run_id = registry.post(f"{V1}/runs", json={"config": {}}).json()["id"]
    items = [{"name": "train_loss", "global_step": MAX_INT - i, "tokens": MAX_INT,
              "replica": MAX_SMALL, "value": -2.2250738585072014e-308} for i in range(10_000)]
    body = json.dumps({"items": items}, indent=2).encode()
    assert len(body) < BODY_LIMITS["metrics"]
    response = registry.post(f"{V1}/runs/{run_id}/metrics:batch", content=body,
                             headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text[:500]
    assert response.json()["inserted"] == 10_000


def test_server_answers_401_before_the_body_is_sent(api_server):
    """Over a real socket: headers announcing a 16 MiB body, and not one body byte. The server
    must answer at once instead of waiting for (and buffering) the body."""
    request = (f"POST {V1}/runs/{uuid.uuid4()}/metrics:batch HTTP/1.1\r\n"
               f"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {16 * 1024**2}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=20) as sock:
        sock.sendall(request)
        head = sock.recv(4096).decode(errors="replace")  # a hang here is the failure
    assert head.startswith("HTTP/1.1 401"), head
