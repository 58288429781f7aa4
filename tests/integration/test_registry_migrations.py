"""The registry schema: Alembic migrations upgrade an empty database to head and back down, and
the models agree with what the migrations build (Postgres, and SQLite for the embedded default)."""
from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from db.migrate import current_revision, downgrade, head_revision, upgrade
from db.models import Base

pytestmark = pytest.mark.integration

_TABLES = {"sweeps", "runs", "metrics", "events", "run_costs", "api_tokens"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _diff(url: str) -> list[object]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


@pytest.mark.filterwarnings("ignore:.*expression-based index:UserWarning",
                            "ignore:.*expression-based index")
def test_postgres_upgrade_to_head_matches_models_and_downgrades_to_empty(fresh_pg_url):
    assert current_revision(fresh_pg_url) is None
    upgrade(fresh_pg_url)
    assert current_revision(fresh_pg_url) == head_revision()
    assert _tables(fresh_pg_url) == _TABLES
    assert _diff(fresh_pg_url) == []
    downgrade(fresh_pg_url)
    assert current_revision(fresh_pg_url) is None
    assert _tables(fresh_pg_url) == set()


def test_postgres_metrics_key_index_treats_null_replica_as_a_value(pg_url):
    engine = create_engine(pg_url)
    try:
        indexes = {ix["name"]: ix for ix in inspect(engine).get_indexes("metrics")}
    finally:
        engine.dispose()
    assert indexes["uq_metrics_key"]["unique"]
    assert "coalesce" in str(indexes["uq_metrics_key"].get("expressions", "")).lower()


@pytest.mark.filterwarnings("ignore:.*expression-based index:UserWarning",
                            "ignore:.*expression-based index")
def test_sqlite_embedded_default_uses_the_same_migrations(tmp_path):
    url = f"sqlite:///{tmp_path / 'crucible.db'}"
    upgrade(url)
    assert _tables(url) == _TABLES
    assert _diff(url) == []
    downgrade(url)
    assert _tables(url) == set()


def test_cli_db_upgrade_and_downgrade(fresh_pg_url, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from api.cli import register

    monkeypatch.setenv("CRUCIBLE_DATABASE_URL", fresh_pg_url)
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    runner = CliRunner()
    assert runner.invoke(app, ["db", "upgrade"]).exit_code == 0
    assert current_revision(fresh_pg_url) == head_revision()
    assert runner.invoke(app, ["db", "downgrade"]).exit_code == 0
    assert current_revision(fresh_pg_url) is None and _tables(fresh_pg_url) == set()


def test_readyz_is_503_until_migrations_reach_head(fresh_pg_url):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(database_url=fresh_pg_url))
    client = TestClient(app)
    before = client.get("/readyz")
    assert before.status_code == 503 and before.json()["revision"] is None
    upgrade(fresh_pg_url)
    after = client.get("/readyz").json()
    assert after == {"status": "ready", "database": True, "revision": head_revision(),
                     "head": head_revision()}
    app.state.engine.dispose()
