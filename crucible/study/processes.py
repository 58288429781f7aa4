"""The failure-process verdict: does the ordering of the strategies survive other failure
processes than the blog's (crucible.faults: `correlated`, `spot`, `trace`)?

A study spec may list `processes`: other specs whose grid runs the same strategies under
several failure processes, one labelled block per process (the unlabelled cells are the blog's
`independent` process). For each arm and p, per process: every strategy's degradation against
the same-seed baseline and its difference from that process's own skip, paired by seed (the
same failure schedule), with a 95% interval and what it says. Stdlib only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crucible.stats import paired_stat

__all__ = ["process_rows", "processes_section"]


def _process(key: Any) -> str:
    return key.label or "independent"


def _reads(diff: Any, strategy: str) -> str:
    if diff.lo is None or diff.hi is None:
        return "too few seeds"
    if diff.lo > 0:
        return f"{strategy} ends higher than skip"
    if diff.hi < 0:
        return f"{strategy} ends lower than skip"
    return "not resolved"


def process_rows(data: Any) -> list[dict[str, Any]]:
    """One row per (spec, arm, p, process, strategy other than skip) of the listed specs."""
    from crucible.study.data import StudyData
    from crucible.study.runner import load_results
    from crucible.study.spec import load_spec

    rows = []
    for path in data.spec.files.processes:
        other = load_spec(path)
        them = StudyData(other, load_results(other))
        for key in them.grid():
            if key.strategy == "skip" or key.p == 0:
                continue
            ref = them.find(key.arm, "skip", key.p, key.label)
            if ref is None:
                continue
            diff = paired_stat(them.degradation(key), them.degradation(ref))
            rows.append({"spec": other, "key": key, "process": _process(key),
                         "stat": them.stat(key), "skip": them.stat(ref), "diff": diff,
                         "reads": _reads(diff, key.strategy)})
    return rows


def _verdict(rows: list[dict[str, Any]], strategy: str) -> str:
    mine = [r for r in rows if r["key"].strategy == strategy]
    if not mine:
        return ""
    groups: dict[str, list[str]] = {}
    for r in mine:
        groups.setdefault(r["reads"], []).append(r["process"])
    parts = [f"{reads} under {', '.join(dict.fromkeys(names))}"
             for reads, names in groups.items()]
    return f"{strategy.capitalize()} against skip: " + "; ".join(parts) + "."


def processes_section(data: Any, labels: Mapping[str, str]) -> list[str]:
    from crucible.study.formatting import _pct, _pts

    rows = process_rows(data)
    if not rows:
        return []
    names = ", ".join(dict.fromkeys(f"`{r['spec'].shown(r['spec'].path)}`" for r in rows))
    docs = ", ".join(dict.fromkeys(f"`{r['spec'].shown(r['spec'].document)}`" for r in rows))
    out = ["## Beyond the blog: other failure processes", "",
           f"The same strategies under other failure processes than the blog's (from {names}; "
           f"its whole document: {docs}). `independent` is the blog's (each stage-replica fails "
           "on its own); the others are that spec's labelled blocks, their overrides listed "
           "there. Degradation against the same-seed p = 0 baseline; \"minus skip\" is paired "
           "by seed with the same process's skip (the same failure schedule), 95% intervals.",
           ""]
    out += ["| arm | p | process | strategy | seeds | degradation | skip | minus skip (points) "
            "| reads as |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = r["key"]
        out.append(f"| {labels[key.arm]} | {key.p:g} | {r['process']} | {key.strategy} | "
                   f"{r['diff'].n} | {_pct(r['stat'])} | {_pct(r['skip'])} | "
                   f"{_pts(r['diff'])} | {r['reads']} |")
    out.append("")
    for strategy in dict.fromkeys(r["key"].strategy for r in rows):
        out.append(f"- {_verdict(rows, strategy)}")
    out.append("")
    return out
