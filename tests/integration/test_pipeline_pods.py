"""The pipeline mode's pod-per-stage layout, its pods' commands run as local processes: no
cluster here, so each rendered stage Job's container command runs on this host as its pod would
(`pods supervise`, one per stage-replica), the S3 store is moto's server, and each stage's DNS
name is `localhost` on a port of its own (in a cluster every pod has its own address and they
share one port). What is not run: Kubernetes itself (scheduling, DNS, the Jobs' budgets, the
NetworkPolicy).

A real `kill -9` of an inner stage process mid-round: its supervisor (not a launcher watching
every process) tells the other stages over their links, restarts it, and the merge Job's
command merges a run in which every replica holds the same global weights.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from crucible.distributed.pipeline.launch import free_ports
from infra.k8s.render import RUN_DIR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _render(argv: list[str]) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "infra.k8s.render", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout))


def _here(container: dict, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """A rendered container's command and environment on this host: the run folder for the
    shared volume, this interpreter for the image's, the session's S3 credentials for the
    Secret's."""
    command = [sys.executable if c == "python" else c.replace(RUN_DIR, str(run_dir))
               for c in container["command"]]
    env = dict(os.environ)
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
    assert {e["name"] for e in container["env"] if "valueFrom" in e} <= set(os.environ)
    return command, env


def test_the_stage_pods_commands_recover_a_real_kill_and_merge(
        tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    objects = _render([
        "--pipeline", "--replicas", "2", "--image", "img", "--name", "pipe",
        "--store", f"s3://{s3_bucket}/pipe", "--endpoint-url", s3_endpoint,
        "--region", "us-east-1", "--link-timeout", "60", "--merge-grace-s", "30",
        "--set", "train.global_steps=4", "--set", "train.eval_every=2",
        "--set", "train.eval_tokens=8192", "--set", "train.device=cpu"])
    ident = json.loads(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["run.json"])
    # what the headless Service's DNS and each pod's own network give the stages in a cluster
    ports = dict(zip(ident["addresses"], free_ports(len(ident["addresses"])), strict=True))
    for key, address in ident["addresses"].items():
        assert re.fullmatch(rf"tcp://pipe-r\d-s\d\.pipe-links:{5555}", address)
        ident["addresses"][key] = f"tcp://localhost:{ports[key]}"
        ident["binds"][key] = f"tcp://127.0.0.1:{ports[key]}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps(ident))
    jobs = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]
            for o in objects if o["kind"] == "Job"}
    pods = {}
    try:
        for name, container in jobs.items():
            if name != "pipe-merge":
                command, env = _here(container, run_dir)
                pods[name] = subprocess.Popen(command, env=env, cwd=tmp_path,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert len(pods) == 8
        # kill -9 stage 1 of replica 0 mid-round, as `kubectl exec ... kill -9` would
        folder = run_dir / "stages" / "r0-s1"
        deadline = time.monotonic() + 300
        while (not (folder / "rounds.jsonl").exists()
               or len((folder / "rounds.jsonl").read_text().splitlines()) < 2):
            assert time.monotonic() < deadline, "stage 1 of replica 0 did not get to round 2"
            assert all(p.poll() is None for p in pods.values())
            time.sleep(0.02)
        time.sleep(0.05)
        killed_at = time.time()
        os.kill(int((folder / "pid").read_text()), signal.SIGKILL)
        outputs = {name: p.communicate(timeout=300)[0].decode() for name, p in pods.items()}
    finally:
        for p in pods.values():
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in pods.values()), outputs
    outcome = json.loads(outputs["pipe-r0-s1"].strip().splitlines()[-1])
    assert (outcome["exit"], outcome["lives"], outcome["lost"]) == (0, 2, False)

    command, env = _here(jobs["pipe-merge"], run_dir)
    merged = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr
    printed = json.loads(merged.stdout.strip().splitlines()[-1])
    assert printed["replicas_agree"] and printed["lost"] == [] and printed["notices"] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    (notice,) = summary["pipeline"]["notices"]         # told once, by its supervisor
    assert (notice["replica"], notice["stage"], notice["gone"]) == (0, 1, False)
    assert notice["wall"] - killed_at < 5.0
    journal = [json.loads(line) for line in
               (run_dir / "stages" / "r0-s1" / "process.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("planned")) for r in journal] == [
        ("start", None), ("kill", False), ("restart", None), ("rejoin", None)]
    assert journal[-1]["global_step"] == notice["round"] + 1
    lives = {(s["replica"], s["stage"]): s["lives"] for s in summary["pipeline"]["stages"]}
    assert lives == {(r, s): 2 if (r, s) == (0, 1) else 1 for r in range(2) for s in range(4)}
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["wall_s"] > 0
