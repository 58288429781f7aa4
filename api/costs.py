"""What runs would cost (`crucible cost`): a run's cost records, one per deployment, and a
sweep's decisions by cost computed from its runs' records by `crucible.pricing.cost_sweep` (the
module `crucible cost` and the study document use). Routes call these and never write SQL.
"""
from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.crud import get_run, get_sweep
from api.errors import InvalidInputError, NotFoundError
from db.models import Run, RunCost, utcnow

__all__ = ["put_run_cost", "list_run_costs", "sweep_costs"]

def put_run_cost(session: Session, *, run_id: uuid.UUID, record: dict[str, Any]) -> RunCost:
    """Store (or replace) the run's cost record (api.schemas.RunCostIn, validated) for its
    deployment and commit. Raises NotFoundError."""
    get_run(session, run_id=run_id)
    row = session.scalars(select(RunCost).where(RunCost.run_id == run_id,
                                                RunCost.deployment == record["deployment"])
                          ).one_or_none()
    if row is None:
        row = RunCost(run_id=run_id, deployment=record["deployment"])
        session.add(row)
    row.model, row.pricing, row.currency = record["model"], record["pricing"], record["currency"]
    row.wall_s, row.accelerator_hours = float(record["wall_s"]), float(record["accelerator_hours"])
    row.cost, row.record, row.updated_at = float(record["cost"]), record, utcnow()
    session.commit()
    return row


def list_run_costs(session: Session, *, run_id: uuid.UUID) -> list[RunCost]:
    """The run's cost records, by deployment name. Raises NotFoundError."""
    get_run(session, run_id=run_id)
    return list(session.scalars(select(RunCost).where(RunCost.run_id == run_id)
                                .order_by(RunCost.deployment)))


def sweep_costs(session: Session, *, sweep_id: uuid.UUID,
                deployment: str | None = None) -> dict[str, Any]:
    """The sweep's decisions by cost on one deployment (crucible.pricing.cost_sweep.sweep_costs)
    from its runs' stored records; `deployment` may be left out when they have one only. Raises
    NotFoundError (no sweep, or no run of it priced on that deployment), InvalidInputError."""
    from crucible.grid.key import CellKey
    from crucible.pricing.cost_sweep import CostRow
    from crucible.pricing.cost_sweep import sweep_costs as decide

    get_sweep(session, sweep_id=sweep_id)
    rows = session.execute(select(Run, RunCost).join(RunCost, RunCost.run_id == Run.id)
                           .where(Run.sweep_id == sweep_id)).all()
    names = sorted({cost.deployment for _, cost in rows})
    if deployment is None:
        if len(names) > 1:
            raise InvalidInputError(f"the sweep's runs are priced on {', '.join(names)}: pass "
                                    "deployment=NAME", field="deployment")
        deployment = names[0] if names else None
    if deployment is None or deployment not in names:
        raise NotFoundError("no run of this sweep has a cost record"
                            + (f" for deployment {deployment!r}" if deployment else "")
                            + "; run `crucible cost SWEEP_FOLDER --deployment FILE --api URL`",
                            field="deployment")
    priced = [CostRow(key=CellKey(run.compression, None if run.p == 0 else str(run.strategy),
                                  run.p, run.label),
                      seed=run.seed, name=run.name or str(run.id), cost=cost.record)
              for run, cost in rows if cost.deployment == deployment]
    return {"sweep_id": str(sweep_id), "deployments": names, **decide(priced)}
