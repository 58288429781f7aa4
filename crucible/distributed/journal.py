"""A replica process's journal: `process.jsonl`, the records of real faults and lives.

Not simulator events (those are `events.jsonl`): each life of a replica's process appends here
what happened to the process itself: `start` (the first life) or `restart` (each later one),
`kill` (planned, recorded by the life that kills itself; or unplanned, recorded by the next life
at the dead life's last heartbeat), `caught_up`, `first_contribution` and `over_budget`. Every
record names its life: the number of `start`/`restart` records before it. The launcher reads the
journals (`count_lives`, `died_in`) to merge the run's summary; the worker writes them. Appends
are fsync'd JSON lines (`crucible.runfiles`); a torn last line is repaired when a life opens the
journal.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from crucible.runfiles import append_jsonl, read_jsonl, repair_torn_tail

__all__ = ["Journal", "count_lives", "died_in", "restart_count"]

FILE = "process.jsonl"
ROUNDS = "rounds.jsonl"


def restart_count() -> int:
    """The elastic agent's restart count of this process (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def count_lives(records: list[dict[str, Any]]) -> int:
    """The lives a replica's process records show: one `start` or `restart` record each."""
    return sum(1 for r in records if r.get("kind") in ("start", "restart"))


def died_in(out: Path) -> int:
    """The global step the last life was in when it died: after its last round record, not
    before a round it was to train from (`caught_up`; a pipeline stage's `rejoin`) or was
    killed at (`kill`). The same for a replica's folder and a pipeline stage's."""
    steps = [r["global_step"] + 1 for r in read_jsonl(Path(out) / ROUNDS)]
    steps += [r["global_step"] for r in read_jsonl(Path(out) / FILE)
              if r.get("kind") in ("caught_up", "kill", "rejoin")]
    return max(steps, default=0)


class Journal:
    """The journal of replica `replica` in folder `out`, opened by one life: its torn tail
    repaired and this life counted (`life`: the lives recorded before it)."""

    def __init__(self, out: Path, replica: int) -> None:
        self.out, self.replica = Path(out), replica
        self.path = self.out / FILE
        repair_torn_tail(self.path)
        repair_torn_tail(self.out / ROUNDS)
        self.life = count_lives(self.records())

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def record(self, kind: str, g: int, *, wall: float | None = None, **extra: Any) -> None:
        """Append one record of this life (`extra` may name another `life`: an unplanned death
        is recorded by the life after it)."""
        append_jsonl(self.path, {
            "kind": kind, "global_step": g, "replica": self.replica,
            "wall": time.time() if wall is None else wall, "restart": restart_count(),
            "life": self.life, **extra})

    def explained(self, life: int) -> dict[str, Any] | None:
        """The planned `kill` record that ended life `life`, if one did."""
        return next((r for r in self.records()
                     if r.get("kind") == "kill" and r.get("planned", True)
                     and r.get("life", 0) == life), None)

    def recorded_death(self, life: int) -> bool:
        """Whether an unplanned death of life `life` is recorded already (by a life that died
        since)."""
        return any(r.get("kind") == "kill" and r.get("dead_life") == life
                   for r in self.records())

    def fired(self, g: int) -> bool:
        """Whether the planned kill at global step `g` has happened (an unplanned death
        recorded at the same step is not it)."""
        return any(r.get("kind") == "kill" and r["global_step"] == g and r.get("planned", True)
                   for r in self.records())
