"""The whole API under schemathesis (property-based, generated from its own OpenAPI schema) on a
real Postgres never answers 5xx, for valid and invalid inputs alike.

Bounded: `MAX_EXAMPLES` per operation and generation mode, no deadline. Half the cases target a
real sweep and run, so the write paths (inserts into JSONB, bulk ingestion) are exercised, not
just the 404s that random ids produce. Operations are driven with plain Hypothesis over
`APIOperation.as_strategy` (schemathesis' pytest fixture loader does not support pytest 9).
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.fixtures.postgres import REGISTRY_TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_EXAMPLES = 25
AUTH = {"Authorization": f"Bearer {REGISTRY_TOKEN}"}


def _strategy(operation, mode, known_ids):
    names = {p.name for p in operation.path_parameters}
    real = {k: v for k, v in known_ids.items() if k in names}
    if not real:
        return operation.as_strategy(mode)
    return st.one_of(operation.as_strategy(mode), operation.as_strategy(mode, path_parameters=real))


def _fuzz(operation, mode, known_ids):
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=_strategy(operation, mode, known_ids))
    def run(case):
        response = case.call(headers=AUTH)
        assert response.status_code < 500, (case.method, case.formatted_path, case.body,
                                            response.text)

    try:
        run()
    except Unsatisfiable:
        # nothing invalid can be sent (e.g. GET /healthz takes no input): nothing to fuzz
        assert mode is GenerationMode.NEGATIVE, operation.label


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=lambda m: m.value)
def test_api_never_answers_5xx(registry, registry_app, mode):
    sweep = registry.post("/api/v1/sweeps", json={"name": "fuzz"}).json()
    run = registry.post("/api/v1/runs", json={"sweep_id": sweep["id"], "config": {}}).json()
    known_ids = {"sweep_id": sweep["id"], "run_id": run["id"]}
    schema = schemathesis.openapi.from_asgi("/openapi.json", registry_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:
        _fuzz(operation, mode, known_ids)
