"""Spool files: where the registry client keeps the batches the API has not stored yet, and the
drain that sends them in order. The replay over a whole spool root and a run's final state are
in `crucible.registry.replay`.

Layout under a spool root (one per work folder: `ReporterSettings.spool_root` in
`crucible.registry.settings`, default `<work_dir>/spool`, so that every later client on the
machine finds what an earlier one left):

    <root>/<run_id>/<writer>.spool.jsonl           batches one reporter could not deliver, in
                                                   order; a line counts once it is fsync'd
    <root>/<run_id>/<writer>.spool.jsonl.offset    bytes of it already delivered
    <root>/<run_id>/<writer>.spool.jsonl.rejected  batches the API refused, or lines that are not
                                                   a batch at all (kept, counted, logged)
    <root>/<run_id>/finish.jsonl ...               the run's final state (`crucible.registry.finish_file`)

A batch is one JSON line {"run_id": str, "kind": "metrics" | "events", "items": [object, ...]};
any other line is moved to `.rejected` when a drain reaches it, never sent and never fatal.

Locks are `flock`s: a reporter holds its own file while it is open, so no replay touches a live
one; a replay holds a file while draining it; the run folder is held for short file operations
only, never across a request. `flock` is reliable on a local disk only: on NFS it degrades to a
per-process POSIX lock (two holders in one process both get it, closing any descriptor of the
file releases it), so the spool root must be on a local disk (docs/OPERATIONS.md). A record is
re-sent when a process dies between "stored" and "offset written": harmless, metrics are keyed
by (name, step, replica) and events by id.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from crucible.registry.client import ApiClient, ApiError, ApiUnavailable
from crucible.registry.spool_files import (
    POLL_S,
    is_current,
    lock_fd,
    open_in_run_folder,
    remove_if_empty,
    run_folder_lock,
)
from crucible.runfiles import append_jsonl, append_line, repair_torn_tail, write_bytes_atomic

__all__ = ["SPOOL_SUFFIX", "SpoolFile", "RunState", "run_state", "send_record", "drain"]

_log = logging.getLogger(__name__)

SPOOL_SUFFIX = ".spool.jsonl"
_KINDS = ("metrics", "events")


def _read_offset(offset_path: Path) -> int:
    try:
        return int(offset_path.read_text())
    except (FileNotFoundError, ValueError):
        return 0        # no offset (or a torn one): re-send from the start, which is harmless


def _record_problem(record: Any) -> str | None:
    """Why a spool line is not a batch (see the module docstring); None when it is one."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if not isinstance(record.get("run_id"), str) or not record["run_id"]:
        return "no run_id string"
    if record.get("kind") not in _KINDS:
        return f"kind {record.get('kind')!r} is neither 'metrics' nor 'events'"
    items = record.get("items")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return "items is not a list of objects"
    return None


def _line_items(line: bytes) -> int:
    """Metric and event items a spool line holds: those of a batch, 1 for anything else (a
    line the replay will refuse still stands for something the run reported)."""
    try:
        record = json.loads(line)
    except ValueError:
        return 1
    return 1 if _record_problem(record) else len(record["items"])


def _items_after(fh: IO[bytes], offset: int) -> int:
    """Items in the complete lines of `fh` from `offset` on."""
    fh.seek(offset)
    return sum(_line_items(line) for line in fh if line.endswith(b"\n"))


class SpoolFile:
    """One reporter's spool file, open and exclusively flocked (see the module docstring).
    `rejected` counts the lines this holder moved to the `.rejected` file.

    Not thread-safe: a caller sharing it between threads guards every call with its own lock.
    """

    def __init__(self, path: Path, fh: IO[bytes]) -> None:
        self.path = path
        self.offset_path = path.with_name(path.name + ".offset")
        self.rejected_path = path.with_name(path.name + ".rejected")
        self.rejected = 0
        self._fh = fh
        repair_torn_tail(fh)   # a reporter killed mid-append: that batch was never acknowledged
        # only the holder writes the offset file, so it is read once and then kept here
        offset = _read_offset(self.offset_path)
        self._delivered = offset if offset <= self._size() else 0

    @classmethod
    def create(cls, run_dir: Path, writer: str) -> SpoolFile:
        """A new, empty spool of one reporter (`writer`, unique) of the run in `run_dir`."""
        path = run_dir / f"{writer}{SPOOL_SUFFIX}"
        while True:
            try:
                fh = open_in_run_folder(path, "xb+")
            except FileExistsError:          # a replay holds it, found it empty, removes it
                time.sleep(POLL_S)
                continue
            if lock_fd(fh.fileno(), wait_s=1.0) and is_current(fh.fileno(), path):
                return cls(path, fh)
            fh.close()

    @classmethod
    def acquire(cls, path: Path, *, wait_s: float = 0.0) -> SpoolFile | None:
        """The spool at `path`, held; None when it is gone, or still held after `wait_s`.
        Raises OSError when it cannot be opened (another user's file, not a file)."""
        try:
            fh = open(path, "rb+")
        except FileNotFoundError:
            return None
        if lock_fd(fh.fileno(), wait_s=wait_s) and is_current(fh.fileno(), path):
            return cls(path, fh)
        fh.close()
        return None

    def _size(self) -> int:
        return os.fstat(self._fh.fileno()).st_size

    def append(self, record: dict[str, Any]) -> None:
        """Add a batch at the end; it counts once this returns (fsync'd)."""
        append_jsonl(self._fh, record)

    def pending(self) -> bool:
        return self._size() > self._delivered

    def owed(self) -> int:
        """Metric and event items not delivered yet."""
        return _items_after(self._fh, self._delivered)

    def next_record(self) -> tuple[Any, bytes, int] | None:
        """The first undelivered line decoded (None when it is not JSON; not necessarily a
        batch), the line itself and the offset after it; None when everything is delivered."""
        self._fh.seek(self._delivered)
        line = self._fh.readline()
        if not line.endswith(b"\n"):
            return None
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        return record, line, self._fh.tell()

    def advance(self, offset: int) -> None:
        """Everything before `offset` is delivered; an all-delivered spool is emptied."""
        if offset >= self._size():
            # offset file first: a crash in between re-sends (harmless), never skips new lines
            self.offset_path.unlink(missing_ok=True)
            self._fh.truncate(0)
            self._delivered = 0
            return
        write_bytes_atomic(self.offset_path, str(offset).encode())
        self._delivered = offset

    def reject(self, raw: bytes, error: ApiError | str) -> None:
        """Keep a line the API refused, or that is not a batch, aside (never silently
        dropped)."""
        _log.error("spooled batch of %s refused (%s); kept in %s", self.path.parent.name, error,
                   self.rejected_path)
        append_line(self.rejected_path, raw if raw.endswith(b"\n") else raw + b"\n")
        self.rejected += 1

    def close(self) -> None:
        """Release the spool; an empty one is removed first, and its run folder with it when
        that is empty (under the run folder's lock, so that nobody settling the run or
        writing its final state loses the folder from under them)."""
        empty = not self.pending()
        if empty:
            self.path.unlink(missing_ok=True)
            self.offset_path.unlink(missing_ok=True)
        self._fh.close()
        if empty:
            with run_folder_lock(self.path.parent, wait_s=0.0) as held:
                if held:
                    remove_if_empty(self.path.parent)


@dataclass
class RunState:
    """What a run folder's spools hold: `owed` items undelivered, `busy` when any spool file
    is held (a live reporter, or a drain under way), `refused` items in `.rejected` files
    (`refused_in`)."""

    owed: int = 0
    busy: bool = False
    refused: int = 0
    refused_in: list[str] = field(default_factory=list)


def run_state(run_dir: Path) -> RunState:
    """The state of the spools in `run_dir`; raises OSError for a spool file that cannot be
    read (then nobody can tell what the run owes)."""
    state = RunState()
    for path in sorted(run_dir.glob(f"*{SPOOL_SUFFIX}")):
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            continue
        with fh:
            state.busy |= not lock_fd(fh.fileno(), wait_s=0.0)     # released when fh closes
            state.owed += _items_after(fh, _read_offset(path.with_name(path.name + ".offset")))
    for path in sorted(run_dir.glob(f"*{SPOOL_SUFFIX}.rejected")):
        with open(path, "rb") as fh:
            refused = _items_after(fh, 0)
        if refused:
            state.refused += refused
            state.refused_in.append(str(path))
    return state


def send_record(client: ApiClient, record: dict[str, Any], *, retries: int | None) -> None:
    """POST one batch {"run_id", "kind": "metrics" | "events", "items"}; raises ValueError
    for anything else (a drain refuses such lines before sending)."""
    problem = _record_problem(record)
    if problem is not None:
        raise ValueError(f"not a spool batch: {problem}")
    post = client.post_metrics if record["kind"] == "metrics" else client.post_events
    post(record["run_id"], record["items"], retries=retries)


Guard = Callable[[], AbstractContextManager[Any]]


def drain(spool: SpoolFile, send: Callable[[dict[str, Any]], None], *,
          until: float | None = None, should_stop: Callable[[], bool] | None = None,
          guard: Guard = nullcontext, owned: Callable[[], bool] | None = None) -> int:
    """Send `spool`'s undelivered batches in order; returns how many items were sent.

    Stops, leaving the rest, at monotonic time `until` or when `should_stop()`; raises
    `ApiUnavailable` at the first batch the API cannot take and `ApiError` for 401/403; a batch
    refused as invalid, and a line that is not a batch, go to the `.rejected` file (counted in
    `spool.rejected`). `guard()` is held around every file operation (never around `send`),
    and once `owned()` turns False (the spool was taken back) nothing more is written.
    """
    sent = 0
    while True:
        with guard():
            if (should_stop is not None and should_stop()) or \
                    (until is not None and time.monotonic() >= until):
                return sent
            found = spool.next_record()
        if found is None:
            return sent
        record, raw, end = found
        refused: ApiError | str | None = _record_problem(record)
        if refused is None:
            try:
                send(record)
            except ApiError as exc:
                if isinstance(exc, ApiUnavailable) or exc.status_code in (401, 403):
                    raise
                refused = exc
        with guard():
            if owned is not None and not owned():
                return sent
            if refused is not None:
                spool.reject(raw, refused)
            else:
                sent += len(record["items"])
            spool.advance(end)
