"""The cells of a sweep's or study's grid: `Cell` (a key, `crucible.grid.key.CellKey`, and a
seed, with the overrides that make its run) and `expand_cells`, the one order in which every
runner takes them (crucible.grid.spec.SweepSpec.cells).

Cells come with stable ids (`mapl-skip-p0.2-decode_sender-s1`: a study's result file names)
and display labels (`mapl/skip/p=0.2/seed=1`: a sweep's run names), in run order: baselines,
then the blog's core cells (skip/drop at p = 0.1 and 0.2), then the rest, seed-major within
each tier, so a grid stopped early holds whole seeds. The p = 0 baseline does not depend on the
mitigation strategy (nothing fails, so nothing is mitigated): it is one cell per (arm, seed),
its key's strategy None; its config's `faults.strategy` is pinned to
`BASELINE_FAULTS_STRATEGY`, so its resolved config, and therefore its fingerprint, is the same
however the spec lists its strategies.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crucible.grid.key import CellKey
from crucible.grid.names import ARMS, BASELINE_FAULTS_STRATEGY, STRATEGIES

if TYPE_CHECKING:
    from crucible.grid.spec import GridBlock, SweepSpec

__all__ = ["Cell", "expand_cells", "grid_keys", "extra_cells"]


@dataclass(frozen=True)
class Cell:
    """One run of a spec: its grid key and seed, the block's overrides, and its run tier
    (0 baselines, 1 the blog's core cells, 2 the rest)."""

    key: CellKey
    seed: int
    sets: tuple[str, ...] = ()          # the block's baseline-neutral overrides
    block: int | None = None            # grid block index; None for a baseline
    tier: int = 0

    @classmethod
    def of(cls, arm: str, strategy: str | None, p: float, seed: int) -> Cell:
        """An unlabelled cell (strategy None: the arm's p = 0 baseline)."""
        if strategy is None or p == 0.0:
            return cls(CellKey.baseline_of(arm), seed)
        key = CellKey(arm, strategy, float(p))
        return cls(key, seed, tier=_tier(key))

    @property
    def arm(self) -> str:
        return self.key.arm

    @property
    def strategy(self) -> str | None:
        """The mitigation strategy; None for a p = 0 baseline (it serves every strategy)."""
        return self.key.strategy

    @property
    def p(self) -> float:
        return self.key.p

    @property
    def is_baseline(self) -> bool:
        return self.key.is_baseline

    @property
    def baseline(self) -> Cell:
        """The p = 0 cell this cell is compared against (itself for a baseline)."""
        return Cell.of(self.arm, None, 0.0, self.seed)

    @property
    def id(self) -> str:
        """The cell's stable id, a study's result file name: `mapl-skip-p0.2-s3`."""
        return f"{self.key.name}-s{self.seed}"

    @property
    def label(self) -> str:
        """The cell's display label, a sweep's run name: `mapl/skip/p=0.2/seed=3`."""
        strategy = "baseline" if self.strategy is None else self.strategy
        variant = f"/{self.key.label}" if self.key.label else ""
        return f"{self.arm}/{strategy}/p={self.p:g}{variant}/seed={self.seed}"

    def overrides(self, spec: SweepSpec) -> list[str]:
        """`key.path=value` settings for this cell: the spec's extras first, the cell's last
        (so a stray `faults.p=` in the extras cannot change which cell this is)."""
        return [*spec.common_overrides(), *self.sets,
                f"pipeline.compression={self.arm}", f"faults.p={self.p!r}",
                f"faults.strategy={self.strategy or BASELINE_FAULTS_STRATEGY}", f"seed={self.seed}"]


def _tier(key: CellKey) -> int:
    from crucible.stats.claims import CLAIM_PS

    if key.is_baseline:
        return 0
    core = key.strategy in ("skip", "drop") and key.p in CLAIM_PS and not key.label
    return 1 if core else 2


def _key_order(key: CellKey) -> tuple[Any, ...]:
    arm = ARMS.index(key.arm) if key.arm in ARMS else len(ARMS)
    strategy = STRATEGIES.index(key.strategy) if key.strategy in STRATEGIES else -1
    return (not key.is_baseline, arm, key.label, strategy, key.p)


def grid_keys(spec: SweepSpec) -> list[CellKey]:
    """Every cell of the spec without seeds, baselines first, in a stable order."""
    return sorted({c.key for c in expand_cells(spec)}, key=_key_order)


def expand_cells(spec: SweepSpec, seeds: Iterable[int] | None = None) -> list[Cell]:
    """The spec's cells in run order: baselines (one per arm and seed), then the blog's core
    cells (skip/drop at p = 0.1 and 0.2) for every seed, then the rest; seed-major within a
    tier so that an interrupted grid has whole seeds. Seeds that only some blocks add (a
    block's `seeds` beyond the spec's) come after all of that, in the same order among
    themselves. p = 0 in a block means the shared baseline. Raises ValueError when two blocks
    give one cell different overrides."""
    wanted = None if seeds is None else set(seeds)
    chosen = tuple(s for s in spec.all_seeds if wanted is None or s in wanted)
    blocks = spec.blocks

    def of(block: GridBlock) -> list[int]:
        return [s for s in (block.seeds or spec.seeds) if s in chosen]

    cells: dict[str, Cell] = {}

    def add(cell: Cell) -> None:
        old = cells.get(cell.id)
        if old is not None and old.sets != cell.sets:
            raise ValueError(f"grid[{cell.block}]: cell {cell.id} is also made by "
                             f"grid[{old.block}] with other overrides; give one block a "
                             "distinct `label`")
        cells.setdefault(cell.id, cell)

    arms = [a for a in ARMS if any(a in b.arms for b in blocks)]
    # an arm's baselines: every seed that one of its blocks runs
    arm_seeds = {a: {s for b in blocks if a in b.arms for s in of(b)} for a in arms}
    for seed in chosen:
        for arm in arms:
            if seed in arm_seeds[arm]:
                add(Cell(CellKey.baseline_of(arm), seed))
    for index, block in enumerate(blocks):
        for arm in block.arms:
            for strategy in block.strategies:
                for p in block.p:
                    if p == 0.0:
                        continue
                    key = CellKey(arm, strategy, p, block.label)
                    for seed in of(block):
                        add(Cell(key, seed, tuple(block.overrides), index, _tier(key)))
    order = {s: i for i, s in enumerate(chosen)}
    # the spec's own seeds first (every cell), then the seeds only some blocks add: a grid
    # stopped early holds whole seeds of the whole grid, not the extra seeds' baselines alone
    extra = {s: int(s not in spec.seeds) for s in chosen}
    return sorted(cells.values(),
                  key=lambda c: (extra[c.seed], c.tier, order[c.seed], _key_order(c.key)))


def extra_cells(spec: SweepSpec, wanted: Iterable[tuple[CellKey, int]],
                runs: Sequence[dict[str, Any]]) -> list[Cell]:
    """The cells a precision round adds (`crucible.stats.seeds_wanted`: cell keys with their
    duration, and how many seeds each wants): for each wide cell as many of the lowest seeds it
    has no run of as it wants added, widest cell first (a labelled cell with its block's
    overrides); and the p = 0 baseline of each new (arm, seed) that has none yet, ahead of
    them."""
    have: dict[CellKey, set[int]] = {}
    bases: set[tuple[str, int]] = set()
    for run in runs:
        key = CellKey.of_row(run)
        if key.is_baseline:
            bases.add((key.arm, int(run["seed"])))
        else:
            have.setdefault(key, set()).add(int(run["seed"]))
    templates = {c.key: c for c in spec.cells() if not c.is_baseline}
    added: list[Cell] = []
    baselines: list[Cell] = []
    for wide, count in wanted:
        key = CellKey(*wide[:4])          # the spec's keys carry no duration
        seeds = have.setdefault(key, set())
        template = templates.get(key)
        seed, new = 0, 0
        while new < count:
            if seed not in seeds:
                seeds.add(seed)
                new += 1
                added.append(Cell.of(key.arm, key.strategy, key.p, seed) if template is None
                             else dataclasses.replace(template, seed=seed))
                if (key.arm, seed) not in bases:
                    bases.add((key.arm, seed))
                    baselines.append(Cell.of(key.arm, None, 0.0, seed))
            seed += 1
    return baselines + added
