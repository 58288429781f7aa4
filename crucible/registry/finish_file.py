"""finish.jsonl: a run's final state on disk, waiting in the run's spool folder until every
record the run reported has reached the registry (the state machine is `crucible.registry.replay`).

    <root>/<run_id>/finish.jsonl           one line {"id", "changes"} per `record_finish` call;
                                           the last complete line is the one that counts
    <root>/<run_id>/finish.jsonl.rejected  final states the API refused, each with its answer
    <root>/<run_id>/finish.jsonl.retiring  applied lines being removed (left by a settle that
                                           died doing so; put back by the next one)

Appending takes no lock (`append`): the line is written, fsync'd, and written again when the
file was retired or set aside meanwhile. The one settle that updates the registry for the run
holds finish.jsonl's flock; retiring renames the file first, then reads what was appended since
the settle read it and writes that to a fresh finish.jsonl - so no line is ever lost, and a
line is at worst applied twice (harmless: the same final state).
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import IO, Any

from crucible.registry.client import ApiError
from crucible.registry.spool import (
    run_state,
)
from crucible.registry.spool_files import (
    is_current,
    lock_fd,
    open_in_run_folder,
    remove_if_empty,
    run_folder_lock,
)
from crucible.runfiles import append_jsonl, append_line, replace

__all__ = ["FINISH", "append", "last_line", "outcome", "refuse", "retire", "restore_leftover"]

FINISH = "finish.jsonl"
_RETIRING = "finish.jsonl.retiring"
_REFUSED = "finish.jsonl.rejected"


def append(run_dir: Path, changes: dict[str, Any]) -> str:
    """Append the final `changes` of the run in `run_dir` durably, whatever anyone holds, and
    return the line's id. The folder is made again when a reporter removed it meanwhile."""
    line = {"id": uuid.uuid4().hex, "changes": changes}
    path = run_dir / FINISH
    while True:
        with open_in_run_folder(path, "ab") as fh:
            append_jsonl(fh, line)
            if is_current(fh.fileno(), path):
                return line["id"]
        # retired or set aside while it was written: write it again, to the fresh file


def _lines(data: bytes) -> list[dict[str, Any]]:
    """The complete, readable lines of a finish file as {"id", "changes", ...} (a line of an
    earlier layout, the changes alone, gets no id)."""
    lines = []
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and isinstance(line.get("changes"), dict):
            lines.append(line)
        elif isinstance(line, dict):
            lines.append({"id": None, "changes": line})
    return lines


def last_line(fh: IO[bytes]) -> tuple[dict[str, Any] | None, int]:
    """(the last line of the finish file open as `fh`, the bytes read)."""
    fh.seek(0)
    data = fh.read()
    lines = _lines(data)
    return (lines[-1] if lines else None), len(data)


def outcome(run_dir: Path, line_id: str) -> tuple[bool, ApiError | None]:
    """(whether line `line_id` is still pending, the API's refusal of it if any). Read in this
    order because a refused line is in finish.jsonl.rejected before it leaves finish.jsonl; a
    line neither pending nor refused was applied, or replaced by a later one."""
    for name in (FINISH, _RETIRING):
        try:
            data = (run_dir / name).read_bytes()
        except FileNotFoundError:
            continue
        if any(line["id"] == line_id for line in _lines(data)):
            return True, None
    try:
        refused = _lines((run_dir / _REFUSED).read_bytes())
    except FileNotFoundError:
        return False, None
    for line in refused:
        if line["id"] == line_id:
            error = line.get("error") or {}
            return False, ApiError(int(error.get("status_code", 0)), error.get("detail"))
    return False, None


def refuse(run_dir: Path, line: dict[str, Any], error: ApiError) -> Path:
    """Keep a final state the API refused, with its answer; returns where."""
    path = run_dir / _REFUSED
    with open(path, "ab") as fh:
        append_jsonl(fh, {**line, "error": {"status_code": error.status_code,
                                             "detail": error.detail}})
    return path


def retire(run_dir: Path, fh: IO[bytes], read_to: int, *, wait_s: float) -> None:
    """Remove the applied lines (the first `read_to` bytes) of finish.jsonl, open and flocked
    as `fh`, and the run folder once empty. Left alone when a new attempt set it aside
    meanwhile, or when the run folder stays locked past `wait_s` (then applied again by a
    later settle: harmless)."""
    path, retiring = run_dir / FINISH, run_dir / _RETIRING
    with run_folder_lock(run_dir, wait_s=wait_s) as held:
        if not (held and is_current(fh.fileno(), path)):
            return
        replace(path, retiring)      # from now on appenders write their line again
        with open(retiring, "rb") as renamed:
            renamed.seek(read_to)
            later = [line for line in renamed if line.endswith(b"\n")]
        if later:
            append_line(path, b"".join(later))
        retiring.unlink()
        if not later:
            state = run_state(run_dir)
            if not state.owed and not state.busy:
                remove_if_empty(run_dir)


def restore_leftover(run_dir: Path) -> bool:
    """Under the run lock: a settle that died while retiring left finish.jsonl.retiring, whose
    lines after the applied ones would be lost (appenders write again only what they wrote
    after the rename): put it back as finish.jsonl (an applied state applied again is
    harmless), or drop it when a newer finish.jsonl exists. Returns True when put back."""
    retiring = run_dir / _RETIRING
    try:
        fh = open(retiring, "rb")
    except FileNotFoundError:
        return False
    with fh:
        if not lock_fd(fh.fileno(), wait_s=0.0):
            return False        # a settle is retiring it right now
        if (run_dir / FINISH).exists():
            retiring.unlink()
            return False
        replace(retiring, run_dir / FINISH)
        return True
