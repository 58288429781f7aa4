"""The registry's FastAPI application factory.

`create_app(settings)` builds one app with its own engine and session factory (no globals, so
tests can run several apps side by side). Routes live under /api/v1; /healthz, /readyz, the
browser sign-in (/login, /logout) and the dashboards' pages (`api.dashboards.routes.router`) at
the root. `api.middleware.RequestGuard` authenticates writes and limits bodies before any route
runs. The OpenAPI document says what the app does: reads carry an optional security
requirement while they are open, a required one once `reads_require_token` is set. /docs and
/redoc load their JavaScript from this server, never a CDN, so they work on an air-gapped host.
"""
from __future__ import annotations

import logging
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from api.dashboards.routes import router as dashboards_router
from api.deps import static_token
from api.errors import install_handlers
from api.middleware import Authenticate, RequestGuard
from api.routes import health, login, runs, sweeps
from api.security import Principal, authenticate
from api.settings import Settings
from db.migrate import upgrade
from db.session import make_engine, make_session_factory

__all__ = ["create_app", "API_PREFIX"]

API_PREFIX = "/api/v1"
DOCS_STATIC_URL = "/static/api-docs"
_log = logging.getLogger(__name__)


def _install_openapi(app: FastAPI, settings: Settings) -> None:
    """FastAPI's document, with optional security on reads while `reads_require_token` is off
    (a read then works with or without a token)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for path_item in schema["paths"].values():
                operation = path_item.get("get")
                if operation and operation.get("security") and not settings.reads_require_token:
                    operation["security"] = [{}, *operation["security"]]
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _redoc_js_without_remote_logo(path: Path, *, logo_url: str) -> bytes:
    """ReDoc's bundle with its one remote image (the "API docs by Redocly" logo in the side menu,
    which has no option to turn it off) pointed at `logo_url`, so an offline page logs no error."""
    js, count = re.subn(r'"https://[^"]*/logo-mini\.svg"', f'"{logo_url}"', path.read_text())
    if count != 1:
        # a cosmetic image must not keep the registry from starting: serve the bundle as it is
        # (offline, the logo then fails to load; tests/browser/test_docs_offline.py says so)
        _log.warning("%s: expected ReDoc's logo URL once, found it %d times; /redoc serves the "
                     "bundle unchanged (check the fastapi-offline version against "
                     "api.app._install_docs)", path, count)
    return js.encode()


def _install_docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc (ReDoc) from the assets the `fastapi-offline` package
    installs, served under DOCS_STATIC_URL: FastAPI's own pages load them from a CDN, which an
    air-gapped host cannot reach. Public in closed mode too, like /openapi.json: the schema is no
    secret and every read or write it describes still needs its token."""
    assets = Path(fastapi_offline.__file__).parent / "static"
    favicon = f"{DOCS_STATIC_URL}/favicon.png"
    redoc_js = _redoc_js_without_remote_logo(assets / "redoc.standalone.js", logo_url=favicon)

    @app.get(f"{DOCS_STATIC_URL}/redoc.offline.js", include_in_schema=False)
    def redoc_offline_js() -> Response:
        return Response(redoc_js, media_type="application/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})

    app.mount(DOCS_STATIC_URL, StaticFiles(directory=assets), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{DOCS_STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{favicon}", oauth2_redirect_url=None,
            swagger_ui_parameters={"validatorUrl": None})  # no badge fetched from a remote validator

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_STATIC_URL}/redoc.offline.js",
            redoc_favicon_url=f"{root}{favicon}", with_google_fonts=False)


def _authenticator(app: FastAPI, settings: Settings) -> Authenticate:
    """token -> Principal or None, on a session of its own (called from a worker thread)."""
    def check(token: str) -> Principal | None:
        with app.state.session_factory() as session:
            return authenticate(session, token=token, static_token=static_token(settings))

    return check


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the API for `settings` (default: from the environment). With
    `settings.migrate_on_start` the database is migrated to head when the app starts."""
    settings = settings or Settings()
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if settings.migrate_on_start:
            upgrade(settings.database_url)
        yield
        engine.dispose()

    app = FastAPI(title="Crucible run registry", version="1.0.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None,
                  description="Runs, sweeps, metrics and fault events of Crucible experiments.")
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    if settings.session_secret is not None:
        app.state.session_secret = settings.session_secret.get_secret_value().encode()
    else:
        app.state.session_secret = secrets.token_bytes(32)
        if settings.reads_require_token:
            _log.info("CRUCIBLE_SESSION_SECRET is unset: browser sessions end when the API stops")
    install_handlers(app)
    app.include_router(health.router)
    app.include_router(login.router)
    app.include_router(sweeps.router, prefix=API_PREFIX)
    app.include_router(runs.router, prefix=API_PREFIX)
    app.include_router(dashboards_router)
    _install_openapi(app, settings)
    _install_docs(app)
    app.add_middleware(RequestGuard, api_prefix=API_PREFIX, max_bytes=settings.max_body_bytes,
                       authenticate=_authenticator(app, settings))
    return app
