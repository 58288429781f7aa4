"""A run whose records are still owed is never called completed: the registry records how many
it owes, the robustness numbers and the dashboards treat it as unfinished, and
`crucible api replay` delivers the records and only then records the run as completed."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import httpx
import pytest

import crucible.registry.spool_files
from crucible.registry.reporting import (
    ApiCallback,
    ApiClient,
    ApiError,
    RecordsOwed,
    record_finish,
    replay_spools,
)
from crucible.registry.spool import SpoolFile
from tests.integration.reporting_helpers import PER_STEP, emit, spool_while_down

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from cli.main import main; main()"]


def _replay(api_server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CRUCIBLE_API_URL": api_server.url,
           "CRUCIBLE_API_TOKEN": api_server.token}
    return subprocess.run([*CLI, "api", "replay", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _page(api_server, path: str) -> str:
    response = httpx.get(f"{api_server.url}{path}", timeout=30)
    assert response.status_code == 200
    return response.text


def test_owed_records_keep_a_run_unfinished_until_replay_delivers_them(api_server, tmp_path):
    client = ApiClient(api_server.url, api_server.token, timeout_s=5, retries=1, backoff_s=0.05)
    sweep_id = client.create_sweep("owed")["id"]
    base = client.create_run({"seed": 0, "faults": {"p": 0.0}}, sweep_id=sweep_id)["id"]
    client.update_run(base, status="completed", final_val_loss=2.0)
    run_id = client.create_run({"seed": 0, "faults": {"p": 0.1}}, sweep_id=sweep_id)["id"]
    client.update_run(run_id, status="running")
    # the registry is away while the run reports, and back just after training ended
    owed = spool_while_down(api_server, client, run_id, tmp_path, range(10))
    assert owed == 10 * PER_STEP
    final = {"status": "completed", "status_reason": None, "final_val_loss": 2.2}
    with pytest.raises(RecordsOwed) as info:    # no time left to replay before finishing
        record_finish(client, tmp_path, run_id, final, timeout_s=0.0)
    assert info.value.owed == owed

    run = client.get_run(run_id)
    assert (run["status"], run["owed_records"]) == ("running", owed)
    assert run["status_reason"] == f"training finished; {owed} records owed"
    assert client.list_metrics(run_id) == []
    robustness = client.robustness(sweep_id)
    assert [item["p"] for item in robustness["items"]] == [0.0]
    assert robustness["pending_runs"] == 1
    assert f"owes {owed} records" in _page(api_server, f"/dashboards/runs/{run_id}")
    assert "still owe records" in _page(api_server, f"/dashboards/sweeps/{sweep_id}")

    done = _replay(api_server, "--spool-root", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"run {run_id}: final state recorded" in done.stdout
    run = client.get_run(run_id)
    assert (run["status"], run["owed_records"], run["status_reason"]) == ("completed", 0, None)
    assert run["final_val_loss"] == 2.2
    assert len(client.list_metrics(run_id)) == 30 and len(client.list_events(run_id)) == 10
    assert [item["p"] for item in client.robustness(sweep_id)["items"]] == [0.0, 0.1]
    assert "owes" not in _page(api_server, f"/dashboards/runs/{run_id}")
    assert list(tmp_path.iterdir()) == []           # nothing left behind
    client.close()


def test_replay_command_says_what_is_left_when_the_registry_is_down(api_server, tmp_path):
    with ApiClient(api_server.url, api_server.token, retries=0) as client:
        run_id = client.create_run({"seed": 1})["id"]
        spool_while_down(api_server, client, run_id, tmp_path, range(2))
    api_server.stop()
    try:
        done = _replay(api_server, "--spool-root", str(tmp_path))
    finally:
        api_server.start()
    assert done.returncode == 1
    assert f"run {run_id}: owes {2 * PER_STEP} records" in done.stdout
    assert "registry unreachable" in done.stderr
    again = _replay(api_server, "--spool-root", str(tmp_path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"delivered {2 * PER_STEP} records" in again.stdout


def test_robustness_leaves_out_a_run_that_owes_records_whatever_its_status(registry):
    """Belt and braces for clients that do not go through the spool (an older reporter)."""
    sweep_id = registry.post("/api/v1/sweeps", json={"name": "owed"}).json()["id"]
    runs = {}
    for p, loss in ((0.0, 2.0), (0.1, 2.2)):
        runs[p] = registry.post("/api/v1/runs", json={"sweep_id": sweep_id, "config": {
            "seed": 0, "faults": {"p": p}}}).json()["id"]
        registry.patch(f"/api/v1/runs/{runs[p]}", json={"status": "completed",
                                                          "final_val_loss": loss})
    registry.patch(f"/api/v1/runs/{runs[0.1]}", json={"owed_records": 5})
    robustness = registry.get(f"/api/v1/sweeps/{sweep_id}/robustness").json()
    assert [item["p"] for item in robustness["items"]] == [0.0]
    assert robustness["pending_runs"] == 1
    registry.patch(f"/api/v1/runs/{runs[0.1]}", json={"owed_records": 0})
    robustness = registry.get(f"/api/v1/sweeps/{sweep_id}/robustness").json()
    assert [item["p"] for item in robustness["items"]] == [0.0, 0.1]


def test_replay_reads_the_spool_folders_of_earlier_versions(api_server, tmp_path):
    """Before spools had a root, each run kept `<work>/runs/<id>/spool/<id>.spool.jsonl`."""
    with ApiClient(api_server.url, api_server.token) as client:
        run_id = client.create_run({"seed": 2})["id"]
        legacy = tmp_path / "runs" / run_id / "spool"
        legacy.mkdir(parents=True)
        lines = [{"run_id": run_id, "kind": "metrics",
                  "items": [{"name": "val_loss", "global_step": 0, "value": 2.5}]},
                 {"run_id": run_id, "kind": "events",
                  "items": [{"id": "drop:0:0:1:0", "kind": "drop", "global_step": 0,
                             "replica": 0, "stage": 1, "detail": {}}]}]
        (legacy / f"{run_id}.spool.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                              for r in lines))
        done = _replay(api_server, "--spool-root", str(legacy))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "delivered 2 records" in done.stdout
        assert [m["value"] for m in client.list_metrics(run_id)] == [2.5]
        assert [e["id"] for e in client.list_events(run_id)] == ["drop:0:0:1:0"]


@pytest.fixture
def client(api_server):
    with ApiClient(api_server.url, api_server.token, timeout_s=5, retries=1,
                   backoff_s=0.05) as api:
        yield api


@contextmanager
def _run_folder_locked(run_dir):
    """Hold a run folder's lock the way a settle in another process does."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _spool_one(root, run_id, items):
    """A spool left by a reporter of `run_id` holding one metrics batch of `items`."""
    spool = SpoolFile.create(root / run_id, "left")
    spool.append({"run_id": run_id, "kind": "metrics", "items": items})
    spool.close()


_FINAL = {"status": "completed", "status_reason": None, "final_val_loss": 2.0}


def test_replay_skips_a_spool_it_cannot_open_and_says_so(api_server, client, tmp_path):
    run_id = client.create_run({"seed": 3})["id"]
    owed = spool_while_down(api_server, client, run_id, tmp_path, range(2))
    stray = tmp_path / "00000000-0000-0000-0000-000000000000" / "x.spool.jsonl"
    stray.mkdir(parents=True)           # replayed first; opening it fails (IsADirectoryError)
    report = replay_spools(client, tmp_path)
    assert report.delivered == owed
    assert list(report.unreadable) == [str(stray)] and not report.complete
    done = _replay(api_server, "--spool-root", str(tmp_path))
    assert done.returncode == 1
    assert f"skipped, cannot read {stray}: IsADirectoryError" in done.stderr


def test_a_new_attempt_is_not_finished_by_what_an_earlier_attempt_left(api_server, client,
                                                                         tmp_path):
    run_id = client.create_run({"seed": 4})["id"]
    # attempt 1 fails while the registry is away: its records and its final state are left
    spool_while_down(api_server, client, run_id, tmp_path, range(3))
    api_server.stop()
    try:
        with pytest.raises(RecordsOwed):
            record_finish(client, tmp_path, run_id,
                          {"status": "failed", "status_reason": "attempt 1 crashed"},
                          timeout_s=0.0)
    finally:
        api_server.start()
    attempt = ApiCallback(client, run_id, tmp_path, flush_interval_s=0.0)   # attempt 2
    client.update_run(run_id, status="running", status_reason=None)         # as register-run
    emit(attempt, range(3, 6))
    assert attempt.wait_handled(30)
    with ApiClient(api_server.url, api_server.token) as elsewhere:   # another flow's replay
        replay_spools(elsewhere, tmp_path)
        assert client.get_run(run_id)["status"] == "running"
        attempt.close()
        replay_spools(elsewhere, tmp_path)
    run = client.get_run(run_id)
    assert (run["status"], run["status_reason"]) == ("running", None)
    record_finish(client, tmp_path, run_id, _FINAL, timeout_s=30)
    run = client.get_run(run_id)
    assert (run["status"], run["owed_records"], run["final_val_loss"]) == ("completed", 0, 2.0)
    assert len(client.list_metrics(run_id)) == 6 * 3 and len(client.list_events(run_id)) == 6


def test_registering_an_attempt_sets_aside_the_final_state_an_earlier_one_left(
        api_server, client, tmp_path):
    from crucible.presets import get_preset
    from flows.run_flow import register_run
    from flows.settings import FlowSettings

    settings = FlowSettings(api_url=api_server.url, api_token=api_server.token,
                            work_dir=tmp_path)
    run_id = client.create_run({"seed": 11})["id"]
    _spool_one(settings.spool_root, run_id,
               [{"name": "val_loss", "global_step": 0, "value": 2.5}])
    with pytest.raises(RecordsOwed):        # attempt 1 failed, owing its record
        record_finish(client, settings.spool_root, run_id,
                      {"status": "failed", "status_reason": "attempt 1 crashed"}, timeout_s=0.0)
    assert register_run.fn(get_preset("smoke"), None, run_id, settings) == run_id
    replay_spools(client, settings.spool_root)     # another flow's replay, before training
    run = client.get_run(run_id)
    assert (run["status"], run["status_reason"]) == ("queued", None)   # waits for its GPU slot
    assert [m["value"] for m in client.list_metrics(run_id)] == [2.5]


def test_record_finish_writes_the_final_state_while_the_run_folder_is_locked(client, tmp_path):
    run_id = client.create_run({"seed": 5})["id"]
    with _run_folder_locked(tmp_path / run_id), pytest.raises(RecordsOwed):
        record_finish(client, tmp_path, run_id, _FINAL, timeout_s=0.2)
    assert replay_spools(client, tmp_path).finished == [run_id]
    assert client.get_run(run_id)["status"] == "completed"


def test_record_finish_outlasts_its_run_folder_being_removed(client, tmp_path, monkeypatch):
    """A reporter closing its empty spool removes the run folder when it is empty: right
    between record_finish making the folder and writing the final state into it."""
    run_id = client.create_run({"seed": 6})["id"]
    removed = []

    def open_after_a_reporter_tidied(path, mode="r", *args, **kwargs):
        if os.path.basename(path) == "finish.jsonl" and mode.startswith("a") and not removed:
            removed.append(path)
            os.rmdir(os.path.dirname(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(crucible.registry.spool_files, "open", open_after_a_reporter_tidied, raising=False)
    record_finish(client, tmp_path, run_id, _FINAL, timeout_s=30)
    assert removed and client.get_run(run_id)["status"] == "completed"


def test_record_finish_fails_when_another_replay_saw_its_final_state_refused(
        api_server, client, tmp_path, monkeypatch):
    run_id = client.create_run({"seed": 7})["id"]
    _spool_one(tmp_path, run_id, [{"name": "val_loss", "global_step": 0, "value": 2.5}])
    module = sys.modules[record_finish.__module__]
    replay_file, interleaved = module._replay_file, []

    def another_replay_first(*args, **kwargs):
        # another process replays the run right now: it delivers the record and applies the
        # final state, which the API refuses
        if not interleaved:
            interleaved.append(True)
            with ApiClient(api_server.url, api_server.token) as elsewhere:
                replay_spools(elsewhere, tmp_path)
        return replay_file(*args, **kwargs)

    monkeypatch.setattr(module, "_replay_file", another_replay_first)
    with pytest.raises(ApiError) as info:
        record_finish(client, tmp_path, run_id, {**_FINAL, "final_val_loss": "low"},
                      timeout_s=30)
    assert info.value.status_code == 422 and "final_val_loss" in str(info.value)
    assert interleaved and not isinstance(info.value, RecordsOwed)
    assert client.get_run(run_id)["status"] != "completed"


def test_a_replay_honours_its_timeout_while_a_run_folder_is_locked(client, tmp_path):
    run_id = client.create_run({"seed": 8})["id"]
    found: list = []
    replay = threading.Thread(target=lambda: found.append(
        replay_spools(client, tmp_path, timeout_s=0.5)))
    with _run_folder_locked(tmp_path / run_id):
        (tmp_path / run_id / "finish.jsonl").write_text(json.dumps(_FINAL) + "\n")
        replay.start()
        replay.join(20)        # a replay that waits past its timeout gets the lock below
    replay.join()
    assert found[0].finished == []          # it gave up on the held folder in time
    assert client.get_run(run_id)["status"] != "completed"
    assert replay_spools(client, tmp_path).finished == [run_id]


def test_records_the_api_refused_are_named_on_the_completed_run(client, tmp_path):
    run_id = client.create_run({"seed": 9})["id"]
    _spool_one(tmp_path, run_id, [{"name": "val_loss", "global_step": 0, "value": "2.5"}])
    record_finish(client, tmp_path, run_id, _FINAL, timeout_s=30)
    run = client.get_run(run_id)
    assert (run["status"], run["owed_records"]) == ("completed", 0)
    rejected = tmp_path / run_id / "left.spool.jsonl.rejected"
    assert run["status_reason"] == f"completed; 1 records refused by the API, kept in {rejected}"
    assert client.list_metrics(run_id) == []
