"""The registry's FastAPI application factory.

`create_app(settings)` builds one app with its own engine and session factory (no globals, so
tests can run several apps side by side). Routes live under /api/v1; /healthz, /readyz and the
browser sign-in (/login, /logout) at the root. The dashboards package contributes pages through
`dashboards.routes.router`, included when that module exists: this is the hook for it, and the
only optional import. `api.middleware.RequestGuard` authenticates writes and limits bodies before
any route runs. The OpenAPI document says what the app does: reads carry an optional security
requirement while they are open, a required one once `reads_require_token` is set.
"""
from __future__ import annotations

import importlib.util
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

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
_log = logging.getLogger(__name__)


def _include_dashboards(app: FastAPI) -> None:
    if importlib.util.find_spec("dashboards.routes") is None:
        return
    from dashboards.routes import router  # noqa: PLC0415 - optional package hook

    app.include_router(router)


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
    _include_dashboards(app)
    _install_openapi(app, settings)
    app.add_middleware(RequestGuard, api_prefix=API_PREFIX, max_bytes=settings.max_body_bytes,
                       authenticate=_authenticator(app, settings))
    return app
