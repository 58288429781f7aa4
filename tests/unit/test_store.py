"""LocalStore behaviour, key validation and URL selection. `store_contract_trace` is the
scenario that tests/integration/test_s3_store.py also runs against S3, to show both stores behave
identically."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from crucible.store import KeyNotFound, LocalStore, S3Store, Store, open_store, validate_key


def store_contract_trace(store: Store) -> list[Any]:
    """Run one fixed scenario against `store`; return everything observable, in order."""
    trace: list[Any] = []
    payload = bytes(range(256)) * 17
    store.put("run/00000001/stage-0/replica-0", payload)
    store.put("run/00000001/stage-0/replica-1", b"")
    store.put("run/00000001/stage-1/replica-0", b"x")
    store.put("run/00000002/stage-0/replica-0", b"y")
    store.put("run/00000001/stage-0/replica-1", b"second")  # overwrite
    trace.append(store.get("run/00000001/stage-0/replica-0") == payload)
    trace.append(store.get("run/00000001/stage-0/replica-1"))
    trace.append(store.list("run/00000001/stage-0/"))
    trace.append(store.list("run/00000001/"))
    trace.append(store.list("run/0000000"))
    trace.append(store.list("nothing/here/"))
    trace.append(len(store.list()))
    trace.append([store.exists("run/00000001/stage-0/replica-0"), store.exists("run/nope")])
    trace.append(store.put_if_absent("run/m.json", b"first"))
    trace.append(store.put_if_absent("run/m.json", b"second"))
    trace.append(store.get("run/m.json"))
    store.delete("run/00000002/stage-0/replica-0")
    store.delete("run/00000002/stage-0/replica-0")  # deleting twice is fine
    trace.append(store.exists("run/00000002/stage-0/replica-0"))
    for bad in ("run/nope", "run/00000002/stage-0/replica-0"):
        try:
            store.get(bad)
            trace.append("found")
        except KeyNotFound:
            trace.append("KeyNotFound")
    for key in ("../escape", "/abs", "a//b", "a/./b", ""):
        try:
            store.put(key, b"z")
            trace.append("accepted")
        except ValueError:
            trace.append("ValueError")
    return trace


EXPECTED_TRACE = [
    True, b"second",
    ["run/00000001/stage-0/replica-0", "run/00000001/stage-0/replica-1"],
    ["run/00000001/stage-0/replica-0", "run/00000001/stage-0/replica-1",
     "run/00000001/stage-1/replica-0"],
    ["run/00000001/stage-0/replica-0", "run/00000001/stage-0/replica-1",
     "run/00000001/stage-1/replica-0", "run/00000002/stage-0/replica-0"],
    [], 4, [True, False], True, False, b"first", False, "KeyNotFound", "KeyNotFound",
    "ValueError", "ValueError", "ValueError", "ValueError", "ValueError",
]


def test_local_store_follows_the_contract(tmp_path: Path) -> None:
    assert store_contract_trace(LocalStore(tmp_path / "store")) == EXPECTED_TRACE


def test_local_store_leaves_no_temp_files_and_stays_inside_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put("a/b", b"1")
    store.put_if_absent("a/c", b"2")
    store.put_if_absent("a/c", b"3")
    assert sorted(os.listdir(tmp_path / "s" / "a")) == ["b", "c"]
    assert not (tmp_path / "escape").exists()


def test_durable_puts_fsync_and_transient_ones_do_not(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    store = LocalStore(tmp_path / "s")
    store.put("run/1/stage-0/replica-0", b"contribution", durable=False)  # a new prefix too
    assert synced == []
    store.put("run/checkpoints/latest.json", b"pointer")
    store.put_if_absent("run/1/stage-0/manifest.json", b"{}")
    assert len(synced) == 2
    assert store.get("run/1/stage-0/replica-0") == b"contribution"
    assert sorted(os.listdir(tmp_path / "s" / "run" / "1" / "stage-0")) == [
        "manifest.json", "replica-0"]                                       # no temp files left


def test_local_store_list_ignores_a_temp_file_of_a_crashed_writer(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"1")
    (tmp_path / "a" / ".tmp-crashed").write_bytes(b"half")
    assert store.list("a/") == ["a/b"]


@pytest.mark.parametrize("key", ["a/../b", "a\\b", "a/.tmp-x", "x\x00"])
def test_invalid_keys_name_the_problem(key: str) -> None:
    with pytest.raises(ValueError, match="store key"):
        validate_key(key)


def test_open_store_by_url(tmp_path: Path) -> None:
    local = open_store(f"file://{tmp_path}/st")
    assert isinstance(local, LocalStore) and local.root == (tmp_path / "st").resolve()
    spaced = open_store((tmp_path / "with space").as_uri())
    assert isinstance(spaced, LocalStore) and spaced.root == (tmp_path / "with space").resolve()
    s3 = open_store("s3://bucket/some/prefix", endpoint_url="http://127.0.0.1:1",
                    region="us-east-1")
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")


@pytest.mark.parametrize("url, hint", [
    ("file://relative/path", "absolute path"),
    ("s3:///prefix-without-bucket", "needs a bucket"),
    ("gs://bucket/x", "file:///abs/path or s3://bucket/prefix"),
    ("", "not supported"),
])
def test_open_store_rejects_bad_urls(url: str, hint: str) -> None:
    with pytest.raises(ValueError, match="store.url") as info:
        open_store(url)
    assert hint in str(info.value)
