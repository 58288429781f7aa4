"""The verdict of an inner step in the pipeline mode: a replica's first stage decides, from the
gradient norms every stage sends it, whether the step completed (the clipping factor) or runs
again, and every live stage of the replica must take that one outcome, whatever deaths the
launcher reports meanwhile.

A real stage process's worker (stage 1 of replica 0, of 4 stages) runs its inner steps in a
thread, over real ZeroMQ links; the test plays its peers (the first stage, the stages after it)
and the launcher with hand-made messages, timed into the window between the stage's norms and
its verdict, which a real `kill -9` hits only by chance.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from crucible.config import apply_overrides
from crucible.distributed.pipeline.launch import free_ports
from crucible.distributed.pipeline.links import (
    LAUNCHER,
    Expect,
    Inbox,
    LinkCounters,
    LinkTimeout,
    Outbox,
)
from crucible.distributed.pipeline.stage import StageWorker
from crucible.faults import FaultPlan
from crucible.presets import get_preset
from crucible.strategy import plan_step

pytestmark = pytest.mark.timeout(120)

R, S, ME = 2, 4, (0, 1)         # the worker: stage 1 of replica 0


class _Peers:
    """The worker's replica-mates and the launcher, played by the test: an inbox at each
    address the worker sends to, and an outbox per identity (each its own connection)."""

    def __init__(self, worker: StageWorker, addresses: dict[str, str]) -> None:
        self.worker, self.addresses = worker, addresses
        self.context = zmq.Context()
        self.inboxes = {t: Inbox(self.context, addresses[f"0,{t}"], LinkCounters(),
                                 max_bytes=1 << 20) for t in (0, 2, 3)}
        self.outboxes: dict[tuple[int, int], Outbox] = {}

    def send(self, src: tuple[int, int], kind: str, *, v: int = 0, h: int = 0, **tensors):
        box = self.outboxes.setdefault(src, Outbox(self.context, src, LinkCounters()))
        box.send(self.addresses["0,1"], kind, g=0, h=h, m=0, owner=0, v=v, tensors=tensors)

    def verdict(self, src: tuple[int, int], coef: float, *, h: int = 0) -> None:
        self.send(src, "clip", h=h, coef=torch.full((1,), coef),
                  dead=torch.zeros(S, dtype=torch.uint8))

    def death(self, stage: int) -> None:
        box = self.outboxes.setdefault(LAUNCHER, Outbox(self.context, LAUNCHER, LinkCounters()))
        box.send(self.addresses["0,1"], "ctl", g=0, h=0, m=0, tensors={},
                 control={"event": "dead", "replica": 0, "stage": stage, "round": 0,
                          "gone": False})
        deadline = time.monotonic() + 30
        while (0, stage) not in self.worker.deaths:     # the worker has read the notice
            assert time.monotonic() < deadline, "the worker never read the death notice"
            time.sleep(0.01)

    def run_step_zero(self) -> None:
        """The forward and backward of inner step 0 reach the worker; returns when its norms
        have reached the first stage (it then waits for the verdict)."""
        act = self.worker._act_expect()["message"]
        self.send((0, 0), "act", message=torch.randn(act.shape))
        self.send((0, 2), "grad", message=torch.randn(act.shape) * 1e-3)
        self.inboxes[0].receive("norms", ME, g=0, h=0, m=0, owner=0, v=0,
                                expect={"norms": Expect(torch.float32,
                                                        (self.worker.adamw_counts[1],))},
                                timeout_s=30)

    def report(self, stage: int) -> float:
        """The coef of what the worker reported to sibling `stage` for step 0, attempt 0."""
        got = self.inboxes[stage].receive("clip", ME, g=0, h=0, m=0, owner=0, v=0,
                                          expect=self.worker._verdict_expect(), timeout_s=30)
        return float(got.tensors["coef"][0])

    def close(self) -> None:
        for box in self.outboxes.values():
            box.close()
        for inbox in self.inboxes.values():
            inbox.close()
        self.context.term()


@pytest.fixture()
def replica(tmp_path: Path, request):
    """(worker, peers, run): the worker of stage 1 of replica 0 under `request.param` (the
    strategy), and `run()` starting its round-0 inner steps in a thread (joined on return)."""
    config = apply_overrides(get_preset("smoke"), [
        f"replicas={R}", f"pipeline.stages={S}", "pipeline.compression=none",
        "train.device=cpu", f"faults.strategy={request.param}"])
    ports = free_ports(R * S)
    addresses = {f"{r},{s}": f"tcp://127.0.0.1:{ports[r * S + s]}"
                 for r in range(R) for s in range(S)}
    (tmp_path / "run.json").write_text(json.dumps({
        "mode": "pipeline", "run_key": "run-verdicts", "store_url": (tmp_path / "store").as_uri(),
        "config": config.to_dict(), "plan": FaultPlan().to_list(), "addresses": addresses,
        "micro_batches": 1, "link_timeout_s": 20.0}))
    worker = StageWorker(tmp_path, *ME)
    peers = _Peers(worker, addresses)
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    def inner_steps() -> None:
        try:
            worker._inner_steps(0)
        except BaseException as exc:   # noqa: BLE001 - the test reports it
            errors.append(exc)

    def run() -> threading.Thread:
        thread = threading.Thread(target=inner_steps, daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    yield worker, peers, run
    for thread in threads:
        thread.join(timeout=60)
    worker.close()
    peers.close()
    assert not errors, errors


def _steps_taken(worker: StageWorker) -> int:
    return int(worker.optimizer.steps.sum())


@pytest.mark.parametrize("replica", ["drop"], indirect=True)
def test_a_complete_verdict_that_arrives_after_the_replica_dropped_is_still_taken(
        replica) -> None:
    """Drop: stage 2 sent its norms and died; the first stage, not yet told, answered
    "complete" and stepped. A stage told of the death before the verdict reached it must step
    too (before the fix it dropped the step: its replica's stages disagreed on it)."""
    worker, peers, run = replica
    thread = run()
    peers.run_step_zero()
    peers.death(2)                      # the replica drops: the notice lands first
    peers.verdict((0, 0), 0.5)          # then the first stage's "complete"
    thread.join(timeout=60)
    assert _steps_taken(worker) == 1    # inner step 0 taken, as the first stage took it
    assert worker.dropped == worker.H - 1   # the rest of the round dropped
    # and its replica's contribution to the round is dropped, as at every stage that dropped
    assert worker.round_dropped
    assert not bool(worker._contributes(0, plan_step(worker.plan, 0, config=worker.config))[0].any())


@pytest.mark.parametrize("replica", ["skip"], indirect=True)
def test_when_the_first_stage_dies_the_survivors_take_the_verdict_one_of_them_got(
        replica) -> None:
    """The first stage answered stage 2 "complete" and died before answering this stage: the
    survivors tell each other what they hold, and this stage takes stage 2's verdict; it
    reports that it held none."""
    worker, peers, run = replica
    thread = run()
    peers.run_step_zero()
    peers.verdict((0, 2), 0.5)          # stage 2's report: it took the first stage's verdict
    peers.verdict((0, 3), -2.0)         # stage 3's: it had none
    peers.death(0)
    thread.join(timeout=60)
    assert _steps_taken(worker) == 1
    assert peers.report(2) == peers.report(3) == -2.0


@pytest.mark.parametrize("replica", ["skip"], indirect=True)
def test_once_a_stage_reported_no_verdict_a_late_one_from_the_dead_first_stage_is_not_used(
        replica) -> None:
    """Its siblings may have decided on its report: the first stage's own copy, arriving
    after the notice of its death, is left unused, and with no survivor holding one the step
    is not taken."""
    worker, peers, run = replica
    thread = run()
    peers.run_step_zero()
    peers.death(0)
    assert peers.report(2) == -2.0      # it told its siblings it holds none
    peers.verdict((0, 0), 0.5)          # the dead stage's copy, still on the wire
    peers.verdict((0, 2), -2.0)
    peers.verdict((0, 3), -2.0)
    thread.join(timeout=60)
    assert _steps_taken(worker) == 0
    assert worker.dropped == worker.H


@pytest.mark.parametrize("replica", ["skip"], indirect=True)
def test_a_stage_that_took_the_verdict_reports_it_when_the_first_stage_dies(replica) -> None:
    worker, peers, run = replica
    thread = run()
    peers.run_step_zero()
    peers.verdict((0, 0), 0.5)
    deadline = time.monotonic() + 30
    while _steps_taken(worker) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    peers.death(0)
    thread.join(timeout=60)
    assert peers.report(2) == peers.report(3) == 0.5   # a sibling still waiting can take it


@pytest.mark.parametrize("replica", ["skip"], indirect=True)
def test_a_sibling_that_never_reports_is_a_link_timeout_not_a_hang(replica) -> None:
    worker, _peers, _run = replica
    worker.timeout_s = 1.0
    worker.position = (0, 0, 0)
    worker.reported[(0, 0, 0)] = None   # it holds none, and neither sibling ever answers
    with pytest.raises(LinkTimeout, match="did not report"):
        worker._survivors_verdict(0, 0)
