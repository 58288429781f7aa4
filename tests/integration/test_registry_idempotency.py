"""Ingestion is idempotent: resent and overlapping batches leave exactly one row per item."""
from __future__ import annotations

import uuid

import pytest
from sqlalchemy import create_engine, func, select

from crucible.events import Event, Metric
from db.models import Event as EventRow
from db.models import Metric as MetricRow

pytestmark = pytest.mark.integration

V1 = "/api/v1"


def _run_id(registry):
    response = registry.post(f"{V1}/runs", json={"config": {"seed": 1, "faults": {"p": 0.1}}})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _count(url, column, run_id):
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count()).where(column == run_id))
    finally:
        engine.dispose()


def _metrics(steps, replicas=(None, 0, 1)):
    return [Metric("train_loss" if r is not None else "val_loss", s, float(s), replica=r).to_dict()
            for s in steps for r in replicas]


def test_same_metric_batch_three_times_stores_each_item_once(registry, pg_db):
    run_id = _run_id(registry)
    batch = {"items": _metrics(range(100))}
    results = [registry.post(f"{V1}/runs/{run_id}/metrics:batch", json=batch).json()
               for _ in range(3)]
    assert [r["inserted"] for r in results] == [300, 0, 0]

    assert _count(pg_db, MetricRow.run_id, uuid.UUID(run_id)) == 300


def test_overlapping_metric_batches_store_the_union(registry, pg_db):

    run_id = _run_id(registry)
    first = registry.post(f"{V1}/runs/{run_id}/metrics:batch",
                          json={"items": _metrics(range(0, 60))}).json()
    second = registry.post(f"{V1}/runs/{run_id}/metrics:batch",
                           json={"items": _metrics(range(40, 100))}).json()
    assert (first["inserted"], second["inserted"]) == (180, 120)
    assert _count(pg_db, MetricRow.run_id, uuid.UUID(run_id)) == 300
    stored = registry.get(f"{V1}/runs/{run_id}/metrics", params={"limit": 10000}).json()["items"]
    keys = [(m["name"], m["global_step"], m["replica"]) for m in stored]
    assert len(keys) == len(set(keys)) == 300


def test_duplicates_inside_one_batch_and_null_replica_collide(registry, pg_db):

    run_id = _run_id(registry)
    item = Metric("val_loss", 3, 1.5).to_dict()
    result = registry.post(f"{V1}/runs/{run_id}/metrics:batch",
                           json={"items": [item, item, {**item, "value": 9.9}]}).json()
    assert result == {"received": 3, "inserted": 1}
    assert _count(pg_db, MetricRow.run_id, uuid.UUID(run_id)) == 1


def test_events_resent_and_overlapping_are_stored_once(registry, pg_db):

    run_id = _run_id(registry)
    events = [Event("bypass", s, replica=s % 4, stage=1).to_dict() for s in range(50)]
    for _ in range(3):
        registry.post(f"{V1}/runs/{run_id}/events:batch", json={"items": events[:30]})
    result = registry.post(f"{V1}/runs/{run_id}/events:batch", json={"items": events[20:]}).json()
    assert result == {"received": 30, "inserted": 20}
    assert _count(pg_db, EventRow.run_id, uuid.UUID(run_id)) == 50


def test_same_keys_in_two_runs_are_distinct(registry, pg_db):

    a, b = _run_id(registry), _run_id(registry)
    batch = {"items": _metrics(range(10))}
    assert registry.post(f"{V1}/runs/{a}/metrics:batch", json=batch).json()["inserted"] == 30
    assert registry.post(f"{V1}/runs/{b}/metrics:batch", json=batch).json()["inserted"] == 30
    assert _count(pg_db, MetricRow.run_id, uuid.UUID(b)) == 30
