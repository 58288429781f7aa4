"""Failure processes beyond independent steps: correlated outages, spot reclaim waves,
heavy-tailed down times and recorded traces (`faults.process`, crucible.faults.plan_for)."""
import collections
import hashlib
import json

import pytest

from crucible.config import Config, ConfigError, FaultConfig, apply_overrides
from crucible.faults import FaultPlan, FaultPlanError, draw_plan, plan_for, read_trace
from crucible.presets import get_preset
from crucible.registry.identity import config_fingerprint
from crucible.study.runner import comparable_config
from crucible.train import train
from tests.unit.helpers import tiny
from tests.unit.test_trainer import _trainer

PROCESSES = [
    {"process": "independent"},
    {"process": "independent", "down_times": "pareto"},
    {"process": "correlated", "group": 3},
    {"process": "spot", "wave": 0.5, "notice": 2},
    {"process": "spot", "wave": 0.25, "down_times": "pareto", "tail": 1.2},
]


def _plan(horizon=60, replicas=8, stages=4, seed=0, **faults):
    faults = {"p": 0.1, "duration": 6, **faults}
    return plan_for(FaultConfig(**faults), seed=seed, replicas=replicas, stages=stages,
                    horizon=horizon)


def test_independent_fixed_plan_is_the_blogs_draw_bit_for_bit():
    for seed in range(5):
        assert _plan(seed=seed).to_list() == draw_plan(
            seed=seed, p=0.1, duration=6, replicas=8, stages=4, horizon=60).to_list()


@pytest.mark.parametrize("faults", PROCESSES)
def test_every_process_is_seeded_valid_and_horizon_free(faults):
    short, long = _plan(horizon=30, **faults), _plan(horizon=120, **faults)
    assert long.until(30).to_list() == short.to_list()
    assert long.validate(replicas=8, stages=4) is long and long.failures
    assert _plan(horizon=120, **faults).to_list() == long.to_list()
    assert _plan(horizon=120, seed=1, **faults).to_list() != long.to_list()
    assert _plan(horizon=120, **{**faults, "p": 0.0}).failures == []


def test_a_correlated_outage_downs_one_stage_in_several_replicas_at_once():
    plan = _plan(horizon=200, process="correlated", group=4)
    groups = collections.Counter((f.start, f.stage, f.duration) for f in plan.failures)
    assert max(groups.values()) == 4           # one outage, four replicas, the same stage
    assert all(n <= 4 for n in groups.values())
    independent = _plan(horizon=200)
    assert max(collections.Counter((f.start, f.stage) for f in independent.failures).values()) < 4


@pytest.mark.parametrize("faults", [{"process": "independent"},
                                    {"process": "correlated", "group": 4},
                                    {"process": "spot", "wave": 0.5}])
def test_every_process_fails_a_replica_at_about_p_per_step_up(faults):
    # duration 1: a replica is up at every draw, so starts per replica-step estimate the rate
    plan = _plan(horizon=4000, replicas=8, duration=1, **faults)
    rate = len(plan.failures) / (8 * 4000)
    assert 0.09 < rate < 0.11, rate        # p = 0.1; 32,000 draws: sd of the rate ~0.0017


def test_a_spot_wave_is_announced_notice_steps_ahead_and_recorded():
    plan = _plan(horizon=100, process="spot", wave=0.5, notice=3)
    assert plan.failures and all(f.notice == 3 and f.start >= 3 for f in plan.failures)
    waves = collections.Counter(f.start for f in plan.failures)
    assert max(waves.values()) == 4            # round(0.5 * 8) replicas in one wave
    records = plan.to_list()
    assert all(r["notice"] == 3 for r in records)
    assert FaultPlan.from_list(json.loads(json.dumps(records))).to_list() == records
    assert "notice" not in _plan().to_list()[0]  # unannounced plans read as they always did


def test_pareto_down_times_keep_the_mean_and_have_a_heavy_tail():
    plan = _plan(horizon=20000, replicas=8, duration=6, down_times="pareto", tail=1.5)
    durations = [f.duration for f in plan.failures]
    mean = sum(durations) / len(durations)
    assert 6.0 <= mean < 7.5, mean            # the ceiling adds under one step
    assert max(durations) > 10 * 6            # some outages last many times the mean
    assert sorted(durations)[len(durations) // 2] < 6   # and most are shorter than it


def test_every_arm_and_strategy_sees_the_same_correlated_plan(tmp_path):
    plans = []
    for compression in ("none", "ssn", "mapl"):
        for strategy in ("skip", "drop", "reroute"):
            cfg = tiny(**{"faults.p": 0.4, "faults.duration": 2, "faults.process": "correlated",
                          "pipeline.compression": compression, "faults.strategy": strategy,
                          "train.global_steps": 6})
            trainer, _ = _trainer(tmp_path / f"{compression}-{strategy}", cfg)
            plans.append(trainer.plan.until(6).to_list())
    assert plans[0] and all(p == plans[0] for p in plans)
    starts = collections.Counter((f["start"], f["stage"]) for f in plans[0])
    assert max(starts.values()) == 2


def test_a_correlated_run_records_its_plan_and_repeats(tmp_path):
    cfg = tiny(**{"faults.p": 0.5, "faults.duration": 2, "faults.process": "correlated",
                  "faults.strategy": "reroute", "train.global_steps": 4})
    a = train(cfg, out_dir=tmp_path / "a")
    b = train(cfg, out_dir=tmp_path / "b")
    assert a["faults"] and a["faults"] == b["faults"]
    assert a["final_val_loss"] == b["final_val_loss"]
    assert a["config"]["faults"]["process"] == "correlated"


# -- traces ----------------------------------------------------------------------------------

def _trace(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_trace_is_replayed_exactly(tmp_path):
    path = _trace(tmp_path, "replica,stage,start,end\n1,2,3,7\n0,1,0,2\n\n")
    plan = plan_for(FaultConfig(p=0.1, process="trace", trace=path), seed=0, replicas=2,
                    stages=4, horizon=10)
    assert plan.to_list() == [{"replica": 0, "stage": 1, "start": 0, "duration": 2},
                              {"replica": 1, "stage": 2, "start": 3, "duration": 4}]
    assert plan_for(FaultConfig(p=0.1, process="trace", trace=path), seed=0, replicas=2,
                    stages=4, horizon=3).to_list() == plan.to_list()[:1]
    assert plan_for(FaultConfig(p=0.0, process="trace", trace=path), seed=0, replicas=2,
                    stages=4, horizon=10).failures == []


@pytest.mark.parametrize("text, needle", [
    ("replica,stage,begin,end\n0,1,0,2\n", "the first line must be replica,stage,start,end"),
    ("", "got nothing"),
    ("replica,stage,start,end\n0,1,zero,2\n", "line 2: ['0', '1', 'zero', '2'] is not four"),
    ("replica,stage,start,end\n0,1,0\n", "line 2"),
    ("replica,stage,start,end\n0,1,4,4\n", "line 2: end 4 must be after start 4"),
    ("replica,stage,start,end\n0,0,0,2\n", "only inner stages 1..2 can fail"),
    ("replica,stage,start,end\n5,1,0,2\n", "replica 5 out of range 0..1"),
    ("replica,stage,start,end\n0,1,0,4\n0,2,2,5\n", "overlap"),
    ("\xff\xfe", "not UTF-8"),
])
def test_a_bad_trace_is_refused_naming_the_line(tmp_path, text, needle):
    path = tmp_path / "bad.csv"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(FaultPlanError, match="faults.trace=") as info:
        read_trace(str(path), replicas=2, stages=4)
    assert needle in str(info.value)


def test_a_trace_over_the_size_limit_is_refused_before_reading(tmp_path, monkeypatch):
    import crucible.faults as faults

    path = _trace(tmp_path, "replica,stage,start,end\n" + "0,1,0,2\n" * 10)
    monkeypatch.setattr(faults, "MAX_TRACE_BYTES", 32)
    with pytest.raises(FaultPlanError, match="more than the 32 a trace may have"):
        read_trace(path, replicas=2, stages=4)
    with pytest.raises(FaultPlanError, match="cannot be read"):
        read_trace(str(tmp_path / "missing.csv"), replicas=2, stages=4)


def test_a_bad_trace_exits_2_before_the_run_folder_is_written(tmp_path):
    from tests.unit.test_cli import _crucible_here, _one_error_line

    path = _trace(tmp_path, "replica,stage,start,end\n0,1,0,x\n")
    out = tmp_path / "out"
    done = _crucible_here("run", "--preset", "smoke", "--set", "faults.p=0.1", "--set",
                          "pipeline.stages=4", "--set", "model.layers=4", "--set",
                          "faults.process=trace", "--set", f"faults.trace={path}",
                          "--out", str(out), "--no-progress", "--no-api")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "line 2" in _one_error_line(done) and not out.exists()


# -- configuration and identity --------------------------------------------------------------

@pytest.mark.parametrize("overrides, needle", [
    ({"faults.group": 1}, "faults.group must be >= 2"),
    ({"faults.process": "correlated", "faults.group": 9}, "faults.group=9 exceeds replicas=8"),
    ({"faults.wave": 0}, "faults.wave must be a fraction"),
    ({"faults.notice": -1}, "faults.notice must be >= 0"),
    ({"faults.tail": 1.0}, "faults.tail must be > 1"),
    ({"faults.process": "trace"}, "faults.process=trace needs faults.trace=PATH"),
    ({"faults.trace": "x.csv"}, "faults.trace='x.csv' is read only by faults.process=trace"),
    ({"faults.process": "zone"}, "faults.process='zone' is not allowed"),
    ({"faults.down_times": "lognormal"}, "allowed values: 'fixed' | 'pareto'"),
])
def test_bad_process_settings_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError, match="faults.") as info:
        apply_overrides(Config(), overrides)
    assert needle in str(info.value)


def _old_fingerprint(config):
    """The fingerprint's rule before the failure processes existed: the whole config, less the
    store and the round deadline."""
    data = json.loads(config.to_json())
    data.pop("store")
    data["sparseloco"].pop("round_timeout_s")
    for key in ("process", "group", "wave", "notice", "down_times", "tail", "trace"):
        data["faults"].pop(key)
    data["train"].pop("tail_average")           # added later still (issue 34)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def test_the_processes_leave_earlier_runs_identities_and_adoption_alone(tmp_path):
    for preset in ("smoke", "study"):
        config = apply_overrides(get_preset(preset), {"faults.p": 0.1})
        assert config_fingerprint(config) == _old_fingerprint(config)
        old_record = json.loads(config.to_json())
        for key in ("process", "group", "wave", "notice", "down_times", "tail", "trace"):
            del old_record["faults"][key]
        del old_record["train"]["tail_average"]
        assert comparable_config(old_record) == comparable_config(config.to_dict())
    base = apply_overrides(get_preset("smoke"), {"faults.p": 0.1})
    others = {config_fingerprint(apply_overrides(base, {key: value})) for key, value in [
        ("faults.process", "correlated"), ("faults.process", "spot"),
        ("faults.down_times", "pareto"), ("faults.group", 3)]}
    assert len(others) == 4 and config_fingerprint(base) not in others


def test_a_trace_runs_identity_follows_the_files_content(tmp_path):
    path = _trace(tmp_path, "replica,stage,start,end\n0,1,0,2\n")
    config = apply_overrides(get_preset("smoke"), {"faults.p": 0.1, "faults.process": "trace",
                                                   "faults.trace": path})
    first = config_fingerprint(config)
    _trace(tmp_path, "replica,stage,start,end\n0,1,0,3\n")
    assert config_fingerprint(config) != first


def test_a_study_block_may_set_the_failure_process():
    from crucible.grid.spec import SweepSpec

    spec = SweepSpec.model_validate({
        "name": "processes", "preset": "smoke", "seeds": [0],
        "grid": [{"arms": ["none"], "strategies": ["skip"], "p": [0.1]},
                 {"arms": ["none"], "strategies": ["skip"], "p": [0.1],
                  "set": ["faults.process=correlated", "faults.group=2"]}]})
    labels = sorted(c.key.label for c in spec.cells())
    assert labels == ["", "", "process_correlated_group_2"]
