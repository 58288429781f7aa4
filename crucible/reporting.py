"""Client of the run registry: `ApiClient` (REST calls) and `ApiCallback`, the trainer callback
that reports metrics and events to the API without ever losing or duplicating one.

How `ApiCallback` keeps that promise:
- records are buffered and sent in batches (size or time triggered; time is checked on every
  call, no background thread, so the trainer's step is the clock);
- a batch that cannot be delivered (connection error, 5xx, 408/429 after retries with backoff) is
  appended to an append-only spool file in `spool_dir` and fsynced, so `flush()` always leaves
  everything received either stored by the API or on disk;
- while the spool is non-empty, new batches queue behind it, and the spool is replayed in order
  (throttled by exponential backoff) once the API answers again; a `.offset` file remembers how
  far the replay got;
- duplicates are impossible by construction of the API: metrics are keyed by (name, step,
  replica), events by their deterministic id, and both endpoints ignore rows already stored, so
  re-sending after a crash between "sent" and "offset written" is harmless;
- `close()` leaves anything undeliverable in the spool, and the next `ApiCallback` on the same
  `spool_dir` replays it when it starts (each record names its run).
A batch the API refuses as invalid (other 4xx) is moved to `<spool>.rejected` and logged, so one
bad record cannot block the queue; 401/403 raise `ApiError` (a configuration mistake).

Only stdlib + httpx: importing this module never imports torch.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from crucible.events import Event, Metric

__all__ = ["ApiError", "ApiUnavailable", "ApiClient", "ApiCallback"]

_log = logging.getLogger(__name__)
_TRANSIENT = {408, 429, 500, 502, 503, 504}
_PREFIX = "/api/v1"


class ApiError(RuntimeError):
    """The API answered with an error; `status_code` and `detail` say which."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"API error {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class ApiUnavailable(ApiError):
    """The API could not be reached (or kept failing with 5xx) after all retries."""


class ApiClient:
    """Thin typed wrapper of the registry's REST API.

    Transient failures (connection errors, 408/429/5xx) are retried `retries` times with
    exponential backoff starting at `backoff_s`, then raise `ApiUnavailable`; other errors raise
    `ApiError` at once.
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
        """One API call with retries; returns the decoded JSON body."""
        attempts = 1 + (self.retries if retries is None else retries)
        params = {k: v for k, v in (params or {}).items() if v is not None}
        for attempt in range(attempts):
            try:
                response = self._http.request(method, path, json=json_body, params=params)
            except httpx.TransportError as exc:
                failure: ApiError = ApiUnavailable(0, f"{type(exc).__name__}: {exc}")
            else:
                if response.status_code < 400:
                    return response.json()
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

    def create_sweep(self, name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("POST", f"{_PREFIX}/sweeps", json_body={"name": name, "spec": spec})

    def get_sweep(self, sweep_id: str) -> dict[str, Any]:
        return self.request("GET", f"{_PREFIX}/sweeps/{sweep_id}")

    def update_sweep(self, sweep_id: str, **changes: Any) -> dict[str, Any]:
        """PATCH a sweep: status=..., prefect_flow_run_id=..."""
        return self.request("PATCH", f"{_PREFIX}/sweeps/{sweep_id}", json_body=changes)

    def robustness(self, sweep_id: str) -> dict[str, Any]:
        return self.request("GET", f"{_PREFIX}/sweeps/{sweep_id}/robustness")

    def table(self, sweep_id: str) -> dict[str, Any]:
        return self.request("GET", f"{_PREFIX}/sweeps/{sweep_id}/table")

    # ------------------------------------------------------------ runs

    def create_run(self, config: dict[str, Any], *, sweep_id: str | None = None,
                   name: str | None = None, config_hash: str | None = None,
                   code_version: str | None = None) -> dict[str, Any]:
        body = {"config": config, "sweep_id": sweep_id, "name": name,
                "config_hash": config_hash, "code_version": code_version}
        return self.request("POST", f"{_PREFIX}/runs",
                            json_body={k: v for k, v in body.items() if v is not None})

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"{_PREFIX}/runs/{run_id}")

    def update_run(self, run_id: str, **changes: Any) -> dict[str, Any]:
        """PATCH a run: status=, status_reason=, final_val_loss=, summary=, ..."""
        return self.request("PATCH", f"{_PREFIX}/runs/{run_id}", json_body=changes)

    def list_runs(self, **filters: Any) -> list[dict[str, Any]]:
        """Every run matching the filters (sweep_id, compression, strategy, p, seed, status,
        config_hash, code_version), following pagination."""
        return list(self._pages(f"{_PREFIX}/runs", filters))

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


def _error(response: httpx.Response) -> ApiError:
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    return ApiError(response.status_code, detail)


Sender = Callable[[dict[str, Any]], None]


class _Spool:
    """An append-only JSON-lines file of undelivered batches, plus the byte offset up to which
    they have been delivered. The owner holds an exclusive flock on it while open."""

    def __init__(self, path: Path) -> None:
        """Open and lock `path`; raises BlockingIOError when another live owner holds it."""
        self.path = path
        self.offset_path = path.with_name(path.name + ".offset")
        self.rejected_path = path.with_name(path.name + ".rejected")
        self._fh: IO[str] = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.close()
            raise
        self._drop_torn_tail()

    def _drop_torn_tail(self) -> None:
        # a process killed mid-append leaves a partial last line that was never acknowledged
        self._fh.seek(0)
        data = self._fh.read()
        if data and not data.endswith("\n"):
            self._fh.truncate(len(data[: data.rfind("\n") + 1].encode("utf-8")))

    def append(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def _offset(self) -> int:
        try:
            return int(self.offset_path.read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def _set_offset(self, offset: int) -> None:
        tmp = self.offset_path.with_name(self.offset_path.name + ".tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self.offset_path)

    def reject(self, record: dict[str, Any], error: ApiError) -> None:
        """Keep a batch the API refused as invalid aside (never silently dropped)."""
        _log.error("registry refused a batch of %d %s (%s); kept in %s", len(record["items"]),
                   record["kind"], error, self.rejected_path)
        with open(self.rejected_path, "a", encoding="utf-8") as rejected:
            rejected.write(json.dumps(record) + "\n")

    def pending(self) -> bool:
        return os.path.getsize(self.path) > self._offset()

    def drain(self, send: Sender) -> None:
        """Send every undelivered record in order; stops at (and re-raises) the first
        ApiUnavailable. Rejected records go to the `.rejected` file."""
        offset = self._offset()
        with open(self.path, "rb") as reader:
            reader.seek(offset)
            for line in reader:
                try:
                    send(json.loads(line))
                except ApiUnavailable:
                    raise
                except ApiError as exc:
                    if exc.status_code in (401, 403):
                        raise
                    self.reject(json.loads(line), exc)
                offset += len(line)
                self._set_offset(offset)
        self._fh.truncate(0)
        self.offset_path.unlink(missing_ok=True)

    def close(self, *, remove_if_empty: bool = True) -> None:
        empty = not self.pending()
        if empty and remove_if_empty:
            self.path.unlink(missing_ok=True)
            self.offset_path.unlink(missing_ok=True)
        self._fh.close()


class ApiCallback:
    """`crucible.events.Callback` reporting to the registry (see the module docstring).

    `batch_size` (<= 10,000) records of one kind, or `flush_interval_s` since the last send,
    trigger a send; `flush()` sends or spools everything; `close()` also retries the spool for up
    to `close_timeout_s` before leaving it for the next callback on `spool_dir`.
    """

    def __init__(self, client: ApiClient, run_id: str, spool_dir: str | os.PathLike[str], *,
                 batch_size: int = 1000, flush_interval_s: float = 2.0,
                 close_timeout_s: float = 10.0, max_backoff_s: float = 30.0) -> None:
        if not 1 <= batch_size <= 10_000:
            raise ValueError(f"batch_size must be in [1, 10000], got {batch_size}")
        self.client = client
        self.run_id = str(run_id)
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.close_timeout_s = close_timeout_s
        self.max_backoff_s = max_backoff_s
        self._metrics: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._last_send = time.monotonic()
        self._retry_at = 0.0
        self._backoff_s = 0.5
        self._replay_others()
        path = self.spool_dir / f"{self.run_id}.spool.jsonl"
        try:
            self._spool = _Spool(path)
        except BlockingIOError:
            raise RuntimeError(f"spool {path} is held by another live ApiCallback for run "
                               f"{self.run_id}; close that one first") from None
        self._try_drain()

    # ------------------------------------------------------------ Callback protocol

    def metric(self, item: Metric) -> None:
        self._metrics.append(item.to_dict())
        self._maybe_send()

    def event(self, item: Event) -> None:
        self._events.append(item.to_dict())
        self._maybe_send()

    def flush(self) -> None:
        """Everything received so far is stored by the API or fsynced to the spool."""
        self._send_buffers()

    def close(self) -> None:
        """Flush, then keep retrying the spool until it drains or `close_timeout_s` passes."""
        self._send_buffers()
        deadline = time.monotonic() + self.close_timeout_s
        while self._spool.pending() and time.monotonic() < deadline:
            self._retry_at = 0.0
            if not self._try_drain():
                time.sleep(min(self._backoff_s, max(0.0, deadline - time.monotonic())))
        if self._spool.pending():
            _log.warning("registry unreachable: %s keeps undelivered records for the next run",
                         self._spool.path)
        self._spool.close()

    @property
    def spooled(self) -> bool:
        """True while undelivered batches wait in the spool."""
        return self._spool.pending()

    # ------------------------------------------------------------ internals

    def _maybe_send(self) -> None:
        full = max(len(self._metrics), len(self._events)) >= self.batch_size
        due = time.monotonic() - self._last_send >= self.flush_interval_s
        if full or due:
            self._send_buffers()

    def _records(self) -> Iterator[dict[str, Any]]:
        for kind, buffer in (("metrics", self._metrics), ("events", self._events)):
            for start in range(0, len(buffer), self.batch_size):
                yield {"run_id": self.run_id, "kind": kind,
                       "items": buffer[start:start + self.batch_size]}
        self._metrics, self._events = [], []

    def _send_buffers(self) -> None:
        self._last_send = time.monotonic()
        for record in self._records():
            if self._spool.pending() and not self._try_drain():
                self._spool.append(record)  # queue behind older batches, in order
                continue
            try:
                self._send(record, retries=None)
            except ApiUnavailable as exc:
                _log.warning("registry unreachable (%s); spooling to %s", exc, self._spool.path)
                self._spool.append(record)
                self._schedule_retry()
            except ApiError as exc:
                if exc.status_code in (401, 403):
                    self._spool.append(record)  # kept for when the token is fixed
                    raise
                self._spool.reject(record, exc)

    def _send(self, record: dict[str, Any], *, retries: int | None) -> None:
        post = self.client.post_metrics if record["kind"] == "metrics" else \
            self.client.post_events
        post(record["run_id"], record["items"], retries=retries)

    def _try_drain(self) -> bool:
        """One throttled attempt to replay the spool; True when it is empty afterwards."""
        if not self._spool.pending():
            return True
        if time.monotonic() < self._retry_at:
            return False
        try:
            self._spool.drain(lambda record: self._send(record, retries=0))
        except ApiUnavailable:
            self._schedule_retry()
            return False
        self._backoff_s = 0.5
        _log.info("registry reachable again; spool %s replayed", self._spool.path)
        return True

    def _schedule_retry(self) -> None:
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)

    def _replay_others(self) -> None:
        """Replay spools left by earlier callbacks on this folder that nobody holds now."""
        for path in sorted(self.spool_dir.glob("*.spool.jsonl")):
            if path.name == f"{self.run_id}.spool.jsonl":
                continue
            try:
                spool = _Spool(path)
            except BlockingIOError:
                continue  # a live callback owns it
            try:
                spool.drain(lambda record: self._send(record, retries=0))
            except ApiUnavailable:
                _log.warning("registry unreachable; %s stays spooled", path)
            finally:
                spool.close()
