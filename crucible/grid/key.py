"""The one key of a grid cell without its seed: `CellKey` (arm, strategy, p, label, duration).

`strategy=None` is an arm's p = 0 baseline, everywhere in the library: nothing fails at p = 0,
so nothing is mitigated, and the baseline serves every strategy of its arm. The grid
(`crucible.grid.cells.Cell.key`), the pairing rule and the claims (`crucible.stats`), the
study document, the precision rounds of the flows and the cost decisions all use this one key.
The outside world keeps its own spellings, translated at the edge: a registry row or a result
file's run row stores `strategy` None and p = 0 (`CellKey.of_row` reads it); the ids and
result file names (`mapl-base-s0`) and the cost record that REST serves
(crucible.pricing.cost_sweep) spell the baseline `BASELINE_NAME`; and the config a baseline is
run with pins `faults.strategy` to `crucible.grid.names.BASELINE_FAULTS_STRATEGY`, which is no
key at all.

Standard library only: every layer (grid, stats, study, pricing, flows, the API and the
dashboards) imports it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["CellKey", "BASELINE_NAME"]

# how ids (`mapl-base-s0`, a study's result file names) and the cost record (REST) spell the
# p = 0 baseline; the key itself spells it strategy=None
BASELINE_NAME = "base"


class CellKey(NamedTuple):
    """A cell of the grid without its seed. `strategy` None is the arm's p = 0 baseline.

    `duration` (the failure duration) tells the cells of a registry sweep apart, whose runs may
    use several; a spec's grid has one, and its keys leave it None. The robustness table's p = 0
    row of each strategy's curve (crucible.stats.pairing) is keyed by that strategy at p = 0:
    the baseline drawn under the strategy, not a cell of its own."""

    arm: str
    strategy: str | None
    p: float
    label: str = ""
    duration: int | None = None

    @classmethod
    def baseline_of(cls, arm: str) -> CellKey:
        """The arm's p = 0 baseline."""
        return cls(arm, None, 0.0)

    @classmethod
    def of_row(cls, row: Mapping[str, Any], *, duration: int | None = None) -> CellKey:
        """The cell of a run row (a registry run, a result file's row: compression, strategy,
        p, label), with `duration` when given; p = 0 is the arm's baseline, whatever strategy
        the row names."""
        p = float(row["p"])
        return cls(str(row["compression"]), None if p == 0.0 else str(row["strategy"]), p,
                   str(row.get("label") or ""), duration)

    @property
    def is_baseline(self) -> bool:
        return self.strategy is None

    @property
    def name(self) -> str:
        """The key's part of a cell id: `mapl-skip-p0.2-decode_sender`, `mapl-base`."""
        if self.strategy is None:
            return f"{self.arm}-{BASELINE_NAME}"
        return f"{self.arm}-{self.strategy}-p{self.p:g}" + (f"-{self.label}" if self.label else "")
