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


def _stored(url, run_id):
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(MetricRow.name, MetricRow.global_step, MetricRow.replica,
                                       MetricRow.tokens, MetricRow.value)
                                .where(MetricRow.run_id == run_id)).all()
    finally:
        engine.dispose()
    return {(n, s, r): (t, v) for n, s, r, t, v in rows}


def test_large_batch_with_duplicates_keeps_the_first_and_a_resend_inserts_nothing(registry, pg_db):
    """The Postgres COPY-and-move path: 1,000 keys sent twice in one 6,000-item batch (the second
    copy with another value), null replicas among them, then the whole batch again."""
    run_id = _run_id(registry)
    first = [{"name": "train_loss", "global_step": s, "replica": s % 3 or None, "tokens": s,
              "value": float(s)} for s in range(5000)]
    again = [{**item, "value": -1.0, "tokens": None} for item in first[:1000]]
    batch = {"items": first[:2500] + again + first[2500:]}
    result = registry.post(f"{V1}/runs/{run_id}/metrics:batch", json=batch).json()
    assert result == {"received": 6000, "inserted": 5000}
    stored = _stored(pg_db, uuid.UUID(run_id))
    assert stored == {(i["name"], i["global_step"], i["replica"]): (i["tokens"], i["value"])
                      for i in first}
    resent = registry.post(f"{V1}/runs/{run_id}/metrics:batch", json=batch).json()
    assert resent == {"received": 6000, "inserted": 0}
    assert _count(pg_db, MetricRow.run_id, uuid.UUID(run_id)) == 5000


def test_two_batches_in_one_transaction_land_in_their_own_runs(registry, pg_db):
    """The staging table is per connection: the move empties it, so a second batch in the same
    transaction (and the same pooled connection afterwards) never re-inserts the first."""
    from api import records
    from db.session import make_engine, make_session_factory

    a, b = _run_id(registry), _run_id(registry)
    engine = make_engine(pg_db, pool_size=1, max_overflow=0)
    try:
        with make_session_factory(engine)() as session:
            assert records._pg_copy_metrics(session, uuid.UUID(a), _metrics(range(10))) == 30
            assert records._pg_copy_metrics(session, uuid.UUID(b), _metrics(range(5))) == 15
            session.commit()
            assert records.insert_metrics(session, run_id=uuid.UUID(b),
                                          items=_metrics(range(7))) == 6
    finally:
        engine.dispose()
    assert _count(pg_db, MetricRow.run_id, uuid.UUID(a)) == 30
    assert _count(pg_db, MetricRow.run_id, uuid.UUID(b)) == 21
