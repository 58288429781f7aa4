"""Who is still there: a heartbeat lease per replica process, in the store.

Each replica process keeps one small object, `<run>/alive/replica-<r>`, rewritten every
`lease_s / 4` seconds by a background thread (`Heartbeat`): its life (0 for the first process,
1 after the first restart, ...), a sequence number, its state (`training`, `catching_up`, `gone`
for a replica killed for good, `done` when it finished), the first global step this life
contributes to (`from`) and the round it is in (`round`).

A peer waiting for contributions asks `PeerWatch.waits_for(r, g)` whether replica r's round-g
contribution is still worth waiting for. The lease is judged by the watcher's own clock: a beat
is fresh while its sequence number changed within the last `lease_s` seconds of what this
process observed (no two hosts' clocks are compared). The rule:

- no beat yet (the run is starting): wait, as without a lease;
- `gone` or `done`: do not wait;
- fresh: wait if this life contributes to round g (`from <= g`); a restarted process that is
  still catching up to a later round is not waited for;
- stale (the process is dead): not in the round it died in (its contribution can no longer
  come). In a later round, if the replica has lives left (its agent will restart it), wait for
  it once: until its new life announces itself or the round's deadline, whichever is first.
  Otherwise (no lives left, or already waited for once) do not wait.

So a dead replica costs its peers at most one lease in the round it died in and at most one
deadline (usually the few seconds of its restart) after it, not one deadline per round. The
store's agreed manifests remain the only agreement: the lease only decides how long a peer
waits before it agrees, and a contribution that lands after the manifest is simply missing.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from crucible.store import KeyNotFound, Store, StoreError

__all__ = ["Heartbeat", "PeerWatch", "beat_key", "read_beat", "BEAT_MAX_BYTES",
           "DEFAULT_LEASE_S", "DEFAULT_RESTARTS"]

log = logging.getLogger(__name__)
DEFAULT_RESTARTS = 3      # per replica, for unplanned deaths (`crucible launch --restarts`)
DEFAULT_LEASE_S = 5.0     # `crucible launch --lease-s`
BEAT_MAX_BYTES = 4096
STATES = frozenset({"training", "catching_up", "gone", "done"})


def beat_key(run: str, replica: int) -> str:
    return f"{run}/alive/replica-{replica}"


def read_beat(store: Store, run: str, replica: int) -> dict[str, Any] | None:
    """Replica `replica`'s last beat, validated; None when there is none or it is not a beat
    (a peer's object is checked like any other read from the store)."""
    try:
        body = json.loads(store.get(beat_key(run, replica), max_bytes=BEAT_MAX_BYTES))
    except KeyNotFound:
        return None
    except (StoreError, ValueError) as exc:
        log.warning("heartbeat of replica %d unreadable (%s); treated as absent", replica, exc)
        return None
    ok = (isinstance(body, dict) and body.get("replica") == replica
          and body.get("state") in STATES
          and all(isinstance(body.get(k), int) and not isinstance(body.get(k), bool)
                  and body[k] >= 0 for k in ("life", "seq"))
          and all(body.get(k) is None or (isinstance(body[k], int) and body[k] >= 0)
                  for k in ("from", "round"))
          and isinstance(body.get("wall"), int | float))
    if not ok:
        log.warning("heartbeat of replica %d is malformed; treated as absent", replica)
        return None
    return body


class Heartbeat:
    """This process's lease: `start()` begins beating from a daemon thread (with a store of its
    own), `update(...)` changes what the next beat says (and beats at once), `stop(state)`
    writes a last beat and ends the thread."""

    def __init__(self, store_factory: Callable[[], Store], run: str, *, replica: int, life: int,
                 lease_s: float, start_from: int | None, state: str = "training") -> None:
        self._factory, self.run, self.replica = store_factory, run, replica
        self.interval_s = lease_s / 4
        self._body: dict[str, Any] = {"replica": replica, "life": life, "seq": 0,
                                      "state": state, "from": start_from, "round": None}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Store | None = None

    def start(self) -> Heartbeat:
        self._store = self._factory()
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._body.update(fields)
        self._beat()

    def stop(self, state: str = "done") -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self._body["state"] = state
        self._beat()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception as exc:            # a store hiccup: the next beat may succeed
                log.warning("heartbeat: %s", exc)

    def _beat(self) -> None:
        with self._lock:
            self._body["seq"] += 1
            self._body["wall"] = time.time()
            data = json.dumps(self._body, sort_keys=True).encode()
        assert self._store is not None, "start() first"
        self._store.put(beat_key(self.run, self.replica), data, durable=False)


class PeerWatch:
    """One process's view of its peers' leases (see the module docstring for the rule)."""

    def __init__(self, store: Store, run: str, *, replicas: int, me: int, lease_s: float,
                 lives: list[int], clock: Callable[[], float] = time.monotonic,
                 refresh_s: float = 0.1) -> None:
        self.store, self.run, self.me = store, run, me
        self.lease_s, self.lives, self.clock, self.refresh_s = lease_s, lives, clock, refresh_s
        self.peers = [r for r in range(replicas) if r != me]
        self.beats: dict[int, dict[str, Any] | None] = {r: None for r in self.peers}
        self.changed_at: dict[int, float] = {}
        self._read_at = -float("inf")
        self._awaited: dict[int, int] = {}         # replica -> the dead life already waited for
        self._awaiting: dict[int, int] = {}        # this round: replica -> dead life waited for

    def refresh(self, *, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._read_at < self.refresh_s:
            return
        self._read_at = now
        for r in self.peers:
            beat = read_beat(self.store, self.run, r)
            old = self.beats[r]
            if beat is not None and (old is None or (beat["life"], beat["seq"])
                                     != (old["life"], old["seq"])):
                self.changed_at[r] = now
            if beat is not None:
                self.beats[r] = beat

    def fresh(self, r: int) -> bool:
        return r in self.changed_at and self.clock() - self.changed_at[r] <= self.lease_s

    def waits_for(self, r: int, global_step: int) -> bool:
        """Whether replica r's contribution to `global_step` is still worth waiting for."""
        beat = self.beats.get(r)
        if beat is None:
            return True
        if beat["state"] in ("gone", "done"):
            return False
        start = beat["from"] if beat["from"] is not None else 0
        if self.fresh(r):
            return start <= global_step
        died_in = beat["round"] if beat["round"] is not None else start
        if global_step <= died_in:
            return False
        if beat["life"] + 1 < self.lives[r] and self._awaited.get(r) != beat["life"]:
            self._awaiting[r] = beat["life"]
            return True
        return False

    def round_over(self) -> None:
        """After a round: a dead life waited for once is not waited for again."""
        for r, life in self._awaiting.items():
            beat = self.beats.get(r)
            if beat is not None and beat["life"] == life and not self.fresh(r):
                self._awaited[r] = life
        self._awaiting.clear()

    def gone(self) -> list[int]:
        """Peers not waited for at all any more: gone, or dead with no life left."""
        out = []
        for r in self.peers:
            beat = self.beats.get(r)
            if beat is None or self.fresh(r) and beat["state"] not in ("gone", "done"):
                continue
            if beat["state"] == "gone" or beat["life"] + 1 >= self.lives[r]:
                out.append(r)
        return out
