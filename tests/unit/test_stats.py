"""crucible.stats: the intervals, the one pairing rule and the robustness built on it, shared by
the API, the dashboards, the flows and the study document."""
from __future__ import annotations

import math
import statistics
import subprocess
import sys

import pytest

from crucible.stats import (
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


def test_stats_imports_no_heavy_modules():
    code = "import sys, crucible.stats; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


# --- seeds by precision ----------------------------------------------------------------------

def _item(strategy, p, n, half, mean=1.0):
    return {"compression": "ssn", "strategy": strategy, "duration": 6, "p": p, "n_seeds": n,
            "mean_pct": mean, "ci_low_pct": None if half is None else mean - half,
            "ci_high_pct": None if half is None else mean + half}


def test_seeds_wanted_picks_only_cells_wider_than_the_target_widest_first():
    from crucible.stats import seeds_for_half_width, seeds_wanted

    items = [_item("skip", 0.0, 4, 0.0), _item("skip", 0.1, 4, 0.3),     # narrow: left alone
             _item("drop", 0.1, 4, 2.0), _item("skip", 0.2, 1, None),    # no interval: widest
             _item("drop", 0.2, 3, 0.9)]
    wanted = seeds_wanted(items, target=0.5, max_seeds=40)
    assert [key for key, _ in wanted] == [("ssn", "skip", 0.2, "", 6), ("ssn", "drop", 0.1, "", 6),
                                          ("ssn", "drop", 0.2, "", 6)]
    added = dict(wanted)
    assert added[("ssn", "skip", 0.2, "", 6)] == 1            # one seed: a second gives an sd
    # half 2.0 at n = 4: sd = 2.0 * 2 / t(0.975, 3); the seeds that sd needs for ±0.5, less 4
    sd = 2.0 * 2 / t_quantile(0.975, 3)
    assert added[("ssn", "drop", 0.1, "", 6)] == seeds_for_half_width(sd, 0.5) - 4
    assert seeds_wanted(items, target=0.5, max_seeds=4) == [
        (("ssn", "skip", 0.2, "", 6), 1), (("ssn", "drop", 0.2, "", 6), 1)]   # the budget caps them


def test_seeds_wanted_reads_widths_never_means():
    from crucible.stats import seeds_wanted

    small = [_item("skip", 0.1, 4, 2.0, mean=0.01)]
    large = [_item("skip", 0.1, 4, 2.0, mean=25.0)]
    assert seeds_wanted(small, target=0.5, max_seeds=99) == seeds_wanted(
        large, target=0.5, max_seeds=99)


def test_a_precision_round_adds_the_lowest_free_seeds_and_their_baselines():
    from crucible.grid.cells import extra_cells
    from crucible.grid.spec import SweepSpec

    spec = SweepSpec(preset="smoke", arms=["ssn"], strategies=["skip", "drop"],
                     failure_probabilities=[0.1], seeds=[0, 1], max_seeds=6)
    runs = [{"compression": "ssn", "strategy": s, "p": p, "seed": seed}
            for seed in (0, 1) for s, p in (("skip", 0.0), ("skip", 0.1), ("drop", 0.1))]
    runs.append({"compression": "ssn", "strategy": "drop", "p": 0.1, "seed": 5})
    cells = extra_cells(spec, [(("ssn", "drop", 0.1, "", 6), 1)], runs)
    labels = [c.label for c in cells]
    # seeds 0, 1 and 5 have runs: one more is the lowest free one, with its baseline; the skip
    # cell is not asked for and gets none
    assert labels == ["ssn/baseline/p=0/seed=2", "ssn/drop/p=0.1/seed=2"]
    more = extra_cells(spec, [(("ssn", "drop", 0.1, "", 6), 3), (("ssn", "skip", 0.1, "", 6), 1)], runs)
    assert [c.label for c in more] == [
        "ssn/baseline/p=0/seed=2", "ssn/baseline/p=0/seed=3", "ssn/baseline/p=0/seed=4",
        "ssn/drop/p=0.1/seed=2",
        "ssn/drop/p=0.1/seed=3", "ssn/drop/p=0.1/seed=4", "ssn/skip/p=0.1/seed=2"]
    assert extra_cells(spec, [], runs) == []


def test_a_precision_round_gives_a_labelled_cell_its_blocks_overrides():
    from crucible.grid.cells import extra_cells
    from crucible.grid.spec import SweepSpec

    spec = SweepSpec(preset="smoke", seeds=[0], max_seeds=4, grid=[
        {"arms": ["mapl"], "strategies": ["skip"], "p": [0.2]},
        {"arms": ["mapl"], "strategies": ["skip"], "p": [0.2], "label": "decode_sender",
         "set": ["pipeline.bypass_decode=sender"]}])
    runs = [{"compression": "mapl", "strategy": "skip", "p": p, "seed": 0, "label": label}
            for p, label in ((0.0, ""), (0.2, ""), (0.2, "decode_sender"))]
    [base, cell] = extra_cells(spec, [(("mapl", "skip", 0.2, "decode_sender", 6), 1)], runs)
    assert base.id == "mapl-base-s1" and cell.id == "mapl-skip-p0.2-decode_sender-s1"
    assert "pipeline.bypass_decode=sender" in cell.overrides(spec)


def test_claims_hold_each_comparison_against_the_references_given():
    from crucible.stats import BLOG_REFERENCES, BLOG_SKIP, CellKey, evaluate_claims, paired_stat

    cells = {CellKey(arm, strategy, p): {s: base + 0.1 * s for s in range(3)}
             for arm, base in (("ssn", 0.4), ("mapl", 0.9), ("none", 0.7))
             for strategy, p, base in (("skip", 0.1, base), ("skip", 0.2, base + 0.5),
                                       ("drop", 0.1, base + 3), ("skip", 0.01, base / 4))}
    blog = {claim.tag: claim for claim in evaluate_claims(cells)}
    assert evaluate_claims(cells, references=BLOG_REFERENCES)[2].comparisons == \
        blog["c"].comparisons                         # the default is the blog's, the same values
    assert [c.reference for c in blog["c"].comparisons] == [
        round(BLOG_SKIP[("ssn", p)] - BLOG_SKIP[(other, p)], 6)
        for p in (0.1, 0.2) for other in ("mapl", "none")]
    assert all(c.reference is None for c in blog["a"].comparisons + blog["e"].comparisons)
    refs = {("ssn", "skip", 0.1): 1.0, ("ssn", "drop", 0.1): 4.0, ("mapl", "skip", 0.1): 0.25,
            ("ssn", "skip", 0.01): 0.125}
    own = {claim.tag: claim for claim in evaluate_claims(cells, references=refs)}
    by_label = {c.label: c for claim in own.values() for c in claim.comparisons}
    assert by_label["SSN, p = 0.1"].reference == -3.0                   # (a): skip - drop
    assert by_label["SSN - MAPL, p = 0.1"].reference == 0.75            # (c)
    assert by_label["SSN - uncompressed, p = 0.1"].reference is None    # no reference for none
    assert by_label["SSN, skip, p = 0.01"].reference == 0.125           # (e)
    assert by_label["SSN, skip"].reference is None    # (b): the references lack p = 0.01, 0.2
    # the references change what the claims are held against, never the intervals or verdicts
    assert by_label["SSN - MAPL, p = 0.1"].stat == paired_stat(
        cells[CellKey("ssn", "skip", 0.1)], cells[CellKey("mapl", "skip", 0.1)])
    assert {t: c.verdict for t, c in own.items()} == {t: c.verdict for t, c in blog.items()}
    assert "the spec's references" in own["c"].blog and "+0.25%" in own["c"].blog
    assert [c.tag for c in evaluate_claims(cells, only=["e", "a"])] == ["a", "e"]


def test_a_slope_reference_needs_a_value_at_every_p_of_the_grid():
    from crucible.stats import CellKey, evaluate_claims

    cells = {CellKey("none", "skip", p): {s: 10 * p + 0.1 * s for s in range(3)}
             for p in (0.1, 0.2, 0.3)}
    refs = {("none", "skip", 0.1): 1.0, ("none", "skip", 0.2): 1.5, ("none", "skip", 0.3): 2.0}
    [b] = evaluate_claims(cells, references=refs, only=["b"])
    assert b.comparisons[0].reference == pytest.approx(0.5)           # per 0.1 of p
    del refs[("none", "skip", 0.3)]
    [b] = evaluate_claims(cells, references=refs, only=["b"])
    assert b.comparisons[0].reference is None
