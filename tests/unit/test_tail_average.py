"""`train.tail_average` (issue 34's cheaper estimand): the global weights averaged over the last
outer steps, scored once at the end as `tail_val_loss`; training itself is unchanged, and a
resumed run ends with the same tail as an uninterrupted one."""
from __future__ import annotations

from pathlib import Path

import pytest

from crucible.config import ConfigError
from crucible.train import train
from tests.unit.helpers import tiny
from tests.unit.test_checkpoint_integrity import _Crash

CFG = {"faults.p": 0.3, "train.global_steps": 6, "train.checkpoint_every": 1}


def test_the_tail_is_scored_and_training_is_unchanged(tmp_path: Path) -> None:
    plain = train(tiny(**CFG), out_dir=tmp_path / "plain")
    tail = train(tiny(**CFG, **{"train.tail_average": 0.5}), out_dir=tmp_path / "tail")
    assert "tail_val_loss" not in plain
    assert tail["final_val_loss"] == plain["final_val_loss"] and tail["evals"] == plain["evals"]
    assert tail["tail_average"] == {"steps": 3, "from_step": 4}
    assert tail["tail_val_loss"] > 0 and tail["tail_val_loss"] != tail["final_val_loss"]


def test_a_tail_of_one_step_is_the_final_global_model(tmp_path: Path) -> None:
    one = train(tiny(**CFG, **{"train.tail_average": 0.01}), out_dir=tmp_path / "one")
    assert one["tail_average"] == {"steps": 1, "from_step": 6}
    assert one["tail_val_loss"] == one["final_val_loss"]


def test_a_run_resumed_inside_the_tail_ends_with_the_same_tail(tmp_path: Path) -> None:
    cfg = tiny(**CFG, **{"train.tail_average": 0.5})
    whole = train(cfg, out_dir=tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path / "cut", callback=_Crash(after=5))   # 5 of 6 steps done
    resumed = train(cfg, out_dir=tmp_path / "cut", resume=True)
    assert resumed["tail_val_loss"] == whole["tail_val_loss"]
    assert resumed["tail_average"] == whole["tail_average"]


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_a_tail_outside_0_1_names_the_key(value: float) -> None:
    with pytest.raises(ConfigError, match=r"train.tail_average must be in \[0, 1\)"):
        tiny(**{"train.tail_average": value})


def test_the_tail_leaves_a_baselines_reports_alone(tmp_path: Path) -> None:
    """p = 0, MAPL, four stages: the alignment report and the bases' report read the model after
    the tail's evaluation, which put the final global weights back."""
    cfg = {"pipeline.compression": "mapl", "train.global_steps": 4}
    plain = train(tiny(**cfg), out_dir=tmp_path / "plain", alignment=True)
    tail = train(tiny(**cfg, **{"train.tail_average": 0.5}), out_dir=tmp_path / "tail",
                 alignment=True)
    assert "tail_val_loss" in tail and "alignment" in plain
    assert tail["alignment"] == plain["alignment"] and tail["mapl_bases"] == plain["mapl_bases"]


def test_the_distributed_mode_refuses_a_tail() -> None:
    from crucible.distributed.worker import check_distributed

    with pytest.raises(ConfigError, match="train.tail_average must be 0 in distributed mode"):
        check_distributed(tiny(**{"train.tail_average": 0.1}))
