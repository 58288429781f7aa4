"""The command line contract: `crucible run` and `crucible presets`, as a user calls them."""
import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-c", "from crucible.cli import main; main()"]


def _crucible(*args, cwd=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.mark.parametrize("compression", ["none", "ssn", "mapl"])
def test_smoke_run_learns_with_every_codec(tmp_path, compression):
    done = _crucible("run", "--preset", "smoke", "--set", f"pipeline.compression={compression}",
                     "--out", str(tmp_path), "--no-progress")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_val_loss"] < 0.7 * summary["initial_val_loss"]
    cfg = summary["config"]
    assert cfg["pipeline"]["compression"] == compression
    assert summary["contributions"]["made"] == cfg["replicas"] * cfg["pipeline"]["stages"] * \
        cfg["train"]["global_steps"]
    for key in ("evals", "tokens_processed", "bytes", "wall_s", "versions", "faults",
                "inner_steps", "synced_params"):
        assert key in summary
    assert summary["bytes"]["boundary_forward"] > 0
    assert f"summary: {tmp_path / 'summary.json'}" in done.stdout


@pytest.mark.parametrize("override, needle", [
    ("model.widht=3", "unknown key 'model.widht'"),
    ("faults.strategy=jump", "allowed values: 'skip' | 'drop' | 'drop_extend' | 'reroute'"),
    ("pipeline.stages=3", "pipeline.stages=3 must divide model.layers=4"),
    ("faults.p=1.5", "faults.p must be a probability in [0, 1]"),
])
def test_bad_set_exits_2_naming_the_key(tmp_path, override, needle):
    done = _crucible("run", "--preset", "smoke", "--set", override, "--out", str(tmp_path))
    assert done.returncode == 2
    assert needle in done.stderr
    assert not (tmp_path / "summary.json").exists()


def test_presets_lists_every_preset():
    done = _crucible("presets", "--json")
    assert done.returncode == 0, done.stderr
    names = [row["name"] for row in json.loads(done.stdout)]
    assert names == ["smoke", "small", "study", "paper-178m"]
