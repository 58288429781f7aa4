"""docs/REST.md's curl examples, run in order against the real app over Postgres, so the guide
cannot drift from the API. Each ```sh block is either a curl command (method, URL, headers and
body parsed with shlex, `$VARS` filled in) or `export NAME=<field from the answer above>`, which
takes that field from the previous answer. Only the headers the guide shows are sent: a write
without its token would fail here as it would for a reader."""
from __future__ import annotations

import json
import re
import shlex
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.postgres import REGISTRY_TOKEN

pytestmark = pytest.mark.integration

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "REST.md"
_BLOCK = re.compile(r"```sh\n(.*?)```", re.DOTALL)
_CAPTURE = re.compile(r"export (\w+)=<(\w+) from the answer above>")
_VAR = re.compile(r"\$(\w+)")


def _curl(command: str) -> tuple[str, str, dict[str, str], str | None]:
    """`curl ...` -> (method, url, headers, body)."""
    args = shlex.split(command.replace("\\\n", " "), comments=True)
    assert args[0] == "curl", command
    method, url, headers, body = "GET", None, {}, None
    rest = iter(args[1:])
    for arg in rest:
        if arg == "-X":
            method = next(rest)
        elif arg == "-H":
            name, value = next(rest).split(":", 1)
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            body = next(rest)
        elif arg.startswith("$CRUCIBLE_API/"):
            url = arg
        else:
            assert arg == "-sS", f"an option the guide test does not know: {arg}"
    assert url is not None, command
    return method, url, headers, body


def _steps() -> list[tuple[str, Any]]:
    steps: list[tuple[str, Any]] = []
    for block in _BLOCK.findall(GUIDE.read_text()):
        if block.lstrip().startswith("curl"):
            steps.append(("curl", _curl(block)))
        elif capture := _CAPTURE.search(block):
            steps.append(("capture", (capture[1], capture[2])))
    return steps


@pytest.fixture
def client(registry_app: Any) -> Iterator[Any]:
    """A client that sends no token of its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    with TestClient(registry_app) as test_client:
        yield test_client


def test_rest_guide_examples_run_against_the_api(client: Any) -> None:
    env = {"CRUCIBLE_API": "", "CRUCIBLE_TOKEN": REGISTRY_TOKEN}
    fill = lambda text: _VAR.sub(lambda m: env[m[1]], text)  # noqa: E731
    answer: dict[str, Any] = {}
    ran: list[str] = []
    for kind, step in _steps():
        if kind == "capture":
            name, field = step
            assert answer.get(field), f"{name}: the previous answer has no {field}: {answer}"
            env[name] = str(answer[field])
            continue
        method, url, headers, body = step
        headers = {name: fill(value) for name, value in headers.items()}
        content = fill(body) if body is not None else None
        if content is not None:
            json.loads(content)  # the guide's body is valid JSON once the variables are in
        response = client.request(method, fill(url), headers=headers, content=content)
        assert response.status_code < 300, f"{method} {url}: {response.status_code} {response.text}"
        answer = response.json()
        if url.endswith(":batch"):
            assert answer["inserted"] == answer["received"] > 0, answer
        if method == "GET" and "items" in answer and "/robustness" not in url:
            assert answer["items"], f"{url} lists nothing: its filters match no example data"
        if "/robustness" in url:
            assert len(answer["missing_baselines"]) == 1, answer
        if url.endswith("/costs") and method == "GET":
            assert answer and answer[0]["deployment"] == "cloud-8x4-spot", answer
        if "/sweeps/$SWEEP_ID/costs" in url:
            assert answer["cells"][0]["strategy"] == "skip", answer
        ran.append(f"{method} {url.split('?')[0]}")
    assert ran == [
        "POST $CRUCIBLE_API/api/v1/sweeps", "POST $CRUCIBLE_API/api/v1/runs",
        "POST $CRUCIBLE_API/api/v1/runs/$RUN_ID/metrics:batch",
        "POST $CRUCIBLE_API/api/v1/runs/$RUN_ID/events:batch",
        "PATCH $CRUCIBLE_API/api/v1/runs/$RUN_ID",
        "PATCH $CRUCIBLE_API/api/v1/runs/$RUN_ID", "PATCH $CRUCIBLE_API/api/v1/sweeps/$SWEEP_ID",
        "GET $CRUCIBLE_API/api/v1/runs", "GET $CRUCIBLE_API/api/v1/sweeps",
        "GET $CRUCIBLE_API/api/v1/runs", "GET $CRUCIBLE_API/api/v1/runs",
        "GET $CRUCIBLE_API/api/v1/sweeps",
        "GET $CRUCIBLE_API/api/v1/runs/$RUN_ID/metrics",
        "GET $CRUCIBLE_API/api/v1/runs/$RUN_ID/metrics",
        "GET $CRUCIBLE_API/api/v1/runs/$RUN_ID/events",
        "GET $CRUCIBLE_API/api/v1/sweeps/rest%20guide%20sweep",
        "GET $CRUCIBLE_API/api/v1/sweeps/$SWEEP_ID/robustness",
        "GET $CRUCIBLE_API/api/v1/sweeps/$SWEEP_ID/table",
        "GET $CRUCIBLE_API/api/v1/sweeps/$SWEEP_ID/claims",
        "PUT $CRUCIBLE_API/api/v1/runs/$RUN_ID/costs",
        "GET $CRUCIBLE_API/api/v1/runs/$RUN_ID/costs",
        "GET $CRUCIBLE_API/api/v1/sweeps/$SWEEP_ID/costs"]
    assert env["CURSOR"]
