"""crucible.analysis: the robustness math shared by the API and the command line."""
from __future__ import annotations

import math
import statistics
import subprocess
import sys

import pytest

from crucible.analysis import (
    relative_degradation,
    robustness,
    robustness_table,
    summarise,
    t_quantile,
)


def _run(run_id, *, p, seed, loss, compression="ssn", strategy="skip", duration=6,
         status="completed"):
    return {"id": run_id, "compression": compression, "strategy": strategy, "p": p,
            "duration": duration, "seed": seed, "status": status, "final_val_loss": loss}


def test_relative_degradation_is_percent_increase_over_baseline():
    assert relative_degradation(2.2, 2.0) == pytest.approx(10.0)
    assert relative_degradation(1.8, 2.0) == pytest.approx(-10.0)


@pytest.mark.parametrize("loss,baseline", [(1.0, 0.0), (1.0, -1.0), (1.0, math.nan),
                                           (math.inf, 1.0)])
def test_relative_degradation_refuses_meaningless_inputs(loss, baseline):
    with pytest.raises(ValueError):
        relative_degradation(loss, baseline)


@pytest.mark.parametrize("df,expected", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622),
                                         (30, 2.0423)])
def test_t_quantile_matches_published_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


def test_t_quantile_approaches_normal_for_large_df():
    normal = statistics.NormalDist().inv_cdf(0.975)
    assert t_quantile(0.975, 100_000) == pytest.approx(normal, abs=1e-4)


def test_summarise_gives_mean_and_t_interval():
    values = [1.0, 2.0, 4.0]
    mean, lo, hi, n = summarise(values)
    half = 4.302652729 * statistics.stdev(values) / math.sqrt(3)
    assert (mean, n) == (pytest.approx(7 / 3), 3)
    assert lo == pytest.approx(7 / 3 - half) and hi == pytest.approx(7 / 3 + half)


def test_summarise_single_value_has_no_interval():
    assert summarise([5.0]) == (5.0, None, None, 1)
    with pytest.raises(ValueError):
        summarise([])


def test_robustness_pairs_by_seed_and_reports_missing_baselines():
    runs = [
        _run("b0", p=0.0, seed=0, loss=2.0),
        _run("b1", p=0.0, seed=1, loss=4.0),
        _run("s0", p=0.1, seed=0, loss=2.2),               # +10 %
        _run("s1", p=0.1, seed=1, loss=4.8),               # +20 %
        _run("d0", p=0.1, seed=0, loss=2.1, strategy="drop"),  # +5 %
        _run("x2", p=0.1, seed=2, loss=3.0),               # seed 2 has no baseline
        _run("pend", p=0.2, seed=0, loss=None, status="running"),
        _run("bad", p=0.2, seed=1, loss=None, status="failed"),
    ]
    out = robustness(runs)
    items = {(i["strategy"], i["p"]): i for i in out["items"]}
    skip = items[("skip", 0.1)]
    assert skip["mean_pct"] == pytest.approx(15.0)
    half = 12.7062047 * statistics.stdev([10.0, 20.0]) / math.sqrt(2)
    assert skip["ci_low_pct"] == pytest.approx(15.0 - half, rel=1e-6)
    assert skip["ci_high_pct"] == pytest.approx(15.0 + half, rel=1e-6)
    assert skip["n_seeds"] == 2 and skip["run_ids"] == ["s0", "s1"]
    drop = items[("drop", 0.1)]
    assert drop["mean_pct"] == pytest.approx(5.0) and drop["ci_low_pct"] is None
    # p = 0 rows start every curve at zero, for each strategy of the arm
    assert items[("skip", 0.0)]["mean_pct"] == 0.0 and items[("skip", 0.0)]["n_seeds"] == 2
    assert items[("drop", 0.0)]["run_ids"] == ["b0", "b1"]
    assert out["missing_baselines"] == [{"compression": "ssn", "seed": 2, "duration": 6}]
    assert out["pending_runs"] == 1 and out["failed_runs"] == 1


def test_robustness_keeps_arms_separate_and_latest_rerun_wins():
    runs = [
        _run("nb", p=0.0, seed=0, loss=2.0, compression="none"),
        _run("sb", p=0.0, seed=0, loss=3.0),
        _run("n1", p=0.5, seed=0, loss=3.0, compression="none"),
        _run("old", p=0.5, seed=0, loss=9.0),
        _run("new", p=0.5, seed=0, loss=3.3),
    ]
    items = {(i["compression"], i["p"]): i for i in robustness(runs)["items"]}
    assert items[("none", 0.5)]["mean_pct"] == pytest.approx(50.0)
    assert items[("ssn", 0.5)]["mean_pct"] == pytest.approx(10.0)
    assert items[("ssn", 0.5)]["run_ids"] == ["new"]


def test_table_has_p_rows_and_arm_columns_with_gaps_as_none():
    runs = [_run("b", p=0.0, seed=0, loss=2.0), _run("s", p=0.1, seed=0, loss=2.5),
            _run("d", p=0.2, seed=0, loss=3.0, strategy="drop")]
    table = robustness_table(robustness(runs)["items"])
    assert table["columns"] == ["ssn/drop", "ssn/skip"]
    assert [row["p"] for row in table["rows"]] == [0.0, 0.1, 0.2]
    assert table["rows"][1]["cells"]["ssn/skip"]["mean_pct"] == pytest.approx(25.0)
    assert table["rows"][1]["cells"]["ssn/drop"] is None
    assert table["rows"][2]["cells"]["ssn/drop"]["mean_pct"] == pytest.approx(50.0)


def test_analysis_imports_no_heavy_modules():
    code = "import sys, crucible.analysis; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
