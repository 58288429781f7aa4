"""Routers of the registry API, mounted under /api/v1 by `api.app.create_app`.

Every router here refuses query parameters its route does not declare (`KnownQueryDep`): a typo
such as `runs?compresion=mapl` is a 422 naming the parameter and listing the allowed ones, never
a silently unfiltered answer. List routes take `fields=` (`FieldsQuery`, checked by
`selected_fields`) and `tag=` (`TagQuery`).
"""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from pydantic import BaseModel

from api.errors import InvalidInputError
from api.schemas import TAG_PATTERN, field_names

__all__ = ["KnownQueryDep", "reject_unknown_query", "FieldsQuery", "TagQuery", "selected_fields"]

TagQuery = Annotated[str | None, Query(min_length=1, max_length=64, pattern=TAG_PATTERN,
                                       description="Only objects that carry this tag")]


def FieldsQuery(model: type[BaseModel]) -> Any:  # noqa: N802 - reads like a type
    """The `fields=` parameter of a list of `model`: comma-separated top-level field names. The
    published pattern lists them; `selected_fields` checks it with a message naming the culprit
    (a pattern mismatch would not)."""
    names = "|".join(field_names(model))
    return Annotated[str | None, Query(
        max_length=2000, json_schema_extra={"pattern": f"^({names})(,({names}))*$"},
        description=f"Comma-separated fields to return for each item, e.g. id,status (id is "
                    f"always included); one of: {', '.join(field_names(model))}")]


def selected_fields(raw: str | None, model: type[BaseModel]) -> set[str] | None:
    """The fields `raw` (a `fields=` value) names, with id; None when `raw` is None. Raises
    `InvalidInputError` (field `query.fields`) naming an unknown field and the allowed ones."""
    if raw is None:
        return None
    allowed = field_names(model)
    for name in raw.split(","):
        if name not in allowed:
            raise InvalidInputError(f"fields: unknown field {name!r}; allowed (comma-separated): "
                                    f"{', '.join(allowed)}", field="query.fields")
    return {"id", *raw.split(",")}


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
