"""The heartbeat lease of the distributed mode (crucible.distributed.liveness) and the worker's
records of its lives: the waiting rule on a real LocalStore with a clock the test moves, the
validation of a beat read from the store, a torn last record line. No processes here
(tests/integration/test_outside_kills.py kills real ones)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from crucible.config import ConfigError, apply_overrides
from crucible.distributed.journal import died_in
from crucible.distributed.launch import check_recovery, lives_of
from crucible.distributed.liveness import Heartbeat, PeerWatch, beat_key, read_beat
from crucible.presets import get_preset
from crucible.runfiles import read_jsonl, repair_torn_tail
from crucible.store import LocalStore

LEASE = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _beat(store: LocalStore, replica: int, *, life: int = 0, seq: int = 1,
          state: str = "training", start: int | None = 0, round_: int | None = None) -> None:
    store.put(beat_key("run", replica), json.dumps({
        "replica": replica, "life": life, "seq": seq, "state": state, "from": start,
        "round": round_, "wall": 1.0}).encode())


def _watch(store: LocalStore, clock: Clock, *, lives: list[int] | None = None) -> PeerWatch:
    return PeerWatch(store, "run", replicas=3, me=0, lease_s=LEASE, lives=lives or [4, 4, 4],
                     clock=clock, refresh_s=0.0)


def test_a_peer_with_no_beat_yet_is_waited_for(tmp_path: Path) -> None:
    watch = _watch(LocalStore(tmp_path), Clock())
    watch.refresh()
    assert watch.waits_for(1, 0) and watch.waits_for(2, 5)


def test_a_fresh_peer_is_waited_for_from_the_step_its_life_starts(tmp_path: Path) -> None:
    store, clock = LocalStore(tmp_path), Clock()
    _beat(store, 1, life=1, state="catching_up", start=7)
    watch = _watch(store, clock)
    watch.refresh()
    assert not watch.waits_for(1, 6)        # it is catching up to step 7: no contribution to 6
    assert watch.waits_for(1, 7) and watch.waits_for(1, 9)


def test_a_silent_peer_is_not_waited_for_in_the_round_it_died_in(tmp_path: Path) -> None:
    store, clock = LocalStore(tmp_path), Clock()
    _beat(store, 1, seq=5, round_=4)
    watch = _watch(store, clock)
    watch.refresh()
    assert watch.waits_for(1, 4)                 # fresh: waited for
    clock.now += LEASE / 2
    watch.refresh()                              # the same beat, still within the lease
    assert watch.waits_for(1, 4)
    clock.now += LEASE                           # silent for longer than the lease: dead
    watch.refresh()
    assert not watch.fresh(1)
    assert not watch.waits_for(1, 4)             # the round it died in
    # the next round: it has lives left, so it is waited for once (its agent restarts it) ...
    assert watch.waits_for(1, 5)
    watch.round_over(5)
    # ... and not again for the same dead life
    assert not watch.waits_for(1, 6) and not watch.waits_for(1, 9)
    # its next life announces itself, catching up to step 7: it had its one wait (round 5), so
    # it is not waited for until it trains, and then from step 7 on
    _beat(store, 1, life=1, seq=1, state="catching_up", start=7)
    clock.now += 0.1
    watch.refresh()
    assert not watch.waits_for(1, 6) and not watch.waits_for(1, 7)
    _beat(store, 1, life=1, seq=2, state="training", start=7)
    clock.now += 0.1
    watch.refresh()
    assert not watch.waits_for(1, 6) and watch.waits_for(1, 7) and watch.waits_for(1, 8)


def test_a_life_catching_up_is_waited_for_once(tmp_path: Path) -> None:
    # restarted before its peers noticed it was gone: catching up to step 4, so waited for in
    # round 4 (it may make it), but not in a later round while it is still catching up
    store, clock = LocalStore(tmp_path), Clock()
    _beat(store, 1, life=1, state="catching_up", start=4)
    watch = _watch(store, clock)
    watch.refresh()
    assert not watch.waits_for(1, 3) and watch.waits_for(1, 4)
    watch.round_over(4)
    assert not watch.waits_for(1, 5)
    _beat(store, 1, life=1, seq=2, state="training", start=6)
    clock.now += 0.1
    watch.refresh()
    assert not watch.waits_for(1, 5) and watch.waits_for(1, 6)


def test_a_beat_that_keeps_changing_stays_fresh(tmp_path: Path) -> None:
    store, clock = LocalStore(tmp_path), Clock()
    watch = _watch(store, clock)
    for seq in range(1, 10):
        _beat(store, 2, seq=seq, round_=seq)
        clock.now += LEASE * 0.9
        watch.refresh()
        assert watch.fresh(2) and watch.waits_for(2, seq)


def test_a_dead_peer_with_no_life_left_is_never_waited_for(tmp_path: Path) -> None:
    store, clock = LocalStore(tmp_path), Clock()
    _beat(store, 1, life=2, round_=3)
    watch = _watch(store, clock, lives=[3, 3, 3])      # life 2 was replica 1's last
    watch.refresh()
    clock.now += LEASE * 2
    watch.refresh()
    assert not watch.waits_for(1, 4) and not watch.waits_for(1, 10)


@pytest.mark.parametrize("state", ["gone", "done"])
def test_gone_and_done_peers_are_not_waited_for(state: str, tmp_path: Path) -> None:
    store, clock = LocalStore(tmp_path), Clock()
    _beat(store, 2, state=state, round_=3)
    watch = _watch(store, clock)
    watch.refresh()
    assert not watch.waits_for(2, 3) and not watch.waits_for(2, 4)


@pytest.mark.parametrize("body", [
    b"not json", b"[]", b'{"replica": 2}',
    json.dumps({"replica": 1, "life": 0, "seq": 1, "state": "training", "from": 0,
                "round": None, "wall": 1.0}).encode(),                     # another replica's
    json.dumps({"replica": 2, "life": -1, "seq": 1, "state": "training", "from": 0,
                "round": None, "wall": 1.0}).encode(),
    json.dumps({"replica": 2, "life": 0, "seq": True, "state": "training", "from": 0,
                "round": None, "wall": 1.0}).encode(),
    json.dumps({"replica": 2, "life": 0, "seq": 1, "state": "asleep", "from": 0,
                "round": None, "wall": 1.0}).encode(),
    b"x" * 5000,                                                           # over the size limit
])
def test_a_malformed_beat_is_read_as_none(body: bytes, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(beat_key("run", 2), body)
    assert read_beat(store, "run", 2) is None


def test_the_heartbeat_writes_a_valid_beat_that_advances(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    beat = Heartbeat(lambda: LocalStore(tmp_path), "run", replica=1, life=2, lease_s=0.4,
                     start_from=5, state="catching_up").start()
    try:
        first = read_beat(store, "run", 1)
        assert first is not None and (first["life"], first["state"], first["from"]) == (
            2, "catching_up", 5)
        beat.update(state="training", round=6)
        second = read_beat(store, "run", 1)
        assert second["seq"] > first["seq"] and (second["state"], second["round"]) == (
            "training", 6)
    finally:
        beat.stop("gone")
    assert read_beat(store, "run", 1)["state"] == "gone"


def test_a_torn_last_record_line_is_passed_over_and_an_earlier_one_is_an_error(
        tmp_path: Path) -> None:
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"global_step": 0}\n{"global_step": 1}\n{"global_st')
    assert read_jsonl(path) == [{"global_step": 0}, {"global_step": 1}]
    path.write_text('{"global_step": 0}\n{"glob\n{"global_step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_the_round_a_life_died_in(tmp_path: Path) -> None:
    assert died_in(tmp_path) == 0                       # died before its first round record
    (tmp_path / "rounds.jsonl").write_text("".join(
        json.dumps({"global_step": g}) + "\n" for g in (0, 1, 2)))
    assert died_in(tmp_path) == 3                       # after round 2, in round 3
    # a later life caught up to step 8 and died before finishing it
    (tmp_path / "process.jsonl").write_text(json.dumps(
        {"kind": "caught_up", "global_step": 8, "replica": 0, "wall": 1.0}) + "\n")
    assert died_in(tmp_path) == 8
    # a pipeline stage's later life rejoined at step 9 (its journal says `rejoin`) and died in it
    with open(tmp_path / "process.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "rejoin", "global_step": 9, "stage": 1, "wall": 2.0}) + "\n")
    assert died_in(tmp_path) == 9


def test_every_replica_has_a_restart_budget_and_bad_budgets_are_refused() -> None:
    config = apply_overrides(get_preset("smoke"), ["replicas=3"])
    kills = [{"replica": 1, "global_step": 2, "rejoin": True},
             {"replica": 2, "global_step": 3, "rejoin": False}]
    assert lives_of(config, kills, restarts=3) == [4, 5, 5]
    assert lives_of(config, [], restarts=0) == [1, 1, 1]
    for restarts, lease, option in ((-1, 5.0, "--restarts"), (1.5, 5.0, "--restarts"),
                                    (2, -1.0, "--lease-s"), (2, float("nan"), "--lease-s")):
        with pytest.raises(ConfigError, match=option):
            check_recovery(restarts=restarts, lease_s=lease)


def test_a_torn_line_is_cut_before_the_next_record_is_appended(tmp_path: Path) -> None:
    path = tmp_path / "process.jsonl"
    path.write_text('{"kind": "start"}\n{"kind": "ki')
    repair_torn_tail(path)
    with open(path, "a") as fh:
        fh.write('{"kind": "restart"}\n')
    assert read_jsonl(path) == [{"kind": "start"}, {"kind": "restart"}]
    repair_torn_tail(path)                     # a whole file is left as it is
    assert path.read_text() == '{"kind": "start"}\n{"kind": "restart"}\n'


def test_recoveries_are_taken_from_the_lives_after_the_dead_one() -> None:
    from crucible.distributed.launch import _lost, _recoveries

    def rec(kind: str, step: int, wall: float, life: int, **extra) -> dict:
        return {"kind": kind, "global_step": step, "replica": 1, "wall": wall, "life": life,
                **extra}

    process = [rec("start", 0, 1.0, 0),
               rec("kill", 3, 4.0, 0, planned=True, rejoin=True),
               rec("restart", 3, 6.0, 1), rec("caught_up", 4, 6.5, 1),
               rec("first_contribution", 4, 7.0, 1),
               # life 1 dies unplanned: its last beat (9.0) is before its last record (9.5)
               rec("round_marker", 5, 9.5, 1),
               rec("kill", 6, 9.0, 1, planned=False, rejoin=True, dead_life=1),
               rec("restart", 6, 12.0, 2), rec("caught_up", 7, 12.5, 2),
               rec("first_contribution", 7, 13.0, 2)]
    rows = _recoveries(process)
    assert [(r["killed_at_step"], r["planned"], r["restart_step"], r["rejoin_step"])
            for r in rows] == [(3, True, 3, 4), (6, False, 6, 7)]
    assert rows[1]["kill_to_rejoin_s"] == 4.0 and rows[0]["kill_to_restart_s"] == 2.0
    # a replica whose third life died with no life left is lost, and says why
    lost = _lost(2, {0: {}}, process, [3, 3], [0, 1])
    assert lost == [{"replica": 1, "lives": 3, "last_step": 7,
                     "reason": "its restart budget is spent: 3 lives of 3 (agent exit code 1)"}]
