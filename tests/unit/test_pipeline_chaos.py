"""Unplanned kills at a fixed rate (crucible.distributed.pipeline.chaos): the schedule is a
seeded stream of its own, hits inner stages only, and the failure schedule read back from the
stage journals is what the deaths and rejoins were."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from crucible.distributed.pipeline.chaos import draw_kills, realized_plan
from crucible.distributed.pipeline.stage_model import stage_dir


def test_the_same_seed_draws_the_same_kills_and_another_seed_others() -> None:
    a = draw_kills(seed=3, rate=0.2, replicas=2, stages=4, global_steps=20)
    assert a == draw_kills(seed=3, rate=0.2, replicas=2, stages=4, global_steps=20)
    assert a != draw_kills(seed=4, rate=0.2, replicas=2, stages=4, global_steps=20)
    assert a, "at rate 0.2 over 19 steps x 4 inner stage-replicas some kill is drawn"


def test_kills_hit_inner_stages_after_the_first_step_in_order() -> None:
    kills = draw_kills(seed=0, rate=0.5, replicas=3, stages=5, global_steps=30)
    assert {k.stage for k in kills} == {1, 2, 3}
    assert min(k.global_step for k in kills) >= 1
    assert all(0.0 <= k.fraction < 1.0 for k in kills)
    assert kills == sorted(kills, key=lambda k: (k.global_step, k.fraction, k.replica, k.stage))
    # about rate x draws: 29 steps x 3 replicas x 3 inner stages at 0.5
    assert 0.35 * 261 < len(kills) < 0.65 * 261


def test_rate_zero_kills_nothing_and_bad_settings_are_refused() -> None:
    assert draw_kills(seed=0, rate=0.0, replicas=2, stages=4, global_steps=50) == []
    with pytest.raises(ValueError, match="rate=1.5"):
        draw_kills(seed=0, rate=1.5, replicas=2, stages=4, global_steps=5)
    with pytest.raises(ValueError, match="stages=2"):
        draw_kills(seed=0, rate=0.1, replicas=2, stages=2, global_steps=5)


def _journal(run: Path, r: int, s: int, records: list[dict]) -> None:
    folder = stage_dir(run, r, s)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "process.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))


def test_the_realized_plan_runs_from_each_death_to_its_rejoin(tmp_path: Path) -> None:
    _journal(tmp_path, 0, 1, [
        {"kind": "start", "global_step": 0, "wall": 1.0},
        {"kind": "kill", "global_step": 3, "planned": False, "wall": 5.0},
        {"kind": "restart", "global_step": 3, "rejoin": 4, "wall": 7.0},
        {"kind": "rejoin", "global_step": 5, "wall": 8.0},     # came back two rounds later
        {"kind": "kill", "global_step": 9, "planned": False, "wall": 9.0}])   # never back
    _journal(tmp_path, 1, 2, [
        {"kind": "start", "global_step": 0, "wall": 1.0},
        {"kind": "kill", "global_step": 2, "planned": True, "wall": 2.0},      # the plan's
        {"kind": "rejoin", "global_step": 4, "wall": 3.0}])
    plan = realized_plan(tmp_path, replicas=2, stages=4, global_steps=12)
    assert plan.to_list() == [
        {"replica": 0, "stage": 1, "start": 3, "duration": 2},
        {"replica": 0, "stage": 1, "start": 9, "duration": 3}]



def test_a_stage_just_killed_reads_as_down_until_its_next_life_rejoins(tmp_path: Path) -> None:
    from crucible.distributed.pipeline.chaos import Killer

    _journal(tmp_path, 0, 1, [{"kind": "start", "global_step": 0, "wall": 1.0}])
    killer = Killer(tmp_path, [], stages=4, alive=lambda: True)
    assert killer._training(0, 1)
    killer.killed[(0, 1)] = 5.0              # killed; the journal still says "start"
    assert not killer._training(0, 1)
    _journal(tmp_path, 0, 1, [{"kind": "start", "global_step": 0, "wall": 1.0},
                              {"kind": "kill", "global_step": 3, "planned": False, "wall": 6.0},
                              {"kind": "rejoin", "global_step": 4, "wall": 7.0}])
    assert killer._training(0, 1)
