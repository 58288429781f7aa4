"""The failure study: a committed grid spec, a resumable runner, and the generated results document.

    crucible study run studies/table1-d128.toml [--jobs 2] [--seeds 0,1] [--limit N] [--dry-run]
    crucible study render studies/table1-d128.toml [--check] [--no-figures]
    crucible study adopt studies/table1-d128.toml   # identical runs of its `reuse` specs

A spec (TOML) names a preset, the seeds and a list of grid blocks (arms x strategies x p, plus
optional `key=value` overrides, a label and the block's own `seeds`; an arm's baselines cover
every seed one of its blocks runs). Optional spec keys: `pilots` (candidate-preset specs whose
table the document shows, crucible.pilot), `token_check` (half-tokens and full pilot specs),
`scale` (specs running some cells at a larger model, crucible.scale), `reuse` (specs whose runs
with exactly a cell's configuration count as that cell), `close_margin`, `resolve_threshold`
(the target half-width) and `equivalence_margin` (claim (e)). It expands into cells with stable
ids:

    none-base-s0                      the p = 0 baseline of an arm and seed, shared by every
                                      strategy and block of that arm
    mapl-skip-p0.2-s3                 arm, strategy, p, seed
    mapl-skip-p0.2-decode_sender-s1   the same with a block label (its overrides)

`study run` runs every cell whose result file `<results_dir>/<cell-id>.json` is missing as a
`crucible run` subprocess (one torch thread each, `--jobs` at a time) and copies the run's
summary.json there when it finishes, so a grid can be completed over several sittings and the
results committed. `study render` turns the committed results into the Markdown document and
its PNG figures; `--check` fails when the document differs from what the data render.

Statistics: a cell's degradation for seed s is 100 (L - L0) / L0 of the final validation loss,
L0 being the same arm's p = 0 baseline with the same seed (every arm and strategy at the same p
and seed sees the same failure schedule, so comparisons are paired by seed). Means come with a
95% Student-t interval over seeds (crucible.analysis); one seed gives no interval.

Paths inside a spec are relative to the spec file's folder. Relative paths printed in the
document are relative to the folder above it (the repository root for `studies/NAME.toml`).
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible.summary import write_json_atomic

__all__ = ["StudyError", "FigureError", "Spec", "Block", "Cell", "GridKey", "Stat", "Comparison", "Claim",
           "load_spec", "expand_cells", "completed_cells", "run_study", "load_results",
           "StudyData", "evaluate_claims", "render_markdown", "build_figures", "write_figures",
           "render", "noise_floor", "paired_stat", "stat_of", "register", "BLOG_SKIP",
           "NOISE_FLOOR_Z", "DEFAULT_SPEC"]

ARMS: tuple[str, ...] = ("none", "ssn", "mapl")
STRATEGIES: tuple[str, ...] = ("skip", "drop", "drop_extend", "reroute")
ARM_LABEL = {"none": "uncompressed", "ssn": "SSN", "mapl": "MAPL"}
TABLE1_ARMS: tuple[str, ...] = ("ssn", "mapl", "none")          # the blog's column order
BASELINE_STRATEGY = "skip"                                     # irrelevant at p = 0
GRID_KEYS = ("seed", "pipeline.compression", "faults.p", "faults.strategy")
# settings that change nothing when no stage fails: a block may vary them and still be compared
# with the arm's shared p = 0 baseline
BASELINE_NEUTRAL_KEYS = ("pipeline.bypass_decode",)

# The blog (178M, R = 8, S = 4, failures last 6 global steps): Table 1, skip.
BLOG_SKIP: dict[tuple[str, float], float] = {
    ("ssn", 0.1): 0.6, ("mapl", 0.1): 0.9, ("none", 0.1): 0.9,
    ("ssn", 0.2): 0.9, ("mapl", 0.2): 1.1, ("none", 0.2): 1.2,
}
BLOG_DROP = "+3.4-3.6%"
CLAIM_PS: tuple[float, ...] = (0.1, 0.2)                        # Table 1's failure rates
LOW_P = 0.01      # the seed texts' reading of the blog: "at 1% ... stays close to baseline"
NOISE_FLOOR_Z = 1.96      # one seed's value lies within ± 1.96 sd of its cell's mean (95%)
MAX_RESULT_BYTES = 50_000
# Dropped, in this order, from a summary that is over MAX_RESULT_BYTES (render needs none).
BULKY_FIELDS: tuple[str, ...] = ("faults", "donor_load", "inner_steps", "mapl_bases", "evals")
DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "studies" / "table1.toml"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]

_SPEC_KEYS = {"name", "preset", "seeds", "set", "grid", "title", "notes", "results_dir",
              "runs_dir", "document", "figures_dir", "close_margin", "resolve_threshold",
              "equivalence_margin",
              "pilots", "token_check", "scale", "reuse"}
_BLOCK_KEYS = {"arms", "strategies", "p", "set", "label", "seeds"}
_SLUG = re.compile(r"^[a-z0-9][a-z0-9_]*$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class StudyError(Exception):
    """Bad input (a spec, a result file): the message names the field and the fix."""


class FigureError(StudyError):
    """The figures cannot be rendered here (no Chromium or Playwright)."""


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    index: int
    arms: tuple[str, ...]
    strategies: tuple[str, ...]
    ps: tuple[float, ...]
    sets: tuple[str, ...] = ()
    label: str = ""
    seeds: tuple[int, ...] | None = None     # None: the spec's seeds


@dataclass(frozen=True)
class Spec:
    path: Path
    name: str
    preset: str
    seeds: tuple[int, ...]
    blocks: tuple[Block, ...]
    sets: tuple[str, ...] = ()
    title: str = ""
    notes: str = ""
    results_dir: Path = Path()
    runs_dir: Path = Path()
    document: Path = Path()
    figures_dir: Path = Path()
    close_margin: float = 0.5
    resolve_threshold: float = 0.5
    equivalence_margin: float = 0.5        # claim (e): "within ± this of the baseline"
    pilots: tuple[Path, ...] = ()
    token_check: tuple[Path, ...] = ()     # (half the tokens, the full run) pilot specs
    scale: tuple[Path, ...] = ()           # specs running some of its cells at a larger model
    reuse: tuple[Path, ...] = ()           # specs whose identical runs count as its own cells

    @property
    def all_seeds(self) -> tuple[int, ...]:
        """The spec's seeds, then any more that a block asks for, in that order."""
        extra = sorted({s for b in self.blocks for s in (b.seeds or ()) if s not in self.seeds})
        return self.seeds + tuple(extra)

    @property
    def root(self) -> Path:
        """The folder that printed paths are relative to (the repository root for
        `studies/NAME.toml`)."""
        return self.path.parent.parent

    def shown(self, path: Path) -> str:
        """`path` as the document prints it: relative to `root`, with forward slashes."""
        return Path(os.path.relpath(path, self.root)).as_posix()

    @property
    def command(self) -> str:
        return f"crucible study render {self.shown(self.path)}"


def _where(path: Path, field_name: str) -> str:
    return f"{path}: {field_name}"


def _str_list(value: Any, where: str, example: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StudyError(f"{where} must be a list of strings, e.g. {example}; got {value!r}")
    return list(value)


def _choices(value: Any, where: str, allowed: Sequence[str]) -> tuple[str, ...]:
    items = _str_list(value, where, f"[\"{allowed[0]}\"]")
    if not items:
        raise StudyError(f"{where} is empty; list at least one of: {', '.join(allowed)}")
    for item in items:
        if item not in allowed:
            raise StudyError(f"{where}: unknown value {item!r}; choose from {', '.join(allowed)}")
    if len(set(items)) != len(items):
        raise StudyError(f"{where} lists a value twice: {items}")
    return tuple(items)


def _overrides(value: Any, where: str, *, per_block: bool = False) -> tuple[str, ...]:
    items = _str_list(value, where, '["pipeline.bypass_decode=sender"]')
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise StudyError(f"{where}: {item!r} must look like key.path=value, e.g. "
                             "\"pipeline.bypass_decode=sender\"")
        if key in GRID_KEYS:
            raise StudyError(f"{where}: {key} is set by the grid itself (arms, strategies, p, "
                             f"seeds); remove {item!r}")
        if per_block and key not in BASELINE_NEUTRAL_KEYS:
            raise StudyError(
                f"{where}: {key} would change training without failures too, but a block's cells "
                "are compared with the arm's shared p = 0 baseline, which does not have it; "
                f"only {', '.join(BASELINE_NEUTRAL_KEYS)} may be set per block (put {key} in "
                "a study of its own)")
    return tuple(items)


def _label_from_sets(sets: Sequence[str]) -> str:
    parts = []
    for item in sets:
        key, value = item.split("=", 1)
        parts.append(f"{key.strip().rsplit('.', 1)[-1]}_{value.strip()}")
    return re.sub(r"[^a-z0-9_]+", "_", "_".join(parts).lower()).strip("_")


def _number(value: Any, where: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise StudyError(f"{where} must be a number, got {value!r}")
    if positive and value <= 0:
        raise StudyError(f"{where} must be > 0, got {value!r}")
    return float(value)


def _block(index: int, data: Any, path: Path) -> Block:
    where = _where(path, f"grid[{index}]")
    if not isinstance(data, dict):
        raise StudyError(f"{where} must be a table ([[grid]] with arms, strategies, p)")
    unknown = sorted(set(data) - _BLOCK_KEYS)
    if unknown:
        raise StudyError(f"{where}: unknown key {unknown[0]!r}; a grid block takes "
                         f"{', '.join(sorted(_BLOCK_KEYS))}")
    for key in ("arms", "strategies", "p"):
        if key not in data:
            raise StudyError(f"{where}: missing {key!r}; e.g. arms = [\"ssn\"], "
                             "strategies = [\"skip\"], p = [0.1, 0.2]")
    arms = _choices(data["arms"], f"{where}.arms", ARMS)
    strategies = _choices(data["strategies"], f"{where}.strategies", STRATEGIES)
    raw_ps = data["p"]
    if not isinstance(raw_ps, list) or not raw_ps:
        raise StudyError(f"{where}.p must be a non-empty list of probabilities, e.g. [0.1, 0.2]")
    ps = []
    for value in raw_ps:
        p = _number(value, f"{where}.p", positive=False)
        if not 0.0 <= p <= 1.0:
            raise StudyError(f"{where}.p: {value!r} is not a probability in [0, 1]")
        ps.append(p)
    if len(set(ps)) != len(ps):
        raise StudyError(f"{where}.p lists a value twice: {raw_ps}")
    sets = _overrides(data.get("set", []), f"{where}.set", per_block=True)
    label = data.get("label")
    if label is None:
        label = _label_from_sets(sets)
    elif not isinstance(label, str) or not _SLUG.match(label):
        raise StudyError(f"{where}.label must be lower-case letters, digits and _ "
                         f"(e.g. \"decode_sender\"), got {label!r}")
    if label and not sets:
        raise StudyError(f"{where}: label {label!r} without `set` overrides would name the same "
                         "runs as the unlabelled cells; remove the label or add `set`")
    seeds = data.get("seeds")
    if seeds is not None:
        seeds = tuple(_seed_list(seeds, f"{where}.seeds"))
    return Block(index=index, arms=arms, strategies=strategies, ps=tuple(ps), sets=sets,
                 label=label, seeds=seeds)


def _seed_list(seeds: Any, where: str) -> list[int]:
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise StudyError(f"{where} must be a non-empty list of integers >= 0, "
                         f"e.g. [0, 1, 2, 3, 4]; got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"{where} lists a seed twice: {seeds}")
    return seeds


def load_spec(path: str | os.PathLike[str]) -> Spec:
    """Read and validate a study spec; raises `StudyError` naming the field and the fix."""
    given = Path(path)
    if not given.is_file():
        raise StudyError(f"spec {given} not found; pass a study spec such as studies/table1.toml")
    path = given          # as the user wrote it, for messages
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise StudyError(f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - _SPEC_KEYS)
    if unknown:
        raise StudyError(f"{path}: unknown key {unknown[0]!r}; a spec takes "
                         f"{', '.join(sorted(_SPEC_KEYS))}")
    for key in ("name", "preset", "seeds", "grid"):
        if key not in data:
            raise StudyError(f"{path}: missing {key!r} (a spec needs name, preset, seeds and at "
                             "least one [[grid]] block)")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise StudyError(f"{_where(path, 'name')} must be lower-case letters, digits, - and _ "
                         f"(it names results/<name>/), got {name!r}")
    from crucible.config import ConfigError, apply_overrides
    from crucible.presets import PRESETS, get_preset

    preset = data["preset"]
    if not isinstance(preset, str) or preset not in PRESETS:
        raise StudyError(f"{_where(path, 'preset')}: unknown preset {preset!r}; choose one of: "
                         f"{', '.join(PRESETS)}")
    seeds = _seed_list(data["seeds"], _where(path, "seeds"))
    grid = data["grid"]
    if not isinstance(grid, list) or not grid:
        raise StudyError(f"{_where(path, 'grid')} must be one or more [[grid]] blocks")
    blocks = tuple(_block(i, block, path) for i, block in enumerate(grid))
    sets = _overrides(data.get("set", []), _where(path, "set"))
    texts = {}
    for key in ("title", "notes"):
        value = data.get(key, "")
        if not isinstance(value, str):
            raise StudyError(f"{_where(path, key)} must be a string, got {value!r}")
        texts[key] = value.strip()
    folder = path.resolve().parent
    paths = {}
    defaults = {"results_dir": f"../results/{name}", "runs_dir": f"../runs/study/{name}",
                "document": "../docs/RESULTS.md", "figures_dir": "../docs/img"}
    for key, default in defaults.items():
        value = data.get(key, default)
        if not isinstance(value, str) or not value:
            raise StudyError(f"{_where(path, key)} must be a path (relative to the spec's "
                             f"folder), got {value!r}")
        paths[key] = Path(os.path.normpath(folder / value))
    numbers = {key: _number(data.get(key, 0.5), _where(path, key))
               for key in ("close_margin", "resolve_threshold", "equivalence_margin")}
    listed: dict[str, list[Path]] = {}
    for key, example in (("pilots", '["pilot-w128-lr2.toml"]'),
                         ("token_check", '["pilot-half.toml", "pilot-full.toml"]'),
                         ("scale", '["scale-d256.toml"]'),
                         ("reuse", '["pilot-w128-lr2.toml"]')):
        listed[key] = []
        for item in _str_list(data.get(key, []), _where(path, key), example):
            pilot = Path(os.path.normpath(folder / item))
            if not pilot.is_file() or pilot == path.resolve():
                raise StudyError(f"{_where(path, key)}: {item!r} is not another study spec "
                                 f"(looked for {pilot}); list other specs relative to this file")
            listed[key].append(pilot)
    if listed["token_check"] and len(listed["token_check"]) != 2:
        raise StudyError(f"{_where(path, 'token_check')} must name two specs: the preset's "
                         "baselines with half the global steps, then with all of them")
    spec = Spec(path=path.resolve(), name=name, preset=preset, seeds=tuple(seeds), blocks=blocks, sets=sets,
                title=texts["title"], notes=texts["notes"], pilots=tuple(listed["pilots"]),
                token_check=tuple(listed["token_check"]), scale=tuple(listed["scale"]),
                reuse=tuple(listed["reuse"]),
                **paths, **numbers)
    # Every distinct configuration must be valid before anything runs.
    base = get_preset(preset)
    checked: set[tuple[str, ...]] = set()
    for cell in expand_cells(spec):
        overrides = cell.overrides()
        key = tuple(o for o in overrides if not o.startswith("seed="))
        if key in checked:
            continue
        checked.add(key)
        try:
            apply_overrides(base, overrides)
        except ConfigError as exc:
            where = "set" if cell.block is None else f"grid[{cell.block}]"
            raise StudyError(f"{_where(path, where)}: cell {cell.id}: {exc}") from None
    return spec


# --------------------------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, order=True)
class GridKey:
    """A cell of the grid without its seed. p == 0 with strategy "base" is an arm's baseline."""
    arm: str
    strategy: str
    p: float
    label: str = ""

    @property
    def is_baseline(self) -> bool:
        return self.strategy == "base"

    @property
    def name(self) -> str:
        if self.is_baseline:
            return f"{self.arm}-base"
        return f"{self.arm}-{self.strategy}-p{self.p:g}" + (f"-{self.label}" if self.label else "")


@dataclass(frozen=True)
class Cell:
    key: GridKey
    seed: int
    sets: tuple[str, ...] = ()          # the spec's and the block's overrides, in that order
    block: int | None = None            # grid block index; None for a baseline
    tier: int = 0                       # run order: 0 baselines, 1 the blog's core, 2 the rest

    @property
    def id(self) -> str:
        return f"{self.key.name}-s{self.seed}"

    def overrides(self) -> list[str]:
        k = self.key
        strategy = BASELINE_STRATEGY if k.is_baseline else k.strategy
        return [*self.sets, f"seed={self.seed}", f"pipeline.compression={k.arm}",
                f"faults.p={k.p:g}", f"faults.strategy={strategy}"]


def _tier(key: GridKey) -> int:
    if key.is_baseline:
        return 0
    core = key.strategy in ("skip", "drop") and key.p in CLAIM_PS and not key.label
    return 1 if core else 2


def grid_keys(spec: Spec) -> list[GridKey]:
    """Every cell of the spec without seeds, baselines first, in a stable order."""
    return sorted({c.key for c in expand_cells(spec)}, key=_key_order)


def _key_order(key: GridKey) -> tuple[Any, ...]:
    arm = ARMS.index(key.arm) if key.arm in ARMS else len(ARMS)
    strategy = STRATEGIES.index(key.strategy) if key.strategy in STRATEGIES else -1
    return (not key.is_baseline, arm, key.label, strategy, key.p)


def expand_cells(spec: Spec, seeds: Iterable[int] | None = None) -> list[Cell]:
    """The spec's cells in run order: baselines (one per arm and seed), then the blog's core
    cells (skip/drop at p = 0.1 and 0.2) for every seed, then the rest; seed-major within a
    tier so that an interrupted grid has whole seeds. Seeds that only some blocks add (a
    block's `seeds` beyond the spec's) come after all of that, in the same order among
    themselves. p = 0 in a block means the shared baseline. Raises `StudyError` when two blocks give one cell id different overrides."""
    wanted = None if seeds is None else set(seeds)
    chosen = tuple(s for s in spec.all_seeds if wanted is None or s in wanted)

    def of(block: Block) -> list[int]:
        return [s for s in (block.seeds or spec.seeds) if s in chosen]

    cells: dict[str, Cell] = {}

    def add(cell: Cell) -> None:
        old = cells.get(cell.id)
        if old is not None and old.sets != cell.sets:
            raise StudyError(f"{_where(spec.path, f'grid[{cell.block}]')}: cell {cell.id} is also "
                             f"made by grid[{old.block}] with other overrides; give one block "
                             "a distinct `label`")
        cells.setdefault(cell.id, cell)

    arms = [a for a in ARMS if any(a in b.arms for b in spec.blocks)]
    # an arm's baselines: every seed that one of its blocks runs
    arm_seeds = {a: {s for b in spec.blocks if a in b.arms for s in of(b)} for a in arms}
    for seed in chosen:
        for arm in arms:
            if seed in arm_seeds[arm]:
                add(Cell(GridKey(arm, "base", 0.0), seed, spec.sets, None, 0))
    for block in spec.blocks:
        for arm in block.arms:
            for strategy in block.strategies:
                for p in block.ps:
                    if p == 0.0:
                        continue
                    key = GridKey(arm, strategy, p, block.label)
                    for seed in of(block):
                        add(Cell(key, seed, spec.sets + block.sets, block.index, _tier(key)))
    order = {s: i for i, s in enumerate(chosen)}
    # the spec's own seeds first (every cell), then the seeds only some blocks add: a grid
    # stopped early holds whole seeds of the whole grid, not the extra seeds' baselines alone
    extra = {s: int(s not in spec.seeds) for s in chosen}
    return sorted(cells.values(),
                  key=lambda c: (extra[c.seed], c.tier, order[c.seed], _key_order(c.key)))


def result_path(spec: Spec, cell: Cell) -> Path:
    return spec.results_dir / f"{cell.id}.json"


def completed_cells(spec: Spec, cells: Iterable[Cell]) -> tuple[list[Cell], list[Cell]]:
    """(done, todo): cells whose result file exists, and the others, in the given order."""
    done, todo = [], []
    for cell in cells:
        (done if result_path(spec, cell).is_file() else todo).append(cell)
    return done, todo


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------

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


def keep_result(spec: Spec, cell: Cell, summary: dict[str, Any], *, jobs: int) -> Path:
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


def adopt_results(spec: Spec, cells: Iterable[Cell], *, write: bool = True) -> dict[str, str]:
    """Cells of `spec` that a `reuse` spec already ran with the same configuration: copied into
    the results folder (marked `study.reused_from`) instead of run again. Returns {cell id:
    source spec name}. The configurations are compared whole (`comparable_config`), the
    source's file validated like any result."""
    from crucible.config import apply_overrides
    from crucible.presets import get_preset

    if not spec.reuse:
        return {}
    sources = [load_spec(path) for path in spec.reuse]
    base = get_preset(spec.preset)
    adopted: dict[str, str] = {}
    for cell in cells:
        wanted = comparable_config(apply_overrides(base, cell.overrides()).to_dict())
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


def run_command(spec: Spec, cell: Cell) -> list[str]:
    """The `crucible run` command of a cell (as argv, through this Python)."""
    argv = [sys.executable, "-c", "from crucible.cli import main; main()", "run",
            "--preset", spec.preset, "--no-progress"]
    for item in cell.overrides():
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


def run_study(spec: Spec, *, jobs: int = 2, seeds: Sequence[int] | None = None,
              limit: int | None = None, dry_run: bool = False,
              echo: Callable[[str], None] = print,
              command: Callable[[Spec, Cell], list[str]] | None = None,
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


# --------------------------------------------------------------------------------------------
# Results and statistics
# --------------------------------------------------------------------------------------------

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


def load_results(spec: Spec) -> dict[str, dict[str, Any]]:
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


@dataclass(frozen=True)
class Stat:
    """Mean of per-seed values with a 95% t-interval (lo/hi None for fewer than 2 seeds)."""
    values: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()
    mean: float | None = None
    sd: float | None = None
    lo: float | None = None
    hi: float | None = None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def half(self) -> float | None:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2.0


def stat_of(by_seed: Mapping[int, float]) -> Stat:
    """Stat of per-seed values: mean, sd, and the 95% Student-t interval (crucible.analysis)."""
    from crucible.analysis import summarise

    seeds = tuple(sorted(by_seed))
    values = tuple(float(by_seed[s]) for s in seeds)
    if not values:
        return Stat()
    mean, lo, hi, _ = summarise(values)
    sd = statistics.stdev(values) if len(values) > 1 else None
    return Stat(values=values, seeds=seeds, mean=mean, sd=sd, lo=lo, hi=hi)


def paired_stat(a: Mapping[int, float], b: Mapping[int, float]) -> Stat:
    """Stat of a - b over the seeds both have."""
    return stat_of({s: a[s] - b[s] for s in a if s in b})


class StudyData:
    """A spec with its loaded results: per-seed degradations, cell statistics, comparisons."""

    def __init__(self, spec: Spec, results: Mapping[str, dict[str, Any]]) -> None:
        self.spec = spec
        self.results = dict(results)
        self.cells = expand_cells(spec)
        self.keys = grid_keys(spec)
        self.by_key: dict[GridKey, dict[int, dict[str, Any]]] = {}
        for cell in self.cells:
            if cell.id in self.results:
                self.by_key.setdefault(cell.key, {})[cell.seed] = self.results[cell.id]

    def runs(self, key: GridKey) -> dict[int, dict[str, Any]]:
        return self.by_key.get(key, {})

    def baseline(self, arm: str) -> dict[int, dict[str, Any]]:
        return self.runs(GridKey(arm, "base", 0.0))

    def degradation(self, key: GridKey) -> dict[int, float]:
        """Per seed: 100 (L - L0) / L0 against the same arm's same-seed baseline (0 at p = 0)."""
        from crucible.analysis import relative_degradation

        base = self.baseline(key.arm)
        if key.is_baseline or key.p == 0.0:
            return {s: 0.0 for s in base}
        return {s: relative_degradation(run["final_val_loss"], base[s]["final_val_loss"])
                for s, run in self.runs(key).items() if s in base}

    def stat(self, key: GridKey) -> Stat:
        return stat_of(self.degradation(key))

    def mean_of(self, key: GridKey, fn: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [v for v in (fn(run) for run in self.runs(key).values()) if v is not None]
        return statistics.fmean(values) if values else None

    def grid(self) -> list[GridKey]:
        return [k for k in self.keys if not k.is_baseline]

    def find(self, arm: str, strategy: str, p: float, label: str = "") -> GridKey | None:
        key = GridKey(arm, strategy, p, label)
        return key if key in self.keys else None


def noise_floor_of(data: StudyData) -> tuple[float | None, float | None]:
    """(median per-cell sd of the paired degradation over cells with >= 2 seeds, the noise floor
    NOISE_FLOOR_Z x that sd: the ± range holding ~95% of one seed's value around its mean)."""
    sds = [s.sd for s in (data.stat(k) for k in data.grid()) if s.sd is not None]
    if not sds:
        return None, None
    sd = statistics.median(sds)
    return sd, NOISE_FLOOR_Z * sd


def noise_floor(spec_path: str | os.PathLike[str] | None = None) -> float | None:
    """The study's noise floor in points (see `noise_floor_of`), from the committed results of
    `spec_path` (default studies/table1.toml of this checkout); None when there is no spec or
    no cell with two seeds. Never raises."""
    try:
        spec = load_spec(spec_path or DEFAULT_SPEC)
        return noise_floor_of(StudyData(spec, load_results(spec)))[1]
    except Exception:   # noqa: BLE001 - the demo must not fail because of the study's data
        return None


# --------------------------------------------------------------------------------------------
# The blog's claims
# --------------------------------------------------------------------------------------------

AGREES, DISAGREES, NOT_RESOLVED, NOT_RUN = "agrees", "disagrees", "not resolved", "not run yet"


@dataclass(frozen=True)
class Comparison:
    label: str
    stat: Stat
    status: str          # "supports", "contradicts", "unresolved", "missing"
    margin: float | None = None     # band rules: the band's half-width; sign rules: None

    @property
    def seeds_to_decide(self) -> int | None:
        """Seeds its measured mean and sd say would decide it (None: over MAX_SEEDS, or no
        sd yet); only meaningful while it is unresolved."""
        from crucible.precision import seeds_to_decide

        if self.stat.mean is None or self.stat.sd is None:
            return None
        return seeds_to_decide(self.stat.mean, self.stat.sd, margin=self.margin)


@dataclass(frozen=True)
class Claim:
    tag: str
    title: str
    blog: str
    quantity: str
    rule: str
    comparisons: tuple[Comparison, ...]

    @property
    def verdict(self) -> str:
        statuses = [c.status for c in self.comparisons]
        if not statuses or all(s == "missing" for s in statuses):
            return NOT_RUN
        if "contradicts" in statuses:
            return DISAGREES
        if all(s == "supports" for s in statuses):
            return AGREES
        return NOT_RESOLVED

    def count(self, status: str) -> int:
        return sum(1 for c in self.comparisons if c.status == status)

    def seeds_to_decide(self) -> tuple[int, int] | None:
        """(seeds, comparisons over MAX_SEEDS) that would decide every unresolved comparison
        if their means and sds stay as measured; None when none is unresolved."""
        open_ = [c for c in self.comparisons if c.status == "unresolved"]
        if not open_:
            return None
        needs = [c.seeds_to_decide for c in open_]
        known = [n for n in needs if n is not None]
        return (max(known) if known else 0), sum(1 for n in needs if n is None)


def _sign_status(s: Stat, expect: str) -> str:
    """`expect` "below" or "above" 0: supports when the whole interval is on that side,
    contradicts when it is wholly on the other side, unresolved when it contains 0."""
    if s.n < 2 or s.lo is None or s.hi is None:
        return "missing"
    below, above = s.hi < 0.0, s.lo > 0.0
    if (below and expect == "below") or (above and expect == "above"):
        return "supports"
    if below or above:
        return "contradicts"
    return "unresolved"


def _band_status(s: Stat, margin: float) -> str:
    """Supports when the interval lies inside [-margin, +margin], contradicts when it lies
    wholly outside it, unresolved otherwise."""
    if s.n < 2 or s.lo is None or s.hi is None:
        return "missing"
    if -margin <= s.lo and s.hi <= margin:
        return "supports"
    if s.lo > margin or s.hi < -margin:
        return "contradicts"
    return "unresolved"


def _slope(points: Sequence[tuple[float, float]]) -> float:
    mx = statistics.fmean(p for p, _ in points)
    my = statistics.fmean(d for _, d in points)
    sxx = math.fsum((p - mx) ** 2 for p, _ in points)
    return math.fsum((p - mx) * (d - my) for p, d in points) / sxx


def _core_ps(data: StudyData, arm: str, strategy: str) -> list[float]:
    return sorted(k.p for k in data.grid() if k.arm == arm and k.strategy == strategy
                  and not k.label)


def skip_minus_drop(data: StudyData) -> list[tuple[str, float, Stat]]:
    """Per (arm, p) present for both skip and drop: the paired difference of degradations,
    skip - drop, over the seeds that have both (points of %)."""
    rows = []
    for arm in ARMS:
        for p in _core_ps(data, arm, "skip"):
            skip, drop = data.find(arm, "skip", p), data.find(arm, "drop", p)
            if skip is None or drop is None:
                continue
            rows.append((arm, p, paired_stat(data.degradation(skip), data.degradation(drop))))
    return rows


def growth_slopes(data: StudyData) -> list[tuple[str, str, list[float], Stat]]:
    """Per arm x {skip, drop}: the least-squares slope of degradation over the grid's failure
    rates p > 0 (at least two), per seed with every p present, in points per 0.1 of p. p = 0 is
    left out: its degradation is 0 by definition, and through that point any positive
    degradation would read as growth."""
    rows = []
    for arm in ARMS:
        for strategy in ("skip", "drop"):
            ps = _core_ps(data, arm, strategy)
            if len(ps) < 2:
                continue
            per_p = {p: data.degradation(GridKey(arm, strategy, p)) for p in ps}
            seeds = set(data.baseline(arm))
            for values in per_p.values():
                seeds &= set(values)
            slopes = {s: 0.1 * _slope([(p, per_p[p][s]) for p in ps])
                      for s in seeds}
            rows.append((arm, strategy, ps, stat_of(slopes)))
    return rows


def _arm_pairs(data: StudyData, arm: str, others: Sequence[str]
               ) -> list[tuple[str, float, Stat]]:
    rows = []
    for p in CLAIM_PS:
        mine = data.find(arm, "skip", p)
        for other in others:
            theirs = data.find(other, "skip", p)
            if mine is None or theirs is None:
                continue
            rows.append((other, p, paired_stat(data.degradation(mine), data.degradation(theirs))))
    return rows


def evaluate_claims(data: StudyData) -> list[Claim]:
    """The blog's four claims (a)-(d) and the seed texts' reading of it at p = 0.01 (e), each
    decided by an explicit rule on paired 95% intervals."""
    margin = data.spec.close_margin
    a = tuple(Comparison(f"{ARM_LABEL[arm]}, p = {p:g}", s, _sign_status(s, "below"))
              for arm, p, s in skip_minus_drop(data))
    b = tuple(Comparison(f"{ARM_LABEL[arm]}, {strategy}", s, _sign_status(s, "above"))
              for arm, strategy, _, s in growth_slopes(data))
    c = tuple(Comparison(f"SSN - {ARM_LABEL[other]}, p = {p:g}", s, _sign_status(s, "below"))
              for other, p, s in _arm_pairs(data, "ssn", ("mapl", "none")))
    d = tuple(Comparison(f"MAPL - uncompressed, p = {p:g}", s, _band_status(s, margin), margin)
              for _, p, s in _arm_pairs(data, "mapl", ("none",)))
    band = data.spec.equivalence_margin
    e = tuple(Comparison(f"{ARM_LABEL[arm]}, skip, p = {LOW_P:g}", s, _band_status(s, band), band)
              for arm in ARMS for key in [data.find(arm, "skip", LOW_P)] if key is not None
              for s in [data.stat(key)])
    blog_b = ", ".join(f"{ARM_LABEL[arm]} +{BLOG_SKIP[(arm, 0.1)]:.1f} -> "
                       f"+{BLOG_SKIP[(arm, 0.2)]:.1f}%" for arm in TABLE1_ARMS)
    blog_c = "; ".join(f"p = {p:g}: SSN +{BLOG_SKIP[('ssn', p)]:.1f}% vs MAPL "
                       f"+{BLOG_SKIP[('mapl', p)]:.1f}%, uncompressed +{BLOG_SKIP[('none', p)]:.1f}%"
                       for p in CLAIM_PS)
    blog_d = "; ".join(f"p = {p:g}: MAPL +{BLOG_SKIP[('mapl', p)]:.1f}% vs uncompressed "
                       f"+{BLOG_SKIP[('none', p)]:.1f}%" for p in CLAIM_PS)
    return [
        Claim("a", "skip costs less than drop at every p",
              f"drop {BLOG_DROP} vs skip +0.6-0.9%", "skip - drop, points (paired by seed)",
              "agrees if, for every arm and every p > 0 of the grid, the 95% interval of the "
              "paired difference skip - drop lies entirely below 0; disagrees if any lies "
              "entirely above 0; not resolved otherwise (an interval contains 0, or a "
              "comparison has fewer than 2 seeds)", a),
        Claim("b", "degradation grows with p", f"skip: {blog_b}",
              "slope of degradation over the failure rates p > 0, points per 0.1 of p",
              "per arm and strategy (skip, drop), each seed's least-squares slope of "
              "degradation against p over the grid's p values above 0 (p = 0 left out: its "
              "degradation is 0 by definition); agrees if every "
              "slope's 95% interval lies entirely above 0; disagrees if any lies entirely "
              "below 0; not resolved otherwise", b),
        Claim("c", "SSN degrades least at p = 0.1 and 0.2", blog_c,
              "SSN - other arm, skip, points (paired by seed)",
              "at p = 0.1 and 0.2 (skip), the paired differences SSN - MAPL and SSN - "
              "uncompressed; agrees if every 95% interval lies entirely below 0; disagrees if "
              "any lies entirely above 0; not resolved otherwise", c),
        Claim("d", "MAPL is close to uncompressed", blog_d,
              "MAPL - uncompressed, skip, points (paired by seed)",
              f"close means within ±{margin:g} points (the spec's close_margin); at p = 0.1 "
              f"and 0.2 (skip), agrees if the 95% interval of the paired difference MAPL - "
              f"uncompressed lies inside [-{margin:g}, +{margin:g}]; disagrees if it lies "
              f"entirely outside that band; not resolved otherwise", d),
        Claim("e", f"at p = {LOW_P:g} the loss stays within ±{band:g} points of its baseline "
              "(the seed texts' reading)",
              "\"at a 1% failure probability per replica per global step, validation loss "
              "stays close to baseline\" (two of the three seed texts)",
              "degradation under skip, points",
              f"an equivalence test: per arm at p = {LOW_P:g} (skip), agrees if the 95% interval "
              f"of the degradation lies inside [-{band:g}, +{band:g}] (the spec's "
              "equivalence_margin; stricter than the usual two one-sided tests, which use a 90% "
              "interval); disagrees if it lies entirely outside; not resolved otherwise", e),
    ]


# --------------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------------

def _pct(s: Stat, unit: str = "%") -> str:
    """'+0.61% [+0.20, +1.02]', '+0.61% (n=1, no interval)' or 'not run yet'."""
    if s.n == 0 or s.mean is None:
        return "not run yet"
    if s.lo is None or s.hi is None:
        return f"{s.mean:+.2f}{unit} (n=1, no interval)"
    return f"{s.mean:+.2f}{unit} [{s.lo:+.2f}, {s.hi:+.2f}]"


def _pts(s: Stat) -> str:
    return _pct(s, unit="")


def _ci(s: Stat) -> str:
    return "-" if s.lo is None or s.hi is None else f"[{s.lo:+.2f}, {s.hi:+.2f}]"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _variant(key: GridKey) -> str:
    return key.label or "-"


def _share(run: Mapping[str, Any]) -> float | None:
    budget = run.get("tokens_budget")
    return run["tokens_processed"] / budget if budget else None


def _setting(data: StudyData) -> dict[str, Any]:
    """What the runs were: from the data where it has it (configs, versions, wall time)."""
    from crucible.config import Config, ConfigError
    from crucible.presets import get_preset, parameter_count, tokens_per_global_step

    runs = [data.results[c.id] for c in data.cells if c.id in data.results]
    config = None
    source = "preset"
    base_runs = [r for arm in ARMS for r in data.baseline(arm).values()]
    for run in base_runs + runs:
        try:
            config = Config.from_dict(run["config"])
            source = "results"
            break
        except (ConfigError, KeyError, TypeError):
            continue
    if config is None:
        from crucible.config import apply_overrides
        config = apply_overrides(get_preset(data.spec.preset), list(data.spec.sets))
    shapes = {_shape(r) for r in runs}
    digests = {r["data_digest"] for r in runs if r.get("data_digest")}
    shas: dict[str, int] = {}
    machines: dict[str, int] = {}
    for run in runs:
        sha = (run.get("versions") or {}).get("git_sha") or "unknown"
        shas[sha] = shas.get(sha, 0) + 1
        machine = (run.get("study") or {}).get("machine")
        if machine:
            machines[machine] = machines.get(machine, 0) + 1
    params = parameter_count(config)
    tokens = tokens_per_global_step(config) * config.train.global_steps
    return {"config": config, "source": source, "params": params, "tokens": tokens,
            "chinchilla": tokens / (20.0 * params), "shapes": len(shapes), "shas": shas,
            "machines": machines, "runs": len(runs), "digests": sorted(digests),
            "undigested": sum(1 for r in runs if not r.get("data_digest")),
            "wall_s": math.fsum(float(r["wall_s"]) for r in runs)}


def _shape(run: Mapping[str, Any]) -> str:
    """A run's configuration beyond what the grid varies (seed, arm, p, strategy, decode) and
    beyond where its corpus lay: corpora are compared by content (`data_digest`), never by
    path."""
    varying = ("seed", "pipeline", "faults")
    config = {k: v for k, v in run["config"].items() if k not in varying}
    if isinstance(config.get("data"), dict):
        data = {k: v for k, v in config["data"].items() if k != "path"}
        path = config["data"].get("path")
        if not run.get("data_digest") and isinstance(path, str):
            data["file"] = Path(path).name    # no digest: the file's name is all there is
        config["data"] = data
    return json.dumps(config, sort_keys=True)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


def _verdict_word(claim: Claim) -> str:
    return {AGREES: "reproduced", DISAGREES: "contradicted", NOT_RESOLVED: "not resolved",
            NOT_RUN: "not run yet"}[claim.verdict]


def _range(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:+.2f}%" if abs(hi - lo) < 0.005 else f"{lo:+.2f}% to {hi:+.2f}%"


def _answer(data: StudyData, claims: Sequence[Claim], setting: Mapping[str, Any],
            resolvable: float | None) -> list[str]:
    """The opening three sentences, templated from the data."""
    spec = data.spec
    by_tag = {c.tag: c for c in claims}
    scale = (f"{setting['params'] / 1e6:.2f}M-parameter runs of {setting['tokens'] / 1e6:.2f}M "
             "tokens on a CPU")

    def means(strategy: str) -> list[float]:
        return [s.mean for k in data.grid() if k.strategy == strategy and k.p in CLAIM_PS
                and not k.label for s in [data.stat(k)] if s.mean is not None]

    skip, drop = means("skip"), means("drop")
    if not skip and not drop:
        return [f"No failure cell has a result yet, so this document answers nothing so far. "
                f"Run `crucible study run {spec.shown(spec.path)}` (it skips the cells already "
                f"in `{spec.shown(spec.results_dir)}/`) and render this file again with "
                f"`{spec.command}`. The study's runs are {scale}, not the blog's 178M "
                "Chinchilla-budget runs."]
    a = by_tag["a"]
    first = (f"At p = 0.1 and 0.2, skipping a failed stage raised the final validation loss by "
             f"{_range(skip)} over the arms (cell means) and dropping the replica's tokens by "
             f"{_range(drop)}, against the blog's +0.6-0.9% and {BLOG_DROP}; the blog's \"skip "
             f"costs less than drop at every p\" is {_verdict_word(a)} here "
             f"({a.count('supports')} of {len(a.comparisons)} paired comparisons have their 95% "
             "interval below 0).")
    second = ("Of the blog's other claims, \"degradation grows with p\" is "
              f"{_verdict_word(by_tag['b'])}, \"SSN degrades least\" is "
              f"{_verdict_word(by_tag['c'])}, and \"MAPL is close to uncompressed\" (within "
              f"±{spec.close_margin:g} points) is {_verdict_word(by_tag['d'])}.")
    e = by_tag["e"]
    second += (f" The seed texts' \"at p = {LOW_P:g} the loss stays close to baseline\" (within "
               f"±{spec.equivalence_margin:g} points) is "
               + (f"{_verdict_word(e)}." if e.comparisons else
                  f"not tested: p = {LOW_P:g} is not in this grid."))
    ns = sorted({data.stat(k).n for k in data.grid()} - {0})
    seeds = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    run = sum(1 for k in data.grid() if data.stat(k).n)
    cells = ("" if run == len(data.grid()) else
             f" ({run} of {len(data.grid())} failure cells run so far)")
    res = ("" if resolvable is None else
           f"; differences smaller than about {resolvable:.2f} points are within this study's noise")
    third = (f"These are {scale} with {seeds} seed{'s' if ns[-1] != 1 else ''} per cell{cells}, "
             f"not the blog's 178M Chinchilla-budget runs{res}.")
    return [first + " " + second + " " + third]


def _missing_count(data: StudyData) -> tuple[int, int]:
    expected = len(data.cells)
    return expected - sum(1 for c in data.cells if c.id in data.results), expected


def render_markdown(data: StudyData, *, figure_names: Mapping[str, str] | None = None) -> str:
    """The whole results document as Markdown (deterministic: only the data and the spec)."""
    spec = data.spec
    claims = evaluate_claims(data)
    setting = _setting(data)
    cfg = setting["config"]
    sd_floor, floor = noise_floor_of(data)
    halves = [s.half for s in (data.stat(k) for k in data.grid()) if s.half is not None]
    diffs = skip_minus_drop(data)
    diff_halves = [s.half for _, _, s in diffs if s.half is not None]
    resolvable = statistics.median(halves) if halves else None
    missing, expected = _missing_count(data)
    figures = figure_names or figure_files(spec)
    img = {name: Path(os.path.relpath(path, spec.document.parent)).as_posix()
           for name, path in figures.items()}
    out: list[str] = []
    title = spec.title or "Failure study: the blog's Table 1 and Figure 3, with intervals"
    out += [f"# {title}", "",
            f"<!-- Generated by `{spec.command}` from {spec.shown(spec.results_dir)}/*.json. "
            f"Do not edit by hand: `{spec.command} --check` and tests/unit/test_study.py fail "
            "when this file differs from what the data render. -->", ""]
    out += _answer(data, claims, setting, resolvable)
    out += ["", f"Generated by `{spec.command}` from the committed run summaries in "
            f"`{spec.shown(spec.results_dir)}/` (spec `{spec.shown(spec.path)}`); "
            f"the runs were made by `crucible study run {spec.shown(spec.path)}`.", ""]

    # Setting
    seeds_per_cell: dict[int, int] = {}
    for key in data.grid():
        n = data.stat(key).n
        seeds_per_cell[n] = seeds_per_cell.get(n, 0) + 1
    m, t = cfg.model, cfg.train
    out += ["## Setting", "",
            f"- Model: {setting['params'] / 1e6:.2f}M parameters per replica (d_model {m.d_model}, "
            f"{m.layers} layers, {m.heads} heads, context {m.seq_len}, vocabulary {m.vocab_size}), "
            f"preset `{spec.preset}`" + ("" if not spec.sets else
                                         f" with {', '.join(f'`{s}`' for s in spec.sets)}") + ".",
            f"- Training: R = {cfg.replicas} data-parallel replicas x S = {cfg.pipeline.stages} "
            f"pipeline stages, SparseLoCo with H = {cfg.sparseloco.inner_steps} inner steps per "
            f"global step, {t.global_steps} global steps, {t.batch_size} sequences per replica "
            f"per inner step, peak learning rate {t.lr:g}; boundary compression factor "
            f"{cfg.pipeline.factor} for SSN and MAPL.",
            f"- Tokens: {setting['tokens']:,} per run when no replica is down, "
            f"{setting['chinchilla']:.2f}x the Chinchilla budget of 20 tokens per parameter "
            f"({'token-limited' if setting['chinchilla'] < 1 else 'at or past the Chinchilla budget'}"
            ").",
            f"- Failures: each inner stage of each replica fails with probability p per global "
            f"step and stays down {cfg.faults.duration} global steps; every arm and strategy at "
            "the same p and seed sees the same failure schedule, so comparisons are paired by "
            "seed.",
            "- Degradation: 100 (L - L0) / L0 of the final validation loss (the whole held-out "
            "split), L0 being the same arm's p = 0 run with the same seed; means over seeds with "
            "a 95% Student-t interval (one seed: no interval).",
            f"- Seeds: {', '.join(str(s) for s in spec.all_seeds)} in the spec; per cell: "
            + (", ".join(f"{c} cell{'s' if c != 1 else ''} with {n}"
                         for n, c in sorted(seeds_per_cell.items(), reverse=True)) or "none") + ".",
            f"- Grid: {expected} runs ({len(data.keys)} cells x seeds, baselines included); "
            f"{expected - missing} present, {missing} not run yet.",
            "- Commits (versions.git_sha of the summaries): "
            + (", ".join(f"`{sha[:12]}` ({n} run{'s' if n != 1 else ''})"
                         for sha, n in sorted(setting["shas"].items())) or "none yet") + ".",
            f"- Wall time: {_duration(setting['wall_s'])} of training over {setting['runs']} runs "
            "(sum of wall_s)" + ("; machine: " + "; ".join(
                f"{name} ({n} runs)" for name, n in sorted(setting["machines"].items()))
                if setting["machines"] else "") + "."]
    if setting["source"] == "preset" and setting["runs"]:
        out.append(f"- Note: the model and training numbers above come from preset "
                   f"`{spec.preset}` as the code defines it now; the summaries' configs no "
                   "longer parse.")
    if setting["shapes"] > 1:
        out.append(f"- Warning: the results come from {setting['shapes']} different "
                   "configurations (beyond seed, arm, p and strategy); they are not one study. "
                   "Delete the stale files and run them again.")
    if len(setting["digests"]) > 1:
        out.append(f"- Warning: the results were trained on {len(setting['digests'])} different "
                   "corpora (by content, `data_digest`); they are not one study.")
    elif setting["digests"]:
        out.append(f"- Corpus: `{setting['digests'][0][:19]}...` (the token stream's "
                   f"`data_digest`) in every run that records one"
                   + (f"; {setting['undigested']} runs made before digests were recorded do "
                      "not" if setting["undigested"] else "") + ".")
    if spec.notes:
        out += ["", spec.notes]
    out.append("")
    if spec.pilots:
        from crucible.pilot import pilot_rows, pilot_section

        out += pilot_section(spec, pilot_rows(spec), ARM_LABEL)
    if spec.token_check:
        from crucible.pilot import token_section

        out += token_section(spec, ARM_LABEL)

    # Table 1
    out += ["## Table 1: skip, increase of the final validation loss over p = 0", "",
            "Mean over seeds with the 95% interval in brackets; the blog's value beside it.", ""]
    header = ["p"]
    for arm in TABLE1_ARMS:
        header += [f"{ARM_LABEL[arm]} (Crucible)", f"{ARM_LABEL[arm]} (blog)"]
    rows = []
    for p in CLAIM_PS:
        row = [f"{p:g}"]
        for arm in TABLE1_ARMS:
            key = data.find(arm, "skip", p)
            row += [_pct(data.stat(key)) if key else "not in the spec",
                    f"+{BLOG_SKIP[(arm, p)]:.1f}%"]
        rows.append(row)
    out += _table(header, rows)
    out += ["", "## Figure 3: degradation against p", "",
            f"![Figure 3: degradation against p, skip solid, drop dashed, 95% bands]"
            f"({img['figure3']})", "",
            "Skip solid, drop dashed, shaded: 95% interval over seeds (none where a point has one "
            "seed); crosses: the blog's skip values.", ""]

    # All cells
    out += ["## All cells", "",
            "Degradation in % of the same-seed baseline's final loss; half-width in points; the "
            f"seeds its measured sd says a ±{spec.resolve_threshold:g}-point 95% interval needs; "
            "tokens processed as a share of the budget and replica-steps with a stage down, means "
            "over seeds.", ""]
    rows = []
    for key in data.grid():
        s = data.stat(key)
        share = data.mean_of(key, _share)
        down = data.mean_of(key, lambda r: r.get("replica_down_fraction"))
        present = len(data.runs(key))
        n_text = str(s.n) if present == s.n else f"{s.n} ({present - s.n} without baseline)"
        rows.append([ARM_LABEL[key.arm], key.strategy, _variant(key), f"{key.p:g}", n_text,
                     "not run yet" if s.mean is None else f"{s.mean:+.2f}%",
                     _ci(s) if s.n != 1 else "n=1, no interval", _num(s.half),
                     _seeds_for_target(s, spec.resolve_threshold),
                     "-" if share is None else f"{100 * share:.1f}%",
                     "-" if down is None else f"{100 * down:.1f}%"])
    out += _table(["arm", "strategy", "variant", "p", "n", "mean", "95% CI", "half-width",
                   f"seeds for ±{spec.resolve_threshold:g}", "tokens processed",
                   "replica-steps down"], rows)
    out.append("")

    # Baselines
    out += ["## Baselines (p = 0)", "", "Absolute final validation loss of each arm's p = 0 runs.",
            ""]
    rows = []
    for arm in ARMS:
        runs = data.baseline(arm)
        if GridKey(arm, "base", 0.0) not in data.keys:
            continue
        losses = [r["final_val_loss"] for r in runs.values()]
        initial = [r["initial_val_loss"] for r in runs.values()
                   if r.get("initial_val_loss") is not None]
        wall = [float(r["wall_s"]) for r in runs.values()]
        rows.append([ARM_LABEL[arm], str(len(losses)),
                     _num(statistics.fmean(losses) if losses else None, ".4f"),
                     _num(statistics.stdev(losses) if len(losses) > 1 else None, ".4f"),
                     _num(statistics.fmean(initial) if initial else None, ".4f"),
                     _num(statistics.fmean(wall) if wall else None, ".0f")])
    out += _table(["arm", "n", "final val loss (mean)", "sd", "initial val loss", "wall s (mean)"],
                  rows)
    out.append("")

    # Extras
    out += _extras(data, img)
    from crucible.alignment_study import alignment_section

    out += alignment_section(data, ARM_LABEL, img.get("alignment"))
    if spec.scale:
        from crucible.scale import scale_section

        out += scale_section(data, ARM_LABEL)

    # Claims
    out += ["## The blog's claims", "",
            "Each claim is decided by the rule under the table, on 95% intervals of differences "
            "paired by seed (same arm baseline, same failure schedule). \"Least favourable\" is "
            "the comparison closest to contradicting the claim.", ""]
    rows = []
    for claim in claims:
        rows.append([f"({claim.tag}) {claim.title}", claim.blog, _claim_summary(claim),
                     f"**{claim.verdict}**", _seeds_needed(claim)])
    out += _table(["claim", "blog", "Crucible (95% CI)", "agrees?",
                   "seeds that would decide it"], rows)
    out += ["", "\"Seeds that would decide it\": for a claim not resolved, the seeds after which "
            "every open comparison's 95% interval would clear its boundary if its mean and sd "
            "stayed as measured (crucible.precision; the sd of n seeds is itself uncertain, "
            "about ±30% at 6 seeds, so read it as a size, not a count)."]
    out += ["", "Rules:", ""]
    out += [f"- ({c.tag}) {c.rule}." for c in claims]
    out.append("")
    for claim in claims:
        out += [f"### ({claim.tag}) {claim.title}", "", f"Quantity: {claim.quantity}.", ""]
        out += _table(["comparison", "n", "mean [95% CI]", "reads as", "seeds to decide"],
                      [[c.label, str(c.stat.n), _pts(c.stat), c.status, _decide_text(c)]
                       for c in claim.comparisons]
                      or [["-", "0", "not in the grid or not run yet", "missing", "-"]])
        out.append("")

    # What agrees, what does not
    out += ["## What agrees with the blog, and what does not", ""]
    for claim in claims:
        out.append(f"- {_claim_sentence(claim)}")
    out.append("")

    # Cannot resolve
    out += ["## What the measurement cannot resolve", ""]
    wide = [(key, s) for key in data.grid() for s in [data.stat(key)]
            if s.half is not None and round(s.half, 2) > spec.resolve_threshold]
    one = [key for key in data.grid() if data.stat(key).n == 1]
    if resolvable is None:
        out.append("- No cell has two seeds yet, so no interval and no noise floor exist.")
    else:
        out.append(f"- Smallest resolvable degradation: the median 95% half-width over the cells "
                   f"is {resolvable:.2f} points, so a cell whose mean is closer to 0 than that "
                   "cannot be told from no degradation.")
        if diff_halves:
            out.append(f"- Smallest resolvable skip - drop difference: the median half-width of "
                       f"the paired differences is {statistics.median(diff_halves):.2f} points.")
        out.append(f"- Noise floor of one seed: the median per-cell sd of the degradation is "
                   f"{sd_floor:.2f} points, so one seed's value lies within about "
                   f"±{floor:.2f} points ({NOISE_FLOOR_Z:g} sd) of its cell's mean; the demo "
                   "(`make demo`) quotes this figure for its one-seed cells.")
        n_seeds = max(s.n for s in (data.stat(k) for k in data.grid()))
        out.append(f"- Halving these widths takes about four times the seeds ({4 * n_seeds} "
                   f"instead of {n_seeds}).")
    if wide:
        out.append(f"- Cells whose half-width exceeds {spec.resolve_threshold:g} points "
                   f"({len(wide)}): " + "; ".join(
                       f"{_cell_name(k)} ±{s.half:.2f}" for k, s in wide) + ".")
    elif resolvable is not None:
        out.append(f"- No cell's half-width exceeds {spec.resolve_threshold:g} points.")
    if one:
        out.append(f"- Cells with one seed, no interval ({len(one)}): "
                   + ", ".join(_cell_name(k) for k in one) + ".")
    if missing:
        out.append(f"- Not run yet: {missing} of {expected} runs; "
                   f"`crucible study run {spec.shown(spec.path)}` runs only those.")
    out.append("- This is a CPU-sized model on a small corpus; the blog's absolute numbers (178M "
               "parameters, Chinchilla tokens) are not expected to match, only the direction and "
               "the ordering of the effects.")
    out.append("")
    return "\n".join(out)


def _seeds_for_target(s: Stat, target: float) -> str:
    from crucible.precision import MAX_SEEDS, seeds_for_half_width

    if s.sd is None:
        return "-"
    n = seeds_for_half_width(s.sd, target)
    return f"> {MAX_SEEDS}" if n is None else str(n)


def _decide_text(c: Comparison) -> str:
    from crucible.precision import MAX_SEEDS

    if c.status != "unresolved":
        return "-"
    n = c.seeds_to_decide
    return f"> {MAX_SEEDS}" if n is None else str(n)


def _seeds_needed(claim: Claim) -> str:
    from crucible.precision import MAX_SEEDS

    need = claim.seeds_to_decide()
    if need is None:
        return "-"
    n, beyond = need
    if beyond and not n:
        return f"> {MAX_SEEDS}"
    return str(n) + (f" ({beyond} comparison{'s' if beyond != 1 else ''} > {MAX_SEEDS})"
                     if beyond else "")


def _cell_name(key: GridKey) -> str:
    parts = [ARM_LABEL[key.arm], key.strategy, f"p = {key.p:g}"]
    if key.label:
        parts.append(key.label)
    return " ".join(parts[:2]) + ", " + ", ".join(parts[2:])


def _claim_summary(claim: Claim) -> str:
    stats = [c for c in claim.comparisons if c.stat.n >= 2]
    if not stats:
        return "not run yet"
    counts = ", ".join(f"{claim.count(k)} {k}" for k in ("supports", "unresolved", "contradicts",
                                                         "missing") if claim.count(k))
    if claim.tag in ("d", "e"):
        worst = max(stats, key=lambda c: max(abs(c.stat.lo or 0.0), abs(c.stat.hi or 0.0)))
    elif claim.tag == "b":
        worst = min(stats, key=lambda c: c.stat.lo if c.stat.lo is not None else math.inf)
    else:
        worst = max(stats, key=lambda c: c.stat.hi if c.stat.hi is not None else -math.inf)
    return (f"{len(claim.comparisons)} comparisons: {counts}; least favourable: "
            f"{worst.label}: {_pts(worst.stat)}")


def _claim_sentence(claim: Claim) -> str:
    head = f"({claim.tag}) \"{claim.title}\": "
    verdict = claim.verdict
    if verdict == NOT_RUN:
        return head + "not run yet (no comparison has two seeds)."
    listed = "; ".join(f"{c.label}: {_pts(c.stat)}" for c in claim.comparisons
                       if c.status != "missing")
    if verdict == AGREES:
        return head + f"reproduced; every comparison supports it ({listed})."
    against = [c for c in claim.comparisons if c.status == "contradicts"]
    if verdict == DISAGREES:
        return head + ("not reproduced: the data contradict it in "
                       + "; ".join(f"{c.label} ({_pts(c.stat)})" for c in against)
                       + f". All comparisons: {listed}.")
    open_ = [c for c in claim.comparisons if c.status in ("unresolved", "missing")]
    return head + ("not resolved: nothing contradicts it, but these comparisons leave it open "
                   "at 95% (interval across the boundary, or fewer than 2 seeds): "
                   + "; ".join(f"{c.label}: {_pts(c.stat) if c.stat.n else 'not run yet'}"
                               for c in open_) + ".")


def _extras(data: StudyData, img: Mapping[str, str]) -> list[str]:
    """Strategies beyond skip/drop and the labelled variants (MAPL decode options)."""
    extra_keys = [k for k in data.grid() if k.label or k.strategy not in ("skip", "drop")]
    if not extra_keys:
        return []
    out = ["## Beyond the blog: other strategies and variants", "",
           "Each row: the same arm's cells at one p, degradation in % with the 95% interval; "
           "variants are the labelled grid blocks (their overrides below).", ""]
    groups = sorted({(k.arm, k.p) for k in extra_keys}, key=lambda g: (ARMS.index(g[0]), g[1]))
    for arm, p in groups:
        keys = [k for k in data.grid() if k.arm == arm and k.p == p]
        out += [f"**{ARM_LABEL[arm]}, p = {p:g}**", ""]
        rows = []
        ref = data.find(arm, "skip", p)
        for key in keys:
            s = data.stat(key)
            vs = "-"
            if ref is not None and key != ref:
                vs = _pts(paired_stat(data.degradation(key), data.degradation(ref)))
            rows.append([key.strategy, _variant(key), _pct(s), vs])
        out += _table(["strategy", "variant", "degradation", "minus skip (paired, points)"], rows)
        out.append("")
    labelled = {}
    for block in data.spec.blocks:
        if block.label:
            labelled[block.label] = block.sets
    if labelled:
        from crucible.config import apply_overrides
        from crucible.presets import get_preset

        base = apply_overrides(get_preset(data.spec.preset), list(data.spec.sets)).to_dict()
        varied = sorted({item.split("=", 1)[0].strip() for sets in labelled.values()
                         for item in sets})
        defaults = []
        for key in varied:
            node: Any = base
            for part in key.split("."):
                node = node[part]
            defaults.append(f"`{key}={node}`")
        out += ["Variants: " + "; ".join(f"`{label}` = {', '.join(f'`{s}`' for s in sets)}"
                                         for label, sets in sorted(labelled.items()))
                + f" (unlabelled cells use the preset's defaults: {', '.join(defaults)}).", ""]
    out += [f"![Other strategies and variants]({img['extras']})", ""]
    return out


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------

def figure_files(spec: Spec) -> dict[str, Path]:
    return {"figure3": spec.figures_dir / f"{spec.name}-figure3.png",
            "extras": spec.figures_dir / f"{spec.name}-extras.png",
            "alignment": spec.figures_dir / f"{spec.name}-alignment.png"}


_COLORS = {"none": "#0072B2", "ssn": "#D55E00", "mapl": "#009E73"}
_DASH = {"skip": "solid", "drop": "dash", "drop_extend": "dot", "reroute": "dashdot"}
_FONT = "DejaVu Sans, Liberation Sans, Arial, sans-serif"


def _rgba(hex_color: str, alpha: float) -> str:
    value = hex_color.lstrip("#")
    r, g, b = (int(value[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def build_figures(data: StudyData) -> dict[str, Any]:
    """Plotly figures: 'figure3' (degradation against p per arm, skip solid and drop dashed,
    95% bands, the blog's skip points) and 'extras' (every cell at the extras' p with its
    interval)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    arms = [a for a in TABLE1_ARMS if any(k.arm == a for k in data.grid())] or list(TABLE1_ARMS)
    fig = make_subplots(rows=1, cols=len(arms), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[ARM_LABEL[a] for a in arms])
    for col, arm in enumerate(arms, start=1):
        color = _COLORS[arm]
        for strategy in ("skip", "drop"):
            points = [(0.0, 0.0, 0.0, 0.0, len(data.baseline(arm)))]
            for p in _core_ps(data, arm, strategy):
                s = data.stat(GridKey(arm, strategy, p))
                if s.mean is not None:
                    points.append((p, s.mean, s.lo if s.lo is not None else s.mean,
                                   s.hi if s.hi is not None else s.mean, s.n))
            if len(points) < 2:
                continue
            xs = [pt[0] for pt in points]
            banded = [pt for pt in points if pt[4] >= 2]
            if len(banded) >= 2:
                fig.add_trace(go.Scatter(
                    x=[pt[0] for pt in banded] + [pt[0] for pt in reversed(banded)],
                    y=[pt[3] for pt in banded] + [pt[2] for pt in reversed(banded)],
                    mode="lines", fill="toself",
                    fillcolor=_rgba(color, 0.18 if strategy == "skip" else 0.10),
                    line={"width": 0}, hoverinfo="skip", showlegend=False), row=1, col=col)
            fig.add_trace(go.Scatter(
                x=xs, y=[pt[1] for pt in points], mode="lines+markers",
                name=f"{strategy} ({'solid' if strategy == 'skip' else 'dashed'})",
                showlegend=col == 1, legendgroup=strategy,
                line={"color": color, "dash": _DASH[strategy], "width": 2.5},
                marker={"size": 8, "color": color,
                        "symbol": ["circle" if pt[4] >= 2 else "circle-open"
                                   for pt in points]}), row=1, col=col)
        blog = [(p, BLOG_SKIP[(arm, p)]) for p in CLAIM_PS]
        fig.add_trace(go.Scatter(x=[b[0] for b in blog], y=[b[1] for b in blog], mode="markers",
                                 name="blog (skip)" if col == 1 else None, showlegend=col == 1,
                                 marker={"symbol": "x-thin", "size": 12, "color": "#000",
                                         "line": {"width": 2, "color": "#000"}}),
                      row=1, col=col)
        fig.add_hline(y=0.0, line={"color": "#999", "width": 1}, row=1, col=col)
        fig.update_xaxes(title_text="failure probability p", row=1, col=col,
                         tickvals=[0.0, *sorted({k.p for k in data.grid()
                                                 if k.p <= 0.5 and not k.label})] or None)
    fig.update_yaxes(title_text="final val loss vs p = 0 (%)", row=1, col=1)
    fig.update_layout(template="plotly_white", font={"family": _FONT, "size": 14},
                      title={"text": "Figure 3: degradation against p (skip solid, drop "
                                     "dashed; 95% bands over seeds)", "x": 0.01},
                      margin={"l": 80, "r": 30, "t": 90, "b": 70}, width=1200, height=480,
                      legend={"x": 0.01, "y": 0.99, "bgcolor": "rgba(255,255,255,0.85)",
                              "bordercolor": "#ccc", "borderwidth": 1})

    # Extras: every cell at each p where an extra strategy or variant was run.
    extra_ps = sorted({k.p for k in data.grid() if k.label or k.strategy not in ("skip", "drop")})
    extras = go.Figure()
    for p in extra_ps:
        for arm in ARMS:
            keys = [k for k in data.grid() if k.arm == arm and k.p == p]
            names, means, plus, minus = [], [], [], []
            for key in keys:
                s = data.stat(key)
                if s.mean is None:
                    continue
                names.append(f"{ARM_LABEL[arm]} {key.strategy}"
                             + (f" {key.label}" if key.label else "")
                             + (f" (p={p:g})" if len(extra_ps) > 1 else ""))
                means.append(s.mean)
                plus.append((s.hi - s.mean) if s.hi is not None else 0.0)
                minus.append((s.mean - s.lo) if s.lo is not None else 0.0)
            if names:
                extras.add_trace(go.Scatter(
                    x=names, y=means, mode="markers", name=ARM_LABEL[arm],
                    marker={"size": 10, "color": _COLORS[arm]},
                    error_y={"type": "data", "array": plus, "arrayminus": minus,
                             "color": _COLORS[arm], "thickness": 2, "width": 6}))
    extras.add_hline(y=0.0, line={"color": "#999", "width": 1})
    extras.update_layout(template="plotly_white", font={"family": _FONT, "size": 14},
                         title={"text": "All strategies and variants at "
                                + ", ".join(f"p = {p:g}" for p in extra_ps)
                                + " (95% intervals over seeds)", "x": 0.01},
                         yaxis_title="final val loss vs p = 0 (%)", width=1200, height=480,
                         margin={"l": 80, "r": 30, "t": 70, "b": 150}, showlegend=True)
    figures = {"figure3": fig, "extras": extras}
    from crucible.alignment_study import alignment_figure

    aligned = alignment_figure(data, _COLORS, ARM_LABEL, _FONT)
    if aligned is not None:
        figures["alignment"] = aligned
    return figures


def write_figures(figures: Mapping[str, Any], paths: Mapping[str, Path], *, scale: int = 2
                  ) -> list[Path]:
    """Render each Plotly figure to PNG in headless Chromium (/usr/bin/chromium, driven by
    Playwright; plotly.js inlined from the plotly package, no network) with Plotly.toImage.
    Raises StudyError when Chromium or Playwright is missing."""
    if not CHROMIUM.exists():
        raise FigureError(f"{CHROMIUM} is missing, so the figures cannot be rendered: install "
                         "Debian's chromium (`make system-deps`), or pass --no-figures")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise FigureError("playwright is not installed (`pip install -e .[dev]`); or pass "
                         "--no-figures") from None

    import plotly

    plotly_js = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(
        encoding="utf-8")
    page_html = ('<!DOCTYPE html><html><head><meta charset="utf-8"><script>' + plotly_js
                 + '</script></head><body><div id="fig"></div></body></html>')
    script = """async ([spec, scale]) => {
        const fig = JSON.parse(spec);
        const gd = document.getElementById('fig');
        await Plotly.newPlot(gd, fig.data, fig.layout, {staticPlot: true});
        return await Plotly.toImage(gd, {format: 'png', width: fig.layout.width,
                                         height: fig.layout.height, scale: scale});
    }"""
    def shoot() -> list[Path]:
        return _screenshots(sync_playwright, figures, paths, page_html, script, scale)

    # Playwright's sync API refuses to run where an asyncio loop is running in this thread
    # (a Prefect flow, a notebook): render in a thread of its own, which has none
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(shoot).result()


def _screenshots(sync_playwright: Any, figures: Mapping[str, Any], paths: Mapping[str, Path],
                 page_html: str, script: str, scale: int) -> list[Path]:
    import base64

    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            # plotly.js is 4.8 MB inline: parsing it on a loaded 2-core machine can pass
            # Playwright's 30 s default
            page.set_default_timeout(180_000)
            page.set_content(page_html, timeout=180_000)
            for name, fig in figures.items():
                url = page.evaluate(script, [fig.to_json(), scale])
                png = base64.b64decode(url.split(",", 1)[1])
                path = paths[name]
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_bytes(png)
                os.replace(tmp, path)
                written.append(path)
        finally:
            browser.close()
    return written


def render(spec: Spec, *, check: bool = False, figures: bool = True,
           echo: Callable[[str], None] = print) -> int:
    """Render (or, with `check`, compare) the document; returns the exit code."""
    data = StudyData(spec, load_results(spec))
    text = render_markdown(data)
    if check:
        try:
            current = spec.document.read_text(encoding="utf-8")
        except OSError:
            current = None
        if current == text:
            echo(f"{spec.shown(spec.document)} is up to date with "
                 f"{spec.shown(spec.results_dir)}")
            return 0
        import difflib

        echo(f"{spec.shown(spec.document)} differs from what {spec.shown(spec.results_dir)} "
             f"renders; run `{spec.command}` and commit the result")
        if current is not None:
            diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(),
                                             "committed", "rendered", lineterm="", n=1))
            for line in diff[:40]:
                echo(line)
        return 1
    spec.document.parent.mkdir(parents=True, exist_ok=True)
    tmp = spec.document.with_name(f".{spec.document.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, spec.document)
    missing, expected = _missing_count(data)
    echo(f"wrote {spec.shown(spec.document)} from {expected - missing} of {expected} runs "
         f"({missing} not run yet)")
    if figures:
        for path in write_figures(build_figures(data), figure_files(spec)):
            echo(f"wrote {spec.shown(path)}")
    return 0


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _check_machine(spec: Spec, *, memory_check: bool = True) -> None:
    """Refuse (ConfigError) a spec whose cells this machine cannot run (device, memory estimate
    of one run), before any run starts; each cell's `crucible run` checks again for itself."""
    from crucible.config import apply_overrides
    from crucible.preflight import check_machine
    from crucible.presets import get_preset

    base, seen = get_preset(spec.preset), set()
    for cell in expand_cells(spec):
        config = apply_overrides(base, [o for o in cell.overrides() if not o.startswith("seed=")])
        if config.to_json() not in seen:
            seen.add(config.to_json())
            check_machine(config, memory_check=memory_check)


def _parse_seeds(text: str | None, spec: Spec) -> list[int] | None:
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise StudyError(f"--seeds must be comma-separated integers such as 0,1; got {text!r}"
                         ) from None
    unknown = [s for s in seeds if s not in spec.all_seeds]
    if not seeds or unknown:
        raise StudyError(f"--seeds {text!r}: choose from the spec's seeds "
                         f"{','.join(str(s) for s in spec.all_seeds)}")
    return seeds


def register(app: Any) -> None:
    """Add the `crucible study run|render` commands to the `crucible` command line."""
    import typer

    study_app = typer.Typer(help="The failure study: run a committed grid spec, render "
                                 "docs/RESULTS.md from its results.", no_args_is_help=True)

    def fail(message: str, code: int = 2) -> typer.Exit:
        typer.echo(f"error: {message}", err=True)
        return typer.Exit(code=code)

    @study_app.command("run")
    def run_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec, e.g. "
                                                                   "studies/table1.toml"),
        jobs: int = typer.Option(2, "--jobs", help="runs at a time (one torch thread each)"),
        seeds: str | None = typer.Option(None, "--seeds", help="only these of the spec's seeds, "
                                                               "e.g. 0,1"),
        limit: int | None = typer.Option(None, "--limit", help="run at most N missing cells "
                                                               "this sitting"),
        dry_run: bool = typer.Option(False, "--dry-run", help="list the cells that would run"),
        skip_memory_check: bool = typer.Option(
            False, "--skip-memory-check", help="start runs whatever their memory estimate "
                                               "(passed on to each `crucible run`)"),
    ) -> None:
        """Run the cells of SPEC that have no result file yet, JOBS at a time.

        Cells with a results/NAME/CELL.json are skipped; each finished run's summary is kept there.

        Exit 1 if a run failed (the others still run), 2 for a bad spec or option."""
        if jobs < 1:
            raise fail(f"--jobs must be >= 1, got {jobs}")

        def stop(signum: int, frame: Any) -> None:   # SIGTERM: stop the runs as Ctrl-C does
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        if limit is not None and limit < 1:
            raise fail(f"--limit must be >= 1, got {limit}")
        from crucible.config import ConfigError

        try:
            spec = load_spec(spec_path)
            if not dry_run:
                _check_machine(spec, memory_check=not skip_memory_check)
            command = ((lambda spec, cell: [*run_command(spec, cell), "--skip-memory-check"])
                       if skip_memory_check else None)
            outcome = run_study(spec, jobs=jobs, seeds=_parse_seeds(seeds, spec), limit=limit,
                                dry_run=dry_run, echo=typer.echo, command=command)
        except (StudyError, ConfigError) as exc:
            raise fail(str(exc)) from None
        if outcome.interrupted:
            raise typer.Exit(code=130)
        if outcome.failed:
            raise typer.Exit(code=1)

    @study_app.command("render")
    def render_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec"),
        check: bool = typer.Option(False, "--check", help="exit 1 if the document differs from "
                                                          "what the data render (no writing)"),
        figures: bool = typer.Option(True, "--figures/--no-figures",
                                     help="also render the PNG figures (headless Chromium)"),
    ) -> None:
        """Render the results document and its PNG figures from the committed results.

        --check writes nothing and exits 1 if the document differs (figures are not checked)."""
        try:
            spec = load_spec(spec_path)
            code = render(spec, check=check, figures=figures and not check, echo=typer.echo)
        except FigureError as exc:
            raise fail(str(exc), code=1) from None
        except StudyError as exc:
            raise fail(str(exc)) from None
        if code:
            raise typer.Exit(code=code)

    @study_app.command("adopt")
    def adopt_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec"),
    ) -> None:
        """Copy the runs of the spec's `reuse` specs that have its cells' exact configuration
        into its results (what `study run` does before it runs anything); runs nothing."""
        try:
            spec = load_spec(spec_path)
            _, todo = completed_cells(spec, expand_cells(spec))
            adopted = adopt_results(spec, todo)
        except StudyError as exc:
            raise fail(str(exc)) from None
        typer.echo(f"study {spec.name}: {len(adopted)} cells taken from identical runs"
                   + (f" of {', '.join(sorted(set(adopted.values())))}" if adopted else "")
                   + f" into {spec.shown(spec.results_dir)}/")

    app.add_typer(study_app, name="study")
