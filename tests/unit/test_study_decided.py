"""The decided study's instrument: seeds from an sd (crucible.stats), the equivalence claim
at p = 0.01, per-block seeds, the pilot table, and results that carry no machine paths and
compare corpora by content. On result files the tests write themselves."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from crucible import stats, study
from crucible.grid.cells import expand_cells
from crucible.grid.key import CellKey
from crucible.grid.names import ARM_LABEL, ARMS
from crucible.grid.spec import SweepSpec
from crucible.stats import t_quantile
from crucible.study.document import _missing_count
from tests.unit.test_study import fake_summary, fill, write_spec

LOW_P_GRID = """
name = "t"
preset = "smoke"
seeds = [0, 1, 2]

[[grid]]
arms = ["none", "ssn", "mapl"]
strategies = ["skip", "drop"]
p = [0, 0.01, 0.1, 0.2]
"""


# ---------------------------------------------------------------------------------------------
# seeds from an sd
# ---------------------------------------------------------------------------------------------

def test_seeds_for_half_width_is_the_smallest_n_that_meets_it() -> None:
    # sd 1, target 0.5: n = 18 gives t(0.975, 17) / sqrt(18) = 2.1098 / 4.2426 = 0.497,
    # n = 17 gives 2.1199 / 4.1231 = 0.514 (t-table values)
    assert stats.seeds_for_half_width(1.0, 0.5) == 18
    assert stats.half_width(1.0, 18) <= 0.5 < stats.half_width(1.0, 17)
    for sd in (0.3, 0.8, 1.1, 2.5):
        n = stats.seeds_for_half_width(sd, 0.5)
        assert n is not None and n >= 2
        assert t_quantile(0.975, n - 1) * sd / math.sqrt(n) <= 0.5
        if n > 2:
            assert t_quantile(0.975, n - 2) * sd / math.sqrt(n - 1) > 0.5
    assert stats.seeds_for_half_width(1.0, 0.5, at_least=30) == 30
    assert stats.seeds_for_half_width(50.0, 0.5) is None          # over MAX_SEEDS
    assert stats.seeds_for_half_width(1.0, 0.0) is None


def test_seeds_to_decide_sign_and_band() -> None:
    # a sign rule needs the half-width below |mean|; a band rule below the distance to the edge
    assert stats.seeds_to_decide(1.0, 1.0) == stats.seeds_for_half_width(1.0, 1.0)
    assert stats.seeds_to_decide(0.2, 1.0, margin=0.5) == \
        stats.seeds_for_half_width(1.0, 0.3)
    assert stats.seeds_to_decide(0.9, 1.0, margin=0.5) == \
        stats.seeds_for_half_width(1.0, 0.4)
    assert stats.seeds_to_decide(0.5, 1.0, margin=0.5) is None     # on the edge: never
    assert stats.seeds_to_decide(0.0, 1.0) is None


# ---------------------------------------------------------------------------------------------
# claim (e): the equivalence test at p = 0.01
# ---------------------------------------------------------------------------------------------

def _claims(spec: SweepSpec, degradations: dict[str, list[float]]) -> dict[str, stats.Claim]:
    fill(spec, degradations)
    data = study.StudyData(spec, study.load_results(spec))
    return {c.tag: c for c in data.claims()}


def test_claim_e_agrees_inside_the_band(tmp_path: Path) -> None:
    spec = study.load_spec(write_spec(tmp_path, LOW_P_GRID))
    claims = _claims(spec, {f"{a}-skip-p0.01": [0.05, 0.10, 0.15] for a in ARMS})
    e = claims["e"]
    assert len(e.comparisons) == 3 and e.verdict == stats.AGREES
    assert e.seeds_to_decide() is None


def test_claim_e_disagrees_outside_and_is_open_across_the_edge(tmp_path: Path) -> None:
    spec = study.load_spec(write_spec(tmp_path, LOW_P_GRID))
    far = _claims(spec, {"none-skip-p0.01": [1.5, 1.6, 1.7],
                         "ssn-skip-p0.01": [0.1, 0.1, 0.2], "mapl-skip-p0.01": [0.0, 0.1, 0.1]})
    assert far["e"].verdict == stats.DISAGREES
    spec2 = study.load_spec(write_spec(tmp_path / "b", LOW_P_GRID))
    astride = _claims(spec2, {f"{a}-skip-p0.01": [0.0, 0.6, 0.3] for a in ARMS})
    e = astride["e"]
    assert e.verdict == stats.NOT_RESOLVED
    # mean 0.3, sd 0.3: deciding "inside +-0.5" needs a half-width below 0.2
    need, beyond = e.seeds_to_decide()
    assert need == stats.seeds_for_half_width(0.3, 0.2) and beyond == 0
    assert f"| {need} |" in study.render_markdown(study.StudyData(spec2,
                                                                  study.load_results(spec2)))


def test_claim_e_is_not_run_when_the_grid_lacks_p_001(spec: SweepSpec) -> None:
    fill(spec, {"ssn-skip-p0.1": [0.1, 0.2, 0.3]})
    data = study.StudyData(spec, study.load_results(spec))
    e = {c.tag: c for c in data.claims()}["e"]
    assert e.comparisons == () and e.verdict == stats.NOT_RUN
    assert "p = 0.01 is not in this grid" in study.render_markdown(data)


@pytest.fixture
def spec(tmp_path: Path) -> SweepSpec:
    return study.load_spec(write_spec(tmp_path))


# ---------------------------------------------------------------------------------------------
# seeds per block
# ---------------------------------------------------------------------------------------------

BLOCK_SEEDS = """
name = "t"
preset = "smoke"
seeds = [0, 1]

[[grid]]
arms = ["none", "ssn"]
strategies = ["skip"]
p = [0.2]

[[grid]]
arms = ["ssn"]
strategies = ["drop"]
p = [0.2]
seeds = [0, 1, 2, 3]
"""


def test_a_block_may_run_more_seeds_and_its_arm_gets_their_baselines(tmp_path: Path) -> None:
    spec = study.load_spec(write_spec(tmp_path, BLOCK_SEEDS))
    ids = [c.id for c in expand_cells(spec)]
    assert spec.all_seeds == (0, 1, 2, 3)
    assert "ssn-drop-p0.2-s3" in ids and "ssn-base-s3" in ids
    assert "ssn-skip-p0.2-s3" not in ids                  # the skip block keeps the spec's seeds
    assert "none-base-s2" not in ids                      # no block of `none` runs seed 2
    assert len(ids) == len(set(ids)) == 2 * 2 + 2 * 2 + 4 + 2   # baselines, skip, drop
    only = [c.id for c in expand_cells(spec, [3])]
    assert sorted(only) == ["ssn-base-s3", "ssn-drop-p0.2-s3"]


def test_bad_block_seeds_name_the_field(tmp_path: Path) -> None:
    path = write_spec(tmp_path, BLOCK_SEEDS.replace("seeds = [0, 1, 2, 3]", "seeds = [1, 1]"))
    with pytest.raises(study.StudyError, match=r"grid\[1\]\.seeds: lists a seed twice"):
        study.load_spec(path)


# ---------------------------------------------------------------------------------------------
# the pilot table
# ---------------------------------------------------------------------------------------------

PILOT = """
name = "pilot-x"
preset = "smoke"
seeds = [0, 1, 2, 3]
set = ["train.lr=0.002"]
title = "Pilot x"

[[grid]]
arms = ["none", "ssn"]
strategies = ["skip"]
p = [0.2]
"""


def test_pilot_rows_measure_sd_seeds_and_grid_cost(tmp_path: Path) -> None:
    pilot = study.load_spec(write_spec(tmp_path, PILOT, name="pilot-x.toml"))
    # none: degradations 1, 2, 3, 4 (sd 1.29); ssn: 0, 0, 0, 0 (sd 0)
    fill(pilot, {"none-skip-p0.2": [1.0, 2.0, 3.0, 4.0], "ssn-skip-p0.2": [0.0] * 4})
    main = study.load_spec(write_spec(tmp_path, LOW_P_GRID.replace(
        'seeds = [0, 1, 2]', 'seeds = [0, 1, 2]\npilots = ["pilot-x.toml"]'), name="main.toml"))
    from crucible.study.pilot import MIN_GRID_SEEDS, pilot_rows

    rows = {r.arm: r for r in pilot_rows(main)}
    assert set(rows) == {"none", "ssn"}
    none = rows["none"]
    assert none.seeds == 4 and none.skip_mean == pytest.approx(2.5)
    assert none.paired_sd == pytest.approx(math.sqrt(5 / 3))
    assert none.seeds_needed == stats.seeds_for_half_width(math.sqrt(5 / 3), 0.5)
    assert none.dims == 64 and rows["ssn"].dims == 8
    assert rows["ssn"].seeds_needed == MIN_GRID_SEEDS
    # the main grid has 6 failure cells per arm (skip, drop x 3 p > 0) plus one baseline
    assert none.grid_runs == none.seeds_needed * 7
    assert none.grid_cpu_h == pytest.approx(none.grid_runs * 60.0 / 3600)
    text = study.render_markdown(study.StudyData(main, study.load_results(main)))
    assert "## How the preset was chosen" in text and "`pilot-x`" in text


def test_a_missing_pilot_is_a_spec_error(tmp_path: Path) -> None:
    path = write_spec(tmp_path, LOW_P_GRID.replace('seeds = [0, 1, 2]',
                                                   'seeds = [0, 1, 2]\npilots = ["nope.toml"]'))
    with pytest.raises(study.StudyError, match="pilots.*'nope.toml' is not another study spec"):
        study.load_spec(path)


# ---------------------------------------------------------------------------------------------
# configurations: corpora by content, no machine paths
# ---------------------------------------------------------------------------------------------

def test_portable_drops_machine_paths(tmp_path: Path) -> None:
    from crucible.data import load_tokens, token_digest

    default = token_digest(load_tokens(None, vocab_size=256))
    summary = {"store_url": "file:///home/someone/run/store", "data_digest": default,
               "config": {"model": {"vocab_size": 256},
                          "data": {"path": "/somewhere/shakespeare.txt", "val_fraction": 0.05}}}
    kept = study.portable(summary)
    assert "store_url" not in kept and kept["config"]["data"]["path"] is None
    other = dict(summary, data_digest="sha256:" + "0" * 64)
    assert study.portable(other)["config"]["data"]["path"] == "shakespeare.txt"
    assert summary["config"]["data"]["path"] == "/somewhere/shakespeare.txt"   # not mutated


def test_token_digest_is_by_content_not_path(tmp_path: Path) -> None:
    from crucible.data import load_tokens, token_digest

    a, b = tmp_path / "a.txt", tmp_path / "sub" / "b.txt"
    b.parent.mkdir()
    a.write_text("to be or not to be")
    b.write_text("to be or not to be")
    assert token_digest(load_tokens(str(a), vocab_size=256)) == \
        token_digest(load_tokens(str(b), vocab_size=256))
    b.write_text("to be or not to bee")
    assert token_digest(load_tokens(str(a), vocab_size=256)) != \
        token_digest(load_tokens(str(b), vocab_size=256))


def _rewrite(spec: SweepSpec, fn) -> None:
    for path in spec.results_dir.glob("*.json"):
        summary = json.loads(path.read_text())
        fn(path.stem, summary)
        path.write_text(json.dumps(summary))


def test_a_corpus_path_alone_is_not_another_configuration(spec: SweepSpec) -> None:
    fill(spec, {"ssn-skip-p0.1": [0.1, 0.2, 0.3]})

    def elsewhere(stem: str, summary: dict) -> None:
        if stem.endswith("s0"):
            summary["config"]["data"]["path"] = "/other/machine/shakespeare.txt"
        summary["data_digest"] = "sha256:" + "a" * 64

    _rewrite(spec, elsewhere)
    text = study.render_markdown(study.StudyData(spec, study.load_results(spec)))
    assert "different configurations" not in text and "different corpora" not in text
    assert "Corpus: `sha256:aaaaaaaaaaaa...`" in text

    def other_corpus(stem: str, summary: dict) -> None:
        if stem.endswith("s1"):
            summary["data_digest"] = "sha256:" + "b" * 64

    _rewrite(spec, other_corpus)
    text = study.render_markdown(study.StudyData(spec, study.load_results(spec)))
    assert "trained on 2 different corpora" in text


def test_a_presets_name_alone_is_not_another_configuration(spec: SweepSpec) -> None:
    """A pilot's runs written as `study` with `model.d_model=128` and a grid's written as
    `study-d128` are one configuration when their settings are equal; a setting that differs
    is another."""
    fill(spec, {"ssn-skip-p0.1": [0.1, 0.2, 0.3]})

    def renamed(stem: str, summary: dict) -> None:
        if stem.endswith("s0"):
            summary["config"]["preset"] = "another-name"

    _rewrite(spec, renamed)
    text = study.render_markdown(study.StudyData(spec, study.load_results(spec)))
    assert "different configurations" not in text

    def other_lr(stem: str, summary: dict) -> None:
        if stem.endswith("s1"):
            summary["config"]["train"]["lr"] = 0.123

    _rewrite(spec, other_lr)
    text = study.render_markdown(study.StudyData(spec, study.load_results(spec)))
    assert "the results come from 2 different configurations" in text


def test_kept_results_are_portable(spec: SweepSpec) -> None:
    cell = expand_cells(spec)[0]
    summary = fake_summary(cell, 2.0, spec=spec)
    summary["store_url"] = "file:///tmp/x/store"
    path = study.keep_result(spec, cell, summary, jobs=2)
    assert "store_url" not in json.loads(path.read_text())


def test_committed_results_hold_no_machine_paths() -> None:
    root = Path(__file__).resolve().parents[2] / "results"
    for path in sorted(root.glob("*/*.json")):
        text = path.read_text()
        assert '"store_url"' not in text, path
        config = json.loads(text)["config"]
        assert config["data"]["path"] is None or "/" not in config["data"]["path"], path


# ---------------------------------------------------------------------------------------------
# the alignment hypothesis on a study's data
# ---------------------------------------------------------------------------------------------

ALIGN_GRID = """
name = "t"
preset = "smoke"
seeds = [0, 1, 2, 3, 4, 5, 6, 7]

[[grid]]
arms = ["none", "ssn"]
strategies = ["skip"]
p = [0.1, 0.2]
"""


def test_fisher_interval_of_a_known_correlation() -> None:
    from crucible.study.alignment import correlation

    xs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    ys = [1.2, 1.9, 3.4, 3.8, 5.3, 5.7, 7.4, 7.9, 9.6, 9.8]
    c = correlation(xs, ys)
    z, se = math.atanh(c.r), 1 / math.sqrt(len(xs) - 3)
    assert c.r > 0.99
    assert c.lo == pytest.approx(math.tanh(z - 1.959963984540054 * se))
    assert c.hi == pytest.approx(math.tanh(z + 1.959963984540054 * se))
    assert correlation([1.0, 2.0], [2.0, 1.0]).lo is None
    assert correlation([1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]).r is None


def _aligned(tmp_path: Path, damage_of) -> study.StudyData:
    spec = study.load_spec(write_spec(tmp_path, ALIGN_GRID))
    degr = {"none": [0.2 * i for i in range(8)], "ssn": [1.0 + 0.3 * i for i in range(8)]}
    fill(spec, {f"{a}-skip-p0.2": v for a, v in degr.items()}
         | {f"{a}-skip-p0.1": v for a, v in degr.items()})

    def add(stem: str, summary: dict) -> None:
        arm, kind = stem.split("-")[:2]
        if kind == "base":
            seed = int(stem.rsplit("-s", 1)[1])
            d = damage_of(arm, seed, degr[arm][seed])
            summary["alignment"] = {"windows": 8, "tokens": 128, "stages": [
                {"stage": 1, "cka": 1.0 - d / 100, "update_ratio": 0.3, "bypass_damage_pct": d},
                {"stage": 2, "cka": 1.0 - d / 100, "update_ratio": 0.3, "bypass_damage_pct": d}]}

    _rewrite(spec, add)
    return study.StudyData(spec, study.load_results(spec))


def test_alignment_that_tracks_degradation_within_arms_predicts(tmp_path: Path) -> None:
    from crucible.study.alignment import alignment_points, alignment_section

    wobble = [0.03, -0.02, 0.01, -0.04, 0.02, 0.0, -0.01, 0.03]
    data = _aligned(tmp_path, lambda arm, seed, d: 2.0 * d + wobble[seed]
                    + (5.0 if arm == "ssn" else 0.0))
    points = alignment_points(data)
    assert len(points) == 16 and {pt.arm for pt in points} == {"none", "ssn"}
    text = "\n".join(alignment_section(data, ARM_LABEL, "img/a.png"))
    assert "| instant bypass damage (%) | + |" in text
    row = next(line for line in text.splitlines() if line.startswith("| instant bypass"))
    assert row.endswith("| predicts |")
    cka = next(line for line in text.splitlines() if line.startswith("| CKA"))
    assert cka.endswith("| predicts |")                  # higher CKA, less damage: sign -
    assert "Verdict: within arms, " in text and "![Alignment" in text
    assert "## Beyond the blog: does alignment" in study.render_markdown(data)


def test_alignment_that_only_differs_between_arms_is_not_a_within_arm_prediction(
        tmp_path: Path) -> None:
    from crucible.study.alignment import alignment_section

    noise = [0.5, -0.3, 0.1, 0.4, -0.5, 0.2, -0.1, -0.3]
    data = _aligned(tmp_path, lambda arm, seed, d: (10.0 if arm == "ssn" else 1.0)
                    + noise[(seed * 3) % 8])
    text = "\n".join(alignment_section(data, ARM_LABEL, None))
    row = next(line for line in text.splitlines() if line.startswith("| instant bypass"))
    pooled = row.split("|")[3]
    assert float(pooled.split("[")[0]) > 0.5              # pooled: the arms alone correlate
    assert row.endswith("| not resolved |")
    assert "Verdict: not resolved" in text


# ---------------------------------------------------------------------------------------------
# the token check and the scale trend
# ---------------------------------------------------------------------------------------------

HALF = """
name = "half"
preset = "smoke"
seeds = [0, 1]
set = ["train.global_steps=5"]

[[grid]]
arms = ["none"]
strategies = ["skip"]
p = [0]
"""


def test_token_check_compares_half_the_tokens_with_the_seed_spread(tmp_path: Path) -> None:
    full = study.load_spec(write_spec(tmp_path, PILOT, name="pilot-x.toml"))
    fill(full, {"none-skip-p0.2": [1.0, 2.0, 3.0, 4.0]}, base=2.0)
    _rewrite(full, lambda stem, s: s.update(final_val_loss=2.0 + 0.01 * int(stem[-1]))
             if "base" in stem else None)
    half = study.load_spec(write_spec(tmp_path, HALF, name="half.toml"))
    fill(half, {"none-skip-p0.2": []}, base=2.3)
    main = study.load_spec(write_spec(tmp_path, LOW_P_GRID.replace(
        'seeds = [0, 1, 2]', 'seeds = [0, 1, 2]\ntoken_check = ["half.toml", "pilot-x.toml"]'),
        name="main.toml"))
    from crucible.study.pilot import token_rows, token_section

    (row,) = token_rows(main)
    assert row["arm"] == "none" and row["seeds"] == [0, 1]
    assert row["change_pct"] == pytest.approx([15.0, 100 * (2.3 - 2.01) / 2.01])
    text = "\n".join(token_section(main, ARM_LABEL))
    assert "token-limited: every seed's loss rose by more than three seed sds" in text


def test_welch_interval_and_the_scale_verdict(tmp_path: Path) -> None:
    from crucible.study.scale import scale_section, welch

    a = stats.stat_of({0: 1.0, 1: 2.0, 2: 3.0})
    b = stats.stat_of({0: 5.0, 1: 7.0, 2: 9.0, 3: 11.0})
    diff, lo, hi = welch(b, a)
    va, vb = 1.0 / 3, (20 / 3) / 4
    dof = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    half = t_quantile(0.975, math.floor(dof)) * math.sqrt(va + vb)
    assert diff == pytest.approx(6.0) and (lo, hi) == pytest.approx((6 - half, 6 + half))
    assert welch(stats.stat_of({0: 1.0}), a) is None

    big = study.load_spec(write_spec(tmp_path, PILOT.replace('name = "pilot-x"',
                                                             'name = "big"'), name="big.toml"))
    fill(big, {"none-skip-p0.2": [0.1, 0.2, 0.1, 0.2], "ssn-skip-p0.2": [3.0, 3.2, 3.1, 3.3]})
    main = study.load_spec(write_spec(tmp_path, LOW_P_GRID.replace(
        'seeds = [0, 1, 2]', 'seeds = [0, 1, 2]\nscale = ["big.toml"]'), name="main.toml"))
    fill(main, {"none-skip-p0.2": [2.0, 2.1, 2.2], "ssn-skip-p0.2": [0.5, 0.6, 0.4]})
    text = "\n".join(scale_section(study.StudyData(main, study.load_results(main)),
                                   ARM_LABEL))
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and "p = 0.2" in line}
    assert rows["uncompressed skip, p = 0.2"].endswith("| lower at the larger model |")
    assert rows["SSN skip, p = 0.2"].endswith("| higher at the larger model |")
    assert "(n=3)" in rows["uncompressed skip, p = 0.2"]
    # what the larger spec sets that this study does not, and how many verdicts chance gives
    assert "`big` differs from this study's settings by `train.lr=0.002`." in text
    assert "2 comparisons, each with its own 95% interval" in text and "about 0.1 of" in text
    # the larger model's seeds: whole ones by arithmetic, a begun one apart with what it has
    from cli.study import here_arithmetic
    here = here_arithmetic()
    assert f"`big`'s whole seeds: 0-3 (`{here}`)." in text
    for stem in ("none-base-s2", "ssn-base-s2", "none-skip-p0.2-s2",
                 "none-base-s3", "ssn-base-s3", "none-skip-p0.2-s3", "ssn-skip-p0.2-s3"):
        path = big.results_dir / f"{stem}.json"
        result = json.loads(path.read_text())
        result["study"]["arithmetic"] = "sha256:00000000000000aa"
        path.write_text(json.dumps(result))
    (big.results_dir / "ssn-skip-p0.2-s2.json").unlink()
    text = "\n".join(scale_section(study.StudyData(main, study.load_results(main)),
                                   ARM_LABEL))
    assert (f"`big`'s whole seeds: 0, 1 (`{here}`); 3 (`sha256:00000000000000aa`); begun, not "
            "whole: 2 (3 of 4 cells, `sha256:00000000000000aa`)." in text)
    # a seed whose cells are not twins is not whole, however many it has
    path = big.results_dir / "ssn-base-s0.json"
    result = json.loads(path.read_text())
    result["study"]["arithmetic"] = "sha256:00000000000000bb"
    path.write_text(json.dumps(result))
    text = "\n".join(scale_section(study.StudyData(main, study.load_results(main)),
                                   ARM_LABEL))
    both = ", ".join(f"`{d}`" for d in sorted([here, "sha256:00000000000000bb"]))
    assert (f"whole seeds: 1 (`{here}`); 3 (`sha256:00000000000000aa`); begun, not whole: 0 (4 "
            f"of 4 cells, not of one arithmetic: {both}); 2 (3 of 4" in text)
    # with nothing of the larger model run, no verdict is counted
    for path in big.results_dir.glob("*.json"):
        path.unlink()
    text = "\n".join(scale_section(study.StudyData(main, study.load_results(main)),
                                   ARM_LABEL))
    assert "not run yet" in text and "comparisons" not in text
    assert "`big`'s whole seeds: none yet." in text
    # one seed of a size: its count is said once
    from crucible.study.scale import _pct
    assert _pct(stats.stat_of({0: 0.36})) == "+0.36% (n=1, no interval)"


PROCESSES = """
name = "procs"
preset = "smoke"
seeds = [0, 1, 2]

[[grid]]
arms = ["none"]
strategies = ["skip", "drop"]
p = [0, 0.1]

[[grid]]
arms = ["none"]
strategies = ["skip", "drop"]
p = [0.1]
label = "burst"
set = ["faults.process=correlated"]
"""


def test_the_process_verdict_pairs_each_strategy_with_its_own_process_skip(
        tmp_path: Path) -> None:
    from crucible.study.processes import process_rows, processes_section

    procs = study.load_spec(write_spec(tmp_path, PROCESSES, name="procs.toml"))
    # independent: drop 4 points above skip; burst: drop level with the burst's own skip, both
    # 3 points above the independent skip (paired with that, it would read "higher")
    fill(procs, {"none-skip-p0.1": [0.0, 0.1, 0.2], "none-drop-p0.1": [4.0, 4.2, 4.1],
                 "none-skip-p0.1-burst": [3.0, 3.1, 3.2],
                 "none-drop-p0.1-burst": [3.0, 3.3, 3.1]})
    main = study.load_spec(write_spec(tmp_path, LOW_P_GRID.replace(
        'seeds = [0, 1, 2]', 'seeds = [0, 1, 2]\nprocesses = ["procs.toml"]'), name="main.toml"))
    data = study.StudyData(main, study.load_results(main))
    rows = {(r["process"], r["key"].strategy): r for r in process_rows(data)}
    assert set(rows) == {("independent", "drop"), ("burst", "drop")}
    assert rows["independent", "drop"]["diff"].mean == pytest.approx(4.0, abs=1e-6)
    assert rows["burst", "drop"]["diff"].mean == pytest.approx(0.0333333, abs=1e-4)
    assert rows["independent", "drop"]["reads"] == "drop ends higher than skip"
    assert rows["burst", "drop"]["reads"] == "not resolved"
    text = "\n".join(processes_section(data, ARM_LABEL))
    assert "- Drop against skip: drop ends higher than skip under independent; not resolved " \
           "under burst." in text


# ---------------------------------------------------------------------------------------------
# reusing identical runs
# ---------------------------------------------------------------------------------------------

def test_identical_runs_of_a_reuse_spec_are_adopted_not_rerun(tmp_path: Path) -> None:
    source = study.load_spec(write_spec(tmp_path, PILOT.replace(
        'arms = ["none", "ssn"]', 'arms = ["none", "mapl"]'), name="pilot-x.toml"))
    fill(source, {"none-skip-p0.2": [1.0, 2.0, 3.0, 4.0], "mapl-skip-p0.2": [0.5] * 4})

    def relabel(stem: str, summary: dict) -> None:
        summary["config"]["preset"] = "another-name-same-values"
        if stem.startswith("none"):     # only MAPL reads the decode: no difference for `none`
            summary["config"]["pipeline"]["bypass_decode"] = "receiver"
        if stem == "mapl-skip-p0.2-s1":
            summary["config"]["pipeline"]["bypass_decode"] = "receiver"   # another computation
        if stem == "none-skip-p0.2-s2":
            summary["config"]["train"]["lr"] = 0.003                      # another computation

    _rewrite(source, relabel)
    main = study.load_spec(write_spec(tmp_path, """
        name = "main"
        preset = "smoke"
        seeds = [0, 1, 2, 3]
        set = ["train.lr=0.002"]
        reuse = ["pilot-x.toml"]

        [[grid]]
        arms = ["none", "mapl"]
        strategies = ["skip"]
        p = [0.2]
        """, name="main.toml"))
    from typer.testing import CliRunner

    from tests.unit.test_study import cli_app

    planned = CliRunner().invoke(cli_app(), ["study", "run", str(main.path), "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert "14 cells taken from identical runs of pilot-x" in planned.output
    to_run = sorted(line.split(":")[0].strip() for line in planned.output.splitlines()
                    if line.startswith("  "))
    assert to_run == ["mapl-skip-p0.2-s1", "none-skip-p0.2-s2"]
    assert not list(main.results_dir.glob("*.json"))         # a dry run writes nothing
    study.adopt_results(main, expand_cells(main))
    done, todo = study.completed_cells(main, expand_cells(main))
    assert len(done) == 16 - 2 and sorted(c.id for c in todo) == to_run
    kept = json.loads((main.results_dir / "none-skip-p0.2-s0.json").read_text())
    assert kept["study"]["reused_from"] == "pilot-x" and kept["study"]["spec"] == "main"
    assert kept["final_val_loss"] == json.loads(
        (source.results_dir / "none-skip-p0.2-s0.json").read_text())["final_val_loss"]


def test_extra_block_seeds_run_after_the_whole_grid_of_the_spec_seeds(tmp_path: Path) -> None:
    spec = study.load_spec(write_spec(tmp_path, BLOCK_SEEDS))
    ids = [c.id for c in expand_cells(spec)]
    first_extra = min(ids.index(i) for i in ids if i.endswith(("-s2", "-s3")))
    assert all(not i.endswith(("-s2", "-s3")) for i in ids[:first_extra])
    assert first_extra == 2 * 2 + 2 * 2 + 2          # every cell of seeds 0 and 1 first
    assert ids[first_extra:] == ["ssn-base-s2", "ssn-base-s3", "ssn-drop-p0.2-s2",
                                 "ssn-drop-p0.2-s3"]


def test_the_decided_grid_runs_the_seeds_its_pilot_asks_for() -> None:
    """Each arm's seeds in studies/table1-d128.toml are the committed pilot's "seeds for
    ±0.5" (at least 8): numbers in the spec come from the data. The uncompressed and SSN skip
    and drop blocks run more (issue 34: seeds added on width for claims (a), (b), (c) and (e),
    the document's price table): at least the pilot's count, and the same seeds in both, so
    every comparison between the two arms pairs on every seed."""
    from crucible.study.pilot import pilot_rows

    repo = Path(__file__).resolve().parents[2]
    spec = study.load_spec(repo / "studies" / "table1-d128.toml")
    (chosen,) = [p for p in spec.files.pilots if p in spec.files.reuse]      # the preset's own pilot
    rows = {r.arm: r for r in pilot_rows(spec) if r.pilot == study.load_spec(chosen).name}
    ssn = next(b for b in spec.blocks if b.arms == ["ssn"] and "skip" in b.strategies)
    for block in spec.blocks:
        for arm in block.arms:
            if arm in ("none", "ssn") and block.strategies == ["skip", "drop"]:
                assert block.seeds == ssn.seeds, block
                assert len(block.seeds or spec.seeds) >= rows[arm].seeds_needed, (block, arm)
                continue
            assert len(block.seeds or spec.seeds) == rows[arm].seeds_needed, (block, arm)


def test_adopt_command_copies_identical_runs_and_runs_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tests.unit.test_study import cli_app

    source = study.load_spec(write_spec(tmp_path, PILOT, name="pilot-x.toml"))
    fill(source, {"none-skip-p0.2": [1.0, 2.0, 3.0, 4.0]})
    main = write_spec(tmp_path, PILOT.replace('name = "pilot-x"', 'name = "main"').replace(
        'title = "Pilot x"', 'title = "Main"\nreuse = ["pilot-x.toml"]'), name="main.toml")
    result = CliRunner().invoke(cli_app(), ["study", "adopt", str(main)])
    assert result.exit_code == 0, result.output
    assert "8 cells taken from identical runs of pilot-x" in result.output
    spec = study.load_spec(main)
    assert len(list(spec.results_dir.glob("*.json"))) == 8      # none: 4 baselines, 4 skip
    again = CliRunner().invoke(cli_app(), ["study", "adopt", str(main)])
    assert "0 cells taken" in again.output
    bad = CliRunner().invoke(cli_app(), ["study", "adopt", str(tmp_path / "nope.toml")])
    assert bad.exit_code == 2 and "not found" in bad.output


def test_token_digest_of_the_splits_is_the_digest_of_the_stream(tmp_path: Path) -> None:
    from crucible.data import TokenData, load_tokens, token_digest
    from crucible.presets import get_preset

    config = get_preset("smoke")
    tokens = load_tokens(None, vocab_size=256)
    data = TokenData(tokens, model=config.model, data=config.data, replicas=1, seed=0)
    assert token_digest(data.train.numpy(), data.val.numpy()) == token_digest(tokens)


def test_a_result_records_this_machines_cpu_identity() -> None:
    """`study.cpu` beside the arithmetic digest: vendor, family, model, name and torch's kernel
    path (what the machine is called; `study.arithmetic` is what it computes)."""
    from crucible.study.runner import cpu_identity

    here = cpu_identity()
    assert here["kernels"] == torch.backends.cpu.get_cpu_capability()
    assert set(here) == {"vendor", "family", "model", "name", "kernels"}


def test_a_precision_rounds_seeds_are_read_back_and_not_owed(tmp_path: Path) -> None:
    """max_seeds: result files of seeds beyond the listed ones (a precision round's) count in
    the cell's statistics, and the document never lists them as not run."""
    spec = study.load_spec(write_spec(tmp_path, 'name = "t"\npreset = "smoke"\nseeds = [0, 1]\n'
                                                'max_seeds = 3\n[[grid]]\narms = ["ssn"]\n'
                                                'strategies = ["skip"]\np = [0.1]\n'))
    fill(spec, {"ssn-skip-p0.1": [0.5, 0.7]})
    assert study.StudyData(spec, study.load_results(spec)).degradation(
        CellKey("ssn", "skip", 0.1)).keys() == {0, 1}
    for cell in study.result_cells(spec):                  # seed 2: what a round added
        if cell.seed == 2:
            loss = 2.0 if cell.key.is_baseline else 2.0 * 1.009
            study.result_path(spec, cell).write_text(json.dumps(fake_summary(cell, loss,
                                                                             spec=spec)))
    data = study.StudyData(spec, study.load_results(spec))
    assert sorted(data.degradation(CellKey("ssn", "skip", 0.1))) == [0, 1, 2]
    assert _missing_count(data) == (0, 4)


def test_a_block_that_changes_nothing_is_refused(tmp_path: Path) -> None:
    """A labelled block whose `set` is the preset's own value would be one run under two names."""
    with pytest.raises(study.StudyError, match="runs the same configuration as"):
        study.load_spec(write_spec(tmp_path, 'name = "t"\npreset = "smoke"\nseeds = [0]\n'
                                             '[[grid]]\narms = ["mapl"]\nstrategies = ["skip"]\n'
                                             'p = [0.1]\n[[grid]]\narms = ["mapl"]\n'
                                             'strategies = ["skip"]\np = [0.1]\n'
                                             'set = ["pipeline.bypass_decode=identity"]\n'))


def test_a_studys_own_references_and_claims_reach_its_document(tmp_path: Path) -> None:
    """`[[references]]` and `claims` in a study's TOML: the document decides only those claims,
    against those values."""
    text = ('name = "t"\npreset = "smoke"\nseeds = [0, 1, 2]\nclaims = ["c"]\n'
            '[[grid]]\narms = ["ssn", "none"]\nstrategies = ["skip"]\np = [0, 0.1]\n'
            '[[references]]\narm = "ssn"\np = 0.1\npct = 0.5\n'
            '[[references]]\narm = "none"\np = 0.1\npct = 1.25\n')
    spec = study.load_spec(write_spec(tmp_path, text))
    fill(spec, {"ssn-skip-p0.1": [0.2, 0.4, 0.3], "none-skip-p0.1": [1.0, 1.1, 1.3]})
    data = study.StudyData(spec, study.load_results(spec))
    [claim] = data.claims()
    assert claim.tag == "c" and [c.reference for c in claim.comparisons] == [-0.75]
    document = study.render_markdown(data)
    claims_section = document[document.index("## The blog's claims"):]
    claims_section = claims_section[:claims_section.index("\n## ", 1)]
    assert "| claim | reference |" in claims_section
    assert "the spec's references: SSN skip at p = 0.1: +0.5%; uncompressed skip at p = " \
           "0.1: +1.25%" in claims_section
    assert "(c) SSN degrades least" in claims_section and "(a)" not in claims_section


def test_a_precision_round_counts_the_seeds_kept_only_as_result_files(tmp_path: Path) -> None:
    """A study's registry can be gone (a fresh clone, another sitting): its precision round
    reads the widths from the result files too, and adds seeds that have no file, never those
    that have one."""
    from crucible.grid.cells import extra_cells
    from flows.study_results import with_result_files

    spec = study.load_spec(write_spec(tmp_path, 'name = "t"\npreset = "smoke"\nseeds = [0, 1]\n'
                                                'max_seeds = 4\ntarget_half_width = 0.5\n'
                                                '[[grid]]\narms = ["ssn"]\n'
                                                'strategies = ["skip"]\np = [0.1]\n'))
    fill(spec, {"ssn-skip-p0.1": [0.5, 2.5]})               # 2 seeds, a wide interval
    assert with_result_files(spec.model_copy(update={"files": None}), []) is None   # plain sweep
    rows = with_result_files(spec, [])                       # nothing in the registry
    assert sorted((r["p"], r["seed"]) for r in rows) == [(0.0, 0), (0.0, 1), (0.1, 0), (0.1, 1)]
    items = stats.robustness(rows)["items"]
    wanted = stats.seeds_wanted(items, target=0.5, max_seeds=4)
    assert [key[:4] for key, _ in wanted] == [("ssn", "skip", 0.1, "")]
    cells = extra_cells(spec, wanted, rows)
    assert {c.seed for c in cells} == {2, 3} and all(c.seed > 1 for c in cells)
    # a registry run of a cell that also has a file is the registry's: not counted twice
    registry = [{**rows[0], "id": "r0", "strategy": None, "label": None}]
    merged = with_result_files(spec, registry)
    assert len(merged) == 4 and merged[0]["id"] == "r0"
    [file_row] = [r for r in rows if r["p"] == 0.1 and r["seed"] == 0]
    failed = [{**file_row, "id": "r-failed", "label": None, "status": "failed"}]
    merged = with_result_files(spec, failed)           # a failed run does not hide the file
    assert [r["id"] for r in merged] == ["r-failed", *(r["id"] for r in rows)]
    assert with_result_files(spec, [{**r, "id": f"r{i}", "label": None,
                                     "strategy": None if r["p"] == 0 else r["strategy"]}
                                    for i, r in enumerate(rows)]) is None   # all in the registry
