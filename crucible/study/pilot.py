"""How the study's preset was chosen: the pilot table, rendered from committed pilot runs.

A study spec may list `pilots`: other study specs (paths relative to it), each one candidate
preset run at skip, p = 0.2 (and its p = 0 baselines) over a few seeds. For every pilot and arm
the table gives the baselines' spread, the paired degradation's mean and sd, the CPU seconds a
run took, and from the sd the seeds a +-target 95% interval needs in that arm and what the
rendering spec's whole grid would cost at that many seeds. Everything comes from the pilots'
result files; nothing is typed in.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PilotRow", "pilot_rows", "pilot_section", "token_rows", "token_section", "PILOT_P",
           "MIN_GRID_SEEDS"]

PILOT_P = 0.2            # the pilots measure skip at the highest failure rate of the grid
MIN_GRID_SEEDS = 8       # the grid's floor, whatever the pilot's sd says


@dataclass(frozen=True)
class PilotRow:
    pilot: str           # the pilot spec's name
    preset: str
    sets: tuple[str, ...]
    dims: int            # boundary dimensions (d_model // factor; d_model for uncompressed)
    arm: str
    seeds: int           # seeds with both a baseline and the skip run
    base_mean: float | None
    base_sd_pct: float | None      # sd of the baselines' final loss, % of their mean
    skip_mean: float | None        # paired degradation, points
    paired_sd: float | None
    wall_s: float | None           # mean wall seconds of the arm's runs (one thread each)
    seeds_needed: int | None       # for a +-target 95% interval, at least MIN_GRID_SEEDS
    grid_runs: int | None          # the rendering spec's runs of this arm at that many seeds
    grid_cpu_h: float | None
    machines: tuple[str, ...] = ()  # where its runs ran: "machine, N at a time"


def _grid_cells_per_arm(spec: Any) -> dict[str, int]:
    """Failure cells per arm in `spec`'s grid (its baselines add one per seed)."""
    from crucible.grid.cells import grid_keys

    counts: dict[str, int] = {}
    for key in grid_keys(spec):
        if not key.is_baseline:
            counts[key.arm] = counts.get(key.arm, 0) + 1
    return counts


def pilot_rows(spec: Any, *, target: float | None = None) -> list[PilotRow]:
    """One row per (pilot of `spec`, arm), in the pilots' order; raises StudyError for a pilot
    spec that does not load."""
    from crucible.config import apply_overrides
    from crucible.grid.names import ARMS
    from crucible.presets import get_preset
    from crucible.stats import seeds_for_half_width, stat_of
    from crucible.study.data import StudyData
    from crucible.study.runner import load_results
    from crucible.study.spec import load_spec

    target = spec.target_half_width if target is None else target
    per_arm = _grid_cells_per_arm(spec)
    rows: list[PilotRow] = []
    for path in spec.files.pilots:
        pilot = load_spec(path)
        data = StudyData(pilot, load_results(pilot))
        config = apply_overrides(get_preset(pilot.preset), list(pilot.common_overrides()))
        for arm in ARMS:
            key = data.find(arm, "skip", PILOT_P)
            if key is None:
                continue
            base = {s: r["final_val_loss"] for s, r in data.baseline(arm).items()}
            paired = stat_of(data.degradation(key))
            arm_runs = list(data.baseline(arm).values()) + list(data.runs(key).values())
            walls = [float(r["wall_s"]) for r in arm_runs]
            machines = tuple(sorted({f"{(r.get('study') or {}).get('machine', 'unknown')}, "
                                     f"{(r.get('study') or {}).get('jobs', '?')} at a time"
                                     for r in arm_runs}))
            base_values = list(base.values())
            base_mean = statistics.fmean(base_values) if base_values else None
            base_sd = (100 * statistics.stdev(base_values) / base_mean
                       if len(base_values) > 1 and base_mean else None)
            needed = None
            if paired.sd is not None and paired.n >= 3:   # an sd of 2 seeds says too little
                n = seeds_for_half_width(paired.sd, target)
                needed = None if n is None else max(MIN_GRID_SEEDS, n)
            wall = statistics.fmean(walls) if walls else None
            runs_total = (None if needed is None or arm not in per_arm
                          else needed * (per_arm[arm] + 1))
            cpu_h = (None if runs_total is None or wall is None
                     else runs_total * wall / 3600.0)
            dims = (config.model.d_model if arm == "none"
                    else config.model.d_model // config.pipeline.factor)
            rows.append(PilotRow(pilot.name, pilot.preset, pilot.common_overrides(), dims, arm, paired.n,
                                 base_mean, base_sd, paired.mean, paired.sd, wall, needed,
                                 runs_total, cpu_h, machines))
    return rows


def _f(value: float | None, fmt: str) -> str:
    from crucible.study.formatting import _num

    return _num(None if value is not None and math.isnan(value) else value, fmt)


def pilot_section(spec: Any, rows: Sequence[PilotRow], labels: Mapping[str, str]) -> list[str]:
    """The "How the preset was chosen" section (Markdown lines)."""
    if not rows:
        return []
    target = spec.target_half_width
    out = ["## How the preset was chosen", "",
           f"Each candidate preset (a pilot spec: `crucible study run PILOT`) was run at skip, "
           f"p = {PILOT_P:g} and p = 0 over the same seeds. Per arm: the baselines' final loss "
           "and its seed-to-seed sd (% of the loss), the paired degradation (points) and its sd, "
           "the mean wall seconds of one run (one torch thread; the machines are listed under "
           f"the table), the seeds a ±{target:g}-point 95% interval needs at that sd (at least "
           f"{MIN_GRID_SEEDS}; shown from 3 seeds on), and this study's grid at "
           "that many seeds in runs and CPU-hours (cells x seeds, one p = 0 baseline per seed; "
           "drop_extend's longer runs counted as one). An sd measured on n seeds is itself "
           "uncertain (about ±30% at 6 seeds), so the seeds and hours are sizes, not counts.", ""]
    header = ["pilot", "boundary dims", "arm", "seeds", "baseline loss", "baseline sd %",
              f"skip p={PILOT_P:g} (points)", "paired sd", "s per run",
              f"seeds for ±{target:g}", "grid runs", "grid CPU-h"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join([
            f"`{r.pilot}`", str(r.dims), labels.get(r.arm, r.arm), str(r.seeds),
            _f(r.base_mean, ".4f"), _f(r.base_sd_pct, ".2f"), _f(r.skip_mean, "+.2f"),
            _f(r.paired_sd, ".2f"), _f(r.wall_s, ".0f"),
            "-" if r.seeds_needed is None else str(r.seeds_needed),
            "-" if r.grid_runs is None else str(r.grid_runs), _f(r.grid_cpu_h, ".1f")]) + " |")
    out += lines
    totals: dict[str, tuple[int, float]] = {}
    for name in dict.fromkeys(r.pilot for r in rows):
        mine = [r for r in rows if r.pilot == name]
        if all(r.grid_runs is not None and r.grid_cpu_h is not None for r in mine):
            totals[name] = (sum(r.grid_runs or 0 for r in mine),
                            math.fsum(r.grid_cpu_h or 0.0 for r in mine))
    if totals:
        out += ["", "This study's grid at each pilot's seeds: " + "; ".join(
            f"`{name}` {runs:,} runs, {hours:.1f} CPU-hours" for name, (runs, hours)
            in totals.items()) + " (rows summed; only pilots with every arm measured)."]
    reused = {p.resolve() for p in spec.files.reuse}
    chosen = [r.pilot for r in rows if any(
        p.name == f"{r.pilot}.toml" or p.stem == r.pilot for p in reused)]
    if chosen:
        out += ["", f"The preset is `{spec.preset}`: the configuration of `{chosen[0]}` (its runs "
                "are this study's cells, adopted by `crucible study adopt`), and each arm's "
                "seeds in the spec are that pilot's \"seeds for\" column."]
    out += ["", "Pilots: " + "; ".join(
        f"`{name}` = preset `{preset}`" + (f" with {', '.join(f'`{s}`' for s in sets)}"
                                           if sets else "")
        for name, preset, sets in dict.fromkeys((r.pilot, r.preset, r.sets) for r in rows))
        + ".", "", "Machines: " + "; ".join(
            f"`{name}`: {', '.join(machines)}" for name, machines in
            {r.pilot: tuple(sorted({m for q in rows if q.pilot == r.pilot for m in q.machines}))
             for r in rows}.items() if machines) + ".", ""]
    return out


def token_rows(spec: Any) -> list[dict[str, Any]]:
    """Per arm of the `token_check` pair (half, full): the seeds both ran, each seed's change of
    the baseline's final loss from full to half the tokens (%), and the full baselines' seed
    sd (% of their mean)."""
    from crucible.grid.names import ARMS
    from crucible.study.data import StudyData
    from crucible.study.runner import load_results
    from crucible.study.spec import load_spec

    half_spec, full_spec = (load_spec(p) for p in spec.files.token_check)
    half = StudyData(half_spec, load_results(half_spec))
    full = StudyData(full_spec, load_results(full_spec))
    rows = []
    for arm in ARMS:
        a = {s: r["final_val_loss"] for s, r in half.baseline(arm).items()}
        b = {s: r["final_val_loss"] for s, r in full.baseline(arm).items()}
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        values = list(b.values())
        sd = (100 * statistics.stdev(values) / statistics.fmean(values)
              if len(values) > 1 else None)
        rows.append({"arm": arm, "seeds": seeds, "half": half_spec.name, "full": full_spec.name,
                     "change_pct": [100 * (a[s] - b[s]) / b[s] for s in seeds],
                     "full_sd_pct": sd, "full_seeds": len(values)})
    return rows


def token_section(spec: Any, labels: Mapping[str, str]) -> list[str]:
    """Is the preset token-limited? Halving the tokens against the seed spread (Markdown)."""
    rows = token_rows(spec)
    if not rows:
        from crucible.study.spec import load_spec

        half = load_spec(spec.files.token_check[0])
        return ["### Is the preset token-limited?", "",
                f"Not measured yet: `crucible study run {half.shown(half.path)}` runs the "
                "preset's baselines with half the tokens.", ""]
    out = ["### Is the preset token-limited?", "",
           f"The preset's baselines with half the global steps (`{rows[0]['half']}`, the schedule "
           f"decaying over them) against the same seeds' full runs (`{rows[0]['full']}`): the "
           "final loss's change, against the seed-to-seed sd of the full baselines.", "",
           "| arm | seeds | half the tokens: change of the final loss | seed sd of the full "
           "baselines |", "|---|---|---|---|"]
    for r in rows:
        change = ", ".join(f"{c:+.2f}%" for c in r["change_pct"])
        out.append(f"| {labels.get(r['arm'], r['arm'])} | {', '.join(map(str, r['seeds']))} | "
                   f"{change} | {_f(r['full_sd_pct'], '.2f')}% ({r['full_seeds']} seeds) |")
    smallest = min(min(r["change_pct"]) for r in rows)
    largest_sd = max((r["full_sd_pct"] for r in rows if r["full_sd_pct"] is not None),
                     default=None)
    if largest_sd is not None:
        verdict = ("token-limited: every seed's loss rose by more than three seed sds"
                   if smallest > 3 * largest_sd else
                   "not clearly token-limited: some seed's rise is within three seed sds")
        out += ["", f"Smallest rise {smallest:+.2f}% against the largest seed sd "
                f"{largest_sd:.2f}%: {verdict}."]
    out.append("")
    return out
