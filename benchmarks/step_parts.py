"""Inner steps or evaluations of Crucible arms against the plain reference, alternated in one
process, with the inner step split into its parts.

`sim_throughput` times whole runs. This benchmark times one piece of a run at a time, so that a
gap can be placed:
- `--part inner`: one global step's H inner steps (`Trainer._inner_steps`) of each arm against
  H steps of `benchmarks/reference.py`'s loop. The forward, the backward, clipping, AdamW and
  (MAPL) the Stiefel step are also timed apart, in milliseconds per inner step.
- `--part eval`: one whole-split evaluation (`Trainer.evaluate`) against the reference's
  evaluation of the same windows.

An arm is a codec name, optionally with config overrides: `mapl:pipeline.mapl_ns_steps=4`. That
is how a change of arithmetic is priced: its time against the arm as it is. Every arm and the
reference run once per repeat, in turn, on one torch thread; medians are reported.

    python -m benchmarks.step_parts --part inner --arms none,ssn,mapl,mapl:pipeline.mapl_ns_steps=4 --repeats 6
    python -m benchmarks.step_parts --part eval --arms none,mapl --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import provenance
from benchmarks.reference import ReferenceLoop
from benchmarks.sim_throughput import ARMS, _timed, arm_config
from crucible import boundary
from crucible.config import Config, ConfigError, apply_overrides
from crucible.events import JsonlCallback
from crucible.store import LocalStore
from crucible.strategy import plan_step
from crucible.train import Trainer

PARTS = ("forward", "backward", "clip", "adamw", "stiefel")


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'mapl:pipeline.mapl_ns_steps=4;...' -> ('mapl', ['pipeline.mapl_ns_steps=4', ...])."""
    name, _, rest = text.partition(":")
    if name not in ARMS:
        raise ConfigError(f"--arms: unknown arm {name!r}; choose from {', '.join(ARMS)}")
    overrides = [item.strip() for item in rest.split(";") if item.strip()]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--arms: {item!r} in {text!r} is not KEY=VALUE")
    return name, overrides


@contextmanager
def _timed_parts(trainer: Trainer, parts: dict[str, float]) -> Iterator[None]:
    """Add the seconds of each part of an inner step to `parts` while inside."""
    def wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        return _timed(parts, name, fn)

    model, optimizer = trainer.model, trainer.optimizer
    saved = (model.forward, trainer._clip, optimizer.step, boundary.stiefel_steps,
             torch.Tensor.backward)
    model.forward = wrap(model.forward, "forward")  # type: ignore[method-assign]
    trainer._clip = wrap(trainer._clip, "clip")  # type: ignore[method-assign]
    optimizer.step = wrap(optimizer.step, "adamw")  # type: ignore[method-assign]
    boundary.stiefel_steps = wrap(boundary.stiefel_steps, "stiefel")
    torch.Tensor.backward = wrap(torch.Tensor.backward, "backward")  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.forward, trainer._clip, optimizer.step
        boundary.stiefel_steps, torch.Tensor.backward = saved[3], saved[4]


def _trainer(config: Config, scratch: Path) -> Trainer:
    tmp = Path(tempfile.mkdtemp(prefix="crucible-parts-", dir=scratch))
    return Trainer(config, store=LocalStore(tmp / "store"), run_key="parts",
                   callback=JsonlCallback(tmp / "out"))


def measure(preset: str, arms: list[str], *, part: str, repeats: int,
            scratch: Path) -> dict[str, Any]:
    scratch.mkdir(parents=True, exist_ok=True)
    trainers: dict[str, tuple[Trainer, Any]] = {}
    for text in arms:
        name, overrides = parse_arm(text)
        config = apply_overrides(arm_config(preset, name, global_steps=None), overrides)
        trainer = _trainer(config, scratch)
        trainers[text] = (trainer, plan_step(trainer.plan, 0, config=config))
    config = next(iter(trainers.values()))[0].config
    H = config.sparseloco.inner_steps
    reference = ReferenceLoop(config, total_steps=H * (repeats + 2) * 10)
    reference.step()  # warm-up
    validation = next(iter(trainers.values()))[0].validation
    seconds: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, dict[str, float]] = {a: dict.fromkeys(PARTS, 0.0) for a in trainers}

    def reference_run() -> None:
        if part == "inner":
            for _ in range(H):
                reference.step()
        else:
            reference.evaluate(validation)

    for rep in range(repeats + 1):  # the first round warms every side up and is not kept
        for arm, (trainer, step) in trainers.items():
            started = time.perf_counter()
            if part == "inner":
                with _timed_parts(trainer, parts[arm] if rep else defaultdict(float)):
                    trainer._inner_steps(0, step)
            else:
                trainer.evaluate()
            if rep:
                seconds[arm].append(time.perf_counter() - started)
        started = time.perf_counter()
        reference_run()
        if rep:
            seconds["reference"].append(time.perf_counter() - started)
    ref = statistics.median(seconds["reference"])
    result: dict[str, Any] = {
        "preset": preset, "part": part, "repeats": repeats, "inner_steps": H,
        "threads": torch.get_num_threads(), "load_avg": list(os.getloadavg()),
        "torch": torch.__version__, "reference_s": ref, "arms": {}}
    for arm in trainers:
        median = statistics.median(seconds[arm])
        row: dict[str, Any] = {"median_s": median, "seconds": [round(s, 4) for s in seconds[arm]],
                               "reference_over_arm": ref / median}
        if part == "inner":
            row["ms_per_inner_step"] = {p: 1e3 * v / (repeats * H) for p, v in parts[arm].items()}
        result["arms"][arm] = row
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=["smoke", "small"])
    parser.add_argument("--part", default="inner", choices=["inner", "eval"])
    parser.add_argument("--arms", default="none,ssn,mapl",
                        help="comma list of ARM[:KEY=VALUE;KEY=VALUE] (arms: "
                             f"{', '.join(ARMS)})")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--scratch", type=Path, default=Path("runs"),
                        help="folder for the trainers' stores (default ./runs)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(1)
    started_on = provenance()
    try:
        result = measure(args.preset, [a.strip() for a in args.arms.split(",") if a.strip()],
                         part=args.part, repeats=args.repeats, scratch=args.scratch)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result["provenance"] = started_on
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
