"""benchmarks.sim_throughput end to end on a tiny run: the reference scores the held-out windows
whenever the trainer does (with the trainer's own evaluation arguments passed through), and every
phase is timed."""
from pathlib import Path

from benchmarks.sim_throughput import measure


def test_a_mapl_run_and_its_reference_finish_with_every_phase_timed(tmp_path: Path) -> None:
    result = measure("smoke", arms=["mapl"], repeats=1, global_steps=1, phases=True,
                     scratch=tmp_path)
    arm = result["arms"]["mapl"]
    assert result["worst_arm"] == "mapl" and len(arm["ratios"]) == 1 and arm["ratio"] > 0
    assert arm["crucible_tokens_per_s"] > 0 and arm["reference_tokens_per_s"] > 0
    phases = arm["phases_s"]
    assert {"inner_steps", "outer_sync", "evaluate", "other", "total"} <= set(phases)
    assert phases["evaluate"] > 0 and phases["inner_steps"] > 0
    assert phases["total"] >= phases["inner_steps"] + phases["evaluate"]
