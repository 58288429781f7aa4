"""Gathering one stage's contributions through an object store, with an agreed set.

Object keys (unique per run, global step, stage and replica):

    <run>/<global_step:08d>/stage-<s>/replica-<r>         one contribution blob
    <run>/<global_step:08d>/stage-<s>/manifest.json       the agreed set, written once
    <run>/<global_step:08d>/stage-<s>/manifest-<n>.json   its successors, n = 1..7 (see below)

Nothing is all-reduced. Agreement starts after the round's upload barrier: every contribution a
peer will make this round is in the store (S3 and a directory both list what was written before
the listing). Each peer then derives the round's set the same way - a pure function of the
listed objects and of what the run's own fault plan says:

- an object larger than the largest valid blob of the stage is rejected unread (its size comes
  from the listing; `get` is bounded too, in case the object grew since);
- a replica the plan has idle this round (its stage down, or the replica dropped) trained
  nothing, so an object in its slot is forged: rejected, whatever it holds;
- every other object is validated (the decoder's checks; an entry that is not a regular file,
  such as a FIFO, is rejected unread) and its header must name this slot: stage, replica,
  global step and run (`sparseloco.run_tag`); a blob of an earlier round or of another run is
  rejected;
- among the valid contributions, one with a tensor whose norm exceeds `max_norm_ratio` times that
  tensor's median over the round's contributions (at least three) is rejected; the aggregation
  still clips the rest to the median (Templar's rule).

The manifest records that derivation (included, rejected with reasons, missing, sizes and a
BLAKE2b digest per included blob) with a create-if-absent write. A peer that finds a manifest
already there (another peer's, or its own before a resume) adopts it only if it equals its own
derivation; otherwise the manifest is invalid - unreadable, too large, not a file (a directory
or FIFO at the key), or not what the store holds (forged, planted before the uploads, an agreed
blob changed or gone) - and is *rejected*: reported as a `manifest_rejected` event, and the
peer moves on to the next versioned key, `manifest-1.json`, ..., where the same rule applies.
Every honest peer reads the same keys in the same order and judges them by the same pure rule,
so all of them settle on the same key and the same set, and a resumed run replays the walk
exactly (a key that is taken but not yet readable is read again, not passed over). If all `MAX_MANIFESTS` keys hold
invalid manifests (someone keeps planting them), the stage skips its outer step: again the same
decision on every peer. Limits: a peer that aggregated under a manifest before an agreed blob was
changed cannot be corrected afterwards (the change is detected and reported, not undone); see
ALGORITHMS.md, "What a dishonest peer can and cannot do to a round". Transient store errors
propagate, for the orchestration layer to retry.

Late arrivals (`agree(..., late_ok=True)`, the distributed mode, `crucible.distributed`): there
the peers are separate processes with no upload barrier; each waits for the round's expected
contributions until its deadline, and a contribution may land after another peer has written the
manifest without it. A peer whose own derivation then differs from the stored manifest derives
the round again with every replica that manifest lists as missing, and that is now present,
counted as not arrived; it adopts the stored manifest only if that derivation matches it
exactly (included, missing, rejected with their reasons, sizes, digests), so every verdict,
outliers against the round's median included, is taken on the set the writer saw. The price:
a dishonest peer can also leave an honest contribution out of one round by writing the
manifest early (it cannot add or change one).

The manifest itself (the `Manifest` type, its JSON form and self-consistency checks, its size
bound and its events) is `crucible.manifest`'s; this module derives, writes and agrees on it.
"""
from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from crucible.events import MAX_DETAIL_TEXT, detail_text
from crucible.manifest import (
    MAX_STRANGERS,
    InvalidManifest,
    Manifest,
    Rejection,
    manifest_limit,
)
from crucible.sparseloco import Contribution, InvalidContribution, run_tag, tensor_norm_ratios
from crucible.store import (
    InvalidObject,
    KeyNotFound,
    ObjectTooLarge,
    Store,
    TransientStoreError,
    validate_key,
)

__all__ = ["contribution_key", "manifest_key", "upload_contribution", "agree", "load_agreed",
           "prune_rounds", "MAX_MANIFESTS"]

log = logging.getLogger(__name__)
MAX_MANIFESTS = 8                    # manifest.json, then manifest-1.json .. manifest-7.json
_SETTLE_ATTEMPTS, _SETTLE_BACKOFF_S = 5, 0.1   # a manifest key taken, not yet readable: 1.5 s
_REPLICA_NAME = re.compile(r"replica-(0|[1-9][0-9]{0,8})")
_MANIFEST_NAME = re.compile(r"manifest(-[1-9][0-9]*)?\.json")
_ROUND = re.compile(r"([0-9]{8})/")
Decode = Callable[[bytes], Contribution]
# Validates a round's blobs at once: per blob, what `Decode` returns for it or the
# InvalidContribution it raises.
DecodeMany = Callable[[Sequence[bytes]], Sequence[Contribution | InvalidContribution]]


def _stage_prefix(run: str, global_step: int, stage: int) -> str:
    if global_step < 0 or stage < 0:
        raise ValueError(f"global_step and stage must be >= 0, got {global_step}, {stage}")
    return validate_key(f"{run}/{global_step:08d}/stage-{stage}")


def contribution_key(run: str, global_step: int, stage: int, replica: int) -> str:
    """Key of replica `replica`'s contribution to `stage` at `global_step`."""
    if replica < 0:
        raise ValueError(f"replica must be >= 0, got {replica}")
    return f"{_stage_prefix(run, global_step, stage)}/replica-{replica}"


def manifest_key(run: str, global_step: int, stage: int, *, version: int = 0) -> str:
    """Key of the `version`-th manifest of a (run, step, stage): 0 is `manifest.json`."""
    if not 0 <= version < MAX_MANIFESTS:
        raise ValueError(f"manifest version must be in [0, {MAX_MANIFESTS}), got {version}")
    name = "manifest.json" if version == 0 else f"manifest-{version}.json"
    return f"{_stage_prefix(run, global_step, stage)}/{name}"


def upload_contribution(store: Store, run: str, global_step: int, stage: int, replica: int,
                        blob: bytes, *, if_absent: bool = False) -> str | None:
    """Write one contribution blob; returns its key. Not fsync'd (`durable=False`): a resumed
    run re-encodes and re-uploads the same bytes before it reads them. `if_absent` (the
    distributed mode, where a restarted process may upload again into a round a peer has
    already agreed on): create only, and return None if the key is taken."""
    key = contribution_key(run, global_step, stage, replica)
    if if_absent:
        return key if store.put_if_absent(key, blob) else None
    store.put(key, blob, durable=False)
    return key


@dataclass(frozen=True)
class _Round:
    """What a peer knows of one (run, step, stage) before it reads the store."""

    run: str
    global_step: int
    stage: int
    expected: list[int]                 # replicas the plan has contributing, ascending
    idle: Mapping[int, str]             # replica -> why it must not contribute this round
    max_blob_bytes: int
    max_norm_ratio: float

    @property
    def prefix(self) -> str:
        return _stage_prefix(self.run, self.global_step, self.stage)


def _arrived(store: Store, rnd: _Round) -> dict[int, tuple[str, int]]:
    """replica -> (key, size) of every contribution object of the round."""
    found = {}
    for key, size in store.sizes(rnd.prefix + "/").items():
        name = key[len(rnd.prefix) + 1:]
        match = _REPLICA_NAME.fullmatch(name)
        if match:
            found[int(match.group(1))] = (key, size)
        elif not _MANIFEST_NAME.fullmatch(name):
            log.warning("ignoring unexpected object %r in %r", key, rnd.prefix)
    return found


def _build(store: Store, rnd: _Round, decode: Decode, decode_many: DecodeMany | None, *,
           late: frozenset[int] = frozenset()) -> Manifest:
    """This peer's derivation of the round's set from what the store holds now; the replicas in
    `late` count as not arrived (a stored manifest was written before they landed)."""
    arrived = {r: found for r, found in _arrived(store, rnd).items() if r not in late}
    manifest = Manifest(run=rnd.run, global_step=rnd.global_step, stage=rnd.stage,
                        expected=rnd.expected, included=[], rejected=[], missing=[])

    def reject(replica: int, reason: str) -> None:  # cut: the manifest's size stays bounded
        manifest.rejected.append(Rejection(replica, detail_text(reason)))

    blobs: dict[int, bytes] = {}
    strangers = 0
    for replica in sorted(set(rnd.expected) | set(arrived)):
        key, size = arrived.get(replica, (None, 0))
        if key is None:
            manifest.missing.append(replica)
        elif replica in rnd.idle:
            reject(replica, rnd.idle[replica])
        elif replica not in rnd.expected:
            strangers += 1
            if strangers <= MAX_STRANGERS:
                reject(replica, f"replica {replica} is not in the expected set {rnd.expected}")
            else:
                log.warning("ignoring %r: more than %d objects of unknown replicas", key,
                            MAX_STRANGERS)
        elif size > rnd.max_blob_bytes:
            reject(replica, _too_large(size, rnd))
        else:
            try:
                blobs[replica] = store.get(key, max_bytes=rnd.max_blob_bytes)
            except KeyNotFound:  # deleted between list and get: it did not arrive
                manifest.missing.append(replica)
            except ObjectTooLarge as exc:  # it grew since the listing
                reject(replica, _too_large(exc.size, rnd))
            except InvalidObject as exc:  # a FIFO, a link, ... where a blob belongs
                reject(replica, str(exc))
    valid = {}
    for replica, (contribution, reason) in _validate_all(blobs, decode, decode_many,
                                                         rnd).items():
        if contribution is None:
            reject(replica, str(reason))
        else:
            valid[replica] = contribution
    for replica, reason in _norm_outliers(valid, rnd.max_norm_ratio).items():
        reject(replica, reason)
        del valid[replica]
    for replica, contribution in valid.items():
        manifest.included.append(replica)
        manifest.sizes[replica] = len(blobs[replica])
        manifest.digests[replica] = _digest(blobs[replica])
        manifest.contributions[replica] = contribution
    manifest.missing.sort()
    manifest.rejected.sort(key=lambda r: r.replica)
    for r in manifest.rejected:
        log.warning("step %d stage %d: rejected replica %d: %s", rnd.global_step, rnd.stage,
                    r.replica, r.reason)
    return manifest


def _too_large(size: int, rnd: _Round) -> str:
    return (f"object of {size} bytes is larger than any valid contribution to stage "
            f"{rnd.stage} ({rnd.max_blob_bytes} bytes); not read")


def _digest(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _validate_all(blobs: dict[int, bytes], decode: Decode, decode_many: DecodeMany | None,
                  rnd: _Round) -> dict[int, tuple[Contribution | None, str | None]]:
    """replica -> (contribution, None) or (None, reason) for each blob, ascending; the header
    must name the stage, replica, step and run the blob is stored as."""
    replicas = sorted(blobs)
    results = (decode_many([blobs[r] for r in replicas]) if decode_many is not None
               else [_decoded(decode, blobs[r]) for r in replicas])
    tag = run_tag(rnd.run)
    out: dict[int, tuple[Contribution | None, str | None]] = {}
    for r, result in zip(replicas, results, strict=True):
        if isinstance(result, InvalidContribution):
            out[r] = (None, result.reason)
            continue
        got = (result.stage, result.replica, result.global_step, result.run_tag)
        if got != (rnd.stage, r, rnd.global_step, tag):
            out[r] = (None, f"header says stage {got[0]}, replica {got[1]}, step {got[2]}, "
                            f"run tag {got[3]} but the object is stored as stage {rnd.stage}, "
                            f"replica {r}, step {rnd.global_step} of run {rnd.run!r} "
                            f"(run tag {tag})")
        else:
            out[r] = (result, None)
    return out


def _decoded(decode: Decode, blob: bytes) -> Contribution | InvalidContribution:
    try:
        return decode(blob)
    except InvalidContribution as exc:
        return exc


def _norm_outliers(valid: Mapping[int, Contribution], ratio: float) -> dict[int, str]:
    """replica -> reason for each contribution with a tensor whose norm is above `ratio` times
    that tensor's median over `valid`; `ratio` 0 disables the rule."""
    if ratio <= 0:
        return {}
    return {r: (f"{name}: its norm is {value:.3g} times the round's median norm of that "
                f"tensor (sparseloco.max_norm_ratio = {ratio:g})")
            for r, (name, value) in tensor_norm_ratios(valid).items() if value > ratio}


def agree(store: Store, run: str, global_step: int, stage: int, *,
          expected_replicas: int | Iterable[int], decode: Decode, max_blob_bytes: int,
          decode_many: DecodeMany | None = None, idle: Mapping[int, str] | None = None,
          max_norm_ratio: float = 0.0, late_ok: bool = False) -> Manifest:
    """The agreed set for (run, global step, stage); see the module docstring.

    `expected_replicas`: a count R (replicas 0..R-1) or the ids of the replicas that contribute
    this round. `idle`: replica -> reason, for replicas of the run that must not contribute
    (their slot is rejected with that reason). `decode(blob)` must return a validated
    Contribution or raise InvalidContribution; `decode_many`, when given, validates all of a
    round's blobs in one call with the same verdicts. `max_blob_bytes`: the size of the
    largest valid blob (`sparseloco.contribution_bytes` / `dense_bytes`); a larger object is
    rejected unread. `late_ok`: adopt a stored manifest that differs from the store only by
    contributions that arrived after it was written (module docstring, "Late arrivals"). The
    returned manifest carries the decoded contributions of its included replicas. Raises
    StoreError on store failures, never for what the store holds.
    """
    expected = (list(range(expected_replicas)) if isinstance(expected_replicas, int)
                else sorted(set(expected_replicas)))
    idle = dict(idle or {})
    if set(idle) & set(expected):
        raise ValueError(f"replicas {sorted(set(idle) & set(expected))} are both expected and idle")
    rnd = _Round(run, global_step, stage, expected, idle, max_blob_bytes, max_norm_ratio)
    ours = _build(store, rnd, decode, decode_many)
    limit = manifest_limit(len(set(expected) | set(idle)))
    assert len(ours.to_json()) <= limit, "a manifest this module wrote must pass its own limit"
    superseded: list[tuple[str, str]] = []
    for version in range(MAX_MANIFESTS):
        key = manifest_key(run, global_step, stage, version=version)
        theirs = _stored_or_write(store, key, ours, limit)
        if theirs is None:
            ours.key, ours.superseded = key, superseded
            return ours
        reason = _disagreement(theirs, ours)
        if reason is not None and late_ok and isinstance(theirs, Manifest):
            # re-derive with what arrived after `theirs` was written counted as missing: every
            # verdict (validity, outliers against the round's median) is then taken on the same
            # set the writer saw, so an honest writer's manifest matches exactly
            late = frozenset(set(_arrived(store, rnd)) & set(theirs.missing))
            if late:
                before = _build(store, rnd, decode, decode_many, late=late)
                if _disagreement(theirs, before) is None:
                    before.key, before.superseded = key, superseded
                    return before
        if reason is None:
            ours.key, ours.superseded = key, superseded
            return ours
        log.warning("step %d stage %d: rejected manifest %r: %s", global_step, stage, key, reason)
        superseded.append((key, reason))
    log.warning("step %d stage %d: all %d manifest keys hold invalid manifests; the stage skips "
                "its outer step", global_step, stage, MAX_MANIFESTS)
    return Manifest(run=run, global_step=global_step, stage=stage, expected=expected,
                    included=[], rejected=[], missing=[], superseded=superseded)


def _stored_or_write(store: Store, key: str, ours: Manifest, limit: int) -> Manifest | str | None:
    """The manifest at `key` (or why it cannot be used), or None once `ours` is written there.

    A key that is taken when written yet absent when read again is read again, a few times
    with backoff: S3 answers 409 to a conditional write while another peer's write of the same
    key is in flight, and that manifest may not be readable yet. Moving on to the next key
    instead would split the peers. Raises TransientStoreError if it stays that way (for the
    orchestration layer to retry)."""
    for attempt in range(_SETTLE_ATTEMPTS):
        try:
            return _read_manifest(store, key, limit)
        except KeyNotFound:
            if store.put_if_absent(key, ours.to_json()):
                return None
        if attempt + 1 < _SETTLE_ATTEMPTS:
            time.sleep(_SETTLE_BACKOFF_S * 2 ** attempt)
    raise TransientStoreError(f"manifest {key!r} cannot be created (it exists) nor read (it "
                              f"does not) after {_SETTLE_ATTEMPTS} tries")


def _read_manifest(store: Store, key: str, limit: int) -> Manifest | str:
    """The manifest at `key`, or why it cannot be used; KeyNotFound if there is none. An
    object that is there but cannot be read as a file (a directory, a FIFO) is unusable too:
    it also blocks the key for `put_if_absent`, so every peer passes over it."""
    try:
        return Manifest.from_json(store.get(key, max_bytes=limit))
    except ObjectTooLarge as exc:
        return f"manifest of {exc.size} bytes exceeds the {limit} a round of this run can need"
    except (InvalidManifest, InvalidObject) as exc:
        return str(exc)


def _disagreement(theirs: Manifest | str, ours: Manifest) -> str | None:
    """None if the stored manifest is this peer's own derivation, else what is wrong with it
    (as `detail_text`: part of it is the writer's text)."""
    if isinstance(theirs, str):
        return detail_text(theirs)
    where = (theirs.run, theirs.global_step, theirs.stage)
    if where != (ours.run, ours.global_step, ours.stage):
        return detail_text(f"it is the manifest of {where}, stored as "
                           f"{(ours.run, ours.global_step, ours.stage)}")
    for name in ("expected", "included", "missing", "rejected", "sizes", "digests"):
        a, b = getattr(theirs, name), getattr(ours, name)
        if a != b:
            if name == "rejected":
                a, b = [r.replica for r in a], [r.replica for r in b]
            text = f"its {name} {a} do not match what the store holds ({b})"
            return (text if len(text) <= MAX_DETAIL_TEXT
                    else f"its {name} do not match what the store holds")
    return None


def load_agreed(store: Store, manifest: Manifest, decode: Decode) -> list[Contribution]:
    """The decoded contributions of `manifest.included`, in replica order (cached ones are not
    downloaded again). Raises InvalidManifest if an agreed object is gone, changed (size or
    digest) or no longer valid: this peer cannot reproduce the agreed aggregate."""
    out = []
    for replica in manifest.included:
        cached = manifest.contributions.get(replica)
        if cached is None:
            cached = _load_one(store, manifest, replica, decode)
            manifest.contributions[replica] = cached
        out.append(cached)
    return out


def _load_one(store: Store, manifest: Manifest, replica: int, decode: Decode) -> Contribution:
    key = contribution_key(manifest.run, manifest.global_step, manifest.stage, replica)
    try:
        blob = store.get(key, max_bytes=manifest.sizes[replica])
    except KeyNotFound:
        raise InvalidManifest(f"agreed contribution {key!r} is missing from the store") from None
    except ObjectTooLarge:
        raise InvalidManifest(f"agreed contribution {key!r} grew since it was agreed") from None
    except InvalidObject as exc:
        raise InvalidManifest(f"agreed contribution: {exc}") from None
    if _digest(blob) != manifest.digests[replica]:
        raise InvalidManifest(f"agreed contribution {key!r} changed since it was agreed")
    rnd = _Round(manifest.run, manifest.global_step, manifest.stage, manifest.expected, {},
                 len(blob), 0.0)
    contribution, reason = _validate_all({replica: blob}, decode, None, rnd)[replica]
    if contribution is None:
        raise InvalidManifest(f"agreed contribution {key!r} no longer validates: {reason}")
    return contribution


def prune_rounds(store: Store, run: str, *, keep_from: int) -> int:
    """Delete every object of the run's rounds before global step `keep_from` (contributions
    and manifests); returns how many. A resumed run never reads a round before its
    checkpoint: it re-uploads and re-agrees the rounds it replays."""
    prefix = validate_key(run) + "/"
    deleted = 0
    for key in store.list(prefix):
        match = _ROUND.match(key[len(prefix):])
        if match and int(match.group(1)) < keep_from:
            store.delete(key)
            deleted += 1
    return deleted
