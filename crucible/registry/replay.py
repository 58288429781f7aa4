"""The replay of spools (`crucible.registry.spool`) that any process can run, and the end of a run: its
final state is recorded in the registry only once every record it reported has arrived.

The state machine of a run's end. `record_finish` appends the run's final state to its
`finish.jsonl` (`crucible.registry.finish_file`: fsync'd, before anything else, whatever lock anyone
holds) and replays the run. Every replay settles each run before and after draining it; a
settle looks at the run's spools and:
- when any spool file is held (a live reporter: an attempt is training; or a drain under way),
  records nothing: the run is not finished, whatever an earlier attempt wrote;
- when records are still owed, records `owed_records` = N with status_reason "training
  finished; N records owed" (the status stays `running`; a failed run is marked failed at once,
  with its count);
- when nothing is owed, applies the last final state with `owed_records` = 0 - only then is
  "completed" true - and says on the run which records the API refused (kept in `.rejected`
  files): status_reason "completed; N records refused by the API, kept in <files>". The applied
  lines are then retired; a refused final state moves to `finish.jsonl.rejected` and
  `record_finish` raises the API's answer, whichever process applied it.
So once the API is back, the first client that replays (any `ApiCallback`'s sender, any flow
start, `crucible api replay`) completes the run. A new attempt of a run (an `ApiCallback`
starting, the `train-run` flow registering it) sets aside the final state an earlier attempt
left (`supersede_finish`), so that state is never applied to the new attempt.

Locks: the run folder's (short file operations only, never across a request), and
finish.jsonl's own, held by the one settle that updates the registry for the run - so updates of
one run never overtake each other, and a stale "owes N" never lands after "completed". Lock
order: finish.jsonl, then the run folder. A wait is bounded by the caller's deadline, and by
`_LOCK_WAIT_S` (whoever holds the lock is settling the run already).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from crucible.ids import validate_id
from crucible.registry import finish_file
from crucible.registry.client import ApiClient, ApiError, ApiUnavailable, RecordsOwed
from crucible.registry.finish_file import FINISH
from crucible.registry.spool import (
    SPOOL_SUFFIX,
    RunState,
    SpoolFile,
    drain,
    run_state,
    send_record,
)
from crucible.registry.spool_files import (
    is_current,
    lock_fd,
    remove_if_empty,
    run_folder_lock,
)

__all__ = ["ReplayReport", "replay_spools", "record_finish", "supersede_finish"]

_log = logging.getLogger(__name__)

_REASON_MAX = 3900          # status_reason holds 4000 characters; room for what is appended
_LOCK_WAIT_S = 10.0         # a caller without a deadline: locks are held for file operations,
#                             or (finish.jsonl's) for one update of the registry


@dataclass
class ReplayReport:
    """What one replay pass did. `owed`: run id -> metric and event records still in its spools
    (a run listed there is not recorded as finished); `held`: spool files another process holds
    (a live reporter, or a replay under way); `unreadable`: path -> why it could not be read
    (skipped; its run is not finished either); `rejected`: `.rejected` file -> lines this pass
    moved there (refused by the API or not a batch: not owed, never re-sent); `errors`: runs
    whose final state the API refused; `unreachable`: why the pass stopped early."""

    delivered: int = 0
    finished: list[str] = field(default_factory=list)
    owed: dict[str, int] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    errors: dict[str, ApiError] = field(default_factory=dict)
    unreachable: str | None = None

    @property
    def complete(self) -> bool:
        """Nothing is left in any spool the pass could see."""
        return not (self.owed or self.held or self.unreadable or self.errors or self.unreachable)


def replay_spools(client: ApiClient, root: str | os.PathLike[str], *,
                  timeout_s: float | None = None, retries: int | None = None,
                  exclude: frozenset[Path] = frozenset(),
                  should_stop: Callable[[], bool] | None = None) -> ReplayReport:
    """Deliver what every spool under `root` holds, and record the final state of every run
    that no longer owes anything (see the module docstring).

    Stops early at `timeout_s` (every lock wait included), when `should_stop()` says so, or at
    the first sign that the registry is unreachable (`report.unreachable`: the other spools
    would only wait again). Files in `exclude` (a live reporter's own) are skipped, files
    another process holds are listed in `report.held`, files that cannot be read in
    `report.unreadable`. Never raises `ApiUnavailable` or OSError; raises `ApiError` for
    401/403.
    """
    report = ReplayReport()
    base = Path(root)
    if not base.is_dir():
        return report
    until = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        flat = sorted(base.glob(f"*{SPOOL_SUFFIX}"))       # the layout of earlier versions
        run_dirs = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError as exc:
        _skip(report, base, exc)
        return report
    try:
        for path in flat:
            _guarded(report, path, lambda p=path: _replay_file(
                client, p, report, until=until, should_stop=should_stop, retries=retries,
                wait_s=0.0, key=p.name))
        for run_dir in run_dirs:
            if (should_stop is not None and should_stop()) or \
                    (until is not None and time.monotonic() >= until):
                break
            _replay_run(client, run_dir, report, until=until, should_stop=should_stop,
                        retries=retries, exclude=exclude, wait_s=0.0)
    except ApiUnavailable as exc:
        report.unreachable = str(exc)
    return report


def record_finish(client: ApiClient, root: str | os.PathLike[str], run_id: str,
                  changes: dict[str, Any], *, timeout_s: float) -> None:
    """Record run `run_id`'s final `changes` (status completed + results, or failed + reason)
    only after every record it reported has reached the registry.

    First appends the changes to the run's `finish.jsonl` (fsync'd; whatever lock anyone
    holds), then replays the run's spools and settles, waiting at most `timeout_s` in all.
    Returns once these changes, or later ones of the same run (a retry, a new attempt), are
    recorded with `owed_records` = 0. Raises `RecordsOwed` (an `ApiUnavailable`: a retry
    replays first) while they are not - records still owed, the registry unreachable, a spool
    held or unreadable - the final state then waits on disk for the next replay; and `ApiError`
    (with the API's answer) when the API refused the changes, whichever process applied them.
    """
    run_dir = Path(root) / validate_id(run_id, field="run_id")
    until = time.monotonic() + timeout_s
    finish_id = finish_file.append(run_dir, changes)
    report = ReplayReport()
    try:
        _replay_run(client, run_dir, report, until=until, should_stop=None, retries=None,
                    exclude=frozenset(), wait_s=max(0.0, until - time.monotonic()))
    except ApiUnavailable as exc:
        report.unreachable = str(exc)
    pending, refusal = finish_file.outcome(run_dir, finish_id)
    if refusal is not None:
        raise refusal
    if pending:
        raise RecordsOwed(run_id, report.owed.get(run_id, 0), str(run_dir))


def supersede_finish(root: str | os.PathLike[str], run_id: str, *, wait_s: float) -> bool:
    """A new attempt of run `run_id` begins: set aside (drop, with a log line) the final state
    an earlier attempt left in the run's spool folder, so that no replay applies it to this
    attempt. Waits up to `wait_s` for a settle elsewhere that is recording that state right now
    (its update may otherwise land after this attempt began: logged). Returns whether a final
    state was set aside."""
    run_dir = Path(root) / validate_id(run_id, field="run_id")
    path = run_dir / FINISH
    with run_folder_lock(run_dir, wait_s=_LOCK_WAIT_S) as held:
        if held:    # a dead settle's leftover is an earlier attempt's state too
            finish_file.restore_leftover(run_dir)
    while True:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            return False
        with fh:
            in_flight = not lock_fd(fh.fileno(), wait_s=wait_s)
            with run_folder_lock(run_dir, wait_s=_LOCK_WAIT_S) as held:
                if not held:
                    _log.warning("run %s: its folder stays locked; the final state an earlier "
                                 "attempt left in %s may still be applied", run_id, path)
                    return False
                if is_current(fh.fileno(), path):
                    earlier, _read_to = finish_file.last_line(fh)
                    path.unlink()       # an append racing with this writes its line again
                    break
        # retired meanwhile (a fresh finish.jsonl holds what came after): look again
    if in_flight:
        _log.warning("run %s: a replay elsewhere is recording the final state of an earlier "
                     "attempt right now; it may land after this attempt began", run_id)
    status = earlier["changes"].get("status") if earlier else None
    _log.info("run %s: a new attempt begins; the final state an earlier attempt left "
              "(status %s) is set aside", run_id, status)
    return True


# ------------------------------------------------------------------ one run

def _replay_run(client: ApiClient, run_dir: Path, report: ReplayReport, *, until: float | None,
                should_stop: Callable[[], bool] | None, retries: int | None,
                exclude: frozenset[Path], wait_s: float) -> None:
    """Settle (the registry learns what is owed), drain the run's spools, settle again."""
    _guarded(report, run_dir, lambda: _settle(client, run_dir, report, retries=retries,
                                              until=until))
    for path in sorted(run_dir.glob(f"*{SPOOL_SUFFIX}")):
        if path in exclude:
            continue
        _guarded(report, path, lambda p=path: _replay_file(
            client, p, report, until=until, should_stop=should_stop, retries=retries,
            wait_s=wait_s, key=run_dir.name))
    _guarded(report, run_dir, lambda: _settle(client, run_dir, report, retries=retries,
                                              until=until))


def _guarded(report: ReplayReport, path: Path, step: Callable[[], None]) -> None:
    """Run one step of a replay; a file it cannot read is reported and skipped, not fatal."""
    try:
        step()
    except OSError as exc:
        _skip(report, path, exc)


def _skip(report: ReplayReport, path: Path, exc: OSError) -> None:
    where = str(exc.filename or path)
    report.unreadable[where] = f"{type(exc).__name__}: {exc.strerror or exc}"
    _log.warning("replay: cannot read %s (%s); skipped, its run stays unfinished", where, exc)


def _replay_file(client: ApiClient, path: Path, report: ReplayReport, *, until: float | None,
                 should_stop: Callable[[], bool] | None, retries: int | None,
                 wait_s: float, key: str) -> None:
    """Drain one spool file; what it still holds afterwards is counted under `key` (a run's
    settle step then counts all of that run's files)."""
    spool = SpoolFile.acquire(path, wait_s=wait_s)
    if spool is None:
        if path.exists():
            report.held.append(str(path))
        return
    try:
        report.delivered += drain(spool, lambda r: send_record(client, r, retries=retries),
                                  until=until, should_stop=should_stop)
        if spool.pending():
            report.owed[key] = report.owed.get(key, 0) + spool.owed()
    finally:
        if spool.rejected:
            where = str(spool.rejected_path)
            report.rejected[where] = report.rejected.get(where, 0) + spool.rejected
        spool.close()


# ------------------------------------------------------------------ the settle step

def _settle(client: ApiClient, run_dir: Path, report: ReplayReport, *,
            retries: int | None, until: float | None) -> None:
    """Record in the registry what the run's folder says (module docstring): nothing while a
    spool is held, what it owes, or its final state. Holding finish.jsonl's lock for the
    update, the run folder's only to read the state. Raises ApiUnavailable when the registry
    cannot be reached, OSError for a spool it cannot read."""
    report.owed.pop(run_dir.name, None)
    path = run_dir / FINISH
    while True:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            if _count_and_tidy(run_dir, report, until=until):
                continue            # a dead settle's leftover is back in place
            return
        with fh:
            if not lock_fd(fh.fileno(), wait_s=_wait_s(until)):
                _count(run_dir, report)    # another settle is updating the registry for it
                return
            if is_current(fh.fileno(), path):
                _settle_held(client, run_dir, fh, report, retries=retries, until=until)
                return
        if until is not None and time.monotonic() >= until:   # retired or set aside while
            _count(run_dir, report)                            # we waited: look again
            return


def _settle_held(client: ApiClient, run_dir: Path, fh: IO[bytes], report: ReplayReport, *,
                 retries: int | None, until: float | None) -> None:
    """The settle step, holding finish.jsonl (`fh`)."""
    run_id = run_dir.name
    with run_folder_lock(run_dir, wait_s=_wait_s(until)) as held:
        state = run_state(run_dir)
        if state.owed:
            report.owed[run_id] = state.owed
        if not held:            # another process is working in the folder: the next replay
            return
        finish_file.restore_leftover(run_dir)
        line, read_to = finish_file.last_line(fh)
    if line is None or state.busy:
        return      # no final state yet, or a reporter (an attempt) or a drain holds a spool
    if state.owed:
        _announce(client, run_id, _owing(line["changes"], state.owed), retries=retries)
        return
    final = _final(line["changes"], state)
    if state.refused:
        _log.warning("run %s: %s", run_id, final["status_reason"])
    try:
        client.update_run(run_id, retries=retries, **{**final, "owed_records": 0})
    except ApiError as exc:
        if isinstance(exc, ApiUnavailable) or exc.status_code in (401, 403):
            raise
        kept = finish_file.refuse(run_dir, line, exc)
        _log.error("registry refused the final state of run %s (%s); kept in %s",
                   run_id, exc, kept)
        report.errors[run_id] = exc
    else:
        report.finished.append(run_id)
    finish_file.retire(run_dir, fh, read_to, wait_s=_wait_s(until))


def _count(run_dir: Path, report: ReplayReport) -> None:
    owed = run_state(run_dir).owed if run_dir.is_dir() else 0
    if owed:
        report.owed[run_dir.name] = owed


def _count_and_tidy(run_dir: Path, report: ReplayReport, *, until: float | None) -> bool:
    """No final state to record: count what the run owes, remove its folder once empty.
    Returns True instead when a dead settle's leftover final state was put back."""
    with run_folder_lock(run_dir, wait_s=_wait_s(until)) as held:
        if held and finish_file.restore_leftover(run_dir):
            return True
        state = run_state(run_dir) if run_dir.is_dir() else RunState()
        if state.owed:
            report.owed[run_dir.name] = state.owed
        if held and not state.owed and not state.busy:
            remove_if_empty(run_dir)
    return False


def _wait_s(until: float | None) -> float:
    """How long a lock may be waited for: until the caller's deadline, and `_LOCK_WAIT_S`
    at most (whoever holds it is settling the run: it does not need a second settle)."""
    if until is None:
        return _LOCK_WAIT_S
    return min(_LOCK_WAIT_S, max(0.0, until - time.monotonic()))


def _owing(changes: dict[str, Any], owed: int) -> dict[str, Any]:
    """What the registry records while a finished run still owes `owed` records."""
    if changes.get("status") in ("failed", "cancelled"):   # final already: say what is owed
        reason = str(changes.get("status_reason") or changes["status"])[:_REASON_MAX]
        return {"status": changes["status"], "status_reason": f"{reason}; {owed} records owed",
                "owed_records": owed}
    return {"status": "running", "status_reason": f"training finished; {owed} records owed",
            "owed_records": owed}


def _final(changes: dict[str, Any], state: RunState) -> dict[str, Any]:
    """The final `changes`, saying on the run which of its records the API refused."""
    if not state.refused:
        return changes
    refused = (f"{state.refused} records refused by the API, kept in "
               f"{', '.join(state.refused_in)}")
    lead = changes.get("status_reason") or changes.get("status") or "finished"
    return {**changes, "status_reason": f"{str(lead)[:_REASON_MAX]}; {refused}"[:4000]}


def _announce(client: ApiClient, run_id: str, changes: dict[str, Any], *,
              retries: int | None) -> None:
    """Record what a finished run owes; a refusal (a run the registry no longer has) is logged,
    the records themselves are still replayed (and refused one by one, into `.rejected`)."""
    try:
        client.update_run(run_id, retries=retries, **changes)
    except ApiError as exc:
        if isinstance(exc, ApiUnavailable) or exc.status_code in (401, 403):
            raise
        _log.warning("registry refused the owed count of run %s: %s", run_id, exc)
