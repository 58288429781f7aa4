"""The pieces around SweepSpec: run fingerprints, error classification, per-run store URLs."""
from __future__ import annotations

import httpx
import pytest

from crucible.config import ConfigError, apply_overrides
from crucible.grid.spec import PRESET_NAMES
from crucible.presets import PRESETS, get_preset
from crucible.registry.identity import code_version, config_fingerprint
from crucible.registry.reporting import ApiUnavailable, describe
from crucible.store import TransientStoreError
from crucible.train import TrainingDiverged
from flows.errors import SimulatedCrash, is_transient
from flows.run_flow import resolve_config, run_store_url


def test_spec_presets_match_the_library() -> None:
    assert set(PRESET_NAMES) == set(PRESETS)


def test_fingerprint_ignores_the_store_but_not_the_numbers() -> None:
    base = get_preset("smoke")
    moved = apply_overrides(base, ["store.url=s3://bucket/elsewhere"])
    reseeded = apply_overrides(base, ["seed=1"])
    assert config_fingerprint(base) == config_fingerprint(moved)
    assert config_fingerprint(base) != config_fingerprint(reseeded)
    assert len(config_fingerprint(base)) == 64


def test_fingerprint_ignores_the_distributed_round_deadline() -> None:
    """A wall-clock deadline of the distributed mode changes no simulated number: the
    fingerprint (a sweep's skip key, a run's store folder) stays the same."""
    base = get_preset("smoke")
    patient = apply_overrides(base, ["sparseloco.round_timeout_s=600"])
    assert config_fingerprint(base) == config_fingerprint(patient)
    assert config_fingerprint(base) != config_fingerprint(
        apply_overrides(base, ["sparseloco.topk=32"]))


def test_code_version_names_the_package_version() -> None:
    import crucible
    assert code_version().startswith(crucible.__version__)


def test_each_run_gets_its_own_store_prefix() -> None:
    assert run_store_url(None, "ab" * 32) is None
    assert run_store_url("s3://b/p/", "ab" * 32) == "s3://b/p/runs/" + "ab" * 8
    config = resolve_config("smoke", ["seed=3"], "s3://bucket/x", "http://127.0.0.1:9000")
    assert config.store.url == f"s3://bucket/x/runs/{config_fingerprint(config)[:16]}"
    assert config.store.endpoint_url == "http://127.0.0.1:9000"
    assert config.seed == 3


def test_bad_override_names_the_key() -> None:
    with pytest.raises(ConfigError, match="faults.p"):
        resolve_config("smoke", ["faults.p=1.5"])


def _status_error(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://x")
    return httpx.HTTPStatusError("boom", request=request,
                                 response=httpx.Response(code, request=request))


@pytest.mark.parametrize("exc", [
    SimulatedCrash("x"), httpx.ConnectError("refused"), TransientStoreError("503"),
    ApiUnavailable(0, "down"), ConnectionResetError(), _status_error(503), _status_error(429),
])
def test_transient_errors_are_retried(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    ConfigError("bad"), TrainingDiverged("nan"), ValueError("x"), KeyError("k"),
    _status_error(404), _status_error(422),
])
def test_deterministic_errors_are_not_retried(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_deterministic_error_wins_over_a_transient_cause() -> None:
    try:
        try:
            raise ConnectionError("blip")
        except ConnectionError as inner:
            raise TrainingDiverged("nan") from inner
    except TrainingDiverged as exc:
        assert not is_transient(exc)


def test_error_from_a_transient_cause_is_transient() -> None:
    try:
        try:
            raise TransientStoreError("slow down")
        except TransientStoreError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as exc:
        assert is_transient(exc)


def test_describe_is_one_line_with_the_type() -> None:
    assert describe(TrainingDiverged("loss nan\nmore")) == "TrainingDiverged: loss nan"
    assert describe(KeyError()) == "KeyError"


def test_device_claims_never_share_an_index(tmp_path) -> None:
    from contextlib import ExitStack

    from flows.gpu import claim_device_index

    with claim_device_index(1, tmp_path) as single:
        assert single is None                      # nothing to choose on a 0/1-device host
    with ExitStack() as stack:
        held = [stack.enter_context(claim_device_index(3, tmp_path)) for _ in range(3)]
        assert sorted(held) == [0, 1, 2]
    with claim_device_index(3, tmp_path) as again:
        assert again == 0                          # released on exit
