"""The study's spec and its cells: `load_spec` reads and validates a study spec (TOML; the
format is in crucible.study's docstring), `expand_cells` turns it into cells with stable ids in
run order, and `result_path` / `completed_cells` say where a cell's result file lies and which
are there.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crucible.names import ARMS, BASELINE_STRATEGY, STRATEGIES
from crucible.stats import CLAIM_PS

GRID_KEYS = ("seed", "pipeline.compression", "faults.p", "faults.strategy")
# settings that change nothing when no stage fails: a block may vary them and still be compared
# with the arm's shared p = 0 baseline
BASELINE_NEUTRAL_KEYS = ("pipeline.bypass_decode",)
DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "studies" / "table1.toml"

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
