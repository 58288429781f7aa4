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


def _config(arm: str, strategy: str | None, steps: int = 6, p: float = 0.1):
    faults = [f"faults.p={p}", f"faults.strategy={strategy}"] if strategy else []
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
    # the fault events the registry gets are the simulator's, one for one
    faults = {"failure_start", "bypass", "drop", "reroute"}
    assert _events(tmp_path / "pipe", faults) == _events(tmp_path / "sim", faults)
    return pipe


def _events(folder: Path, kinds: set[str]) -> list[tuple]:
    rows = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    return sorted((e["kind"], e["global_step"], e["replica"], e["stage"]) for e in rows
                  if e["kind"] in kinds)


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
    process = _events(tmp_path / "pipe", {"process_killed", "process_restarted",
                                          "process_rejoined"})
    assert [e for e in process if e[2:] == (0, 1)] == [
        ("process_killed", 1, 0, 1), ("process_rejoined", 3, 0, 1),
        ("process_restarted", 1, 0, 1)]
    assert len(process) == 3 * 3                       # three kills, each restarted, rejoined


@pytest.mark.slow
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


# -- real faults: kill -9 of a stage process at a moment the plan does not know -----------------

def _kill_during(config, tmp_path: Path, *, replica: int, stage: int, after_rounds: int,
                 offset_s: float, restarts: int = 3, hostile: bool = False) -> dict:
    """Run `config` in the pipeline mode and SIGKILL stage `stage` of replica `replica` from
    outside, `offset_s` after it recorded `after_rounds` rounds (mid-round); with `hostile`,
    also throw malformed messages at another stage's link."""
    import os
    import signal
    import threading
    import time

    import zmq

    out = tmp_path / "pipe"
    result: dict = {}

    def run() -> None:
        try:
            result["summary"] = launch_pipeline(config, out_dir=out, restarts=restarts,
                                                link_timeout_s=60)
        except BaseException as exc:   # noqa: BLE001 - the test reports it
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    rounds = out / "stages" / f"r{replica}-s{stage}" / "rounds.jsonl"
    deadline = time.monotonic() + 240
    while (not rounds.exists() or len(rounds.read_text().splitlines()) < after_rounds) \
            and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    time.sleep(offset_s)
    pid = int((rounds.parent / "pid").read_text())
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    if hostile:
        address = json.loads((out / "run.json").read_text())["addresses"]["1,2"]
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        sock.send_multipart([b"{not json"])
        sock.send_multipart([json.dumps({"kind": "act", "src": [1, 1], "g": 0, "h": 0, "m": 0,
                                         "owner": 1, "v": 0, "tensors": [
                                             {"name": "message", "dtype": "float32",
                                              "shape": [1, 4, 32, 64], "stride": [0, 0, 0, 0]}]}
                                        ).encode(), b"\0" * 10])
        sock.close()
        context.term()
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    summary["killed_at"] = killed_at
    return summary


def _journal(tmp_path: Path, replica: int, stage: int) -> list[dict]:
    path = tmp_path / "pipe" / "stages" / f"r{replica}-s{stage}" / "process.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_recovered(summary: dict, tmp_path: Path, replica: int, stage: int) -> None:
    pipe = summary["pipeline"]
    assert pipe["replicas_agree"]                      # every replica holds the same weights
    (notice,) = pipe["notices"]                        # one death, noticed once
    assert (notice["replica"], notice["stage"], notice["gone"]) == (replica, stage, False)
    assert notice["wall"] - summary["killed_at"] < 5.0
    kinds = [(r["kind"], r.get("planned")) for r in _journal(tmp_path, replica, stage)]
    assert kinds == [("start", None), ("kill", False), ("restart", None), ("rejoin", None)]
    rejoin = _journal(tmp_path, replica, stage)[-1]["global_step"]
    assert rejoin == notice["round"] + 1               # back at the next round boundary
    events = [json.loads(line) for line in
              (tmp_path / "pipe" / "events.jsonl").read_text().splitlines()]
    killed = [e for e in events if e["kind"] == "process_killed"]
    assert [(e["global_step"], e["replica"], e["stage"], e["detail"]["planned"])
            for e in killed] == [(notice["round"], replica, stage, False)]
    (rejoined,) = [e for e in events if e["kind"] == "process_rejoined"]
    assert 0 < rejoined["detail"]["seconds_after_kill"] < 60
    # it went on learning: the final loss is below the initial one
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_a_real_kill_of_an_inner_stage_mid_step_is_bypassed_live_under_skip(
        tmp_path: Path) -> None:
    summary = _kill_during(_config("none", "skip", p=0), tmp_path, replica=0, stage=1,
                           after_rounds=2, offset_s=0.05, hostile=True)
    _check_recovered(summary, tmp_path, 0, 1)
    # the malformed messages were refused and counted, and nothing crashed
    assert summary["pipeline"]["links"]["refused"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy, stage", [("drop", 2), ("reroute", 1), ("skip", 0),
                                             ("skip", 3)])
def test_a_real_kill_recovers_under_every_strategy_and_at_the_ends(strategy, stage,
                                                                  tmp_path: Path) -> None:
    summary = _kill_during(_config("ssn", strategy, p=0), tmp_path, replica=1, stage=stage,
                           after_rounds=2, offset_s=0.05)
    _check_recovered(summary, tmp_path, 1, stage)


@pytest.mark.slow
def test_a_stage_that_never_returns_is_skipped_for_the_rest_of_the_run(tmp_path: Path) -> None:
    summary = _kill_during(_config("none", "skip", p=0), tmp_path, replica=0, stage=2,
                           after_rounds=2, offset_s=0.05, restarts=0)
    pipe = summary["pipeline"]
    assert [(x["replica"], x["stage"]) for x in pipe["lost"]] == [(0, 2)]
    (notice,) = pipe["notices"]
    assert notice["gone"] and pipe["replicas_agree"]
    rounds = [json.loads(line) for line in
              (tmp_path / "pipe" / "stages" / "r0-s1" / "rounds.jsonl").read_text().splitlines()]
    assert all(2 in r["bypassed"] for r in rounds if r["global_step"] > notice["round"])


@pytest.mark.slow
def test_every_replica_of_a_stage_killed_in_one_round_rejoins(tmp_path: Path) -> None:
    """Both replicas' stage 1 killed from outside in the same round: nobody trains stage 1 in
    that round, so nobody agrees it; the restarted lives restore the round before it (a
    restarted life once waited for that agreement until the link timeout) and the run ends
    with every stage-replica back, holding the same weights, on the failure schedule the
    simulator replays."""
    import threading

    from crucible.distributed.pipeline.chaos import Kill, Killer, realized_plan

    config = _config("none", "drop", steps=8, p=0.0)
    out = tmp_path / "pipe"
    result: dict = {}
    launch = threading.Thread(target=lambda: result.update(summary=launch_pipeline(
        config, out_dir=out, plan=FaultPlan(), link_timeout_s=40)))
    launch.start()
    killer = Killer(out, [Kill(replica=0, stage=1, global_step=3, fraction=0.0),
                          Kill(replica=1, stage=1, global_step=3, fraction=0.0)],
                    stages=4, alive=launch.is_alive)
    killer.start()
    launch.join()
    killer.join()
    assert killer.error is None
    assert [k["outcome"] for k in killer.done] == ["killed", "killed"], killer.done
    summary = result["summary"]
    assert summary["pipeline"]["replicas_agree"] and summary["pipeline"]["lost"] == []
    plan = realized_plan(out, replicas=2, stages=4, global_steps=8)
    assert {(f.replica, f.stage) for f in plan.failures} == {(0, 1), (1, 1)}
    assert len({f.start for f in plan.failures}) == 1, plan.to_list()
    for r in (0, 1):
        kinds = [x["kind"] for x in _journal(tmp_path, r, 1)]
        assert kinds[-3:] == ["kill", "restart", "rejoin"], kinds


@pytest.mark.slow
def test_a_reroute_donor_whose_replica_drops_takes_its_borrower_along(tmp_path: Path) -> None:
    """Under reroute replica 0 runs stage 1 on replica 1's (its own is down by plan); a real
    kill of replica 1's stage 2 drops replica 1 for the rest of the round, so its stage 1 serves
    nobody: replica 0 drops too instead of waiting for its donor until the link timeout (it
    once did, and the run failed).

    Replica 0 drops only if the death reaches it while it still has inner steps to run through
    the donor (a death after its last one drops nothing of its round). With the preset's 4
    inner steps a round's inner phase takes about 0.2 s (the rounds' `inner_s`), and a kill 30%
    into the round left it little time: on a loaded machine replica 0 once finished its inner
    steps before the death reached it. So these rounds have 16 inner steps and the kill comes
    10% in, leaving most of the inner phase after the notice."""
    import threading

    from crucible.distributed.pipeline.chaos import Kill, Killer

    config = apply_overrides(_config("none", "reroute", steps=7, p=0.0),
                             ["sparseloco.inner_steps=16"])
    plan = FaultPlan().down(replica=0, stage=1, start=2, steps=4)
    out = tmp_path / "pipe"
    result: dict = {}
    launch = threading.Thread(target=lambda: result.update(summary=launch_pipeline(
        config, out_dir=out, plan=plan, link_timeout_s=40)))
    launch.start()
    killer = Killer(out, [Kill(replica=1, stage=2, global_step=3, fraction=0.1)], stages=4,
                    alive=launch.is_alive)
    killer.start()
    launch.join()
    killer.join()
    assert killer.error is None and killer.done[0]["outcome"] == "killed", killer.done
    summary = result["summary"]
    assert summary["pipeline"]["replicas_agree"] and summary["pipeline"]["lost"] == []
    (notice,) = summary["pipeline"]["notices"]
    dropped = {(row["replica"], row["global_step"]) for row in
               (json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines())
               if row["dropped"]}
    assert {(0, notice["round"]), (1, notice["round"])} <= dropped, dropped
