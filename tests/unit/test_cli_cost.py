"""`crucible cost` as a user calls it: a run folder, a sweep folder, a study's results, bad
input (exit 2 with one `error:` line, never a traceback)."""
import json
import shutil
from pathlib import Path

from crucible.pricing.cost import run_cost
from crucible.pricing.deployment import load_deployment
from tests.unit.test_cli import _crucible_here

ROOT = Path(__file__).resolve().parents[2]
SPOT = ROOT / "infra" / "deployments" / "cloud-8x4-spot.toml"
RESULTS = ROOT / "results" / "processes"


def _run_folder(tmp_path, cell, name=None):
    folder = tmp_path / (name or cell)
    folder.mkdir(parents=True)
    shutil.copyfile(RESULTS / f"{cell}.json", folder / "summary.json")
    return folder


def test_cost_of_a_run_folder_writes_cost_json(tmp_path):
    folder = _run_folder(tmp_path, "none-reroute-p0.1-s0")
    result = _crucible_here("cost", folder, "--deployment", SPOT)
    assert result.returncode == 0, result.stderr
    written = json.loads((folder / "cost.json").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    assert written == json.loads(json.dumps(run_cost(summary, load_deployment(SPOT))))
    assert written["deployment"] == "cloud-8x4-spot" and written["pricing"] == "spot"
    assert "cost on cloud-8x4-spot" in result.stdout
    assert not list(folder.glob(".cost.json*"))          # no temporary file left behind


def test_cost_of_a_sweep_folder_names_the_cheapest_strategy(tmp_path):
    sweep = tmp_path / "sweep"
    for cell in ("none-base-s0", "none-base-s1", "none-skip-p0.1-s0", "none-skip-p0.1-s1",
                 "none-drop-p0.1-s0", "none-drop-p0.1-s1"):
        _run_folder(sweep, cell)
    result = _crucible_here("cost", sweep, "--deployment", SPOT, "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert {(c["strategy"], len(c["seeds"])) for c in record["cells"]} == {
        ("base", 2), ("skip", 2), ("drop", 2)}
    assert record["cheapest"][0]["p"] == 0.1
    assert record["cheapest"][0]["strategy"] in ("skip", "drop")
    assert json.loads((sweep / "costs.json").read_text()) == record
    assert all((sweep / c / "cost.json").is_file() for c in ("none-base-s0", "none-drop-p0.1-s1"))


def test_cost_of_a_study_writes_nothing_beside_the_committed_data(tmp_path):
    before = sorted(p.name for p in RESULTS.iterdir())
    result = _crucible_here("cost", ROOT / "studies" / "processes.toml", "--deployment", SPOT)
    assert result.returncode == 0, result.stderr
    assert "cheapest at none correlated, p = 0.1" in result.stdout
    assert sorted(p.name for p in RESULTS.iterdir()) == before


def test_bad_input_exits_2_naming_the_fix(tmp_path):
    folder = _run_folder(tmp_path, "none-base-s0")
    bad = tmp_path / "bad.toml"
    bad.write_text(SPOT.read_text().replace("spot_discount = 0.6", "spot_discount = 0.95"))
    result = _crucible_here("cost", folder, "--deployment", bad)
    assert result.returncode == 2
    assert "price.spot_discount must be >= 0 and <= 0.9" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    result = _crucible_here("cost", tmp_path / "nowhere", "--deployment", SPOT)
    assert result.returncode == 2 and "no such folder" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _crucible_here("cost", empty, "--deployment", SPOT)
    assert result.returncode == 2 and "holds no summary.json" in result.stderr
    assert not (folder / "cost.json").exists()
