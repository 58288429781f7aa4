"""Tags and notes of runs and sweeps: the rule the command line (`--tag`, `--note`) and the sweep
form (`SweepSpec.tags`, `.notes`) check before anything reaches the registry, the same rule the
REST schemas enforce (api.schemas: Tags, Notes).

A tag is 1-64 characters from `A-Za-z0-9._:/+=-` (no spaces: `key:value` and `a/b` work, and a tag
is safe in a URL query and as a Prefect tag); an object carries at most 32, stored de-duplicated
and sorted. Notes are free text of at most 10,000 characters. Only stdlib: importing this never
imports torch.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MAX_NOTES", "MAX_TAGS", "TAG_PATTERN", "TAG_RULE", "check_notes", "check_tags"]

TAG_PATTERN = r"^[A-Za-z0-9._:/+=-]{1,64}$"
MAX_TAGS = 32
MAX_NOTES = 10_000
TAG_RULE = f"1-64 characters from A-Za-z0-9._:/+=- (no spaces), at most {MAX_TAGS} tags"
_TAG = re.compile(TAG_PATTERN)


def check_tags(values: Iterable[str], *, field: str) -> list[str]:
    """`values` de-duplicated and sorted. Raises ValueError naming `field`, the first bad tag and
    the rule (or the count, when there are more than `MAX_TAGS` distinct tags)."""
    tags = sorted(set(values))
    for tag in tags:
        if not _TAG.fullmatch(tag):
            raise ValueError(f"{field} {tag[:80]!r} is not a valid tag: a tag is {TAG_RULE}, "
                             "e.g. baseline, lr:3e-4 or paper/fig3")
    if len(tags) > MAX_TAGS:
        raise ValueError(f"{field}: {len(tags)} distinct tags, at most {MAX_TAGS} allowed")
    return tags


def check_notes(value: str | None, *, field: str) -> str | None:
    """`value` (None or empty: no notes). Raises ValueError naming `field` when it is longer than
    `MAX_NOTES` characters."""
    if not value:
        return None
    if len(value) > MAX_NOTES:
        raise ValueError(f"{field} has {len(value)} characters, at most {MAX_NOTES} allowed")
    return value
