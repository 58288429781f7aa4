"""The real-failure study of the pipeline mode: real `kill -9`s of inner stage processes at a
fixed rate, each real run held against the simulator replaying the failure schedule it had.

A spec (`studies/pipeline-real.toml`, `kind = "pipeline-real"`) names a preset and overrides,
the arms, the strategies, the kill rate and the seeds. Per arm and seed, `run_study` makes:

- `ARM-base-sSEED`: the pipeline run without kills (`crucible launch --pipeline`), and the
  simulator's run of the same config (`crucible run`): the baseline both sides share (they agree
  to the bit at one thread, which the result records), the clean wall-clock, and the per-round
  times the cost model is calibrated on;
- `ARM-STRATEGY-sSEED`: the pipeline run with the kills `chaos.draw_kills` draws for the seed
  (each at a wall-clock moment inside its round, carried out from outside by `chaos.Killer`),
  then the simulator's run of the failure schedule the kills made (`chaos.realized_plan`: each
  death from the round it happened in to the round its next life rejoined).

Each result is one JSON file under the spec's `results` folder, written whole (write-then-
rename) once both runs of the cell are done; a cell with a result is never run again. The
document (`crucible.study.pipeline_doc`) is rendered from these files alone.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible.study.spec import StudyError

__all__ = ["RealSpec", "is_real_spec", "load_real_spec", "run_study", "load_real_results",
           "refused_seeds", "all_cells", "KIND", "cell_id"]

KIND = "pipeline-real"
_FIELDS = {"kind", "name", "title", "preset", "set", "arms", "strategies", "rate", "seeds",
           "restarts", "results", "document", "deployment", "notes"}


@dataclass(frozen=True)
class RealSpec:
    path: Path
    name: str
    title: str
    preset: str
    overrides: tuple[str, ...]
    arms: tuple[str, ...]
    strategies: tuple[str, ...]
    rate: float
    seeds: tuple[int, ...]
    restarts: int
    results_dir: Path
    document: Path
    deployment: Path
    notes: str = ""
    cells: tuple[str, ...] = field(default=())

    def config(self, arm: str, strategy: str, seed: int) -> Any:
        from crucible.config import apply_overrides
        from crucible.presets import get_preset

        return apply_overrides(get_preset(self.preset), [
            *self.overrides, f"pipeline.compression={arm}", "faults.p=0",
            f"faults.strategy={'skip' if strategy == 'base' else strategy}", f"seed={seed}",
            "train.device=cpu"])


def cell_id(arm: str, strategy: str, seed: int) -> str:
    return f"{arm}-{strategy}-s{seed}"


def is_real_spec(path: str | os.PathLike[str]) -> bool:
    """Whether the TOML file at `path` is a real-failure study (`kind = "pipeline-real"`)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh).get("kind") == KIND
    except (OSError, tomllib.TOMLDecodeError):
        return False      # load_spec says what is wrong with it


def _need(data: dict[str, Any], key: str, kind: type, path: Path, example: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise StudyError(f"{path}: `{key}` must be {example}; got {value!r}")
    return value


def load_real_spec(path: str | os.PathLike[str]) -> RealSpec:
    """Parse and check a real-failure study spec; StudyError names the field and the fix."""
    from crucible.config import ConfigError
    from crucible.distributed.pipeline.stage_model import check_pipeline

    path = Path(path).resolve()
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise StudyError(f"{path}: cannot read the spec ({exc})") from None
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise StudyError(f"{path}: unknown field(s) {', '.join(unknown)}; a {KIND} spec takes "
                         f"{', '.join(sorted(_FIELDS))}")
    arms = _need(data, "arms", list, path, 'a list such as ["none", "ssn"]')
    strategies = _need(data, "strategies", list, path, 'a list such as ["skip", "drop"]')
    seeds = _need(data, "seeds", list, path, "a list of integer seeds such as [0, 1, 2]")
    if not arms or any(a not in ("none", "ssn", "mapl") for a in arms):
        raise StudyError(f"{path}: `arms` must name none, ssn or mapl; got {arms!r}")
    if not strategies or any(s not in ("skip", "drop") for s in strategies):
        raise StudyError(f"{path}: `strategies` must be skip and/or drop (what an unplanned "
                         f"death of an inner stage does live); got {strategies!r}")
    if not seeds or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise StudyError(f"{path}: `seeds` must be distinct integers >= 0; got {seeds!r}")
    rate = data.get("rate")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 0.5:
        raise StudyError(f"{path}: `rate` (kill probability per inner stage-replica and global "
                         f"step) must be in (0, 0.5]; got {rate!r}")
    restarts = data.get("restarts", 10)
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 1:
        raise StudyError(f"{path}: `restarts` must be an integer >= 1; got {restarts!r}")
    folder = path.parent
    spec = RealSpec(
        path=path, name=_need(data, "name", str, path, 'a name such as "pipeline-real"'),
        title=str(data.get("title", data["name"])),
        preset=_need(data, "preset", str, path, 'a preset such as "smoke"'),
        overrides=tuple(str(x) for x in data.get("set", [])), arms=tuple(arms),
        strategies=tuple(strategies), rate=float(rate), seeds=tuple(seeds), restarts=restarts,
        results_dir=(folder / str(data.get("results", f"../results/{data['name']}"))).resolve(),
        document=(folder / str(data.get("document", f"../docs/RESULTS-{data['name']}.md"))
                  ).resolve(),
        deployment=(folder / _need(data, "deployment", str, path,
                                   'the deployment file the cost model prices with, such as '
                                   '"../infra/deployments/this-machine-pipeline.toml"')).resolve(),
        notes=str(data.get("notes", "")).strip())
    try:
        config = spec.config(arms[0], strategies[0], seeds[0])
        check_pipeline(config)
    except (ConfigError, ValueError, KeyError) as exc:
        raise StudyError(f"{path}: the preset with `set` does not make a pipeline run: {exc}"
                         ) from None
    if config.replicas < 2:
        raise StudyError(f"{path}: `set` gives {config.replicas} replica(s); a study of "
                         "failures needs at least 2 (set replicas=2)")
    return spec


def all_cells(spec: RealSpec) -> list[tuple[str, str, int]]:
    """(arm, strategy, seed) of every cell, the baselines first, seed by seed."""
    return [(arm, strategy, seed) for seed in spec.seeds for arm in spec.arms
            for strategy in ("base", *spec.strategies)]


def load_real_results(spec: RealSpec) -> dict[str, dict[str, Any]]:
    """Every committed result of the spec, checked against its file name and the spec."""
    import json

    out: dict[str, dict[str, Any]] = {}
    if not spec.results_dir.is_dir():
        return out
    for path in sorted(spec.results_dir.glob("*.json")):
        if path.stat().st_size > 4_000_000:
            raise StudyError(f"{path}: {path.stat().st_size} bytes, over the 4 MB a result may "
                             "hold; delete it and run the cell again")
        try:
            result = json.loads(path.read_text())
            cell = result["study"]["cell"]
            for key in ("arm", "strategy", "seed"):
                result["study"][key]   # noqa: B018 - present, or KeyError below
        except (ValueError, KeyError, TypeError) as exc:
            raise StudyError(f"{path}: not a {KIND} result ({exc}); delete it and run the "
                             "cell again") from None
        if cell != path.stem:
            raise StudyError(f"{path}: holds cell {cell!r}, not {path.stem!r}")
        out[cell] = result
    return out


def refused_seeds(spec: RealSpec, here: str) -> dict[int, str]:
    """The seeds this machine may not add to: a seed's cells pair (its baseline with its kill
    runs), so all of them are made with one arithmetic (crucible.arithmetic's digest); a
    seed begun with another is refused, with the reason."""
    out: dict[int, str] = {}
    for result in load_real_results(spec).values():
        st = result["study"]
        theirs = st.get("arithmetic")
        seed = int(st["seed"])
        if theirs != here and seed not in out:
            out[seed] = (f"seed {seed} was begun with arithmetic {theirs} and this machine "
                         f"computes {here}; its cells pair only within one arithmetic: run "
                         "it on a machine of that kind, or choose a new seed (add it to the "
                         "spec's seeds)")
    return out


# -- running ------------------------------------------------------------------------------------
def run_study(spec: RealSpec, *, seeds: list[int] | None = None, scratch: Path,
              log: Any = print) -> list[str]:
    """Run every cell of `spec` (of `seeds`) without a result yet; returns the cells made.
    A cell that fails is logged and left without a result (StudyError at the end, naming
    it); the others still run."""
    import torch

    torch.set_num_threads(1)
    done = load_real_results(spec)
    made: list[str] = []
    failed: list[str] = []
    for arm, strategy, seed in all_cells(spec):
        cell = cell_id(arm, strategy, seed)
        if (seeds is not None and seed not in seeds) or cell in done:
            continue
        started = time.time()
        try:
            result = (_base_cell if strategy == "base" else _kill_cell)(
                spec, arm, strategy, seed, scratch / cell)
        except (RuntimeError, ValueError, TimeoutError) as exc:
            # a failed cell writes nothing (it runs again next time) and stops no other
            log(f"{cell}: FAILED ({type(exc).__name__}: {exc}); scratch kept in "
                f"{scratch / cell}")
            failed.append(cell)
            continue
        result["study"].update(_provenance(), cell=cell, arm=arm, strategy=strategy,
                               seed=seed, rate=spec.rate, wall_s=time.time() - started)
        from crucible.runfiles import write_json_atomic
        write_json_atomic(spec.results_dir / f"{cell}.json", result)
        made.append(cell)
        log(f"{cell}: done in {time.time() - started:.0f} s")
    if failed:
        raise StudyError(f"{len(failed)} cell(s) failed: {', '.join(failed)} (their logs are "
                         f"in {scratch}); the others are kept; run the study again to retry")
    return made


def _provenance() -> dict[str, Any]:
    import torch

    from crucible.arithmetic import arithmetic
    from crucible.study.runner import cpu_identity
    from crucible.summary import git_sha

    return {"commit": git_sha(), "cpu": cpu_identity(), "torch": torch.__version__,
            "arithmetic": arithmetic()["digest"], "threads": torch.get_num_threads(),
            # the host's load average when the cell ended: its processes share the cores, so
            # wall-clock and restart times are this host's at this load
            "load_average": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}


def _launch(config: Any, out: Path, *, restarts: int, kills: list[Any] | None = None
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One pipeline run (with `kills` carried out from outside); (summary, what each kill
    did)."""
    from crucible.distributed.pipeline.chaos import Killer
    from crucible.distributed.pipeline.launch import launch_pipeline
    from crucible.faults import FaultPlan

    shutil.rmtree(out, ignore_errors=True)
    result: dict[str, Any] = {}

    def go() -> None:
        try:
            result["summary"] = launch_pipeline(config, out_dir=out, plan=FaultPlan(),
                                                restarts=restarts, link_timeout_s=120.0)
        except BaseException as exc:      # re-raised below, in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=go, name="pipeline-launch")
    thread.start()
    killer = None
    if kills:
        killer = Killer(out, kills, stages=config.pipeline.stages, alive=thread.is_alive)
        killer.start()
    thread.join()
    if killer is not None:
        killer.join()
        if killer.error is not None:
            raise killer.error
    if "error" in result:
        raise result["error"]
    return result["summary"], (killer.done if killer is not None else [])


def _rounds(out: Path) -> dict[str, Any]:
    """Per-round times of the run (replica 0's first stage's records, whose rounds every
    replica's chain and the outer round pace): the round walls' differences and inner steps'
    seconds, for the cost model's calibration."""
    from crucible.runfiles import read_jsonl

    rows = read_jsonl(out / "stages" / "r0-s0" / "rounds.jsonl")
    walls = [float(r["wall"]) for r in rows]
    return {"round_walls": walls, "inner_s": [float(r["inner_s"]) for r in rows]}


def _real_part(summary: dict[str, Any], out: Path) -> dict[str, Any]:
    pipe = summary["pipeline"]
    return {"final_val_loss": summary["final_val_loss"], "wall_s": summary["wall_s"],
            "tokens": summary["tokens_processed"], "replicas_agree": pipe["replicas_agree"],
            "lost": pipe["lost"], "evals_missing": pipe["evals_missing"],
            # inner steps run again (per replica: every stage of it counts the same retry)
            "retried_steps": sum(max((s["retried_steps"] for s in pipe["stages"]
                                      if s["replica"] == r), default=0)
                                 for r in range(summary["replicas"])),
            "dropped_steps": sum(s["dropped_steps"] for s in pipe["stages"] if s["stage"] == 0),
            "act_payload": pipe["links"]["sent_payload"].get("act", 0),
            "notices": pipe["notices"], **_rounds(out)}


def _sim_part(summary: dict[str, Any]) -> dict[str, Any]:
    """What the document and the cost model need of a simulated run's summary."""
    keep = ("final_val_loss", "global_steps", "faults", "bytes", "contributions", "evals",
            "eval_tokens", "initial_val_loss", "inner_steps", "donor_load", "wall_s")
    return {k: summary.get(k) for k in keep}


def _base_cell(spec: RealSpec, arm: str, strategy: str, seed: int, out: Path
               ) -> dict[str, Any]:
    from crucible.faults import FaultPlan
    from crucible.train import train

    config = spec.config(arm, strategy, seed)
    summary, _ = _launch(config, out / "pipeline", restarts=spec.restarts)
    sim = train(config, out_dir=out / "sim", plan=FaultPlan())
    return {"study": {}, "config": config.to_dict(),
            "real": _real_part(summary, out / "pipeline"), "sim": _sim_part(sim),
            "same_bits": summary["final_val_loss"] == sim["final_val_loss"]}


def _recoveries(out: Path, kills: list[dict[str, Any]], notices: list[dict[str, Any]]
                ) -> list[dict[str, Any]]:
    """Per kill that happened: the round it died in, the launcher's notice, the next life's
    restart and rejoin, in seconds after the signal (the stage journal's records)."""
    from crucible.distributed.pipeline.stage_model import stage_dir
    from crucible.runfiles import read_jsonl

    rows = []
    for kill in kills:
        if kill.get("outcome") != "killed":
            continue
        r, s, at = int(kill["replica"]), int(kill["stage"]), float(kill["wall"])
        notice = next((n for n in notices if (n["replica"], n["stage"]) == (r, s)
                       and float(n["wall"]) >= at), None)
        journal = read_jsonl(stage_dir(out, r, s) / "process.jsonl")
        after = [x for x in journal if float(x["wall"]) >= at]
        restart = next((x for x in after if x.get("kind") == "restart"), None)
        rejoin = next((x for x in after if x.get("kind") == "rejoin"), None)
        rows.append({
            "replica": r, "stage": s, "died_in": None if notice is None else int(notice["round"]),
            "notice_s": None if notice is None else float(notice["wall"]) - at,
            "restart_s": None if restart is None else float(restart["wall"]) - at,
            "rejoin_s": None if rejoin is None else float(rejoin["wall"]) - at,
            "rejoined_at": None if rejoin is None else int(rejoin["global_step"])})
    return rows


def _kill_cell(spec: RealSpec, arm: str, strategy: str, seed: int, out: Path
               ) -> dict[str, Any]:
    from crucible.distributed.pipeline.chaos import draw_kills, realized_plan
    from crucible.train import train

    config = spec.config(arm, strategy, seed)
    R, S, steps = config.replicas, config.pipeline.stages, config.train.global_steps
    kills = draw_kills(seed=seed, rate=spec.rate, replicas=R, stages=S, global_steps=steps)
    summary, done = _launch(config, out / "pipeline", restarts=spec.restarts, kills=kills)
    plan = realized_plan(out / "pipeline", replicas=R, stages=S, global_steps=steps)
    replay = train(config, out_dir=out / "sim", plan=plan)
    real = _real_part(summary, out / "pipeline")
    real["recoveries"] = _recoveries(out / "pipeline", done, real["notices"])
    return {"study": {}, "config": config.to_dict(), "kills": done, "plan": plan.to_list(),
            "real": real, "replay": _sim_part(replay)}
