"""A study's results: `keep_result` keeps a finished run's summary as its cell's result file
(the `failure-sweep` flow calls it for every cell it completes: `crucible study run` runs a
study on that flow), `adopt_results` takes cells from identical runs of the spec's `reuse`
specs, and `load_results` reads the committed
results back, each checked against its cell (`check_result`).
"""
from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from crucible.arithmetic import digest_of
from crucible.grid.cells import Cell
from crucible.grid.spec import SweepSpec
from crucible.study.spec import StudyError, load_spec, result_cells, result_path
from crucible.summary import write_json_atomic

MAX_RESULT_BYTES = 50_000
# Dropped, in this order, from a summary that is over MAX_RESULT_BYTES (render needs none).
BULKY_FIELDS: tuple[str, ...] = ("faults", "donor_load", "inner_steps", "mapl_bases", "evals")


def _first_cpu() -> dict[str, str]:
    """/proc/cpuinfo's fields of the first processor ({} where there is none to read)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break                       # the first processor's block is enough
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def machine_description() -> str:
    """e.g. 'x86_64, 2 CPUs, Intel(R) Xeon(R) ...' (no host name)."""
    model = _first_cpu().get("model name", "")
    parts = [platform.machine() or "unknown", f"{os.cpu_count() or '?'} CPUs"]
    return ", ".join(parts + ([model] if model else []))


def cpu_identity() -> dict[str, Any]:
    """What tells this machine's CPU model apart where its name does not: a virtual machine may
    name a Zen 1 and a Zen 3 alike ("AMD EPYC"), and the two round differently. The vendor,
    family and model of /proc/cpuinfo's first processor, its name, and the kernel path torch
    dispatches to (`torch.backends.cpu.get_cpu_capability()`); None where unknown."""
    info = _first_cpu()
    import torch

    def number(key: str) -> int | None:
        return int(info[key]) if info.get(key, "").isdigit() else None

    return {"vendor": info.get("vendor_id"), "family": number("cpu family"),
            "model": number("model"), "name": info.get("model name"),
            "kernels": torch.backends.cpu.get_cpu_capability()}


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
                     "cpu": cpu_identity(), "arithmetic": digest_of(summary), "jobs": jobs,
                     "dropped_fields": dropped}
    path = result_path(spec, cell)
    write_json_atomic(path, kept)
    return path


def comparable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved config as two runs must share to be the same computation: without the preset's
    name (a label; presets only fill in values), without keys added later at their default
    (`crucible.config.LATER_DEFAULTS`) and, outside the MAPL arm, without
    `pipeline.bypass_decode` (only MAPL reads it)."""
    from crucible.config import without_later_defaults

    out = {k: v for k, v in without_later_defaults(dict(config)).items() if k != "preset"}
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
                check_result(summary, cell, path)
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


def check_result(summary: Mapping[str, Any], cell: Cell, path: Path) -> None:
    """Refuse (StudyError) a summary that is not a usable result of `cell`: another cell's,
    or one lacking what the document reads."""
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
    """The result files of the spec's cells (`result_cells`: precision rounds' seeds too), by
    cell id (other files are ignored)."""
    found: dict[str, dict[str, Any]] = {}
    for cell in result_cells(spec):
        path = result_path(spec, cell)
        if not path.is_file():
            continue
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StudyError(f"{path}: not readable JSON ({exc}); delete it and run the cell "
                             "again") from None
        check_result(summary, cell, path)
        found[cell.id] = summary
    return found
