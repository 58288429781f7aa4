"""What the study document says of what it has not decided (issue 34): each open comparison
priced from the data (its sd, the seeds and CPU-hours it would need), claim (a)'s seeds taken
from its costliest comparison with the ones lacking an sd named, the GPU spec's estimate, the
estimand pilot's table and verdict, the seed blocks' table, and an answer worded for the grid
it has (one arm, one p)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from crucible import stats, study
from crucible.study.estimand import ADOPT_RATIO, estimand_rows, estimand_section
from crucible.study.formatting import _seeds_needed
from crucible.study.price import CPU_BUDGET_H, gpu_estimate, price, price_section
from tests.unit.test_study import fake_summary, fill, write_spec

REPO = Path(__file__).resolve().parents[2]

GRID = """
name = "t"
preset = "smoke"
seeds = [0, 1, 2, 3]

[[grid]]
arms = ["none", "ssn"]
strategies = ["skip", "drop"]
p = [0, 0.01, 0.1, 0.2]
"""


def _data(tmp_path: Path, text: str = GRID) -> study.StudyData:
    spec = study.load_spec(write_spec(tmp_path, text))
    fill(spec, {"none-skip-p0.1": [1.0, 1.4, 0.6, 1.2], "none-drop-p0.1": [3.0, 2.0, 4.0, 3.5],
                "ssn-skip-p0.1": [0.2, 1.5, -0.5, 0.9], "ssn-drop-p0.1": [0.4, 1.0, 0.1, 2.0],
                "none-skip-p0.01": [0.3], "ssn-skip-p0.01": [0.1]})
    return study.StudyData(spec, study.load_results(spec))


def test_an_open_comparison_is_priced_from_its_sd_and_the_measured_runs(tmp_path: Path) -> None:
    data = _data(tmp_path)
    (a,) = [c for c in data.claims() if c.tag == "a"]
    ssn = next(c for c in a.comparisons if c.label == "SSN, p = 0.1")
    assert ssn.status == "unresolved"
    got = price(data, ssn)
    need = got["need"]

    def clears(n: int) -> bool:      # 80% power: gap >= (t_.975 + t_.8) sd / sqrt(n)
        t = stats.t_quantile(0.975, n - 1) + stats.t_quantile(0.8, n - 1)
        return abs(ssn.stat.mean) >= t * ssn.stat.sd / math.sqrt(n)

    assert clears(need) and not clears(need - 1)
    # more than the seeds at which it would clear with the mean exactly as measured (50%)
    assert need > stats.seeds_to_decide(ssn.stat.mean, ssn.stat.sd)
    assert got["new"] == need - 4 and got["runs_per_seed"] == 3
    # fake runs take 60 s each: skip, drop and the baseline per new seed
    assert math.isclose(got["cpu_h"], (need - 4) * 3 * 60.0 / 3600.0)
    assert got["within_budget"] == (got["cpu_h"] <= CPU_BUDGET_H)


def test_a_comparison_with_one_seed_is_priced_at_the_seed_that_gives_it_an_sd(
        tmp_path: Path) -> None:
    data = _data(tmp_path)
    (e,) = [c for c in data.claims() if c.tag == "e"]
    one = next(c for c in e.comparisons if c.label.startswith("uncompressed"))
    got = price(data, one)
    assert one.status == "missing" and got["first_sd"] and got["new"] == 1
    section = "\n".join(price_section(data, data.claims()))
    row = next(line for line in section.splitlines() if line.startswith("| (e) uncompressed"))
    assert "2 (for an sd)" in row and row.endswith("| a second seed first |")


def test_claim_a_names_its_costliest_comparison_and_those_without_an_sd(tmp_path: Path) -> None:
    data = _data(tmp_path)
    (a,) = [c for c in data.claims() if c.tag == "a"]
    # p = 0.01 has skip only and p = 0.2 nothing: 4 comparisons without an sd
    assert a.without_sd == a.count("missing") == 4
    needs = [c.seeds_to_decide for c in a.comparisons if c.status == "unresolved"]
    text = _seeds_needed(a)
    assert text.startswith(str(max(n for n in needs if n is not None)))
    assert "4 comparisons without an sd yet" in text


def test_the_gpu_spec_is_the_claims_grid_at_chinchilla_tokens() -> None:
    gpu = gpu_estimate(REPO / "studies" / "gpu-d512.toml",
                       REPO / "infra" / "deployments" / "one-gpu-h100.toml")
    spec = study.load_spec(REPO / "studies" / "gpu-d512.toml")
    assert gpu["runs"] == len(spec.cells()) == 3 * 9 * 8
    assert 20e6 <= gpu["params"] <= 50e6 and 0.95 <= gpu["chinchilla"] <= 1.05
    assert math.isclose(gpu["gpu_h"], gpu["runs"] * gpu["run_s"] / 3600.0)
    assert not gpu["deployment_path"].startswith("/")       # a path a reader has too


def _tail_fill(spec: study.SweepSpec, final: dict[int, float], tail: dict[int, float]) -> None:
    """Baselines at 2.0 (both estimands) and skip p = 0.2 at the given degradations (%)."""
    for cell in spec.cells():
        if cell.seed not in final:
            continue
        path = study.result_path(spec, cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        if cell.key.is_baseline:
            loss, tail_loss = 2.0, 2.0
        else:
            loss = 2.0 * (1 + final[cell.seed] / 100)
            tail_loss = 2.0 * (1 + tail[cell.seed] / 100)
        summary = fake_summary(cell, loss, spec=spec)
        summary["tail_val_loss"] = tail_loss
        path.write_text(json.dumps(summary))


PILOT = """
name = "ep"
preset = "smoke"
seeds = [0, 1, 2, 3]
document = "../runs/ep.md"
[[grid]]
arms = ["none"]
strategies = ["skip"]
p = [0, 0.2]
"""


@pytest.mark.parametrize("tail_spread, adopted", [(0.5, True), (0.9, False)])
def test_the_estimand_pilot_adopts_the_tail_only_when_its_sd_is_two_thirds(
        tmp_path: Path, tail_spread: float, adopted: bool) -> None:
    pilot = study.load_spec(write_spec(tmp_path, PILOT, name="ep.toml"))
    final = {0: 1.0, 1: 3.0, 2: 0.0, 3: 2.0}
    tail = {s: 1.5 + tail_spread * (v - 1.5) for s, v in final.items()}   # sd scaled
    _tail_fill(pilot, final, tail)
    main = study.load_spec(write_spec(tmp_path, GRID.replace(
        'seeds = [0, 1, 2, 3]\n', 'seeds = [0, 1, 2, 3]\nestimand = ["ep.toml"]\n')))
    (row,) = estimand_rows(main)
    assert math.isclose(row["ratio"], tail_spread)
    text = "\n".join(estimand_section(main, {"none": "uncompressed"}))
    assert ("Qualifies as a second, labelled estimand" in text) == adopted
    assert ("Does not qualify" in text) == (not adopted)
    assert ADOPT_RATIO == pytest.approx(2 / 3)
    assert "Provisional" not in text                   # every seed of the pilot is in


def test_the_seed_blocks_table_names_each_seeds_arithmetic(tmp_path: Path) -> None:
    from crucible.study.blocks import blocks_section

    data = _data(tmp_path)
    results = dict(data.results)
    old = json.loads(json.dumps(results["none-base-s1"]))
    old["study"].pop("arithmetic")
    results["none-base-s1"] = old
    text = "\n".join(blocks_section(data.spec, results, []))
    here = data.results["none-base-s0"]["study"]["arithmetic"]
    assert f"| 0 | 8 | `{here}` | not named |" in text        # fakes name no CPU model
    assert f"| 1 | 6 | `{here}`; no proof yet | not named |" in text   # one made before it
    assert "exchangeable" in text


def test_a_grid_with_one_arm_and_one_p_is_described_as_such(tmp_path: Path) -> None:
    from crucible.study.document import render_markdown

    spec = study.load_spec(write_spec(tmp_path, """
name = "t"
preset = "smoke"
seeds = [0, 1, 2]
[[grid]]
arms = ["none"]
strategies = ["skip", "drop"]
p = [0, 0.1]
"""))
    fill(spec, {"none-skip-p0.1": [0.5, 0.7, 0.6], "none-drop-p0.1": [3.0, 3.3, 3.1]})
    text = render_markdown(study.StudyData(spec, study.load_results(spec)),
                           figure_names={"figure3": tmp_path / "f.png"})
    first = text.split("\n\n")[2]
    assert first.startswith("At p = 0.1, skipping") and "(uncompressed)" in first
    assert "over the arms" not in first and "(tested at p = 0.1)" in first
    assert "1 of 1 paired comparison has its 95% interval below 0" in first


def test_a_pilot_short_of_its_seeds_reads_as_provisional(tmp_path: Path) -> None:
    pilot = study.load_spec(write_spec(tmp_path, PILOT, name="ep.toml"))
    _tail_fill(pilot, {0: 1.0, 1: 3.0, 2: 0.0}, {0: 1.2, 1: 1.8, 2: 1.0})
    main = study.load_spec(write_spec(tmp_path, GRID.replace(
        'seeds = [0, 1, 2, 3]\n', 'seeds = [0, 1, 2, 3]\nestimand = ["ep.toml"]\n')))
    text = "\n".join(estimand_section(main, {"none": "uncompressed"}))
    assert "Provisional (3 of the pilot's 4 seeds so far): " in text
