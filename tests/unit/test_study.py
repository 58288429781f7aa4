"""The failure study's tooling (crucible/study/): spec parsing and its errors, cell expansion,
shared baselines, skipping completed cells, the statistics, the claims rules, and the generated
document's --check, all on result files the tests write themselves (no training here except one
smoke-sized end-to-end run, marked slow)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.study import here_arithmetic, register
from crucible import stats, study
from crucible.config import apply_overrides
from crucible.grid.cells import Cell, expand_cells
from crucible.grid.key import CellKey
from crucible.grid.spec import SweepSpec
from crucible.presets import get_preset
from crucible.study.document import _missing_count
from crucible.study.formatting import _claim_sentence

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from cli.main import main; main()"]

GRID = """
name = "t"
preset = "smoke"
seeds = [0, 1, 2]

[[grid]]
arms = ["none", "ssn", "mapl"]
strategies = ["skip", "drop"]
p = [0, 0.05, 0.1, 0.2]

[[grid]]
arms = ["none"]
strategies = ["reroute"]
p = [0.2]

[[grid]]
label = "decode_sender"
arms = ["mapl"]
strategies = ["skip"]
p = [0.2]
set = ["pipeline.bypass_decode=sender"]
"""


def write_spec(root: Path, text: str = GRID, name: str = "t.toml") -> Path:
    path = root / "studies" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


_STUDY = SweepSpec(duration=None)   # a spec that adds nothing to its cells' own settings


def fake_summary(cell: Cell, loss: float, *, spec: SweepSpec = _STUDY,
                 sha: str = "abc123def4567890",
                 wall_s: float = 60.0) -> dict:
    """A summary with the fields render reads, its config built as `crucible run` would."""
    config = apply_overrides(get_preset("smoke"), cell.overrides(spec)).to_dict()
    budget = 1000
    return {"config": config, "seed": cell.seed, "final_val_loss": loss,
            "initial_val_loss": 5.5, "tokens_budget": budget,
            "tokens_processed": budget if cell.key.p == 0 else int(budget * (1 - cell.key.p)),
            "replica_down_fraction": cell.key.p * 2, "wall_s": wall_s,
            "versions": {"git_sha": sha},
            "study": {"machine": "x86_64, 2 CPUs", "arithmetic": here_arithmetic()}}


def fill(spec: SweepSpec, degradations: dict[str, list[float]], *, base: float = 2.0,
         seeds: tuple[int, ...] | None = None) -> None:
    """Write result files: every baseline of the listed arms at loss `base`, and each cell
    named by its seedless id (e.g. 'ssn-skip-p0.1') at base * (1 + d / 100) per seed."""
    seeds = seeds or spec.seeds
    wanted = {name: values for name, values in degradations.items()}
    arms = {name.split("-")[0] for name in wanted}
    for cell in expand_cells(spec, seeds):
        if cell.key.is_baseline and cell.key.arm in arms:
            loss = base
        elif cell.key.name in wanted:
            values = wanted[cell.key.name]
            index = seeds.index(cell.seed)
            if index >= len(values):
                continue
            loss = base * (1 + values[index] / 100.0)
        else:
            continue
        path = study.result_path(spec, cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fake_summary(cell, loss, spec=spec)))


@pytest.fixture
def spec(tmp_path: Path) -> SweepSpec:
    return study.load_spec(write_spec(tmp_path))


def cli_app() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def noop() -> None:  # a second command keeps `study` a sub-command
        pass

    register(app)
    return app


# ---------------------------------------------------------------------------------------------
# spec parsing
# ---------------------------------------------------------------------------------------------

def test_committed_spec_parses_into_the_issue_grid() -> None:
    spec = study.load_spec(REPO / "studies" / "table1.toml")
    assert spec.name == "table1" and spec.preset == "study"
    assert len(spec.seeds) >= 5 and spec.seeds == list(range(len(spec.seeds)))   # the issue: >= 5
    cells = expand_cells(spec)
    keys = {c.key for c in cells}
    baselines = [k for k in keys if k.is_baseline]
    assert sorted(k.arm for k in baselines) == ["mapl", "none", "ssn"]
    assert len(keys) == 3 + 3 * 2 * 3 + 2 * 2 + 2
    assert len(cells) == len(spec.seeds) * len(keys)
    labels = {k.label for k in keys if k.label}
    assert labels == {"decode_sender", "decode_receiver"}
    assert spec.results_dir == REPO / "results" / "table1"
    assert spec.document == REPO / "docs" / "RESULTS-d64.md"


@pytest.mark.parametrize("text, needle", [
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n', "missing 'grid'"),
    ('name = "t"\npreset = "smok"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["skip"]\n'
     'p=[0.1]\n', "preset: unknown preset 'smok'; allowed: smoke"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\ncolour = 1\n[[grid]]\narms=["none"]\n'
     'strategies=["skip"]\np=[0.1]\n', "unknown key 'colour'"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["zip"]\nstrategies=["skip"]\n'
     'p=[0.1]\n', "grid[0].arms: unknown arm 'zip'; allowed: none, ssn, mapl"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["jump"]\n'
     'p=[0.1]\n', "grid[0].strategies: unknown strategy 'jump'"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["skip"]\n'
     'p=[1.5]\n', "grid[0].p: 1.5 is not a probability in [0, 1]"),
    ('name = "t"\npreset = "smoke"\nseeds = "all"\n[[grid]]\narms=["none"]\n'
     'strategies=["skip"]\np=[0.1]\n', "seeds: Input should be a valid list; e.g. seeds = [0, 1"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["skip"]\n'
     'p=[0.1]\nset=["pipeline.bypass_decode=sideways"]\n',
     "grid[0]: cell none-skip-p0.1-bypass_decode_sideways-s0: pipeline.bypass_decode"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["skip"]\n'
     'p=[0.1]\nset=["faults.p=0.3"]\n', "faults.p is set by the grid itself"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\nset = ["model.widht=3"]\n[[grid]]\n'
     'arms=["none"]\nstrategies=["skip"]\np=[0.1]\n', "unknown key 'model.widht'"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["skip"]\n'
     'p=[0.1]\nlabel="Bad Label"\nset=["pipeline.bypass_decode=sender"]\n', "grid[0].label: must be lower-case"),
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["skip"]\n'
     'p=[0.1]\ncolour=1\n', "grid[0]: unknown key 'colour'; a grid block takes arms"),
    ('name = "t" = 1\n', "is not valid TOML"),
    # a block may not change what its shared p = 0 baseline trains
    ('name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\narms=["none"]\nstrategies=["skip"]\n'
     'p=[0.1]\nset=["sparseloco.clip_granularity=stage"]\n',
     "sparseloco.clip_granularity would change training without failures too"),
])
def test_bad_spec_names_the_field(tmp_path: Path, text: str, needle: str) -> None:
    path = write_spec(tmp_path, text)
    with pytest.raises(study.StudyError) as err:
        study.load_spec(path)
    assert needle in str(err.value)


def test_two_blocks_that_make_one_id_differently_are_refused(tmp_path: Path) -> None:
    path = write_spec(tmp_path, """
        name = "t"
        preset = "smoke"
        seeds = [0]
        [[grid]]
        label = "x"
        arms = ["none"]
        strategies = ["skip"]
        p = [0.1]
        set = ["pipeline.bypass_decode=sender"]
        [[grid]]
        label = "x"
        arms = ["none"]
        strategies = ["skip"]
        p = [0.1]
        set = ["pipeline.bypass_decode=receiver"]
    """)
    with pytest.raises(study.StudyError, match="give one block a distinct `label`"):
        study.load_spec(path)


@pytest.mark.parametrize("args, needle", [
    (["study", "run", "nowhere.toml"], "spec nowhere.toml not found"),
    (["study", "render", "nowhere.toml"], "spec nowhere.toml not found"),
])
def test_cli_bad_input_exits_2_without_traceback(tmp_path: Path, args: list[str],
                                                 needle: str) -> None:
    result = CliRunner().invoke(cli_app(), args)
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_cli_bad_options_exit_2(spec: SweepSpec) -> None:
    for args, needle in ([["--seeds", "7"], "choose from the spec's seeds 0,1,2"],
                         [["--seeds", "a,b"], "--seeds must be comma-separated integers"],
                         [["--jobs", "0"], "--jobs must be >= 1"]):
        result = CliRunner().invoke(cli_app(), ["study", "run", str(spec.path), *args])
        assert result.exit_code == 2, result.output
        assert needle in result.output


def test_real_cli_reports_a_bad_spec_with_exit_2(tmp_path: Path) -> None:
    path = write_spec(tmp_path, 'name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\n'
                                'arms=["none"]\nstrategies=["skip"]\np=[2]\n')
    done = subprocess.run([*CLI, "study", "run", str(path), "--dry-run"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "grid[0].p: 2.0 is not a probability in [0, 1]" in done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------------------
# cells
# ---------------------------------------------------------------------------------------------

def test_cell_ids_are_stable_and_baselines_shared(spec: SweepSpec) -> None:
    cells = expand_cells(spec)
    ids = [c.id for c in cells]
    assert len(ids) == len(set(ids))
    for expected in ("none-base-s0", "mapl-skip-p0.2-s2", "ssn-drop-p0.05-s1",
                     "none-reroute-p0.2-s0", "mapl-skip-p0.2-decode_sender-s1"):
        assert expected in ids
    # one baseline per arm and seed, shared by every strategy and block; no p = 0 cell
    baselines = [c for c in cells if c.key.is_baseline]
    assert sorted(c.id for c in baselines) == sorted(f"{a}-base-s{s}" for a in
                                                     ("none", "ssn", "mapl") for s in (0, 1, 2))
    assert not [c for c in cells if not c.key.is_baseline and c.key.p == 0]
    assert len(cells) == 3 * (3 + 3 * 2 * 3 + 1 + 1)
    # baselines use the arm's default config (no block overrides)
    base = next(c for c in cells if c.id == "mapl-base-s1")
    assert base.overrides(spec) == ["pipeline.compression=mapl", "faults.p=0.0",
                                    "faults.strategy=skip", "seed=1"]
    sender = next(c for c in cells if c.id == "mapl-skip-p0.2-decode_sender-s1")
    assert sender.overrides(spec)[0] == "pipeline.bypass_decode=sender"
    assert "faults.p=0.2" in sender.overrides(spec)


def test_run_order_baselines_then_core_cells_seed_major(spec: SweepSpec) -> None:
    cells = expand_cells(spec)
    tiers = [c.tier for c in cells]
    assert tiers == sorted(tiers)
    assert all(c.key.is_baseline for c in cells[:9])
    core = [c for c in cells if c.tier == 1]
    assert {(c.key.strategy, c.key.p) for c in core} == {(s, p) for s in ("skip", "drop")
                                                         for p in (0.1, 0.2)}
    assert [c.seed for c in core] == sorted(c.seed for c in core)
    assert cells[-1].tier == 2


def test_derived_label_without_explicit_label(tmp_path: Path) -> None:
    path = write_spec(tmp_path, 'name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\n'
                                'arms=["mapl"]\nstrategies=["skip"]\np=[0.2]\n'
                                'set=["pipeline.bypass_decode=receiver"]\n')
    ids = [c.id for c in expand_cells(study.load_spec(path))]
    assert ids == ["mapl-base-s0", "mapl-skip-p0.2-bypass_decode_receiver-s0"]


def test_completed_cells_are_skipped(spec: SweepSpec) -> None:
    fill(spec, {"ssn-skip-p0.1": [0.5, 0.6]})
    cells = expand_cells(spec)
    done, todo = study.completed_cells(spec, cells)
    assert {c.id for c in done} == {"ssn-base-s0", "ssn-base-s1", "ssn-base-s2",
                                    "ssn-skip-p0.1-s0", "ssn-skip-p0.1-s1"}
    assert len(done) + len(todo) == len(cells)
    result = CliRunner().invoke(cli_app(), ["study", "run", str(spec.path), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"{len(cells) - 5} to run" in lines[0] and "5 already in results/t (skipped)" in lines[0]
    assert not any("ssn-skip-p0.1-s0:" in line for line in lines)
    [line] = [line for line in lines if "ssn-skip-p0.1-s2:" in line]
    assert line.endswith("--set faults.strategy=skip --set seed=2")
    assert not (spec.runs_dir).exists()                 # a dry run starts nothing


def test_cli_run_exits_1_when_a_run_fails(tmp_path: Path, monkeypatch) -> None:
    """What the flow reported decides the exit code: a failed cell is exit 1 (the flow's own
    failure handling is tested with the flow, tests/integration/test_flows_*)."""
    import cli.embedded
    from cli.embedded import SweepReport

    path = write_spec(tmp_path, 'name = "t"\npreset = "smoke"\nseeds = [0]\n[[grid]]\n'
                                'arms=["mapl"]\nstrategies=["skip"]\np=[0.1]\n')
    seen: list[int] = []

    def flow(spec, work_dir, **_):
        seen.append(spec.max_concurrent_runs)
        return SweepReport("sid", tmp_path / "report.html", {}, None,
                           "1 of 2 cells of sweep sid failed: boom")

    monkeypatch.setattr(cli.embedded, "run_sweep_embedded", flow)
    result = CliRunner().invoke(cli_app(), ["study", "run", str(path), "--jobs", "3"])
    assert result.exit_code == 1, result.output
    assert "failed: 1 of 2 cells of sweep sid failed: boom" in result.output and seen == [3]


def test_slim_summary_keeps_small_summaries_whole() -> None:
    small = {"final_val_loss": 1.0, "faults": [1, 2], "evals": [1, 2, 3]}
    assert study.slim_summary(small) == (small, [])
    big = {"final_val_loss": 1.0, "evals": [{"v": "x" * 100}] * 1000}
    kept, dropped = study.slim_summary(big)
    assert kept["evals"] == [big["evals"][0], big["evals"][-1]]
    assert dropped == ["evals (kept the first and the last)"]


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------

def test_statistics_against_hand_computed_values(spec: SweepSpec) -> None:
    fill(spec, {"ssn-skip-p0.1": [1.0, 2.0, 3.0], "ssn-drop-p0.1": [4.0, 6.0, 5.0]})
    data = study.StudyData(spec, study.load_results(spec))
    s = data.stat(CellKey("ssn", "skip", 0.1))
    # mean 2, sd 1, t(0.975, 2) = 4.302653 -> half-width 4.302653 / sqrt(3) = 2.484138
    assert s.n == 3 and s.seeds == (0, 1, 2)
    assert s.mean == pytest.approx(2.0)
    assert s.sd == pytest.approx(1.0)
    assert s.half == pytest.approx(2.484138, abs=1e-5)
    assert (s.lo, s.hi) == (pytest.approx(-0.484138, abs=1e-5), pytest.approx(4.484138, abs=1e-5))
    # paired skip - drop per seed: -3, -4, -2 -> mean -3, sd 1
    [(arm, p, diff)] = [row for row in stats.skip_minus_drop(data.claim_cells()) if row[2].n]
    assert (arm, p) == ("ssn", 0.1)
    assert diff.values == pytest.approx((-3.0, -4.0, -2.0))
    assert diff.mean == pytest.approx(-3.0) and diff.hi == pytest.approx(-0.515862, abs=1e-5)
    # relative degradation is against the same seed's baseline: give seeds 1 and 2 baselines of
    # their own (seed 0 keeps 2.0); the cell's losses stay 2.0 * (1 + d / 100) = 2.02, 2.04, 2.06
    for seed, base_loss in ((1, 2.5), (2, 1.6)):
        [cell] = [c for c in expand_cells(spec)
                  if c.key == CellKey.baseline_of("ssn") and c.seed == seed]
        study.result_path(spec, cell).write_text(json.dumps(fake_summary(cell, base_loss, spec=spec)))
    rebased = study.StudyData(spec, study.load_results(spec))
    skip = CellKey("ssn", "skip", 0.1)
    # by hand: 100 (2.02 - 2.0) / 2.0 = 1.0, 100 (2.04 - 2.5) / 2.5 = -18.4,
    # 100 (2.06 - 1.6) / 1.6 = 28.75 (against seed 0's 2.0 every seed would read 1, 2, 3 again)
    assert rebased.degradation(skip) == pytest.approx({0: 1.0, 1: -18.4, 2: 28.75})
    assert rebased.stat(skip).mean == pytest.approx((1.0 - 18.4 + 28.75) / 3)
    assert rebased.degradation(CellKey.baseline_of("ssn")) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_one_seed_has_no_interval_and_missing_cells_are_counted(spec: SweepSpec) -> None:
    fill(spec, {"none-skip-p0.1": [0.7]})
    data = study.StudyData(spec, study.load_results(spec))
    s = data.stat(CellKey("none", "skip", 0.1))
    assert s.n == 1 and s.lo is None and s.half is None and s.sd is None
    text = study.render_markdown(data)
    assert "+0.70% (n=1, no interval)" in text
    assert "not run yet" in text
    missing, expected = _missing_count(data)
    assert expected == len(expand_cells(spec)) and missing == expected - 4


def test_growth_slope_per_seed(spec: SweepSpec) -> None:
    # d = 10 p per seed plus a seed offset at every p: slopes 1.0 per 0.1 of p... computed by hand
    fill(spec, {"none-skip-p0.05": [0.5, 0.6, 0.4], "none-skip-p0.1": [1.0, 1.1, 0.9],
                "none-skip-p0.2": [2.0, 2.1, 1.9]})
    data = study.StudyData(spec, study.load_results(spec))
    rows = {(arm, strat): s for arm, strat, _, s in stats.growth_slopes(data.claim_cells())}
    s = rows[("none", "skip")]
    ps = [0.05, 0.1, 0.2]   # p = 0 is left out of the fit
    for seed, offset in enumerate([0.0, 0.1, -0.1]):
        ys = [10 * p + offset for p in ps]
        mx, my = sum(ps) / 3, sum(ys) / 3
        slope = sum((x - mx) * (y - my) for x, y in zip(ps, ys, strict=True)) / \
            sum((x - mx) ** 2 for x in ps)
        assert s.values[seed] == pytest.approx(0.1 * slope)


def test_growth_claim_does_not_read_a_fall_as_growth(spec: SweepSpec) -> None:
    # positive but falling with p (the review's case): through (0, 0) this read as growth
    values = {"none-skip-p0.05": [2.0, 2.1, 1.9], "none-skip-p0.1": [2.0, 2.1, 1.9],
              "none-skip-p0.2": [1.5, 1.6, 1.4]}
    fill(spec, values)
    data = study.StudyData(spec, study.load_results(spec))
    rows = {(arm, strat): s for arm, strat, _, s in stats.growth_slopes(data.claim_cells())}
    assert rows[("none", "skip")].mean < 0


def test_result_file_for_another_cell_is_refused(spec: SweepSpec) -> None:
    cells = {c.id: c for c in expand_cells(spec)}
    path = study.result_path(spec, cells["ssn-skip-p0.1-s0"])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(fake_summary(cells["ssn-skip-p0.2-s0"], 2.0, spec=spec)))
    with pytest.raises(study.StudyError, match="not cell ssn-skip-p0.1-s0"):
        study.load_results(spec)


# ---------------------------------------------------------------------------------------------
# claims
# ---------------------------------------------------------------------------------------------

def _claims(spec: SweepSpec, degradations: dict[str, list[float]]) -> dict[str, stats.Claim]:
    fill(spec, degradations)
    return {c.tag: c for c in study.StudyData(spec, study.load_results(spec)).claims()}


def _grid(skip: dict[str, list[float]], drop: dict[str, list[float]] | float = 3.5,
          ps: tuple[float, ...] = (0.05, 0.1, 0.2)) -> dict[str, list[float]]:
    out = {}
    for arm, values in skip.items():
        for i, p in enumerate(ps):
            out[f"{arm}-skip-p{p:g}"] = [v * (i + 1) for v in values]
            d = drop if isinstance(drop, float) else None
            out[f"{arm}-drop-p{p:g}"] = ([d * (i + 1) + j * 0.1 for j in range(3)]
                                         if d is not None else [v * (i + 1) for v in drop[arm]])
    return out


def test_claims_agree_on_blog_like_data(spec: SweepSpec) -> None:
    claims = _claims(spec, _grid({"ssn": [0.30, 0.32, 0.34], "mapl": [0.45, 0.47, 0.46],
                                  "none": [0.46, 0.45, 0.48]}))
    assert claims["a"].verdict == stats.AGREES
    assert claims["b"].verdict == stats.AGREES
    assert claims["c"].verdict == stats.AGREES
    assert claims["d"].verdict == stats.AGREES


def test_claims_disagree_when_the_data_say_the_opposite(spec: SweepSpec) -> None:
    # skip worse than drop, degradation shrinking with p, SSN worst, MAPL far from uncompressed
    data = _grid({"ssn": [-3.0, -3.1, -3.2], "mapl": [-5.0, -5.1, -5.2],
                  "none": [-8.0, -8.1, -8.2]}, drop=-10.0)
    claims = _claims(spec, data)
    assert claims["a"].verdict == stats.DISAGREES
    assert claims["b"].verdict == stats.DISAGREES
    assert claims["c"].verdict == stats.DISAGREES
    assert claims["d"].verdict == stats.DISAGREES
    assert "not reproduced" in _claim_sentence(claims["a"])


def test_claims_not_resolved_when_intervals_straddle(spec: SweepSpec) -> None:
    noisy = {"ssn": [-2.0, 1.0, 2.5], "mapl": [2.0, -1.0, 0.5], "none": [1.0, -2.0, 1.5]}
    claims = _claims(spec, _grid(noisy, drop={"ssn": [2.0, -1.5, 0.5], "mapl": [-1.0, 2.0, 0.0],
                                               "none": [0.0, 1.0, -1.5]}))
    for tag in "abcd":
        assert claims[tag].verdict == stats.NOT_RESOLVED, tag
    assert "not resolved" in _claim_sentence(claims["a"])


def test_claims_not_run_without_two_seeds(spec: SweepSpec) -> None:
    claims = _claims(spec, {"ssn-skip-p0.1": [0.5]})
    assert {c.verdict for c in claims.values()} == {stats.NOT_RUN}


def test_close_margin_rule(spec: SweepSpec) -> None:
    margin = spec.close_margin
    inside = stats.stat_of({0: 0.1, 1: 0.2, 2: 0.15})
    outside = stats.stat_of({0: margin + 1.0, 1: margin + 1.1, 2: margin + 1.05})
    astride = stats.stat_of({0: 0.0, 1: margin, 2: margin + 0.5})
    assert stats.claims._band_status(inside, margin) == "supports"
    assert stats.claims._band_status(outside, margin) == "contradicts"
    assert stats.claims._band_status(astride, margin) == "unresolved"


# ---------------------------------------------------------------------------------------------
# the document
# ---------------------------------------------------------------------------------------------

def test_render_check_passes_then_fails_after_an_edit(spec: SweepSpec) -> None:
    fill(spec, _grid({"ssn": [0.30, 0.32, 0.34], "mapl": [0.45, 0.47, 0.46],
                      "none": [0.46, 0.45, 0.48]}))
    app = cli_app()
    runner = CliRunner()
    result = runner.invoke(app, ["study", "render", str(spec.path), "--no-figures"])
    assert result.exit_code == 0, result.output
    text = spec.document.read_text()
    assert result.output.startswith("wrote docs/RESULTS.md")
    result = runner.invoke(app, ["study", "render", str(spec.path), "--check"])
    assert result.exit_code == 0, result.output
    spec.document.write_text(text.replace("agrees", "agreees", 1))
    result = runner.invoke(app, ["study", "render", str(spec.path), "--check"])
    assert result.exit_code == 1
    assert "differs from what results/t renders" in result.output
    spec.document.unlink()
    assert runner.invoke(app, ["study", "render", str(spec.path), "--check"]).exit_code == 1


def test_document_content(spec: SweepSpec) -> None:
    fill(spec, _grid({"ssn": [0.30, 0.32, 0.34], "mapl": [0.45, 0.47, 0.46],
                      "none": [0.46, 0.45, 0.48]}))
    text = study.render_markdown(study.StudyData(spec, study.load_results(spec)))
    # opening answer first, then the setting, the tables, the claims, the limits
    order = ["# ", "## Setting", "## Table 1", "## Figure 3", "## All cells", "## Baselines",
             "## Beyond the blog", "## The blog's claims",
             "## What agrees with the blog", "## What the measurement cannot resolve"]
    positions = [text.index(h) for h in order]
    assert positions == sorted(positions)
    opening = text.split("## Setting")[0]
    assert "is reproduced here" in opening
    assert "`crucible study render studies/t.toml`" in text
    assert "`abc123def456` (" in text                # the commit of the summaries
    assert "| 0.1 | +0.64% [" in text                 # SSN, skip, p = 0.1 (0.6, 0.64, 0.68)
    assert "| +0.6% |" in text                        # the blog's value beside
    assert "![Figure 3" in text and "(img/t-figure3.png)" in text
    assert "| claim | blog | Crucible (95% CI) | agrees? |" in text
    assert "not run yet" in text                      # reroute / decode_sender cells absent
    assert str(spec.root) not in text                 # no machine-specific path
    assert "x86_64, 2 CPUs" in text


def test_document_renders_with_no_results(spec: SweepSpec) -> None:
    text = study.render_markdown(study.StudyData(spec, {}))
    assert "No failure cell has a result yet" in text
    assert text.count("not run yet") > 10


def test_noise_floor_from_the_results(spec: SweepSpec) -> None:
    assert study.noise_floor(spec.path) is None
    fill(spec, {"ssn-skip-p0.1": [1.0, 2.0, 3.0], "ssn-skip-p0.2": [1.0, 3.0, 5.0],
                "none-skip-p0.1": [0.0, 1.0, 2.0]})
    # per-cell sds 1, 2, 1 -> median 1 -> floor 1.96
    assert study.noise_floor(spec.path) == pytest.approx(study.NOISE_FLOOR_Z * 1.0)


def test_demo_table_marks_one_seed_cells(monkeypatch, capsys) -> None:
    from cli import flows as flows_cli

    monkeypatch.setattr(study, "noise_floor", lambda *a, **k: 1.234)
    table = {"columns": ["ssn/skip"], "rows": [
        {"p": 0.0, "cells": {"ssn/skip": {"mean_pct": 0.0, "ci_low_pct": None,
                                          "ci_high_pct": None, "n_seeds": 1}}},
        {"p": 0.1, "cells": {"ssn/skip": {"mean_pct": -0.5, "ci_low_pct": None,
                                          "ci_high_pct": None, "n_seeds": 1}}},
        {"p": 0.3, "cells": {"ssn/skip": {"mean_pct": 3.0, "ci_low_pct": 1.0,
                                          "ci_high_pct": 5.0, "n_seeds": 2}}}]}
    monkeypatch.setenv("COLUMNS", "200")
    flows_cli._print_table(table, "t")
    out = capsys.readouterr().out
    assert "-0.50% (1 seed; below noise ±1.2)" in out
    assert "±1.2 points is the one-seed noise floor the failure study measured" in \
        " ".join(out.split())
    assert "+3.00% [+1.00, +5.00]" in out
    assert "0 (baseline)" in out
    table["rows"][1]["cells"]["ssn/skip"]["mean_pct"] = -2.5
    flows_cli._print_table(table, "t")
    assert "-2.50% (1 seed; noise ±1.2)" in capsys.readouterr().out
    monkeypatch.setattr(study, "noise_floor", lambda *a, **k: None)
    flows_cli._print_table(table, "t")
    assert "-2.50% (1 seed, no interval)" in capsys.readouterr().out


@pytest.mark.browser
def test_figures_render_to_png(spec: SweepSpec, tmp_path: Path) -> None:
    if not study.CHROMIUM.exists():
        pytest.skip(f"{study.CHROMIUM} is missing (make system-deps)")
    fill(spec, _grid({"ssn": [0.30, 0.32, 0.34], "mapl": [0.45, 0.47, 0.46],
                      "none": [0.46, 0.45, 0.48]}))
    fill(spec, {"none-reroute-p0.2": [0.4, 0.5, 0.6]})
    data = study.StudyData(spec, study.load_results(spec))
    paths = {"figure3": tmp_path / "f3.png", "extras": tmp_path / "ex.png"}

    async def inside_a_running_loop() -> list[Path]:
        # as under a Prefect flow or in a notebook: Playwright's sync API refuses a thread
        # whose asyncio loop is running, so the renderer must not use this thread
        return study.write_figures(study.build_figures(data), paths, scale=1)

    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    # a thread of the test's own, whatever loop other tests left running in the main thread
    with ThreadPoolExecutor(max_workers=1) as pool:
        written = pool.submit(asyncio.run, inside_a_running_loop()).result()
    assert written == [paths["figure3"], paths["extras"]]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000


# ---------------------------------------------------------------------------------------------
# the committed study
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["table1.toml", "table1-d128.toml", "processes.toml"])
def test_committed_results_document_matches_the_committed_data(name: str) -> None:
    spec = study.load_spec(REPO / "studies" / name)
    expected = study.render_markdown(study.StudyData(spec, study.load_results(spec)))
    committed = spec.document.read_text(encoding="utf-8")
    assert committed == expected, (f"{spec.shown(spec.document)} differs from what "
                                   f"{spec.shown(spec.results_dir)} renders: run "
                                   f"`crucible study render studies/{name}`")


@pytest.mark.slow   # ~40 s: two runs on the embedded stack (Prefect, registry), then a render
def test_end_to_end_smoke_study(tmp_path: Path) -> None:
    path = write_spec(tmp_path, """
        name = "e2e"
        preset = "smoke"
        seeds = [0]
        set = ["train.global_steps=2", "train.eval_every=2", "train.eval_tokens=2048",
               "train.warmup_steps=1"]
        [[grid]]
        arms = ["none"]
        strategies = ["skip"]
        p = [0.5]
    """)
    done = subprocess.run([*CLI, "study", "run", str(path), "--jobs", "2"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "study e2e: 2 ran, 0 failed; 2 of 2 cells in results/e2e" in done.stdout
    results = sorted(p.name for p in (tmp_path / "results" / "e2e").glob("*"))
    assert results == ["none-base-s0.json", "none-skip-p0.5-s0.json"]   # no temporary files
    kept = json.loads((tmp_path / "results" / "e2e" / "none-skip-p0.5-s0.json").read_text())
    assert kept["versions"]["git_sha"] and math.isfinite(kept["final_val_loss"])
    assert kept["config"]["faults"]["p"] == 0.5 and "store_url" not in kept
    assert kept["study"]["cell"] == "none-skip-p0.5-s0" and kept["study"]["jobs"] == 2
    # the study asks its baselines (only) for the alignment report its hypothesis test reads
    base = json.loads((tmp_path / "results" / "e2e" / "none-base-s0.json").read_text())
    assert len(base["alignment"]["stages"]) == base["config"]["pipeline"]["stages"] - 2
    assert "alignment" not in kept
    # the runs are in the study's registry (SQLite in its runs folder), with the same losses
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'runs' / 'study' / 'e2e' / 'registry.db'}")
    with engine.connect() as connection:
        stored = connection.execute(sa.text(
            "SELECT p, status, final_val_loss FROM runs ORDER BY p")).all()
    engine.dispose()
    assert [(p, status) for p, status, _ in stored] == [(0.0, "completed"), (0.5, "completed")]
    assert stored[1][2] == kept["final_val_loss"]
    again = subprocess.run([*CLI, "study", "run", str(path)], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and "2 already in results/e2e (skipped), 0 to run" in again.stdout
    rendered = subprocess.run([*CLI, "study", "render", str(path), "--no-figures"],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    assert "n=1, no interval" in (tmp_path / "docs" / "RESULTS.md").read_text()
    # the flow's cell is the computation `crucible run` makes of it, to the bit
    spec = study.load_spec(path)
    [cell] = [c for c in expand_cells(spec) if c.id == "none-skip-p0.5-s0"]
    alone = tmp_path / "alone"
    solo = subprocess.run([*CLI, "run", "--preset", "smoke", "--no-progress", "--out", str(alone),
                           *[a for o in cell.overrides(spec) for a in ("--set", o)]],
                          capture_output=True, text=True, timeout=300)
    assert solo.returncode == 0, solo.stderr
    assert json.loads((alone / "summary.json").read_text())["final_val_loss"] \
        == kept["final_val_loss"]


@pytest.mark.slow   # ~60 s: a study with a precision round on the embedded stack
def test_study_run_adds_seeds_by_precision_into_results_and_the_registry(tmp_path: Path) -> None:
    """max_seeds in a study: after seeds 0 and 1, every cell wider than the (tiny) target
    gets seed 2 and its baseline in the same `study run`; each lands in results/ and the
    study's registry, and a second `study run` runs nothing."""
    path = write_spec(tmp_path, """
        name = "prec"
        preset = "smoke"
        seeds = [0, 1]
        max_seeds = 3
        target_half_width = 0.001
        set = ["train.global_steps=2", "train.eval_every=2", "train.eval_tokens=2048",
               "train.warmup_steps=1"]
        [[grid]]
        arms = ["none"]
        strategies = ["skip"]
        p = [0.5]
    """)
    done = subprocess.run([*CLI, "study", "run", str(path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = sorted(p.stem for p in (tmp_path / "results" / "prec").glob("*.json"))
    assert results == [f"none-{c}-s{s}" for c in ("base", "skip-p0.5") for s in (0, 1, 2)]
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'runs' / 'study' / 'prec' / 'registry.db'}")
    with engine.connect() as connection:
        seeds = connection.execute(sa.text(
            "SELECT p, seed FROM runs WHERE status = 'completed' ORDER BY p, seed")).all()
    engine.dispose()
    assert [tuple(row) for row in seeds] == [(p, s) for p in (0.0, 0.5) for s in (0, 1, 2)]
    again = subprocess.run([*CLI, "study", "run", str(path)], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and "0 to run" in again.stdout
