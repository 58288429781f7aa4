"""`crucible cost` on a real distributed run (`crucible launch`, R = 2 processes, replica 1
SIGKILLed and restarted): the model names the round the run really missed and prices the kill
over the same run without it at the lease's wait, not the deadline (a slow test: two
launches)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from crucible.config import apply_overrides
from crucible.distributed.launch import launch
from crucible.presets import get_preset
from crucible.pricing.cost import run_cost
from crucible.pricing.deployment import load_deployment
from tests.unit.test_cli import _crucible_here

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

THIS_MACHINE = Path(__file__).resolve().parents[2] / "infra" / "deployments" / "this-machine.toml"


def test_cost_of_a_killed_distributed_run_names_the_missed_round(tmp_path: Path) -> None:
    config = apply_overrides(get_preset("smoke"), ["replicas=2", "train.global_steps=4",
                                                   "sparseloco.round_timeout_s=3"])
    killed = launch(config, out_dir=tmp_path / "killed",
                    kills=[{"replica": 1, "global_step": 2, "rejoin": True}])
    assert killed["distributed"]["missing_rounds"]["1"] == [2]
    result = _crucible_here("cost", tmp_path / "killed", "--deployment", THIS_MACHINE)
    assert result.returncode == 0, result.stderr
    cost = json.loads((tmp_path / "killed" / "cost.json").read_text())
    # the round the killed replica missed, and only it, is the kill's; with the run's heartbeat
    # lease the others wait until the restarted process is back (this machine's restart_s +
    # rejoin_s), less their own rounds' work, never the 3 s deadline
    assert cost["kill_wait_rounds"] == killed["distributed"]["missing_rounds"]["1"]
    assert killed["distributed"]["lease_s"] > 0
    deployment = load_deployment(THIS_MACHINE)
    assert 0 <= cost["breakdown_s"]["wait_s"] <= deployment.restart_s + deployment.rejoin_s < 3.0
    whole = launch(config, out_dir=tmp_path / "whole")
    priced = run_cost(whole, load_deployment(THIS_MACHINE))
    assert priced["kill_wait_rounds"] == []
    # the killed run differs from its twin by at most the time until it is back
    assert cost["wall_s"] - priced["wall_s"] <= deployment.restart_s + deployment.rejoin_s
    assert cost["measured_wall_s"] == killed["wall_s"]
