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
            # both estimands over the same seeds: their sds compare like with like
            by_final = _degradations(data, key, "final_val_loss")
            by_tail = _degradations(data, key, "tail_val_loss")
            common = set(by_final) & set(by_tail)
            final = stat_of({s: v for s, v in by_final.items() if s in common})
            tail = stat_of({s: v for s, v in by_tail.items() if s in common})
            ratio = (tail.sd / final.sd if tail.sd is not None and final.sd
                     else None)
            rows.append({"spec": other, "data": data, "key": key, "final": final,
                         "tail": tail, "ratio": ratio})
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
        return (f"Qualifies as a second, labelled estimand: the tail-averaged loss's paired sd "
                f"is {best:.2f}-{worst:.2f} of the final loss's in every arm (at most "
                f"{ADOPT_RATIO:.2f} asked), so an interval of one width would need about "
                f"{1 / worst ** 2:.1f}x fewer seeds. No claim above reads it yet: the blog's "
                "final loss is the estimand of every claim, and the study's runs would need "
                "`train.tail_average` to carry the second. A ratio of sds over this few seeds "
                "is itself uncertain; read it as a size.")
    return (f"Does not qualify: the tail-averaged loss's paired sd is {best:.2f}-{worst:.2f} of "
            f"the final loss's (at most {ADOPT_RATIO:.2f} in every arm was asked); the final loss "
            "stays the study's only estimand. A ratio of sds over this few seeds is itself "
            "uncertain; read it as a size.")


def estimand_section(spec: Any, arm_label: Mapping[str, str]) -> list[str]:
    """The document's "A cheaper estimand" section (nothing when the spec lists no pilot)."""
    if not spec.files.estimand:
        return []
    rows = estimand_rows(spec)
    tails = sorted({(int(run["tail_average"]["steps"]), int(run["global_steps"]))
                    for row in rows for data in [row["data"]]
                    for run in list(data.runs(row["key"]).values())
                    + list(data.baseline(row["key"].arm).values())
                    if isinstance(run.get("tail_average"), dict)})
    span = ("; ".join(f"the last {n} of {g} outer steps" for n, g in tails)
            or "the last outer steps")
    out = ["## A cheaper estimand: the tail-averaged loss (pilot)", "",
           "Beside the final validation loss, each pilot run scored the global weights averaged "
           f"over {span} (`train.tail_average`: ceil(share x global steps) in floating point; "
           "one extra evaluation, training unchanged). Degradation in % of the same-seed "
           "baseline's value of the same estimand, with the 95% interval; sd: the paired sd "
           "over the seeds both estimands have, points.", ""]
    table = [[f"`{r['spec'].name}`", arm_label.get(r["key"].arm, r["key"].arm),
              r["key"].strategy, f"{r['key'].p:g}", str(r["final"].n), _ci(r["final"]),
              _sd(r["final"]), _ci(r["tail"]), _sd(r["tail"]),
              "-" if r["ratio"] is None else f"{r['ratio']:.2f}"] for r in rows]
    from crucible.study.formatting import _table

    out += _table(["pilot", "arm", "strategy", "p", "n", "final loss", "sd", "tail-averaged",
                   "sd", "sd ratio"], table)
    text = verdict(rows)
    short = [(r["final"].n, len(r["spec"].all_seeds)) for r in rows
             if r["final"].n < len(r["spec"].all_seeds)]
    if short and rows and all(r["ratio"] is not None for r in rows):
        have, want = min(short)
        text = f"Provisional ({have} of the pilot's {want} seeds so far): " + text
    out += ["", text, ""]
    return out
