"""Keyset pagination of the registry's lists: opaque cursors and the page query.

A cursor encodes the sort key of the last item returned, so pages stay stable while rows are
inserted. `encode_cursor` / `decode_cursor` turn a key of ints, UTC datetimes and UUIDs into a
fixed-width hex string and back; `cursor_pattern` is the regular expression the routes publish
for it; `keyset_page` runs a query ordered by two columns from a cursor on (`api.crud`,
`api.records`).
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_
from sqlalchemy.orm import Session

from api.errors import InvalidInputError

__all__ = ["cursor_pattern", "encode_cursor", "decode_cursor", "keyset_page"]

# A cursor is the hex of the last item's sort key at a fixed width: 8 bytes per int (signed) or
# timestamp (microseconds since the epoch), 16 per UUID. Every hex string of the right length is
# a position (a timestamp beyond the calendar is clamped), so the routes' `pattern` states
# exactly which cursors are valid, and the published schema and the 422s agree.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_CURSOR_BYTES = {int: 8, datetime: 8, uuid.UUID: 16}
_MIN_US = (datetime.min.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)
_MAX_US = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)


def cursor_pattern(kinds: Sequence[type]) -> str:
    """The regular expression every cursor of a sort key of these `kinds` matches."""
    return f"^[0-9a-fA-F]{{{2 * sum(_CURSOR_BYTES[kind] for kind in kinds)}}}$"


def _cursor_bytes(value: Any) -> bytes:
    if isinstance(value, uuid.UUID):
        return value.bytes
    if isinstance(value, datetime):  # SQLite returns naive timestamps, written in UTC
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        value = (moment - _EPOCH) // timedelta(microseconds=1)
    return int(value).to_bytes(8, "big", signed=True)


def encode_cursor(key: Sequence[Any]) -> str:
    """Opaque cursor for a sort key of ints, UTC datetimes and UUIDs."""
    return b"".join(_cursor_bytes(value) for value in key).hex()


def _cursor_part(kind: type, raw: bytes) -> Any:
    if kind is uuid.UUID:
        return uuid.UUID(bytes=raw)
    number = int.from_bytes(raw, "big", signed=True)
    if kind is datetime:
        return _EPOCH + timedelta(microseconds=min(max(number, _MIN_US), _MAX_US))
    return number


def decode_cursor(cursor: str, *, kinds: Sequence[type]) -> list[Any]:
    """Decode a cursor made by `encode_cursor` whose parts have the given `kinds`
    (int, datetime, uuid.UUID). Raises InvalidInputError naming `cursor` otherwise."""
    if not re.fullmatch(cursor_pattern(kinds)[1:-1], cursor):
        raise InvalidInputError("cursor is not one this API returned; pass next_cursor from the "
                                "previous page, or omit it for the first page",
                                field="query.cursor")
    raw = bytes.fromhex(cursor)
    parts, offset = [], 0
    for kind in kinds:
        width = _CURSOR_BYTES[kind]
        parts.append(_cursor_part(kind, raw[offset:offset + width]))
        offset += width
    return parts


def keyset_page(session: Session, query: Any, *, columns: tuple[Any, Any],
                kinds: tuple[type, type], limit: int,
                cursor: str | None) -> tuple[list[Any], str | None]:
    """Run `query` ordered by the two `columns` (the last one unique), starting after `cursor`;
    return at most `limit` rows and the cursor of the next page (None on the last page)."""
    c0, c1 = columns
    if cursor is not None:
        v0, v1 = decode_cursor(cursor, kinds=kinds)
        query = query.where(or_(c0 > v0, and_(c0 == v0, c1 > v1)))  # (c0, c1) > (v0, v1)
    rows = list(session.scalars(query.order_by(c0, c1).limit(limit + 1)))
    if len(rows) <= limit:
        return rows, None
    last = rows[limit - 1]
    key = [getattr(last, c.key) for c in columns]
    return rows[:limit], encode_cursor(key)
