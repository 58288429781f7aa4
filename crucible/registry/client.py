"""The registry's REST client: `ApiClient` and the errors it raises.

`ApiClient` is a thin typed wrapper of `/api/v1`: transient failures (connection errors, any
other httpx error - an undecodable body, a redirect loop -, 408/429/5xx, and a success answer
whose body is not JSON, as a proxy's HTML page) are retried with exponential backoff and then
raise `ApiUnavailable`; any other error answer raises `ApiError` at once. No other exception
leaves a request. `RecordsOwed` says that a run's final state could not be
recorded yet because some of its metrics and events have not reached the registry
(`crucible.registry.replay`). Only stdlib + httpx: importing this module never imports torch.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

__all__ = ["ApiError", "ApiUnavailable", "RecordsOwed", "ApiClient", "RegistryClient"]

_TRANSIENT = {408, 429, 500, 502, 503, 504}
_PREFIX = "/api/v1"


class ApiError(RuntimeError):
    """The API answered with an error; `status_code` and `detail` say which."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"API error {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled with its real arguments (Prefect may keep a failed task's exception)
        return type(self), (self.status_code, self.detail)


class ApiUnavailable(ApiError):
    """The API could not be reached (or kept failing with 5xx) after all retries."""


class RecordsOwed(ApiUnavailable):
    """A run's final state was not recorded: `owed` of its metrics and events (possibly 0: then
    only the final state itself) have not reached the registry yet. They wait in the run's spool
    folder `spool`; the next replay that delivers them records the final state. Transient: a
    retry replays first."""

    def __init__(self, run_id: str, owed: int, spool: str) -> None:
        message = (f"run {run_id}: {owed} records and its final state have not reached the "
                   f"registry yet (kept in {spool}); the final state is recorded once they "
                   "arrive (`crucible api replay` delivers them)")
        RuntimeError.__init__(self, message)   # the message alone, without "API error 0"
        self.status_code, self.detail = 0, message
        self.run_id, self.owed, self.spool = run_id, owed, spool

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.run_id, self.owed, self.spool)


class ApiClient:
    """Thin typed wrapper of the registry's REST API.

    Transient failures (module docstring) are retried `retries` times with exponential backoff
    starting at `backoff_s`, then raise `ApiUnavailable`; other error answers raise `ApiError`
    at once.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = 10.0,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ transport

    def request(self, method: str, path: str, *, json_body: Any = None,
                params: dict[str, Any] | None = None, retries: int | None = None) -> Any:
        """One API call with retries; returns the decoded JSON body. Raises only `ApiError`
        (`ApiUnavailable` for what may pass: see the class docstring)."""
        attempts = 1 + (self.retries if retries is None else retries)
        params = {k: v for k, v in (params or {}).items() if v is not None}
        for attempt in range(attempts):
            try:
                response = self._http.request(method, path, json=json_body, params=params)
            except httpx.HTTPError as exc:   # transport, undecodable content, redirects
                failure: ApiError = ApiUnavailable(0, f"{type(exc).__name__}: {exc}")
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError as exc:   # not JSON: not the API (a proxy's page)
                        kind = response.headers.get("content-type", "no content type")
                        failure = ApiUnavailable(response.status_code,
                                                 f"answer is not JSON ({kind}): {exc}")
                else:
                    failure = _error(response)
                    if response.status_code not in _TRANSIENT:
                        raise failure
            if attempt + 1 < attempts:
                time.sleep(self.backoff_s * 2**attempt)
        raise ApiUnavailable(failure.status_code, failure.detail)

    def _pages(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        cursor = None
        while True:
            page = self.request("GET", path, params={**params, "cursor": cursor})
            yield from page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                return

    # ------------------------------------------------------------ sweeps

    def create_sweep(self, name: str, spec: dict[str, Any] | None = None, *,
                     tags: list[str] | None = None, notes: str | None = None) -> dict[str, Any]:
        body = {"name": name, "spec": spec, "tags": tags, "notes": notes}
        return self.request("POST", f"{_PREFIX}/sweeps",
                            json_body={k: v for k, v in body.items() if v is not None})

    def get_sweep(self, sweep_ref: str) -> dict[str, Any]:
        """The sweep with this id, or the newest one with exactly this name."""
        return self.request("GET", f"{_PREFIX}/sweeps/{quote(sweep_ref, safe='')}")

    def update_sweep(self, sweep_id: str, **changes: Any) -> dict[str, Any]:
        """PATCH a sweep: status=, prefect_flow_run_id=, tags= (replaces) or add_tags= /
        remove_tags= (edited atomically), notes= (None clears), spec_annotations= (merged into
        the stored spec; crucible.grid.spec.ANNOTATIONS only)."""
        return self.request("PATCH", f"{_PREFIX}/sweeps/{sweep_id}", json_body=changes)

    def robustness(self, sweep_id: str) -> dict[str, Any]:
        return self.request("GET", f"{_PREFIX}/sweeps/{sweep_id}/robustness")

    def claims(self, sweep_id: str, *, duration: int | None = None) -> dict[str, Any]:
        params = None if duration is None else {"duration": duration}
        return self.request("GET", f"{_PREFIX}/sweeps/{sweep_id}/claims", params=params)

    def table(self, sweep_id: str) -> dict[str, Any]:
        return self.request("GET", f"{_PREFIX}/sweeps/{sweep_id}/table")

    # ------------------------------------------------------------ runs

    def create_run(self, config: dict[str, Any], *, sweep_id: str | None = None,
                   name: str | None = None, config_hash: str | None = None,
                   code_version: str | None = None, tags: list[str] | None = None,
                   notes: str | None = None, label: str | None = None) -> dict[str, Any]:
        """POST a run; `label` is its study block's (crucible.grid.spec.GridBlock.label)."""
        body = {"config": config, "sweep_id": sweep_id, "name": name,
                "config_hash": config_hash, "code_version": code_version, "tags": tags,
                "notes": notes, "label": label or None}
        return self.request("POST", f"{_PREFIX}/runs",
                            json_body={k: v for k, v in body.items() if v is not None})

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"{_PREFIX}/runs/{run_id}")

    def update_run(self, run_id: str, *, retries: int | None = None,
                   **changes: Any) -> dict[str, Any]:
        """PATCH a run: status=, status_reason=, owed_records=, final_val_loss=, summary=,
        tags= (replaces) or add_tags= / remove_tags= (edited atomically), notes= (None clears),
        ..."""
        return self.request("PATCH", f"{_PREFIX}/runs/{run_id}", json_body=changes,
                            retries=retries)

    def list_runs(self, **filters: Any) -> list[dict[str, Any]]:
        """Every run matching the filters (sweep_id, compression, strategy, p, seed, status,
        config_hash, code_version, tag), following pagination."""
        return list(self._pages(f"{_PREFIX}/runs", filters))

    # ------------------------------------------------------------ costs (crucible cost)

    def put_run_cost(self, run_id: str, record: dict[str, Any]) -> dict[str, Any]:
        """PUT the run's cost record on one deployment (crucible.pricing.cost.run_cost; replaces an
        earlier record of the same deployment name)."""
        return self.request("PUT", f"{_PREFIX}/runs/{run_id}/costs", json_body=record)

    def run_costs(self, run_id: str) -> list[dict[str, Any]]:
        return self.request("GET", f"{_PREFIX}/runs/{run_id}/costs")

    def sweep_costs(self, sweep_id: str, *, deployment: str | None = None) -> dict[str, Any]:
        params = None if deployment is None else {"deployment": deployment}
        return self.request("GET", f"{_PREFIX}/sweeps/{sweep_id}/costs", params=params)

    # ------------------------------------------------------------ metrics and events

    def post_metrics(self, run_id: str, items: list[dict[str, Any]], *,
                     retries: int | None = None) -> dict[str, Any]:
        return self.request("POST", f"{_PREFIX}/runs/{run_id}/metrics:batch",
                            json_body={"items": items}, retries=retries)

    def post_events(self, run_id: str, items: list[dict[str, Any]], *,
                    retries: int | None = None) -> dict[str, Any]:
        return self.request("POST", f"{_PREFIX}/runs/{run_id}/events:batch",
                            json_body={"items": items}, retries=retries)

    def list_metrics(self, run_id: str, *, name: str | None = None) -> list[dict[str, Any]]:
        return list(self._pages(f"{_PREFIX}/runs/{run_id}/metrics", {"name": name}))

    def list_events(self, run_id: str, *, kind: str | None = None) -> list[dict[str, Any]]:
        return list(self._pages(f"{_PREFIX}/runs/{run_id}/events", {"kind": kind}))


# the name the flows' and CLI's documentation uses for it
RegistryClient = ApiClient


def _error(response: httpx.Response) -> ApiError:
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    return ApiError(response.status_code, detail)
