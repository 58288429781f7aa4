"""The trainer: R replicas x S stages, H inner AdamW steps per global step, then the outer sync.

    global_step(g):
        draw faults          -> who is down, rejoin resets, what each strategy does about it
        inner steps (H)      -> every replica through its live stages (bypass / drop / reroute)
        outer sync           -> contributions -> agreed set -> aggregate -> outer step -> rejoin
        report               -> metrics, events, evaluation, checkpoint

`train(config, out_dir=...)` is the library entry point used by the CLI and the flows; it writes
`summary.json`, `metrics.jsonl` and `events.jsonl` into `out_dir` and checkpoints to the store.
The distributed worker's `ReplicaTrainer` is this `Trainer` holding one replica row (see the
class's docstring for its hooks). The evaluation methods live in `crucible.evaluation` (a mixin).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from crucible import boundary
from crucible.arithmetic import arithmetic
from crucible.checkpoint import checkpoint_limit, load_latest, save_checkpoint
from crucible.config import Config
from crucible.data import TokenData, check_token_budget, load_tokens, token_digest
from crucible.errors import TrainingDiverged
from crucible.evaluation import BASIS_WINDOWS, Evaluator, standard_error
from crucible.events import Callback, Event, JsonlCallback, Metric, MultiCallback
from crucible.faults import FaultPlan, plan_for
from crucible.ids import validate_id
from crucible.model_file import MODEL_FILE, save_global_weights
from crucible.optim import ReplicaAdamW, clip_per_replica, lr_at
from crucible.pipeline import ReplicatedPipeline, resolve_device
from crucible.presets import tokens_per_global_step
from crucible.progress import RunProgress
from crucible.store import Store, open_store
from crucible.strategy import StepPlan, fault_events, plan_step
from crucible.summary import RunCounters, write_json_atomic
from crucible.sync import OuterSync, StageSyncResult

__all__ = ["Trainer", "TrainingDiverged", "train", "resolve_device", "standard_error"]

log = logging.getLogger(__name__)


class Trainer:
    """One run. Construct, then `run()`; `global_step(g)` is one outer round.

    The simulator holds every replica (`replicas=None`). The distributed worker
    (`crucible.distributed.worker.ReplicaTrainer`) is this class holding one replica row: it
    passes `replicas=[r]` and its `device`, and overrides the hooks where a process that holds
    part of the run differs: `_data_view` and `_make_sync` (what the constructor builds),
    `_local_step` (its rows of the run-wide step plan), `_round_starts` / `_round_done` (around
    each outer round) and `_report_tokens`. Everything else, the rejoin resets included, is one
    implementation."""

    def __init__(self, config: Config, *, store: Store, run_key: str, callback: Callback,
                 plan: FaultPlan | None = None, device: torch.device | None = None,
                 replicas: Sequence[int] | None = None) -> None:
        """`replicas`: the run's replicas this trainer holds, one model row each, ascending
        (default: all of `config.replicas`); `device`: default `train.device` resolved. The fault
        plan is always the run's, drawn for all `config.replicas`."""
        self.config, self.store, self.run_key, self.callback = config, store, run_key, callback
        self.device = resolve_device(config.train.device) if device is None else device
        self.replica_ids = list(range(config.replicas)) if replicas is None else list(replicas)
        self.R, self.S, self.H = (len(self.replica_ids), config.pipeline.stages,
                                  config.sparseloco.inner_steps)
        tokens = load_tokens(config.data.path, vocab_size=config.model.vocab_size)
        data = TokenData(tokens, model=config.model, data=config.data,
                         replicas=config.replicas, seed=config.seed)
        self.data = self._data_view(data)
        check_token_budget(len(data.train),
                           budget=tokens_per_global_step(config) * config.train.global_steps,
                           data=config.data, preset=config.preset)
        local = config if self.R == config.replicas else config.replace(replicas=self.R)
        self.model = ReplicatedPipeline(local).to_device(self.device)
        self.optimizer = ReplicaAdamW([self.model.stage_params(s) for s in range(self.S)],
                                      self.model.layouts, train=config.train, replicas=self.R)
        self.stiefel_momentum = {s: torch.zeros_like(p["basis"]) for s in range(self.S)
                                 if "basis" in (p := self.model.stage_params(s))}
        self._stiefel_work = boundary.Workspace()   # the SPEL step's scratch, reused every step
        self.sync = self._make_sync()
        self.validation = data.validation(tokens=config.train.eval_tokens,
                                          batch_size=config.train.eval_batch_size)
        self.evaluator = Evaluator(self.model, self.validation, config, self.device)
        self.max_steps = self._max_steps()
        faults = config.faults
        self.plan = plan if plan is not None else plan_for(
            faults, seed=config.seed, replicas=config.replicas, stages=self.S,
            horizon=self.max_steps)
        self.plan.validate(replicas=config.replicas, stages=self.S)
        self.counters = RunCounters.empty(replicas=self.R, stages=self.S)
        self.next_step = 0
        # train.tail_average: the global weights summed over the last outer steps (float64)
        self.tail_sum: list[dict[str, torch.Tensor]] | None = None
        self.tail_count = 0

    # -- what a trainer holding part of the run overrides ----------------------------------------
    def _data_view(self, data: TokenData) -> Any:
        """The data this trainer draws its rows' micro-batches from (`batches(replicas=R)`)."""
        return data

    def _make_sync(self) -> OuterSync:
        """The outer round (called once the model is built)."""
        return OuterSync(self.config, self.model, store=self.store, run_key=self.run_key)

    def _local_step(self, step: StepPlan) -> StepPlan:
        """This trainer's rows of the run-wide step plan."""
        return step

    def _round_starts(self, g: int) -> None:
        """Called first in every global step."""

    def _round_done(self, g: int, step: StepPlan, results: list[StageSyncResult]) -> None:
        """Called after the outer round is counted, before the step's metrics."""

    def _report_tokens(self, g: int) -> None:
        """The run's `tokens` metric after global step g."""
        self.callback.metric(Metric("tokens", g, float(self.counters.tokens_processed),
                                    tokens=self.counters.tokens_processed))

    def _max_steps(self) -> int:
        steps = self.config.train.global_steps
        if self.config.faults.strategy == "drop_extend" and self.config.faults.p > 0:
            return steps * (self.config.faults.duration + 1) + self.config.faults.duration
        return steps

    # -- the loop --------------------------------------------------------------------------------
    def run(self, *, on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        if self.counters.initial_val_loss is None and self.config.train.eval_initial:
            eval_started = time.perf_counter()
            self.counters.initial_val_loss = self.evaluate()
            self.counters.timing["eval_s"] += time.perf_counter() - eval_started
            self.counters.evals.append({"global_step": 0, "tokens": 0,
                                        "val_loss": self.counters.initial_val_loss,
                                        "val_loss_stderr": self.last_eval_stderr})
            self.callback.metric(Metric("val_loss", 0, self.counters.initial_val_loss, tokens=0))
        budget = tokens_per_global_step(self.config) * self.config.train.global_steps
        while not self._finished(budget):
            self.global_step(self.next_step)
            self.next_step += 1
            self._add_to_tail()
            if on_step:
                on_step(self.next_step, self._target_steps(budget))
            self._maybe_evaluate(budget)
            self.callback.flush()
            self._maybe_checkpoint(started, budget)
        self.counters.wall_s += time.perf_counter() - started
        self.counters.timing.update({f"{k}_s": v for k, v in self.sync.codec_s.items()})
        summary = self.counters.summary(self.config, plan=self.plan.until(self.next_step),
                                        tokens_budget=budget, global_steps=self.next_step,
                                        synced_params=self.sync.param_count())
        summary["eval_tokens"] = self.eval_tokens
        if self.tail_count:
            summary.update(self.tail_evaluation())
        if self.config.pipeline.compression == "mapl":
            # only the final evaluation keeps taps (every evaluation drops the last one's), so
            # they are of these very weights (the tail evaluation puts the model's own back); a
            # run that did not evaluate at its end (resumed finished) has none, and the report
            # runs its own forward
            summary["mapl_bases"] = self.evaluator.basis_report(taps=self.evaluator.last_taps)
            self.evaluator.last_taps = None
        return summary

    def alignment(self, summary: dict[str, Any]) -> None:
        """Add the global model's alignment report (`crucible.alignment`) to `summary`, its
        seconds as `timing.alignment_s` (outside `wall_s`). Asked for by whoever needs it (a
        study's baselines: `train(..., alignment=True)`); it costs about 7% of a MAPL run."""
        from crucible.alignment import alignment_report
        summary["alignment"] = alignment_report(self.evaluator)
        summary.setdefault("timing", {})["alignment_s"] = summary["alignment"].pop("seconds")

    def tail_first_step(self) -> int:
        """The first outer step (1-based, as `next_step` counts them) whose global weights the
        tail average takes: the last ceil(tail_average x global_steps) of the planned steps
        (drop_extend: and every step it adds, so its tail is longer than its baseline's). MAPL's
        averaged bases are scored as they are, slightly off the Stiefel manifold."""
        share = self.config.train.tail_average
        steps = self.config.train.global_steps
        if share <= 0:
            return steps + 1
        # the float product, as the estimand pilot's runs took it (0.1 x 60 = 6 steps); a share
        # whose product rounds up (0.07 x 100 = 7.000000000000001: 8 steps) takes one step more:
        # the summary's tail_average.steps says how many
        return steps - max(1, math.ceil(share * steps)) + 1

    @torch.no_grad()
    def _add_to_tail(self) -> None:
        """After an outer step: add the global weights (replica row 0 holds them) to the tail
        sum, when the step is in the tail. Reads the weights only: training is unchanged."""
        if self.config.train.tail_average == 0 or self.next_step < self.tail_first_step():
            return
        weights = [self.model.replica_weights(replica=0, stage=s) for s in range(self.S)]
        if self.tail_sum is None:
            self.tail_sum = [{n: w.double() for n, w in stage.items()} for stage in weights]
        else:
            for total, stage in zip(self.tail_sum, weights, strict=True):
                for name, w in stage.items():
                    total[name] += w.double()
        self.tail_count += 1

    @torch.no_grad()
    def tail_evaluation(self) -> dict[str, Any]:
        """The validation loss of the tail-averaged global weights (one evaluation, the model's
        own weights put back afterwards): {tail_val_loss, tail_val_loss_stderr, tail_average:
        {steps, from_step}}."""
        assert self.tail_sum is not None and self.tail_count > 0
        started = time.perf_counter()
        own = [self.model.replica_weights(replica=0, stage=s) for s in range(self.S)]
        row = torch.tensor([0], device=self.device)
        for s, total in enumerate(self.tail_sum):
            self.model.set_stage(s, {n: (t / self.tail_count).float() for n, t in total.items()},
                                 replicas=row)
        try:
            losses = self.evaluator.window_losses()
        finally:
            for s, weights in enumerate(own):
                self.model.set_stage(s, weights, replicas=row)
        self.counters.timing["eval_s"] += time.perf_counter() - started
        return {"tail_val_loss": float(losses.mean()),
                "tail_val_loss_stderr": standard_error(losses),
                "tail_average": {"steps": self.tail_count, "from_step": self.tail_first_step()}}

    def _finished(self, budget: int) -> bool:
        if self.next_step < self.config.train.global_steps:
            return False
        if self.config.faults.strategy != "drop_extend":
            return True
        return self.counters.tokens_processed >= budget or self.next_step >= self.max_steps

    def _target_steps(self, budget: int) -> int:
        if self._finished(budget):
            return self.next_step
        return max(self.config.train.global_steps, self.next_step + 1)

    def global_step(self, g: int) -> None:
        """One outer round: faults -> H inner steps -> outer sync -> report."""
        self._round_starts(g)
        run_step = plan_step(self.plan, g, config=self.config)
        step = self._local_step(run_step)
        self._apply_rejoins(g)
        self._report_faults(g, step)
        started = time.perf_counter()
        losses = self._inner_steps(g, step)
        synced = time.perf_counter()
        results = self.sync.synchronise(g, run_step.contributes)
        self.counters.timing["inner_s"] += synced - started
        self.counters.timing["sync_s"] += time.perf_counter() - synced
        self.counters.record_sync(g, results, self.callback)
        self.counters.record_step(step, h=self.H, tokens_per_replica=self._tokens_per_replica(),
                                  config=self.config)
        self._round_done(g, step, results)
        for row, loss in losses.items():
            self.callback.metric(Metric("train_loss", g, loss, replica=self.replica_ids[row],
                                        tokens=self.counters.tokens_processed))
        self._report_tokens(g)

    def _tokens_per_replica(self) -> int:
        return self.H * self.config.train.batch_size * self.config.model.seq_len

    # -- faults ----------------------------------------------------------------------------------
    def _apply_rejoins(self, g: int) -> None:
        """A stage-replica back from a failure restarts with none of its state: fresh AdamW
        moments and step, error feedback and (MAPL) Stiefel momentum."""
        for failure in self.plan.rejoining(g):
            if failure.replica not in self.replica_ids:
                continue
            row, s = self.replica_ids.index(failure.replica), failure.stage
            self.optimizer.reset(replica=row, stage=s)
            self.sync.reset_error(replica=failure.replica, stage=s)
            reset = ["adamw_moments", "adamw_step", "error_feedback"]
            if s in self.stiefel_momentum:
                self.stiefel_momentum[s][row].zero_()
                reset.append("stiefel_momentum")
            self.callback.event(Event("rejoin", g, replica=failure.replica, stage=s,
                                      detail={"reset": reset, "down_steps": failure.duration}))

    def _report_faults(self, g: int, step: StepPlan) -> None:
        for event in fault_events(self.plan, g, step, strategy=self.config.faults.strategy,
                                  replicas=self.replica_ids):
            self.callback.event(event)

    # -- inner steps -----------------------------------------------------------------------------
    def _inner_steps(self, g: int, step: StepPlan) -> dict[int, float]:
        totals = torch.zeros(self.R, dtype=torch.float64)
        bypass = step.bypass.to(self.device)
        route = {s: idx.to(self.device) for s, idx in step.route.items()}
        weights = step.loss_weight.to(self.device)
        active = step.active.to(self.device)
        total_inner = self.config.train.global_steps * self.H
        for h in range(self.H):
            ids, targets = self.data.batches(replicas=self.R, batch_size=self.config.train.batch_size)
            lr = lr_at(self._schedule_position(g, h, step), train=self.config.train,
                       total_steps=total_inner)
            with self._autocast():
                losses = self.model(ids.to(self.device), targets.to(self.device),
                                    bypass=bypass, route=route)
            if not bool(torch.isfinite(losses[step.loss_weight.bool()]).all()):
                raise TrainingDiverged(f"non-finite training loss at global step {g}, inner step "
                                       f"{h}: {losses.tolist()}")
            (losses * weights).sum().backward()
            self._average_donor_gradients(step)
            self._update(lr, active)
            totals += losses.detach().double().cpu()
        return {r: float(totals[r] / self.H) for r in range(self.R) if step.loss_weight[r] > 0}

    @torch.no_grad()
    def _average_donor_gradients(self, step: StepPlan) -> None:
        """reroute: a donor's stage accumulated the gradients of its own micro-batch and of each
        replica it served, a sum of per-batch means; divide by the number of batches so that
        every batch weighs what one replica's batch weighs, and the donor's clipping and AdamW
        see a mean gradient, not one inflated by the foreign batches."""
        if step.extra_load is None or not bool(step.extra_load.any()):
            return
        for s in range(self.S):
            load = step.extra_load[:, s]
            if not bool(load.any()):
                continue
            scale = (1.0 / (1.0 + load.double())).float().to(self.device)
            for p in self.model.stage_params(s).values():
                if p.grad is not None:
                    p.grad.mul_(scale.view(-1, *([1] * (p.dim() - 1))))

    def _schedule_position(self, g: int, h: int, step: StepPlan) -> float:
        """Where inner step h of global step g sits on the learning-rate schedule, in inner steps.

        Every strategy but `drop_extend` follows the nominal clock (g * H + h): a `drop` run keeps
        its original schedule, as in the blog. `drop_extend` trains until it has processed the
        token budget, so its clock is the tokens processed so far over the tokens one full inner
        step processes: warm-up and decay stretch over what the run actually trains, and the
        schedule reaches its floor as the budget is met (not at the nominal last step, after
        which every extra step would run at the floor)."""
        if self.config.faults.strategy != "drop_extend":
            return float(g * self.H + h)
        full_step = self.R * self.config.train.batch_size * self.config.model.seq_len
        processing = float((step.loss_weight > 0).sum()) / self.R
        return self.counters.tokens_processed / full_step + h * processing

    def _update(self, lr: float, active: torch.Tensor) -> None:
        if self.config.sparseloco.method == "ddp":
            self._all_reduce(active)
        self._clip()
        self.optimizer.step(lr=lr, active=active)
        pipe = self.config.pipeline
        moving = [(s, self.model.stage_params(s)["basis"]) for s in self.stiefel_momentum]
        moving = [(s, basis) for s, basis in moving if basis.grad is not None]
        # every boundary's SPEL step in one batch (the matrices are still iterated one by one)
        boundary.stiefel_steps([basis.data for _, basis in moving],
                               [basis.grad for _, basis in moving],
                               [self.stiefel_momentum[s] for s, _ in moving],
                               [active[:, s] for s, _ in moving], lr=lr * pipe.mapl_lr_scale,
                               beta=pipe.mapl_momentum, steps=pipe.mapl_ns_steps,
                               work=self._stiefel_work)
        self.model.zero_grad(set_to_none=True)

    def _clip(self) -> None:
        clip_per_replica(self.optimizer.parameters(), self.config.train.grad_clip)

    @torch.no_grad()
    def _all_reduce(self, active: torch.Tensor) -> None:
        """ddp: every stage's gradient becomes the mean over the replicas that trained it."""
        for s in range(self.S):
            mask = active[:, s]
            if not bool(mask.any()):
                continue
            count = mask.sum()
            for p in self.model.stage_params(s).values():
                if p.grad is None:
                    continue
                view = (-1,) + (1,) * (p.dim() - 1)
                mean = (p.grad * mask.view(view)).sum(0, keepdim=True) / count
                p.grad.copy_(mean.expand_as(p.grad))
            sent = int(mask.sum()) * 4 * sum(
                p.numel() // self.R for p in self.model.stage_params(s).values())
            self.counters.bytes_upload += sent   # ddp's all-reduce is dense fp32:
            self.counters.bytes_dense += sent    # what it sends is its own dense equivalent

    def _autocast(self):
        return self.evaluator.autocast()

    # -- evaluation (crucible.evaluation.Evaluator) ------------------------------------------------
    def evaluate(self, *, taps_of: int = 0) -> float:
        """Validation loss of the global model (`Evaluator.evaluate`)."""
        return self.evaluator.evaluate(taps_of=taps_of)

    @property
    def last_eval_stderr(self) -> float | None:
        return self.evaluator.last_eval_stderr

    @property
    def last_window_losses(self) -> torch.Tensor | None:
        return self.evaluator.last_window_losses

    @property
    def eval_tokens(self) -> int:
        return self.evaluator.eval_tokens

    def _maybe_evaluate(self, budget: int) -> None:
        g = self.next_step
        final = self._finished(budget)
        if g % self.config.train.eval_every == 0 or final:
            started = time.perf_counter()
            # the last evaluation keeps what MAPL's basis report needs of the same weights
            keep = BASIS_WINDOWS if final and self.config.pipeline.compression == "mapl" else 0
            val = self.evaluate(taps_of=keep)
            self.counters.timing["eval_s"] += time.perf_counter() - started
            if not torch.isfinite(torch.tensor(val)):
                raise TrainingDiverged(f"validation loss is {val} after global step {g}")
            self.counters.evals.append({"global_step": g, "tokens": self.counters.tokens_processed,
                                        "val_loss": val, "val_loss_stderr": self.last_eval_stderr})
            self.callback.metric(Metric("val_loss", g, val, tokens=self.counters.tokens_processed))

    # -- checkpoints -----------------------------------------------------------------------------
    def _maybe_checkpoint(self, started: float, budget: int) -> None:
        every = self.config.train.checkpoint_every
        if not every or self.next_step % every or self._finished(budget):
            return
        wall = self.counters.wall_s
        self.counters.wall_s = wall + time.perf_counter() - started
        save_checkpoint(self.store, self.run_key, global_step=self.next_step,
                        config_json=self.config.to_json(), state=self.state_dict(),
                        keep=self.config.train.keep_checkpoints)
        self.counters.wall_s = wall

    def state_dict(self) -> dict[str, Any]:
        return {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "stiefel": {str(s): m.cpu() for s, m in self.stiefel_momentum.items()},
                "sync": self.sync.state_dict(), "data": self.data.state_dict(),
                "counters": self.counters.state_dict(), "plan": self.plan.to_list(),
                "next_step": self.next_step,
                "tail": {"sum": self.tail_sum, "count": self.tail_count}}

    def resume(self) -> int | None:
        """Load the newest good checkpoint of the run, if any; returns its global step. A newer
        checkpoint that fails its checks is skipped with a `checkpoint_rejected` event. Raises
        CheckpointError when checkpoints exist and none is usable."""
        found = load_latest(self.store, self.run_key, config_json=self.config.to_json(),
                            max_bytes=checkpoint_limit(self.state_dict()))
        if found is None:
            return None
        for step, key, reason in found.skipped:
            self.callback.event(Event("checkpoint_rejected", step, detail={
                "key": key, "reason": reason, "resumed_from": found.global_step}))
        self.load_state_dict(found.state)
        return found.global_step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for s, m in self.stiefel_momentum.items():
            m.copy_(state["stiefel"][str(s)])
        self.sync.load_state_dict(state["sync"])
        self.data.load_state_dict(state["data"])
        self.counters.load_state_dict(state["counters"])
        self.plan = FaultPlan.from_list(state["plan"])
        self.next_step = int(state["next_step"])
        tail = state.get("tail") or {}          # checkpoints older than train.tail_average
        self.tail_sum, self.tail_count = tail.get("sum"), int(tail.get("count") or 0)


def _versions(device: torch.device) -> dict[str, Any]:
    import platform

    import crucible
    from crucible.summary import git_sha
    return {"crucible": crucible.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "git_sha": git_sha(),
            "host": platform.node(), "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads(),
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")}


def _run_identity(out_dir: Path, config: Config, resume: bool,
                  run_key: str | None) -> tuple[str, str]:
    """The run's store key and store URL, fixed on the first start and reused on resume.
    A caller that knows a stable identity (the registry's run id) passes `run_key`, so a resume
    on another machine finds the checkpoints in a shared store."""
    path = out_dir / "run.json"
    if resume and path.exists() and run_key is None:
        ident = json.loads(path.read_text())
        # the run key is a store prefix: an edited run.json must not reach outside the run
        return validate_id(ident["run_key"], field=f"run_key in {path}"), ident["store_url"]
    store_url = config.store.url or (out_dir / "store").resolve().as_uri()
    run_key = f"run-{uuid.uuid4().hex[:12]}" if run_key is None else validate_id(
        run_key, field="run_key")
    # the config too: a later `--resume` into this folder is checked against it even when the
    # run stopped before its first checkpoint
    ident = {"run_key": run_key, "store_url": store_url, "config": json.loads(config.to_json())}
    write_json_atomic(path, ident)
    return ident["run_key"], ident["store_url"]


def train(config: Config, *, out_dir: str | os.PathLike[str], callback: Callback | None = None,
          resume: bool = False, progress: bool = False, plan: FaultPlan | None = None,
          on_step: Callable[[int, int], None] | None = None,
          run_key: str | None = None, alignment: bool = False) -> dict[str, Any]:
    """Train one run and write `summary.json`, `metrics.jsonl`, `events.jsonl` into `out_dir`.

    `alignment`: add the final model's alignment report to the summary (`Trainer.alignment`;
    what a study asks of its baselines, for the alignment hypothesis), when the pipeline has an
    inner stage.

    With `resume=True` and a checkpoint in the run's store, training continues from it and ends
    with the same numbers as an uninterrupted run. Raises `ConfigError` for a bad configuration,
    `TrainingDiverged` for a non-finite loss and `StoreError` for store failures.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_key, store_url = _run_identity(out, config, resume, run_key)
    store = open_store(store_url, endpoint_url=config.store.endpoint_url, region=config.store.region)
    sinks = JsonlCallback(out)
    bar = RunProgress(enabled=progress)   # nothing attached when the bar is off
    extra = [c for c in (callback, bar.callback) if c is not None]
    sink: Callback = MultiCallback(sinks, *extra) if extra else sinks
    files, size = store.remove_temporaries(f"{run_key}/")
    if files:  # left by a run killed mid-write; no writer of this run is alive now
        log.info("removed %d temporary files (%d bytes) of interrupted writes under %s",
                 files, size, run_key)
    trainer = Trainer(config, store=store, run_key=run_key, callback=sink, plan=plan)
    if resume:
        step = trainer.resume()
        if step is not None:
            log.info("resumed %s from global step %d", run_key, step)
        if callback is not None:
            # what a killed reporter held in memory is in the run's files: send it again
            log.info("re-sent %d records of the interrupted run", sinks.resend(callback))
    try:
        with bar.show(trainer, total=config.train.global_steps) as show_step:

            def step_done(done: int, total: int) -> None:
                show_step(done, total)
                if on_step is not None:
                    on_step(done, total)

            summary = trainer.run(on_step=step_done)
    finally:
        sink.flush()
    if alignment and trainer.S > 2:
        trainer.alignment(summary)
    save_global_weights(out / MODEL_FILE, trainer.sync.global_weights)
    if trainer.last_window_losses is not None:
        # per-window final losses: paired comparisons between runs on the same windows
        torch.save(trainer.last_window_losses.float(), out / "val_windows.pt")
    summary["versions"] = _versions(trainer.device)
    # the arithmetic it trained with, by what it computes (crucible.arithmetic): a study pairs
    # cells only within one arithmetic
    summary["arithmetic"] = arithmetic(trainer.device)
    # the corpus by content, never by path: hashed once, when the summary is written (not in
    # every Trainer's start-up; the splits are the stream's two consecutive parts)
    summary["data_digest"] = token_digest(trainer.data.train.numpy(), trainer.data.val.numpy())
    summary["run_key"] = run_key
    summary["store_url"] = store_url
    write_json_atomic(out / "summary.json", summary)
    sink.close()
    return summary
