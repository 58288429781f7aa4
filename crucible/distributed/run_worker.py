"""The worker process's entry point, as its elastic agent starts it:

    python -m crucible.distributed.run_worker --run-dir DIR --replica r

It first asks the kernel to SIGKILL this process when its parent, the agent, dies
(`PR_SET_PDEATHSIG`, Linux), then checks that the parent still is an agent (one that died before
the request took effect has left this process to init: it exits at once), and only then imports
torch and the worker (`crucible.distributed.worker.main`): the window in which a killed agent
could leave an orphan training beside its replacement is the interpreter's start, not seconds of
imports.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_AGENT = b"torch.distributed.run"


def die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError) as exc:
        print(f"warning: cannot ask to die with the agent ({exc}); a killed agent may leave "
              "this process behind until the launcher stops it", file=sys.stderr)
        return
    try:
        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return
    if _AGENT not in parent:          # the agent died before the request took effect
        print("error: this worker's agent is gone; exiting", file=sys.stderr)
        os._exit(1)


if __name__ == "__main__":
    die_with_parent()
    from crucible.distributed.worker import main  # noqa: E402  (after the request, on purpose)

    sys.exit(main())
