"""The registry client against the real API under uvicorn on Postgres: with the API stopped
mid-run and restarted, every metric and event arrives exactly once."""
from __future__ import annotations

import pytest

from crucible.events import Event, Metric
from crucible.reporting import ApiCallback, ApiClient, ApiError

pytestmark = pytest.mark.integration


def _emit(callback, steps):
    """What a trainer does: per global step, metrics per replica, an event, then flush."""
    for step in steps:
        for replica in range(2):
            callback.metric(Metric("train_loss", step, 3.0 - step * 0.01, tokens=64 * step,
                                   replica=replica))
        callback.metric(Metric("val_loss", step, 2.5 - step * 0.01))
        callback.event(Event("bypass", step, replica=step % 2, stage=1, detail={"step": step}))
        callback.flush()


def _expected(steps):
    metrics = sorted(
        [("train_loss", s, r, pytest.approx(3.0 - s * 0.01), 64 * s) for s in steps
         for r in range(2)] + [("val_loss", s, None, pytest.approx(2.5 - s * 0.01), None)
                               for s in steps], key=lambda m: (m[1], m[0], m[2] or 0))
    return metrics


def _stored(client, run_id):
    metrics = sorted([(m["name"], m["global_step"], m["replica"], m["value"], m["tokens"])
                      for m in client.list_metrics(run_id)], key=lambda m: (m[1], m[0], m[2] or 0))
    events = client.list_events(run_id)
    return metrics, events


@pytest.fixture
def client(api_server):
    with ApiClient(api_server.url, api_server.token, timeout_s=2.0, retries=1,
                   backoff_s=0.05) as api:
        yield api


def test_client_crud_round_trip(client):
    sweep = client.create_sweep("client", spec={"p": [0.0, 0.1]})
    run = client.create_run({"seed": 4, "faults": {"p": 0.1}}, sweep_id=sweep["id"],
                            config_hash="abc", code_version="v1")
    client.update_run(run["id"], status="completed", final_val_loss=2.0)
    client.update_sweep(sweep["id"], status="completed")
    assert client.get_run(run["id"])["final_val_loss"] == 2.0
    assert [r["id"] for r in client.list_runs(sweep_id=sweep["id"], config_hash="abc")] == \
        [run["id"]]
    assert client.robustness(sweep["id"])["missing_baselines"][0]["seed"] == 4
    assert client.table(sweep["id"])["rows"] == []
    with pytest.raises(ApiError) as info:
        client.update_run(run["id"], status="exploded")
    assert info.value.status_code == 422


def test_outage_mid_run_loses_and_duplicates_nothing(api_server, client, tmp_path):
    run_id = client.create_run({"seed": 0, "faults": {"p": 0.1}})["id"]
    callback = ApiCallback(client, run_id, tmp_path / "spool", batch_size=7,
                           flush_interval_s=0.0, close_timeout_s=20.0)
    _emit(callback, range(0, 10))
    assert not callback.spooled
    api_server.stop()
    _emit(callback, range(10, 25))          # every flush lands in the spool
    assert callback.spooled
    api_server.start()
    _emit(callback, range(20, 40))          # overlapping steps re-sent on purpose
    callback.close()
    assert not (tmp_path / "spool" / f"{run_id}.spool.jsonl").exists()
    metrics, events = _stored(client, run_id)
    assert metrics == _expected(range(40))
    assert [e["id"] for e in events] == [Event("bypass", s, replica=s % 2, stage=1).id
                                         for s in range(40)]
    assert [e["detail"] for e in events] == [{"step": s} for s in range(40)]


def test_spool_left_at_close_is_replayed_by_the_next_callback(api_server, client, tmp_path):
    run_id = client.create_run({"seed": 1})["id"]
    api_server.stop()
    first = ApiCallback(client, run_id, tmp_path, batch_size=1000, close_timeout_s=0.0)
    _emit(first, range(5))
    first.close()
    assert (tmp_path / f"{run_id}.spool.jsonl").stat().st_size > 0
    api_server.start()
    other_run = client.create_run({"seed": 2})["id"]
    second = ApiCallback(client, other_run, tmp_path)   # replays the first run's spool at start
    second.close()
    metrics, events = _stored(client, run_id)
    assert metrics == _expected(range(5)) and len(events) == 5
    assert not (tmp_path / f"{run_id}.spool.jsonl").exists()


def test_torn_spool_tail_is_dropped_and_order_kept(api_server, client, tmp_path):
    run_id = client.create_run({"seed": 3})["id"]
    api_server.stop()
    callback = ApiCallback(client, run_id, tmp_path, close_timeout_s=0.0)
    _emit(callback, range(3))
    callback.close()
    with open(tmp_path / f"{run_id}.spool.jsonl", "a") as fh:
        fh.write(f'{{"run_id": "{run_id}", "kind": "metr')    # killed mid-append
    api_server.start()
    resumed = ApiCallback(client, run_id, tmp_path)
    _emit(resumed, range(3, 6))
    resumed.close()
    metrics, _ = _stored(client, run_id)
    assert metrics == _expected(range(6))


# replica 0's stage 1 is down at steps 0-1, replica 1's at 1-2: at step 1 both are down, so a
# reroute has no healthy donor left and that step's stage is bypassed
_BOTH_DOWN_AT_STEP_1 = [{"replica": 0, "stage": 1, "start": 0, "duration": 2},
                        {"replica": 1, "stage": 1, "start": 1, "duration": 2}]
_DONE = {  # strategy -> (global step, replica) -> (kind, detail) of the one event for that step
    "drop": {(0, 0): ("drop", {"strategy": "drop"}), (1, 0): ("drop", {"strategy": "drop"}),
             (1, 1): ("drop", {"strategy": "drop"}), (2, 1): ("drop", {"strategy": "drop"})},
    "reroute": {(0, 0): ("reroute", {"strategy": "reroute", "donor": 1}),
                (1, 0): ("bypass", {"strategy": "reroute"}),
                (1, 1): ("bypass", {"strategy": "reroute"}),
                (2, 1): ("reroute", {"strategy": "reroute", "donor": 0})},
}
_BARS = {  # strategy -> timeline bar name -> [(replica, first step, steps, text)]
    "drop": {"stage down: tokens dropped": [(0, 0, 2, "stage 1"), (1, 1, 2, "stage 1")]},
    "reroute": {"stage down: stage skipped (bypass)": [(0, 1, 1, "stage 1"), (1, 1, 1, "stage 1")],
                "stage down: rerouted via donor replica": [(0, 0, 1, "stage 1 via replica 1"),
                                                           (1, 2, 1, "stage 1 via replica 0")]},
}


@pytest.mark.parametrize("strategy", ["drop", "reroute"])
def test_a_training_run_reports_what_was_done_about_each_down_stage(client, tmp_path, strategy):
    """A real (tiny) training run reporting through the client: one event per down stage-replica
    and step, of the kind that says what was done; the registry's kind filter and the dashboard's
    fault timeline built from the stored events agree."""
    from crucible.config import apply_overrides
    from crucible.faults import FaultPlan
    from crucible.presets import get_preset
    from crucible.train import train
    from dashboards import figures

    config = apply_overrides(get_preset("smoke"), {
        "model.d_model": 32, "model.layers": 4, "model.heads": 2, "model.seq_len": 16,
        "replicas": 2, "train.batch_size": 2, "sparseloco.inner_steps": 2,
        "train.global_steps": 3, "train.eval_every": 3, "train.warmup_steps": 2,
        "faults.strategy": strategy, "faults.p": 0.01})
    run_id = client.create_run(config.to_dict())["id"]
    callback = ApiCallback(client, run_id, tmp_path / "spool", flush_interval_s=0.0)
    summary = train(config, out_dir=tmp_path / "out", callback=callback,
                    plan=FaultPlan.from_list(_BOTH_DOWN_AT_STEP_1))

    events = client.list_events(run_id)
    done = {(e["global_step"], e["replica"]): (e["kind"], e["detail"]) for e in events
            if e["kind"] in ("bypass", "drop", "reroute")}
    assert done == _DONE[strategy]
    assert sum(e["kind"] in ("bypass", "drop", "reroute") for e in events) == len(done)
    bypassed = [(e["global_step"], e["replica"]) for e in client.list_events(run_id, kind="bypass")]
    assert bypassed == ([] if strategy == "drop" else [(1, 0), (1, 1)])
    for kind in ("drop", "reroute"):
        assert {(e["global_step"], e["replica"]) for e in client.list_events(run_id, kind=kind)} \
            == {key for key, (k, _) in _DONE[strategy].items() if k == kind}

    fig = figures.fault_timeline(faults=summary["faults"], events=events, strategy=strategy,
                                 replicas=2, global_steps=3)
    bars = {t.name: sorted(zip(t.y, t.base, t.x, t.text, strict=True)) for t in fig.data
            if t.type == "bar"}
    assert bars == _BARS[strategy]
