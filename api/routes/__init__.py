"""Routers of the registry API, mounted under /api/v1 by `api.app.create_app`.

Every router here refuses query parameters its route does not declare (`KnownQueryDep`): a typo
such as `runs?compresion=mapl` is a 422 naming the parameter and listing the allowed ones, never
a silently unfiltered answer.
"""
from __future__ import annotations

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from api.errors import InvalidInputError

__all__ = ["KnownQueryDep", "reject_unknown_query"]


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters `dependant` and its sub-dependencies declare (by alias)."""
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def reject_unknown_query(request: Request) -> None:
    """Raise `InvalidInputError` (422, field `query.<name>`) for the first query parameter the
    matched route does not declare."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    allowed = sorted(_query_names(route.dependant))
    for key in request.query_params:
        if key not in allowed:
            names = ", ".join(allowed) if allowed else "none"
            raise InvalidInputError(f"unknown query parameter '{key}'; allowed: {names}",
                                    field=f"query.{key}")


KnownQueryDep = Depends(reject_unknown_query)
