"""Distributed-mode configuration: the round deadline is validated, and what a replica process
cannot run is refused before anything starts, naming the key and the alternative."""
from __future__ import annotations

import pytest

from crucible.config import ConfigError, apply_overrides
from crucible.distributed.worker import check_distributed
from crucible.presets import get_preset


def test_round_timeout_has_a_default_and_is_validated() -> None:
    assert get_preset("smoke").sparseloco.round_timeout_s == 60.0
    for bad in ("0", "-1", "1e9"):
        with pytest.raises(ConfigError, match="sparseloco.round_timeout_s"):
            apply_overrides(get_preset("smoke"), [f"sparseloco.round_timeout_s={bad}"])


@pytest.mark.parametrize("override", [
    "faults.strategy=reroute", "faults.strategy=drop_extend", "sparseloco.method=ddp",
    "sparseloco.method=diloco", "store.keep_rounds=2", "train.checkpoint_every=5"])
def test_what_a_replica_process_cannot_run_is_refused(override: str) -> None:
    config = apply_overrides(get_preset("smoke"), [override, "faults.p=0.1"])
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        check_distributed(config)


@pytest.mark.parametrize("strategy", ["skip", "drop"])
def test_in_replica_strategies_are_accepted(strategy: str) -> None:
    check_distributed(apply_overrides(get_preset("smoke"), [f"faults.strategy={strategy}",
                                                            "faults.p=0.1"]))
