"""The study's "Beyond the blog: what it costs": every committed run priced on the shipped
deployments (infra/deployments/*.toml, crucible.pricing.cost), the cells' time and money, the
time and money to reach the no-failure baseline's final loss, the loss on the baseline's budget
and the cheapest strategy at each p (crucible.pricing.cost_sweep), as the document's lines.

Deterministic: only the committed summaries and the deployment files.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from crucible.grid.key import BASELINE_NAME
from crucible.study.formatting import _table

__all__ = ["DEPLOYMENTS", "DEPLOYMENTS_DIR", "study_costs", "cost_section"]

DEPLOYMENTS_DIR = Path(__file__).resolve().parents[2] / "infra" / "deployments"
# the deployments a study document prices (this-machine.toml has a notional price only)
DEPLOYMENTS = ("cloud-8x4-on-demand", "cloud-8x4-spot", "one-gpu-h100")


def study_costs(data: Any, deployments: Sequence[str] = DEPLOYMENTS) -> list[dict[str, Any]]:
    """Per deployment, the sweep cost record (crucible.pricing.cost_sweep.sweep_costs) of the
    study's committed runs, with the deployment's description."""
    from crucible.pricing.cost import CostError, run_costs
    from crucible.pricing.cost_sweep import CostRow, sweep_costs
    from crucible.pricing.deployment import load_deployment

    loaded = [load_deployment(DEPLOYMENTS_DIR / f"{name}.toml") for name in deployments]
    rows: list[list[Any]] = [[] for _ in loaded]
    unpriced, matched, priced_runs = 0, 0, 0
    for key in data.keys:
        for seed, summary in sorted(data.runs(key).items()):
            try:
                costs = run_costs(summary, loaded)
            except CostError:
                unpriced += 1
                continue
            priced_runs += 1
            matched += costs[0]["replay_matches"] is True
            for i, cost in enumerate(costs):
                rows[i].append(CostRow(key=key, seed=seed, name=f"{key.name}-s{seed}",
                                       cost=cost))
    out = []
    for deployment, priced in zip(loaded, rows, strict=True):
        record = sweep_costs(priced)
        record["description"] = deployment.description
        record["unpriced"] = unpriced
        record["replayed"] = [matched, priced_runs]
        out.append(record)
    return out


def _money(stat: Mapping[str, Any], unit: str) -> str:
    if stat["mean"] is None:
        return "-"
    if stat["lo"] is None:
        return f"{stat['mean']:.2f} {unit}"
    return f"{stat['mean']:.2f} [{stat['lo']:.2f}, {stat['hi']:.2f}] {unit}"


def _loss(stat: Mapping[str, Any]) -> str:
    if stat["mean"] is None:
        return "-"
    if stat["lo"] is None:
        return f"{stat['mean']:.4f}"
    return f"{stat['mean']:.4f} [{stat['lo']:.4f}, {stat['hi']:.4f}]"


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _cell(cell: Mapping[str, Any], labels: Mapping[str, str]) -> list[str]:
    return [labels.get(cell["arm"], cell["arm"]), cell["strategy"], cell["label"] or "-",
            f"{cell['p']:g}"]


def _target(cell: Mapping[str, Any], unit: str) -> str:
    target = cell["target"]
    if cell["strategy"] == BASELINE_NAME:
        return "(the target)"
    if not target["reached"]:
        return f"not reached (0 of {target['of']})"
    return (f"{target['reached']} of {target['of']}: {_hours(target['wall_s']['mean'])}, "
            f"{_money(target['cost'], unit)}")


def cost_section(data: Any, labels: Mapping[str, str],
                 records: Sequence[Mapping[str, Any]] | None = None) -> list[str]:
    """The document's cost section, or nothing when the study has no run yet."""
    records = study_costs(data) if records is None else records
    if not records or not any(r["cells"] for r in records):
        return []
    matched, total = records[0].get("replayed") or (0, 0)
    out = ["## Beyond the blog: what it costs", "",
           "Every committed run priced on the shipped deployments by `crucible cost` "
           "(crucible/pricing/cost.py: each round replayed from the run's fault plan through "
           f"its own strategy, which gives the inner steps and donor loads {matched} of the "
           f"{total} runs recorded; a round takes its slowest "
           "replica's inner steps, boundary transfers and "
           "store traffic; every provisioned accelerator is paid for the whole wall-clock, idle "
           "under drop or not). The deployments' numbers are assumptions stated in their files "
           "(`infra/deployments/`), not measurements; each prices an inner step as the blog's "
           "178M model's (`workload.preset`), so these are the study's rounds and failures at "
           "that model's cost. The model's predictions against measured runs of this machine "
           "are in docs/PERFORMANCE.md, \"Cost model against measured runs\".", "",
           "Target: the same-seed p = 0 run's final loss, reached where the evaluation curve "
           "falls to it; budget: the arm's mean p = 0 money, with the loss each run has when "
           "it is spent. Means over seeds with 95% intervals; money in the deployment's "
           "currency."
           + (f" {records[0]['unpriced']} runs whose summaries lack what the model needs are "
              "left out." if records[0].get("unpriced") else ""), ""]
    for record in records:
        unit = record["currency"]
        out += [f"**{record['deployment']}** ({record['pricing'].replace('_', ' ')}): "
                f"{record['description']}.", ""]
        rows = [[*_cell(c, labels), _hours(c["wall_s"]["mean"]), _money(c["cost"], unit),
                 _loss(c["final_val_loss"]), _target(c, unit), _loss(c["loss_at_budget"])]
                for c in record["cells"]]
        out += _table(["arm", "strategy", "variant", "p", "wall-clock", "money",
                       "final val loss", "to the baseline's loss", "loss on the baseline's "
                       "budget"], rows)
        out.append("")
    out += ["**Cheapest strategy at each p** (least money to the baseline's loss with every "
            "seed there; otherwise, marked *budget*, the lowest loss on the baseline's "
            "budget):", ""]
    header = ["arm", "variant", "p", *[r["deployment"] for r in records]]
    keys = sorted({(c["arm"], c["label"], c["p"]) for r in records for c in r["cheapest"]})
    rows = []
    for arm, label, p in keys:
        row = [labels.get(arm, arm), label or "-", f"{p:g}"]
        for record in records:
            found = next((c for c in record["cheapest"]
                          if (c["arm"], c["label"], c["p"]) == (arm, label, p)), None)
            if found is None or found["strategy"] is None:
                row.append("-")
            elif found["by"] == "target":
                row.append(f"{found['strategy']} ({found['cost']:.2f} {record['currency']})")
            else:
                row.append(f"{found['strategy']} (*budget*: loss {found['loss_at_budget']:.4f})")
        rows.append(row)
    out += _table(header, rows)
    out += ["", *_reading(records), ""]
    return out


def _ratio(cell: Mapping[str, Any], base: Mapping[str, Any], key: str = "cost") -> float:
    return cell[key]["mean"] / base[key]["mean"]


def _reading(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the tables say, in sentences generated from them."""
    out = []
    for record in records:
        base = {c["arm"]: c for c in record["cells"] if c["strategy"] == BASELINE_NAME
                and c["cost"]["mean"]}
        same = [c for c in record["cells"] if c["strategy"] in ("skip", "drop", "reroute")
                and c["arm"] in base]
        if same:
            ratios = [_ratio(c, base[c["arm"]]) for c in same]
            why = ("every round waits for its slowest replica, and dropped or skipped work "
                   "leaves the other replicas' accelerators paid for"
                   if record.get("layout") != "one_device" else
                   "the one device runs only the work that is done, so dropped replicas and "
                   "skipped stages cost nothing")
            out.append(f"- {record['deployment']}: skip, drop and reroute cost "
                       f"{min(ratios):.2f}-{max(ratios):.2f}x their baseline's money ({why}).")
        labelled = [c for c in record["cheapest"] if c["label"] and c["strategy"]]
        if labelled:
            out.append(f"- {record['deployment']}: cheapest "
                       + "; ".join(f"under {c['label']} failures ({labels_of(c)}, p = "
                                   f"{c['p']:g}): {c['strategy']}"
                                   + (" (to the baseline's loss)" if c["by"] == "target" else
                                      " (lowest loss on the baseline's budget)")
                                   for c in labelled) + ".")
        for cell in record["cells"]:
            if cell["strategy"] != "drop_extend" or cell["arm"] not in base:
                continue
            b = base[cell["arm"]]
            steps = cell["global_steps"]["mean"]
            target = cell["target"]
            reached = ("reaches the baseline's loss after "
                       f"{target['cost']['mean'] / b['cost']['mean']:.2f}x its money"
                       if target["reached"] else "never reaches the baseline's loss")
            at = cell["loss_at_budget"]["mean"]
            out.append(f"- {record['deployment']}: drop_extend ({labels_of(cell)}"
                       + (f", {cell['label']}" if cell["label"] else "") + ", p = "
                       f"{cell['p']:g}) runs {steps:.0f} global steps against the baseline's "
                       f"{b['global_steps']['mean']:.0f} and costs {_ratio(cell, b):.2f}x its "
                       f"money; it {reached}"
                       + ("" if at is None else
                          f", and on the baseline's budget its loss is {at:.4f} against "
                          f"{b['final_val_loss']['mean']:.4f}")
                       + ".")
    return out


def labels_of(cell: Mapping[str, Any]) -> str:
    from crucible.grid.names import ARM_LABEL

    return ARM_LABEL.get(cell["arm"], cell["arm"])
