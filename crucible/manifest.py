"""The manifest of a gather round: the agreed set of one (run, global step, stage) as data.

`Manifest` holds what a peer derived for a round (included replicas with their sizes and
BLAKE2b digests, rejected ones with the reason, missing ones); `to_json` / `from_json` are its
stored form (version `MANIFEST_VERSION`), and `from_json` refuses, as `InvalidManifest` naming
the problem, anything unreadable or not self-consistent. `manifest_limit` bounds a manifest's
size for a run's replica count; `manifest_events` turns a manifest into the trainer's events.
How the set is derived, written and agreed on through a store is `crucible.gather`'s.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from crucible.events import MAX_DETAIL_TEXT, Event, detail_text, event_id
from crucible.sparseloco import Contribution

__all__ = ["Manifest", "Rejection", "InvalidManifest", "manifest_events", "manifest_limit",
           "MANIFEST_VERSION", "MAX_STRANGERS"]

MANIFEST_VERSION = 2
MAX_STRANGERS = 16                   # objects of replicas outside the run recorded per round


class InvalidManifest(ValueError):
    """A manifest object cannot be used; `reason` says why."""


def manifest_limit(replicas: int) -> int:
    """Most bytes a manifest of a round with `replicas` replicas can take (what `crucible.gather`
    writes stays under it; a larger object is refused unread)."""
    per_entry = 64 + 2 * MAX_DETAIL_TEXT + 64   # ids, a JSON-escaped reason, size and digest
    return 4096 + per_entry * (replicas + MAX_STRANGERS)


@dataclass(frozen=True)
class Rejection:
    replica: int
    reason: str


@dataclass
class Manifest:
    """The agreed set of one (run, global step, stage).

    `included`: replicas whose contributions every peer aggregates, ascending. `rejected`: those
    whose object was refused, with the reason. `missing`: expected replicas with no object.
    `sizes` / `digests`: bytes and BLAKE2b-128 (hex) of each included object. Not serialised:
    `contributions` caches the decoded contributions this process validated; `key` is where the
    set was agreed (None: every manifest key held an invalid manifest, the stage skips its
    outer step); `superseded` lists (key, reason) of the invalid manifests passed over.
    """

    run: str
    global_step: int
    stage: int
    expected: list[int]
    included: list[int]
    rejected: list[Rejection]
    missing: list[int]
    sizes: dict[int, int] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    contributions: dict[int, Contribution] = field(default_factory=dict, repr=False,
                                                   compare=False)
    key: str | None = field(default=None, compare=False)
    superseded: list[tuple[str, str]] = field(default_factory=list, compare=False)

    def to_json(self) -> bytes:
        body = {"version": MANIFEST_VERSION, "run": self.run, "global_step": self.global_step,
                "stage": self.stage, "expected": self.expected, "included": self.included,
                "rejected": [{"replica": r.replica, "reason": r.reason} for r in self.rejected],
                "missing": self.missing, "sizes": {str(r): n for r, n in self.sizes.items()},
                "digests": {str(r): d for r, d in self.digests.items()}}
        return json.dumps(body, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest and check that it is self-consistent; raises InvalidManifest
        naming what is wrong."""
        try:
            body: dict[str, Any] = json.loads(data)
            if not isinstance(body, dict) or body.get("version") != MANIFEST_VERSION:
                version = body.get("version") if isinstance(body, dict) else None
                raise InvalidManifest(f"manifest version {version!r} is not {MANIFEST_VERSION}")
            manifest = cls(run=_text(body["run"]), global_step=_count(body["global_step"]),
                           stage=_count(body["stage"]), expected=_counts(body["expected"]),
                           included=_counts(body["included"]),
                           rejected=[Rejection(_count(x["replica"]), _text(x["reason"]))
                                     for x in body["rejected"]],
                           missing=_counts(body["missing"]),
                           sizes={_count(int(r)): _count(n) for r, n in body["sizes"].items()},
                           digests={_count(int(r)): _text(d)
                                    for r, d in body["digests"].items()})
        except InvalidManifest:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise InvalidManifest(detail_text(f"unreadable manifest: {exc!r}")) from None
        manifest._check_consistent()
        return manifest

    def _check_consistent(self) -> None:
        rejected = [r.replica for r in self.rejected]
        groups = (self.included, rejected, self.missing)
        if sum(map(len, groups)) != len(set().union(*groups)):
            raise InvalidManifest("a replica is listed twice among included, rejected, missing")
        if not set(self.included) | set(self.missing) <= set(self.expected):
            raise InvalidManifest("included or missing replicas outside the expected set")
        if not set(self.expected) <= set().union(*groups):
            raise InvalidManifest("an expected replica is neither included, rejected nor missing")
        if set(self.sizes) != set(self.included) or set(self.digests) != set(self.included):
            raise InvalidManifest("sizes and digests must name exactly the included replicas")


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _counts(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise ValueError(f"{values!r} is not a list")
    return [_count(v) for v in values]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def manifest_events(manifest: Manifest, *, absent_ok: Sequence[int] = ()) -> list[Event]:
    """Events of a manifest for the trainer's callback: `manifest_rejected` for each invalid
    manifest passed over (detail: key, reason), `contribution_rejected` and
    `contribution_missing`. Replicas in `absent_ok` (e.g. whose stage was down by design)
    raise no missing event."""
    g, stage = manifest.global_step, manifest.stage
    events = [Event(kind="manifest_rejected", global_step=g, stage=stage,
                    detail={"key": key, "reason": reason},
                    id=event_id("manifest_rejected", g, None, stage, ordinal))
              for ordinal, (key, reason) in enumerate(manifest.superseded)]
    events += [Event(kind="contribution_rejected", global_step=g, replica=r.replica, stage=stage,
                     detail={"reason": r.reason}) for r in manifest.rejected]
    events += [Event(kind="contribution_missing", global_step=g, replica=r, stage=stage,
                     detail={}) for r in manifest.missing if r not in absent_ok]
    return events
