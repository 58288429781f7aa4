"""The pipeline mode against the simulator: every stage of every replica its own process, the
boundary messages over real ZeroMQ links, the outer round through the store, the fault plan's
stage failures as real kills and restarts; the same bits as `crucible run`.

Tolerance: none. A stage process runs the simulator's kernels on its stage's one replica row, and
the three places where a split pipeline would round otherwise are made the simulator's: a tensor
crosses a link with its memory layout (a MAPL basis is column-major, and a product rounds
otherwise on a row-major copy), the clipping norm is reduced at the simulator's width from the
norms every stage of the replica sends, and a MAPL boundary's Stiefel step runs in a batch of
the simulator's shape. Both sides run one torch thread on this machine (tests/conftest.py; the
stage processes' default), so final global weights and validation losses compare with
`torch.equal` / `==`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crucible.config import apply_overrides
from crucible.distributed.pipeline.launch import launch_pipeline
from crucible.faults import FaultPlan
from crucible.model_file import load_global_weights
from crucible.presets import get_preset
from crucible.train import train

pytestmark = pytest.mark.timeout(600)

# replica 0 loses stage 1 for steps 1-2 (replica 1 can donate it), replica 1 stage 1 at step 2
# (both down: reroute falls back to skipping it) and stage 2 for steps 3-4
PLAN = (FaultPlan().down(replica=0, stage=1, start=1, steps=2)
        .down(replica=1, stage=1, start=2, steps=1).down(replica=1, stage=2, start=3, steps=2))


def _config(arm: str, strategy: str | None, steps: int = 6):
    faults = ["faults.p=0.1", f"faults.strategy={strategy}"] if strategy else []
    return apply_overrides(get_preset("smoke"), [
        "replicas=2", f"pipeline.compression={arm}", f"train.global_steps={steps}",
        "train.eval_every=3", "train.eval_tokens=8192", "train.device=cpu",
        "pipeline.bypass_decode=sender", *faults])


def _agree(arm: str, strategy: str | None, tmp_path: Path) -> dict:
    config = _config(arm, strategy)
    plan = PLAN if strategy else FaultPlan()
    sim = train(config, out_dir=tmp_path / "sim", plan=plan)
    pipe = launch_pipeline(config, out_dir=tmp_path / "pipe", plan=plan, link_timeout_s=120)
    assert pipe["pipeline"]["replicas_agree"]
    assert [e["global_step"] for e in pipe["evals"]] == [e["global_step"] for e in sim["evals"]]
    assert [e["val_loss"] for e in pipe["evals"]] == [e["val_loss"] for e in sim["evals"]]
    a = load_global_weights(tmp_path / "sim" / "model.pt")
    b = load_global_weights(tmp_path / "pipe" / "model.pt")
    differ = [(s, n) for s in range(len(a)) for n in a[s] if not torch.equal(a[s][n], b[s][n])]
    assert not differ, differ
    assert pipe["pipeline"]["links"]["refused"] == 0
    return pipe


def _lives(pipe: dict) -> dict[tuple[int, int], int]:
    return {(s["replica"], s["stage"]): s["lives"] for s in pipe["pipeline"]["stages"]}


def test_mapl_at_p0_ends_on_the_simulators_bits(tmp_path: Path) -> None:
    pipe = _agree("mapl", None, tmp_path)
    assert set(_lives(pipe).values()) == {1}


def test_planned_stage_failures_are_real_kills_and_end_on_the_simulators_bits(
        tmp_path: Path) -> None:
    pipe = _agree("ssn", "reroute", tmp_path)
    # every planned failure killed its process once, and it came back
    assert _lives(pipe) == {(r, s): 2 if (r, s) in {(0, 1), (1, 1), (1, 2)} else 1
                            for r in range(2) for s in range(4)}
    journal = [json.loads(line) for line in
               (tmp_path / "pipe" / "stages" / "r0-s1" / "process.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["global_step"]) for r in journal][:4] == [
        ("start", 0), ("kill", 1), ("restart", 1), ("rejoin", 3)]


def test_the_boundary_bytes_shrink_by_the_compression_factor(tmp_path: Path) -> None:
    payload, total = {}, {}
    for arm in ("none", "ssn"):
        config = _config(arm, None, steps=1)
        pipe = launch_pipeline(config, out_dir=tmp_path / arm, link_timeout_s=120)
        payload[arm] = pipe["pipeline"]["links"]["sent_payload"]["act"]
        total[arm] = pipe["pipeline"]["links"]["sent_bytes"]["act"]
    # every forward crossing: 2 replicas x 4 inner steps x 3 boundaries, 4 x 32 tokens each;
    # uncompressed sends d = 64 fp32 values a token, SSN k = 8 and a one-byte token id
    crossings, tokens = 2 * 4 * 3, 4 * 32
    assert payload["none"] == crossings * tokens * 64 * 4
    assert payload["ssn"] == crossings * tokens * (8 * 4 + 1)
    assert total["none"] > payload["none"] and total["ssn"] > payload["ssn"]   # + headers


@pytest.mark.slow
@pytest.mark.parametrize("arm, strategy", [
    ("none", None), ("ssn", None),
    ("none", "skip"), ("ssn", "skip"), ("mapl", "skip"),
    ("none", "drop"), ("ssn", "drop"), ("mapl", "drop"),
    ("none", "reroute"), ("mapl", "reroute"),
])
def test_every_arm_and_strategy_ends_on_the_simulators_bits(arm, strategy,
                                                            tmp_path: Path) -> None:
    _agree(arm, strategy, tmp_path)
