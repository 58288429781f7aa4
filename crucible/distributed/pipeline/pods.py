"""The pipeline mode with every stage-replica on a host of its own (a Kubernetes pod of the
pod-per-stage layout, `infra/k8s`): the launcher's two roles split so that no one process
watches them all.

    python -m crucible.distributed.pipeline.pods supervise --run-dir DIR --replica R --stage S
    python -m crucible.distributed.pipeline.pods merge --run-dir DIR [--grace-s S]

`supervise` is `launch.launch_pipeline`'s watch over one process, run beside it: it starts the
stage process (`launch.stage_command`, its log in `stages/rR-sS/stage.log`) and, when it dies by
a signal (a planned kill, `kill -9`, the OOM killer), tells every other stage process of an
unplanned death over its link (the launcher's `ctl` notice and `notices.jsonl` line, by the
launcher's own `_notify`) and starts it again while it has lives (`run.json`'s `lives`). A stage
that exits 0 is done; one that exits with an error is not restarted (it would repeat it). The
lives used are counted in `stages/rR-sS/supervisor.json`, so a supervisor that replaces one lost
with its pod goes on counting, and first announces the life that died unseen with that pod.
Exit 0 when the stage finished or died with no life left (the run goes on without it: `lost`),
1 when it failed with an error.

`merge` waits until every supervisor has reported its outcome (once one has, at most `grace_s`
for the others: a stage-replica whose pods were all lost is merged as lost), then merges the
run folder as the launcher does (`launch.merge_pipeline`). Exit 1 when a stage failed with an
error (named, with its log) or no copy of some stage's weights survived.

The run folder (`run.json`, the stage folders, `notices.jsonl`) must be one filesystem shared by
every pod; the outer rounds go through the store named in `run.json`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from crucible.config import Config
from crucible.distributed.journal import died_in
from crucible.distributed.pipeline.launch import (
    _notify,
    _planned_death,
    _start,
    merge_pipeline,
)
from crucible.distributed.pipeline.links import LAUNCHER, LinkCounters, Outbox, Shaping
from crucible.distributed.pipeline.stage_model import stage_dir
from crucible.runfiles import read_jsonl, write_json_atomic

__all__ = ["supervise", "merge_pods", "STATE_FILE", "main"]

log = logging.getLogger(__name__)
STATE_FILE = "supervisor.json"


def _state(folder: Path) -> dict[str, Any]:
    path = folder / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def supervise(run_dir: Path, *, replica: int, stage: int) -> dict[str, Any]:
    """Watch stage `stage` of replica `replica` until it is done, lost or failed; returns its
    outcome (`exit`: the stage process's last exit code, negative for a signal; `lost`; `lives`
    used), also written to its `supervisor.json`."""
    ident = json.loads((run_dir / "run.json").read_text())
    lives = int(ident["lives"][f"{replica},{stage}"])
    folder = stage_dir(run_dir, replica, stage)
    folder.mkdir(parents=True, exist_ok=True)
    state = _state(folder)
    if state.get("outcome") is not None:          # reported already (its pod went after)
        return state["outcome"]
    used = int(state.get("lives_used", 0))
    state.setdefault("started", time.time())
    context = zmq.Context()
    notices = Outbox(context, LAUNCHER, LinkCounters())
    # a stage that finished before its last pod went is done (no life is spent on it)
    code = 0 if (folder / "summary.json").exists() else None
    try:
        if used and code is None:
            _announce_unseen(run_dir, notices, ident, replica=replica, stage=stage, life=used - 1,
                             gone=used >= lives)
        # started again only after a death by a signal: an exit code >= 0 is done, or an
        # error that a restart would repeat
        while (code is None or code < 0) and used < lives:
            used += 1
            write_json_atomic(folder / STATE_FILE, state | {"lives_used": used})
            code = _start(run_dir, replica, stage).wait()
            if code >= 0:
                continue
            gone = used >= lives
            if gone or not _planned_death(run_dir, replica, stage, life=used - 1):
                _notify(run_dir, notices, ident["addresses"], r=replica, s=stage, gone=gone,
                        exit_code=code)
            log.warning("stage %d of replica %d died (exit %d)%s", stage, replica, code,
                        " with no life left: the run goes on without it" if gone else
                        f"; restarting (life {used + 1} of {lives})")
    finally:
        notices.close()
        context.term()
    outcome = {"replica": replica, "stage": stage, "exit": code, "lives": used,
               "lost": code is None or code < 0, "wall": time.time()}
    write_json_atomic(folder / STATE_FILE, state | {"lives_used": used, "outcome": outcome})
    return outcome


def _announce_unseen(run_dir: Path, notices: Outbox, ident: dict[str, Any], *, replica: int,
                     stage: int, life: int, gone: bool) -> None:
    """A supervisor that replaces one lost with its pod: the stage's last life died with that
    pod, unseen. Its peers are told, as the lost supervisor would have (unless it had, or the
    life ended by its planned kill, which every peer knows from the plan)."""
    folder = stage_dir(run_dir, replica, stage)
    if _planned_death(run_dir, replica, stage, life=life):
        return
    died = died_in(folder)
    path = run_dir / "notices.jsonl"
    if any((n["replica"], n["stage"], n["round"]) == (replica, stage, died)
           for n in (read_jsonl(path) if path.exists() else [])):
        return
    log.warning("stage %d of replica %d: life %d died unseen (with its pod) in round %d",
                stage, replica, life, died)
    _notify(run_dir, notices, ident["addresses"], r=replica, s=stage, gone=gone,
            exit_code=None)


def merge_pods(run_dir: Path, *, grace_s: float = 1800.0, poll_s: float = 10.0) -> dict[str, Any]:
    """Wait for every supervisor's outcome (at most `grace_s` once the first is in), then merge
    the run as `launch_pipeline` does; returns the summary. Raises RuntimeError naming a stage
    that failed with an error (or from the merge: no copy of some stage's weights)."""
    ident = json.loads((run_dir / "run.json").read_text())
    config = Config.from_dict(ident["config"])
    keys = [(r, s) for r in range(config.replicas) for s in range(config.pipeline.stages)]
    first = None
    while True:
        states = {key: _state(stage_dir(run_dir, *key)) for key in keys}
        missing = [key for key, st in states.items() if st.get("outcome") is None]
        if not missing:
            break
        if first is None and len(missing) < len(keys):
            first = time.monotonic()
        if first is not None and time.monotonic() - first >= grace_s:
            log.warning("no outcome from stage-replicas %s after %.0f s: merged as lost",
                        missing, grace_s)
            break
        time.sleep(poll_s)
    outcomes = {key: st.get("outcome") or {"replica": key[0], "stage": key[1], "exit": None,
                                           "lives": int(st.get("lives_used", 0)), "lost": True}
                for key, st in states.items()}
    failed = [o for o in outcomes.values() if o["exit"] is not None and o["exit"] > 0]
    if failed:
        raise RuntimeError("; ".join(
            f"stage {o['stage']} of replica {o['replica']} failed (exit {o['exit']}); its log: "
            f"{stage_dir(run_dir, o['replica'], o['stage']) / 'stage.log'}" for o in failed))
    started = [st["started"] for st in states.values() if "started" in st]
    ended = [o["wall"] for o in outcomes.values() if "wall" in o]
    wall_s = max(ended) - min(started) if started and ended else 0.0
    lost = [{k: o[k] for k in ("replica", "stage", "exit", "lives")}
            for o in outcomes.values() if o["lost"]]
    summary = merge_pipeline(run_dir, config, wall_s=wall_s, lost=lost,
                             lives_used={key: o["lives"] for key, o in outcomes.items()})
    summary["pipeline"]["shaping"] = Shaping(**ident.get("shaping", {})).to_dict()
    write_json_atomic(run_dir / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crucible.distributed.pipeline.pods")
    sub = parser.add_subparsers(dest="role", required=True)
    one = sub.add_parser("supervise", help="start and watch one stage process")
    one.add_argument("--run-dir", required=True, type=Path)
    one.add_argument("--replica", required=True, type=int)
    one.add_argument("--stage", required=True, type=int)
    merge = sub.add_parser("merge", help="merge the run once every supervisor reported")
    merge.add_argument("--run-dir", required=True, type=Path)
    merge.add_argument("--grace-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.role == "supervise":
        outcome = supervise(args.run_dir, replica=args.replica, stage=args.stage)
        print(json.dumps(outcome))
        return 1 if outcome["exit"] is not None and outcome["exit"] > 0 else 0
    try:
        summary = merge_pods(args.run_dir, grace_s=args.grace_s)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    keys = ("final_val_loss", "tokens_processed", "wall_s")
    print(json.dumps({k: summary[k] for k in keys} | {
        "lost": [[x["replica"], x["stage"]] for x in summary["pipeline"]["lost"]],
        "replicas_agree": summary["pipeline"]["replicas_agree"],
        "notices": len(summary["pipeline"]["notices"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
