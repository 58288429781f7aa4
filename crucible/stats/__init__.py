"""Statistics, in one vocabulary for the whole project: intervals over seeds
(`crucible.stats.intervals`), the one baseline-pairing rule and the robustness built on it
(`crucible.stats.pairing`), and the blog's claims decided on paired intervals
(`crucible.stats.claims`). Used by the registry (which stores the pairing on each run), REST,
the dashboards, the Prefect artifacts and the study document.

Stdlib only: no torch, no numpy (the API process and `crucible api` import it; a test checks).
"""
from __future__ import annotations

from collections.abc import Sequence

from crucible.grid.key import CellKey  # the claims' input is keyed by the grid's one cell key
from crucible.stats.claims import (
    AGREES,
    BLOG_DROP,
    BLOG_REFERENCES,
    BLOG_SKIP,
    CLAIM_COLUMNS,
    CLAIM_PS,
    CONTRADICTS,
    DISAGREES,
    LOW_P,
    MISSING,
    NOT_RESOLVED,
    NOT_RUN,
    SUPPORTS,
    TABLE1_ARMS,
    UNRESOLVED,
    Claim,
    Comparison,
    References,
    claim_rows,
    claims_to_dict,
    evaluate_claims,
    growth_slopes,
    skip_minus_drop,
)
from crucible.stats.intervals import (
    LEVEL,
    MAX_SEEDS,
    Stat,
    half_width,
    paired_stat,
    relative_degradation,
    seeds_for_half_width,
    seeds_to_decide,
    slope,
    stat_of,
    summarise,
    t_quantile,
    welch,
)
from crucible.stats.pairing import (
    GroupKey,
    baseline_ids,
    choose_baselines,
    column_name,
    group_key,
    is_baseline,
    paired_degradations,
    robustness,
    robustness_table,
    seeds_wanted,
    usable,
)

__all__ = [
    "AGREES", "BLOG_DROP", "BLOG_REFERENCES", "BLOG_SKIP", "References", "CLAIM_PS", "CONTRADICTS", "DISAGREES", "LOW_P",
    "MISSING", "NOT_RESOLVED", "NOT_RUN", "SUPPORTS", "TABLE1_ARMS", "UNRESOLVED", "Claim",
    "Comparison", "claims_to_dict", "claim_rows", "CLAIM_COLUMNS", "evaluate_claims", "growth_slopes", "skip_minus_drop",
    "LEVEL", "MAX_SEEDS", "Stat", "half_width", "paired_stat", "relative_degradation",
    "seeds_for_half_width", "seeds_to_decide", "slope", "stat_of", "summarise", "t_quantile",
    "welch",
    "CellKey", "GroupKey", "baseline_ids", "choose_baselines", "column_name", "group_key",
    "is_baseline", "paired_degradations", "robustness", "robustness_table", "usable",
    "seeds_wanted",
    "sweep_claims",
]


def sweep_claims(runs: list[dict[str, object]], *, duration: int | None = None,
                 close_margin: float = 0.5, equivalence_margin: float = 0.5,
                 target_half_width: float = 0.5, references: References | None = None,
                 only: Sequence[str] | None = None) -> dict[str, object]:
    """The claims of a sweep's runs (rows as `robustness` takes them), at one failure duration:
    `duration`, or the only one the runs have. Raises ValueError naming the durations when
    there are several and none is chosen, or the chosen one has no run."""
    cells, _ = paired_degradations(runs)
    durations = sorted({k.duration for k in cells if k.duration is not None})
    if duration is None:
        if len(durations) > 1:
            raise ValueError("the sweep's runs have failure durations "
                             f"{', '.join(map(str, durations))}; choose one with duration=")
        duration = durations[0] if durations else None
    elif durations and duration not in durations:
        raise ValueError(f"no run of the sweep has failure duration {duration}; it has "
                         f"{', '.join(map(str, durations))}")
    chosen = {k._replace(duration=None): {s: v for s, (v, _) in by_seed.items()}
              for k, by_seed in cells.items() if k.duration == duration and k.p > 0}
    claims = evaluate_claims(chosen, close_margin=close_margin,
                             equivalence_margin=equivalence_margin, references=references,
                             only=only)
    return {"duration": duration, "close_margin": close_margin,
            "references": "blog" if references is None else "spec",
            "equivalence_margin": equivalence_margin, "target_half_width": target_half_width,
            "claims": claims_to_dict(claims, target_half_width=target_half_width)}
