"""The registry's FastAPI application factory.

`create_app(settings)` builds one app with its own engine and session factory (no globals, so
tests can run several apps side by side). Routes live under /api/v1; /healthz and /readyz at the
root. The dashboards package contributes pages through `dashboards.routes.router`, included when
that module exists: this is the hook for it, and the only optional import.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.errors import install_handlers
from api.middleware import BodySizeLimit
from api.routes import health, runs, sweeps
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
    install_handlers(app)
    app.include_router(health.router)
    app.include_router(sweeps.router, prefix=API_PREFIX)
    app.include_router(runs.router, prefix=API_PREFIX)
    _include_dashboards(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app
