"""No phantom arms, on the real registry: a baseline (p = 0) is stored with strategy NULL, so a
sweep of only drop_extend and reroute shows exactly those two strategies in its REST answers and
dashboard figures, each paired with the arm's baseline; migration 0003 moves existing baselines
from `skip` to NULL and back (Postgres and SQLite)."""
from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from crucible.config import Config
from db.migrate import downgrade, upgrade

pytestmark = pytest.mark.integration

V1 = "/api/v1"


def _config(*, p: float, seed: int, strategy: str = "skip") -> dict:
    config = Config()
    config.pipeline.compression = "ssn"
    config.faults.p, config.faults.strategy, config.seed = p, strategy, seed
    return config.to_dict()


def _run(registry, sweep_id: str, *, p: float, seed: int, loss: float,
         strategy: str = "skip") -> dict:
    created = registry.post(f"{V1}/runs", json={"sweep_id": sweep_id,
                                                "config": _config(p=p, seed=seed, strategy=strategy)})
    assert created.status_code == 201, created.text
    run = created.json()
    patch = registry.patch(f"{V1}/runs/{run['id']}", json={
        "status": "completed", "final_val_loss": loss, "tokens_budget": 1000,
        "tokens_processed": 1000})
    assert patch.status_code == 200, patch.text
    return run


def test_sweep_of_drop_extend_and_reroute_shows_no_skip(registry, registry_app):
    from api.dashboards import queries
    from dashboards import accounting, figures, pages, style

    sweep = registry.post(f"{V1}/sweeps", json={"name": "no phantom arms"}).json()
    sid = sweep["id"]
    # baselines keep the sweep's pinned faults.strategy=skip in their config, as
    # crucible/grid/spec.py does
    bases = [_run(registry, sid, p=0.0, seed=s, loss=2.0 + 0.2 * s) for s in (0, 1)]
    for s in (0, 1):
        _run(registry, sid, p=0.1, seed=s, loss=(2.0 + 0.2 * s) * 1.10, strategy="drop_extend")
        _run(registry, sid, p=0.1, seed=s, loss=(2.0 + 0.2 * s) * 1.05, strategy="reroute")

    for base in bases:
        stored = registry.get(f"{V1}/runs/{base['id']}").json()
        assert base["strategy"] is None and stored["strategy"] is None
        assert stored["config"]["faults"]["strategy"] == "skip"   # the config is untouched
    listed = registry.get(f"{V1}/runs", params={"sweep_id": sid}).json()["items"]
    assert {r["strategy"] for r in listed} == {None, "drop_extend", "reroute"}
    assert all(r["baseline_run_id"] in {b["id"] for b in bases} for r in listed if r["p"] > 0)

    robustness = registry.get(f"{V1}/sweeps/{sid}/robustness").json()
    items = {(i["strategy"], i["p"]): i for i in robustness["items"]}
    assert set(items) == {(s, p) for s in ("drop_extend", "reroute") for p in (0.0, 0.1)}
    assert items[("drop_extend", 0.1)]["mean_pct"] == pytest.approx(10.0)
    assert items[("reroute", 0.1)]["mean_pct"] == pytest.approx(5.0)
    for strategy in ("drop_extend", "reroute"):
        assert items[(strategy, 0.0)]["run_ids"] == [b["id"] for b in bases]
    table = registry.get(f"{V1}/sweeps/{sid}/table").json()
    assert table["columns"] == ["ssn/drop_extend", "ssn/reroute"]

    with registry_app.state.session_factory() as session:
        view = queries.sweep_view(session, sweep_id=uuid.UUID(sid))
    names = {t.name for fig in (figures.robustness_curves(view["robustness"]),
                                accounting.token_accounting(view["runs"])) for t in fig.data}
    assert names >= {"SSN · drop_extend", "SSN · reroute"}
    assert not any("skip" in name for name in names), names
    header = figures.robustness_table(view["table"]).data[0].header.values
    assert not any("skip" in h for h in header), header
    page = pages.sweep_page(view, plotly_tag="", run_href=None)
    runs_table = page[page.index("<th>strategy</th>"):]
    runs_table = runs_table[:runs_table.index("</table>")]
    assert "skip" not in runs_table and runs_table.count(f"<td>{style.BASELINE_LABEL}</td>") == 2


def _insert_run(conn: sa.Connection, *, p: float, strategy: str) -> None:
    """A run row as revision 0002 stores it (UUIDs are CHAR(32) hex on SQLite)."""
    run_id = uuid.uuid4()
    conn.execute(sa.text(
        "INSERT INTO runs (id, config, compression, strategy, p, duration, seed, preset, status,"
        " created_at, updated_at) VALUES (:id, '{}', 'ssn', :strategy, :p, 6, 0, 'smoke',"
        " 'completed', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
        {"id": run_id.hex if conn.dialect.name == "sqlite" else str(run_id),
         "strategy": strategy, "p": p})


def _strategies(engine: sa.Engine) -> dict[float, str | None]:
    with engine.connect() as conn:
        return {p: s for p, s in conn.execute(sa.text("SELECT p, strategy FROM runs"))}


def _strategy_nullable(engine: sa.Engine) -> bool:
    columns = sa.inspect(engine).get_columns("runs")
    return bool(next(c for c in columns if c["name"] == "strategy")["nullable"])


def _check_0003_round_trip(url: str) -> None:
    upgrade(url, "0002")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            _insert_run(conn, p=0.0, strategy="skip")
            _insert_run(conn, p=0.2, strategy="reroute")
        upgrade(url)
        assert _strategies(engine) == {0.0: None, 0.2: "reroute"}
        assert _strategy_nullable(engine)
        downgrade(url, "0002")
        assert _strategies(engine) == {0.0: "skip", 0.2: "reroute"}
        assert not _strategy_nullable(engine)
    finally:
        engine.dispose()
    downgrade(url)


def test_migration_0003_nulls_baseline_strategy_and_restores_skip_postgres(fresh_pg_url):
    _check_0003_round_trip(fresh_pg_url)


def test_migration_0003_nulls_baseline_strategy_and_restores_skip_sqlite(tmp_path):
    _check_0003_round_trip(f"sqlite:///{tmp_path / 'crucible.db'}")
