"""The scale trend: the same cells at a larger model, against the study's own.

A study spec may list `scale`: other specs that run some of its cells (arm x strategy x p) at a
larger model. For every cell both have, the degradation at each size and the difference larger
minus this study's, with a 95% Welch interval (the two sizes are different models: nothing is
paired), and what it says: the degradation shrinks with size, grows, or the interval cannot
tell. Stdlib only.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from crucible.stats import welch

__all__ = ["scale_rows", "scale_section", "seeds_line"]


def scale_rows(data: Any) -> list[dict[str, Any]]:
    from crucible.config import apply_overrides
    from crucible.presets import get_preset, parameter_count
    from crucible.study.data import StudyData
    from crucible.study.runner import load_results
    from crucible.study.spec import load_spec

    def params(spec: Any) -> int:
        return parameter_count(apply_overrides(get_preset(spec.preset), list(spec.common_overrides())))

    rows = []
    for path in data.spec.files.scale:
        other = load_spec(path)
        big = StudyData(other, load_results(other))
        seeds = seeds_line(other, big.results)
        for key in big.grid():
            if key not in data.keys:
                continue
            small_stat, big_stat = data.stat(key), big.stat(key)
            rows.append({"name": other.name, "key": key, "small": small_stat, "big": big_stat,
                         "params": (params(data.spec), params(other)),
                         "diff": welch(big_stat, small_stat), "seeds": seeds,
                         "set": _changes(data.spec, other)})
    return rows


def _changes(spec: Any, other: Any) -> list[str]:
    """How `other`'s settings differ from `spec`'s: its preset where the two differ, what it
    sets that `spec` does not, and what `spec` sets that it does not (as written in the specs:
    `train.lr=0.002` and `train.lr=2e-3` count as different)."""
    mine, theirs = list(spec.common_overrides()), list(other.common_overrides())
    changes = [] if other.preset == spec.preset else [f"preset {other.preset}"]
    return (changes + [f"`{c}`" for c in theirs if c not in mine]
            + [f"not `{c}`" for c in mine if c not in theirs])


def _ranges(seeds: list[int]) -> str:
    """[0, 1, 2, 3, 5, 6] -> '0-3, 5, 6'."""
    parts: list[tuple[int, int]] = []
    for seed in sorted(seeds):
        if parts and parts[-1][1] == seed - 1:
            parts[-1] = (parts[-1][0], seed)
        else:
            parts.append((seed, seed))
    return ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}"
                     for a, b in parts)


def seeds_line(spec: Any, results: Mapping[str, Any]) -> str:
    """Which of a larger-model spec's seeds are whole, and with which arithmetic each block was
    made. Whole: every cell of the grid, of one arithmetic (one digest, or cells made before the
    probe with a proof of it). A seed with only some cells, or whose cells are not twins (two
    digests, or undigested cells without a proof), is named apart, with what it holds."""
    from crucible.study.blocks import load_proofs, seed_blocks
    from crucible.study.spec import result_cells

    blocks = seed_blocks(spec, results, load_proofs(spec))
    wanted = Counter(cell.seed for cell in result_cells(spec))
    whole: dict[str, list[int]] = {}
    apart: list[str] = []
    for seed, block in sorted(blocks.items()):
        digests = sorted(set(block.digests) | (set(block.proven) if block.undigested else set()))
        kind = ", ".join(f"`{d}`" for d in digests) or "no digest"
        unproven = bool(block.undigested) and bool(block.digests) and not block.proven
        if len(digests) > 1 or unproven:
            apart.append(f"{seed} ({len(block.cells)} of {wanted[seed]} cells, not of "
                         f"one arithmetic: {kind}{', and cells with no digest' if unproven else ''})")
        elif len(block.cells) >= wanted[seed]:
            whole.setdefault(kind, []).append(seed)
        else:
            apart.append(f"{seed} ({len(block.cells)} of {wanted[seed]} cells, {kind})")
    shown = "; ".join(f"{_ranges(seeds)} ({kind})" for kind, seeds in whole.items())
    text = f"`{spec.name}`'s whole seeds: {shown or 'none yet'}"
    if apart:
        text += "; begun, not whole: " + "; ".join(apart)
    return text + "."


def _pct(s: Any) -> str:
    from crucible.study.formatting import _pct as pct

    # a single seed's text already says n=1
    return pct(s) if s.mean is None or s.lo is None else f"{pct(s)} (n={s.n})"


def scale_section(data: Any, labels: Mapping[str, str]) -> list[str]:
    from crucible.study.formatting import _cell_name

    rows = scale_rows(data)
    if not rows:
        return []
    models = "; ".join(f"`{name}`: {big / 1e6:.2f}M parameters" for name, (_, big) in
                       dict.fromkeys((r["name"], r["params"]) for r in rows))
    out = ["## Beyond the blog: does the degradation shrink with size?", "",
           f"The same cells at a larger model ({models}; this study's: "
           f"{rows[0]['params'][0] / 1e6:.2f}M). Degradation against each size's own "
           "baseline, 95% intervals over seeds; the difference larger - this study with a 95% "
           "Welch interval (different models, so nothing is paired). \"Lower\" means the "
           "larger model's degradation is lower (a smaller loss increase, or a larger gain).",
           "",
           "| cell | model | this study | larger model | larger - this (points) | reads as |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        key = r["key"]
        diff = r["diff"]
        if diff is None:
            text, reads = "-", "not run yet" if r["big"].n == 0 else "too few seeds"
        else:
            text = f"{diff[0]:+.2f} [{diff[1]:+.2f}, {diff[2]:+.2f}]"
            reads = ("lower at the larger model" if diff[2] < 0 else
                     "higher at the larger model" if diff[1] > 0 else "not resolved")
        out.append(f"| {_cell_name(key)} | `{r['name']}` | {_pct(r['small'])} | "
                   f"{_pct(r['big'])} | {text} | {reads} |")
    out.append("")
    for line in dict.fromkeys(r["seeds"] for r in rows):
        out += [line, ""]
    for name, changes in dict.fromkeys((r["name"], tuple(r["set"])) for r in rows):
        if changes:
            out += [f"`{name}` differs from this study's settings by {', '.join(changes)}"
                    + (": a difference between the sizes is a difference of all of these, not of "
                       "one alone." if len(changes) > 1 else "."), ""]
    compared = sum(r["diff"] is not None for r in rows)
    if compared > 1:
        out += [f"{compared} comparisons, each with its own 95% interval: were nothing to "
                f"change with size, about {0.05 * compared:.1f} of them would still read "
                "\"higher\" or \"lower\" by chance.", ""]
    return out
