"""Simulation efficiency: tokens/s of the Crucible trainer over tokens/s of a plain PyTorch loop.

For a preset (R=8 replicas x S=4 stages, as every preset has) it times `Trainer.run()` - inner
steps, outer SparseLoCo sync through a local object store, evaluation, metrics/events written to
jsonl with fsync, checkpoints, exactly what `crucible run` does - for each arm:

- `none`, `ssn`, `mapl`: the three boundary codecs, no faults;
- `skip_p0.2`: codec `none`, `skip` strategy at failure probability 0.2 (duration from the preset);

and the plain reference (`benchmarks/reference.py`: one model, one AdamW, R*B sequences of T
tokens per step, the same number of steps, and, interleaved, the same evaluations of the same
held-out windows) in the same process. By default the reference is
interleaved inside each Crucible run - H reference steps after every global step, timed apart and
taken out of the run's wall time - so a change in machine speed (this machine is shared) hits
both sides of a pair alike; `--separate` alternates whole runs instead, as the first version of
this benchmark did. Each (arm, repeat) gives one pair; the median of the pairs' ratios is
reported. `ratio` is the worst arm's median ratio (the goal is >= 0.9). Each arm also gets
`ratio_loop`: the same pairs with the Crucible side timed as the summary's `wall_s` times a run,
the training loop without the end-of-run reports (MAPL's basis report; the alignment report
runs only where a study asks for it since issue 35), whose cost is fixed per run and so weighs 3x more in a 10-step
run than in the preset's 30.

`--reference codec` pairs the mapl arm with a plain loop that carries MAPL's boundaries instead
(`benchmarks/reference.py`, `codec="mapl"`): the simulator's own overhead on MAPL, without
MAPL's arithmetic counted against it. `--reference both` runs the two loops in each mapl run,
one after the other and timed apart, so that one sitting gives the plain pairs, the pairs with
the codec's loop (`against_codec`) and the codec's cost to a plain loop (`codec_loop_over_plain`),
pair by pair. Every arm's pairs also give a mean with a 95% Student-t interval (`interval`).

    python -m benchmarks.sim_throughput --preset small --json
    python -m benchmarks.sim_throughput --preset smoke --repeats 3 --threads 1 --phases

`--global-steps` shortens a run (throughput per step does not depend on the run length beyond
the warm-up, evaluation and checkpoint cadence, which stay the preset's). `--phases` adds where a
Crucible run's wall time goes (inner steps, outer sync, evaluation, callback flush, checkpoint,
and `other`: the rest of the run, the end-of-run reports included) and the summary's own
`timing` (the round's phases encode/upload/decode/aggregate/outer, the reports' seconds).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import provenance
from benchmarks.reference import ReferenceLoop, reference_tokens_per_s
from crucible.config import Config, apply_overrides
from crucible.events import JsonlCallback
from crucible.presets import get_preset
from crucible.stats.intervals import summarise
from crucible.store import LocalStore
from crucible.train import Trainer

log = logging.getLogger("benchmarks.sim_throughput")

REFERENCES = ("plain", "codec", "both")

ARMS: dict[str, dict[str, object]] = {
    "none": {"pipeline.compression": "none"},
    "ssn": {"pipeline.compression": "ssn"},
    "mapl": {"pipeline.compression": "mapl"},
    "skip_p0.2": {"pipeline.compression": "none", "faults.p": 0.2, "faults.strategy": "skip"},
}


def arm_config(preset: str, arm: str, *, global_steps: int | None) -> Config:
    """The preset with the arm's overrides, on the CPU in fp32."""
    overrides: dict[str, object] = {"train.device": "cpu", "train.dtype": "fp32", **ARMS[arm]}
    if global_steps is not None:
        overrides["train.global_steps"] = global_steps
    return apply_overrides(get_preset(preset), overrides)


def _timed(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start
    return wrapper


def _instrument(trainer: Trainer) -> dict[str, float]:
    # wrap bound methods on the instance only: the trainer's code is unchanged
    phases: dict[str, float] = defaultdict(float)
    trainer._inner_steps = _timed(phases, "inner_steps", trainer._inner_steps)  # type: ignore[method-assign]
    trainer.sync.synchronise = _timed(phases, "outer_sync", trainer.sync.synchronise)  # type: ignore[method-assign]
    trainer.evaluate = _timed(phases, "evaluate", trainer.evaluate)  # type: ignore[method-assign]
    trainer.callback.flush = _timed(phases, "callback_flush", trainer.callback.flush)  # type: ignore[method-assign]
    trainer._maybe_checkpoint = _timed(phases, "checkpoint", trainer._maybe_checkpoint)  # type: ignore[method-assign]
    return phases


def crucible_run(config: Config, *, phases: bool = False, scratch: Path = Path("runs"),
                 reference: ReferenceLoop | None = None,
                 also: ReferenceLoop | None = None) -> dict[str, Any]:
    """One `Trainer.run()` in a scratch directory under `scratch` (where `crucible run` writes:
    its out folder, store included, is under ./runs); tokens/s over the run's wall time (the
    trainer's construction - data loading, initialisation - is not timed).

    With `reference`, H steps of that loop (plain, or with a codec) run after every global step
    (through `run`'s `on_step` hook), and it scores the held-out windows after every evaluation;
    both are timed on their own: both sides then see the same machine, global step by global
    step, and the reference's time is taken out of the run's (the trainer's own `timing.eval_s`
    still counts the loops' evaluations; the `evaluate` phase does not). `also` (with
    `reference`): a second loop interleaved the same way right after the first, timed on its
    own (`also_tokens_per_s`), so that one run pairs the arm with two loops. The order is fixed
    (run, reference, also): each side follows one other side's work every global step, as with
    one loop."""
    if also is not None and reference is None:
        raise ValueError("`also` is a second reference: give `reference` too")
    scratch.mkdir(parents=True, exist_ok=True)
    loops = [loop for loop in (reference, also) if loop is not None]
    spent = [0.0 for _ in loops]

    def interleave(_done: int, _total: int) -> None:
        for i, loop in enumerate(loops):
            started = time.perf_counter()
            for _ in range(config.sparseloco.inner_steps):
                loop.step()
            spent[i] += time.perf_counter() - started

    with tempfile.TemporaryDirectory(prefix="crucible-bench-", dir=scratch) as tmp:
        sink = JsonlCallback(Path(tmp) / "out")
        trainer = Trainer(config, store=LocalStore(Path(tmp) / "store"), run_key="bench",
                          callback=sink)
        timings = _instrument(trainer) if phases else {}
        if reference is not None:
            # the reference scores the same held-out windows whenever the trainer does: both
            # sides then do the same work, training and evaluation
            crucible_evaluate = trainer.evaluate

            def evaluate_both(**kwargs: Any) -> float:
                value = crucible_evaluate(**kwargs)
                for i, loop in enumerate(loops):
                    started = time.perf_counter()
                    loop.evaluate(trainer.validation)
                    spent[i] += time.perf_counter() - started
                return value

            trainer.evaluate = evaluate_both  # type: ignore[method-assign]
        start = time.perf_counter()
        summary = trainer.run(on_step=interleave if reference is not None else None)
        ref_s = sum(spent)
        elapsed = time.perf_counter() - start - ref_s
        sink.close()
    result: dict[str, Any] = {"tokens": summary["tokens_processed"], "wall_s": elapsed,
                              "tokens_per_s": summary["tokens_processed"] / elapsed}
    # the training loop alone, as the summary's `wall_s` counts it: without the end-of-run
    # reports (alignment, MAPL bases, tail average) that `run` adds after the last step
    loop_s = summary["wall_s"] - ref_s
    result.update(loop_s=loop_s, reports_s=elapsed - loop_s,
                  loop_tokens_per_s=summary["tokens_processed"] / loop_s)
    keys = ("reference_tokens_per_s", "also_tokens_per_s")[:len(loops)]
    for key, loop, seconds in zip(keys, loops, spent, strict=True):
        steps = loop.done - 1  # less the warm-up step
        result[key] = steps * loop.tokens_per_step / seconds
    if phases:
        result["phases_s"] = dict(timings)
        # what the loop's phases leave out: the end-of-run reports (alignment, MAPL bases,
        # tail average) and the loop's own bookkeeping
        result["phases_s"]["other"] = elapsed - sum(timings.values())
        # the run's own timing (summary.json `timing`: the round's phases, the reports')
        result["timing_s"] = {k: v for k, v in summary.get("timing", {}).items()
                              if isinstance(v, (int, float))}
    return result


def reference_codec(arm: str, reference: str) -> str:
    """The codec the plain loop carries for `arm`: none for `--reference plain`; for
    `--reference codec`, MAPL's for the mapl arm (`benchmarks/reference.py`) and none for the
    others (SSN's fixed projections make its arm cheaper than the plain loop already)."""
    _known(reference)
    return "mapl" if reference == "codec" and arm == "mapl" else "none"


def also_codec(arm: str, reference: str) -> str | None:
    """`--reference both`: the codec of the second loop the mapl arm is paired with in the same
    run (MAPL's), besides the plain one `reference_codec` gives it; None for every other case."""
    _known(reference)
    return "mapl" if reference == "both" and arm == "mapl" else None


def _known(reference: str) -> None:
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")


def measure(preset: str, *, arms: list[str], repeats: int, global_steps: int | None,
            phases: bool, scratch: Path = Path("runs"), interleave: bool = True,
            reference: str = "plain") -> dict[str, Any]:
    """Reference and Crucible arm by arm, `repeats` times; medians of the pairs' ratios, and
    their mean with a 95% interval (`ratio_interval`). With
    `interleave` (the default) the reference runs inside each Crucible run, H steps after every
    global step; otherwise whole reference runs alternate with whole Crucible runs. `reference`:
    "plain" (no codec), "codec" (`reference_codec`) or "both": the target's plain pairs, and for
    the mapl arm, in the same runs, pairs with the loop that carries MAPL's codec
    (`against_codec`) and that loop's speed over the plain one's (`codec_loop_over_plain`): what
    MAPL's codec costs a plain loop that trains and evaluates as the run does, pair by pair
    (interleaved runs only)."""
    if reference == "both" and not interleave:
        raise ValueError("--reference both pairs two loops inside one run: it needs interleaving")
    pairs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    loop_pairs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    phase_runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    timing_runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    codec_pairs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    loop_costs: dict[str, list[float]] = {arm: [] for arm in arms}
    for rep in range(repeats):
        for arm in arms:
            config = arm_config(preset, arm, global_steps=global_steps)
            steps = config.train.global_steps * config.sparseloco.inner_steps
            codec = reference_codec(arm, reference)
            second = also_codec(arm, reference)
            if interleave:
                loop = ReferenceLoop(config, total_steps=steps + 1, codec=codec)
                loop.step()  # warm-up, untimed, as in the separate mode
                also = None
                if second is not None:
                    also = ReferenceLoop(config, total_steps=steps + 1, codec=second)
                    also.step()
                run = crucible_run(config, phases=phases, scratch=scratch, reference=loop,
                                   also=also)
                ref = run["reference_tokens_per_s"]
                if also is not None:
                    codec_pairs[arm].append((run["tokens_per_s"], run["also_tokens_per_s"]))
                    loop_costs[arm].append(run["also_tokens_per_s"] / ref)
                    log.info("repeat %d arm %s: codec loop %.0f tok/s, ratio %.3f", rep, arm,
                             run["also_tokens_per_s"],
                             run["tokens_per_s"] / run["also_tokens_per_s"])
            else:
                ref = reference_tokens_per_s(config, steps=steps, codec=codec)
                run = crucible_run(config, phases=phases, scratch=scratch)
            pairs[arm].append((run["tokens_per_s"], ref))
            loop_pairs[arm].append((run["loop_tokens_per_s"], ref))
            if phases:
                phase_runs[arm].append({**run["phases_s"], "total": run["wall_s"]})
                timing_runs[arm].append(run["timing_s"])
            log.info("repeat %d arm %s: crucible %.0f tok/s, reference %.0f tok/s, ratio %.3f",
                     rep, arm, run["tokens_per_s"], ref, run["tokens_per_s"] / ref)
    result = _summarise(preset, arms, pairs, phase_runs, global_steps)
    for arm in arms:
        # the loop alone (without the end-of-run reports): the ratio the summary's wall_s gives
        result["arms"][arm]["ratio_loop"] = statistics.median(c / r for c, r in loop_pairs[arm])
        result["arms"][arm]["ratios_loop"] = [round(c / r, 4) for c, r in loop_pairs[arm]]
        if timing_runs[arm] and timing_runs[arm][0]:
            names = set.intersection(*(set(t) for t in timing_runs[arm]))
            result["arms"][arm]["timing_s"] = {
                n: statistics.median(t[n] for t in timing_runs[arm]) for n in sorted(names)}
        if codec_pairs[arm]:
            result["arms"][arm]["against_codec"] = _pair_stats(codec_pairs[arm])
            result["arms"][arm]["codec_loop_over_plain"] = {
                "ratios": [round(x, 4) for x in loop_costs[arm]],
                "interval": ratio_interval(loop_costs[arm])}
    result["interleaved"] = interleave
    # which loop each arm was paired with: under "codec" the top-level `ratio`/`worst_arm` are
    # the mapl arm's against its codec's loop and the others' against the plain one; under
    # "both" every arm's against the plain one (the mapl arm's other pairs: `against_codec`)
    result["reference"] = reference
    for arm in arms:
        result["arms"][arm]["reference_codec"] = reference_codec(arm, reference)
        second = also_codec(arm, reference)
        if second is not None:
            result["arms"][arm]["also_codec"] = second
    return result


def ratio_interval(ratios: list[float]) -> dict[str, float | int | None]:
    """The pairs' mean ratio with its two-sided 95% Student-t interval (`lo`/`hi` None for one
    pair): what a target such as 0.9 is resolved against. The median (`ratio`) says where the
    pairs sit; the interval says whether their spread lets a claim be made."""
    mean, lo, hi, n = summarise(ratios)
    return {"mean": mean, "lo": lo, "hi": hi, "n": n}


def interval_text(interval: dict[str, Any]) -> str:
    """`ratio_interval`'s result as a table prints it: "0.904 [0.860, 0.949]" ("[-]" for one
    pair, which has no spread to estimate)."""
    if interval["lo"] is None:
        return f"{interval['mean']:.3f} [-]"
    return f"{interval['mean']:.3f} [{interval['lo']:.3f}, {interval['hi']:.3f}]"


def _pair_stats(runs: list[tuple[float, float]]) -> dict[str, Any]:
    """Of (crucible, reference) tokens/s pairs: the median ratio, every ratio, their mean with
    its interval, and the reference's median speed."""
    ratios = [c / r for c, r in runs]
    return {"ratio": statistics.median(ratios), "ratios": [round(x, 4) for x in ratios],
            "interval": ratio_interval(ratios),
            "reference_tokens_per_s": statistics.median(r for _, r in runs)}


def _summarise(preset: str, arms: list[str], pairs: dict[str, list[tuple[float, float]]],
               phase_runs: dict[str, list[dict[str, float]]],
               global_steps: int | None) -> dict[str, Any]:
    per_arm: dict[str, Any] = {}
    for arm in arms:
        runs = pairs[arm]
        per_arm[arm] = {**_pair_stats(runs),
                        "crucible_tokens_per_s": statistics.median(c for c, _ in runs)}
        if phase_runs[arm]:
            names = phase_runs[arm][0].keys()
            per_arm[arm]["phases_s"] = {n: statistics.median(p[n] for p in phase_runs[arm])
                                        for n in names}
    worst = min(arms, key=lambda a: per_arm[a]["ratio"])
    config = arm_config(preset, arms[0], global_steps=global_steps)
    return {
        "preset": preset, "worst_arm": worst, "ratio": per_arm[worst]["ratio"],
        "crucible_tokens_per_s": per_arm[worst]["crucible_tokens_per_s"],
        "reference_tokens_per_s": per_arm[worst]["reference_tokens_per_s"],
        "arms": per_arm, "replicas": config.replicas, "stages": config.pipeline.stages,
        "global_steps": config.train.global_steps, "inner_steps": config.sparseloco.inner_steps,
        "tokens_per_inner_step": config.replicas * config.train.batch_size * config.model.seq_len,
        "repeats": len(next(iter(pairs.values()))), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0], "load_avg": list(os.getloadavg()),
    }


def _table(result: dict[str, Any]) -> str:
    lines = ["| arm | crucible tokens/s | reference tokens/s | ratio (median of pairs) "
             "| mean [95% interval] | pairs |", "|---|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        lines.append(f"| {arm} | {r['crucible_tokens_per_s']:.0f} | {r['reference_tokens_per_s']:.0f}"
                     f" | {r['ratio']:.3f} | {interval_text(r['interval'])}"
                     f" | {', '.join(f'{x:.3f}' for x in r['ratios'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=["smoke", "small"])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--global-steps", type=int, default=None,
                        help="override train.global_steps (default: the preset's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both sides (default: torch's choice)")
    parser.add_argument("--phases", action="store_true", help="report where Crucible's time goes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--separate", dest="interleave", action="store_false",
                        help="alternate whole reference runs with whole Crucible runs instead of "
                             "interleaving the reference step by step inside each run")
    parser.add_argument("--reference", default="plain", choices=REFERENCES,
                        help="plain: the loop without a codec, for every arm (the target's "
                             "reference); codec: the mapl arm against a plain loop with MAPL's "
                             "boundaries, the simulator's own overhead on MAPL; both: the plain "
                             "pairs, and the mapl arm paired with both loops in the same runs")
    parser.add_argument("--scratch", type=Path, default=Path("runs"),
                        help="folder for the runs' object store and logs (default ./runs, as "
                             "`crucible run`; on this machine /tmp creates files 10x slower)")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if not arms:
        parser.error("--arms names no arm; give a comma list of " + ", ".join(ARMS))
    for flag, value in (("--repeats", args.repeats), ("--global-steps", args.global_steps),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.reference == "both" and not args.interleave:
        parser.error("--reference both pairs two loops inside one run: drop --separate")
    if args.reference in ("codec", "both") and "mapl" not in arms:
        parser.error(f"--reference {args.reference} changes the mapl arm's loop only: add mapl "
                     "to --arms")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    started_on = provenance()
    result = measure(args.preset, arms=arms, repeats=args.repeats,
                     global_steps=args.global_steps, phases=args.phases, scratch=args.scratch,
                     interleave=args.interleave, reference=args.reference)
    result["provenance"] = started_on
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
        for arm, r in result["arms"].items():
            if "against_codec" in r:
                print(f"{arm} against the loop with its codec: "
                      f"{interval_text(r['against_codec']['interval'])}; that loop over the plain "
                      f"one: {interval_text(r['codec_loop_over_plain']['interval'])}")
        print(f"ratio (worst arm, {result['worst_arm']}): {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
