"""The gather's late-arrival rule (`agree(..., late_ok=True)`, used by the distributed mode): a
contribution that lands after a peer wrote the manifest without it is missing from that round
for every peer, instead of splitting the peers over two manifests; anything else that does not
match the store is still rejected."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from crucible.gather import agree, manifest_key, upload_contribution
from crucible.sparseloco import contribution_bytes, decode_contribution
from crucible.store import LocalStore
from tests.unit.test_gather import RUN, SHAPES, STAGE, STEP, _blob

LIMIT = contribution_bytes(SHAPES)


def _agree(store: LocalStore, **kwargs: object):
    kwargs.setdefault("expected_replicas", [0, 1, 2])
    return agree(store, RUN, STEP, STAGE, max_blob_bytes=LIMIT,
                 decode=lambda b: decode_contribution(b, SHAPES, stage=STAGE),
                 **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def _early_manifest_then_late_upload(store: LocalStore):
    for r in (0, 1):
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    first = _agree(store, late_ok=True)          # the deadline passed without replica 2
    upload_contribution(store, RUN, STEP, STAGE, 2, _blob(2))
    return first


def test_late_contribution_is_missing_for_every_peer(store: LocalStore) -> None:
    first = _early_manifest_then_late_upload(store)
    later = _agree(store, late_ok=True)
    assert first.key == later.key == manifest_key(RUN, STEP, STAGE)
    assert later.included == [0, 1] and later.missing == [2]
    assert sorted(later.contributions) == [0, 1]


def test_without_late_ok_a_late_contribution_splits_the_peers(store: LocalStore) -> None:
    # what the rule prevents: the simulator's strict rule rejects the early manifest
    _early_manifest_then_late_upload(store)
    strict = _agree(store)
    assert strict.key == manifest_key(RUN, STEP, STAGE, version=1)
    assert strict.included == [0, 1, 2]


def test_late_ok_still_rejects_a_manifest_the_store_contradicts(store: LocalStore) -> None:
    first = _early_manifest_then_late_upload(store)
    body = json.loads(first.to_json())
    body["digests"]["0"] = "0" * 32                # an agreed blob that is not what it says
    path = Path(store.root) / manifest_key(RUN, STEP, STAGE)
    path.write_text(json.dumps(body))
    later = _agree(store, late_ok=True)
    assert later.key == manifest_key(RUN, STEP, STAGE, version=1)
    assert later.included == [0, 1, 2]
    assert later.superseded and later.superseded[0][0] == manifest_key(RUN, STEP, STAGE)


def test_create_only_upload_keeps_the_first_blob(store: LocalStore) -> None:
    key = upload_contribution(store, RUN, STEP, STAGE, 0, _blob(0), if_absent=True)
    assert key is not None
    assert upload_contribution(store, RUN, STEP, STAGE, 0, _blob(1), if_absent=True) is None
    assert store.get(key) == _blob(0)


def test_a_late_arrival_beside_an_outlier_does_not_split_the_peers(store: LocalStore) -> None:
    four = {"expected_replicas": [0, 1, 2, 3], "max_norm_ratio": 50.0, "late_ok": True}
    for r in (0, 1):
        upload_contribution(store, RUN, STEP, STAGE, r, _blob(r))
    upload_contribution(store, RUN, STEP, STAGE, 2, _blob(2, scale=1000.0))   # an outlier
    first = _agree(store, **four)                 # the deadline passed without replica 3
    assert first.included == [0, 1] and [x.replica for x in first.rejected] == [2]
    upload_contribution(store, RUN, STEP, STAGE, 3, _blob(3))                 # honest, late
    later = _agree(store, **four)
    assert later.key == first.key
    assert later.included == first.included
