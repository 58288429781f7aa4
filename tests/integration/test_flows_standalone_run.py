"""`crucible run --api URL`: a run outside any sweep, reported to the real API (uvicorn on
Postgres) through the flows' spooled reporter, lands in the registry with its config, name, tags,
notes, every metric and event, and status completed; its page is printed at start and end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from crucible.registry.reporting import ApiClient

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from cli.main import main; main()"]
SHORT = ["--preset", "smoke", "--set", "train.global_steps=3", "--set", "faults.p=0.5",
         "--set", "faults.duration=1", "--no-progress"]


def _crucible(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CRUCIBLE_API")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**base, **env})


def _local(out: Path) -> tuple[set[tuple[Any, ...]], set[str]]:
    """What the trainer produced, from the run folder's own files."""
    metrics = {(m["name"], m["global_step"], m["replica"]) for m in
               map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    events = {e["id"] for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())}
    return metrics, events


def test_run_with_api_lands_in_the_registry_completed_with_every_record(
        api_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _crucible(["run", *SHORT, "--out", str(out), "--api", api_server.url,
                      "--name", "lr probe", "--tag", "probe", "--tag", "paper/fig3",
                      "--note", "first look at p=0.5"],
                     {"CRUCIBLE_API_TOKEN": api_server.token,
                      "CRUCIBLE_WORK_DIR": str(tmp_path / "work")}, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = json.loads((out / "registry.json").read_text())["run_id"]
    page = f"{api_server.url}/dashboards/runs/{run_id}"
    pages = [line for line in done.stdout.splitlines() if line.startswith("run page:")]
    assert len(pages) == 2 and all(page in line for line in pages)       # at start and at end
    assert done.stdout.strip().splitlines()[-1] == f"run page: {page}"

    summary = json.loads((out / "summary.json").read_text())
    with ApiClient(api_server.url, api_server.token) as client:
        run = client.get_run(run_id)
        metrics = client.list_metrics(run_id)
        events = client.list_events(run_id)
        tagged = client.list_runs(tag="paper/fig3")
    assert run["status"] == "completed" and run["sweep_id"] is None
    assert run["name"] == "lr probe" and run["notes"] == "first look at p=0.5"
    assert run["tags"] == ["paper/fig3", "probe"]
    assert run["config"] == summary["config"]
    assert run["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    assert not run.get("owed_records")
    assert [r["id"] for r in tagged] == [run_id]
    local_metrics, local_events = _local(out)
    assert local_events, "p = 0.5 over 3 steps: the run had faults to report"
    stored = [(m["name"], m["global_step"], m["replica"]) for m in metrics]
    assert len(stored) == len(set(stored)) and set(stored) == local_metrics
    assert {e["id"] for e in events} == local_events


def test_a_refused_token_exits_2_before_training(api_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _crucible(["run", *SHORT, "--out", str(out)],
                     {"CRUCIBLE_API_URL": api_server.url, "CRUCIBLE_API_TOKEN": "not-a-token",
                      "CRUCIBLE_WORK_DIR": str(tmp_path / "work")}, tmp_path)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "refused the token" in errors[0], done.stderr[-2000:]
    assert "CRUCIBLE_API_TOKEN" in errors[0]
    assert not (out / "summary.json").exists()


def _max_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max([-1] + [json.loads(line)["global_step"] for line in lines if line.endswith("}")])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_registry_down_mid_run_loses_nothing_and_replay_completes_it(
        api_server: Any, tmp_path: Path) -> None:
    """The API stops after the run's first global steps and stays down to its end: the command
    still succeeds, says records are owed, and the run is not called completed; once the API is
    back, `crucible api replay` delivers every record and completes it."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {"CRUCIBLE_API_URL": api_server.url, "CRUCIBLE_API_TOKEN": api_server.token,
           "CRUCIBLE_WORK_DIR": str(work), "CRUCIBLE_REPLAY_TIMEOUT_S": "2"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("CRUCIBLE_API")}
    tiny = ["--preset", "smoke", "--no-progress", "--set", "train.global_steps=40",
            "--set", "model.d_model=32", "--set", "model.heads=2", "--set", "faults.p=0.3",
            "--set", "faults.duration=1", "--set", "train.eval_tokens=64"]
    proc = subprocess.Popen([*CLI, "run", *tiny, "--out", str(out)], cwd=tmp_path,
                            env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        while _max_step(out) < 2 and proc.poll() is None:
            time.sleep(0.05)
        api_server.stop()
        stopped_at = _max_step(out)
        stdout, stderr = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
        api_server.start()
    assert proc.returncode == 0, stderr[-3000:]
    assert stopped_at < 39, "the run ended before the outage began"
    assert "records owed" in stderr and "crucible api replay" in stderr
    run_id = json.loads((out / "registry.json").read_text())["run_id"]
    with ApiClient(api_server.url, api_server.token) as client:
        assert client.get_run(run_id)["status"] == "running"      # never completed while owing

        replay = _crucible(["api", "replay"], env, tmp_path)
        assert replay.returncode == 0, replay.stderr[-3000:]
        run = client.get_run(run_id)
        metrics, events = client.list_metrics(run_id), client.list_events(run_id)
    assert run["status"] == "completed" and not run.get("owed_records")
    local_metrics, local_events = _local(out)
    stored = [(m["name"], m["global_step"], m["replica"]) for m in metrics]
    assert len(stored) == len(set(stored)) and set(stored) == local_metrics
    assert {e["id"] for e in events} == local_events
