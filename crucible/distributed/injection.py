"""Test fault injection for replica processes: stop a process at a chosen moment and wait there
to be killed from outside, so a test (or `benchmarks/distributed.py`) can kill it inside an
upload or before its final evaluation. Armed only by an environment variable; the worker imports
this module only when one is set (`armed`), so the production path never reaches it.

- `CRUCIBLE_FAULT_HOLD_UPLOAD="REPLICA:STEP:STAGE"`: that replica's first life stops inside the
  upload of that contribution (its temporary file written, not yet linked in: what a writer
  killed before its rename leaves); the file `holding-upload` in its folder says it is there.
  Needs a `file://` store.
- `CRUCIBLE_FAULT_HOLD_FINAL="REPLICA"`: that replica's first life stops after its last round's
  record, before the final evaluation (`holding-final` says it is there).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from crucible.config import ConfigError
from crucible.gather import contribution_key
from crucible.runfiles import write_json_atomic
from crucible.store import LocalStore

__all__ = ["HOLD_UPLOAD_ENV", "HOLD_FINAL_ENV", "armed", "arm"]

log = logging.getLogger(__name__)
HOLD_UPLOAD_ENV = "CRUCIBLE_FAULT_HOLD_UPLOAD"
HOLD_FINAL_ENV = "CRUCIBLE_FAULT_HOLD_FINAL"


def armed() -> bool:
    """Whether any injection is asked for (the worker imports nothing of this otherwise)."""
    return bool(os.environ.get(HOLD_UPLOAD_ENV) or os.environ.get(HOLD_FINAL_ENV))


def hold(marker: Path, what: dict[str, Any]) -> None:
    """Say where this process is (`marker`) and wait to be killed."""
    write_json_atomic(marker, {**what, "pid": os.getpid()})
    log.warning("fault injection: holding at %s until killed", what)
    while True:
        time.sleep(1.0)


class _HoldingStore:
    """The store, except that one contribution's upload stops half way."""

    def __init__(self, store: LocalStore, key: str, marker: Path) -> None:
        self._store, self._key, self._marker = store, key, marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key != self._key:
            return self._store.put_if_absent(key, data)
        temporary = self._store.write_temporary(key, bytes(data))
        hold(self._marker, {"key": key, "temporary": temporary})
        return False                                      # not reached


def arm(trainer: Any, out: Path, *, replica: int, life: int) -> None:
    """Arm what the environment asks for on `trainer` (a `worker.ReplicaTrainer`) of the first
    life of replica `replica`; later lives run unarmed."""
    if life > 0:
        return
    text = os.environ.get(HOLD_UPLOAD_ENV, "")
    if text:
        try:
            r, step, stage = (int(x) for x in text.split(":"))
        except ValueError:
            raise ConfigError(f"{HOLD_UPLOAD_ENV}={text!r}: expected REPLICA:STEP:STAGE") from None
        if r == replica:
            sync = trainer.sync
            if not isinstance(sync.store, LocalStore):
                raise ConfigError(f"{HOLD_UPLOAD_ENV} needs a file:// store (it stops a "
                                  "LocalStore write half way)")
            sync.store = _HoldingStore(sync.store,
                                       contribution_key(sync.run_key, step, stage, replica),
                                       Path(out) / "holding-upload")
    if os.environ.get(HOLD_FINAL_ENV) == str(replica):
        done, last = trainer._round_done, trainer.config.train.global_steps - 1

        def round_done(g: int, step: Any, results: Any) -> None:
            done(g, step, results)
            if g == last:
                hold(Path(out) / "holding-final", {"global_step": g})

        trainer._round_done = round_done
