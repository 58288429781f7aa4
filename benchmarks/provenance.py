"""What a benchmark's numbers were measured on: the commit (and whether the tree had changes),
the CPU as /proc/cpuinfo tells it apart, the arithmetic digest of `crucible.arithmetic`, torch's
thread count and the load average. docs/PERFORMANCE.md names the commit and machine of every
table; a benchmark's JSON carries them, so nobody types them from memory. The commit is
`crucible.runfiles.git_sha`'s, what a run's summary records."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]


def commit(short: bool = True) -> str | None:
    """HEAD of the checkout the benchmark runs from (None outside a git checkout, or without
    git)."""
    from crucible.runfiles import git_sha

    sha = git_sha()
    return sha[:7] if sha and short else sha


def dirty() -> bool | None:
    """Whether tracked files differ from HEAD (None outside a git checkout, or without git)."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                              cwd=_REPO, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(done.stdout.strip()) if done.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """{commit, dirty, cpu, arithmetic, threads, cpu_count, load_avg}, taken now (call it before
    the measurement: the load average is the one the benchmark started at; only its first,
    one-minute value speaks for the start, the others for the minutes before)."""
    import torch

    from crucible.arithmetic import arithmetic
    from crucible.study.runner import cpu_identity

    return {"commit": commit(), "dirty": dirty(), "cpu": cpu_identity(),
            "arithmetic": arithmetic()["digest"], "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]}
