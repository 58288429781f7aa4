"""What a run would cost on a deployment: wall-clock time, accelerator-hours and money, from
what the run recorded (its `summary.json`) and a `Deployment` (crucible.pricing.deployment).

`run_cost(summary, deployment)` is deterministic and reads nothing but its arguments. It
replays the run round by round: the recorded fault plan through the run's own strategy
(`crucible.strategy.plan_step`, so skip, drop, drop_extend and reroute act exactly as they did in
training, donors included) for the recorded number of global steps, plus the real process kills
of a distributed run (`distributed.kills`). The model, per global step (an outer round):

- Inner steps. Stage s of a replica takes `t_s` per inner step: the deployment's `step_s`, or
  6 x (the run's parameters / S) x (batch_size x seq_len) / `flops_per_s`. A replica's inner
  step is the sum over its path (no micro-batch pipelining): a skipped stage costs nothing, a
  stage it reaches through a reroute donor costs that donor's `t_s x (1 + its foreign
  micro-batches)` (the donor's own stage pays the same second batch), plus each boundary
  crossing, forward and backward: 2 x latency + tokens x (forward + backward wire bytes) /
  bandwidth. A dropped replica computes nothing. The round takes H times its slowest replica.
- Outer synchronisation. Bytes per contribution are the run's (`bytes.upload` / contributions
  made); each replica uploads its contributions and downloads the other contributions of its S
  stages through the store link (2 x store latency), plus `sync_compute_s`; the round takes the
  slowest replica.
- Waits for real kills (a distributed run's planned `distributed.kills` and the unplanned deaths
  in `distributed.recoveries`). With the run's heartbeat lease (`distributed.lease_s` > 0,
  crucible.distributed.liveness) the others wait, in the round of the kill, until the new
  process announces itself or the lease runs out (`min(lease, restart_s)`, less their own work);
  in the next round, for the restarted replica's contribution, which lands `restart_s +
  rejoin_s` after the kill plus a round's work, at most the deadline (`round_timeout_s`: the
  deployment's, else the run's), once; a replica that misses that round too is not waited for
  again until it is back (then for the rest of the round it came back in). A replica that
  never returns costs only the round of its kill. Without a lease (runs from before it, or `--lease-s 0`) a round in which a
  killed process's contribution is missing costs every replica the deadline: a kill costs at
  least its own round, and one more for each round that `restart_s + rejoin_s` outlasts; a
  replica killed for good costs the deadline in every round after its kill. Planned failures
  (skip, drop, reroute) cost no wait: their missing contributions are known in advance.
- Waits for a pipeline stage's real death (`pipeline.deaths`: replica, stage, the global step
  it died in and how far into that round, `fraction`). The round it died in goes on without
  it (its replica bypasses or drops it, as the recorded plan says); the stage comes back in
  the next round, which every replica's chain and the outer round wait for: `restart_s +
  rejoin_s` after the death, less the rest of the round it died in ((1 - fraction) x the
  round). A death in the last round costs the same at the run's end (the run ends when every
  stage process has).
- Scale. With the deployment's `workload.preset`, the inner step, boundary bytes and
  contribution bytes are that preset's model's (contributions scaled by its parameter count);
  rounds, H, R, S, the codec, the faults and the strategy stay the run's.
- Evaluations: the held-out tokens scored at `eval_fraction` of a training token's time, each
  evaluation of the run; plus `startup_s` once.

Layout `one_device` (one GPU host holding every stage-replica, as the simulator runs): the
round's inner steps are the sum of every stage-replica's work (one device, one after another)
plus the slowest replica's boundary crossings, and the accelerators are `accelerators_per_stage`
in all.

Accelerator-hours count every provisioned accelerator (R x S x accelerators_per_stage) for the
whole wall-clock: a stage idle under `drop`, a donor-less replica, replicas waiting out a
deadline are paid for. Money is accelerator-hours x the price per hour, on demand and spot;
`cost` is the one the deployment's `pricing` names. `busy_fraction` is the share of those
accelerator-seconds spent computing inner steps. `curve` is the loss against wall-clock and money
at each evaluation, from the initial loss (the recorded one, else ln V: a fresh model's) at the
end of start-up. `replay_matches` says whether the replayed rounds give the inner steps and
donor loads the run recorded (None where it cannot be checked: a run with real kills).

Not modelled: micro-batch pipelining inside an inner step, contention of a donor's boundary
link, store egress prices, evaluation by one replica only (every replica evaluates, in
parallel), and spot reclaims beyond what the run's fault plan already holds (a reclaimed
stage is a failed stage for the plan's duration).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from crucible.pricing.deployment import Deployment

__all__ = ["COST_MODEL", "CostError", "run_cost", "run_costs", "stage_step_s"]

# the version every stored cost record carries (the module's first name, kept: records and REST
# clients match it)
COST_MODEL = "crucible.cost/1"


class CostError(ValueError):
    """A summary the model cannot price (a missing or inconsistent field, named)."""


def stage_step_s(config: Any, deployment: Deployment) -> list[float]:
    """Seconds per inner step of each of the run's S stages on `deployment`."""
    from crucible.presets import parameter_count

    stages = config.pipeline.stages
    if deployment.step_s is not None:
        times = list(deployment.step_s)
        if len(times) == 1:
            return times * stages
        if len(times) != stages:
            raise CostError(f"{deployment.source}: compute.step_s has {len(times)} values but "
                            f"the run has {stages} stages; give one number or {stages}")
        return times
    tokens = config.train.batch_size * config.model.seq_len
    flops = 6.0 * parameter_count(config) / stages * tokens
    return [flops / float(deployment.flops_per_s)] * stages


def _workload(config: Any, deployment: Deployment) -> Any:
    """The configuration whose model, batch and context price an inner step: the run's own, or
    the deployment's `workload.preset` (model, batch) with the run's pipeline codec."""
    if deployment.workload_preset is None:
        return config
    from crucible.config import Config
    from crucible.presets import get_preset

    preset = get_preset(deployment.workload_preset).to_dict()
    data = config.to_dict()
    data["model"] = preset["model"]
    data["train"] = {**data["train"], "batch_size": preset["train"]["batch_size"]}
    return Config.from_dict(data)


def _config(summary: Mapping[str, Any]) -> Any:
    from crucible.config import Config, ConfigError

    try:
        return Config.from_dict(summary["config"])
    except (KeyError, TypeError, ConfigError) as exc:
        raise CostError(f"the summary's config does not parse ({exc}); price a run written "
                        "by this version of crucible") from None


def _kills(distributed: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The run's real kills: the planned ones, and the unplanned deaths its lives recorded."""
    lost = {int(row["replica"]) for row in distributed.get("lost") or []}
    kills = [dict(k) for k in distributed.get("kills") or []]
    kills += [{"replica": int(row["replica"]), "global_step": int(row["killed_at_step"]),
               "rejoin": int(row["replica"]) not in lost}
              for row in distributed.get("recoveries") or [] if row.get("planned") is False]
    return kills


def _kill_waits(kills: Sequence[Mapping[str, Any]], deployment: Deployment, *,
                steps: int, round_s: float, timeout_s: float,
                lease_s: float = 0.0) -> tuple[dict[int, set[int]], dict[int, float]]:
    """Per global step: the killed replicas missing from it, and the seconds every other
    replica waits in it (the module docstring, "Waits for real kills")."""
    absent: dict[int, set[int]] = {}
    waits: dict[int, float] = {}

    def wait(g: int, seconds: float) -> None:
        waits[g] = max(waits.get(g, 0.0), seconds)

    back_after = deployment.restart_s + deployment.rejoin_s
    for kill in kills:
        replica, start = int(kill["replica"]), int(kill["global_step"])
        if start >= steps:
            continue
        rejoin = kill.get("rejoin", True)
        if lease_s <= 0:                       # no lease: the deadline while it is missing
            elapsed, g = 0.0, start
            while g < steps:
                absent.setdefault(g, set()).add(replica)
                wait(g, timeout_s)
                elapsed += round_s + timeout_s
                g += 1
                if rejoin and elapsed >= back_after:
                    break
            continue
        absent.setdefault(start, set()).add(replica)
        detected = min(lease_s, deployment.restart_s)
        first = min(timeout_s, max(0.0, detected - round_s))    # the deadline still bounds it
        wait(start, first)
        if not rejoin:
            continue
        elapsed = round_s + first            # seconds after the kill when round start + 1 begins
        awaited = False
        for g in range(start + 1, steps):
            # it trains round g from when it is back: its contribution lands `late` after the
            # others' own work
            late = back_after - elapsed
            if late <= 0:
                break                          # back in step with the others
            if not awaited:                    # coming back: waited for once, to the deadline
                awaited = True
                if late <= timeout_s:
                    wait(g, late)
                    break
                wait(g, timeout_s)
                elapsed += round_s + timeout_s
            elif late <= round_s:              # back during this round, training it: waited for
                wait(g, late)
                break
            else:                              # still coming back: not waited for again
                elapsed += round_s
            absent.setdefault(g, set()).add(replica)
    return absent, waits


def _stage_death_waits(pipeline: Mapping[str, Any], deployment: Deployment, *, steps: int,
                       round_s: float) -> dict[int, float]:
    """Per global step, the seconds every replica waits in it for a pipeline stage that died
    in the round before (the module docstring, "Waits for a pipeline stage's real death")."""
    waits: dict[int, float] = {}
    back_after = deployment.restart_s + deployment.rejoin_s
    for death in pipeline.get("deaths") or []:
        died = int(death["global_step"])
        if not 0 <= died < steps:
            continue
        fraction = min(1.0, max(0.0, float(death.get("fraction", 0.5))))
        g = min(died + 1, steps - 1)
        waits[g] = max(waits.get(g, 0.0), max(0.0, back_after - (1.0 - fraction) * round_s))
    return waits


@dataclass(frozen=True)
class _Round:
    """One round's plan as plain lists: who computes what, through which donor."""
    bypass: tuple[tuple[bool, ...], ...]        # (R, S)
    active: tuple[tuple[bool, ...], ...]        # (R, S)
    processing: tuple[bool, ...]                # (R,) the replica's tokens are trained on
    extra: tuple[tuple[int, ...], ...]          # (R, S) foreign micro-batches per inner step
    donors: Mapping[tuple[int, int], int]
    crossings: tuple[int, ...]                  # (R,) boundary crossings per token

    def without(self, gone: set[int]) -> _Round:
        """The round with the replicas in `gone` dead: they compute and contribute nothing."""
        return _Round(bypass=self.bypass,
                      active=tuple(tuple(False for _ in row) if r in gone else row
                                   for r, row in enumerate(self.active)),
                      processing=tuple(p and r not in gone for r, p in enumerate(self.processing)),
                      extra=self.extra, donors=self.donors, crossings=self.crossings)


def _replay(summary: Mapping[str, Any], config: Any) -> list[_Round]:
    """Every recorded global step's plan through the run's strategy (crucible.strategy)."""
    from crucible.faults import FaultPlan
    from crucible.strategy import plan_step

    plan = FaultPlan.from_list(summary.get("faults") or [])
    rounds = []
    for g in range(-1, int(summary["global_steps"])):   # -1: the fault-free round
        step = plan_step(plan if g >= 0 else FaultPlan(), max(g, 0), config=config)
        extra = step.extra_load
        rounds.append(_Round(
            bypass=tuple(tuple(row) for row in step.bypass.tolist()),
            active=tuple(tuple(row) for row in step.active.tolist()),
            processing=tuple(w > 0 for w in step.loss_weight.tolist()),
            extra=(tuple(tuple(row) for row in extra.tolist()) if extra is not None else
                   tuple((0,) * config.pipeline.stages for _ in range(config.replicas))),
            donors=dict(step.donors), crossings=tuple(step.crossings().tolist())))
    return rounds


def _replay_check(summary: Mapping[str, Any], config: Any,
                  rounds: Sequence[_Round]) -> bool | None:
    """Whether the replayed rounds give the inner steps and donor loads the run recorded (None
    for a run with real kills, whose dead rounds the plan does not hold, or without the
    counts)."""
    if (summary.get("distributed") or {}).get("kills") or "inner_steps" not in summary:
        return None
    H = config.sparseloco.inner_steps
    R, S = config.replicas, config.pipeline.stages
    steps = [[H * sum(int(one.active[r][s]) for one in rounds[1:]) for s in range(S)]
             for r in range(R)]
    donors = [[H * sum(one.extra[r][s] for one in rounds[1:]) for s in range(S)]
              for r in range(R)]
    return steps == summary["inner_steps"] and donors == summary.get("donor_load", donors)


def run_cost(summary: Mapping[str, Any], deployment: Deployment) -> dict[str, Any]:
    """The cost record of one run (see the module docstring for the model)."""
    return run_costs(summary, [deployment])[0]


def run_costs(summary: Mapping[str, Any], deployments: Sequence[Deployment]
              ) -> list[dict[str, Any]]:
    """`run_cost` of one run on each deployment (the run's rounds replayed once)."""
    config = _config(summary)
    try:
        rounds = _replay(summary, config)
        check = _replay_check(summary, config, rounds)
        return [{**_priced(summary, config, rounds, d), "replay_matches": check}
                for d in deployments]
    except KeyError as exc:
        raise CostError(f"the summary has no {exc.args[0]!r}: price a summary.json that "
                        "crucible run, launch or a study wrote") from None


def _initial_loss(summary: Mapping[str, Any], config: Any) -> float:
    """The loss before training: the recorded one, else the uniform prediction's ln V (what a
    freshly initialised model scores, to within its small init)."""
    initial = summary.get("initial_val_loss")
    return float(initial) if initial is not None else math.log(config.model.vocab_size)


def _priced(summary: Mapping[str, Any], config: Any, rounds: Sequence[_Round],
            deployment: Deployment) -> dict[str, Any]:
    from crucible.boundary import wire_bytes
    from crucible.presets import parameter_count

    R, S, H = config.replicas, config.pipeline.stages, config.sparseloco.inner_steps
    steps = int(summary["global_steps"])
    work = _workload(config, deployment)
    t = stage_step_s(work, deployment)
    tokens = work.train.batch_size * work.model.seq_len
    forward, backward = wire_bytes(work)
    link = deployment.boundary_bandwidth_mbps * 1e6 / 8.0           # bytes/s
    store = deployment.store_bandwidth_mbps * 1e6 / 8.0
    crossing_s = (2 * deployment.boundary_latency_ms / 1000.0 + tokens * (forward + backward) / link)
    made = int((summary.get("contributions") or {}).get("made", 0))
    per_contribution = (summary["bytes"]["upload"] / made if made else 0.0) * (
        parameter_count(work) / parameter_count(config))
    timeout_s = deployment.round_timeout_s or config.sparseloco.round_timeout_s
    distributed = summary.get("distributed") or {}

    def priced(one: _Round) -> tuple[float, dict[str, float], float]:
        return _round(one, t, crossing_s, per_contribution, store, deployment, H=H)

    # the kills' waits need the length of a round without them: the fault-free round's
    absent, waits = _kill_waits(_kills(distributed), deployment, steps=steps,
                                round_s=priced(rounds[0])[0], timeout_s=timeout_s,
                                lease_s=float(distributed.get("lease_s") or 0.0))
    for g, seconds in _stage_death_waits(summary.get("pipeline") or {}, deployment,
                                         steps=steps, round_s=priced(rounds[0])[0]).items():
        waits[g] = max(waits.get(g, 0.0), seconds)
    totals = {"compute_s": 0.0, "boundary_s": 0.0, "store_s": 0.0, "wait_s": 0.0}
    busy_s = 0.0
    ends: list[float] = []          # wall-clock at the end of each round, before evaluations
    clock = deployment.startup_s
    for g, one in enumerate(rounds[1:]):
        gone = absent.get(g, set())
        total, parts, busy = priced(one.without(gone) if gone else one)
        wait = waits.get(g, 0.0)
        for key, value in parts.items():
            totals[key] += value
        totals["wait_s"] += wait
        busy_s += busy
        clock += total + wait
        ends.append(clock)
    evals = list(summary.get("evals") or [])
    eval_tokens = summary.get("eval_tokens") or config.train.eval_tokens
    eval_each = (eval_tokens or 0) * sum(t) / tokens * deployment.eval_fraction
    recorded_initial = summary.get("initial_val_loss") is not None
    n_evals = len(evals) + (1 if recorded_initial else 0)
    # the curve starts before the first round, at the initial loss (after its evaluation)
    curve = [{"global_step": 0, "val_loss": _initial_loss(summary, config),
              "wall_s": deployment.startup_s + (eval_each if recorded_initial else 0.0)}]
    done = 1 if recorded_initial else 0
    for e in evals:
        done += 1
        g = int(e["global_step"])
        at = (ends[g - 1] if 0 < g <= len(ends) else clock) + done * eval_each
        curve.append({"global_step": g, "val_loss": e["val_loss"], "wall_s": at})
    wall = clock + n_evals * eval_each
    devices = 1 if deployment.layout == "one_device" else R * S     # busy_s runs on these
    accelerators = deployment.accelerators_per_stage * devices
    hours = accelerators * wall / 3600.0
    for point in curve:
        point["accelerator_hours"] = accelerators * point["wall_s"] / 3600.0
        point["cost"] = point["accelerator_hours"] * deployment.price_per_hour
    money = {"on_demand": hours * deployment.on_demand_per_hour,
             "spot": hours * deployment.spot_per_hour}
    return {
        "model": COST_MODEL, "deployment": deployment.name, "pricing": deployment.pricing,
        "layout": deployment.layout,
        "currency": deployment.currency, "global_steps": steps, "replicas": R, "stages": S,
        "workload": deployment.workload_preset, "stage_step_s": t, "wall_s": wall,
        "breakdown_s": {"startup_s": deployment.startup_s, **totals,
                        "eval_s": n_evals * eval_each},
        "accelerators": accelerators, "accelerator_hours": hours,
        "busy_fraction": min(1.0, busy_s / (wall * devices)) if wall else 0.0,
        "money": money, "cost": money["spot" if deployment.pricing == "spot" else "on_demand"],
        "price_per_hour": deployment.price_per_hour,
        "kill_wait_rounds": sorted(absent), "final_val_loss": summary.get("final_val_loss"),
        "curve": curve, "measured_wall_s": summary.get("wall_s"),
    }


def _round(one: _Round, t: Sequence[float], crossing_s: float, per_contribution: float,
           store: float, deployment: Deployment, *, H: int) -> tuple[float, dict[str, float],
                                                                     float]:
    """(seconds, their split, busy stage-seconds) of one round."""
    R, S = len(one.active), len(t)
    load = [[int(one.active[r][s]) + one.extra[r][s] for s in range(S)] for r in range(R)]
    slowest = (0.0, 0.0)
    for r in range(R):
        if not one.processing[r]:
            continue
        compute = 0.0
        for s in range(S):
            if one.bypass[r][s]:
                continue
            holder = one.donors.get((r, s), r)
            compute += t[s] * max(load[holder][s], 1)
        boundary = one.crossings[r] * crossing_s
        if compute + boundary > sum(slowest):
            slowest = (compute, boundary)
    per_stage = [sum(int(one.active[r][s]) for r in range(R)) for s in range(S)]
    store_s = 0.0
    for r in range(R):
        up = sum(int(a) for a in one.active[r])
        down = sum(per_stage[s] - int(one.active[r][s]) for s in range(S))
        if up or down:
            seconds = ((up + down) * per_contribution / store
                       + 2 * deployment.store_latency_ms / 1000.0)
            store_s = max(store_s, seconds)
    busy = H * sum(t[s] * load[r][s] for r in range(R) for s in range(S))
    compute_s = busy if deployment.layout == "one_device" else H * slowest[0]
    parts = {"compute_s": compute_s, "boundary_s": H * slowest[1],
             "store_s": store_s + deployment.sync_compute_s}
    return math.fsum(parts.values()), parts, busy
