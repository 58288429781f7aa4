"""`crucible launch`: a distributed run, one process per replica (see `crucible.distributed`).

    crucible launch --preset smoke --nproc 2 [--set key=value ...] --out DIR \
        [--kill REPLICA@STEP ...] [--kill-forever REPLICA@STEP ...] [--restarts N] [--lease-s S]

Exit 0 with DIR/summary.json written (also when a replica never came back: a warning names it,
and the summary's `distributed.lost` says why); 2 for bad input (message names the option and
the fix); 1 when no replica finished; 130 when interrupted (SIGINT or SIGTERM: the replicas
are stopped first).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from crucible.config import ConfigError, apply_overrides
from crucible.distributed.liveness import add_recovery_arguments

__all__ = ["launch_main"]


def _kill(text: str, *, rejoin: bool) -> dict:
    replica, sep, step = text.partition("@")
    if not sep or not replica.isdigit() or not step.isdigit():
        raise ConfigError(f"--kill {text!r}: expected REPLICA@GLOBAL_STEP, e.g. 1@3")
    return {"replica": int(replica), "global_step": int(step), "rejoin": rejoin}


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as an interrupt, once: a second one must not cut short the replicas' stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crucible launch", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smoke", help="a preset name (`crucible presets`)")
    p.add_argument("--nproc", type=int, required=True,
                   help="replicas, one process each (sets `replicas`)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--out", type=Path, required=True, help="run folder")
    p.add_argument("--kill", action="append", default=[], metavar="R@STEP",
                   help="SIGKILL replica R at the start of global step STEP; it is restarted")
    p.add_argument("--kill-forever", action="append", default=[], metavar="R@STEP",
                   help="as --kill, but the replica is not restarted")
    add_recovery_arguments(p)
    return p


def launch_main(argv: list[str]) -> int:
    """Parse `argv`, launch, print the summary's key numbers as JSON; returns the exit code."""
    from crucible.distributed.launch import check_recovery, launch
    from crucible.presets import get_preset

    args = _parser().parse_args(argv)
    try:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        check_recovery(restarts=args.restarts, lease_s=args.lease_s)
        config = apply_overrides(get_preset(args.preset),
                                 [*args.overrides, f"replicas={args.nproc}"])
        kills = ([_kill(k, rejoin=True) for k in args.kill]
                 + [_kill(k, rejoin=False) for k in args.kill_forever])
        if args.out.exists() and not args.out.is_dir():
            raise ConfigError(f"--out {args.out} is not a folder; pass a new folder")
        if args.out.exists() and (args.out / "run.json").exists():
            raise ConfigError(f"--out {args.out} already holds a run; pass a new folder")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None   # a cancel too
    try:
        summary = launch(config, out_dir=args.out, kills=kills, restarts=args.restarts,
                         lease_s=args.lease_s)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the replicas were stopped; {args.out} holds a partial run",
              file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    for row in summary["distributed"]["lost"]:
        print(f"warning: replica {row['replica']} never came back ({row['reason']}); the run "
              "completed without it", file=sys.stderr)
    keys = ("final_val_loss", "global_steps", "tokens_processed", "contributions", "wall_s")
    print(json.dumps({k: summary[k] for k in keys} | {"out": str(args.out),
                     "lost": [row["replica"] for row in summary["distributed"]["lost"]]},
                     indent=2))
    return 0
