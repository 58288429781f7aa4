"""The gather with an agreed set, through a LocalStore: malformed, missing and misaddressed
contributions are excluded with reasons while the round completes; the manifest is written once
and adopted by every later peer that derives the same set, and an invalid one is passed over
for the next versioned key."""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest
import torch

from crucible.events import MAX_DETAIL_TEXT
from crucible.gather import (
    MAX_MANIFESTS,
    agree,
    contribution_key,
    load_agreed,
    manifest_key,
    prune_rounds,
    upload_contribution,
)
from crucible.manifest import InvalidManifest, Manifest, Rejection, manifest_events, manifest_limit
from crucible.sparseloco import (
    Contribution,
    aggregate,
    contribution_bytes,
    decode_contribution,
    decode_contributions,
    encode_contribution,
    run_tag,
)
from crucible.store import KeyNotFound, LocalStore

SHAPES = {"w": (64, 64), "b": (64,)}
RUN, STEP, STAGE = "exp-1", 12, 2
LIMIT = contribution_bytes(SHAPES)


def _delta(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _blob(replica: int, *, stage: int = STAGE, step: int = STEP, run: str = RUN,
          scale: float = 1.0) -> bytes:
    delta = {n: t * scale for n, t in _delta(replica).items()}
    return encode_contribution(delta, {}, beta=0.95, stage=stage, replica=replica,
                               global_step=step, run_tag=run_tag(run))[0]


def _agree(store: LocalStore, **kwargs: object) -> Manifest:
    kwargs.setdefault("decode", _decode)
    kwargs.setdefault("max_blob_bytes", LIMIT)
    return agree(store, RUN, STEP, STAGE, **kwargs)  # type: ignore[arg-type]


def _decode(blob: bytes) -> Contribution:
    return decode_contribution(blob, SHAPES, stage=STAGE)


def _decode_many(blobs: list[bytes]) -> list[object]:
    return decode_contributions(blobs, SHAPES, stage=STAGE)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_keys_follow_the_documented_scheme() -> None:
    assert contribution_key("exp-1", 12, 2, 5) == "exp-1/00000012/stage-2/replica-5"
    assert manifest_key("exp-1", 12, 2) == "exp-1/00000012/stage-2/manifest.json"
    with pytest.raises(ValueError, match="store key"):
        contribution_key("../x", 1, 0, 0)


def test_bad_contributions_are_excluded_and_the_round_completes(store: LocalStore) -> None:
    good = [0, 1, 4]
    for r in good:
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    upload_contribution(store, RUN, STEP, STAGE, 2, _blob(2)[:-30])          # truncated
    upload_contribution(store, RUN, STEP, STAGE, 3, _blob(3, stage=STAGE + 1))  # wrong stage
    upload_contribution(store, RUN, STEP, STAGE, 5, b"")                     # empty object
    upload_contribution(store, RUN, STEP, STAGE, 6, _blob(7))                # replica mismatch
    upload_contribution(store, RUN, STEP, STAGE, 9, _blob(9))                # not expected

    manifest = _agree(store, expected_replicas=8)

    assert manifest.included == good
    reasons = {r.replica: r.reason for r in manifest.rejected}
    assert set(reasons) == {2, 3, 5, 6, 9}
    assert "truncated or corrupted" in reasons[2]
    assert "stage 3, expected stage 2" in reasons[3]
    assert "empty object" in reasons[5]
    assert "replica 7" in reasons[6] and "replica 6" in reasons[6]
    assert "not in the expected set" in reasons[9]
    assert manifest.missing == [7]
    assert manifest.sizes == {r: len(_blob(r)) for r in good}

    contributions = load_agreed(store, manifest, _decode)
    assert [c.replica for c in contributions] == good
    agg = aggregate(contributions, SHAPES)
    assert all(torch.isfinite(t).all() for t in agg.values())


def test_manifest_is_written_once_and_adopted_after_a_resume(store: LocalStore) -> None:
    for r in (0, 1):
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    first = _agree(store, expected_replicas=2)
    written = store.get(manifest_key(RUN, STEP, STAGE))
    for r in (0, 1):  # a resumed run uploads the same bytes again, then agrees
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    again = _agree(store, expected_replicas=2)
    assert again == first and again.included == [0, 1]
    assert again.key == first.key == manifest_key(RUN, STEP, STAGE) and not again.superseded
    assert store.get(manifest_key(RUN, STEP, STAGE)) == written
    assert store.list(f"{RUN}/{STEP:08d}/stage-{STAGE}/manifest") == [
        manifest_key(RUN, STEP, STAGE)]
    stored = Manifest.from_json(written)  # a peer holding only the manifest loads the same data
    for a, b in zip(load_agreed(store, stored, _decode), load_agreed(store, first, _decode),
                    strict=True):
        assert a.replica == b.replica
        assert all(torch.equal(a.params[n].values, b.params[n].values) for n in SHAPES)


def test_a_peer_that_loses_the_race_adopts_the_winners_set(tmp_path: Path) -> None:
    """Another peer writes the manifest between this peer's derivation and its own write: this
    peer's create-if-absent fails, it reads the winner's manifest, finds its own set, adopts."""
    class Racing(LocalStore):
        def put_if_absent(self, key: str, data: bytes) -> bool:
            super().put_if_absent(key, data)  # the other peer, same derivation, first
            return super().put_if_absent(key, data)

    store = Racing(tmp_path)
    for r in (0, 1):
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    adopted = _agree(store, expected_replicas=2)
    assert adopted.included == [0, 1] and adopted.key == manifest_key(RUN, STEP, STAGE)
    assert sorted(adopted.contributions) == [0, 1]   # its own validation, reused


def test_a_manifest_key_taken_but_not_yet_readable_is_read_again(tmp_path: Path) -> None:
    """S3 answers 409 to a conditional write while another peer's write of the same key is in
    flight, and that manifest may not be readable yet: this peer reads again and adopts it
    (moving on to the next key instead would split the peers)."""
    class InFlight(LocalStore):
        pending: tuple[str, bytes] | None = None
        misses = 0

        def put_if_absent(self, key: str, data: bytes) -> bool:
            if self.pending is None:               # the other peer's write, in flight
                self.pending, self.misses = (key, data), 1
            return False

        def get(self, key: str, **kwargs: object) -> bytes:
            if self.pending and self.pending[0] == key:
                if self.misses:                  # the first read after the 409 finds nothing
                    self.misses -= 1
                    raise KeyNotFound(key)
                super().put_if_absent(*self.pending)   # then it lands
                self.pending = None
            return super().get(key, **kwargs)     # type: ignore[arg-type]

    store = InFlight(tmp_path)
    for r in (0, 1):
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    adopted = _agree(store, expected_replicas=2)
    assert adopted.included == [0, 1] and adopted.key == manifest_key(RUN, STEP, STAGE)
    assert not adopted.superseded


def test_a_late_arrival_supersedes_a_manifest_that_calls_it_missing(store: LocalStore) -> None:
    """Agreement follows the upload barrier: a manifest that calls a replica missing while its
    object is in the store was not derived from this round's uploads (e.g. planted before
    them). It is passed over, with the reason, for the next key."""
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    early = _agree(store, expected_replicas=2)
    assert early.missing == [1]
    upload_contribution(store, RUN, STEP, STAGE, 1, _blob(1))
    again = _agree(store, expected_replicas=2)
    assert again.included == [0, 1] and again.key == manifest_key(RUN, STEP, STAGE, version=1)
    (key, reason), = again.superseded
    assert key == manifest_key(RUN, STEP, STAGE) and "included [0] do not match" in reason
    events = manifest_events(again)
    assert [(e.kind, e.detail["key"]) for e in events] == [("manifest_rejected", key)]
    assert events[0].id == f"manifest_rejected:{STEP}:-:{STAGE}:0"


def test_no_valid_contribution_gives_an_empty_agreed_set(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, b"garbage")
    manifest = _agree(store, expected_replicas=[0, 1])
    assert manifest.included == [] and load_agreed(store, manifest, _decode) == []
    with pytest.raises(ValueError, match="skip its outer step"):
        aggregate(load_agreed(store, manifest, _decode), SHAPES)


def test_an_agreed_object_that_vanished_or_changed_supersedes_the_manifest(
        store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    upload_contribution(store, RUN, STEP, STAGE, 1, _blob(1))
    _agree(store, expected_replicas=2)
    stored = Manifest.from_json(store.get(manifest_key(RUN, STEP, STAGE)))
    store.delete(contribution_key(RUN, STEP, STAGE, 0))
    with pytest.raises(InvalidManifest, match="missing from the store"):
        load_agreed(store, stored, _decode)
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0, scale=2.0))  # same size, new bytes
    with pytest.raises(InvalidManifest, match="changed since it was agreed"):
        load_agreed(store, stored, _decode)
    again = _agree(store, expected_replicas=2)
    assert again.included == [0, 1] and again.key == manifest_key(RUN, STEP, STAGE, version=1)
    assert "its digests" in again.superseded[0][1]


def test_unreadable_manifest_is_passed_over(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    store.put(manifest_key(RUN, STEP, STAGE), b"{not json")
    manifest = _agree(store, expected_replicas=1)
    assert manifest.included == [0] and manifest.key == manifest_key(RUN, STEP, STAGE, version=1)
    assert "unreadable manifest" in manifest.superseded[0][1]


@pytest.mark.parametrize("body, needle", [
    ({"version": 1}, "manifest version 1 is not 2"),
    ({"included": [0, 0]}, "listed twice"),
    ({"included": [True]}, "not a non-negative integer"),
    ({"expected": [0, 1]}, "neither included, rejected nor missing"),
    ({"sizes": {}}, "exactly the included replicas"),
    ({"run": "another"}, "manifest of ('another'"),
    ({"global_step": STEP + 1}, "manifest of ('exp-1', 13"),
])
def test_invalid_manifests_are_rejected_with_the_reason(store: LocalStore, body: dict,
                                                        needle: str) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    good = json.loads(_agree(store, expected_replicas=1).to_json())
    store.delete(manifest_key(RUN, STEP, STAGE))
    store.put(manifest_key(RUN, STEP, STAGE), json.dumps({**good, **body}).encode())
    manifest = _agree(store, expected_replicas=1)
    assert manifest.included == [0] and needle in manifest.superseded[0][1]


def _plant_non_file(path: Path, kind: str) -> None:
    """Something that is not a regular file at `path`, as a peer with write access could
    leave: a directory (with an object in it), a FIFO, or a link."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"{}")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(path.parent / "replica-0")


@pytest.mark.timeout(30)   # a FIFO that is opened for reading blocks until a writer comes
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_manifest_key_that_is_not_a_file_is_passed_over_by_every_peer(
        tmp_path: Path, kind: str) -> None:
    root = tmp_path / "store"
    first = LocalStore(root)
    for r in (0, 1):
        upload_contribution(first, RUN, STEP, STAGE, r, _blob(r))
    _plant_non_file(root / manifest_key(RUN, STEP, STAGE), kind)
    peers = [_agree(first, expected_replicas=2), _agree(LocalStore(root), expected_replicas=2)]
    for manifest in peers:
        assert manifest.included == [0, 1]
        assert manifest.key == manifest_key(RUN, STEP, STAGE, version=1)
        (key, reason), = manifest.superseded
        assert key == manifest_key(RUN, STEP, STAGE) and "not a regular file" in reason
    assert peers[0] == peers[1]


def test_a_deeply_nested_manifest_is_unreadable_not_a_crash(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    store.put(manifest_key(RUN, STEP, STAGE), b"[" * 5000 + b"]" * 5000)
    manifest = _agree(store, expected_replicas=1)
    assert manifest.included == [0] and "unreadable manifest" in manifest.superseded[0][1]


def test_an_oversized_manifest_is_refused_unread(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    store.put(manifest_key(RUN, STEP, STAGE), b" " * (manifest_limit(1) + 1))
    manifest = _agree(store, expected_replicas=1)
    assert manifest.included == [0] and "exceeds the" in manifest.superseded[0][1]


def test_when_every_manifest_key_is_taken_by_garbage_the_stage_skips(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    for version in range(MAX_MANIFESTS):
        store.put(manifest_key(RUN, STEP, STAGE, version=version), b"junk")
    manifest = _agree(store, expected_replicas=1)
    assert manifest.key is None and manifest.included == []
    assert len(manifest_events(manifest, absent_ok=[0])) == MAX_MANIFESTS


def test_manifest_events_report_rejections_and_unexpected_absences(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    upload_contribution(store, RUN, STEP, STAGE, 1, b"")
    manifest = _agree(store, expected_replicas=4)
    events = manifest_events(manifest, absent_ok=[3])
    assert [(e.kind, e.replica, e.stage, e.global_step) for e in events] == [
        ("contribution_rejected", 1, STAGE, STEP), ("contribution_missing", 2, STAGE, STEP)]
    assert "empty object" in events[0].detail["reason"]
    assert events[0].id == f"contribution_rejected:{STEP}:1:{STAGE}:0"


def test_batched_validation_agrees_with_one_by_one(tmp_path: Path) -> None:
    """The same round, gathered once with `decode` alone and once with `decode_many`: the same
    manifest (included, rejected with the same reasons, missing, sizes) and the same values."""
    manifests = []
    for name, many in (("single", None), ("batched", _decode_many)):
        store = LocalStore(tmp_path / name)
        for r in (0, 1, 4, 6):
            upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
        upload_contribution(store, RUN, STEP, STAGE, 2, _blob(2)[:-30])           # truncated
        upload_contribution(store, RUN, STEP, STAGE, 3, _blob(3, step=STEP + 1))   # wrong step
        upload_contribution(store, RUN, STEP, STAGE, 5, _blob(4))                  # misaddressed
        upload_contribution(store, RUN, STEP, STAGE, 9, _blob(0))                  # unexpected
        manifest = _agree(store, expected_replicas=8, decode_many=many)
        manifests.append(manifest)
    single, batched = manifests
    assert batched.to_json() == single.to_json()
    assert batched.included == [0, 1, 4, 6]
    assert [r.replica for r in batched.rejected] == [2, 3, 5, 9]
    assert batched.missing == [7]
    assert "replica 4" in {r.replica: r.reason for r in batched.rejected}[5]
    for r in batched.included:
        for name in SHAPES:
            a, b = single.contributions[r].params[name], batched.contributions[r].params[name]
            assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


def test_slot_of_an_idle_replica_is_rejected_with_the_plans_reason(store: LocalStore) -> None:
    for r in (0, 2):
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    upload_contribution(store, RUN, STEP, STAGE, 1, _blob(1))   # its stage is down: forged
    manifest = _agree(store, expected_replicas=[0, 2], idle={1: "stage 2 of replica 1 is down"})
    assert manifest.included == [0, 2] and manifest.missing == []
    assert manifest.rejected == [Rejection(1, "stage 2 of replica 1 is down")]


def test_blobs_of_another_run_and_of_version_1_are_rejected(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    upload_contribution(store, RUN, STEP, STAGE, 1, _blob(1, run="exp-2"))
    v1 = bytearray(_blob(2)[:-4])
    struct.pack_into("<H", v1, 4, 1)       # version 1: a u64 step where v2 has step and tag
    struct.pack_into("<Q", v1, 16, STEP)
    upload_contribution(store, RUN, STEP, STAGE, 2, bytes(v1) + struct.pack("<I", zlib.crc32(v1)))
    manifest = _agree(store, expected_replicas=3)
    reasons = {r.replica: r.reason for r in manifest.rejected}
    assert manifest.included == [0] and sorted(reasons) == [1, 2]
    assert f"run tag {run_tag('exp-2')}" in reasons[1] and "run tag None" in reasons[2]


def test_norm_far_beyond_the_median_is_rejected_and_the_rest_aggregate_unchanged(
        tmp_path: Path) -> None:
    honest = LocalStore(tmp_path / "honest")
    attacked = LocalStore(tmp_path / "attacked")
    for r in range(4):
        upload_contribution(honest, RUN, STEP, STAGE, r, _blob(r))
        upload_contribution(attacked, RUN, STEP, STAGE, r, _blob(r))
    upload_contribution(attacked, RUN, STEP, STAGE, 4, _blob(4, scale=1e3))
    got = _agree(attacked, expected_replicas=5, max_norm_ratio=50.0)
    (rejection,) = got.rejected
    assert rejection.replica == 4 and "times the round's median" in rejection.reason
    assert "sparseloco.max_norm_ratio = 50" in rejection.reason
    want = _agree(honest, expected_replicas=4, max_norm_ratio=50.0)
    a, b = aggregate(list(got.contributions.values()), SHAPES), aggregate(
        list(want.contributions.values()), SHAPES)
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    assert _agree(attacked, expected_replicas=5, max_norm_ratio=0.0).included == [0, 1, 2, 3, 4]


def test_oversized_object_is_rejected_from_its_listed_size(tmp_path: Path) -> None:
    class Reads(LocalStore):
        def get(self, key: str, **kwargs: object) -> bytes:
            self.read = [*getattr(self, "read", []), key]
            return super().get(key, **kwargs)

    store = Reads(tmp_path)
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    upload_contribution(store, RUN, STEP, STAGE, 1, _blob(1) + b"\0")   # one byte too many
    manifest = _agree(store, expected_replicas=2)
    assert manifest.included == [0] and "not read" in manifest.rejected[0].reason
    assert contribution_key(RUN, STEP, STAGE, 1) not in store.read
    assert len(_blob(0)) == LIMIT   # the limit is exact: every valid blob has this size


def test_prune_rounds_keeps_the_later_rounds_and_other_objects(store: LocalStore) -> None:
    for step in range(5):
        upload_contribution(store, RUN, step, STAGE, 0, _blob(0, step=step))
    store.put(f"{RUN}/checkpoints/step-00000004.pt", b"state")
    assert prune_rounds(store, RUN, keep_from=3) == 3
    assert store.list(f"{RUN}/") == [f"{RUN}/00000003/stage-2/replica-0",
                                     f"{RUN}/00000004/stage-2/replica-0",
                                     f"{RUN}/checkpoints/step-00000004.pt"]


def test_what_a_peer_writes_cannot_grow_a_manifest_or_an_event(store: LocalStore) -> None:
    """Objects of 40 replicas the run does not have and a blob whose parameter name is long and
    not ASCII: the rejections are recorded (16 of the strangers), each reason at most
    MAX_DETAIL_TEXT ASCII characters, and the manifest stays under its limit."""
    for r in range(2):
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    for r in range(100, 140):
        upload_contribution(store, RUN, STEP, STAGE, r, b"x")
    odd = encode_contribution({"é" * 500: torch.ones(64)}, {}, beta=0.95, stage=STAGE,
                              replica=2, global_step=STEP, run_tag=run_tag(RUN))[0]
    upload_contribution(store, RUN, STEP, STAGE, 2, odd)
    manifest = _agree(store, expected_replicas=3)
    assert manifest.included == [0, 1]
    assert len(manifest.rejected) == 1 + 16
    assert all(len(r.reason) <= MAX_DETAIL_TEXT and r.reason.isascii() for r in manifest.rejected)
    assert len(manifest.to_json()) <= manifest_limit(3)
