"""The cost model (crucible.pricing.cost) against hand-computed numbers, and the deployment
file's checks (crucible.pricing.deployment).

The hand case: R = 2 replicas x S = 2 stages, H = 1 inner step, 2 global steps, stage step times
1 s and 2 s, one boundary crossing of 128 tokens x 256 bytes = 32,768 bytes at 0.262144 Mbit/s
(1 s) + 2 x 250 ms latency = 1.5 s, contributions of 1,000 bytes at 0.008 Mbit/s (1 s each),
10 s of start-up, one evaluation of 128 tokens at half a training token's time (1.5 s).
A fault-free round: each replica 1 + 2 + 1.5 = 4.5 s of inner step, then 2 uploads + 2 downloads
= 4 s at the store: 8.5 s. Two rounds + start-up + evaluation: 28.5 s.
"""
import math

import pytest

from crucible.config import apply_overrides
from crucible.presets import get_preset
from crucible.pricing.cost import CostError, run_cost
from crucible.pricing.deployment import (
    MAX_BYTES,
    DeploymentError,
    load_deployment,
    parse_deployment,
)

HAND = {
    "name": "hand", "pricing": "on_demand",
    "compute": {"step_s": [1.0, 2.0], "eval_fraction": 0.5, "startup_s": 10.0},
    "network": {"boundary_bandwidth_mbps": 0.262144, "boundary_latency_ms": 250.0,
                "store_bandwidth_mbps": 0.008, "store_latency_ms": 0.0},
    "recovery": {"restart_s": 5.0, "rejoin_s": 0.0, "round_timeout_s": 20.0},
    "price": {"on_demand_per_hour": 3.6, "spot_discount": 0.5},
}


def _deployment(**changes):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in HAND.items()}
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[section] = value
    return parse_deployment(data, source="hand.toml")


def _summary(strategy="skip", faults=(), steps=2, kills=None):
    config = apply_overrides(get_preset("smoke"), [
        "replicas=2", "pipeline.stages=2", "sparseloco.inner_steps=1",
        f"train.global_steps={steps}", f"faults.strategy={strategy}"])
    made = 2 * 2 * steps - sum(1 for _ in faults) * (2 if strategy.startswith("drop") else 1)
    summary = {"config": config.to_dict(), "global_steps": steps, "faults": list(faults),
               "bytes": {"upload": 1000 * made}, "contributions": {"made": made},
               "evals": [{"global_step": steps, "val_loss": 3.0}], "eval_tokens": 128,
               "initial_val_loss": None, "final_val_loss": 3.0, "wall_s": 30.0}
    if kills is not None:
        summary["distributed"] = {"kills": kills}
    return summary


def test_fault_free_run_costs_hand_computed_time_and_money():
    cost = run_cost(_summary(), _deployment())
    assert cost["stage_step_s"] == [1.0, 2.0]
    assert cost["wall_s"] == pytest.approx(28.5)
    assert cost["breakdown_s"]["compute_s"] == pytest.approx(6.0)
    assert cost["breakdown_s"]["boundary_s"] == pytest.approx(3.0)
    assert cost["breakdown_s"]["store_s"] == pytest.approx(8.0)
    assert cost["breakdown_s"]["eval_s"] == pytest.approx(1.5)
    assert cost["accelerators"] == 4
    assert cost["accelerator_hours"] == pytest.approx(4 * 28.5 / 3600)
    assert cost["money"]["on_demand"] == pytest.approx(0.114)
    assert cost["money"]["spot"] == pytest.approx(0.057)
    assert cost["cost"] == cost["money"]["on_demand"]
    # the curve starts after start-up at ln 256 (smoke's vocabulary: no initial evaluation)
    assert cost["curve"] == [
        pytest.approx({"global_step": 0, "val_loss": math.log(256), "wall_s": 10.0,
                       "accelerator_hours": 4 * 10 / 3600, "cost": 0.04}),
        pytest.approx({"global_step": 2, "val_loss": 3.0, "wall_s": 28.5,
                       "accelerator_hours": 4 * 28.5 / 3600, "cost": 0.114})]


def test_skipped_stage_costs_nothing_in_time():
    # round 1: replica 0 runs stage 0 only (1 s, no crossing); replica 1 is the slowest (4.5 s);
    # the store moves 3 contributions per replica (3 s): 7.5 s instead of 8.5 s
    fault = {"replica": 0, "stage": 1, "start": 1, "duration": 1}
    cost = run_cost(_summary("skip", [fault]), _deployment())
    assert cost["wall_s"] == pytest.approx(10 + 8.5 + 7.5 + 1.5)


def test_reroute_donor_carries_a_second_batch():
    # round 1: replica 0's stage 1 runs on replica 1's, which takes 2 x 2 s: both replicas
    # 1 + 4 + 1.5 = 6.5 s; the store 3 s: 9.5 s
    fault = {"replica": 0, "stage": 1, "start": 1, "duration": 1}
    cost = run_cost(_summary("reroute", [fault]), _deployment())
    assert cost["wall_s"] == pytest.approx(10 + 8.5 + 9.5 + 1.5)


def test_dropped_replica_idles_but_is_paid_for():
    # round 1: replica 0 computes nothing; replica 1 4.5 s; the store 2 s: 6.5 s
    fault = {"replica": 0, "stage": 1, "start": 1, "duration": 1}
    cost = run_cost(_summary("drop", [fault]), _deployment())
    assert cost["wall_s"] == pytest.approx(10 + 8.5 + 6.5 + 1.5)
    assert cost["accelerator_hours"] == pytest.approx(4 * cost["wall_s"] / 3600)
    skip = run_cost(_summary("skip", [fault]), _deployment())
    assert cost["busy_fraction"] < skip["busy_fraction"]


def test_kill_costs_everyone_the_round_deadline():
    # round 1: replica 1 is dead: replica 0 alone (4.5 s + 2 s at the store) + the 20 s deadline
    kills = [{"replica": 1, "global_step": 1, "rejoin": True}]
    cost = run_cost(_summary(kills=kills), _deployment())
    assert cost["kill_wait_rounds"] == [1]
    assert cost["breakdown_s"]["wait_s"] == pytest.approx(20.0)
    assert cost["wall_s"] == pytest.approx(10 + 8.5 + 6.5 + 20 + 1.5)


def test_slow_restart_waits_out_more_rounds_and_forever_waits_every_round():
    kills = [{"replica": 1, "global_step": 1, "rejoin": True}]
    # back after 40 s: round 1 (8.5 + 20 s) is not enough, round 2 waits too
    slow = run_cost(_summary(steps=4, kills=kills), _deployment(recovery__restart_s=40.0))
    assert slow["kill_wait_rounds"] == [1, 2]
    gone = [{"replica": 1, "global_step": 1, "rejoin": False}]
    forever = run_cost(_summary(steps=4, kills=gone), _deployment())
    assert forever["kill_wait_rounds"] == [1, 2, 3]


def test_spot_pricing_reports_the_spot_price():
    cost = run_cost(_summary(), _deployment(pricing="spot"))
    assert cost["cost"] == pytest.approx(0.057)
    explicit = run_cost(_summary(), _deployment(pricing="spot", price__spot_per_hour=0.36))
    assert explicit["cost"] == pytest.approx(4 * 28.5 / 3600 * 0.36)


def test_cost_is_deterministic_and_leaves_the_summary_alone():
    summary = _summary("reroute", [{"replica": 0, "stage": 1, "start": 0, "duration": 2}])
    before = repr(summary)
    assert run_cost(summary, _deployment()) == run_cost(summary, _deployment())
    assert repr(summary) == before


def test_flops_give_the_step_time_from_the_model_size():
    from crucible.presets import parameter_count

    summary = _summary()
    config = apply_overrides(get_preset("smoke"), ["replicas=2", "pipeline.stages=2"])
    flops = 6.0 * parameter_count(config) / 2 * (4 * 32)
    cost = run_cost(summary, _deployment(compute={"flops_per_s": flops}))
    assert cost["stage_step_s"] == pytest.approx([1.0, 1.0])


def test_workload_preset_prices_the_presets_inner_step():
    own = run_cost(_summary(), _deployment(compute={"flops_per_s": 1e12}))
    big = run_cost(_summary(), _deployment(compute={"flops_per_s": 1e12},
                                           workload={"preset": "paper-178m"}))
    assert big["workload"] == "paper-178m"
    assert big["stage_step_s"][0] > 100 * own["stage_step_s"][0]


def test_step_times_must_match_the_stages():
    with pytest.raises(CostError, match="step_s has 3 values but the run has 2 stages"):
        run_cost(_summary(), _deployment(compute={"step_s": [1.0, 1.0, 1.0]}))


@pytest.mark.parametrize(("change", "message"), [
    ({"pricing": "reserved"}, "pricing must be one of on_demand, spot"),
    ({"compute": {}}, "exactly one of step_s"),
    ({"compute": {"step_s": 1.0, "flops_per_s": 1.0}}, "exactly one of step_s"),
    ({"compute": {"step_s": -1.0}}, r"compute.step_s must be > 0"),
    ({"compute": {"step_s": [1.0, "fast"]}}, r"compute.step_s\[1\] must be a number"),
    ({"network__boundary_bandwidth_mbps": 0.0}, "network.boundary_bandwidth_mbps must be > 0"),
    ({"price__spot_discount": 0.95}, "price.spot_discount must be >= 0 and <= 0.9"),
    ({"price__spot_per_hour": 0.1}, "spot is 0-90% off"),
    ({"price__accelerators_per_stage": 0}, "accelerators_per_stage must be an integer >= 1"),
    ({"price__cost": 1}, "unknown key price.cost; \\[price\\] takes"),
    ({"workload": {"preset": "huge"}}, "workload.preset 'huge' is not a preset"),
    ({"colour": "red"}, "unknown key 'colour'"),
])
def test_bad_deployment_names_the_field(change, message):
    with pytest.raises(DeploymentError, match=message):
        _deployment(**change)


def test_missing_field_names_what_to_set():
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in HAND.items()}
    del data["network"]["store_latency_ms"]
    with pytest.raises(DeploymentError, match="network.store_latency_ms is missing: set it"):
        parse_deployment(data, source="hand.toml")


def test_deployment_file_checks(tmp_path):
    with pytest.raises(DeploymentError, match="cannot read the deployment file"):
        load_deployment(tmp_path / "absent.toml")
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * MAX_BYTES)
    with pytest.raises(DeploymentError, match="larger than"):
        load_deployment(big)
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(DeploymentError, match="not valid TOML"):
        load_deployment(bad)


@pytest.mark.parametrize("name", ["this-machine", "cloud-8x4-on-demand", "cloud-8x4-spot",
                                  "one-gpu-h100"])
def test_shipped_deployments_load(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "infra" / "deployments" / f"{name}.toml"
    deployment = load_deployment(path)
    assert deployment.name == name
    assert math.isfinite(deployment.price_per_hour)
    assert "http" not in path.read_text()


def test_reach_interpolates_and_says_not_reached():
    from crucible.pricing.cost_sweep import loss_at_money, reach

    curve = [{"val_loss": 5.0, "wall_s": 10.0, "cost": 1.0},
             {"val_loss": 3.0, "wall_s": 30.0, "cost": 3.0},
             {"val_loss": 2.0, "wall_s": 50.0, "cost": 5.0}]
    assert reach(curve, 2.5) == pytest.approx({"wall_s": 40.0, "cost": 4.0})
    assert reach(curve, 3.0) == pytest.approx({"wall_s": 30.0, "cost": 3.0})
    assert reach(curve, 1.9) is None
    assert loss_at_money(curve, 2.0) == pytest.approx(4.0)
    assert loss_at_money(curve, 9.0) == pytest.approx(2.0)     # ended under budget
    assert loss_at_money(curve, 0.5) is None                    # nothing within the budget


def test_sweep_costs_pairs_by_seed_and_names_the_cheapest():
    from crucible.grid.key import CellKey
    from crucible.pricing.cost_sweep import CostRow, sweep_costs

    def row(strategy, p, seed, losses, costs):
        curve = [{"global_step": i, "val_loss": v, "wall_s": 100.0 * c, "cost": c}
                 for i, (v, c) in enumerate(zip(losses, costs, strict=True))]
        return CostRow(key=CellKey("none", strategy, p), seed=seed,
                       name=f"{strategy or 'base'}-{seed}",
                       cost={"deployment": "d", "pricing": "on_demand", "currency": "USD",
                             "curve": curve, "final_val_loss": losses[-1], "cost": costs[-1],
                             "wall_s": 100.0 * costs[-1], "accelerator_hours": costs[-1]})

    rows = [row(None, 0.0, 0, [5, 2.0], [0, 10]), row(None, 0.0, 1, [5, 2.2], [0, 10]),
            # drop never gets to its baseline; extend gets there at 15 and 13.33
            row("drop", 0.2, 0, [5, 2.5], [0, 9]), row("drop", 0.2, 1, [5, 2.6], [0, 9]),
            row("drop_extend", 0.2, 0, [5, 2.5, 1.5], [0, 10, 20]),
            row("drop_extend", 0.2, 1, [5, 2.5, 1.6], [0, 10, 20])]
    record = sweep_costs(rows)
    cells = {c["strategy"]: c for c in record["cells"]}
    # the record (REST, the result files) spells the baseline "base"; its key, strategy None
    assert cells["base"]["p"] == 0.0 and cells["base"]["runs"] == ["base-0", "base-1"]
    assert cells["drop"]["target"]["reached"] == 0
    assert cells["drop_extend"]["target"]["reached"] == 2
    assert cells["drop_extend"]["target"]["cost"]["mean"] == pytest.approx((15 + 40 / 3) / 2)
    assert cells["drop_extend"]["target"]["cost"]["lo"] is not None
    assert cells["drop"]["loss_at_budget"]["mean"] == pytest.approx(2.55)
    assert record["cheapest"] == [{"arm": "none", "label": "", "p": 0.2,
                                   "strategy": "drop_extend", "by": "target",
                                   "cost": pytest.approx((15 + 40 / 3) / 2),
                                   "loss_at_budget": pytest.approx(2.5)}]


@pytest.mark.parametrize("cell", ["table1-d128/none-reroute-p0.2-s0",
                                  "table1-d128/none-drop_extend-p0.2-s0",
                                  "processes/none-skip-p0.1-spot-s3"])
def test_replay_gives_the_inner_steps_and_donor_loads_the_run_recorded(cell):
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "results" / f"{cell}.json"
    summary = json.loads(path.read_text())
    assert run_cost(summary, _deployment(compute={"step_s": 1.0}))["replay_matches"] is True
    summary["donor_load"][0][1] += 1      # a record the plan cannot explain
    summary["inner_steps"][0][0] += 16
    assert run_cost(summary, _deployment(compute={"step_s": 1.0}))["replay_matches"] is False


def _leased(summary, lease_s=5.0):
    summary["distributed"]["lease_s"] = lease_s
    return summary


def test_with_a_lease_a_kill_costs_the_restart_not_the_deadline():
    # the hand round is 8.5 s; restart 5 s, lease 5 s: the others learn of the death (the new
    # process announces itself) 5 s after it, inside their own 8.5 s: no wait in that round;
    # back (restart + rejoin) 5 s after the kill, in step for the next: no wait either
    kills = [{"replica": 1, "global_step": 1, "rejoin": True}]
    cost = run_cost(_leased(_summary(steps=4, kills=kills)), _deployment())
    assert cost["kill_wait_rounds"] == [1]
    assert cost["breakdown_s"]["wait_s"] == pytest.approx(0.0)
    # a slow restart (40 s, deadline 20 s, lease 12 s): round 1 waits for the lease, 12 - 8.5 =
    # 3.5 s; round 2 starts 12 s after the kill and is waited for once, to the deadline (back
    # 40 s after the kill); round 3 starts 12 + 8.5 + 20 = 40.5 s after it: in step
    slow = run_cost(_leased(_summary(steps=5, kills=kills), lease_s=12.0),
                    _deployment(recovery__restart_s=40.0))
    assert slow["kill_wait_rounds"] == [1, 2]
    assert slow["breakdown_s"]["wait_s"] == pytest.approx(3.5 + 20.0)
    # a little slower (44 s): round 3 is not waited for again to the deadline, only for the
    # 3.5 s it is back late by
    slower = run_cost(_leased(_summary(steps=5, kills=kills), lease_s=12.0),
                      _deployment(recovery__restart_s=44.0))
    assert slower["kill_wait_rounds"] == [1, 2]
    assert slower["breakdown_s"]["wait_s"] == pytest.approx(3.5 + 20.0 + 3.5)


def test_with_a_lease_a_replica_that_never_returns_costs_one_round():
    # lease 10 s, restart 20 s: the others wait 10 - 8.5 s in the round of the kill, and no
    # later round (without the lease: the deadline in every round after it)
    gone = [{"replica": 1, "global_step": 1, "rejoin": False}]
    cost = run_cost(_leased(_summary(steps=4, kills=gone), lease_s=10.0),
                    _deployment(recovery__restart_s=20.0))
    assert cost["kill_wait_rounds"] == [1]
    assert cost["breakdown_s"]["wait_s"] == pytest.approx(1.5)


def test_unplanned_kills_in_the_recoveries_are_priced_too():
    summary = _leased(_summary(steps=4, kills=[]))
    summary["distributed"]["recoveries"] = [
        {"replica": 1, "killed_at_step": 2, "planned": False, "rejoin_step": 3}]
    cost = run_cost(summary, _deployment())
    assert cost["kill_wait_rounds"] == [2]
    planned = run_cost(_leased(_summary(steps=4, kills=[])), _deployment())
    assert planned["kill_wait_rounds"] == []
    # the dead replica computes nothing in round 2: the run is no slower than without it
    assert cost["wall_s"] <= planned["wall_s"]


def test_a_pipeline_stage_death_costs_its_restart_less_the_rest_of_its_round():
    # the hand round is 8.5 s; a stage dies 20% into round 1 and is back 20 s later: the rest
    # of round 1 (6.8 s) goes on without it, round 2 waits 20 - 6.8 = 13.2 s for it
    summary = _summary(steps=4)
    summary["pipeline"] = {"deaths": [{"replica": 1, "stage": 1, "global_step": 1,
                                       "fraction": 0.2}]}
    base = run_cost(_summary(steps=4), _deployment(recovery__restart_s=20.0))
    slow = run_cost(summary, _deployment(recovery__restart_s=20.0))
    assert slow["breakdown_s"]["wait_s"] == pytest.approx(13.2)
    assert slow["wall_s"] == pytest.approx(base["wall_s"] + 13.2)
    # back within the rest of its round (5 s): nobody waits
    fast = run_cost(summary, _deployment(recovery__restart_s=5.0))
    assert fast["breakdown_s"]["wait_s"] == pytest.approx(0.0)
    # two deaths in one round restart side by side (the longer wait counts), and a death in
    # the last round costs the same at the run's end
    summary["pipeline"]["deaths"] += [
        {"replica": 0, "stage": 1, "global_step": 1, "fraction": 0.5},
        {"replica": 0, "stage": 1, "global_step": 3, "fraction": 0.0}]
    both = run_cost(summary, _deployment(recovery__restart_s=20.0))
    assert both["breakdown_s"]["wait_s"] == pytest.approx(20 - 0.5 * 8.5 + 20 - 8.5)
