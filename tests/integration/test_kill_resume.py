"""A run killed with SIGKILL after a checkpoint resumes to the uninterrupted run's numbers."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-c", "from cli.main import main; main()"]
SETTINGS = ["--preset", "smoke", "--set", "faults.p=0.3", "--set", "faults.duration=2",
            "--set", "train.checkpoint_every=2", "--set", "train.global_steps=8",
            "--set", "pipeline.compression=ssn", "--no-progress"]


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_matches_uninterrupted(tmp_path):
    whole = subprocess.run([*CLI, "run", *SETTINGS, "--out", str(tmp_path / "whole")],
                           capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "cut"
    proc = subprocess.Popen([*CLI, "run", *SETTINGS, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = out / "store"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if list(store.glob("run-*/checkpoints/step-00000004.pt")):
            break
        assert proc.poll() is None, "the run ended before it was killed"
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("no checkpoint appeared")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists()
    resumed = subprocess.run([*CLI, "run", *SETTINGS, "--out", str(out), "--resume"],
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((tmp_path / "whole" / "summary.json").read_text())
    b = json.loads((out / "summary.json").read_text())
    assert b["final_val_loss"] == a["final_val_loss"]
    assert b["evals"] == a["evals"] and b["faults"] == a["faults"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    keys = [(m["name"], m["global_step"], m["replica"]) for m in map(json.loads, lines)]
    assert len(keys) == len(set(keys)) == len((tmp_path / "whole" / "metrics.jsonl").read_text().splitlines())
