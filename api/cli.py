"""Command-line commands contributed by the `api` package (registered by cli.main).

- `crucible api [--host --port]` serves the registry with uvicorn;
- `crucible api token create [--name --expires-in 30d]` stores a new token and prints it alone on
  its last line; `token list` shows every token without its secret; `token revoke NAME_OR_ID`;
- `crucible api replay [--spool-root DIR]` delivers what reporters left in their spools (a client
  command: it reads `CRUCIBLE_API_URL` / `CRUCIBLE_API_TOKEN` / `CRUCIBLE_WORK_DIR` like the flows);
- `crucible api tag {run,sweep} REF [--add T]... [--remove T]...` and
  `crucible api note {run,sweep} REF [TEXT | --clear]` edit tags and notes through the REST API
  (client commands: `CRUCIBLE_API_URL`, `CRUCIBLE_API_TOKEN`) and print the result; a sweep's REF
  may be its exact name;
- `crucible db upgrade` / `crucible db downgrade [--revision]` run the migrations.
The token and db commands use the database of `CRUCIBLE_DATABASE_URL` (see api.settings.Settings).
Exit codes: 0 done, 1 the database or registry is unreachable, 2 a bad argument or token.
"""
from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from api.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from crucible.registry.client import ApiClient

__all__ = ["register"]

_log = logging.getLogger(__name__)

api_app = typer.Typer(help="The run registry's REST API.", no_args_is_help=False)
token_app = typer.Typer(help="API tokens: writes, and reads in closed mode.",
                        no_args_is_help=True)
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


_DURATION = re.compile(r"^\s*(\d{1,6})\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _duration(text: str | None) -> timedelta | None:
    """'30d', '12h', '90m', '45s', '2w' -> timedelta; None stays None."""
    if text is None:
        return None
    match = _DURATION.match(text)
    if match is None or int(match.group(1)) == 0:
        raise typer.BadParameter(f"{text!r} is not a duration; write a positive count and a unit "
                                 "s, m, h, d or w, e.g. 30d or 12h", param_hint="--expires-in")
    return timedelta(seconds=int(match.group(1)) * _UNIT_S[match.group(2)])


@contextmanager
def _db_session() -> Iterator[Session]:
    """A session on `CRUCIBLE_DATABASE_URL`; an unreachable database exits 1 with one line."""
    from sqlalchemy.exc import OperationalError

    from db.session import make_engine, make_session_factory

    settings = Settings()
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            yield session
    except OperationalError as exc:
        typer.echo(f"error: cannot reach the database (CRUCIBLE_DATABASE_URL): "
                   f"{str(exc.orig or exc).strip().splitlines()[0]}", err=True)
        raise typer.Exit(code=1) from None
    finally:
        engine.dispose()


@token_app.command("create")
def token_create(name: str = typer.Option("default", help="a label for the token"),
                 expires_in: str | None = typer.Option(
                     None, "--expires-in", help="valid this long, e.g. 30d, 12h, 2w "
                                                "(default: until revoked)")) -> None:
    """Create a write token; it is shown once, alone on the last line."""
    from api.security import create_token
    from db.models import utcnow

    lifetime = _duration(expires_in)
    expires_at = utcnow() + lifetime if lifetime is not None else None
    with _db_session() as session:
        token = create_token(session, name=name, expires_at=expires_at)
    until = f", valid until {_when(expires_at)}" if expires_at else ""
    typer.echo(f"created token {name!r}{until}; store it now, it cannot be shown again:")
    typer.echo(token)


def _when(moment: datetime | None, *, never: str = "-") -> str:
    from api.security import as_utc

    moment = as_utc(moment)
    return never if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


@token_app.command("list")
def token_list() -> None:
    """Every token: id, name, state, created, last used, expires, revoked (never the secret)."""
    from api.security import list_tokens, token_state
    from db.models import utcnow

    with _db_session() as session:
        tokens = list_tokens(session)
    now = utcnow()
    rows = [("ID", "NAME", "STATE", "CREATED", "LAST USED", "EXPIRES", "REVOKED")]
    rows += [(str(token.id), token.name, token_state(token, now=now), _when(token.created_at),
              _when(token.last_used_at, never="never"), _when(token.expires_at),
              _when(token.revoked_at)) for token in tokens]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                   .rstrip())
    if not tokens:
        typer.echo("no tokens yet: `crucible api token create`")


@token_app.command("revoke")
def token_revoke(name_or_id: str = typer.Argument(
        ..., metavar="NAME_OR_ID", help="a token id, or the name of one unrevoked token")) -> None:
    """Revoke a token: it stops working at once, and so do the browser sessions it opened."""
    from api.security import TokenLookupError, revoke_token

    with _db_session() as session:
        try:
            token = revoke_token(session, name_or_id=name_or_id)
        except TokenLookupError as exc:
            raise _usage(str(exc)) from None
        typer.echo(f"revoked token {token.name!r} ({token.id}) at {_when(token.revoked_at)}")


@api_app.command("replay")
def replay(spool_root: Path | None = typer.Option(
               None, "--spool-root", help="spool root to drain (default: CRUCIBLE_SPOOL_DIR, "
                                          "else <CRUCIBLE_WORK_DIR>/spool)"),
           timeout_s: float = typer.Option(
               600.0, "--timeout-s", min=0.0, help="stop after this long; what is left stays "
                                                   "for the next replay")) -> None:
    """Deliver the metrics, events and final states that reporters left in their spools while
    the registry was unreachable, and record as completed every run that no longer owes records.

    Exit 0: nothing is left; 1: records are still owed (the registry is unreachable, another
    process holds a spool, or a spool file cannot be read); 2: a bad option, setting or token.
    Batches the API refuses are kept in `.rejected` files beside their spool, and listed.
    """
    from pydantic import ValidationError

    from crucible.registry.reporting import ApiClient, ApiError, replay_spools
    from crucible.registry.settings import ReporterSettings

    try:
        settings = ReporterSettings()
    except ValidationError as exc:
        raise _usage("; ".join(str(error["msg"]) for error in exc.errors())) from None
    if spool_root is not None and not spool_root.is_dir():
        raise _usage(f"--spool-root {spool_root} is not a folder; pass a spool root "
                     "(CRUCIBLE_SPOOL_DIR, by default <CRUCIBLE_WORK_DIR>/spool)")
    root = spool_root or settings.spool_root
    if not root.is_dir():
        typer.echo(f"no spools under {root}: nothing to replay")
        return
    with ApiClient(settings.api_url, settings.token) as client:
        try:
            report = replay_spools(client, root, timeout_s=timeout_s)
        except ApiError as exc:     # 401/403: nothing else escapes a replay
            raise _usage(f"the registry refused the token ({exc}); set CRUCIBLE_API_TOKEN to a "
                         "valid write token") from None
    typer.echo(f"delivered {report.delivered} records from {root}")
    for run_id in report.finished:
        typer.echo(f"run {run_id}: final state recorded")
    for run_id, owed in sorted(report.owed.items()):
        typer.echo(f"run {run_id}: owes {owed} records")
    for run_id, error in sorted(report.errors.items()):
        typer.echo(f"run {run_id}: the registry refused its final state ({error})", err=True)
    for path in report.held:
        typer.echo(f"skipped (held by another process): {path}")
    for path, why in sorted(report.unreadable.items()):
        typer.echo(f"skipped, cannot read {path}: {why} (its run stays unfinished)", err=True)
    for path, lines in sorted(report.rejected.items()):
        typer.echo(f"{lines} batches refused by the API (or not batches), kept in {path}",
                   err=True)
    if report.unreachable:
        typer.echo(f"registry unreachable, the rest stays spooled: {report.unreachable}", err=True)
    if not report.complete:
        raise typer.Exit(code=1)


class Kind(StrEnum):
    """What a tag or note command edits."""

    run = "run"
    sweep = "sweep"


_REF_HELP = "a run's id; a sweep's id or exact name (the newest sweep of that name)"


@contextmanager
def _registry() -> Iterator[ApiClient]:
    """An API client on `CRUCIBLE_API_URL` with `CRUCIBLE_API_TOKEN`; API errors become one line
    and an exit code (2: refused, 1: unreachable)."""
    from pydantic import ValidationError

    from crucible.registry.client import ApiClient, ApiError, ApiUnavailable
    from crucible.registry.settings import ClientSettings

    try:
        settings = ClientSettings(_env_file=".env")   # a .env file too, as the service reads
    except ValidationError as exc:
        raise _usage("; ".join(str(error["msg"]) for error in exc.errors())) from None
    try:
        with ApiClient(settings.api_url, settings.token, retries=1) as client:
            yield client
    except ApiUnavailable as exc:
        typer.echo(f"error: cannot reach the registry at {settings.api_url} "
                   f"(CRUCIBLE_API_URL): {exc.detail}", err=True)
        raise typer.Exit(code=1) from None
    except ApiError as exc:
        hint = ("; set CRUCIBLE_API_TOKEN to a valid write token (`crucible api token create`)"
                if exc.status_code == 401 else "")
        raise _usage(f"{exc.detail}{hint}") from None


def _edit(kind: Kind, ref: str, changes: dict[str, Any],
          show: Callable[[dict[str, Any]], str]) -> None:
    """PATCH the run or sweep `ref` with `changes` (none: only read it) and print `show(it)`."""
    with _registry() as client:
        if kind is Kind.run:
            try:
                run_id = str(uuid.UUID(ref))
            except ValueError:
                raise _usage(f"REF {ref!r} is not a run id; give the run's UUID (see "
                             "GET /api/v1/runs or the dashboards)") from None
            target = (client.update_run(run_id, **changes) if changes
                      else client.get_run(run_id))
        else:
            target = client.get_sweep(ref)
            if changes:
                target = client.update_sweep(target["id"], **changes)
    typer.echo(f"{kind.value} {target['id']}: {show(target)}")


def _checked_tags(tags: list[str], option: str) -> list[str]:
    from crucible.grid.tags import check_tags

    try:
        return check_tags(tags, field=option)
    except ValueError as exc:
        raise _usage(str(exc)) from None


def _tags_line(target: dict[str, Any]) -> str:
    return "tags " + (", ".join(target["tags"]) if target["tags"] else "(none)")


@api_app.command("tag")
def tag(kind: Kind = typer.Argument(..., help="run or sweep"),
        ref: str = typer.Argument(..., metavar="REF", help=_REF_HELP),
        add: list[str] = typer.Option([], "--add", help="add this tag (repeatable)"),
        remove: list[str] = typer.Option([], "--remove", help="remove this tag (repeatable)")
        ) -> None:
    """Add or remove tags of a run or sweep (in one atomic edit) and print its tags; without
    --add or --remove, print them. A tag is 1-64 characters from A-Za-z0-9._:/+=-."""
    changes: dict[str, Any] = {}
    if add:
        changes["add_tags"] = _checked_tags(add, "--add")
    if remove:
        changes["remove_tags"] = _checked_tags(remove, "--remove")
    _edit(kind, ref, changes, _tags_line)


@api_app.command("note")
def note(kind: Kind = typer.Argument(..., help="run or sweep"),
         ref: str = typer.Argument(..., metavar="REF", help=_REF_HELP),
         text: str | None = typer.Argument(None, help="the new notes (replace the old ones)"),
         clear: bool = typer.Option(False, "--clear", help="remove the notes")) -> None:
    """Set (or --clear) the notes of a run or sweep and print them; with neither, print them."""
    from crucible.grid.tags import MAX_NOTES

    if clear and text is not None:
        raise _usage("give either TEXT or --clear, not both")
    if text is not None and (len(text) > MAX_NOTES or "\x00" in text):
        raise _usage(f"TEXT: notes are at most {MAX_NOTES:,} characters, without NUL")
    changes: dict[str, Any] = {"notes": None} if clear else {}
    if text is not None:
        changes["notes"] = text
    _edit(kind, ref, changes, lambda target: f"notes {target['notes'] or '(none)'}")


def _usage(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


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
