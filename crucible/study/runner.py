"""The study's runner: `run_study` runs a spec's missing cells as `crucible run` subprocesses,
`jobs` at a time, and keeps each finished run's summary in the results folder
(`keep_result`); `adopt_results` takes cells from identical runs of the spec's `reuse` specs,
`check_same_cpu` refuses to mix CPU models, and `load_results` reads the committed results
back, each checked against its cell (`_expect`).
"""
from __future__ import annotations

import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible.spec import Cell, SweepSpec, expand_cells
from crucible.study.spec import StudyError, completed_cells, load_spec, result_path
from crucible.summary import write_json_atomic

MAX_RESULT_BYTES = 50_000
# Dropped, in this order, from a summary that is over MAX_RESULT_BYTES (render needs none).
BULKY_FIELDS: tuple[str, ...] = ("faults", "donor_load", "inner_steps", "mapl_bases", "evals")


def machine_description() -> str:
    """e.g. 'x86_64, 2 CPUs, Intel(R) Xeon(R) ...' (no host name)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [platform.machine() or "unknown", f"{os.cpu_count() or '?'} CPUs"]
    return ", ".join(parts + ([model] if model else []))


def cpu_model(description: str | None = None) -> str | None:
    """The CPU model in a `machine_description()` (default: this machine's); None when it
    names none (older results say only where they ran)."""
    text = machine_description() if description is None else description
    parts = [p.strip() for p in text.split(",")]
    if len(parts) >= 3 and parts[1].endswith("CPUs"):
        return ", ".join(parts[2:]) or None
    return None


def check_same_cpu(spec: SweepSpec, results: Mapping[str, Mapping[str, Any]] | None = None, *,
                   here: str | None = None) -> None:
    """Refuse (StudyError) to add runs made on this CPU model to results made on another.
    Training is chaotic, and two CPUs' kernels round differently (an AMD EPYC's AVX2 paths
    against an Intel Xeon's AVX-512 ones: the same cell of study-d128 ended 1.4% apart), so a
    run here would be paired with a same-seed baseline that is not its twin and the paired
    interval would mix two noise levels. Results that name no CPU model are not compared."""
    here = cpu_model() if here is None else here
    if here is None:
        return
    results = load_results(spec) if results is None else results
    theirs = sorted({m for m in (cpu_model(str((r.get("study") or {}).get("machine", "")))
                                 for r in results.values()) if m})
    others = [m for m in theirs if m != here]
    if others:
        raise StudyError(
            f"{spec.shown(spec.results_dir)} holds runs made on {', '.join(others)}; this "
            f"machine is {here}. Runs of one study must come from one CPU model: training is "
            "chaotic and two CPUs round differently (the same study-d128 cell ends 1.4% apart "
            "on an AMD EPYC and an Intel Xeon), so a run here would not be paired with its "
            "twin baseline. Continue on a machine with that CPU, or pass --allow-mixed-cpus "
            "to mix them anyway (the document lists the machines)")


def slim_summary(summary: dict[str, Any], limit: int = MAX_RESULT_BYTES
                 ) -> tuple[dict[str, Any], list[str]]:
    """The summary as it is kept: whole unless its JSON is over `limit` bytes, then without
    BULKY_FIELDS (in that order, only as many as needed; `evals` keeps its first and last).
    Returns (kept, names of the dropped or trimmed fields)."""
    kept = dict(summary)
    dropped: list[str] = []
    for name in BULKY_FIELDS:
        if len(json.dumps(kept, indent=2, sort_keys=True)) <= limit:
            break
        if name not in kept:
            continue
        if name == "evals" and isinstance(kept[name], list) and len(kept[name]) > 2:
            kept[name] = [kept[name][0], kept[name][-1]]
            dropped.append("evals (kept the first and the last)")
        elif name != "evals":
            del kept[name]
            dropped.append(name)
    return kept, dropped


def portable(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without this machine's paths, as committed results keep it: `store_url` (the
    run folder's own store) is left out, and `config.data.path` becomes null when the run's
    `data_digest` is the default corpus's, else its file name alone (the digest says which
    corpus it was, wherever it lay)."""
    kept = {k: v for k, v in summary.items() if k != "store_url"}
    config = kept.get("config")
    data = config.get("data") if isinstance(config, dict) else None
    path = data.get("path") if isinstance(data, dict) else None
    if isinstance(path, str):
        from crucible.data import load_tokens, token_digest

        default = token_digest(load_tokens(None, vocab_size=config["model"]["vocab_size"]))
        name = None if summary.get("data_digest") == default else Path(path).name
        kept["config"] = {**config, "data": {**data, "path": name}}
    return kept


def keep_result(spec: SweepSpec, cell: Cell, summary: dict[str, Any], *, jobs: int) -> Path:
    """Copy a finished run's summary, `portable`, into the results folder (write, then
    rename)."""
    kept, dropped = slim_summary(portable(summary))
    kept["study"] = {"spec": spec.name, "cell": cell.id, "machine": machine_description(),
                     "jobs": jobs, "dropped_fields": dropped}
    path = result_path(spec, cell)
    write_json_atomic(path, kept)
    return path


def comparable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved config as two runs must share to be the same computation: without the preset's
    name (a label; presets only fill in values) and, outside the MAPL arm, without
    `pipeline.bypass_decode` (only MAPL reads it)."""
    out = {k: v for k, v in config.items() if k != "preset"}
    pipeline = out.get("pipeline")
    if isinstance(pipeline, dict) and pipeline.get("compression") != "mapl":
        out["pipeline"] = {k: v for k, v in pipeline.items() if k != "bypass_decode"}
    return out


def adopt_results(spec: SweepSpec, cells: Iterable[Cell], *, write: bool = True) -> dict[str, str]:
    """Cells of `spec` that a `reuse` spec already ran with the same configuration: copied into
    the results folder (marked `study.reused_from`) instead of run again. Returns {cell id:
    source spec name}. The configurations are compared whole (`comparable_config`), the
    source's file validated like any result."""
    from crucible.config import apply_overrides
    from crucible.presets import get_preset

    if not spec.files.reuse:
        return {}
    sources = [load_spec(path) for path in spec.files.reuse]
    base = get_preset(spec.preset)
    adopted: dict[str, str] = {}
    for cell in cells:
        wanted = comparable_config(apply_overrides(base, cell.overrides(spec)).to_dict())
        for source in sources:
            path = source.results_dir / f"{cell.id}.json"
            if not path.is_file():
                continue
            try:
                summary = json.loads(path.read_text(encoding="utf-8"))
                _expect(summary, cell, path)
            except (OSError, ValueError, StudyError):
                continue
            if comparable_config(summary["config"]) != wanted:
                continue
            if write:
                kept = dict(summary)
                kept["study"] = {**(summary.get("study") or {}), "spec": spec.name,
                                 "cell": cell.id, "reused_from": source.name}
                write_json_atomic(result_path(spec, cell), kept)
            adopted[cell.id] = source.name
            break
    return adopted


def run_command(spec: SweepSpec, cell: Cell) -> list[str]:
    """The `crucible run` command of a cell (as argv, through this Python)."""
    argv = [sys.executable, "-c", "from crucible.cli import main; main()", "run",
            "--preset", spec.preset, "--no-progress"]
    for item in cell.overrides(spec):
        argv += ["--set", item]
    # a cell not in the results starts afresh: --overwrite drops what an interrupted attempt
    # left in its folder, which `crucible run` would otherwise refuse (or mix into)
    return argv + ["--out", str(spec.runs_dir / cell.id), "--overwrite"]


def _shell_view(argv: Sequence[str]) -> str:
    return "crucible " + " ".join(argv[3:])


def _last_error(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line:
            return line.strip()[:300]
    return lines[-1].strip()[:300] if lines else "no output"


@dataclass
class RunOutcome:
    ran: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: int = 0
    interrupted: bool = False


def run_study(spec: SweepSpec, *, jobs: int = 2, seeds: Sequence[int] | None = None,
              limit: int | None = None, dry_run: bool = False,
              echo: Callable[[str], None] = print,
              command: Callable[[SweepSpec, Cell], list[str]] | None = None,
              poll_s: float = 0.5) -> RunOutcome:
    """Run the spec's missing cells, `jobs` at a time; see the module docstring. `command`
    builds a cell's argv (default `run_command`). A failed run is reported and the others go
    on; a finished run's summary is copied into the results folder."""
    command = command or run_command
    cells = expand_cells(spec, seeds)
    done, todo = completed_cells(spec, cells)
    adopted = adopt_results(spec, todo, write=not dry_run)
    if adopted:
        echo(f"study {spec.name}: {len(adopted)} cells taken from identical runs of "
             + ", ".join(sorted({source for source in adopted.values()})))
        done += [c for c in todo if c.id in adopted]
        todo = [c for c in todo if c.id not in adopted]
    if limit is not None:
        todo = todo[:limit]
    outcome = RunOutcome(skipped=len(done))
    echo(f"study {spec.name}: {len(cells)} cells, {len(done)} already in "
         f"{spec.shown(spec.results_dir)} (skipped), {len(todo)} to run"
         + ("" if dry_run else f", {jobs} at a time"))
    if dry_run:
        for cell in todo:
            echo(f"  {cell.id}: {_shell_view(command(spec, cell))}")
        return outcome
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    running: dict[str, tuple[Cell, subprocess.Popen[bytes], float, Path, Any]] = {}
    queue = list(todo)
    finished = 0
    durations: list[float] = []
    try:
        while queue or running:
            while queue and len(running) < jobs:
                cell = queue.pop(0)
                out = spec.runs_dir / cell.id
                out.parent.mkdir(parents=True, exist_ok=True)
                (out / "summary.json").unlink(missing_ok=True)   # never keep a stale one
                log = spec.runs_dir / f"{cell.id}.log"
                fh = open(log, "wb")   # closed when the run ends
                proc = subprocess.Popen(command(spec, cell), stdout=fh, stderr=subprocess.STDOUT,
                                        env=env, cwd=spec.root, start_new_session=True)
                running[cell.id] = (cell, proc, time.monotonic(), log, fh)
            time.sleep(poll_s)
            for cell_id in [cid for cid, item in running.items() if item[1].poll() is not None]:
                cell, proc, started, log, fh = running.pop(cell_id)
                fh.close()
                seconds = time.monotonic() - started
                finished += 1
                prefix = f"[{finished:>3}/{len(todo)}] {cell.id:<36} {seconds:7.1f} s"
                summary_file = spec.runs_dir / cell.id / "summary.json"
                problem = None
                summary: dict[str, Any] = {}
                if proc.returncode != 0:
                    problem = f"exit {proc.returncode}: {_last_error(log)}"
                else:
                    try:
                        summary = json.loads(summary_file.read_text())
                        _expect(summary, cell, summary_file)
                    except (OSError, ValueError) as exc:
                        problem = f"no usable {summary_file}: {exc}"
                    except StudyError as exc:
                        problem = str(exc)
                if problem is not None:
                    outcome.failed.append((cell.id, problem))
                    echo(f"{prefix}  FAILED ({problem}); log: {spec.shown(log)}")
                    continue
                kept = keep_result(spec, cell, summary, jobs=jobs)
                outcome.ran.append(cell.id)
                durations.append(seconds)
                left = len(queue) + len(running)
                eta = statistics.fmean(durations) * left / max(jobs, 1)
                dropped = json.loads(kept.read_text())["study"]["dropped_fields"]
                echo(f"{prefix}  final val loss {summary['final_val_loss']:.4f}"
                     + (f"  (~{eta / 60:.0f} min left)" if left else "")
                     + (f"  [kept without {', '.join(dropped)}: over "
                        f"{MAX_RESULT_BYTES // 1000} KB]" if dropped else ""))
    except KeyboardInterrupt:
        outcome.interrupted = True
        for cell, proc, _, _, fh in running.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            fh.close()
            echo(f"interrupted: {cell.id} stopped (no result kept)")
    echo(f"study {spec.name}: {len(outcome.ran)} ran, {len(outcome.failed)} failed, "
         f"{outcome.skipped} skipped (already done)"
         + ("; interrupted, run again to continue" if outcome.interrupted else ""))
    for cell_id, problem in outcome.failed:
        echo(f"  failed: {cell_id}: {problem}")
    return outcome


def _expect(summary: Mapping[str, Any], cell: Cell, path: Path) -> None:
    cfg = summary.get("config")
    if not isinstance(cfg, dict):
        raise StudyError(f"{path}: no `config` object; is this a crucible summary.json?")
    try:
        found = (cfg["pipeline"]["compression"], float(cfg["faults"]["p"]), cfg["seed"])
        strategy = cfg["faults"]["strategy"]
    except (KeyError, TypeError, ValueError):
        raise StudyError(f"{path}: config lacks pipeline.compression / faults.p / faults.strategy"
                         " / seed") from None
    expected = (cell.key.arm, cell.key.p, cell.seed)
    if found != expected or (not cell.key.is_baseline and strategy != cell.key.strategy):
        raise StudyError(f"{path}: holds compression={found[0]} p={found[1]:g} seed={found[2]} "
                         f"strategy={strategy}, not cell {cell.id}; move or delete the file")
    for name in ("final_val_loss", "tokens_processed", "tokens_budget", "wall_s"):
        if name not in summary:
            raise StudyError(f"{path}: missing {name!r}; copy the run's whole summary.json")
    loss = summary["final_val_loss"]
    if not isinstance(loss, int | float) or not math.isfinite(loss) or loss <= 0:
        raise StudyError(f"{path}: final_val_loss is {loss!r}; delete the file and run the cell "
                         "again")


def load_results(spec: SweepSpec) -> dict[str, dict[str, Any]]:
    """The result files of the spec's cells, by cell id (other files are ignored)."""
    found: dict[str, dict[str, Any]] = {}
    for cell in expand_cells(spec):
        path = result_path(spec, cell)
        if not path.is_file():
            continue
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StudyError(f"{path}: not readable JSON ({exc}); delete it and run the cell "
                             "again") from None
        _expect(summary, cell, path)
        found[cell.id] = summary
    return found
