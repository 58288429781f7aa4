"""Liveness and readiness probes (mounted at the root, not under /api/v1)."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from api.schemas import Health, Readiness
from db.migrate import current_revision, head_revision

router = APIRouter(tags=["health"])
_log = logging.getLogger(__name__)


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up (no dependencies checked)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(request: Request) -> JSONResponse:
    """Ready when the database answers and its schema is at the newest migration."""
    head = head_revision()
    try:
        with request.app.state.engine.connect() as conn:
            revision = current_revision(conn)
        reachable = True
    except SQLAlchemyError as exc:
        _log.warning("readiness: database unreachable: %s", exc)
        revision, reachable = None, False
    ready = reachable and revision == head
    body = Readiness(status="ready" if ready else "not_ready", database=reachable,
                     revision=revision, head=head)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)
