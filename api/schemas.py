"""Pydantic request/response shapes of the registry API (a contract shared with the client,
the flows and the dashboards).

Every input has limits: string lengths, integer ranges that fit the database columns, finite
floats, known enum values, bounded JSON documents (no NUL characters or lone surrogates, which
Postgres cannot store, no NaN/inf, numbers within a double's range, bounded depth and size).
Unknown fields are refused so typos surface as 422s naming the field.

Tags (`Tags`) are 1-64 characters from `A-Za-z0-9._:/+=-`, at most 32 per object, de-duplicated
and sorted on the way in; notes are free text up to 10,000 characters. A PATCH gives either `tags`
(replaces the list) or `add_tags`/`remove_tags` (applied by the server in one transaction), never
both. `RunFields`/`SweepFields` are the items of a list asked for with `?fields=`: only the named
fields (see `field_names`), so their schemas require none.

Numbers are strict, as JSON Schema reads the published types: an `integer` field takes a JSON
integer or a whole number written as a float (`3.0`), a `number` field takes any JSON number;
strings ("1.5") and booleans are refused. Error bodies have one shape, `ErrorResponse`, for every
4xx/5xx the API sends. The sweep analysis responses (robustness, claims, Table 1) are
`api.analysis_schemas`'s.
"""
from __future__ import annotations

import json
import math
import re
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
    create_model,
    model_validator,
)
from pydantic_core import core_schema
from typing_extensions import (  # pydantic refuses typing.TypedDict before 3.12
    TypeAliasType,
    TypedDict,
)

from crucible.events import EVENT_KINDS, METRIC_NAMES
from crucible.grid.names import Compression, RunStatus, Strategy, SweepStatus  # noqa: F401
from crucible.grid.spec import ANNOTATIONS
from crucible.grid.tags import MAX_NOTES, MAX_TAGS, TAG_PATTERN

__all__ = [
    "MAX_BATCH_ITEMS", "RunStatus", "SweepStatus", "Compression", "Strategy", "MetricName",
    "EventKind", "EVENT_KIND_HELP", "SweepCreate", "SweepUpdate", "SweepPublic", "RunCreate",
    "RunUpdate",
    "RunPublic", "MetricIn", "MetricPublic", "EventIn", "EventPublic", "MetricBatch",
    "EventBatch", "BatchResult", "Page", "Health", "Readiness", "ErrorItem", "ErrorResponse",
    "check_text", "TAG_PATTERN", "MAX_TAGS", "MAX_NOTES", "Tags", "RunFields", "SweepFields",
    "field_names", "RunCostIn", "RunCostPublic", "CostPoint",
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
MetricName = Literal[METRIC_NAMES]  # type: ignore[valid-type]
EventKind = Literal[EVENT_KINDS]  # type: ignore[valid-type]
EVENT_KIND_HELP = ("What happened. Per down stage-replica and global step exactly one of: bypass "
                   "(the stage was skipped), drop (the replica's tokens were dropped), reroute "
                   "(its micro-batches went through detail.donor's stage); also failure_start, "
                   "rejoin, contribution_missing, contribution_rejected, manifest_rejected "
                   "(a round's manifest failed validation), checkpoint_rejected (a damaged "
                   "checkpoint was skipped on resume); in the distributed mode, real process "
                   "faults: process_killed, process_restarted and process_rejoined (detail: "
                   "wall-clock seconds after the kill; process_killed's detail.planned is false "
                   "for a death nobody planned), and process_lost (a replica that never came "
                   "back; detail: reason, lives).")


def check_text(value: str) -> str:
    """`value` if Postgres can store it (no NUL, no lone surrogates); raises ValueError."""
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
        check_text(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must not contain NaN or infinite numbers")
    elif isinstance(value, int) and not isinstance(value, bool) and _overflows(value):
        raise ValueError(f"must not contain numbers beyond +-{MAX_JSON_NUMBER:.17g}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key)
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
# `check_text`, whose message is clearer than a pattern mismatch)
_NO_NUL = {"pattern": "^[^\\x00]*$"}


def Text(max_length: int, min_length: int = 0) -> Any:  # noqa: N802 - reads like a type
    """A string type with length limits that Postgres can store."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length,
                                json_schema_extra=_NO_NUL),
                     AfterValidator(check_text)]


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

_TAG = re.compile(TAG_PATTERN)  # the rule of crucible.grid.tags, which the CLI and sweep form check


def _check_tag(tag: str) -> str:
    if not _TAG.fullmatch(tag):
        raise ValueError(f"{tag[:80]!r} is not a tag: use 1-64 characters from A-Za-z0-9._:/+=- "
                         "(no spaces)")
    return tag


def _sorted_unique(tags: list[str]) -> list[str]:
    return sorted(set(tags))


# checked by `_check_tag` (its message names the rule); the schema states the same rule
Tag = Annotated[str, AfterValidator(_check_tag),
                _SchemaExtra(minLength=1, maxLength=64, pattern=TAG_PATTERN)]
Tags = Annotated[list[Tag], Field(max_length=MAX_TAGS, description=(
    f"at most {MAX_TAGS} tags of 1-64 characters from A-Za-z0-9._:/+=- (stored de-duplicated "
    "and sorted)")), AfterValidator(_sorted_unique)]
Notes = Text(MAX_NOTES)

_IN = ConfigDict(extra="forbid", allow_inf_nan=False)
_OUT = ConfigDict(from_attributes=True)

T = TypeVar("T")


# A PATCH replaces the tags or edits them, not both; stated in the schema too, so generated
# clients and fuzzers know it (values do not matter: giving both keys is the mistake).
_TAGS_ONE_WAY = "give either tags (replaces the list) or add_tags/remove_tags, not both"
_TAG_EDITS = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={
    "not": {"anyOf": [{"required": ["tags", "add_tags"]},
                      {"required": ["tags", "remove_tags"]}]}})


class _TagEdits(BaseModel):
    """`tags` replaces the list; `add_tags` / `remove_tags` edit it atomically (removals first,
    so a tag in both lists is kept); null leaves it as is. `notes`: null clears them."""

    model_config = _TAG_EDITS
    tags: Tags | None = None
    add_tags: Tags | None = None
    remove_tags: Tags | None = None
    notes: Notes | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _tags_one_way(self) -> _TagEdits:
        if "tags" in self.model_fields_set and self.model_fields_set & {"add_tags", "remove_tags"}:
            raise ValueError(_TAGS_ONE_WAY)
        return self


class SweepCreate(BaseModel):
    model_config = _IN
    name: Text(200, 1)  # type: ignore[valid-type]
    spec: JsonObject | None = None
    tags: Tags = Field(default_factory=list)
    notes: Notes | None = None  # type: ignore[valid-type]


# the keys of a stored spec that annotate it without changing what it runs, each any JSON
# value: the schema names them, so a key that would make it another sweep is a 422 by schema
SpecAnnotations = create_model(
    "SpecAnnotations", __config__=_IN,
    **{key: (JsonValue | None, Field(None)) for key in ANNOTATIONS})


class SweepUpdate(_TagEdits):
    status: SweepStatus | None = None
    prefect_flow_run_id: Text(64) | None = None  # type: ignore[valid-type]
    spec_annotations: SpecAnnotations | None = Field(  # type: ignore[valid-type]
        None, description="keys of the stored spec that annotate it without changing what it "
                          "runs (crucible.grid.spec.ANNOTATIONS: margins, target_half_width, "
                          "references, claims, title, ...), merged into the stored spec; any "
                          "other key is refused (a spec that runs other cells is another sweep)")


class SweepPublic(BaseModel):
    model_config = _OUT
    id: uuid.UUID
    name: str
    spec: dict[str, Any] | None
    status: SweepStatus
    prefect_flow_run_id: str | None
    tags: list[str]
    notes: str | None
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
    tags: Tags = Field(default_factory=list)
    notes: Notes | None = None  # type: ignore[valid-type]
    label: str = Field("", max_length=64, pattern=r"^([a-z0-9][a-z0-9_]*)?$",
                       description="the study block the run belongs to (crucible.grid.spec."
                                   "GridBlock.label: a block with baseline-neutral overrides); '' "
                                   "for an unlabelled cell; refused on a p = 0 baseline")


class RunUpdate(_TagEdits):
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
    label: str = Field(description="the study block the run belongs to; '' outside labelled "
                                   "blocks")
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
    summary: dict[str, Any] | None = Field(
        description="the run's summary.json; its `config` key is left out when it equals the "
                    "run's `config` (one copy per run)")
    prefect_flow_run_id: str | None
    tags: list[str]
    notes: str | None
    created_at: datetime
    updated_at: datetime

    @model_validator(mode="after")
    def _config_once(self) -> RunPublic:
        if self.summary and "config" in self.summary and self.summary["config"] == self.config:
            self.summary = {k: v for k, v in self.summary.items() if k != "config"}
        return self


def field_names(model: type[BaseModel]) -> tuple[str, ...]:
    """The top-level fields of a public model, in order: what `?fields=` may name."""
    return tuple(model.model_fields)


def _selection(model: type[BaseModel], name: str) -> Any:
    """A TypedDict of `model`'s fields, none required: an item listed with `?fields=`."""
    fields = {key: NotRequired[Annotated[info.annotation, Field(description=info.description)]]
              for key, info in model.model_fields.items()}
    selection = TypedDict(name, fields)  # type: ignore[operator]
    selection.__doc__ = (f"A {model.__name__} with only the fields named in ?fields= (id is "
                         f"always included).")
    return selection


RunFields = _selection(RunPublic, "RunFields")
SweepFields = _selection(SweepPublic, "SweepFields")


# A TypedDict, not a model: a batch holds up to 10,000 metric points, and plain dicts of numbers
# and strings validate 3x faster than model instances and are not tracked by Python's cyclic
# garbage collector, whose full collections cost the server ~60 ms on every other 10,000-item
# request when each item was a model. Same JSON schema, defaults and 422 messages as the model it
# replaced (only an item that is not an object now reads "Input should be a valid dictionary");
# no docstring, it would become the schema's description. Validated items are dicts with all
# five keys (tokens and replica default to None).
Money = Annotated[float, Strict(), Field(ge=0, le=MAX_JSON_NUMBER, allow_inf_nan=False)]


class CostPoint(BaseModel):
    model_config = _IN
    global_step: Step
    val_loss: Loss
    wall_s: Money
    cost: Money
    accelerator_hours: Money | None = None


class RunCostIn(BaseModel):
    """A run's cost record on one deployment, as `crucible cost` writes it (cost.json,
    crucible.pricing.cost.run_cost): the headline fields below are checked, the rest of the record
    (breakdown_s, money, stage_step_s, ...) is kept as sent."""
    # the extra fields' names, as every key in a stored document: no NUL (Postgres)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False,
                              json_schema_extra={"propertyNames": _NO_NUL})
    __pydantic_extra__: dict[str, JsonValue] = Field(init=False)  # type: ignore[assignment]
    deployment: Text(200, 1)  # type: ignore[valid-type]
    model: Text(64, 1) = Field(description="the cost model's version "  # type: ignore[valid-type]
                                           "(crucible.pricing.cost.COST_MODEL)")
    pricing: Literal["on_demand", "spot"]
    currency: Text(16, 1)  # type: ignore[valid-type]
    wall_s: Money
    accelerator_hours: Money
    cost: Money
    final_val_loss: Loss | None = None
    curve: list[CostPoint] = Field(default_factory=list, max_length=100_000,
                                   description="the loss against wall-clock and money at each "
                                               "evaluation")

    @model_validator(mode="after")
    def _json_limits(self) -> RunCostIn:
        _check_json(self.model_dump())
        return self


class RunCostPublic(BaseModel):
    model_config = _OUT
    run_id: uuid.UUID
    deployment: str
    model: str = Field(description="the cost model's version (crucible.pricing.cost.COST_MODEL)")
    pricing: str = Field(description="on_demand or spot: the price `cost` is in")
    currency: str
    wall_s: float = Field(description="predicted wall-clock seconds on the deployment")
    accelerator_hours: float = Field(description="every provisioned accelerator for the whole "
                                                 "wall-clock, idle ones included")
    cost: float = Field(description="accelerator_hours x the price per hour of `pricing`")
    record: dict[str, Any] = Field(description="the whole record (crucible.pricing.cost.run_cost)")
    updated_at: datetime


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
