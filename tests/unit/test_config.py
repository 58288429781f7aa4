import dataclasses

import pytest

from crucible.config import Config, ConfigError, StoreConfig, apply_overrides
from crucible.presets import PRESETS, get_preset
from crucible.store import parse_store_url


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


@pytest.mark.parametrize("key, nearest", [
    ("fault.p", "faults.p"),                    # misspelled section
    ("faults.strat", "faults.strategy"),        # misspelled leaf
    ("pipline.stages", "pipeline.stages"),
    ("train.globalsteps", "train.global_steps"),
    ("replica", "replicas"),                    # a top-level key
])
def test_unknown_key_suggests_the_nearest_valid_one(key, nearest):
    with pytest.raises(ConfigError, match=rf"unknown key '{key}'; did you mean {nearest}\?"):
        apply_overrides(get_preset("smoke"), [f"{key}=1"])


def test_unknown_key_in_a_mapping_suggests_the_nearest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown key 'model.d_modle'; did you mean "
                                          r"model.d_model\?"):
        Config.from_dict({"model": {"d_modle": 32}})


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
    with pytest.raises(ConfigError, match=r"choose one of: smoke, small, study, study-d128, paper-178m"):
        get_preset("huge")


@pytest.mark.parametrize("override, needle", [
    ("store.url=file://relative", "store.url='file://relative': a file URL needs an absolute path"),
    ("store.url=s3://", "store.url='s3://': an S3 URL needs a bucket"),
    ("store.url=s3://bucket:9000/x", "'bucket:9000' is not a bucket name"),
    ("store.url=s3://bucket/../x", "bad key prefix"),
    ("store.url=file:///proc/self", "store.url='file:///proc/self' is inside a system "
                                    "pseudo-filesystem"),
    ("store.url=file:///sys/fs", "pseudo-filesystem"),
    ("store.url=http://x", "store.url='http://x' is not supported"),
    ("store.endpoint_url=notaurl", "store.endpoint_url='notaurl' is not an http(s) URL"),
    ("store.endpoint_url=ftp://host", "store.endpoint_url='ftp://host' is not an http(s) URL"),
])
def test_store_location_is_checked_at_construction(override, needle):
    with pytest.raises(ConfigError) as caught:
        apply_overrides(get_preset("smoke"), [override])
    assert needle in str(caught.value)


@pytest.mark.parametrize("override, parsed", [
    # store.url as given, and the (scheme, location, key prefix) it names: the path normalised,
    # localhost dropped, the prefix without its slashes
    ("store.url=file:///var/crucible/store", ("file", "/var/crucible/store", "")),
    ("store.url=file://localhost/var/x", ("file", "/var/x", "")),
    ("store.url=s3://bucket", ("s3", "bucket", "")),
    ("store.url=s3://my.bucket/a/b/", ("s3", "my.bucket", "a/b")),
    ("store.endpoint_url=http://127.0.0.1:9000", None),
    ("store.endpoint_url=https://acct.r2.cloudflarestorage.com", None),
])
def test_good_store_locations_are_accepted(override, parsed):
    preset = get_preset("smoke")
    cfg = apply_overrides(preset, [override])
    key, value = override.removeprefix("store.").split("=", 1)
    expected = {"url": None, "endpoint_url": None, "region": None, "keep_rounds": 0, key: value}
    assert dataclasses.asdict(cfg.store) == expected
    assert cfg.replace(store=StoreConfig()) == preset          # nothing but the store changed
    assert Config.from_dict(cfg.to_dict()).store == cfg.store  # and it survives the round trip
    if parsed is not None:
        assert parse_store_url(cfg.store.url) == parsed


def test_chunk_larger_than_the_codec_addresses_is_refused_up_front():
    # 12-bit chunk-local indices: a 128-edge chunk used to fail only in the first outer sync
    from crucible.sparseloco._chunking import MAX_CHUNK

    with pytest.raises(ConfigError, match=r"sparseloco.chunk=128 is too large.*\[1, 64\]"):
        apply_overrides(get_preset("smoke"), ["sparseloco.chunk=128"])
    assert MAX_CHUNK == 64
    apply_overrides(get_preset("smoke"), ["sparseloco.chunk=64"])


def test_more_global_steps_than_a_contribution_header_holds_are_refused():
    with pytest.raises(ConfigError, match="32-bit"):
        apply_overrides(get_preset("smoke"), {"train.global_steps": 2**32})
    # drop_extend can run (duration + 1) times longer than configured
    with pytest.raises(ConfigError, match="faults.duration"):
        apply_overrides(get_preset("smoke"), {"train.global_steps": 2**29,
                                              "faults.strategy": "drop_extend",
                                              "faults.duration": 8})
    apply_overrides(get_preset("smoke"), {"train.global_steps": 2**32 - 1})
