"""Pydantic request/response shapes of the registry API (a contract shared with the client,
the flows and the dashboards).

Every input has limits: string lengths, integer ranges that fit the database columns, finite
floats, known enum values, bounded JSON documents (no NUL characters or lone surrogates, which
Postgres cannot store, no NaN/inf, bounded depth and size). Unknown fields are refused so typos
surface as 422s naming the field.
"""
from __future__ import annotations

import json
import math
import uuid
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, NotRequired, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from typing_extensions import TypedDict  # pydantic refuses typing.TypedDict before 3.12

from crucible.events import EVENT_KINDS, METRIC_NAMES

__all__ = [
    "MAX_BATCH_ITEMS", "RunStatus", "SweepStatus", "Compression", "Strategy", "MetricName",
    "EventKind", "EVENT_KIND_HELP", "SweepCreate", "SweepUpdate", "SweepPublic", "RunCreate",
    "RunUpdate",
    "RunPublic", "MetricIn", "MetricPublic", "EventIn", "EventPublic", "MetricBatch",
    "EventBatch", "BatchResult", "Page", "RobustnessItem", "MissingBaseline", "RobustnessPublic",
    "TableCell", "TableRow", "TablePublic", "Health", "Readiness",
]

MAX_BATCH_ITEMS = 10_000
MAX_INT = 2**62          # fits BIGINT with headroom
MAX_SMALL = 2**31 - 1    # fits INTEGER
MAX_JSON_BYTES = 1_000_000
MAX_JSON_DEPTH = 32

RunStatus = Literal["pending", "running", "completed", "failed"]
SweepStatus = Literal["pending", "running", "completed", "failed"]
Compression = Literal["none", "ssn", "mapl"]
Strategy = Literal["skip", "drop", "drop_extend", "reroute"]
MetricName = Literal[METRIC_NAMES]  # type: ignore[valid-type]
EventKind = Literal[EVENT_KINDS]  # type: ignore[valid-type]
EVENT_KIND_HELP = ("What happened. Per down stage-replica and global step exactly one of: bypass "
                   "(the stage was skipped), drop (the replica's tokens were dropped), reroute "
                   "(its micro-batches went through detail.donor's stage); also failure_start, "
                   "rejoin, contribution_missing, contribution_rejected.")


def _check_text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 text (no lone surrogates)") from None
    return value


def _walk_json(value: Any, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must not contain NaN or infinite numbers")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise ValueError(f"must not contain integers beyond +-{MAX_INT}")
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


def Text(max_length: int, min_length: int = 0) -> Any:  # noqa: N802 - reads like a type
    """A string type with length limits that Postgres can store."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length),
                     AfterValidator(_check_text)]


JsonObject = Annotated[dict[str, Any], AfterValidator(_check_json)]
Step = Annotated[int, Field(ge=0, le=MAX_INT)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Index = Annotated[int, Field(ge=0, le=MAX_SMALL)]
Loss = Annotated[float, Field(allow_inf_nan=False)]

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
    strategy: str
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
    value: Annotated[float, Field(allow_inf_nan=False)]


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


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    database: bool
    revision: str | None
    head: str | None
