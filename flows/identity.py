"""What makes two runs "the same run": the resolved config's fingerprint and the code version.

A sweep that is re-run skips a cell whose fingerprint and code version match a completed run.
The fingerprint leaves out `store.url` (and the S3 endpoint and region): where checkpoints live
does not change the numbers, and a re-run may point at another bucket.
"""
from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from pathlib import Path

import crucible
from crucible.config import Config

__all__ = ["config_fingerprint", "code_version", "git_sha"]

_REPO_ROOT = Path(__file__).resolve().parent.parent


def config_fingerprint(config: Config) -> str:
    """sha256 (hex) of the resolved config's canonical JSON, without the store location and
    `sparseloco.round_timeout_s` (the distributed mode's wall-clock deadline: no number of a
    simulated run depends on it, and adding the key must not re-identify every earlier run),
    nor the keys added later that hold their default (`crucible.config.LATER_DEFAULTS`). A
    `trace` process adds the trace file's sha256: the same path with other failures is another
    run."""
    data = config.identity()
    data.pop("store", None)
    data.get("sparseloco", {}).pop("round_timeout_s", None)
    if config.faults.process == "trace" and config.faults.trace:
        from crucible.faults import trace_digest

        data["faults"]["trace_sha256"] = trace_digest(config.faults.trace)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@functools.cache
def git_sha() -> str | None:
    """The checkout's commit, or None outside a git checkout (an installed wheel, a container)."""
    try:
        result = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=_REPO_ROOT,
                                capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = result.stdout.strip()
    return sha if result.returncode == 0 and sha else None


def code_version() -> str:
    """`crucible.__version__`, plus `+g<sha>` when the git commit is known."""
    sha = git_sha()
    return f"{crucible.__version__}+g{sha}" if sha else crucible.__version__
