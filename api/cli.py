"""Command-line commands contributed by the `api` package (registered by crucible.cli).

- `crucible api [--host --port]` serves the registry with uvicorn;
- `crucible api token create [--name]` stores a new token and prints it alone on its last line;
- `crucible db upgrade` / `crucible db downgrade [--revision]` run the migrations.
All of them use the database of `CRUCIBLE_DATABASE_URL` (see api.settings.Settings).
"""
from __future__ import annotations

import logging

import typer

from api.settings import Settings

__all__ = ["register"]

_log = logging.getLogger(__name__)

api_app = typer.Typer(help="The run registry's REST API.", no_args_is_help=False)
token_app = typer.Typer(help="API tokens for writes.", no_args_is_help=True)
db_app = typer.Typer(help="The registry database.", no_args_is_help=True)
api_app.add_typer(token_app, name="token")


@api_app.callback(invoke_without_command=True)
def serve(ctx: typer.Context,
          host: str = typer.Option("127.0.0.1", help="interface to listen on"),
          port: int = typer.Option(8000, min=1, max=65535, help="TCP port"),
          migrate: bool = typer.Option(True, help="migrate the database to head first")) -> None:
    """Serve the REST API (and dashboards) with uvicorn."""
    if ctx.invoked_subcommand is not None:
        return
    import uvicorn

    from api.app import create_app
    from db.migrate import upgrade

    settings = Settings()
    if migrate:
        upgrade(settings.database_url)
    uvicorn.run(create_app(settings), host=host, port=port)


@token_app.command("create")
def token_create(name: str = typer.Option("default", help="a label for the token")) -> None:
    """Create a write token; it is shown once, alone on the last line."""
    from api.security import create_token
    from db.session import make_engine, make_session_factory

    engine = make_engine(Settings().database_url)
    try:
        with make_session_factory(engine)() as session:
            token = create_token(session, name=name)
    finally:
        engine.dispose()
    typer.echo(f"created token {name!r}; store it now, it cannot be shown again:")
    typer.echo(token)


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Option("head", help="target revision")) -> None:
    """Migrate the database up to `revision` (default: head)."""
    from db.migrate import upgrade

    upgrade(Settings().database_url, revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Option("base", help="target revision (base: empty)")
                 ) -> None:
    """Migrate the database down to `revision` (default: base, dropping every table)."""
    from db.migrate import downgrade

    downgrade(Settings().database_url, revision)
    typer.echo(f"database at {revision}")


def register(app: typer.Typer) -> None:
    """Add `api ...` and `db ...` to the `crucible` command line."""
    app.add_typer(api_app, name="api")
    app.add_typer(db_app, name="db")
