"""Faults from outside a distributed run, as an operator (or a test) makes them: find a replica's
worker or agent process and `kill -9` it at a chosen point.

    from crucible.distributed.outside import kill, wait_for_rounds
    wait_for_rounds(run_dir, replica=1, rounds=10)      # replica 1 finished 10 rounds
    killed_at = kill(run_dir, replica=1, what="worker")  # SIGKILL; returns the wall time

The pids come from the files the run writes (`replicas/replica-<r>/worker.pid`, `agent.pid`),
checked against `/proc/<pid>/cmdline` before the signal, so a recycled pid is never hit (Linux).
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from crucible.runfiles import read_jsonl

__all__ = ["pid_of", "worker_pids", "kill", "wait_for", "wait_for_rounds", "rounds_of",
           "holding_upload"]

_COMMAND = {"worker": b"crucible.distributed.run_worker", "agent": b"torch.distributed.run"}


def pid_of(run_dir: Path, *, replica: int, what: str) -> int | None:
    """The live pid of replica `replica`'s `what` ("worker" or "agent"), or None."""
    if what not in _COMMAND:
        raise ValueError(f"what={what!r}: expected 'worker' or 'agent'")
    folder = Path(run_dir) / "replicas" / f"replica-{replica}"
    try:
        pid = json.loads((folder / f"{what}.pid").read_text())["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, KeyError):
        return None
    if _COMMAND[what] not in argv or str(replica).encode() not in argv or not any(
            str(Path(run_dir).resolve()).encode() in a for a in argv):
        return None
    return int(pid)


def worker_pids(run_dir: Path, *, replica: int) -> list[int]:
    """Every live worker process of replica `replica` of the run in `run_dir`, by their
    command lines (`/proc`), whatever `worker.pid` says."""
    want = [_COMMAND["worker"], b"--run-dir", str(Path(run_dir).resolve()).encode(),
            b"--replica", str(replica).encode()]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:                   # gone meanwhile, or not ours to read
            continue
        if all(w in argv for w in want) and argv[argv.index(b"--replica") + 1] == want[-1]:
            found.append(int(entry.name))
    return found


def kill(run_dir: Path, *, replica: int, what: str = "worker") -> float:
    """SIGKILL replica `replica`'s worker or agent; returns the wall-clock time of the signal.
    Raises LookupError when that process is not running."""
    pid = pid_of(run_dir, replica=replica, what=what)
    if pid is None:
        raise LookupError(f"replica {replica} has no live {what} process in {run_dir}")
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    return at


def rounds_of(run_dir: Path, *, replica: int) -> list[dict]:
    return read_jsonl(Path(run_dir) / "replicas" / f"replica-{replica}" / "rounds.jsonl")


def wait_for(check: Callable[[], bool], *, timeout_s: float, what: str,
             alive: Callable[[], bool] = lambda: True) -> None:
    """Poll `check` every 20 ms until it holds; TimeoutError after `timeout_s`, RuntimeError
    when `alive()` turns false first (the run ended)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if not alive():
            raise RuntimeError(f"the run ended before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s:.0f} s")
        time.sleep(0.02)


def wait_for_rounds(run_dir: Path, *, replica: int, rounds: int, timeout_s: float = 600,
                    alive: Callable[[], bool] = lambda: True) -> None:
    """Until replica `replica` has recorded `rounds` rounds (`rounds.jsonl`)."""
    wait_for(lambda: len(rounds_of(run_dir, replica=replica)) >= rounds, timeout_s=timeout_s,
             what=f"{rounds} rounds of replica {replica}", alive=alive)


def holding_upload(run_dir: Path, *, replica: int) -> bool:
    """Whether replica `replica` stopped inside an upload (`injection.HOLD_UPLOAD_ENV`)."""
    return (Path(run_dir) / "replicas" / f"replica-{replica}" / "holding-upload").exists()

