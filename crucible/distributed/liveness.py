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
- fresh and training: wait if this life contributes to round g (`from <= g`);
- stale (the process is dead): not in the round it died in (its contribution can no longer
  come); in a later round, if the replica has lives left (its agent will restart it), it is
  *coming back*; so is a fresh life still catching up to a step at or before g (one catching up
  to a later step is not waited for). A replica coming back is waited for once per life it
  comes back as: in one round, until its contribution or the deadline; not again until that
  life trains. Otherwise (no lives left) do not wait.

So a dead replica costs its peers at most one lease in the round it died in and at most one
deadline (usually the few seconds of its restart) after it, not one deadline per round. The
store's agreed manifests remain the only agreement: the lease only decides how long a peer
waits before it agrees, and a contribution that lands after the manifest is simply missing.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from crucible.config import ConfigError
from crucible.store import KeyNotFound, Store, StoreError

__all__ = ["Heartbeat", "PeerWatch", "add_recovery_arguments", "beat_key", "check_recovery",
           "read_beat", "write_gone", "BEAT_MAX_BYTES", "DEFAULT_LEASE_S", "DEFAULT_RESTARTS"]

log = logging.getLogger(__name__)
DEFAULT_RESTARTS = 3      # per replica, for unplanned deaths (`crucible launch --restarts`)
DEFAULT_LEASE_S = 5.0     # `crucible launch --lease-s`
BEAT_MAX_BYTES = 4096
STATES = frozenset({"training", "catching_up", "gone", "done"})


def add_recovery_arguments(parser: Any) -> None:
    """`--restarts` and `--lease-s`, as `crucible launch` and the Kubernetes renderer take them."""
    parser.add_argument("--restarts", type=int, default=DEFAULT_RESTARTS, metavar="N",
                        help="per replica, restarts for unplanned deaths of its worker or agent "
                             f"(default {DEFAULT_RESTARTS}; planned --kill restarts come on top)")
    parser.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S, metavar="SECONDS",
                        help="heartbeat lease: peers stop waiting for a replica silent this long "
                             f"(default {DEFAULT_LEASE_S:g}; 0 turns the lease off)")


def check_recovery(*, restarts: int, lease_s: float) -> None:
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
        raise ConfigError(f"restarts (--restarts) must be a whole number >= 0, got "
                          f"{restarts!r}")
    if not (isinstance(lease_s, int | float) and lease_s >= 0 and lease_s == lease_s):
        raise ConfigError(f"lease_s (--lease-s) must be a number of seconds >= 0 (0: no "
                          "lease; peers wait for a dead replica until each round's deadline), "
                          f"got {lease_s!r}")


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
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    ok = (isinstance(body, dict) and body.get("replica") == replica
          and body.get("state") in STATES
          and count(body.get("life")) and count(body.get("seq"))
          and all(body.get(k) is None or count(body[k]) for k in ("from", "round"))
          and isinstance(body.get("wall"), int | float) and not isinstance(body["wall"], bool)
          and math.isfinite(body["wall"]))
    if not ok:
        log.warning("heartbeat of replica %d is malformed; treated as absent", replica)
        return None
    return body


def write_gone(store: Store, run: str, replica: int) -> None:
    """A last beat for a replica that will not come back, written by someone else (the
    launcher, once the replica's agent gave up): its peers stop waiting for it at once."""
    beat = read_beat(store, run, replica)
    body = {"replica": replica, "life": beat["life"] if beat else 0,
            "seq": (beat["seq"] + 1) if beat else 1, "state": "gone",
            "from": beat["from"] if beat else None, "round": beat["round"] if beat else None,
            "wall": time.time()}
    store.put(beat_key(run, replica), json.dumps(body, sort_keys=True).encode(), durable=False)


class Heartbeat:
    """This process's lease: `start()` begins beating from a daemon thread (with a store of its
    own), `update(...)` changes what the next beat says and writes it at once, `stop(state)`
    writes a last beat and ends the thread. A beat that cannot be written is logged, never
    raised: the lease is advice to the peers, and training must not die of it."""

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
            self._beat()

    def _beat(self) -> None:
        """Write the body with the next sequence number (one writer at a time, so a later body
        never lands before an earlier one)."""
        assert self._store is not None, "start() first"
        with self._lock:
            self._body["seq"] += 1
            self._body["wall"] = time.time()
            data = json.dumps(self._body, sort_keys=True).encode()
            try:
                self._store.put(beat_key(self.run, self.replica), data, durable=False)
            except Exception as exc:       # a store hiccup: the next beat may succeed
                log.warning("heartbeat of replica %d not written: %s", self.replica, exc)


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

    def _returning(self, r: int, global_step: int) -> int | None:
        """The life replica r is coming back as, if it may contribute to `global_step` but is
        not training yet: its dead life's successor (the life died in an earlier round and has
        lives left), or a restarted life still catching up to a step at or before this one."""
        beat = self.beats[r]
        assert beat is not None
        start = beat["from"] if beat["from"] is not None else 0
        if self.fresh(r):
            return beat["life"] if beat["state"] == "catching_up" and start <= global_step \
                else None
        died_in = beat["round"] if beat["round"] is not None else start
        if global_step > died_in and beat["life"] + 1 < self.lives[r]:
            return beat["life"] + 1
        return None

    def waits_for(self, r: int, global_step: int) -> bool:
        """Whether replica r's contribution to `global_step` is still worth waiting for."""
        beat = self.beats.get(r)
        if beat is None:
            return True
        if beat["state"] in ("gone", "done"):
            return False
        start = beat["from"] if beat["from"] is not None else 0
        if self.fresh(r) and beat["state"] == "training":
            return start <= global_step
        returning = self._returning(r, global_step)
        return returning is not None and self._awaited.get(r) != returning

    def round_over(self, global_step: int) -> None:
        """After round `global_step`: a replica coming back (dead with lives left, or catching
        up) that could have been waited for in it has had its one wait, whether or not this
        process got to ask (another peer's manifest may have ended the round first)."""
        for r in self.peers:
            beat = self.beats.get(r)
            if beat is None or beat["state"] in ("gone", "done"):
                continue
            returning = self._returning(r, global_step)
            if returning is not None:
                self._awaited[r] = returning
