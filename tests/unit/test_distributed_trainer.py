"""The distributed worker's trainer is the simulator's `Trainer` holding one replica row: the
same constructor (one row of everything) and the same rejoin resets, applied to its own row and
reported under the run's replica index. No processes here (tests/integration/test_distributed.py
runs real ones)."""
from __future__ import annotations

import json

import torch

from crucible.config import apply_overrides
from crucible.distributed.worker import ReplicaTrainer
from crucible.events import JsonlCallback, NullCallback
from crucible.faults import FaultPlan
from crucible.presets import get_preset
from crucible.store import LocalStore
from crucible.sync import OuterSync
from crucible.train import Trainer


def test_one_row_of_the_simulators_trainer(tmp_path):
    config = apply_overrides(get_preset("smoke"), ["replicas=3", "pipeline.compression=mapl",
                                                   "faults.strategy=skip"])
    plan = FaultPlan().down(replica=2, stage=1, start=0, steps=1).down(
        replica=0, stage=1, start=0, steps=1)
    trainer = ReplicaTrainer(config, replica=2, store=LocalStore(tmp_path / "store"),
                             run_key="run", callback=JsonlCallback(tmp_path / "out"),
                             device=torch.device("cpu"), plan=plan)
    assert (trainer.R, trainer.replica_ids) == (1, [2])
    assert trainer.model.R == 1 and trainer.counters.inner_steps.shape == (1, 4)
    assert isinstance(trainer.sync, OuterSync) and trainer.sync.replica == 2
    assert trainer.plan is plan
    # the simulator's initial global weights and replica 2's data stream
    sim = Trainer(config, store=LocalStore(tmp_path / "sim"), run_key="sim",
                  callback=NullCallback(), plan=plan)
    for ours, theirs in zip(trainer.sync.global_weights, sim.sync.global_weights, strict=True):
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ids, targets = trainer.data.batches(replicas=1, batch_size=2)
    sim_ids, sim_targets = sim.data.batches(replicas=3, batch_size=2)
    assert torch.equal(ids[0], sim_ids[2]) and torch.equal(targets[0], sim_targets[2])

    # state to forget: AdamW moments and step, error feedback, Stiefel momentum of stage 1
    trainer.optimizer.steps.fill_(5)
    for stage in (0, 1):
        trainer.stiefel_momentum[stage].fill_(1.0)
        for buf in trainer.sync.errors[stage].values():
            buf.fill_(1.0)
    trainer._apply_rejoins(1)       # replica 2's stage 1 and replica 0's stage 1 rejoin
    trainer.callback.flush()
    assert int(trainer.optimizer.steps[0, 1]) == 0 and int(trainer.optimizer.steps[0, 0]) == 5
    assert not trainer.stiefel_momentum[1].any() and trainer.stiefel_momentum[0].all()
    assert all(not buf.any() for buf in trainer.sync.errors[1].values())
    assert all(buf.all() for buf in trainer.sync.errors[0].values())
    events = [json.loads(x) for x in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["replica"], e["stage"], e["detail"]["reset"]) for e in events] == [
        ("rejoin", 2, 1, ["adamw_moments", "adamw_step", "error_feedback", "stiefel_momentum"])]
