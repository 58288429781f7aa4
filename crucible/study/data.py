"""A spec with its loaded results (`StudyData`): per-seed paired degradations, cell statistics
and the blog's claims decided on them; and the study's noise floor (`noise_floor`), which the
demo quotes for its one-seed cells.
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from crucible.grid.cells import grid_keys
from crucible.grid.key import CellKey
from crucible.grid.names import COMPLETED
from crucible.grid.spec import SweepSpec
from crucible.stats import Claim, Stat, evaluate_claims, paired_degradations, stat_of
from crucible.study.runner import load_results
from crucible.study.spec import DEFAULT_SPEC, load_spec, result_cells

NOISE_FLOOR_Z = 1.96      # one seed's value lies within ± 1.96 sd of its cell's mean (95%)


def _row(key: CellKey, seed: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """A committed result as the pairing rule's run row, the registry's shape (a result file is
    a completed run; a baseline's strategy None, as the registry stores it)."""
    faults = (summary.get("config") or {}).get("faults") or {}
    return {"id": f"{key.name}-s{seed}", "compression": key.arm,
            "strategy": key.strategy, "p": key.p, "label": key.label, "seed": seed,
            "duration": int(faults.get("duration", 0)), "status": COMPLETED,
            "final_val_loss": summary.get("final_val_loss")}


class StudyData:
    """A spec with its loaded results: per-seed degradations, cell statistics, comparisons."""

    def __init__(self, spec: SweepSpec, results: Mapping[str, dict[str, Any]]) -> None:
        self.spec = spec
        self.results = dict(results)
        self.cells = result_cells(spec)
        self.keys = grid_keys(spec)
        self.by_key: dict[CellKey, dict[int, dict[str, Any]]] = {}
        for cell in self.cells:
            if cell.id in self.results:
                self.by_key.setdefault(cell.key, {})[cell.seed] = self.results[cell.id]

    def runs(self, key: CellKey) -> dict[int, dict[str, Any]]:
        return self.by_key.get(key, {})

    def baseline(self, arm: str) -> dict[int, dict[str, Any]]:
        return self.runs(CellKey.baseline_of(arm))

    def degradation(self, key: CellKey) -> dict[int, float]:
        """Per seed: 100 (L - L0) / L0 against the baseline the one pairing rule gives
        (crucible.stats.pairing: the same arm's same-seed p = 0 run; 0 at p = 0)."""
        base = self.baseline(key.arm)
        if key.is_baseline or key.p == 0.0:
            return {s: 0.0 for s in base}
        rows = ([_row(CellKey.baseline_of(key.arm), s, r) for s, r in base.items()]
                + [_row(key, s, r) for s, r in self.runs(key).items()])
        cells, _ = paired_degradations(rows)
        found = next((v for k, v in cells.items() if k.p == key.p and k.label == key.label), {})
        return {s: value for s, (value, _) in found.items()}

    def claim_cells(self) -> dict[CellKey, dict[int, float]]:
        """Every grid cell (run or not yet) with its per-seed degradations: the input of the
        claims (crucible.stats.claims)."""
        return {k: self.degradation(k) for k in self.grid()}

    def claims(self) -> list[Claim]:
        """The blog's claims (a)-(e) decided on this study's data, with its spec's margins."""
        return evaluate_claims(self.claim_cells(), close_margin=self.spec.close_margin,
                               equivalence_margin=self.spec.equivalence_margin,
                               references=self.spec.reference_values(), only=self.spec.claims)

    def stat(self, key: CellKey) -> Stat:
        return stat_of(self.degradation(key))

    def mean_of(self, key: CellKey, fn: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [v for v in (fn(run) for run in self.runs(key).values()) if v is not None]
        return statistics.fmean(values) if values else None

    def grid(self) -> list[CellKey]:
        return [k for k in self.keys if not k.is_baseline]

    def find(self, arm: str, strategy: str, p: float, label: str = "") -> CellKey | None:
        key = CellKey(arm, strategy, p, label)
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
    except Exception:   # noqa: BLE001 - a sweep must not fail because of the study's data
        return None
