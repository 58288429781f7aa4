"""Pydantic request/response shapes of the registry API (a contract shared with the client,
the flows and the dashboards).

Every input has limits: string lengths, integer ranges that fit the database columns, finite
floats, known enum values, bounded JSON documents (no NUL characters or lone surrogates, which
Postgres cannot store, no NaN/inf, numbers within a double's range, bounded depth and size).
Unknown fields are refused so typos surface as 422s naming the field.

Numbers are strict, as JSON Schema reads the published types: an `integer` field takes a JSON
integer or a whole number written as a float (`3.0`), a `number` field takes any JSON number;
strings ("1.5") and booleans are refused. Error bodies have one shape, `ErrorResponse`, for every
4xx/5xx the API sends.
"""
from __future__ import annotations

import json
import math
import sys
import uuid
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, NotRequired, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    GetPydanticSchema,
    Strict,
    TypeAdapter,
    WithJsonSchema,
)
from pydantic_core import core_schema
from typing_extensions import (  # pydantic refuses typing.TypedDict before 3.12
    TypeAliasType,
    TypedDict,
)

from crucible.events import EVENT_KINDS, METRIC_NAMES

__all__ = [
    "MAX_BATCH_ITEMS", "RunStatus", "SweepStatus", "Compression", "Strategy", "MetricName",
    "EventKind", "EVENT_KIND_HELP", "SweepCreate", "SweepUpdate", "SweepPublic", "RunCreate",
    "RunUpdate",
    "RunPublic", "MetricIn", "MetricPublic", "EventIn", "EventPublic", "MetricBatch",
    "EventBatch", "BatchResult", "Page", "RobustnessItem", "MissingBaseline", "RobustnessPublic",
    "TableCell", "TableRow", "TablePublic", "Health", "Readiness", "ErrorItem", "ErrorResponse",
]

MAX_BATCH_ITEMS = 10_000
# Steps and counts stay exact in every JSON parser (JavaScript's Number.MAX_SAFE_INTEGER), so a
# schema validator that compares numbers as doubles agrees with the server on every bound.
MAX_INT = 2**53 - 1
MAX_SMALL = 2**31 - 1    # fits INTEGER
MAX_JSON_BYTES = 1_000_000
MAX_JSON_DEPTH = 32
MAX_JSON_NUMBER = sys.float_info.max  # numbers in documents must be finite as doubles

# queued: waiting for a GPU slot; cancelled: stopped by the operator (final, like failed)
RunStatus = Literal["pending", "queued", "running", "completed", "failed", "cancelled"]
SweepStatus = Literal["pending", "running", "completed", "failed", "cancelled"]
Compression = Literal["none", "ssn", "mapl"]
Strategy = Literal["skip", "drop", "drop_extend", "reroute"]
MetricName = Literal[METRIC_NAMES]  # type: ignore[valid-type]
EventKind = Literal[EVENT_KINDS]  # type: ignore[valid-type]
EVENT_KIND_HELP = ("What happened. Per down stage-replica and global step exactly one of: bypass "
                   "(the stage was skipped), drop (the replica's tokens were dropped), reroute "
                   "(its micro-batches went through detail.donor's stage); also failure_start, "
                   "rejoin, contribution_missing, contribution_rejected, manifest_rejected "
                   "(a round's manifest failed validation), checkpoint_rejected (a damaged "
                   "checkpoint was skipped on resume).")


def _check_text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 text (no lone surrogates)") from None
    return value


def _overflows(number: int) -> bool:
    """True when an integer rounds to no finite double (as JSON Schema validators compare)."""
    try:
        float(number)
    except OverflowError:
        return True
    return False


def _walk_json(value: Any, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must not contain NaN or infinite numbers")
    elif isinstance(value, int) and not isinstance(value, bool) and _overflows(value):
        raise ValueError(f"must not contain numbers beyond +-{MAX_JSON_NUMBER:.17g}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _walk_json(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _walk_json(item, depth + 1)


def _check_json(value: dict[str, Any]) -> dict[str, Any]:
    _walk_json(value, 0)
    if len(json.dumps(value)) > MAX_JSON_BYTES:
        raise ValueError(f"is larger than {MAX_JSON_BYTES} bytes of JSON")
    return value


# Strings Postgres can store, as the published schema says it (the check itself is
# `_check_text`, whose message is clearer than a pattern mismatch)
_NO_NUL = {"pattern": "^[^\\x00]*$"}


def Text(max_length: int, min_length: int = 0) -> Any:  # noqa: N802 - reads like a type
    """A string type with length limits that Postgres can store."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length,
                                json_schema_extra=_NO_NUL),
                     AfterValidator(_check_text)]


class _SchemaExtra:
    """Adds JSON Schema keywords pydantic cannot derive (e.g. `propertyNames`) to a type's schema;
    validation is unchanged."""

    def __init__(self, **keywords: Any) -> None:
        self.keywords = keywords

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {**handler(schema), **self.keywords}


# What `_walk_json` accepts, as the published schema states it (the depth and size limits cannot
# be stated in JSON Schema; they are in the descriptions). Schema only: documents are validated
# by `_check_json`, whose messages name the problem.
JsonValue = TypeAliasType("JsonValue", Annotated[  # type: ignore[misc]
    Annotated[str, _SchemaExtra(**_NO_NUL)]
    | Annotated[float, _SchemaExtra(minimum=-MAX_JSON_NUMBER, maximum=MAX_JSON_NUMBER)]
    | bool | None | list["JsonValue"]
    | Annotated[dict[str, "JsonValue"], _SchemaExtra(propertyNames=_NO_NUL)],
    _SchemaExtra(description=f"Any JSON value: strings without NUL characters, numbers finite as "
                             f"doubles, nested at most {MAX_JSON_DEPTH} levels.")])
_JSON_OBJECT_SCHEMA = TypeAdapter(Annotated[dict[str, JsonValue], _SchemaExtra(
    propertyNames=_NO_NUL,
    description=f"A JSON object of at most {MAX_JSON_BYTES:,} bytes as JSON text.")]).core_schema


class _JsonObjectSchema:
    def __get_pydantic_json_schema__(self, _schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return handler(_JSON_OBJECT_SCHEMA)


JsonObject = Annotated[dict[str, Any], AfterValidator(_check_json), _JsonObjectSchema()]


def _json_int(*, ge: int, le: int) -> Any:
    """An integer as JSON Schema reads `type: integer`: a JSON integer or a whole float (`3.0`);
    strings and booleans are refused. Built from pydantic-core validators (no Python call per
    value: batches of 10,000 metrics validate as fast as with plain `int`)."""
    def build(_source: Any, _handler: Any) -> core_schema.CoreSchema:
        number = core_schema.union_schema(
            [core_schema.int_schema(strict=True),
             core_schema.float_schema(strict=True, allow_inf_nan=False)],
            custom_error_type="int_type")
        return core_schema.chain_schema([number, core_schema.int_schema(ge=ge, le=le)])

    return Annotated[int, GetPydanticSchema(build),
                     WithJsonSchema({"type": "integer", "minimum": ge, "maximum": le})]


Step = _json_int(ge=0, le=MAX_INT)
Count = _json_int(ge=0, le=MAX_INT)
Index = _json_int(ge=0, le=MAX_SMALL)
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # strict: ints yes, "1.5"/true no
Loss = Number

_IN = ConfigDict(extra="forbid", allow_inf_nan=False)
_OUT = ConfigDict(from_attributes=True)

T = TypeVar("T")


class SweepCreate(BaseModel):
    model_config = _IN
    name: Text(200, 1)  # type: ignore[valid-type]
    spec: JsonObject | None = None


class SweepUpdate(BaseModel):
    model_config = _IN
    status: SweepStatus | None = None
    prefect_flow_run_id: Text(64) | None = None  # type: ignore[valid-type]


class SweepPublic(BaseModel):
    model_config = _OUT
    id: uuid.UUID
    name: str
    spec: dict[str, Any] | None
    status: SweepStatus
    prefect_flow_run_id: str | None
    created_at: datetime
    updated_at: datetime


class RunCreate(BaseModel):
    model_config = _IN
    sweep_id: uuid.UUID | None = None
    name: Text(200) | None = None  # type: ignore[valid-type]
    config: JsonObject = Field(description="crucible.config.Config.to_dict(); partial configs "
                                           "are completed with defaults and validated")
    config_hash: Text(128) | None = None  # type: ignore[valid-type]
    code_version: Text(128) | None = None  # type: ignore[valid-type]


class RunUpdate(BaseModel):
    model_config = _IN
    status: RunStatus | None = None
    status_reason: Text(4000) | None = None  # type: ignore[valid-type]
    initial_val_loss: Loss | None = None
    final_val_loss: Loss | None = None
    tokens_budget: Count | None = None
    tokens_processed: Count | None = None
    owed_records: Count | None = Field(None, description="metrics and events the run's reporter "
                                       "still holds in its spool; 0 once all have arrived")
    summary: JsonObject | None = None
    prefect_flow_run_id: Text(64) | None = None  # type: ignore[valid-type]


class RunPublic(BaseModel):
    model_config = _OUT
    id: uuid.UUID
    sweep_id: uuid.UUID | None
    name: str | None
    config: dict[str, Any]
    config_hash: str | None
    code_version: str | None
    compression: str
    strategy: str | None = Field(description="the mitigation strategy; null for a p = 0 baseline, "
                                             "which serves every strategy of its arm")
    p: float
    duration: int
    seed: int
    preset: str
    status: RunStatus
    status_reason: str | None
    baseline_run_id: uuid.UUID | None
    initial_val_loss: float | None
    final_val_loss: float | None
    tokens_budget: int | None
    tokens_processed: int | None
    owed_records: int | None
    summary: dict[str, Any] | None
    prefect_flow_run_id: str | None
    created_at: datetime
    updated_at: datetime


# A TypedDict, not a model: a batch holds up to 10,000 metric points, and plain dicts of numbers
# and strings validate 3x faster than model instances and are not tracked by Python's cyclic
# garbage collector, whose full collections cost the server ~60 ms on every other 10,000-item
# request when each item was a model. Same JSON schema, defaults and 422 messages as the model it
# replaced (only an item that is not an object now reads "Input should be a valid dictionary");
# no docstring, it would become the schema's description. Validated items are dicts with all
# five keys (tokens and replica default to None).
class MetricIn(TypedDict):
    __pydantic_config__ = _IN  # type: ignore[misc]
    name: MetricName
    global_step: Step
    tokens: NotRequired[Annotated[Count | None, Field(default=None)]]
    replica: NotRequired[Annotated[Index | None, Field(default=None)]]
    value: Number


class MetricPublic(BaseModel):
    model_config = _OUT
    name: str
    global_step: int
    tokens: int | None
    replica: int | None
    value: float


class EventIn(BaseModel):
    model_config = _IN
    id: Text(200, 1)  # type: ignore[valid-type]
    kind: EventKind = Field(description=EVENT_KIND_HELP)
    global_step: Step
    replica: Index | None = None
    stage: Index | None = None
    detail: JsonObject | None = None


class EventPublic(BaseModel):
    id: str
    kind: str = Field(description=EVENT_KIND_HELP)
    global_step: int
    replica: int | None
    stage: int | None
    detail: dict[str, Any] | None


class MetricBatch(BaseModel):
    model_config = _IN
    items: list[MetricIn] = Field(max_length=MAX_BATCH_ITEMS)


class EventBatch(BaseModel):
    model_config = _IN
    items: list[EventIn] = Field(max_length=MAX_BATCH_ITEMS)


class BatchResult(BaseModel):
    received: int = Field(description="items in the request")
    inserted: int = Field(description="items newly stored; the rest were already there")


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; "
                                                "null on the last page")


class RobustnessItem(BaseModel):
    compression: str
    strategy: str
    duration: int
    p: float
    mean_pct: float
    ci_low_pct: float | None = Field(description="null with a single seed")
    ci_high_pct: float | None
    n_seeds: int
    seeds: list[int]
    run_ids: list[str]


class MissingBaseline(BaseModel):
    compression: str
    seed: int
    duration: int


class RobustnessPublic(BaseModel):
    sweep_id: uuid.UUID
    items: list[RobustnessItem]
    missing_baselines: list[MissingBaseline]
    pending_runs: int
    failed_runs: int


class TableCell(BaseModel):
    mean_pct: float
    ci_low_pct: float | None
    ci_high_pct: float | None
    n_seeds: int


class TableRow(BaseModel):
    p: float
    cells: dict[str, TableCell | None]


class TablePublic(BaseModel):
    sweep_id: uuid.UUID
    columns: list[str]
    rows: list[TableRow]


class ErrorItem(BaseModel):
    field: str | None = Field(description="where the problem is, e.g. body.items.3.value; null "
                                          "when it concerns the whole request")
    message: str
    type: str = Field(description="a machine-readable kind, e.g. missing, too_large, "
                                  "NotFoundError")


class ErrorResponse(BaseModel):
    """The body of every error response (4xx and 5xx)."""

    detail: str = Field(description="what was wrong, and how to fix it, in one line")
    errors: list[ErrorItem]


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    database: bool
    revision: str | None
    head: str | None
