"""The gather with an agreed set, through a LocalStore: malformed, missing and misaddressed
contributions are excluded with reasons while the round completes; the manifest is written once
and adopted by every later peer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from crucible.gather import (
    InvalidManifest,
    Manifest,
    agree,
    contribution_key,
    load_agreed,
    manifest_events,
    manifest_key,
    upload_contribution,
)
from crucible.sparseloco import (
    Contribution,
    aggregate,
    decode_contribution,
    decode_contributions,
    encode_contribution,
)
from crucible.store import LocalStore

SHAPES = {"w": (64, 64), "b": (64,)}
RUN, STEP, STAGE = "exp-1", 12, 2


def _delta(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _blob(replica: int, *, stage: int = STAGE, step: int = STEP) -> bytes:
    return encode_contribution(_delta(replica), {}, beta=0.95, stage=stage, replica=replica,
                               global_step=step)[0]


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

    manifest = agree(store, RUN, STEP, STAGE, expected_replicas=8, decode=_decode)

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
    first = agree(store, RUN, STEP, STAGE, expected_replicas=3, decode=_decode)
    written = store.get(manifest_key(RUN, STEP, STAGE))
    upload_contribution(store, RUN, STEP, STAGE, 2, _blob(2))  # a late arrival
    again = agree(store, RUN, STEP, STAGE, expected_replicas=3, decode=_decode)
    assert again == first and again.included == [0, 1] and again.missing == [2]
    assert store.get(manifest_key(RUN, STEP, STAGE)) == written
    assert again.contributions == {}  # adopted: must be loaded, and loads the same data
    loaded = load_agreed(store, again, _decode)
    cached = load_agreed(store, first, _decode)
    for a, b in zip(loaded, cached, strict=True):
        assert a.replica == b.replica
        assert all(torch.equal(a.params[n].values, b.params[n].values) for n in SHAPES)


def test_a_peer_that_loses_the_race_adopts_the_winners_set(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    winner = Manifest(run=RUN, global_step=STEP, stage=STAGE, expected=[0, 1], included=[0],
                      rejected=[], missing=[1], sizes={0: len(_blob(0))})
    upload_contribution(store, RUN, STEP, STAGE, 1, _blob(1))
    # The winner's manifest lands between this peer's listing and its write: simulate by
    # writing it first with put_if_absent and checking this peer yields to it.
    assert store.put_if_absent(manifest_key(RUN, STEP, STAGE), winner.to_json())
    assert not store.put_if_absent(manifest_key(RUN, STEP, STAGE), b"{}")
    adopted = agree(store, RUN, STEP, STAGE, expected_replicas=2, decode=_decode)
    assert adopted.included == [0] and adopted.missing == [1]


def test_no_valid_contribution_gives_an_empty_agreed_set(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, b"garbage")
    manifest = agree(store, RUN, STEP, STAGE, expected_replicas=[0, 1], decode=_decode)
    assert manifest.included == [] and load_agreed(store, manifest, _decode) == []
    with pytest.raises(ValueError, match="skip its outer step"):
        aggregate(load_agreed(store, manifest, _decode), SHAPES)


def test_an_agreed_object_that_vanished_is_an_invalid_manifest(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    agree(store, RUN, STEP, STAGE, expected_replicas=1, decode=_decode)
    store.delete(contribution_key(RUN, STEP, STAGE, 0))
    adopted = agree(store, RUN, STEP, STAGE, expected_replicas=1, decode=_decode)
    with pytest.raises(InvalidManifest, match="missing from the store"):
        load_agreed(store, adopted, _decode)


def test_unreadable_manifest_is_reported(store: LocalStore) -> None:
    store.put(manifest_key(RUN, STEP, STAGE), b"{not json")
    with pytest.raises(InvalidManifest, match="unreadable manifest"):
        agree(store, RUN, STEP, STAGE, expected_replicas=1, decode=_decode)


def test_manifest_events_report_rejections_and_unexpected_absences(store: LocalStore) -> None:
    upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0))
    upload_contribution(store, RUN, STEP, STAGE, 1, b"")
    manifest = agree(store, RUN, STEP, STAGE, expected_replicas=4, decode=_decode)
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
        manifest = agree(store, RUN, STEP, STAGE, expected_replicas=8, decode=_decode,
                         decode_many=many)
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
