"""Tags and notes on sweeps and runs: set on create, replaced or edited (add_tags/remove_tags,
atomic under concurrent edits) by PATCH, validated with 422s naming the field, filtered by
`tag=` (REST lists and the dashboards' crud queries, Postgres and SQLite), migration 0004, and
the `crucible api tag` / `crucible api note` commands."""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from api import crud
from crucible.config import Config
from db.migrate import downgrade, upgrade
from db.models import Run
from db.session import make_engine, make_session_factory

pytestmark = pytest.mark.integration

V1 = "/api/v1"


def _sweep(registry, name="tagged", **body):
    response = registry.post(f"{V1}/sweeps", json={"name": name, **body})
    assert response.status_code == 201, response.text
    return response.json()


def _run(registry, sweep_id=None, **body):
    response = registry.post(f"{V1}/runs", json={"sweep_id": sweep_id,
                                                 "config": Config().to_dict(), **body})
    assert response.status_code == 201, response.text
    return response.json()


@pytest.mark.parametrize("kind", ["sweeps", "runs"])
def test_tags_and_notes_round_trip(registry, kind):
    make = _sweep if kind == "sweeps" else _run
    bare = make(registry)
    assert bare["tags"] == [] and bare["notes"] is None
    made = make(registry, tags=["paper", "ablation", "paper"], notes="first try")
    assert made["tags"] == ["ablation", "paper"] and made["notes"] == "first try"
    url = f"{V1}/{kind}/{made['id']}"
    assert registry.get(url).json()["tags"] == ["ablation", "paper"]

    edited = registry.patch(url, json={"add_tags": ["v2", "ablation"], "remove_tags": ["paper"]})
    assert edited.status_code == 200, edited.text
    assert edited.json()["tags"] == ["ablation", "v2"]
    # removals first: a tag in both lists stays
    both = registry.patch(url, json={"add_tags": ["v2"], "remove_tags": ["v2"]}).json()
    assert both["tags"] == ["ablation", "v2"]
    replaced = registry.patch(url, json={"tags": ["final"], "notes": "use this one"}).json()
    assert replaced["tags"] == ["final"] and replaced["notes"] == "use this one"
    # null tags leave them; null notes clear them
    cleared = registry.patch(url, json={"tags": None, "notes": None}).json()
    assert cleared["tags"] == ["final"] and cleared["notes"] is None
    assert registry.get(url).json()["tags"] == ["final"]


@pytest.mark.parametrize(("body", "field"), [
    ({"tags": ["has space"]}, "body.tags.0"),
    ({"tags": [""]}, "body.tags.0"),
    ({"tags": ["x" * 65]}, "body.tags.0"),
    ({"tags": [f"t{i}" for i in range(33)]}, "body.tags"),
    ({"add_tags": ["ok", "no;semicolon"]}, "body.add_tags.1"),
    ({"remove_tags": [7]}, "body.remove_tags.0"),
    ({"tags": ["a"], "add_tags": ["b"]}, "body"),
    ({"tags": [], "remove_tags": ["b"]}, "body"),
    ({"notes": "n" * 10_001}, "body.notes"),
])
def test_bad_tags_and_notes_are_422s_naming_the_field(registry, body, field):
    sweep = _sweep(registry)
    for url in (f"{V1}/sweeps/{sweep['id']}", f"{V1}/runs/{_run(registry, sweep['id'])['id']}"):
        response = registry.patch(url, json=body)
        assert response.status_code == 422, response.text
        assert [e["field"] for e in response.json()["errors"]] == [field]
    if "tags" in body and "add_tags" not in body and "remove_tags" not in body:
        refused = registry.post(f"{V1}/sweeps", json={"name": "bad", **body})
        assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == field


def test_bad_tag_message_says_the_rule(registry):
    response = registry.post(f"{V1}/sweeps", json={"name": "x", "tags": ["a b"]})
    assert "1-64 characters from A-Za-z0-9._:/+=-" in response.json()["detail"]
    both = registry.patch(f"{V1}/sweeps/{_sweep(registry)['id']}",
                          json={"tags": ["a"], "add_tags": ["b"]})
    assert "either tags" in both.json()["detail"]


def test_adding_past_32_tags_is_a_409_that_changes_nothing(registry):
    sweep = _sweep(registry, tags=[f"t{i}" for i in range(30)])
    url = f"{V1}/sweeps/{sweep['id']}"
    response = registry.patch(url, json={"add_tags": ["x1", "x2", "x3"], "status": "running"})
    assert response.status_code == 409, response.text
    assert response.json()["errors"][0]["field"] == "body.add_tags"
    after = registry.get(url).json()
    assert len(after["tags"]) == 30 and after["status"] == "pending"
    # replacing with what removals make room for is fine
    ok = registry.patch(url, json={"add_tags": ["x1", "x2"], "remove_tags": ["t0"]})
    assert ok.status_code == 200 and len(ok.json()["tags"]) == 31


def _waiting_for_a_lock(engine: sa.Engine, *, timeout_s: float = 30.0) -> None:
    """Return once some other backend of this database waits for a row lock."""
    deadline = time.monotonic() + timeout_s
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'")).scalar()
            if waiting:
                return
            time.sleep(0.05)
    raise AssertionError("the concurrent PATCH never waited for the row lock")


def test_concurrent_tag_edits_lose_no_tag(registry, pg_db):
    """A PATCH add_tags that starts while another transaction edits the same row waits for it
    and edits what it committed: the edit of each keeps the other's tag (without the row lock
    the PATCH would have read the old tags and written them back without 'x')."""
    run = _run(registry, tags=["base"])
    engine = sa.create_engine(pg_db)
    answers: dict[str, object] = {}

    def patch() -> None:
        answers["y"] = registry.patch(f"{V1}/runs/{run['id']}", json={"add_tags": ["y"]})

    try:
        with engine.connect() as conn, conn.begin():
            tags = conn.execute(sa.select(Run.tags).where(Run.id == uuid.UUID(run["id"]))
                                .with_for_update()).scalar_one()
            thread = threading.Thread(target=patch)
            thread.start()
            _waiting_for_a_lock(engine)
            conn.execute(sa.update(Run).where(Run.id == uuid.UUID(run["id"]))
                         .values(tags=sorted([*tags, "x"])))
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        engine.dispose()
    assert answers["y"].status_code == 200, answers["y"].text
    assert registry.get(f"{V1}/runs/{run['id']}").json()["tags"] == ["base", "x", "y"]


def test_sqlite_tag_edit_racing_another_loses_no_tag(tmp_path):
    """The embedded registry (SQLite) has no row locks: an edit that lands between another
    edit's read and write must wait for it, not be overwritten by it (pysqlite starts a
    transaction only at the first write, so without SQLite's write lock taken before the read
    the first edit writes back tags read before the second committed)."""
    url = f"sqlite:///{tmp_path / 'crucible.db'}"
    upgrade(url)
    first, second = make_engine(url), make_engine(url)
    try:
        with make_session_factory(first)() as session:
            run_id = crud.create_run(session, config=Config().to_dict(), tags=["base"]).id
        racing: list[threading.Thread] = []

        def edit_b() -> None:
            with make_session_factory(second)() as other:
                crud.update_run(other, run_id=run_id, changes={"add_tags": ["b"]})

        @sa.event.listens_for(first, "before_cursor_execute")
        def _race(_conn, _cursor, statement, *_args) -> None:
            if statement.startswith("UPDATE runs") and not racing:
                racing.append(threading.Thread(target=edit_b))
                racing[0].start()
                racing[0].join(timeout=2)  # B's edit lands now unless a lock holds it back

        with make_session_factory(first)() as session:
            crud.update_run(session, run_id=run_id, changes={"add_tags": ["a"]})
        racing[0].join(timeout=60)
        assert not racing[0].is_alive()
        with make_session_factory(first)() as session:
            assert crud.get_run(session, run_id=run_id).tags == ["a", "b", "base"]
    finally:
        first.dispose()
        second.dispose()


def test_two_threads_adding_and_removing_keep_every_tag(registry):
    sweep = _sweep(registry, tags=["keep"])
    url = f"{V1}/sweeps/{sweep['id']}"
    failures: list[str] = []

    def edit(prefix: str) -> None:
        for i in range(10):
            response = registry.patch(url, json={"add_tags": [f"{prefix}{i}", f"tmp-{prefix}"],
                                                 "remove_tags": [f"tmp-{prefix}{i - 1}"]})
            if response.status_code != 200:
                failures.append(response.text)

    threads = [threading.Thread(target=edit, args=(prefix,)) for prefix in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    expected = {"keep", "tmp-a", "tmp-b"} | {f"{p}{i}" for p in "ab" for i in range(10)}
    assert registry.get(url).json()["tags"] == sorted(expected)


def test_tag_filter_on_both_list_endpoints(registry):
    tagged_sweep = _sweep(registry, "one", tags=["paper", "v1"])
    _sweep(registry, "two", tags=["v1"])
    _sweep(registry, "three")
    listed = registry.get(f"{V1}/sweeps", params={"tag": "paper"}).json()["items"]
    assert [s["id"] for s in listed] == [tagged_sweep["id"]]
    assert len(registry.get(f"{V1}/sweeps", params={"tag": "v1"}).json()["items"]) == 2

    wanted = _run(registry, tagged_sweep["id"], tags=["paper"])
    _run(registry, tagged_sweep["id"], tags=["paperless"])
    _run(registry, tags=["other"])
    runs = registry.get(f"{V1}/runs", params={"tag": "paper"}).json()["items"]
    assert [r["id"] for r in runs] == [wanted["id"]]
    combined = registry.get(f"{V1}/runs", params={"tag": "paper", "status": "running"})
    assert combined.json()["items"] == []
    assert registry.get(f"{V1}/runs", params={"tag": "nobody"}).json()["items"] == []
    bad = registry.get(f"{V1}/runs", params={"tag": "two words"})
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "query.tag"


def _tag_filters(url: str) -> None:
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session:
            sweep = crud.create_sweep(session, name="s", tags=["paper"])
            crud.create_sweep(session, name="t", tags=["papers"])
            run = crud.create_run(session, config=Config().to_dict(), sweep_id=sweep.id,
                                  tags=["paper", "z"])
            crud.create_run(session, config=Config().to_dict(), tags=["zz"])
            assert [s.id for s in crud.recent_sweeps(session, tag="paper")] == [sweep.id]
            assert [r.id for r in crud.recent_runs(session, tag="paper")] == [run.id]
            assert [r.id for r in crud.list_runs(session, tag="z")[0]] == [run.id]
            assert [s.id for s in crud.list_sweeps(session, tag="paper")[0]] == [sweep.id]
            assert crud.recent_runs(session, tag="nothing") == []
            crud.update_run(session, run_id=run.id, changes={"add_tags": ["b"],
                                                              "remove_tags": ["z"]})
            assert crud.get_run(session, run_id=run.id).tags == ["b", "paper"]
    finally:
        engine.dispose()


def test_crud_tag_filters_postgres(pg_db):
    _tag_filters(pg_db)


def test_crud_tag_filters_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'crucible.db'}"
    upgrade(url)
    _tag_filters(url)


def _insert_old_run(conn: sa.Connection, run_id: uuid.UUID) -> bool:
    """A run row as an earlier revision stored it (only the columns every revision has);
    returns whether the database is SQLite (its UUIDs are stored as hex)."""
    sqlite = conn.dialect.name == "sqlite"
    conn.execute(sa.text(
        "INSERT INTO runs (id, config, compression, strategy, p, duration, seed, preset,"
        " status, created_at, updated_at) VALUES (:id, '{}', 'ssn', 'skip', 0.1, 6, 0,"
        " 'smoke', 'completed', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
        {"id": run_id.hex if sqlite else str(run_id)})
    return sqlite


def _check_0004_round_trip(url: str) -> None:
    upgrade(url, "0003")
    engine = sa.create_engine(url)
    run_id = uuid.uuid4()
    try:
        with engine.begin() as conn:
            sqlite = _insert_old_run(conn, run_id)
            conn.execute(sa.text(
                "INSERT INTO sweeps (id, name, status, created_at, updated_at) VALUES (:id, 'old',"
                " 'completed', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                {"id": uuid.uuid4().hex if sqlite else str(uuid.uuid4())})
        upgrade(url, "0004")
        with engine.connect() as conn:   # by SQL: the ORM's runs are head's (later columns)
            tags, notes = conn.execute(sa.text("SELECT tags, notes FROM runs")).one()
            assert (tags if isinstance(tags, list) else json.loads(tags)) == [] and notes is None
        with make_session_factory(engine)() as session:
            sweep = crud.list_sweeps(session)[0][0]
            assert sweep.tags == [] and sweep.notes is None
        downgrade(url, "0003")
        for table in ("runs", "sweeps"):
            columns = {c["name"] for c in sa.inspect(engine).get_columns(table)}
            assert not columns & {"tags", "notes"}
    finally:
        engine.dispose()
    downgrade(url)


def test_migration_0004_gives_existing_rows_no_tags_and_downgrades_postgres(fresh_pg_url):
    _check_0004_round_trip(fresh_pg_url)


def test_migration_0004_gives_existing_rows_no_tags_and_downgrades_sqlite(tmp_path):
    _check_0004_round_trip(f"sqlite:///{tmp_path / 'crucible.db'}")


def _check_0006_round_trip(url: str) -> None:
    """Migration 0006: a run stored before it reads label '' (an unlabelled cell) through the
    ORM, and downgrading drops the column."""
    upgrade(url, "0005")
    engine = sa.create_engine(url)
    run_id = uuid.uuid4()
    try:
        with engine.begin() as conn:
            _insert_old_run(conn, run_id)
        upgrade(url)
        with make_session_factory(engine)() as session:
            assert session.scalars(sa.select(Run)).one().label == ""
        downgrade(url, "0005")
        assert "label" not in {c["name"] for c in sa.inspect(engine).get_columns("runs")}
    finally:
        engine.dispose()
    downgrade(url)


def test_migration_0006_gives_existing_runs_no_label_and_downgrades_postgres(fresh_pg_url):
    _check_0006_round_trip(fresh_pg_url)


def test_migration_0006_gives_existing_runs_no_label_and_downgrades_sqlite(tmp_path):
    _check_0006_round_trip(f"sqlite:///{tmp_path / 'crucible.db'}")


# ---------------------------------------------------------------- CLI


@pytest.fixture
def cli(api_server, monkeypatch):
    """`crucible ...` in-process, as a client of the uvicorn-served API."""
    import typer

    from api.cli import register

    monkeypatch.setenv("CRUCIBLE_API_URL", api_server.url)
    monkeypatch.setenv("CRUCIBLE_API_TOKEN", api_server.token)
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_cli_tags_and_notes_a_sweep_by_name_and_a_run_by_id(cli, api_server):
    import httpx

    headers = {"Authorization": f"Bearer {api_server.token}"}
    name = f"cli-tags-{uuid.uuid4().hex[:8]}"
    sweep = httpx.post(f"{api_server.url}{V1}/sweeps", json={"name": name}, headers=headers).json()
    run = httpx.post(f"{api_server.url}{V1}/runs", json={"config": {}}, headers=headers).json()

    done = cli("api", "tag", "sweep", name, "--add", "paper", "--add", "v1")
    assert done.exit_code == 0, done.output
    assert f"sweep {sweep['id']}: tags paper, v1" in done.output
    done = cli("api", "tag", "sweep", name, "--remove", "v1", "--add", "final")
    assert "tags final, paper" in done.output
    done = cli("api", "tag", "run", run["id"], "--add", "look-here")
    assert done.exit_code == 0 and f"run {run['id']}: tags look-here" in done.output
    assert cli("api", "tag", "run", run["id"]).output.strip().endswith("tags look-here")

    done = cli("api", "note", "sweep", name, "diverged at step 40")
    assert done.exit_code == 0 and "notes diverged at step 40" in done.output
    assert httpx.get(f"{api_server.url}{V1}/sweeps/{sweep['id']}").json()["notes"] == \
        "diverged at step 40"
    done = cli("api", "note", "sweep", name, "--clear")
    assert done.exit_code == 0 and "notes (none)" in done.output


@pytest.mark.parametrize(("args", "message"), [
    (("api", "tag", "sweep", "no-such-sweep-name", "--add", "x"), "no-such-sweep-name"),
    (("api", "tag", "run", "not-a-uuid", "--add", "x"), "not a run id"),
    (("api", "tag", "run", str(uuid.uuid4()), "--add", "x"), "does not exist"),
    (("api", "tag", "sweep", "any", "--add", "two words"), "--add 'two words' is not a valid tag"),
    (("api", "tag", "sweep", "any", "--remove", "a;b"), "--remove 'a;b' is not a valid tag"),
    (("api", "note", "sweep", "any", "text", "--clear"), "not both"),
])
def test_cli_tag_and_note_errors_exit_2_with_a_message(cli, args, message):
    done = cli(*args)
    assert done.exit_code == 2, done.output
    assert message in done.output


def test_cli_tag_with_a_bad_token_exits_2(cli, monkeypatch, api_server):
    monkeypatch.setenv("CRUCIBLE_API_TOKEN", "crc_wrong")
    done = cli("api", "tag", "run", str(uuid.uuid4()), "--add", "x")
    assert done.exit_code == 2 and "CRUCIBLE_API_TOKEN" in done.output
