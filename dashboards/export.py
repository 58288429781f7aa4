"""Offline export: one self-contained HTML file of a sweep's dashboard.

The file embeds plotly.js once (inline) and every figure's data, so it opens from disk with no
server and no internet. It is written atomically: to a temporary file in the target folder, then
renamed over the target, so a reader never sees half a report and a failure leaves any previous
report intact. Run pages are not embedded (a 200-run sweep would be hundreds of figures); the
runs table lists every run's numbers instead.
"""
from __future__ import annotations

import logging
import os
import tempfile
import uuid
from pathlib import Path

from sqlalchemy.orm import Session

from dashboards import pages, queries
from db.session import make_engine, make_session_factory

__all__ = ["write_report", "render_report"]

_log = logging.getLogger(__name__)


def render_report(session: Session, sweep_id: uuid.UUID | str) -> str:
    """The offline sweep page as one HTML string (plotly.js inlined once).

    Raises `api.errors.NotFoundError` for an unknown sweep, `ValueError` for a malformed id.
    """
    view = queries.sweep_view(session, sweep_id=_as_uuid(sweep_id))
    return pages.sweep_page(view, plotly_tag=pages.inline_plotly_tag(), run_href=None)


def _as_uuid(sweep_id: uuid.UUID | str) -> uuid.UUID:
    if isinstance(sweep_id, uuid.UUID):
        return sweep_id
    try:
        return uuid.UUID(str(sweep_id))
    except ValueError:
        raise ValueError(f"sweep id {sweep_id!r} is not a UUID; pass the id that "
                         "`crucible sweep` printed or /api/v1/sweeps lists") from None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(sweep_id: uuid.UUID | str, out_path: str | os.PathLike[str], *,
                 session: Session | None = None, database_url: str | None = None) -> Path:
    """Write the offline dashboard of `sweep_id` to `out_path`; return the written path.

    Reads through `session` when given, else opens `database_url` (default: the registry's
    settings, `CRUCIBLE_DATABASE_URL`). Nothing is written if the sweep does not exist
    (`api.errors.NotFoundError`) or the id is malformed (`ValueError`).
    """
    path = Path(out_path)
    if session is not None:
        text = render_report(session, sweep_id)
    else:
        if database_url is None:
            from api.settings import Settings  # noqa: PLC0415 - read settings only when needed
            database_url = Settings().database_url
        engine = make_engine(database_url)
        try:
            with make_session_factory(engine)() as own_session:
                text = render_report(own_session, sweep_id)
        finally:
            engine.dispose()
    _write_atomic(path, text)
    _log.info("wrote sweep report %s (%.1f MB)", path, len(text.encode()) / 1e6)
    return path
