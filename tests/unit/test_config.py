import pytest

from crucible.config import ConfigError, apply_overrides
from crucible.presets import PRESETS, get_preset


def test_every_preset_defaults_to_eight_replicas_and_four_stages():
    for name in PRESETS:
        cfg = get_preset(name)
        assert (cfg.replicas, cfg.pipeline.stages) == (8, 4)
        assert cfg.model.layers % 4 == 0


def test_stages_must_divide_layers():
    with pytest.raises(ConfigError, match=r"pipeline.stages=3 must divide model.layers=4"):
        apply_overrides(get_preset("smoke"), ["pipeline.stages=3"])


def test_factor_must_divide_d_model():
    with pytest.raises(ConfigError, match=r"pipeline.factor=7 must divide model.d_model=64"):
        apply_overrides(get_preset("smoke"), ["pipeline.compression=ssn", "pipeline.factor=7"])


@pytest.mark.parametrize("p", ["-0.1", "1.5", "nan"])
def test_failure_probability_outside_unit_interval_is_refused(p):
    with pytest.raises(ConfigError, match=r"faults.p"):
        apply_overrides(get_preset("smoke"), [f"faults.p={p}"])


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'model.widht'.*model.d_model"):
        apply_overrides(get_preset("smoke"), ["model.widht=3"])


def test_enum_value_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"faults.strategy='jump'.*'skip' \| 'drop'"):
        apply_overrides(get_preset("smoke"), ["faults.strategy=jump"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"train.global_steps='ten' is not a valid int"):
        apply_overrides(get_preset("smoke"), ["train.global_steps=ten"])


def test_overrides_round_trip_through_dict():
    cfg = apply_overrides(get_preset("small"), ["faults.p=0.2", "pipeline.compression=mapl",
                                                "store.url=s3://bucket/prefix"])
    assert cfg.faults.p == 0.2 and cfg.pipeline.compression == "mapl"
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


def test_unknown_preset_lists_names():
    with pytest.raises(ConfigError, match=r"choose one of: smoke, small, study, paper-178m"):
        get_preset("huge")
