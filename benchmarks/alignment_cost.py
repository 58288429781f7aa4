"""The end-of-run alignment report (crucible.alignment), timed two ways on the same trainer.

`resumed`: as `Trainer.run` makes it (each bypassed forward starts from the message the intact
forward sent into the skipped stage, and the skipped stage is not computed); `whole`: every
bypassed forward computed from the embedding on, as before issue 38. The two alternate
`--repeats` times in one process with one torch thread, on the preset's freshly initialised
global model (the report's cost does not depend on the weights), and the reports are compared
bit for bit.

    python -m benchmarks.alignment_cost --preset small --arms none,ssn,mapl --windows 256 --repeats 3

Prints one JSON object: per arm, the median seconds of each way, their ratio, and `equal`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.sim_throughput import arm_config
from crucible.alignment import ALIGNMENT_WINDOWS, alignment_report
from crucible.events import MultiCallback
from crucible.store import LocalStore
from crucible.train import Trainer


def _report(trainer: Trainer, windows: int, *, whole: bool) -> tuple[float, dict[str, Any]]:
    model_class = type(trainer.model)
    forward = model_class.forward

    def whole_forward(self: Any, *args: Any, resume: Any = None, taps: Any = None,
                      **kwargs: Any) -> torch.Tensor:
        return forward(self, *args, taps={} if taps is None else taps, **kwargs)

    if whole:
        model_class.forward = whole_forward  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        report = alignment_report(trainer.evaluator, windows=windows)
        seconds = time.perf_counter() - started
    finally:
        model_class.forward = forward  # type: ignore[method-assign]
    report.pop("seconds")
    return seconds, report


def measure(preset: str, arms: list[str], *, windows: int, repeats: int) -> dict[str, Any]:
    result: dict[str, Any] = {"preset": preset, "windows": windows, "repeats": repeats, "arms": {}}
    for arm in arms:
        config = arm_config(preset, arm, global_steps=None)
        with tempfile.TemporaryDirectory(prefix="crucible-align-", dir="runs") as tmp:
            trainer = Trainer(config, store=LocalStore(Path(tmp) / "store"), run_key="align",
                              callback=MultiCallback())
            times: dict[str, list[float]] = {"whole": [], "resumed": []}
            reports = {}
            for _ in range(repeats):
                for way in ("whole", "resumed"):
                    seconds, reports[way] = _report(trainer, windows, whole=way == "whole")
                    times[way].append(seconds)
        whole, resumed = (statistics.median(times[w]) for w in ("whole", "resumed"))
        result["arms"][arm] = {"whole_s": whole, "resumed_s": resumed,
                               "resumed_over_whole": resumed / whole,
                               "equal": reports["whole"] == reports["resumed"]}
    result["load_avg"] = list(os.getloadavg())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=["smoke", "small"])
    parser.add_argument("--arms", default="none,ssn,mapl")
    parser.add_argument("--windows", type=int, default=ALIGNMENT_WINDOWS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    Path("runs").mkdir(exist_ok=True)
    print(json.dumps(measure(args.preset, [a for a in args.arms.split(",") if a],
                             windows=args.windows, repeats=args.repeats), indent=2))


if __name__ == "__main__":
    main()
