"""The memory estimate (`crucible.memory`) against the peak RSS that `crucible run` reaches.

Each case runs the real command line (`cli.main.main`) in a child process of its own, which
reports the estimate the run's pre-flight check made (the `memory estimate` log record) and its
own peak resident set size (`getrusage(RUSAGE_SELF).ru_maxrss`) when the run has ended; sizes in
MiB. With `--device cuda`, the GPU cases: the device part of the estimate against
`torch.cuda.max_memory_allocated`. Prints a Markdown table (docs/OPERATIONS.md, "Memory
estimate") or, with `--json`, the raw numbers.

    OMP_NUM_THREADS=1 python -m benchmarks.memory_estimate [--case smoke ...] [--json]
    python -m benchmarks.memory_estimate --device cuda [--data-path shakespeare.txt]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# name -> (preset, --set overrides). The synthetic cases stretch one term each: activations
# (a large batch) and model state with checkpoints (many replicas of a wider model).
CASES: dict[str, tuple[str, list[str]]] = {
    "smoke": ("smoke", []),
    "study": ("study", []),
    "small": ("small", []),
    "smoke B=256": ("smoke", ["train.batch_size=256", "train.global_steps=2",
                              "data.allow_repeat=true"]),
    "smoke R=32 d=256 ckpt": ("smoke", ["replicas=32", "model.d_model=256",
                                        "train.global_steps=2", "train.checkpoint_every=1",
                                        "data.allow_repeat=true"]),
}


# GPU cases (`--device cuda`): the device part of the estimate against what CUDA's caching
# allocator handed out. The paper preset at R=8, B=16 is the configuration docs/PERFORMANCE.md
# measured at 131.3 GiB; two inner steps reach the step's peak, one global step its sync.
_GPU_SHORT = ["train.global_steps=1", "sparseloco.inner_steps=2", "train.eval_tokens=65536",
              "train.checkpoint_every=0", "data.allow_repeat=true", "train.device=cuda"]
GPU_CASES: dict[str, tuple[str, list[str]]] = {
    "paper-178m R=2 B=4 fp32": ("paper-178m", ["replicas=2", "train.batch_size=4",
                                               "train.dtype=fp32", *_GPU_SHORT]),
    "paper-178m R=2 B=4 bf16": ("paper-178m", ["replicas=2", "train.batch_size=4", *_GPU_SHORT]),
    "paper-178m R=8 B=16 bf16": ("paper-178m", _GPU_SHORT),
}


def _child(preset: str, overrides: list[str], out: str) -> dict[str, Any]:
    """Run `crucible run` in this process; the estimate and this process's peak RSS."""
    captured: dict[str, Any] = {}

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if hasattr(record, "memory_estimate"):
                captured["estimate"] = record.memory_estimate

    logger = logging.getLogger("crucible.memory")
    logger.addHandler(_Grab(logging.INFO))
    logger.setLevel(logging.INFO)
    sys.argv = ["crucible", "run", "--preset", preset, "--out", out, "--no-progress"]
    for item in overrides:
        sys.argv += ["--set", item]
    from cli.main import app  # `crucible run` alone: no registry or flows packages needed

    code = 0
    try:
        app()
    except SystemExit as exc:
        code = int(exc.code or 0)
    est = captured["estimate"]
    row = {"exit": code, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "estimate": est.host_bytes, "process": est.process, "data": est.data,
           "model_state": est.model_state, "phase": est.phase,
           "phase_bytes": est.host_phases[est.phase], "checkpoint": est.checkpoint}
    if est.on_gpu:
        import torch

        row.update(device_estimate=est.device_bytes,
                   device_allocated=torch.cuda.max_memory_allocated(),
                   device_reserved=torch.cuda.max_memory_reserved())
    return row


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[*CASES, *GPU_CASES],
                        help="run only these cases (repeatable; default: all of the device's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the GPU cases, device estimate against CUDA's allocator")
    parser.add_argument("--data-path", help="data.path for every case (a machine without the "
                                            "cached corpus)")
    parser.add_argument("--json", action="store_true", help="print the raw numbers")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = GPU_CASES if args.device == "cuda" else CASES
    if args.child:
        preset, overrides = {**CASES, **GPU_CASES}[args.child[0]]
        data = [f"data.path={os.environ['MEMORY_ESTIMATE_DATA']}"] if os.environ.get(
            "MEMORY_ESTIMATE_DATA") else []
        print(json.dumps(_child(preset, [*overrides, *data], args.child[1])))
        return
    env = dict(os.environ, CRUCIBLE_LOG_LEVEL="WARNING")
    if args.data_path:
        env["MEMORY_ESTIMATE_DATA"] = str(Path(args.data_path).resolve())
    Path("runs").mkdir(exist_ok=True)
    rows = []
    for name in args.case or list(cases):
        with tempfile.TemporaryDirectory(dir="runs") as out:
            done = subprocess.run([sys.executable, "-m", "benchmarks.memory_estimate", "--child",
                                   name, str(Path(out) / "run")], capture_output=True, text=True,
                                  env=env, check=False)
        if done.returncode != 0:
            raise SystemExit(f"case {name} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"case": name, **row})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    if args.device == "cuda":
        print("| case | device estimate (GiB) | max allocated (GiB) | max reserved (GiB) | "
              "estimate / allocated | host estimate (MiB) | peak RSS (MiB) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['device_estimate'] / 2**30:.1f} | "
                  f"{r['device_allocated'] / 2**30:.1f} | {r['device_reserved'] / 2**30:.1f} | "
                  f"{r['device_estimate'] / r['device_allocated']:.2f} | "
                  f"{_mib(r['estimate'])} | {_mib(r['peak_rss'])} |")
        return
    print("| case | process | data | model state | largest phase | checkpoint | estimate | "
          "measured peak RSS | estimate / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {_mib(r['process'])} | {_mib(r['data'])} | "
              f"{_mib(r['model_state'])} | {r['phase']} {_mib(r['phase_bytes'])} | "
              f"{_mib(r['checkpoint'])} | {_mib(r['estimate'])} | {_mib(r['peak_rss'])} | "
              f"{r['estimate'] / r['peak_rss']:.2f} |")


if __name__ == "__main__":
    main()
