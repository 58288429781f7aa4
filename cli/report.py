"""The report command on the `crucible` command line (registered by cli.main): the offline
dashboard of a sweep, read from the registry's database (`api.dashboards.export`).

- `crucible report SWEEP --out FILE.html [--database-url URL]` writes the offline report of a
  sweep (SWEEP: its id or exact name; the newest sweep of that name): one self-contained HTML
  file with the sweep page and every run's page, linked. `--sweep SWEEP` is the older spelling
  and still works. The database defaults to the registry's settings (`CRUCIBLE_DATABASE_URL`).
  Exit 0 on success, 2 for an unknown sweep or an unreadable database (nothing is written then).
"""
from __future__ import annotations

import uuid
from pathlib import Path

import typer

__all__ = ["register", "report"]


def _unknown(ref: str) -> str:
    if _is_uuid(ref):
        return f"sweep {ref} does not exist (GET /api/v1/sweeps lists the sweeps)"
    return (f"{ref!r} is not a UUID and no sweep is named exactly so; pass a sweep's id or its "
            "exact name (GET /api/v1/sweeps lists them)")


def _is_uuid(ref: str) -> bool:
    try:
        uuid.UUID(ref)
    except ValueError:
        return False
    return True


def report(
    sweep_ref: str | None = typer.Argument(
        None, metavar="SWEEP", help="the sweep's id (a UUID) or its exact name", show_default=False),
    out: Path = typer.Option(..., "--out", help="the HTML file to write", dir_okay=False),
    sweep: str | None = typer.Option(None, "--sweep", help="same as SWEEP (older spelling)",
                                     hidden=True),
    database_url: str | None = typer.Option(
        None, "--database-url", help="registry database (default: CRUCIBLE_DATABASE_URL)"),
) -> None:
    """Write the offline report of a sweep (its page and every run's page) to one HTML file."""
    from sqlalchemy.exc import OperationalError, ProgrammingError  # noqa: PLC0415

    from api.dashboards.export import write_report  # noqa: PLC0415
    from api.errors import NotFoundError  # noqa: PLC0415 - keep `crucible --help` fast

    if (sweep_ref is None) == (sweep is None):
        typer.echo("error: SWEEP: give the sweep's id or name once, e.g. "
                   "`crucible report my-sweep --out report.html`", err=True)
        raise typer.Exit(code=2)
    ref = sweep_ref if sweep_ref is not None else sweep
    assert ref is not None
    try:
        path = write_report(ref, out, database_url=database_url)
    except NotFoundError:
        typer.echo(f"error: SWEEP: {_unknown(ref)}", err=True)
        raise typer.Exit(code=2) from None
    except (OperationalError, ProgrammingError) as exc:
        typer.echo(f"error: --database-url: cannot read the registry ({exc.orig}); check the URL "
                   "and run `crucible db upgrade` on a new database", err=True)
        raise typer.Exit(code=2) from None
    size_mb = path.stat().st_size / 1e6
    typer.echo(f"wrote {path} ({size_mb:.1f} MB); open it in a browser, no server needed")


def register(app: typer.Typer) -> None:
    """Add this package's commands to the `crucible` command line."""
    app.command("report")(report)
