"""The price of what a study has not decided: per open comparison of the claims, its measured
sd, the seeds its mean and sd say would decide it, and the CPU-hours those seeds cost at the
study's own measured seconds per run; and what the same grid would cost on a GPU at a size
where the seed spread is expected to be far smaller (`gpu_estimate`, from a deployment file's
measured throughput).

Every number is computed from the committed results and files named in the text: nothing here is
typed in. A comparison is priced alone (its failure cells and its arms' baselines for each new
seed); comparisons of one claim share seeds, so a claim costs at most the sum of its
comparisons' prices and at least the costliest one's.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from crucible.stats import MAX_SEEDS, Claim, Comparison
from crucible.study.data import StudyData
from crucible.study.formatting import _num, _table

# what a session may spend on deciding claims (issue 34: about 30 CPU-hours of new runs in all):
# a comparison that costs more is "beyond this preset"
CPU_BUDGET_H = 30.0
OPEN = ("unresolved", "missing")
# a study's GPU companion (the same claims at a size where the seed spread is smaller), priced
# on the deployment whose compute was measured
GPU_SPECS = {"table1-d128": "gpu-d512.toml"}
GPU_DEPLOYMENT = "infra/deployments/one-gpu-h100.toml"


def _wall(data: StudyData, arm: str, strategy: str | None, p: float) -> float | None:
    """Mean wall_s of a cell's runs (strategy None: the arm's baseline)."""
    if strategy is None:
        runs = data.baseline(arm)
    else:
        key = data.find(arm, strategy, p)
        runs = data.runs(key) if key is not None else {}
    walls = [float(r["wall_s"]) for r in runs.values()
             if isinstance(r.get("wall_s"), int | float)]
    return sum(walls) / len(walls) if walls else None


def seed_seconds(data: StudyData, comparison: Comparison) -> tuple[float | None, int]:
    """(CPU-seconds one more seed of `comparison` takes, runs it takes): its failure cells' and
    its arms' baselines' mean wall_s (a cell not run yet: the study's mean run); None when the
    study has no run at all."""
    every = [float(r["wall_s"]) for r in data.results.values()
             if isinstance(r.get("wall_s"), int | float)]
    if not every:
        return None, 0
    fallback = sum(every) / len(every)
    parts = [_wall(data, arm, strategy, p) for arm, strategy, p in comparison.cells]
    parts += [_wall(data, arm, None, 0.0) for arm in comparison.baselines]
    return sum(fallback if w is None else w for w in parts), len(parts)


POWER = 0.8


def seeds_for_power(mean: float, sd: float, *, margin: float | None = None,
                    power: float = POWER) -> int | None:
    """The smallest n whose 95% interval would clear the comparison's boundary with probability
    `power` if the true difference were the measured mean and the sd the measured sd:
    gap >= (t_0.975 + t_power) sd / sqrt(n), gap the distance from the mean to the boundary (0
    for a sign rule, the band's edge for a band rule). None beyond MAX_SEEDS or at the
    boundary itself."""
    from crucible.stats import t_quantile

    if not (math.isfinite(mean) and math.isfinite(sd)):
        return None
    gap = abs(mean) if margin is None else abs(margin - abs(mean))
    if gap == 0:
        return None
    for n in range(2, MAX_SEEDS + 1):
        if gap >= (t_quantile(0.975, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n):
            return n
    return None


def price(data: StudyData, comparison: Comparison) -> dict[str, Any]:
    """One open comparison's price, at 80% power (`seeds_for_power`): {n, mean, sd, need
    (total seeds; None: over MAX_SEEDS),
    new (seeds to add), runs_per_seed, cpu_h (None: over MAX_SEEDS or nothing measured),
    within_budget}. A comparison with fewer than 2 seeds has no sd: its price is the seeds
    that give it one (2), and its need is unknown until then."""
    s = comparison.stat
    per_seed, runs = seed_seconds(data, comparison)
    if comparison.status == "missing":
        need: int | None = 2
        first_sd = True
    else:
        need = (None if s.mean is None or s.sd is None else
                seeds_for_power(s.mean, s.sd, margin=comparison.margin))
        first_sd = False
    new = None if need is None else max(0, need - s.n)
    cpu_h = None if new is None or per_seed is None else new * per_seed / 3600.0
    return {"n": s.n, "mean": s.mean, "sd": s.sd, "need": need, "new": new,
            "first_sd": first_sd, "runs_per_seed": runs, "cpu_h": cpu_h,
            "within_budget": cpu_h is not None and cpu_h <= CPU_BUDGET_H}


def price_rows(data: StudyData, claims: Sequence[Claim]) -> list[tuple[Claim, Comparison,
                                                                         dict[str, Any]]]:
    return [(claim, c, price(data, c)) for claim in claims for c in claim.comparisons
            if c.status in OPEN and claim.verdict not in ("agrees", "disagrees")]


def price_section(data: StudyData, claims: Sequence[Claim],
                  gpu: Mapping[str, Any] | None = None) -> list[str]:
    """The document's "The price of what is not decided" section."""
    rows = price_rows(data, claims)
    out = ["## The price of what is not decided", "",
           "Each comparison of a claim that is not decided, with its measured sd (points) and "
           "what deciding it would take if the true difference were its measured mean and the "
           "sd its measured sd: the seeds in all for 80% power (the interval clears the "
           "boundary in 4 of 5 repetitions; the claims table's \"seeds that would decide it\" "
           "is the seeds at which it would clear if the mean stayed exactly as measured, about "
           "50%), the seeds to add, the runs one new seed takes (its failure cells and its "
           "arms' baselines: an upper bound where a seed's baseline exists already) and the "
           "CPU-hours of those runs at this study's measured mean wall_s per cell (one torch "
           "thread per run). A comparison with one seed has no sd yet: its price is the second "
           "seed that gives it one. Comparisons are priced alone; those of one claim share "
           "seeds. \"Decidable here\": at most "
           f"{CPU_BUDGET_H:g} CPU-hours on its own; \"beyond this preset\": more, or more "
           f"than {MAX_SEEDS} seeds. The sd of n seeds is itself uncertain (about ±30% at 6 "
           "seeds), so read the counts as sizes.", ""]
    if not rows:
        return out + ["Every claim is decided, or no comparison is open.", ""]
    table = []
    for claim, c, p in rows:
        if p["first_sd"]:
            need = "2 (for an sd)"
        else:
            need = f"> {MAX_SEEDS}" if p["need"] is None else str(p["need"])
        if p["first_sd"]:
            verdict = "a second seed first"
        else:
            verdict = "decidable here" if p["within_budget"] else "beyond this preset"
        table.append([f"({claim.tag}) {c.label}", str(p["n"]), _num(p["mean"], "+.2f"),
                      _num(p["sd"], ".2f"), need, "-" if p["new"] is None else str(p["new"]),
                      str(p["runs_per_seed"]), _num(p["cpu_h"], ".1f"), verdict])
    out += _table(["comparison", "n", "mean", "sd", "seeds (80% power)", "seeds to add",
                   "runs a seed", "CPU-hours", "reads as"], table)
    measured = [p for _, _, p in rows if not p["first_sd"]]
    decidable = [p["cpu_h"] for p in measured if p["within_budget"]]
    beyond = sum(1 for p in measured if not p["within_budget"])
    first = [p["cpu_h"] or 0.0 for _, _, p in rows if p["first_sd"]]
    out += ["", f"Of the {len(measured)} open comparisons with an sd, {len(decidable)} "
            f"{'is' if len(decidable) == 1 else 'are'} decidable within {CPU_BUDGET_H:g} "
            f"CPU-hours each on its own (together at most {sum(decidable):.1f} CPU-hours, less where "
            f"they share seeds) and {beyond} {'is' if beyond == 1 else 'are'} beyond this preset; "
            f"{len(first)} more have fewer than 2 seeds (an sd for all of them: at most "
            f"{sum(first):.1f} CPU-hours).", ""]
    if gpu:
        out += gpu_lines(gpu)
    return out


def gpu_estimate(spec_path: Path, deployment_path: Path) -> dict[str, Any]:
    """What a GPU study spec would cost on a deployment: per run, the tokens' 6N FLOPs at the
    deployment's measured `compute.flops_per_s`, its evaluations (held-out tokens at
    `eval_fraction` of a training token's time, as `crucible.pricing.cost` prices them), the
    SparseLoCo round's measured seconds scaled by the synced values (178M measured) per global
    step, and the start-up; in all, the runs of every cell of the spec. Returns {spec,
    deployment, runs, params, tokens, run_s, gpu_h, money (None without a price)}."""
    from crucible.config import apply_overrides
    from crucible.presets import get_preset, parameter_count, tokens_per_global_step
    from crucible.pricing.deployment import load_deployment
    from crucible.study.spec import load_spec

    spec = load_spec(spec_path)
    deployment = load_deployment(deployment_path)
    cells = spec.cells()
    config = apply_overrides(get_preset(spec.preset), list(spec.common_overrides()))
    params = parameter_count(config)
    tokens = tokens_per_global_step(config) * config.train.global_steps
    if deployment.flops_per_s is None:
        raise ValueError(f"{deployment_path}: compute.flops_per_s is not set; a GPU estimate "
                         "needs the measured rate")
    if config.train.eval_tokens <= 0:
        raise ValueError(f"{spec_path}: set train.eval_tokens (0 scores the whole held-out "
                         "split, whose size this estimate does not know)")
    per_token_s = 6 * params / deployment.flops_per_s
    evaluations = config.train.global_steps // config.train.eval_every + 1
    eval_s = evaluations * config.train.eval_tokens * per_token_s * deployment.eval_fraction
    train_s = tokens * per_token_s + eval_s
    sync_s = (deployment.sync_compute_s * params / _MEASURED_SYNC_PARAMS
              * config.train.global_steps)
    run_s = train_s + sync_s + deployment.startup_s
    # one_device: accelerators_per_stage is the accelerators of the whole run
    gpu_h = len(cells) * run_s * deployment.accelerators_per_stage / 3600.0
    hourly = deployment.price_per_hour
    return {"spec": spec.shown(spec.path), "name": spec.name, "deployment": deployment.name,
            "deployment_path": spec.shown(deployment_path.resolve()), "runs": len(cells),
            "params": params, "tokens": tokens, "run_s": run_s, "sync_s": sync_s, "gpu_h": gpu_h,
            "money": None if hourly is None else gpu_h * hourly, "seeds": len(spec.all_seeds),
            "chinchilla": tokens / (20 * params), "currency": deployment.currency}


# the synced values of the measurement behind `sync_compute_s` (paper-178m: 177.5M per replica)
_MEASURED_SYNC_PARAMS = 177.5e6


def gpu_lines(gpu: Mapping[str, Any]) -> list[str]:
    money = "" if gpu["money"] is None else f", about {gpu['money']:,.0f} {gpu['currency']}"
    return [f"On a GPU: `{gpu['spec']}` runs the same claims' grid at "
            f"{gpu['params'] / 1e6:.0f}M parameters and {gpu['tokens'] / 1e6:.0f}M tokens a run "
            f"({gpu['chinchilla']:.1f}x Chinchilla), {gpu['runs']} runs over {gpu['seeds']} "
            f"seeds. On `{gpu['deployment_path']}` (its measured compute: the file says where "
            "it was measured) a run takes about "
            f"{gpu['run_s'] / 60:.0f} minutes, the whole spec about {gpu['gpu_h']:.0f} "
            f"GPU-hours{money}. An estimate, not a measurement: 6N FLOPs at the measured rate "
            "(a smaller model uses a GPU less well: a lower bound for the inner steps) and "
            f"{gpu['sync_s'] / 60:.0f} minutes a run of SparseLoCo rounds at the rate measured "
            "when the round ran on 3 CPU threads (an upper bound: it runs on the device since "
            "issue 24, unmeasured there). "
            f"It runs with `crucible study run {gpu['spec']}` on a machine with a GPU.", ""]
