"""Reporting a run to the registry: `ApiCallback`, the trainer callback that sends metrics and
events to the API from a background thread, never stalling training, never losing a record and
never storing one twice. `ApiClient` and its errors (`crucible.registry.client`) and the replay
of spools with a run's final state (`crucible.registry.replay`) are importable from here too;
`final_changes` builds the final state that ends a run (completed with its summary, or failed),
`describe` the one-line reason of a run that failed.

How `ApiCallback` keeps those promises:
- the training thread only hands records over: `metric`/`event` buffer them, and a full batch
  (`batch_size`), `flush_interval_s` elapsed or `flush()` puts the batch on a bounded in-memory
  queue (`queue_batches`); when the queue is full the batch is appended to the run's spool file
  instead (a local fsync). The training thread never does network I/O and never waits for it;
- a sender thread first replays what earlier reporters left under the spool root, then takes
  batches from the queue (merging small ones) and posts them. A batch that cannot be delivered
  (connection error, 5xx, 408/429 after retries with backoff, a hang past the client's timeout)
  is appended to the spool and fsync'd; while the spool holds batches, new ones go behind them
  and the spool is replayed in order, throttled by exponential backoff, once the API answers
  again; a `.offset` file remembers how far the replay got. An error that is not an `ApiError`
  (a bug, a library's surprise) is logged, what the sender held is spooled (kept in memory and
  tried again while the disk refuses it), and the sender goes on after the backoff: it never
  dies silently. Should its thread end anyway, later hand-overs go to the spool and `close()`
  spools whatever it still held;
- duplicates are impossible by construction of the API: metrics are keyed by (name, step,
  replica), events by their deterministic id, and both endpoints ignore rows already stored, so
  re-sending after a crash between "sent" and "offset written" is harmless;
- `close()` hands the rest over, lets the sender deliver for at most `close_timeout_s`, then
  writes whatever is still queued or in flight to the spool and returns; `owed_records` says how
  many metric and event records the spool still holds. The next replay delivers them: the sender
  of any later `ApiCallback` on the same spool root, any flow start, `crucible api replay`;
- a run's final state goes through the spool folder too (`record_finish`): it is recorded only
  once every record the run reported has arrived, so a run is never called completed with data
  missing; until then the registry shows `owed_records` = N, "owes N records" (see
  `crucible.registry.replay` for the state machine). A new `ApiCallback` of a run is a new attempt: it
  sets aside the final state an earlier attempt left there, and while its spool is open no
  replay records any final state of the run.
A batch the API refuses as invalid (other 4xx) is moved to `<spool>.rejected` and logged, so one
bad record cannot block the queue; a refused token (401/403) is raised by the next call on the
training thread, its batch kept in the spool for when the token is fixed.

A SIGKILL takes the batches still in the in-memory queue with it (at most `queue_batches`; in
normal operation the last step's), but not from the run: the run folder's metrics.jsonl and
events.jsonl are fsync'd every global step, and a resumed run sends them to its reporter again
before training on (`crucible.train.train`, `JsonlCallback.resend`). Everything the sender has
stored or spooled survives as it is.

Only stdlib + httpx: importing this module never imports torch.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from crucible.events import Event, Metric
from crucible.ids import validate_id
from crucible.registry.client import ApiClient, ApiError, ApiUnavailable, RecordsOwed
from crucible.registry.replay import ReplayReport, record_finish, replay_spools, supersede_finish
from crucible.registry.spool import SpoolFile, drain, send_record

__all__ = ["ApiError", "ApiUnavailable", "RecordsOwed", "ApiClient", "ApiCallback",
           "ReplayReport", "replay_spools", "record_finish", "supersede_finish", "final_changes",
           "describe"]

_log = logging.getLogger(__name__)
_FIRST_BACKOFF_S = 0.5


def final_changes(*, summary: dict[str, Any] | None = None,
                  reason: str | None = None) -> dict[str, Any]:
    """The changes that end a run (for `record_finish`): completed with the trainer's `summary`
    (its headline numbers and the summary itself), or, without one, failed with `reason`."""
    if summary is None:
        return {"status": "failed", "status_reason": reason}
    return {"status": "completed", "status_reason": None,
            "initial_val_loss": summary.get("initial_val_loss"),
            "final_val_loss": summary.get("final_val_loss"),
            "tokens_budget": summary.get("tokens_budget"),
            "tokens_processed": summary.get("tokens_processed"),
            "summary": _json_safe(summary)}


def describe(exc: BaseException) -> str:
    """A one-line reason for the registry: the exception's type and message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:4000] if text else type(exc).__name__


def _json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as the registry stores it (non-finite floats become None: JSON has none)."""
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return json.loads(json.dumps(clean(summary), default=str))


def _batches(run_id: str, metrics: list[dict[str, Any]], events: list[dict[str, Any]],
             batch_size: int) -> Iterator[dict[str, Any]]:
    """Spool records {"run_id", "kind", "items"} of at most `batch_size` items each."""
    for kind, items in (("metrics", metrics), ("events", events)):
        for start in range(0, len(items), batch_size):
            yield {"run_id": run_id, "kind": kind, "items": items[start:start + batch_size]}


class ApiCallback:
    """`crucible.events.Callback` reporting run `run_id` to the registry (module docstring).

    `spool_dir` is the spool root shared by every reporter of the work folder: this callback
    writes `<spool_dir>/<run_id>/<writer>.spool.jsonl` and its sender first replays what earlier
    reporters left anywhere under `spool_dir`. `batch_size` (<= 10,000) records of one kind, or
    `flush_interval_s` since the last hand-over, make a batch; at most `queue_batches` batches
    wait in memory; `close()` waits at most `close_timeout_s` for the sender.
    """

    def __init__(self, client: ApiClient, run_id: str, spool_dir: str | os.PathLike[str], *,
                 batch_size: int = 1000, flush_interval_s: float = 2.0,
                 close_timeout_s: float = 10.0, max_backoff_s: float = 30.0,
                 queue_batches: int = 64) -> None:
        if not 1 <= batch_size <= 10_000:
            raise ValueError(f"batch_size must be in [1, 10000], got {batch_size}")
        if queue_batches < 1:
            raise ValueError(f"queue_batches must be >= 1, got {queue_batches}")
        self.client = client
        self.run_id = validate_id(str(run_id), field="run_id")   # it names a spool folder
        self.spool_dir = Path(spool_dir)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.close_timeout_s = close_timeout_s
        self.max_backoff_s = max_backoff_s
        self.queue_batches = queue_batches
        self.owed_records: int | None = None     # set by close(): records left in the spool
        self._metrics: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._last_hand_over = time.monotonic()
        self._closed = False
        # One lock guards the queue, the batches in flight, the spool file and the flags below;
        # it is never held during network I/O, so the training thread waits on it for a local
        # file operation at most.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[dict[str, Any]] = deque()
        self._in_flight: list[dict[str, Any]] = []
        self._stopping = False
        self._deadline: float | None = None
        self._taken_back = False     # close() took the spool back from a sender stuck on I/O
        self._sender_running = True  # False once the sender thread is past its last step
        self._fatal: ApiError | None = None
        self._retry_at = 0.0
        self._backoff_s = _FIRST_BACKOFF_S
        writer = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._spool = SpoolFile.create(self.spool_dir / self.run_id, writer)
        try:
            # a new attempt reports: what an earlier one left as the run's final state must
            # not be applied to this one (its spool, held from now on, keeps the run open)
            supersede_finish(self.spool_dir, self.run_id, wait_s=0.0)
        except BaseException:
            self._spool.close()
            raise
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"crucible-reporter-{self.run_id[:8]}")
        self._sender.start()

    # ------------------------------------------------------------ Callback protocol (trainer)

    def metric(self, item: Metric) -> None:
        self._check_open()
        self._metrics.append(item.to_dict())
        self._maybe_hand_over()

    def event(self, item: Event) -> None:
        self._check_open()
        self._events.append(item.to_dict())
        self._maybe_hand_over()

    def flush(self) -> None:
        """Hand everything received so far to the sender (or to the spool when the queue is
        full); never waits for the API. Raises the `ApiError` of a refused token."""
        self._hand_over()

    def close(self) -> None:
        """Hand the rest over, let the sender deliver for at most `close_timeout_s`, then leave
        whatever is undelivered - queued, in flight, held by a sender that failed - in the
        spool (`owed_records` says how many records) for the next replay. Idempotent; raises
        the `ApiError` of a refused token, and the OSError of a spool that cannot be written
        (the records it could not take are counted in `owed_records` and logged)."""
        if self._closed:
            return
        try:
            self._hand_over()
        finally:
            self._closed = True
            self._stop_sender()
        self._raise_fatal()

    def wait_handled(self, timeout_s: float) -> bool:
        """Block until every batch handed over so far is stored by the API or in the spool, or
        `timeout_s` passes; True when it is. The trainer never calls it (tests and callers
        that want a barrier do)."""
        with self._wake:
            return self._wake.wait_for(lambda: not (self._queue or self._in_flight),
                                       timeout=timeout_s)

    @property
    def spooled(self) -> bool:
        """True while undelivered batches wait in the spool."""
        with self._lock:
            if self.owed_records is not None:     # closed
                return self.owed_records > 0
            return self._spool.pending()

    # ------------------------------------------------------------ training thread

    def _maybe_hand_over(self) -> None:
        full = max(len(self._metrics), len(self._events)) >= self.batch_size
        if full or time.monotonic() - self._last_hand_over >= self.flush_interval_s:
            self._hand_over()

    def _hand_over(self) -> None:
        self._check_open()
        self._last_hand_over = time.monotonic()
        records = list(_batches(self.run_id, self._metrics, self._events, self.batch_size))
        self._metrics, self._events = [], []
        if records:
            with self._wake:
                try:
                    while records:
                        if len(self._queue) < self.queue_batches and self._sender_running:
                            self._queue.append(records[0])
                        else:       # the queue is full (or no sender): spill, a local fsync
                            self._spool.append(records[0])
                        records.pop(0)
                finally:
                    # a failed spill (disk full) raises here; close() spools the rest again
                    self._queue.extend(records)
                    self._wake.notify_all()
        self._raise_fatal()     # after the hand-over: a refused token never costs a record

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ApiCallback of run {self.run_id} is closed")

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _stop_sender(self) -> None:
        with self._wake:
            self._stopping = True
            self._deadline = time.monotonic() + self.close_timeout_s
            self._wake.notify_all()
        self._sender.join(timeout=self.close_timeout_s)
        with self._wake:
            # stuck on the network: take the spool back. Alive or not, whatever the sender
            # still holds is spooled (a batch in flight too: if its request still succeeds,
            # the replay re-sends it harmlessly)
            self._taken_back = self._sender.is_alive()
            try:
                self._spool_held()
            finally:
                unspooled = sum(len(r["items"]) for r in [*self._in_flight, *self._queue])
                self.owed_records = self._spool.owed() + unspooled
                path = self._spool.path
                self._spool.close()
                self._wake.notify_all()
        if unspooled:
            _log.error("registry: %d records of run %s could not be written to %s; they are "
                       "lost unless the run is resumed (its metrics.jsonl and events.jsonl "
                       "hold them)", unspooled, self.run_id, path)
        elif self.owed_records:
            _log.warning("registry: %d records of run %s not delivered yet; kept in %s for the "
                         "next replay (`crucible api replay`)", self.owed_records, self.run_id,
                         path)

    def _spool_held(self) -> None:
        """Move the batches in flight and queued to the spool (call with the lock held), each
        one only once its append returned: a failed append (disk full) raises and keeps the
        rest where they were, for the next try."""
        while self._in_flight:
            self._spool.append(self._in_flight[0])
            self._in_flight.pop(0)
        while self._queue:
            self._spool.append(self._queue[0])
            self._queue.popleft()

    # ------------------------------------------------------------ sender thread

    def _send_loop(self) -> None:
        try:
            try:
                self._replay_others()
            except Exception:   # noqa: BLE001 - the run's own records matter more
                _log.exception("registry: replaying earlier spools under %s failed; they stay "
                               "for the next replay", self.spool_dir)
            while True:
                try:
                    if not self._round():
                        return
                except Exception:   # noqa: BLE001 - never die: every record is kept
                    if not self._recover():
                        return
        finally:
            with self._wake:
                self._sender_running = False    # from now on hand-overs spill to the spool
                self._wake.notify_all()

    def _recover(self) -> bool:
        """After an unexpected error (not an ApiError): log it, spool what the sender held,
        back off, go on. False once there is nothing left to do (closing, out of time)."""
        with self._wake:
            if self._taken_back:     # close() spooled everything; its client may be gone
                return False
            _log.exception("registry sender of run %s: unexpected error; its batches go to %s "
                           "and it goes on", self.run_id, self._spool.path)
            self._schedule_retry()
            try:
                self._spool_held()
            except OSError:
                _log.exception("registry sender of run %s: cannot spool to %s; its batches "
                               "stay in memory and are tried again", self.run_id,
                               self._spool.path)
            if self._stopping and self._past_deadline():
                return False
            until = self._retry_at if self._deadline is None else min(self._retry_at,
                                                                      self._deadline)
            self._wake.wait(timeout=max(0.0, until - time.monotonic()))
        return True

    def _replay_others(self) -> None:
        """Replay what earlier reporters left under the spool root (until close's deadline);
        a refused token is raised on the training thread like one refused for this run."""
        try:
            report = replay_spools(self.client, self.spool_dir, retries=0,
                                   exclude=frozenset({self._spool.path}),
                                   should_stop=self._past_deadline)
        except ApiError as exc:     # 401/403: nothing else escapes a replay
            self._fatal = exc
            return
        if report.finished:
            _log.info("registry: recorded the final state of %d earlier run(s)",
                      len(report.finished))
        if report.unreachable:
            _log.info("registry unreachable; earlier spools stay for the next replay")

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _round(self) -> bool:
        """Take the queued batches, deliver them, retry the spool when due; False once closing
        is done (nothing queued, and the spool empty or the deadline passed)."""
        with self._wake:
            while not (self._queue or self._in_flight or self._stopping or self._spool_due()):
                self._wake.wait(timeout=self._retry_wait())
            # batches left in flight by an unexpected error that could not be spooled go first
            self._in_flight = self._merged([*self._in_flight, *self._queue])
            self._queue.clear()
            in_flight, stopping = list(self._in_flight), self._stopping
        for record in in_flight:
            self._deliver(record)
        self._try_drain()
        if not stopping:
            return True
        with self._wake:
            if self._taken_back:
                return False
            if self._queue:
                return True
            if not self._pending() or self._past_deadline() or self._fatal is not None:
                return False    # done, out of time, or the token is refused: no use waiting
            # closing with a non-empty spool: wait for the next retry (or the deadline)
            assert self._deadline is not None
            self._wake.wait(timeout=max(0.0, min(self._retry_at, self._deadline)
                                        - time.monotonic()))
        return True

    def _merged(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Queued batches re-cut into as few as possible (fewer requests when behind)."""
        if len(records) < 2:
            return records
        metrics = [item for r in records if r["kind"] == "metrics" for item in r["items"]]
        events = [item for r in records if r["kind"] == "events" for item in r["items"]]
        return list(_batches(self.run_id, metrics, events, self.batch_size))

    def _pending(self) -> bool:
        """The spool holds undelivered batches (call with the lock held); False once close()
        took it back: the sender then has nothing left to do."""
        return not self._taken_back and self._spool.pending()

    def _spool_due(self) -> bool:
        return self._pending() and time.monotonic() >= self._retry_at

    def _retry_wait(self) -> float | None:
        if not self._pending():
            return None
        return max(0.0, self._retry_at - time.monotonic())

    def _deliver(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._taken_back:
                return
            behind = self._spool.pending()
        if behind and not self._try_drain():
            self._done(record, spool=True)    # queue behind older batches, in order
            return
        try:
            send_record(self.client, record, retries=None)
        except ApiUnavailable as exc:
            _log.warning("registry unreachable (%s); spooling to %s", exc, self._spool.path)
            self._schedule_retry()
            self._done(record, spool=True)
        except ApiError as exc:
            if exc.status_code in (401, 403):
                self._fatal = exc
                self._done(record, spool=True)    # kept for when the token is fixed
            else:
                self._done(record, refused=exc)
        else:
            self._done(record)

    def _done(self, record: dict[str, Any], *, spool: bool = False,
              refused: ApiError | None = None) -> None:
        """A batch in flight is stored, spooled or refused: one step under the lock, so that
        close() sees it either in flight or settled, never both or neither."""
        with self._wake:
            if self._taken_back:
                return
            if spool:       # raises when it fails (disk full): the batch stays in flight
                self._spool.append(record)
            elif refused is not None:
                self._spool.reject(json.dumps(record).encode("utf-8"), refused)
            self._in_flight = [r for r in self._in_flight if r is not record]
            self._wake.notify_all()

    def _try_drain(self) -> bool:
        """One throttled replay of this callback's own spool; True when it is empty after."""
        with self._lock:
            if not self._pending():
                return True
        if time.monotonic() < self._retry_at:
            return False
        try:
            drain(self._spool, lambda r: send_record(self.client, r, retries=0),
                  guard=lambda: self._lock, owned=lambda: not self._taken_back)
        except ApiUnavailable:
            self._schedule_retry()
            return False
        except ApiError as exc:     # 401/403: a token problem, the spool waits for a fix
            self._fatal = exc
            self._schedule_retry()
            return False
        self._backoff_s = _FIRST_BACKOFF_S
        with self._lock:
            return not self._pending()

    def _schedule_retry(self) -> None:
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
