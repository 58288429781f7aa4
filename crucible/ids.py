"""Identifiers that become folder names or object-store keys: one rule, checked at every edge.

A run id, a run key (the store prefix of a run), a sweep name or a study cell id ends up as one
path segment (`<work>/runs/<run_id>`, `<store>/<run_key>/checkpoints/...`), so it must not be
able to name anything else: no '/', no '..', not absolute, nothing a shell or a file system
treats specially. The rule is a safe slug, `[A-Za-z0-9][A-Za-z0-9._-]{0,127}` without '..'
(which also admits every UUID in its canonical form). Callers pass the field's name, so the
error says which input was wrong; `InvalidId` is a `ConfigError`, so every command maps it to
exit 2 and the flows never retry it.
"""
from __future__ import annotations

import re

from crucible.config import ConfigError

__all__ = ["InvalidId", "ID_RULE", "validate_id"]

ID_RULE = "1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, no '..'"
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class InvalidId(ConfigError):
    """An identifier that would not be a single, safe path segment or key segment."""


def validate_id(value: object, *, field: str) -> str:
    """Return `value` if it is a safe identifier (see `ID_RULE`), else raise `InvalidId` naming
    `field`, the value and the rule. Never normalises: a value is accepted as given or refused."""
    if not isinstance(value, str) or not _SAFE.fullmatch(value) or ".." in value:
        shown = value if not isinstance(value, str) else value[:200]
        raise InvalidId(f"{field}={shown!r} is not a valid id: it becomes a folder name and a "
                        f"store key, so it must be {ID_RULE} (a UUID or a slug such as "
                        "'run-0a1b2c')")
    return value
