"""What a benchmark's numbers were measured on: the commit (and whether the tree had changes),
the CPU as /proc/cpuinfo tells it apart, the arithmetic digest of `crucible.arithmetic`, torch's
thread count and the load average. docs/PERFORMANCE.md names the commit and machine of every
table; a benchmark's JSON carries them, so nobody types them from memory."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]


def commit(short: bool = True) -> str | None:
    """HEAD of the checkout the benchmark runs from (None outside a git checkout)."""
    args = ["git", "-C", str(_REPO), "rev-parse"] + (["--short"] if short else []) + ["HEAD"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def dirty() -> bool | None:
    """Whether tracked files differ from HEAD (None outside a git checkout)."""
    done = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True)
    return bool(done.stdout.strip()) if done.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """{commit, dirty, cpu, arithmetic, threads, cpu_count, load_avg}, taken now (call it before
    the measurement: the load average is the one the benchmark started at)."""
    import torch

    from crucible.arithmetic import arithmetic
    from crucible.study.runner import cpu_identity

    return {"commit": commit(), "dirty": dirty(), "cpu": cpu_identity(),
            "arithmetic": arithmetic()["digest"], "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]}
