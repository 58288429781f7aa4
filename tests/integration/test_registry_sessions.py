"""Closed mode (`reads_require_token`): browsers sign in at /login and get a signed, expiring,
HttpOnly session cookie (never the token); tokens can expire and be listed and revoked from the
command line, and a revoked or expired token (or a session it opened) is refused at once."""
from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
import typer
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select
from typer.testing import CliRunner

from api.app import create_app
from api.security import LAST_USED_RESOLUTION_S, authenticate, create_token, hash_token
from api.sessions import SESSION_COOKIE, issue_session
from api.settings import Settings
from db.models import ApiToken, utcnow
from db.session import make_engine, make_session_factory

pytestmark = pytest.mark.integration

V1 = "/api/v1"
STATIC = "crc_closed-mode-static-token"
SECRET = "a-session-secret-for-the-registry-tests"


@pytest.fixture
def closed(pg_db):
    """The app with reads closed, the settings token STATIC and a fixed session secret."""
    app = create_app(Settings(database_url=pg_db, api_token=STATIC, reads_require_token=True,
                              session_secret=SECRET))
    yield app
    app.state.engine.dispose()


@pytest.fixture
def cli(pg_db, monkeypatch):
    """`crucible api ...` on the test database: cli(args) -> CliRunner result."""
    from api.cli import register

    monkeypatch.setenv("CRUCIBLE_DATABASE_URL", pg_db)
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return lambda *args: CliRunner().invoke(app, ["api", *args])


def _token(pg_db, *, name="t", expires_at=None):
    engine = make_engine(pg_db)
    try:
        with make_session_factory(engine)() as session:
            return create_token(session, name=name, expires_at=expires_at)
    finally:
        engine.dispose()


def _rows(pg_db):
    engine = create_engine(pg_db)
    try:
        with engine.connect() as conn:
            return {row.name: row for row in conn.execute(select(ApiToken))}
    finally:
        engine.dispose()


def _sweep(app):
    with TestClient(app, headers={"Authorization": f"Bearer {STATIC}"}) as client:
        return client.post(f"{V1}/sweeps", json={"name": "closed"}).json()["id"]


def _login(client, token, next_path="/login"):
    return client.post("/login", data={"token": token, "next": next_path},
                       follow_redirects=False)


def test_anonymous_browser_is_sent_to_login_and_back(closed):
    sweep_id = _sweep(closed)
    page = f"/dashboards/sweeps/{sweep_id}"
    client = TestClient(closed)
    response = client.get(page, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == f"/login?next={page}"
    form = client.get(response.headers["location"])
    assert form.status_code == 200 and 'name="token"' in form.text and page in form.text
    assert client.get(f"{V1}/sweeps").status_code == 401  # the JSON API answers 401, no redirect
    assert client.get("/dashboards/static/plotly.min.js").status_code == 401

    signed_in = _login(client, STATIC, page)
    assert (signed_in.status_code, signed_in.headers["location"]) == (303, page)
    assert client.get(page).status_code == 200
    assert client.get("/dashboards/static/plotly.min.js").status_code == 200
    assert client.get(f"{V1}/sweeps/{sweep_id}").json()["id"] == sweep_id
    assert client.post("/logout", follow_redirects=False).status_code == 303
    assert client.get(page, follow_redirects=False).status_code == 303


@pytest.mark.parametrize("next_path", ["//evil.example/x", "https://evil.example", "/\\evil",
                                       "javascript:alert(1)"])
def test_login_never_sends_the_browser_off_site(closed, next_path):
    response = _login(TestClient(closed), STATIC, next_path)
    assert (response.status_code, response.headers["location"]) == (303, "/login")


def test_session_cookie_is_signed_httponly_strict_and_holds_no_token(closed, pg_db):
    token = _token(pg_db, name="browser")
    client = TestClient(closed)
    cookie = _login(client, token).headers["set-cookie"]
    assert re.search(r"; HttpOnly", cookie) and re.search(r"; SameSite=strict", cookie, re.I)
    assert "; Path=/" in cookie and "Secure" not in cookie  # plain http here
    value = client.cookies[SESSION_COOKIE]
    assert token not in value and token[4:] not in value
    assert str(_rows(pg_db)["browser"].token_hash) not in value
    over_https = TestClient(closed, base_url="https://testserver")
    assert "; Secure" in _login(over_https, token).headers["set-cookie"]


def test_a_session_never_writes(closed):
    client = TestClient(closed)
    _login(client, STATIC)
    response = client.post(f"{V1}/sweeps", json={"name": "csrf"})
    assert response.status_code == 401 and "bearer" in response.json()["detail"]


def test_forged_tampered_and_expired_sessions_are_refused(closed):
    sweep_id = _sweep(closed)
    page = f"/dashboards/sweeps/{sweep_id}"
    ref = "static:" + hash_token(STATIC)[:16]
    good = issue_session(ref=ref, expires_at=utcnow() + timedelta(hours=1), secret=SECRET.encode())
    cases = {
        "good": good,
        "tampered": good[:-2] + ("AA" if not good.endswith("AA") else "BB"),
        "other secret": issue_session(ref=ref, expires_at=utcnow() + timedelta(hours=1),
                                      secret=b"another secret"),
        "expired": issue_session(ref=ref, expires_at=utcnow() - timedelta(seconds=1),
                                 secret=SECRET.encode()),
        "unknown token": issue_session(ref=str(uuid.uuid4()), expires_at=utcnow()
                                       + timedelta(hours=1), secret=SECRET.encode()),
        "garbage": "not.a-session",
    }
    statuses = {}
    for label, value in cases.items():
        client = TestClient(closed, cookies={SESSION_COOKIE: value})
        statuses[label] = client.get(page, follow_redirects=False).status_code
    assert statuses == {"good": 200, "tampered": 303, "other secret": 303, "expired": 303,
                        "unknown token": 303, "garbage": 303}


@pytest.mark.parametrize("value", [b"YQ.\xe9", "\u00e9.\u00e9".encode(), b"\xff\xfe.\x80"])
def test_non_ascii_session_cookie_is_refused_not_a_server_error(closed, value):
    """Browsers send cookie bytes as they are; the server reads them as latin-1 text, which an
    HMAC comparison of text refuses with TypeError: the value must simply count as no session."""
    sweep_id = _sweep(closed)
    client = TestClient(closed)
    cookie = [(b"cookie", SESSION_COOKIE.encode() + b"=" + value)]
    assert client.get("/login", headers=cookie).status_code == 200
    assert client.get(f"{V1}/runs", headers=cookie).status_code == 401
    page = client.get(f"/dashboards/sweeps/{sweep_id}", headers=cookie, follow_redirects=False)
    assert page.status_code == 303


def test_revoked_token_is_refused_and_its_sessions_end(closed, pg_db, cli):
    token = _token(pg_db, name="laptop")
    browser = TestClient(closed)
    _login(browser, token)
    sweep_id = _sweep(closed)
    page = f"/dashboards/sweeps/{sweep_id}"
    assert browser.get(page).status_code == 200
    bearer = {"Authorization": f"Bearer {token}"}
    assert TestClient(closed, headers=bearer).get(f"{V1}/sweeps").status_code == 200

    result = cli("token", "revoke", "laptop")
    assert result.exit_code == 0, result.output
    assert "revoked token 'laptop'" in result.output
    assert browser.get(page, follow_redirects=False).status_code == 303
    writer = TestClient(closed, headers=bearer)
    assert writer.get(f"{V1}/sweeps").status_code == 401
    assert writer.post(f"{V1}/sweeps", json={"name": "x"}).status_code == 401
    assert _login(TestClient(closed), token).status_code == 401


def test_expired_token_is_refused(closed, pg_db):
    token = _token(pg_db, name="old", expires_at=utcnow() - timedelta(seconds=1))
    client = TestClient(closed, headers={"Authorization": f"Bearer {token}"})
    assert client.post(f"{V1}/sweeps", json={"name": "late"}).status_code == 401
    assert client.get(f"{V1}/sweeps").status_code == 401
    assert _login(TestClient(closed), token).status_code == 401


def test_session_ends_with_its_token(closed, pg_db):
    """A session never outlives the token that opened it."""
    token = _token(pg_db, name="short", expires_at=utcnow() + timedelta(minutes=5))
    cookie = _login(TestClient(closed), token).headers["set-cookie"]
    max_age = int(re.search(r"Max-Age=(\d+)", cookie).group(1))
    assert 0 < max_age <= 300


def test_last_used_is_recorded_at_most_once_a_minute(closed, pg_db):
    token = _token(pg_db, name="busy")
    assert _rows(pg_db)["busy"].last_used_at is None
    client = TestClient(closed, headers={"Authorization": f"Bearer {token}"})
    assert client.post(f"{V1}/sweeps", json={"name": "a"}).status_code == 201
    first = _rows(pg_db)["busy"].last_used_at
    assert first is not None
    assert client.get(f"{V1}/sweeps").status_code == 200
    assert _rows(pg_db)["busy"].last_used_at == first  # within the minute: no write
    engine = make_engine(pg_db)
    try:
        with make_session_factory(engine)() as session:
            later = first + timedelta(seconds=LAST_USED_RESOLUTION_S)
            assert authenticate(session, token=token, now=later) is not None
    finally:
        engine.dispose()
    assert _rows(pg_db)["busy"].last_used_at == later


def test_token_list_shows_state_and_dates_and_never_the_secret(pg_db, cli):
    created = cli("token", "create", "--name", "ci", "--expires-in", "30d")
    assert created.exit_code == 0, created.output
    assert "valid until" in created.output
    secret = created.output.strip().splitlines()[-1]
    other = cli("token", "create", "--name", "old").output.strip().splitlines()[-1]
    assert cli("token", "revoke", "old").exit_code == 0
    TestClient(create_app(Settings(database_url=pg_db)),
               headers={"Authorization": f"Bearer {secret}"}).post(f"{V1}/sweeps",
                                                                    json={"name": "used"})
    listed = cli("token", "list")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATE", "CREATED", "LAST", "USED", "EXPIRES",
                                "REVOKED"]
    ci = next(line for line in lines if " ci " in line)
    old = next(line for line in lines if " old " in line)
    expiry = (utcnow() + timedelta(days=30)).strftime("%Y-%m-%d")
    assert " active " in ci and expiry in ci and "never" not in ci
    assert " revoked " in old and "never" in old
    rows = _rows(pg_db)
    for hidden in (secret, other, secret[4:], rows["ci"].token_hash, rows["old"].token_hash):
        assert hidden not in listed.output


@pytest.mark.parametrize("args,message", [
    (["token", "revoke", "nobody"], "no unrevoked token named"),
    (["token", "revoke", str(uuid.uuid4())], "no unrevoked token"),
    (["token", "revoke", "twin"], "2 unrevoked tokens are named 'twin'"),
    (["token", "create", "--expires-in", "30 days"], "--expires-in"),
    (["token", "create", "--expires-in", "0d"], "--expires-in"),
])
def test_bad_token_commands_exit_2_naming_the_problem(pg_db, cli, args, message):
    _token(pg_db, name="twin")
    _token(pg_db, name="twin")
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
