"""File primitives the spools and a run's final-state file share: flock with a bounded wait,
the run-folder lock, opening a file in a run folder, and tidying an emptied run folder (their
lines are appended, and torn tails cut, by `crucible.runfiles`).

`flock` is reliable on a local disk only (see `crucible.registry.spool`): the spool root must be local.
"""
from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["POLL_S", "lock_fd", "is_current", "run_folder_lock",
           "open_in_run_folder", "remove_if_empty"]

POLL_S = 0.05


def lock_fd(fd: int, *, wait_s: float) -> bool:
    """Take an exclusive flock on `fd`, polling for up to `wait_s`; False if still held."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def is_current(fd: int, path: Path) -> bool:
    """True while `path` still names the file open as `fd`: a holder that emptied a spool
    removes it before unlocking, so whoever waited for that lock must look again."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


@contextmanager
def run_folder_lock(run_dir: Path, *, wait_s: float) -> Iterator[bool]:
    """Hold the run folder's flock for the block; yields False when it could not be taken
    within `wait_s` or the folder is gone. Held for file operations only, never a request."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield False
        return
    try:
        yield lock_fd(fd, wait_s=wait_s) and is_current(fd, run_dir)
    finally:
        os.close(fd)


def open_in_run_folder(path: Path, mode: str) -> IO[bytes]:
    """Open `path` in `mode`, making its run folder first - again when a reporter or a replay
    removed the empty folder in between."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return open(path, mode)
        except FileNotFoundError:
            continue


def remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass        # not empty (or already gone): nothing to tidy
