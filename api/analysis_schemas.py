"""Pydantic response shapes of the registry's sweep analysis: robustness, claims, Table 1.

The bodies of GET /sweeps/{ref}/robustness (`RobustnessPublic`), /claims (`ClaimsPublic`) and
/table (`TablePublic`), what `api.analysis` returns validated; a contract shared with the client,
the flows and the dashboards like `api.schemas`, which holds every other request and response
shape.
"""
from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["RobustnessItem", "MissingBaseline", "RobustnessPublic", "ClaimComparison",
           "ClaimOut", "ClaimsPublic", "TableCell", "TableRow", "TablePublic"]


class RobustnessItem(BaseModel):
    compression: str
    strategy: str
    label: str = Field(description="the study block of the cell ('' for unlabelled cells; the "
                                   "blog's claims read only those)")
    duration: int
    p: float
    mean_pct: float
    ci_low_pct: float | None = Field(description="null with a single seed")
    ci_high_pct: float | None
    n_seeds: int
    seeds: list[int]
    run_ids: list[str]


class MissingBaseline(BaseModel):
    compression: str
    seed: int
    duration: int


class RobustnessPublic(BaseModel):
    sweep_id: uuid.UUID
    items: list[RobustnessItem]
    missing_baselines: list[MissingBaseline]
    pending_runs: int
    failed_runs: int


class ClaimComparison(BaseModel):
    label: str = Field(description="what is compared, e.g. \"SSN - MAPL, p = 0.1\"")
    status: Literal["supports", "contradicts", "unresolved", "missing"]
    mean: float | None = Field(description="points (percent of the baseline's loss); null "
                                           "before any seed")
    sd: float | None = Field(description="sd over seeds; null below 2 seeds")
    ci_low: float | None = Field(description="95% Student-t interval over seeds; null below 2")
    ci_high: float | None
    half_width: float | None
    n_seeds: int
    seeds: list[int]
    margin: float | None = Field(description="band rules: the band's half-width; sign rules: "
                                             "null")
    reference: float | None = Field(description="the blog's value of the same quantity, where "
                                                "it gives one")
    within_target: bool | None = Field(description="half_width <= the target half-width")
    seeds_for_target: int | None = Field(description="seeds its measured sd says a "
                                                     "±target interval needs")
    seeds_to_decide: int | None = Field(description="unresolved comparisons: seeds after which "
                                                    "the interval decides, if the mean and sd "
                                                    "stay as measured")


class ClaimOut(BaseModel):
    tag: str
    title: str
    blog: str = Field(description="what the blog reports")
    quantity: str
    rule: str = Field(description="how the verdict follows from the intervals")
    verdict: Literal["agrees", "disagrees", "not resolved", "not run yet"]
    counts: dict[str, int]
    seeds_to_decide: int | None = Field(description="seeds that would decide every unresolved "
                                                    "comparison; null when none is unresolved")
    comparisons_beyond_max_seeds: int | None
    max_seeds: int
    comparisons: list[ClaimComparison]


class ClaimsPublic(BaseModel):
    sweep_id: uuid.UUID
    duration: int | None = Field(description="the failure duration the claims are decided at")
    close_margin: float
    equivalence_margin: float
    target_half_width: float
    references: Literal["blog", "spec"] = Field(
        description="where the comparisons' reference values come from: the blog's Table 1, "
                    "or the sweep spec's own `references`")
    claims: list[ClaimOut]


class TableCell(BaseModel):
    mean_pct: float
    ci_low_pct: float | None
    ci_high_pct: float | None
    n_seeds: int


class TableRow(BaseModel):
    p: float
    cells: dict[str, TableCell | None]


class TablePublic(BaseModel):
    sweep_id: uuid.UUID
    columns: list[str]
    rows: list[TableRow]
