"""SweepSpec: validation messages and grid expansion with shared baselines."""
from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from crucible.grid.cells import expand_cells
from crucible.grid.key import CellKey
from crucible.grid.spec import BASELINE_FAULTS_STRATEGY, DEMO_SPEC, SweepSpec


def _error(**kwargs: object) -> str:
    with pytest.raises(ValidationError) as info:
        SweepSpec(**kwargs)
    return str(info.value)


def test_unknown_arm_is_named_with_allowed_values() -> None:
    message = _error(arms=["ssn", "zip"])
    assert "unknown arm 'zip'" in message
    assert "none, ssn, mapl" in message
    assert "arms" in message


def test_unknown_strategy_is_named() -> None:
    assert "unknown strategy 'retry'" in _error(strategies=["retry"])


def test_unknown_preset_is_named() -> None:
    assert "unknown preset 'huge'" in _error(preset="huge")


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_probability_outside_unit_interval_is_rejected(p: float) -> None:
    message = _error(failure_probabilities=[0.1, p])
    assert "outside [0, 1]" in message and repr(p) in message


@pytest.mark.parametrize("field", ["arms", "strategies", "failure_probabilities", "seeds"])
def test_empty_list_is_rejected(field: str) -> None:
    message = _error(**{field: []})
    assert field in message and "at least 1" in message


def test_only_baseline_probability_is_an_empty_grid() -> None:
    assert "grid is empty" in _error(failure_probabilities=[0.0])


def test_bad_store_url_and_override_are_named() -> None:
    assert "store_url='http://x' is not supported; use file:///abs/path" in _error(
        store_url="http://x")
    assert "store_url='file://relative': a file URL needs an absolute path" in _error(
        store_url="file://relative")
    assert "store_url='s3://': an S3 URL needs a bucket" in _error(store_url="s3://")
    assert "key.path=value" in _error(overrides=["replicas"])


def test_unknown_field_is_rejected() -> None:
    assert "colour" in _error(colour="red")


def test_baselines_are_shared_by_strategies() -> None:
    spec = SweepSpec(arms=["ssn", "mapl"], strategies=["skip", "drop", "reroute"],
                     failure_probabilities=[0.0, 0.1, 0.2], seeds=[0, 1])
    cells = expand_cells(spec)
    baselines = [c for c in cells if c.is_baseline]
    faulty = [c for c in cells if not c.is_baseline]
    assert len(baselines) == 2 * 2                       # arm x seed
    assert len(faulty) == 2 * 3 * 2 * 2                  # arm x strategy x p>0 x seed
    assert len(set(cells)) == len(cells)
    assert {c.baseline for c in faulty} == set(baselines)
    assert all(c.strategy is None for c in baselines)


def test_one_cell_key_with_none_for_the_baseline_and_the_edge_spellings_kept() -> None:
    spec = SweepSpec(arms=["mapl"], strategies=["skip"], failure_probabilities=[0.0, 0.2],
                     seeds=[0])
    base, skip = expand_cells(spec)
    assert base.key == CellKey.baseline_of("mapl") == CellKey("mapl", None, 0.0)
    assert base.key.is_baseline and not skip.key.is_baseline
    assert skip.key == CellKey("mapl", "skip", 0.2)
    # ids, labels and the baseline's config keep their spellings (result files, run names,
    # fingerprints)
    assert (base.id, skip.id) == ("mapl-base-s0", "mapl-skip-p0.2-s0")
    assert base.label == "mapl/baseline/p=0/seed=0"
    assert f"faults.strategy={BASELINE_FAULTS_STRATEGY}" in base.overrides(spec)
    assert BASELINE_FAULTS_STRATEGY == "skip"
    # a registry row or a result file's row: p = 0 is the baseline whatever strategy it names
    row = {"compression": "mapl", "strategy": "skip", "p": 0.0, "label": None, "seed": 0}
    assert CellKey.of_row(row) == base.key
    assert CellKey.of_row({**row, "p": 0.2}, duration=6) == CellKey("mapl", "skip", 0.2, "", 6)


def test_duplicates_collapse() -> None:
    spec = SweepSpec(arms=["ssn", "ssn"], strategies=["skip", "skip"],
                     failure_probabilities=[0.1, 0.1], seeds=[3, 3])
    assert len(expand_cells(spec)) == 2


def test_cell_overrides_pin_the_cell_after_extras() -> None:
    spec = SweepSpec(overrides=["replicas=2"], global_steps=3, duration=2)
    baseline = expand_cells(spec)[0]
    assert baseline.overrides(spec) == [
        "replicas=2", "train.global_steps=3", "faults.duration=2", "pipeline.compression=ssn",
        "faults.p=0.0", f"faults.strategy={BASELINE_FAULTS_STRATEGY}", "seed=0"]


@pytest.mark.parametrize("key", ["faults.p", "faults.strategy", "pipeline.compression", "seed"])
def test_an_override_of_a_grid_key_is_refused(key: str) -> None:
    message = _error(overrides=[f"{key}=1"])
    assert "overrides" in message and f"{key} is set by the grid itself" in message


def test_schema_renders_dropdowns_and_descriptions() -> None:
    schema = SweepSpec.model_json_schema()
    props = schema["properties"]
    assert all(prop.get("description") for prop in props.values())
    assert props["preset"]["enum"] == ["smoke", "small", "study", "study-d128", "paper-178m"]
    assert props["arms"]["items"]["enum"] == ["none", "ssn", "mapl"]


def test_demo_spec_is_the_advertised_grid() -> None:
    """The study's preset at half its replicas: skip against drop at p = 0.2, 3 seeds (two
    give a t-interval too wide for the effect), so the demo's claim (a) has an interval."""
    spec = SweepSpec(**DEMO_SPEC)
    cells = spec.cells()
    assert len(cells) == 3 * (1 + 2)                 # each seed: the baseline, skip and drop
    assert {c.id for c in cells if c.seed == 0} == {"none-base-s0", "none-skip-p0.2-s0",
                                                    "none-drop-p0.2-s0"}
    assert spec.preset == "study" and spec.duration is None and len(spec.seeds) >= 3


def test_a_sweep_stored_before_claims_and_precision_keeps_its_identity():
    from crucible.grid.spec import identity_of

    spec = SweepSpec(**DEMO_SPEC)
    stored_today = spec.model_dump(mode="json")
    older = {k: v for k, v in stored_today.items()            # what an earlier release stored
             if k not in ("close_margin", "equivalence_margin", "target_half_width",
                          "max_seeds", "grid", "title", "files")}
    assert identity_of(older) == identity_of(stored_today) == spec.identity()
    # a new target or margins is another reading of the same runs: the same sweep
    assert SweepSpec(**DEMO_SPEC, target_half_width=0.2).identity() == spec.identity()
    # a seed budget changes what runs: another sweep; and with one, so does the target
    assert SweepSpec(**DEMO_SPEC, max_seeds=4).identity() != spec.identity()
    assert (SweepSpec(**DEMO_SPEC, max_seeds=4, target_half_width=0.2).identity()
            != SweepSpec(**DEMO_SPEC, max_seeds=4).identity())
    with pytest.raises(ValueError, match="max_seeds"):
        SweepSpec(**{**DEMO_SPEC, "seeds": [0, 1, 2]}, max_seeds=2)


# --------------------------------------------------------------------------------------------
# the grid: one model for a sweep and a study
# --------------------------------------------------------------------------------------------

_GRID = [{"arms": ["none", "ssn"], "strategies": ["skip", "drop"], "p": [0, 0.1]},
         {"arms": ["mapl"], "strategies": ["skip"], "p": [0.2],
          "set": ["pipeline.bypass_decode=sender"], "seeds": [0, 5]}]


def test_grid_blocks_expand_with_labels_overrides_and_their_own_seeds() -> None:
    spec = SweepSpec(grid=_GRID, seeds=[0, 1], duration=None)
    cells = {c.id: c for c in spec.cells()}
    assert sorted(cells) == sorted(
        [f"{a}-base-s{s}" for a in ("none", "ssn") for s in (0, 1)]
        + ["mapl-base-s0", "mapl-base-s5"]
        + [f"{a}-{st}-p0.1-s{s}" for a in ("none", "ssn") for st in ("skip", "drop")
           for s in (0, 1)]
        + ["mapl-skip-p0.2-bypass_decode_sender-s0", "mapl-skip-p0.2-bypass_decode_sender-s5"])
    sender = cells["mapl-skip-p0.2-bypass_decode_sender-s5"]
    assert sender.label == "mapl/skip/p=0.2/bypass_decode_sender/seed=5"
    assert sender.overrides(spec) == ["pipeline.bypass_decode=sender",
                                      "pipeline.compression=mapl", "faults.p=0.2",
                                      "faults.strategy=skip", "seed=5"]
    # the baseline of a labelled cell is the arm's shared, unlabelled one
    assert sender.baseline.id == "mapl-base-s5" and sender.baseline.sets == ()
    # the block's own seed (5) runs after every cell of the spec's seeds
    order = [c.id for c in spec.cells()]
    assert order.index("mapl-base-s5") > order.index("ssn-drop-p0.1-s1")
    # the flat fields are the one-block grid
    flat = SweepSpec(arms=["none"], strategies=["skip"], failure_probabilities=[0.1])
    assert [c.id for c in flat.cells()] == [
        c.id for c in SweepSpec(grid=[{"arms": ["none"], "strategies": ["skip"], "p": [0.1]}]
                                ).cells()]


@pytest.mark.parametrize("spec, needle", [
    ({"grid": _GRID, "arms": ["ssn"]}, "give either `grid` or arms, not both"),
    ({"grid": [{**_GRID[0], "set": ["train.lr=0.1"]}]},
     "train.lr would change training without failures too"),
    ({"grid": [{**_GRID[0], "label": "x"}]}, "without `set` overrides"),
    ({"grid": [{**_GRID[0], "label": "Bad"}]}, "must be lower-case letters"),
    ({"grid": [{**_GRID[0], "p": [0.1, 0.1]}]}, "lists a value twice"),
    ({"grid": [{**_GRID[0], "p": [1.5]}]}, "1.5 is not a probability"),
    ({"grid": [{**_GRID[0], "seeds": [1, 1]}]}, "lists a seed twice"),
    ({"grid": [_GRID[1], {**_GRID[1], "set": ["pipeline.bypass_decode=receiver"],
                          "label": "bypass_decode_sender"}]}, "distinct `label`"),
])
def test_a_bad_grid_names_the_field_and_the_fix(spec: dict, needle: str) -> None:
    assert needle in _error(**spec)


def test_a_spec_round_trips_through_its_json_as_the_prefect_form_sends_it() -> None:
    spec = SweepSpec(grid=_GRID, seeds=[0, 1], tags=["t"])
    again = SweepSpec(**spec.model_dump(mode="json"))
    assert again.cells() == spec.cells() and again.identity() == spec.identity()
    assert "grid" in SweepSpec.model_json_schema()["properties"]


def test_the_committed_study_specs_load_into_the_one_model() -> None:
    from pathlib import Path

    from crucible.study import load_spec

    root = Path(__file__).resolve().parents[2]
    spec = load_spec(root / "studies" / "table1.toml")
    assert isinstance(spec, SweepSpec) and spec.duration is None    # the preset's duration
    assert spec.files is not None and spec.results_dir == root / "results" / "table1"
    again = SweepSpec(**spec.model_dump(mode="json"))
    assert [c.id for c in again.cells()] == [c.id for c in spec.cells()]
    assert again.identity() == spec.identity()           # where its files lie is no identity


def test_the_flow_plans_a_labelled_block_with_its_overrides() -> None:
    from flows.settings import FlowSettings
    from flows.sweep_flow import _plan

    planned = {item.cell.id: item for item in _plan(SweepSpec(grid=_GRID), FlowSettings())}
    sender = planned["mapl-skip-p0.2-bypass_decode_sender-s0"]
    assert sender.config.pipeline.bypass_decode == "sender"
    assert planned["mapl-base-s0"].config.pipeline.bypass_decode != "sender"
    assert len({item.fingerprint for item in planned.values()}) == len(planned)


def test_the_flow_refuses_two_cells_of_one_configuration() -> None:
    from crucible.config import ConfigError
    from flows.settings import FlowSettings
    from flows.sweep_flow import _plan

    same = [{"arms": ["mapl"], "strategies": ["skip"], "p": [0.2]},
            {"arms": ["mapl"], "strategies": ["skip"], "p": [0.2],
             "set": ["pipeline.bypass_decode=identity"]}]      # the smoke preset's own value
    with pytest.raises(ConfigError, match=r"^spec\.grid\[1\]: cell mapl-skip-p0\.2-bypass_decode_"
                       r"identity-s0 runs the same configuration as mapl-skip-p0\.2-s0 "):
        _plan(SweepSpec(grid=same), FlowSettings())


def test_concurrency_is_no_part_of_a_sweeps_identity() -> None:
    assert (SweepSpec(**{**DEMO_SPEC, "max_concurrent_runs": 4}).identity()
            == SweepSpec(**DEMO_SPEC).identity())


def test_a_spec_this_machine_cannot_run_is_refused_naming_a_cell() -> None:
    """One check of a sweep's or study's cells here (crucible sweep, crucible study run):
    each distinct configuration once, the failure naming the first cell that has it."""
    import torch

    from crucible.config import ConfigError
    from crucible.preflight import check_spec_here

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    check_spec_here(SweepSpec(**DEMO_SPEC), memory_check=False)          # runs here: no error
    spec = SweepSpec(**{**DEMO_SPEC, "overrides": ["train.device=cuda"]})
    first = spec.cells()[0].id
    with pytest.raises(ConfigError, match=rf"^cell {first}: train\.device=cuda but no CUDA"):
        check_spec_here(spec, memory_check=False)


def test_references_and_claims_are_validated_and_no_part_of_the_identity() -> None:
    refs = [{"arm": "ssn", "p": 0.1, "pct": 0.6}, {"arm": "ssn", "strategy": "drop", "p": 0.1,
                                                  "pct": 3.4}]
    spec = SweepSpec(**DEMO_SPEC, references=refs, claims=["a", "c"])
    assert spec.reference_values() == {("ssn", "skip", 0.1): 0.6, ("ssn", "drop", 0.1): 3.4}
    assert SweepSpec(**DEMO_SPEC).reference_values() is None            # the blog's
    assert spec.identity() == SweepSpec(**DEMO_SPEC).identity()          # what runs is the same
    again = SweepSpec.model_validate_json(spec.model_dump_json())         # as the form sends it
    assert again.references == spec.references and again.claims == ["a", "c"]
    for bad, needle in (([{"arm": "x", "p": 0.1, "pct": 1}], "references.0.arm"),
                        ([{"arm": "ssn", "p": 0, "pct": 1}], "references.0.p"),
                        ([{"arm": "ssn", "p": 0.1, "pct": 1, "seed": 2}], "references.0.seed"),
                        (refs[:1] * 2, "two references for ssn/skip at p = 0.1")):
        with pytest.raises(ValidationError, match=re.escape(needle)):
            SweepSpec(**DEMO_SPEC, references=bad)
    for bad, needle in ((["f"], "claims.0"), ([], "decides no claim"), (["a", "a"], "twice")):
        with pytest.raises(ValidationError, match=re.escape(needle)):
            SweepSpec(**DEMO_SPEC, claims=bad)


def test_run_seeds_runs_some_seeds_of_the_same_sweep() -> None:
    grid = [{"arms": ["ssn"], "strategies": ["skip"], "p": [0.1]},
            {"arms": ["mapl"], "strategies": ["skip"], "p": [0.1], "seeds": [0, 5]}]
    spec = SweepSpec(grid=grid, seeds=[0, 1])
    part = spec.model_copy(update={"run_seeds": [5]})
    assert part.identity() == spec.identity()                   # one sweep in the registry
    assert [c.id for c in part.runs_now()] == ["mapl-base-s5", "mapl-skip-p0.1-s5"]
    assert spec.runs_now() == spec.cells()
    with pytest.raises(ValidationError, match=r"run_seeds \[7\] are not among the spec's seeds"):
        SweepSpec(grid=grid, seeds=[0, 1], run_seeds=[1, 7])


def test_demo_options_add_to_the_demos_overrides() -> None:
    """`crucible sweep --demo --set k=v`: the demo's own settings stay, the option's come after
    them (and win where both name a key); other options replace the demo's value."""
    from cli.flows import _spec_from_options

    spec = _spec_from_options(True, {"overrides": ["train.lr=0.002"], "seeds": [4, 5]})
    assert spec.overrides == [*DEMO_SPEC["overrides"], "train.lr=0.002"]
    assert spec.seeds == [4, 5] and spec.preset == DEMO_SPEC["preset"]
    assert _spec_from_options(False, {"overrides": ["replicas=2"]}).overrides == ["replicas=2"]
