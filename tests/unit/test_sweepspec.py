"""SweepSpec: validation messages and grid expansion with shared baselines."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.spec import BASELINE_STRATEGY, DEMO_SPEC, SweepSpec, expand_grid


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
    cells = expand_grid(spec)
    baselines = [c for c in cells if c.is_baseline]
    faulty = [c for c in cells if not c.is_baseline]
    assert len(baselines) == 2 * 2                       # arm x seed
    assert len(faulty) == 2 * 3 * 2 * 2                  # arm x strategy x p>0 x seed
    assert len(set(cells)) == len(cells)
    assert {c.baseline for c in faulty} == set(baselines)
    assert all(c.strategy is None for c in baselines)


def test_duplicates_collapse() -> None:
    spec = SweepSpec(arms=["ssn", "ssn"], strategies=["skip", "skip"],
                     failure_probabilities=[0.1, 0.1], seeds=[3, 3])
    assert len(expand_grid(spec)) == 2


def test_cell_overrides_pin_the_cell_after_extras() -> None:
    spec = SweepSpec(overrides=["faults.p=0.9", "replicas=2"], global_steps=3, duration=2)
    baseline = expand_grid(spec)[0]
    items = baseline.overrides(spec)
    assert items[:2] == ["faults.p=0.9", "replicas=2"]
    assert items[-5:] == ["pipeline.compression=ssn", "faults.p=0.0",
                          f"faults.strategy={BASELINE_STRATEGY}", "faults.duration=2", "seed=0"]
    assert "train.global_steps=3" in items


def test_schema_renders_dropdowns_and_descriptions() -> None:
    schema = SweepSpec.model_json_schema()
    props = schema["properties"]
    assert all(prop.get("description") for prop in props.values())
    assert props["preset"]["enum"] == ["smoke", "small", "study", "study-d128", "paper-178m"]
    assert props["arms"]["items"]["enum"] == ["none", "ssn", "mapl"]


def test_demo_spec_is_the_advertised_grid() -> None:
    cells = SweepSpec(**DEMO_SPEC).cells()
    assert len(cells) == 2 * 2 * 2 + 2


def test_a_sweep_stored_before_claims_and_precision_keeps_its_identity():
    from flows.spec import identity_of

    spec = SweepSpec(**DEMO_SPEC)
    stored_today = spec.model_dump(mode="json")
    older = {k: v for k, v in stored_today.items()            # what an earlier release stored
             if k not in ("close_margin", "equivalence_margin", "target_half_width",
                          "max_seeds")}
    assert identity_of(older) == identity_of(stored_today) == spec.identity()
    # a new target or margins is another reading of the same runs: the same sweep
    assert SweepSpec(**DEMO_SPEC, target_half_width=0.2).identity() == spec.identity()
    # a seed budget changes what runs: another sweep; and with one, so does the target
    assert SweepSpec(**DEMO_SPEC, max_seeds=4).identity() != spec.identity()
    assert (SweepSpec(**DEMO_SPEC, max_seeds=4, target_half_width=0.2).identity()
            != SweepSpec(**DEMO_SPEC, max_seeds=4).identity())
    with pytest.raises(ValueError, match="max_seeds"):
        SweepSpec(**{**DEMO_SPEC, "seeds": [0, 1, 2]}, max_seeds=2)
