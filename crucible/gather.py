"""Gathering one stage's contributions through an object store, with an agreed set.

Object keys (unique per run, global step, stage and replica):

    <run>/<global_step:08d>/stage-<s>/replica-<r>       one contribution blob
    <run>/<global_step:08d>/stage-<s>/manifest.json     the agreed set, written once

Nothing is all-reduced. After the upload phase, `agree` lists what arrived, downloads and
validates each object (the decoder's checks, plus: the header's stage, replica and step match the
key), and writes the manifest with a create-if-absent write: the first writer wins, and a peer
that finds a manifest already there (another peer's, or its own before a resume) adopts it.
Every peer therefore aggregates exactly the same list. A bad or missing object is excluded and
recorded in the manifest; it never fails the round. Transient store errors propagate, for the
orchestration layer to retry.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from crucible.events import Event
from crucible.sparseloco import Contribution, InvalidContribution
from crucible.store import KeyNotFound, Store, validate_key

__all__ = ["Manifest", "Rejection", "InvalidManifest", "contribution_key", "manifest_key",
           "upload_contribution", "agree", "load_agreed", "manifest_events", "MANIFEST_VERSION"]

log = logging.getLogger(__name__)
MANIFEST_VERSION = 1
_REPLICA_NAME = re.compile(r"replica-(0|[1-9][0-9]{0,8})")
Decode = Callable[[bytes], Contribution]
# Validates a round's blobs at once: per blob, what `Decode` returns for it or the
# InvalidContribution it raises.
DecodeMany = Callable[[Sequence[bytes]], Sequence[Contribution | InvalidContribution]]


class InvalidManifest(ValueError):
    """A manifest object cannot be parsed; peers cannot agree on the set for that stage."""


def _stage_prefix(run: str, global_step: int, stage: int) -> str:
    if global_step < 0 or stage < 0:
        raise ValueError(f"global_step and stage must be >= 0, got {global_step}, {stage}")
    return validate_key(f"{run}/{global_step:08d}/stage-{stage}")


def contribution_key(run: str, global_step: int, stage: int, replica: int) -> str:
    """Key of replica `replica`'s contribution to `stage` at `global_step`."""
    if replica < 0:
        raise ValueError(f"replica must be >= 0, got {replica}")
    return f"{_stage_prefix(run, global_step, stage)}/replica-{replica}"


def manifest_key(run: str, global_step: int, stage: int) -> str:
    return f"{_stage_prefix(run, global_step, stage)}/manifest.json"


@dataclass(frozen=True)
class Rejection:
    replica: int
    reason: str


@dataclass
class Manifest:
    """The agreed set of one (run, global step, stage).

    `included`: replicas whose contributions every peer aggregates, ascending. `rejected`: those
    whose object failed validation, with the reason. `missing`: expected replicas with no object.
    `sizes`: bytes of each included object. `contributions` (not serialised) caches the decoded
    contributions when this process validated them, so `load_agreed` need not download twice.
    """

    run: str
    global_step: int
    stage: int
    expected: list[int]
    included: list[int]
    rejected: list[Rejection]
    missing: list[int]
    sizes: dict[int, int] = field(default_factory=dict)
    contributions: dict[int, Contribution] = field(default_factory=dict, repr=False,
                                                   compare=False)

    def to_json(self) -> bytes:
        body = {"version": MANIFEST_VERSION, "run": self.run, "global_step": self.global_step,
                "stage": self.stage, "expected": self.expected, "included": self.included,
                "rejected": [{"replica": r.replica, "reason": r.reason} for r in self.rejected],
                "missing": self.missing, "sizes": {str(r): n for r, n in self.sizes.items()}}
        return json.dumps(body, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest; raises InvalidManifest naming what is wrong."""
        try:
            body: dict[str, Any] = json.loads(data)
            if body.get("version") != MANIFEST_VERSION:
                raise InvalidManifest(f"manifest version {body.get('version')!r} is not "
                                      f"{MANIFEST_VERSION}")
            return cls(run=str(body["run"]), global_step=int(body["global_step"]),
                       stage=int(body["stage"]), expected=[int(r) for r in body["expected"]],
                       included=[int(r) for r in body["included"]],
                       rejected=[Rejection(int(x["replica"]), str(x["reason"]))
                                 for x in body["rejected"]],
                       missing=[int(r) for r in body["missing"]],
                       sizes={int(r): int(n) for r, n in body.get("sizes", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, InvalidManifest):
                raise
            raise InvalidManifest(f"unreadable manifest: {exc!r}") from None


def upload_contribution(store: Store, run: str, global_step: int, stage: int, replica: int,
                        blob: bytes) -> str:
    """Write one contribution blob; returns its key. Not fsync'd (`durable=False`): a resumed
    run re-encodes and re-uploads the same bytes before it reads them."""
    key = contribution_key(run, global_step, stage, replica)
    store.put(key, blob, durable=False)
    return key


def _check_header(c: Contribution, *, stage: int, replica: int, global_step: int) -> None:
    got, want = (c.stage, c.replica, c.global_step), (stage, replica, global_step)
    if got != want:
        raise InvalidContribution(
            f"header says stage {c.stage}, replica {c.replica}, step {c.global_step} but the "
            f"object is stored as stage {stage}, replica {replica}, step {global_step}")


def _arrived(store: Store, prefix: str) -> dict[int, str]:
    """replica -> key of every contribution object under `prefix/`."""
    found = {}
    for key in store.list(prefix + "/"):
        name = key[len(prefix) + 1:]
        match = _REPLICA_NAME.fullmatch(name)
        if match:
            found[int(match.group(1))] = key
        elif name != "manifest.json":
            log.warning("ignoring unexpected object %r in %r", key, prefix)
    return found


def _validate(store: Store, key: str, decode: Decode, *, stage: int, replica: int,
              global_step: int) -> tuple[Contribution | None, str | None, int]:
    """(contribution, None, size) if valid, (None, reason, size) if not; KeyNotFound if gone."""
    blob = store.get(key)
    contribution, reason = _validate_all({replica: blob}, decode, None, stage=stage,
                                         global_step=global_step)[replica]
    return contribution, reason, len(blob)


def _build(store: Store, run: str, global_step: int, stage: int, expected: list[int],
           decode: Decode, decode_many: DecodeMany | None) -> Manifest:
    prefix = _stage_prefix(run, global_step, stage)
    arrived = _arrived(store, prefix)
    manifest = Manifest(run=run, global_step=global_step, stage=stage, expected=expected,
                        included=[], rejected=[], missing=[])
    blobs: dict[int, bytes] = {}
    for replica in sorted(set(expected) | set(arrived)):
        if replica not in arrived:
            manifest.missing.append(replica)
        elif replica not in expected:
            manifest.rejected.append(Rejection(replica, f"replica {replica} is not in the "
                                                        f"expected set {expected}"))
        else:
            try:
                blobs[replica] = store.get(arrived[replica])
            except KeyNotFound:  # deleted between list and get: it did not arrive
                manifest.missing.append(replica)
    for replica, (contribution, reason) in _validate_all(blobs, decode, decode_many, stage=stage,
                                                         global_step=global_step).items():
        if contribution is None:
            manifest.rejected.append(Rejection(replica, str(reason)))
            log.warning("step %d stage %d: rejected replica %d: %s", global_step, stage,
                        replica, reason)
        else:
            manifest.included.append(replica)
            manifest.sizes[replica] = len(blobs[replica])
            manifest.contributions[replica] = contribution
    manifest.missing.sort()
    manifest.rejected.sort(key=lambda r: r.replica)
    return manifest


def _validate_all(blobs: dict[int, bytes], decode: Decode, decode_many: DecodeMany | None, *,
                  stage: int, global_step: int,
                  ) -> dict[int, tuple[Contribution | None, str | None]]:
    """replica -> (contribution, None) or (None, reason) for each blob, ascending; the header
    must name the stage, replica and step the blob is stored as."""
    replicas = sorted(blobs)
    results = (decode_many([blobs[r] for r in replicas]) if decode_many is not None
               else [_decoded(decode, blobs[r]) for r in replicas])
    out: dict[int, tuple[Contribution | None, str | None]] = {}
    for r, result in zip(replicas, results, strict=True):
        try:
            if isinstance(result, InvalidContribution):
                raise result
            _check_header(result, stage=stage, replica=r, global_step=global_step)
            out[r] = (result, None)
        except InvalidContribution as exc:
            out[r] = (None, exc.reason)
    return out


def _decoded(decode: Decode, blob: bytes) -> Contribution | InvalidContribution:
    try:
        return decode(blob)
    except InvalidContribution as exc:
        return exc


def agree(store: Store, run: str, global_step: int, stage: int, *,
          expected_replicas: int | Iterable[int], decode: Decode,
          decode_many: DecodeMany | None = None) -> Manifest:
    """The agreed set for (run, global step, stage), written once to the store.

    `expected_replicas`: a count R (replicas 0..R-1) or the replica ids expected to contribute.
    `decode(blob)` must return a validated Contribution or raise InvalidContribution. If a
    manifest already exists it is returned as is (its `contributions` cache empty). Raises
    InvalidManifest if an existing manifest is unreadable, StoreError on store failures.
    `decode_many`, when given, validates all downloaded blobs in one call (with the verdicts
    `decode` would give); `decode` then serves only single re-downloads.
    """
    expected = (list(range(expected_replicas)) if isinstance(expected_replicas, int)
                else sorted(set(expected_replicas)))
    key = manifest_key(run, global_step, stage)
    if store.exists(key):
        return _adopt(store, key, None)
    manifest = _build(store, run, global_step, stage, expected, decode, decode_many)
    if store.put_if_absent(key, manifest.to_json()):
        return manifest
    return _adopt(store, key, manifest)  # another peer wrote first: its set is the agreed one


def _adopt(store: Store, key: str, ours: Manifest | None) -> Manifest:
    manifest = Manifest.from_json(store.get(key))
    if ours is not None:
        manifest.contributions = {r: c for r, c in ours.contributions.items()
                                  if r in manifest.included and
                                  ours.sizes.get(r) == manifest.sizes.get(r)}
    return manifest


def load_agreed(store: Store, manifest: Manifest, decode: Decode) -> list[Contribution]:
    """The decoded contributions of `manifest.included`, in replica order (cached ones are not
    downloaded again). Raises InvalidManifest if an agreed object is gone or no longer valid:
    this peer cannot reproduce the agreed aggregate."""
    out = []
    for replica in manifest.included:
        cached = manifest.contributions.get(replica)
        if cached is not None:
            out.append(cached)
            continue
        key = contribution_key(manifest.run, manifest.global_step, manifest.stage, replica)
        try:
            contribution, reason, _ = _validate(store, key, decode, stage=manifest.stage,
                                                replica=replica,
                                                global_step=manifest.global_step)
        except KeyNotFound:
            raise InvalidManifest(f"agreed contribution {key!r} is missing from the store") from None
        if contribution is None:
            raise InvalidManifest(f"agreed contribution {key!r} no longer validates: {reason}")
        manifest.contributions[replica] = contribution
        out.append(contribution)
    return out


def manifest_events(manifest: Manifest, *, absent_ok: Sequence[int] = ()) -> list[Event]:
    """`contribution_rejected` and `contribution_missing` events of a manifest, for the trainer's
    callback. Replicas in `absent_ok` (e.g. whose stage was down by design) raise no missing event."""
    events = [Event(kind="contribution_rejected", global_step=manifest.global_step,
                    replica=r.replica, stage=manifest.stage, detail={"reason": r.reason})
              for r in manifest.rejected]
    events += [Event(kind="contribution_missing", global_step=manifest.global_step, replica=r,
                     stage=manifest.stage, detail={})
               for r in manifest.missing if r not in absent_ok]
    return events
