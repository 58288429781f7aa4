"""A baseline (p = 0) belongs to no strategy: a sweep of only drop_extend and reroute shows those
two strategies everywhere (robustness items, Table 1, figure series and legends, the Prefect table
rows), each paired with the arm's baseline, and never a `skip` its baselines' configs happen to
name."""
from __future__ import annotations

import json

import pytest

from crucible import stats as analysis
from dashboards import accounting, figures, style
from flows.sweep_flow import robustness_rows

_STRATEGIES = {"drop_extend", "reroute"}


def _run(run_id: str, *, p: float, seed: int, loss: float, strategy: str | None,
         arm: str = "ssn") -> dict:
    return {"id": run_id, "compression": arm, "strategy": strategy, "p": p, "duration": 6,
            "seed": seed, "status": "completed", "final_val_loss": loss, "initial_val_loss": 4.0,
            "tokens_budget": 1000, "tokens_processed": 900 if strategy == "drop_extend" and p else 1000}


def _sweep(baseline_strategy: str | None) -> list[dict]:
    """Baselines 2.0 / 2.2 (seeds 0 / 1); drop_extend +10 %, reroute +5 % at p = 0.1."""
    runs = []
    for seed, base in ((0, 2.0), (1, 2.2)):
        runs.append(_run(f"b{seed}", p=0.0, seed=seed, loss=base, strategy=baseline_strategy))
        runs.append(_run(f"x{seed}", p=0.1, seed=seed, loss=base * 1.10, strategy="drop_extend"))
        runs.append(_run(f"r{seed}", p=0.1, seed=seed, loss=base * 1.05, strategy="reroute"))
    return runs


def _legend_names(fig) -> set[str]:
    return {trace.name for trace in fig.data if trace.name}


# the registry stores None; a run dict from an older registry or a local study still says "skip"
@pytest.mark.parametrize("baseline_strategy", [None, "skip"])
def test_baseline_pairs_with_each_strategy_and_adds_none(baseline_strategy) -> None:
    out = analysis.robustness(_sweep(baseline_strategy))
    items = {(i["strategy"], i["p"]): i for i in out["items"]}
    assert set(items) == {(s, p) for s in _STRATEGIES for p in (0.0, 0.1)}
    assert items[("drop_extend", 0.1)]["mean_pct"] == pytest.approx(10.0)
    assert items[("reroute", 0.1)]["mean_pct"] == pytest.approx(5.0)
    for strategy in _STRATEGIES:  # the one baseline per seed starts both curves at 0
        assert items[(strategy, 0.0)]["run_ids"] == ["b0", "b1"]
        assert items[(strategy, 0.0)]["mean_pct"] == 0.0

    table = analysis.robustness_table(out["items"])
    assert table["columns"] == ["ssn/drop_extend", "ssn/reroute"]
    assert not any("skip" in json.dumps(x) for x in (out, table))

    curves = figures.robustness_curves(out)
    assert _legend_names(curves) >= {"SSN · drop_extend", "SSN · reroute"}
    header = list(figures.robustness_table(table).data[0].header.values)
    tokens = accounting.token_accounting(_sweep(baseline_strategy))
    assert _legend_names(tokens) == {"SSN · drop_extend", "SSN · reroute"}
    for fig in (curves, tokens):  # series names, legend groups, hover labels
        for trace in fig.data:
            text = f"{trace.name} {trace.legendgroup} {trace.hovertemplate}"
            assert "skip" not in text, text
    assert header[1:] == ["<b>SSN · drop_extend</b>", "<b>SSN · reroute</b>"]
    # every token curve starts at the baseline's full budget
    for trace in tokens.data:
        assert trace.x[0] == 0.0 and trace.y[0] == 100.0

    rows = robustness_rows(out)   # the Prefect table artifact
    assert {r["strategy"] for r in rows} == _STRATEGIES and all(r["p"] == 0.1 for r in rows)


def test_baselines_alone_make_no_strategy() -> None:
    baselines = [r for r in _sweep(None) if r["p"] == 0]
    assert analysis.robustness(baselines)["items"] == []
    tokens = accounting.token_accounting(baselines)
    assert _legend_names(tokens) == {f"SSN · {style.BASELINE_LABEL}"}
