"""Command-line commands contributed by the `dashboards` package (registered by crucible.cli).

- `crucible report --sweep ID --out FILE.html [--database-url URL]` writes the offline dashboard
  of a sweep (one self-contained HTML file). The database defaults to the registry's settings
  (`CRUCIBLE_DATABASE_URL`). Exit 0 on success, 2 for an unknown or malformed sweep id or an
  unreadable database (nothing is written then).
"""
from __future__ import annotations

from pathlib import Path

import typer

__all__ = ["register", "report"]


def report(
    sweep: str = typer.Option(..., "--sweep", help="the sweep's id (a UUID)"),
    out: Path = typer.Option(..., "--out", help="the HTML file to write", dir_okay=False),
    database_url: str | None = typer.Option(
        None, "--database-url", help="registry database (default: CRUCIBLE_DATABASE_URL)"),
) -> None:
    """Write the offline robustness dashboard of a sweep to one self-contained HTML file."""
    from sqlalchemy.exc import OperationalError, ProgrammingError  # noqa: PLC0415

    from api.errors import NotFoundError  # noqa: PLC0415 - keep `crucible --help` fast
    from dashboards.export import write_report  # noqa: PLC0415

    try:
        path = write_report(sweep, out, database_url=database_url)
    except (NotFoundError, ValueError) as exc:
        typer.echo(f"error: --sweep: {exc}", err=True)
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
