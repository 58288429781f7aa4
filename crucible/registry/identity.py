"""What makes two runs "the same run": the resolved config's fingerprint and the code version.

A sweep that is re-run skips a cell whose fingerprint and code version match a completed run.
The fingerprint leaves out `store.url` (and the S3 endpoint and region): where checkpoints live
does not change the numbers, and a re-run may point at another bucket.
"""
from __future__ import annotations

import hashlib
import json

import crucible
from crucible.config import Config
from crucible.runfiles import git_sha

__all__ = ["config_fingerprint", "code_version"]


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


def code_version() -> str:
    """`crucible.__version__`, plus `+g<sha>` (12 hex digits) when the git commit is known."""
    sha = git_sha()
    return f"{crucible.__version__}+g{sha[:12]}" if sha else crucible.__version__
