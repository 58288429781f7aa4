"""benchmarks.sim_throughput end to end on a tiny run: the reference scores the held-out windows
whenever the trainer does (with the trainer's own evaluation arguments passed through), and every
phase is timed."""
from pathlib import Path

import pytest

from benchmarks.sim_throughput import interval_text, main, measure, ratio_interval


def test_a_mapl_run_and_its_reference_finish_with_every_phase_timed(tmp_path: Path) -> None:
    result = measure("smoke", arms=["mapl"], repeats=1, global_steps=1, phases=True,
                     scratch=tmp_path)
    arm = result["arms"]["mapl"]
    assert result["worst_arm"] == "mapl" and len(arm["ratios"]) == 1 and arm["ratio"] > 0
    # one pair: its ratio is the mean, and there is no spread for an interval
    assert arm["interval"] == {"mean": pytest.approx(arm["ratio"]), "lo": None, "hi": None, "n": 1}
    assert arm["crucible_tokens_per_s"] > 0 and arm["reference_tokens_per_s"] > 0
    phases = arm["phases_s"]
    assert {"inner_steps", "outer_sync", "evaluate", "other", "total"} <= set(phases)
    assert phases["evaluate"] > 0 and phases["inner_steps"] > 0
    assert phases["total"] >= phases["inner_steps"] + phases["evaluate"]


def test_the_pairs_interval_is_students_t_over_the_pairs() -> None:
    # two pairs 0.1 apart: sd 0.0707, t(0.975, 1) = 12.706, half-width 12.706 * 0.05 = 0.635
    interval = ratio_interval([0.9, 1.0])
    assert interval["n"] == 2 and interval["mean"] == pytest.approx(0.95)
    assert interval["hi"] - interval["mean"] == pytest.approx(0.6353, abs=1e-4)
    assert interval["mean"] - interval["lo"] == pytest.approx(0.6353, abs=1e-4)
    # more pairs with the same spread narrow it (t falls and sqrt(n) grows)
    assert ratio_interval([0.9, 1.0] * 4)["hi"] < interval["hi"]
    assert interval_text(interval) == "0.950 [0.315, 1.585]"
    assert interval_text(ratio_interval([0.9])) == "0.900 [-]"


@pytest.mark.parametrize("argv, named", [
    (["--arms", ","], "--arms"), (["--arms", "fast"], "unknown arm"),
    (["--repeats", "0"], "--repeats"), (["--global-steps", "-1"], "--global-steps"),
    (["--threads", "0"], "--threads")])
def test_a_bad_argument_exits_2_naming_it(argv: list[str], named: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and named in capsys.readouterr().err
