"""The registry's analysis of a sweep: its runs' analysis view, robustness, claims, Table 1.

Read-only functions over a SQLAlchemy session, keyword-only like `api.crud`, which they build
on (`analysis_rows`: the one view of a run that the numbers and the baseline re-link both read).
The statistics themselves are `crucible.stats`'s; these add the sweep's id and its spec's margins.
Raise `NotFoundError` for a missing sweep.
"""
from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.crud import analysis_rows, get_sweep
from api.errors import InvalidInputError, NotFoundError
from crucible import stats
from db.models import Run, Sweep

__all__ = ["sweep_run_rows", "sweep_robustness", "sweep_claims", "sweep_table"]


def sweep_run_rows(session: Session, *, sweep_id: uuid.UUID) -> list[dict[str, Any]]:
    """The analysis view of a sweep's runs (creation order): id, compression, strategy, p,
    label, duration, seed, status, final_val_loss, initial_val_loss. A run that still owes records
    (`owed_records` > 0) has status "running" here, whatever its own says: it is not a finished
    data point until they arrive. Raises NotFoundError."""
    if session.scalar(select(Sweep.id).where(Sweep.id == sweep_id)) is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist", field="sweep_id")
    return analysis_rows(session, Run.sweep_id == sweep_id)


def sweep_robustness(session: Session, *, sweep_id: uuid.UUID) -> dict[str, Any]:
    """`crucible.stats.robustness` of the sweep's runs, with "sweep_id" added."""
    result = stats.robustness(sweep_run_rows(session, sweep_id=sweep_id))
    return {"sweep_id": sweep_id, **result}


def sweep_claims(session: Session, *, sweep_id: uuid.UUID,
                 duration: int | None = None) -> dict[str, Any]:
    """The blog's claims decided on the sweep's runs (`crucible.stats.sweep_claims`), with the
    margins and the target half-width of its spec (0.5 points each where it sets none).
    Raises InvalidInputError (field `duration`) when the runs span several failure durations
    and none is chosen, or the chosen one has no run."""
    sweep = get_sweep(session, sweep_id=sweep_id)
    spec = sweep.spec or {}

    def number(name: str) -> float:
        value = spec.get(name)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        return float(value) if ok else 0.5

    references, only = _claim_choices(spec)
    try:
        result = stats.sweep_claims(sweep_run_rows(session, sweep_id=sweep_id),
                                    duration=duration, close_margin=number("close_margin"),
                                    equivalence_margin=number("equivalence_margin"),
                                    target_half_width=number("target_half_width"),
                                    references=references, only=only)
    except ValueError as exc:
        raise InvalidInputError(str(exc), field="duration") from None
    return {"sweep_id": sweep_id, **result}


def _claim_choices(spec: dict[str, Any]) -> tuple[stats.References | None, list[str] | None]:
    """The stored spec's `references` and `claims`, each validated by the spec model's own
    field type (crucible.grid.spec.References, Claims); unset: the blog's, all five. A stored
    value the model refuses is a 422 naming it (a sweep registered by hand with a malformed
    spec)."""
    from pydantic import TypeAdapter, ValidationError

    from crucible.grid.spec import Claims, References, reference_values

    def valid(name: str, kind: Any) -> Any:
        value = spec.get(name)
        if value is None:
            return None
        try:
            return TypeAdapter(kind).validate_python(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                            for part in first["loc"])
            raise InvalidInputError(f"the sweep's stored spec.{name}{where}: {first['msg']}; "
                                    "register the sweep again with a valid spec",
                                    field=f"spec.{name}") from None

    refs = valid("references", References)
    only = valid("claims", Claims)
    return (None if refs is None else reference_values(refs),
            None if only is None else list(only))


def sweep_table(session: Session, *, sweep_id: uuid.UUID) -> dict[str, Any]:
    """The Table-1 shape (p rows x arm columns) of the sweep's robustness items."""
    items = sweep_robustness(session, sweep_id=sweep_id)["items"]
    return {"sweep_id": sweep_id, **stats.robustness_table(items)}
