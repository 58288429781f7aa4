"""A cheaper estimand, measured: the tail-averaged loss against the blog's final loss.

A study spec may list `estimand`: pilot specs whose runs set `train.tail_average`, so each run
records beside `final_val_loss` the loss of the global weights averaged over its last outer
steps (`tail_val_loss`, one extra evaluation). For each arm and failure cell of a pilot, the
degradation against the same-seed baseline is computed with both estimands (each against the
baseline's own value of it), and their paired sds compared: an estimand whose sd is at most
`ADOPT_RATIO` of the final loss's in every arm needs (1 / ratio)^2 times fewer seeds for the
same interval, and becomes a second, labelled estimand; the final loss stays the primary (the
blog's). Stdlib only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crucible.stats import Stat, stat_of

__all__ = ["ADOPT_RATIO", "estimand_rows", "estimand_section"]

ADOPT_RATIO = 2 / 3


def _degradations(data: Any, key: Any, field: str) -> dict[int, float]:
    base = data.baseline(key.arm)
    out = {}
    for seed, run in data.runs(key).items():
        mine, theirs = run.get(field), (base.get(seed) or {}).get(field)
        if isinstance(mine, int | float) and isinstance(theirs, int | float) and theirs > 0:
            out[seed] = 100.0 * (mine - theirs) / theirs
    return out


def estimand_rows(spec: Any) -> list[dict[str, Any]]:
    """Per pilot spec and failure cell: {spec, key, final: Stat, tail: Stat, ratio}."""
    from crucible.study.data import StudyData
    from crucible.study.runner import load_results
    from crucible.study.spec import load_spec

    rows = []
    for path in spec.files.estimand:
        other = load_spec(path)
        data = StudyData(other, load_results(other))
        for key in data.grid():
            if key.p == 0:
                continue
            final = stat_of(_degradations(data, key, "final_val_loss"))
            tail = stat_of(_degradations(data, key, "tail_val_loss"))
            ratio = (tail.sd / final.sd if tail.sd is not None and final.sd
                     else None)
            rows.append({"spec": other, "key": key, "final": final, "tail": tail,
                         "ratio": ratio})
    return rows


def _ci(s: Stat) -> str:
    if s.mean is None:
        return "not run yet"
    if s.lo is None or s.hi is None:
        return f"{s.mean:+.2f}% (n=1)"
    return f"{s.mean:+.2f}% [{s.lo:+.2f}, {s.hi:+.2f}]"


def _sd(s: Stat) -> str:
    return "-" if s.sd is None else f"{s.sd:.2f}"


def verdict(rows: list[dict[str, Any]]) -> str:
    """The pilot's conclusion in words, from its rows."""
    if not rows or any(r["ratio"] is None for r in rows):
        return ("Not decided yet: every arm needs at least two seeds of both estimands before "
                "their sds can be compared.")
    worst = max(r["ratio"] for r in rows)
    best = min(r["ratio"] for r in rows)
    if worst <= ADOPT_RATIO:
        return (f"Adopted as a second, labelled estimand: the tail-averaged loss's paired sd is "
                f"{best:.2f}-{worst:.2f} of the final loss's in every arm (at most "
                f"{ADOPT_RATIO:.2f} asked), so an interval of one width needs about "
                f"{1 / worst ** 2:.1f}x fewer seeds. The blog's final loss stays the primary "
                "estimand of every claim above.")
    return (f"Not adopted: the tail-averaged loss's paired sd is {best:.2f}-{worst:.2f} of the "
            f"final loss's (at most {ADOPT_RATIO:.2f} in every arm was asked); the final loss "
            "stays the study's only estimand.")


def estimand_section(spec: Any, arm_label: Mapping[str, str]) -> list[str]:
    """The document's "A cheaper estimand" section (nothing when the spec lists no pilot)."""
    if not spec.files.estimand:
        return []
    rows = estimand_rows(spec)
    out = ["## A cheaper estimand: the tail-averaged loss (pilot)", "",
           "Beside the final validation loss, each pilot run scored the global weights averaged "
           "over the last 10% of its outer steps (`train.tail_average`; one extra evaluation, "
           "training unchanged). Degradation in % of the same-seed baseline's value of the same "
           "estimand, with the 95% interval; sd: the paired sd over seeds, points.", ""]
    table = [[f"`{r['spec'].name}`", arm_label.get(r["key"].arm, r["key"].arm),
              r["key"].strategy, f"{r['key'].p:g}", str(r["final"].n), _ci(r["final"]),
              _sd(r["final"]), _ci(r["tail"]), _sd(r["tail"]),
              "-" if r["ratio"] is None else f"{r['ratio']:.2f}"] for r in rows]
    from crucible.study.formatting import _table

    out += _table(["pilot", "arm", "strategy", "p", "n", "final loss", "sd", "tail-averaged",
                   "sd", "sd ratio"], table)
    out += ["", verdict(rows), ""]
    return out
