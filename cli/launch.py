"""`crucible launch`: a distributed run, one process per replica (see `crucible.distributed`),
or with `--pipeline` one process per stage of every replica (`crucible.distributed.pipeline`).

    crucible launch --preset smoke --nproc 2 [--set key=value ...] --out DIR \
        [--kill REPLICA@STEP ...] [--kill-forever REPLICA@STEP ...] [--restarts N] [--lease-s S]
    crucible launch --pipeline --preset smoke --nproc 2 [--set key=value ...] --out DIR \
        [--micro-batches M] [--link-timeout S] [--link-mbps MBIT_S] [--link-latency-ms MS]
        [--restarts N]

In the pipeline mode the fault plan's stage failures are real: the stage process is killed at
the start of its planned global step and restarted to rejoin when the plan says; a stage
process killed from outside is noticed, bypassed live and restarted (docs/OPERATIONS.md).

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
    p.add_argument("--pipeline", action="store_true",
                   help="one process per stage-replica (R x S), ZeroMQ links between stages")
    p.add_argument("--micro-batches", type=int, default=1, metavar="M",
                   help="--pipeline: micro-batches per inner step, fill-drain (default 1: the "
                        "simulator's arithmetic)")
    p.add_argument("--link-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="--pipeline: how long a stage waits for a message before it fails")
    p.add_argument("--link-mbps", type=float, default=0.0, metavar="MBIT_S",
                   help="--pipeline: every link's bandwidth, megabits per second (0: no limit)")
    p.add_argument("--link-latency-ms", type=float, default=0.0, metavar="MS",
                   help="--pipeline: every link's latency, milliseconds")
    return p


def _pipeline(args: argparse.Namespace, config) -> None:
    """Run the pipeline mode and print its summary's key numbers."""
    from crucible.distributed.pipeline.launch import launch_pipeline
    from crucible.distributed.pipeline.links import Shaping

    summary = launch_pipeline(config, out_dir=args.out, micro_batches=args.micro_batches,
                              restarts=args.restarts, link_timeout_s=args.link_timeout,
                              shaping=Shaping(args.link_mbps, args.link_latency_ms))
    pipe = summary["pipeline"]
    print(json.dumps({"final_val_loss": summary["final_val_loss"],
                      "tokens_processed": summary["tokens_processed"],
                      "wall_s": summary["wall_s"], "replicas_agree": pipe["replicas_agree"],
                      "link_bytes": pipe["links"]["sent_bytes"],
                      "refused_messages": pipe["links"]["refused"], "out": str(args.out)},
                     indent=2))


def _replicas(args: argparse.Namespace, config, kills: list[dict]) -> None:
    """Run one process per replica and print its summary's key numbers."""
    from crucible.distributed.launch import launch

    summary = launch(config, out_dir=args.out, kills=kills, restarts=args.restarts,
                     lease_s=args.lease_s)
    for row in summary["distributed"]["lost"]:
        print(f"warning: replica {row['replica']} never came back ({row['reason']}); the run "
              "completed without it", file=sys.stderr)
    keys = ("final_val_loss", "global_steps", "tokens_processed", "contributions", "wall_s")
    print(json.dumps({k: summary[k] for k in keys} | {"out": str(args.out),
                     "lost": [row["replica"] for row in summary["distributed"]["lost"]]},
                     indent=2))


def launch_main(argv: list[str]) -> int:
    """Parse `argv`, launch, print the summary's key numbers as JSON; returns the exit code."""
    from crucible.distributed.launch import check_recovery
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
        if args.pipeline and kills:
            raise ConfigError("--kill and --kill-forever kill whole replicas; with --pipeline "
                              "the fault plan's stage failures are the kills (set faults.p and "
                              "faults.strategy)")
        if args.pipeline:
            from crucible.distributed.pipeline.links import Shaping
            from crucible.distributed.pipeline.stage_model import check_pipeline
            check_pipeline(config, micro_batches=args.micro_batches)
            if args.link_timeout <= 0:
                raise ConfigError(f"--link-timeout must be > 0 seconds, got {args.link_timeout}")
            Shaping(args.link_mbps, args.link_latency_ms)   # refuses a negative one
        elif args.link_mbps or args.link_latency_ms:
            raise ConfigError("--link-mbps and --link-latency-ms shape the pipeline mode's "
                              "links; add --pipeline")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None   # a cancel too
    try:
        if args.pipeline:
            _pipeline(args, config)
        else:
            _replicas(args, config, kills)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        stopped = "the stage processes were" if args.pipeline else "the replicas were"
        print(f"interrupted: {stopped} stopped; {args.out} holds a partial run", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return 0
