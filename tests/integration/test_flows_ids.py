"""Ids given to the flows are not paths: a crafted `run_id` or `sweep_id` is refused, naming the
parameter, before anything is registered or a folder is made (`crucible.ids.validate_id`)."""
from __future__ import annotations

import pytest

from crucible.registry.reporting import ApiClient
from flows.run_flow import train_run

pytestmark = pytest.mark.integration

TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.d_model=32",
        "train.eval_tokens=64", "train.global_steps=1"]


@pytest.mark.parametrize("field, value", [
    ("run_id", "../../etc"), ("run_id", "/tmp/crucible-escape"), ("run_id", "a/b"),
    ("sweep_id", "../sweeps"),
])
def test_crafted_id_parameter_is_refused_before_anything_is_registered(
        prefect_harness: None, flow_client: ApiClient, tmp_path, field: str, value: str) -> None:
    before = len(flow_client.list_runs())
    state = train_run(preset="smoke", overrides=TINY, return_state=True, **{field: value})
    assert state.is_failed()
    assert f"{field}={value!r} is not a valid id" in state.message
    assert len(flow_client.list_runs()) == before
    work = tmp_path / "work"
    assert not (work / "runs").exists() or not any((work / "runs").iterdir())
    assert not (tmp_path / "etc").exists()
