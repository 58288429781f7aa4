"""Two study cells at once: as two threads of one process (how `crucible study run` runs them,
as subflows of the failure-sweep flow) against two processes (how the earlier runner did).

    python -m benchmarks.cells_in_threads [--preset study] [--global-steps 6] [--set K=V ...]
        [--out runs/bench-threads]

Prints one JSON line: wall seconds of each way (the processes' includes starting Python and
importing torch, reported apart as the slowest process's own training time), the ratio, and
whether the final losses agree to the bit (they must: every random stream is seeded per run).
One torch thread everywhere. The runs are seeds 0 and 1 of the preset's p = 0 cell.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def _one(preset: str, steps: int, seed: int, out: Path, extra: list[str]) -> float:
    from crucible.config import apply_overrides
    from crucible.presets import get_preset
    from crucible.train import train

    config = apply_overrides(get_preset(preset), [*extra, f"train.global_steps={steps}",
                                                   f"train.eval_every={steps}", f"seed={seed}"])
    return float(train(config, out_dir=out)["final_val_loss"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="study")
    parser.add_argument("--global-steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-threads"))
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        help="key.path=value for both runs, e.g. sparseloco.inner_steps=16")
    parser.add_argument("--one", nargs=2, metavar=("SEED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.one:
        started = time.perf_counter()
        loss = _one(args.preset, args.global_steps, int(args.one[0]), Path(args.one[1]),
                    args.extra)
        print(json.dumps({"loss": loss, "train_s": time.perf_counter() - started}))
        return 0
    out = args.out.resolve()
    seeds = (0, 1)
    losses: dict[int, float] = {}
    started = time.perf_counter()
    threads = [threading.Thread(target=lambda s=s: losses.__setitem__(
        s, _one(args.preset, args.global_steps, s, out / f"thread-{s}", args.extra)))
        for s in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    threads_s = time.perf_counter() - started
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    extra = [a for item in args.extra for a in ("--set", item)]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.cells_in_threads", "--preset",
                               args.preset, "--global-steps", str(args.global_steps), *extra,
                               "--one", str(s), str(out / f"process-{s}")],
                              stdout=subprocess.PIPE, env=env)
             for s in seeds]
    done = [json.loads(p.communicate()[0]) for p in procs]
    processes_s = time.perf_counter() - started
    print(json.dumps({
        "preset": args.preset, "global_steps": args.global_steps, "set": args.extra,
        "threads_s": round(threads_s, 2), "processes_s": round(processes_s, 2),
        "processes_train_s": round(max(d["train_s"] for d in done), 2),
        "ratio_threads_to_processes": round(threads_s / processes_s, 3),
        "same_bits": [losses[s] for s in seeds] == [d["loss"] for d in done],
        "load_average": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
