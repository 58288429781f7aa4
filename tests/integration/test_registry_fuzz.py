"""The whole API under schemathesis (property-based, generated from its own OpenAPI schema) on a
real Postgres, run by schemathesis' own engine as `schemathesis run --checks all` runs it: every
phase (examples, coverage, fuzzing, stateful) and every check. So: no 5xx; every status code,
header and body as documented (one error shape, `ErrorResponse`); schema-valid input accepted,
schema-violating input refused; auth enforced wherever it is declared; `Allow` right on 405.

Bounded: `MAX_EXAMPLES` per operation and phase, deterministic generation, no example database.
Path ids are often a real sweep and run (a dictionary draw), so the write paths (inserts
into JSONB, bulk ingestion) run, not just the 404s of random ids. One thing JSON Schema cannot
state is `crucible.config`'s cross-field rules (heads dividing d_model, topk within a chunk,
...): positive cases of POST /runs carry a valid config drawn here; invalid configs are still
sent by the negative cases, and must get a 4xx.
"""
from __future__ import annotations

from typing import Any, get_args

import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema

from api.app import create_app
from api.schemas import Compression, Strategy
from api.settings import Settings
from tests.fixtures.postgres import REGISTRY_TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_EXAMPLES = 10
CREATE_RUN = "POST /api/v1/runs"
# 413 is how the API refuses a batch of more than 10,000 items (the schema's maxItems): a
# refusal, which schemathesis' default list of refusals leaves out
_REFUSALS = SchemathesisConfig.from_dict({}).projects.default.checks.negative_data_rejection

_CONFIGS = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31),
    "faults": st.fixed_dictionaries({"p": st.floats(0, 1), "duration": st.integers(1, 64),
                                     "strategy": st.sampled_from(get_args(Strategy))}),
    "pipeline": st.fixed_dictionaries({"compression": st.sampled_from(get_args(Compression))}),
})


def _config(known_ids: dict[str, str]) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict({
        "headers": {"Authorization": f"Bearer {REGISTRY_TOKEN}"},
        "checks": {"enabled": True,  # = --checks all
                   "negative_data_rejection": {
                       "expected-statuses": [*_REFUSALS.expected_statuses, "413"]}},
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "continue-on-failure": True,
        "dictionaries": {name: {"values": [value]} for name, value in known_ids.items()},
        "parameters": {f"path.{name}": {"dictionary": name, "probability": 0.5}
                       for name in known_ids},
    })


def _valid_config(context: Any, case: Any) -> Any:
    """flatmap_case hook: a positive case of POST /runs gets a valid config."""
    positive = case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE
    if context.operation.label != CREATE_RUN or not positive or not isinstance(case.body, dict):
        return st.just(case)

    def with_config(config: dict[str, Any]) -> Any:
        case.body["config"] = config
        return case

    return _CONFIGS.map(with_config)


def _failures(app: Any, known_ids: dict[str, str]) -> tuple[list[str], set[str]]:
    """Run the engine over `app`; the failures it found (one line each) and the phases it ran."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=_config(known_ids))
    schema.hook("flatmap_case")(_valid_config)
    failures, phases = [], set()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            phases.add(str(event.phase))
            for checks in event.recorder.checks.values():
                failures += [f"{event.recorder.label} [{event.phase}] {check.name}: "
                             f"{check.failure_info.failure.title}: "
                             f"{check.failure_info.failure.message[:300]}"
                             for check in checks if check.failure_info is not None]
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures.append(f"engine error: {event!r}"[:500])
    return failures, phases


@pytest.fixture(params=["open", "closed"])
def fuzzed_app(request, registry_app, pg_db):
    """The app with open reads (the default), and with `reads_require_token` (every read then
    declares and enforces auth; dashboard pages redirect to /login)."""
    if request.param == "open":
        yield registry_app
        return
    app = create_app(Settings(database_url=pg_db, api_token=REGISTRY_TOKEN,
                              reads_require_token=True))
    yield app
    app.state.engine.dispose()


def test_api_agrees_with_its_schema_under_every_check(registry, fuzzed_app):
    sweep = registry.post("/api/v1/sweeps", json={"name": "fuzz"}).json()
    run = registry.post("/api/v1/runs", json={"sweep_id": sweep["id"], "config": {}}).json()
    # /sweeps/{sweep_ref} takes an id or a name: the real sweep by its name
    failures, phases = _failures(fuzzed_app, {"sweep_ref": sweep["name"], "run_id": run["id"]})
    assert failures == []
    assert phases == {"examples", "coverage", "fuzzing", "stateful"}
