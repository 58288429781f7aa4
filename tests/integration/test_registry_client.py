"""The registry client against the real API under uvicorn on Postgres: with the API stopped
mid-run and restarted, every metric and event arrives exactly once."""
from __future__ import annotations

import errno
import json
import threading

import pytest

from crucible.events import Event
from crucible.registry.reporting import (
    ApiCallback,
    ApiClient,
    ApiError,
    ApiUnavailable,
    replay_spools,
)
from crucible.registry.spool import SpoolFile
from tests.integration.reporting_helpers import FlakyProxy
from tests.integration.reporting_helpers import emit as _emit

pytestmark = pytest.mark.integration


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


def _spool_files(root):
    return sorted(root.rglob("*.spool.jsonl"))


def test_outage_mid_run_loses_and_duplicates_nothing(api_server, client, tmp_path):
    run_id = client.create_run({"seed": 0, "faults": {"p": 0.1}})["id"]
    callback = ApiCallback(client, run_id, tmp_path / "spool", batch_size=7,
                           flush_interval_s=0.0, close_timeout_s=20.0)
    _emit(callback, range(0, 10))
    assert callback.wait_handled(30) and not callback.spooled
    api_server.stop()
    _emit(callback, range(10, 25))          # every batch lands in the spool
    assert callback.wait_handled(30) and callback.spooled
    api_server.start()
    _emit(callback, range(20, 40))          # overlapping steps re-sent on purpose
    callback.close()
    assert callback.owed_records == 0
    assert _spool_files(tmp_path / "spool") == []
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
    assert first.owed_records == 5 * 4      # per step: 2 train_loss, 1 val_loss, 1 event
    api_server.start()
    other_run = client.create_run({"seed": 2})["id"]
    second = ApiCallback(client, other_run, tmp_path)   # its sender replays the first's spool
    second.close()
    metrics, events = _stored(client, run_id)
    assert metrics == _expected(range(5)) and len(events) == 5
    assert _spool_files(tmp_path) == []


def test_torn_spool_tail_is_dropped_and_order_kept(api_server, client, tmp_path):
    run_id = client.create_run({"seed": 3})["id"]
    api_server.stop()
    callback = ApiCallback(client, run_id, tmp_path, close_timeout_s=0.0)
    _emit(callback, range(3))
    callback.close()
    [spool] = _spool_files(tmp_path)
    with open(spool, "a") as fh:
        fh.write(f'{{"run_id": "{run_id}", "kind": "metr')    # killed mid-append
    api_server.start()
    resumed = ApiCallback(client, run_id, tmp_path)
    _emit(resumed, range(3, 6))
    resumed.close()
    metrics, _ = _stored(client, run_id)
    assert metrics == _expected(range(6))


def test_spool_lines_of_the_wrong_shape_are_set_aside_and_the_rest_delivered(
        client, tmp_path):
    run_id = client.create_run({"seed": 3})["id"]
    good = {"run_id": run_id, "kind": "metrics",
            "items": [{"name": "val_loss", "global_step": 0, "value": 2.5}]}
    bad = [{"kind": "metrics"}, {"run_id": run_id, "kind": "events", "items": "oops"},
           {"run_id": run_id, "kind": "metrics", "items": [7]}]
    spool = SpoolFile.create(tmp_path / run_id, "shapes")
    for record in [*bad, good]:
        spool.append(record)
    spool.close()
    report = replay_spools(client, tmp_path)
    assert report.delivered == 1 and report.complete
    rejected = tmp_path / run_id / "shapes.spool.jsonl.rejected"
    assert report.rejected == {str(rejected): 3}
    assert [json.loads(line) for line in rejected.read_text().splitlines()] == bad
    assert [m["value"] for m in client.list_metrics(run_id)] == [2.5]


class _FailsFirst:
    """The real client, except that its first metric post raises `error`: a failure in the
    sender's path that is not an ApiError (a bug, a library's surprise, a thread exit)."""

    def __init__(self, client, error):
        self._client, self._error = client, error
        self.failed = threading.Event()

    def __getattr__(self, name):
        return getattr(self._client, name)

    def post_metrics(self, *args, **kwargs):
        if not self.failed.is_set():
            self.failed.set()
            raise self._error
        return self._client.post_metrics(*args, **kwargs)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("error, disk_full_once", [
    (RuntimeError("a bug in the sender's path"), True), (SystemExit(3), False)],
    ids=["exception-then-disk-full", "thread-exit"])
def test_records_handed_over_survive_a_failing_sender(client, tmp_path, monkeypatch, error,
                                                       disk_full_once):
    run_id = client.create_run({"seed": 6})["id"]
    if disk_full_once:     # spooling what the failed sender held fails once too
        append, full = SpoolFile.append, [True]

        def append_on_a_full_disk(spool, record):
            if full[0]:
                full[0] = False
                raise OSError(errno.ENOSPC, "No space left on device")
            append(spool, record)

        monkeypatch.setattr(SpoolFile, "append", append_on_a_full_disk)
    failing = _FailsFirst(client, error)
    callback = ApiCallback(failing, run_id, tmp_path, flush_interval_s=0.0, max_backoff_s=0.1,
                           close_timeout_s=30.0)
    _emit(callback, range(5))
    assert failing.failed.wait(30)
    _emit(callback, range(5, 10))          # handed over after the failure
    callback.close()
    report = replay_spools(client, tmp_path)
    assert report.complete
    assert callback.owed_records == report.delivered
    metrics, events = _stored(client, run_id)
    assert metrics == _expected(range(10)) and len(events) == 10


@pytest.mark.parametrize("answer", ["html", "bad-gzip"])
def test_an_answer_no_client_can_read_is_transient_and_the_sender_goes_on(
        api_server, client, tmp_path, answer):
    run_id = client.create_run({"seed": 7})["id"]
    with FlakyProxy(api_server.url) as proxy, \
            ApiClient(proxy.url, api_server.token, timeout_s=5, retries=0) as via_proxy:
        proxy.broken = answer
        with pytest.raises(ApiUnavailable):
            via_proxy.get_run(run_id)
        callback = ApiCallback(via_proxy, run_id, tmp_path, flush_interval_s=0.0,
                               max_backoff_s=0.1, close_timeout_s=30.0)
        _emit(callback, range(5))
        assert callback.wait_handled(30) and callback.spooled
        proxy.broken = None                 # the proxy recovers: the same sender delivers
        _emit(callback, range(5, 10))
        callback.close()
    assert callback.owed_records == 0
    metrics, events = _stored(client, run_id)
    assert metrics == _expected(range(10)) and len(events) == 10


def test_a_refused_token_is_raised_on_the_training_thread_and_nothing_is_lost(
        api_server, client, tmp_path):
    run_id = client.create_run({"seed": 5})["id"]
    with ApiClient(api_server.url, "crc_not-a-valid-token", retries=0) as refused:
        callback = ApiCallback(refused, run_id, tmp_path, flush_interval_s=0.0)
        _emit(callback, range(3))
        assert callback.wait_handled(30)
        with pytest.raises(ApiError) as info:
            callback.flush()
        assert info.value.status_code in (401, 403)
        with pytest.raises(ApiError):
            callback.close()
    assert callback.owed_records == 3 * 4            # kept for when the token is fixed
    report = replay_spools(client, tmp_path)
    assert report.complete and report.delivered == 3 * 4
    metrics, events = _stored(client, run_id)
    assert metrics == _expected(range(3)) and len(events) == 3


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
    from dashboards import timeline

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

    fig = timeline.fault_timeline(faults=summary["faults"], events=events, strategy=strategy,
                                  replicas=2, global_steps=3)
    bars = {t.name: sorted(zip(t.y, t.base, t.x, t.text, strict=True)) for t in fig.data
            if t.type == "bar"}
    assert bars == _BARS[strategy]


def _database_online(admin_url, url, online):
    """Take the registry's database away (refuse new connections, end the open ones) or give it
    back: what a Postgres restart looks like to the API, without touching the other tests'
    databases on the same server."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = make_url(url).database
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(online).lower()}'))
            if not online:
                conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE datname = :name AND pid <> pg_backend_pid()"),
                             {"name": name})
    finally:
        engine.dispose()


def test_database_outage_mid_run_answers_503_and_loses_nothing(api_server, client, tmp_path,
                                                               pg_admin_url):
    import httpx

    run_id = client.create_run({"seed": 6, "faults": {"p": 0.1}})["id"]
    callback = ApiCallback(client, run_id, tmp_path / "spool", batch_size=7,
                           flush_interval_s=0.0, close_timeout_s=30.0)
    _emit(callback, range(0, 10))
    assert callback.wait_handled(30) and not callback.spooled
    _database_online(pg_admin_url, api_server.database_url, False)
    try:
        # the API stays up and says the registry is unavailable: a 503, never a 500
        answer = httpx.post(f"{api_server.url}/api/v1/runs/{run_id}/metrics:batch",
                            json={"items": [{"name": "val_loss", "global_step": 99,
                                             "value": 1.0}]},
                            headers={"Authorization": f"Bearer {api_server.token}"}, timeout=10)
        assert answer.status_code == 503, answer.text
        _emit(callback, range(10, 25))
        assert callback.wait_handled(30) and callback.spooled
    finally:
        _database_online(pg_admin_url, api_server.database_url, True)
    _emit(callback, range(25, 40))
    callback.close()
    assert callback.owed_records == 0
    metrics, events = _stored(client, run_id)
    assert metrics == _expected(range(40))
    assert len(events) == 40 and len({e["id"] for e in events}) == 40
