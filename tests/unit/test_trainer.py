"""The multi-replica trainer: SparseLoCo rounds, fault strategies, accounting, determinism."""
import json

import pytest
import torch

from crucible.events import Callback, Event, Metric
from crucible.faults import FaultPlan, draw_plan
from crucible.store import LocalStore
from crucible.train import Trainer, train
from tests.unit.helpers import tiny

VOLATILE = ("wall_s", "run_key", "store_url", "versions", "timing")


def _stable(summary):
    return {k: v for k, v in summary.items() if k not in VOLATILE}


def _trainer(tmp_path, cfg, plan=None, callback=None):
    class Collect:
        def __init__(self):
            self.metrics, self.events = [], []

        def metric(self, item: Metric):
            self.metrics.append(item)

        def event(self, item: Event):
            self.events.append(item)

        def flush(self):
            pass

        def close(self):
            pass

    sink = callback or Collect()
    return Trainer(cfg, store=LocalStore(tmp_path / "store"), run_key="t", callback=sink,
                   plan=plan), sink


def test_clean_run_contributes_every_stage_replica_and_learns(tmp_path):
    cfg = tiny(**{"train.global_steps": 4, "train.eval_every": 2})
    summary = train(cfg, out_dir=tmp_path)
    R, S = cfg.replicas, cfg.pipeline.stages
    assert summary["contributions"] == {"made": R * S * 4, "missed": 0, "rejected": 0}
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["tokens_processed"] == summary["tokens_budget"]
    assert summary["bytes"]["upload"] * 20 < summary["bytes"]["dense_upload_equivalent"]
    assert [e["global_step"] for e in summary["evals"]] == [0, 2, 4]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["name"] == "train_loss" for m in metrics) == R * 4


def test_same_config_and_seed_give_identical_summaries(tmp_path):
    cfg = tiny(**{"faults.p": 0.5, "faults.duration": 2})
    a = train(cfg, out_dir=tmp_path / "a")
    b = train(cfg, out_dir=tmp_path / "b")
    assert _stable(a) == _stable(b)
    c = train(tiny(**{"faults.p": 0.5, "faults.duration": 2, "seed": 1}), out_dir=tmp_path / "c")
    assert c["final_val_loss"] != a["final_val_loss"]


def test_strategies_are_the_same_run_without_failures(tmp_path):
    results = {s: train(tiny(**{"faults.strategy": s, "train.global_steps": 2}), out_dir=tmp_path / s)
               for s in ("skip", "drop", "reroute", "drop_extend")}
    first = _stable(results["skip"])
    for strategy, summary in results.items():
        got = _stable(summary)
        got["config"]["faults"]["strategy"] = "skip"
        assert got == first, strategy


def test_every_arm_sees_the_same_fault_plan(tmp_path):
    plans = []
    for compression in ("none", "ssn", "mapl"):
        for strategy in ("skip", "drop", "reroute", "drop_extend"):
            cfg = tiny(**{"faults.p": 0.4, "faults.duration": 2, "pipeline.compression": compression,
                          "faults.strategy": strategy, "train.global_steps": 6})
            trainer, _ = _trainer(tmp_path / f"{compression}-{strategy}", cfg)
            plans.append(trainer.plan.until(6).to_list())
    assert plans[0] and all(p == plans[0] for p in plans)
    ran = train(tiny(**{"faults.p": 0.4, "faults.duration": 2, "train.global_steps": 6,
                        "pipeline.compression": "ssn"}), out_dir=tmp_path / "ran")
    assert ran["faults"] == plans[0]


def test_plan_prefix_does_not_depend_on_horizon():
    short = draw_plan(seed=3, p=0.3, duration=2, replicas=4, stages=4, horizon=10)
    long = draw_plan(seed=3, p=0.3, duration=2, replicas=4, stages=4, horizon=40)
    assert long.until(10).to_list() == short.to_list()


def test_token_accounting_per_strategy(tmp_path):
    plan = [{"replica": 1, "stage": 1, "start": 0, "duration": 2}]
    per_replica_step = 2 * 2 * 16   # H * B * T
    out = {}
    for strategy in ("skip", "reroute", "drop", "drop_extend"):
        cfg = tiny(**{"faults.strategy": strategy, "faults.p": 0.01, "train.global_steps": 3})
        out[strategy] = train(cfg, out_dir=tmp_path / strategy, plan=FaultPlan.from_list(plan))
    budget = out["skip"]["tokens_budget"]
    assert out["skip"]["tokens_processed"] == budget
    assert out["reroute"]["tokens_processed"] == budget
    assert out["drop"]["tokens_processed"] == budget - 2 * per_replica_step
    assert out["drop_extend"]["tokens_processed"] >= budget
    assert out["drop_extend"]["global_steps"] == 4
    assert out["reroute"]["donor_load"][0][1] == 2 * 2    # donor 0 carried 2 steps x H batches


def test_skip_keeps_the_failed_stage_passive_and_in_sync(tmp_path):
    cfg = tiny(**{"faults.p": 0.01})
    plan = FaultPlan().down(replica=1, stage=2, start=0, steps=2)
    trainer, sink = _trainer(tmp_path, cfg, plan)
    before = trainer.model.replica_weights(replica=1, stage=2)
    trainer.global_step(0)
    assert int(trainer.optimizer.steps[1, 2]) == 0
    assert int(trainer.optimizer.steps[0, 2]) == cfg.sparseloco.inner_steps
    assert int(trainer.optimizer.steps[1, 1]) == cfg.sparseloco.inner_steps
    assert all(torch.count_nonzero(m[1]) == 0 for m in trainer.optimizer.exp_avg[2].values())
    missing = [e for e in sink.events if e.kind == "contribution_missing"]
    assert [(e.replica, e.stage) for e in missing] == [(1, 2)]
    after = trainer.model.replica_weights(replica=1, stage=2)
    for s in range(cfg.pipeline.stages):
        for r in range(cfg.replicas):
            weights = trainer.model.replica_weights(replica=r, stage=s)
            for name, value in weights.items():
                assert torch.equal(value, trainer.sync.global_weights[s][name])
    assert any(not torch.equal(before[n], after[n]) for n in before)   # it applied the aggregate


def test_rejoin_resets_only_the_failed_stage(tmp_path):
    cfg = tiny(**{"faults.p": 0.01, "train.global_steps": 3})
    plan = FaultPlan().down(replica=0, stage=1, start=1, steps=1)
    trainer, sink = _trainer(tmp_path, cfg, plan)
    trainer.global_step(0)
    trainer.global_step(1)
    assert torch.count_nonzero(trainer.sync.errors[1]["h1_qkv"][0]) > 0  # buffer from step 0
    trainer._apply_rejoins(2)
    assert int(trainer.optimizer.steps[0, 1]) == 0
    for name in trainer.optimizer.exp_avg[1]:
        assert torch.count_nonzero(trainer.optimizer.exp_avg[1][name][0]) == 0
        assert torch.count_nonzero(trainer.optimizer.exp_avg_sq[1][name][0]) == 0
    for buf in trainer.sync.errors[1].values():
        assert torch.count_nonzero(buf[0]) == 0
    assert torch.count_nonzero(trainer.sync.errors[2]["h2_qkv"][0]) > 0
    assert int(trainer.optimizer.steps[0, 2]) > 0 and int(trainer.optimizer.steps[1, 1]) > 0
    rejoin = [e for e in sink.events if e.kind == "rejoin"]
    assert rejoin and "error_feedback" in rejoin[0].detail["reset"]


@pytest.mark.parametrize("bad, message", [
    (dict(replica=0, stage=7, start=0, steps=1), "out of range"),
    (dict(replica=0, stage=0, start=0, steps=1), "only inner stages"),
    (dict(replica=0, stage=3, start=0, steps=1), "only inner stages"),
    (dict(replica=5, stage=1, start=0, steps=1), "replica 5 out of range"),
])
def test_bad_plans_are_refused(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, tiny(), FaultPlan().down(**bad))


def test_overlapping_failures_on_one_replica_are_refused(tmp_path):
    plan = FaultPlan().down(replica=1, stage=1, start=0, steps=3).down(replica=1, stage=2, start=2,
                                                                       steps=1)
    with pytest.raises(ValueError, match="overlap"):
        _trainer(tmp_path, tiny(), plan)


class _Crash(Callback):
    """Raises once `after` global steps have been flushed (a killed process, in-process)."""

    def __init__(self, after):
        self.after, self.flushed = after, 0

    def metric(self, item):
        pass

    def event(self, item):
        pass

    def flush(self):
        self.flushed += 1
        if self.flushed == self.after:
            raise KeyboardInterrupt("killed")

    def close(self):
        pass


@pytest.mark.parametrize("compression", ["none", "mapl"])
def test_resume_reaches_the_same_numbers_bit_for_bit(tmp_path, compression):
    cfg = tiny(**{"faults.p": 0.5, "faults.duration": 2, "train.global_steps": 5,
                  "train.checkpoint_every": 2, "pipeline.compression": compression})
    whole = train(cfg, out_dir=tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path / "cut", callback=_Crash(after=3))
    resumed = train(cfg, out_dir=tmp_path / "cut", resume=True)
    assert _stable(resumed) == _stable(whole)
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    keys = [(m["name"], m["global_step"], m["replica"]) for m in map(json.loads, lines)]
    assert len(keys) == len(set(keys))
    assert len(lines) == len((tmp_path / "whole" / "metrics.jsonl").read_text().splitlines())


class _Collect(Callback):
    """Keeps what it receives, keyed as the registry keys it (a reporter that loses nothing)."""

    def __init__(self):
        self.metrics, self.events = set(), set()

    def metric(self, item):
        self.metrics.add((item.name, item.global_step, item.replica))

    def event(self, item):
        self.events.add(item.id)

    def flush(self):
        pass

    def close(self):
        pass


def test_resume_resends_what_a_killed_reporter_held(tmp_path):
    # the reporter killed with the run (_Crash) delivered nothing; the resumed run's reporter
    # must still receive every record of the run, those before the checkpoint included
    cfg = tiny(**{"faults.p": 0.5, "faults.duration": 2, "train.global_steps": 5,
                  "train.checkpoint_every": 2})
    whole = _Collect()
    train(cfg, out_dir=tmp_path / "whole", callback=whole)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path / "cut", callback=_Crash(after=3))
    after_kill = _Collect()
    train(cfg, out_dir=tmp_path / "cut", resume=True, callback=after_kill)
    assert whole.events and any(step == 0 for _, step, _ in whole.metrics)
    assert after_kill.metrics == whole.metrics
    assert after_kill.events == whole.events


def test_resume_refuses_a_different_config(tmp_path):
    cfg = tiny(**{"train.checkpoint_every": 1, "train.global_steps": 2})
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path, callback=_Crash(after=2))
    with pytest.raises(Exception, match="different configuration"):
        train(tiny(**{"train.checkpoint_every": 1, "train.global_steps": 2, "seed": 9}),
              out_dir=tmp_path, resume=True)


@pytest.mark.parametrize("method", ["diloco", "ddp"])
def test_baseline_outer_methods_train(tmp_path, method):
    summary = train(tiny(**{"sparseloco.method": method}), out_dir=tmp_path)
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    if method == "diloco":
        assert summary["bytes"]["upload"] >= summary["bytes"]["dense_upload_equivalent"]
