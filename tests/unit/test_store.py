"""LocalStore behaviour, key validation and URL selection. `store_contract_trace` is the
scenario that tests/integration/test_s3_store.py also runs against S3, to show both stores behave
identically."""
from __future__ import annotations

import os
import socket
import stat
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from crucible.store import (
    InvalidObject,
    KeyNotFound,
    LocalStore,
    ObjectTooLarge,
    S3Store,
    Store,
    StoreError,
    open_store,
    validate_key,
)


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


def size_limit_trace(store: Store) -> list[Any]:
    """Sizes from the listing and bounded reads, the scenario both stores must agree on."""
    trace: list[Any] = []
    store.put("r/a", b"x" * 100)
    store.put("r/b", b"")
    store.put("r/sub/c", b"yy")
    trace.append(store.sizes("r/"))
    trace.append(store.sizes("nothing/"))
    trace.append(store.get("r/a", max_bytes=100) == b"x" * 100)
    for limit in (99, 0):
        try:
            store.get("r/a", max_bytes=limit)
            trace.append("read")
        except ObjectTooLarge as exc:
            trace.append((exc.key, exc.size, exc.limit))
    trace.append(store.get("r/b", max_bytes=0))
    try:
        store.get("r/none", max_bytes=5)
    except KeyNotFound:
        trace.append("KeyNotFound")
    return trace


SIZE_TRACE = [{"r/a": 100, "r/b": 0, "r/sub/c": 2}, {}, True, ("r/a", 100, 99), ("r/a", 100, 0),
              b"", "KeyNotFound"]


def test_local_store_sizes_and_bounded_reads(tmp_path: Path) -> None:
    assert size_limit_trace(LocalStore(tmp_path)) == SIZE_TRACE


def refused_read_peak(store: Store, key: str, size: int) -> int:
    """Peak bytes Python allocated while `get(key, max_bytes=4096)` refused an object of
    `size` bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(ObjectTooLarge, match=f"{size} bytes"):
            store.get(key, max_bytes=4096)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_bounded_read_of_a_huge_object_allocates_next_to_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("big", bytes(64 << 20), durable=False)
    assert refused_read_peak(store, "big", 64 << 20) < 1 << 20


def test_remove_temporaries_deletes_only_interrupted_writes_under_the_prefix(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("run/checkpoints/step-00000002.pt", b"whole")
    store.put("other/x", b"1")
    (tmp_path / "run" / "checkpoints" / ".tmp-killed").write_bytes(b"h" * 1000)
    (tmp_path / "run" / ".tmp-a").write_bytes(b"h" * 10)
    (tmp_path / "other" / ".tmp-live").write_bytes(b"w")
    assert store.remove_temporaries("run/") == (2, 1010)
    assert store.remove_temporaries("run/") == (0, 0)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        ".tmp-live", "step-00000002.pt", "x"]


def test_local_store_leaves_no_temp_files_and_stays_inside_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put("a/b", b"1")
    store.put_if_absent("a/c", b"2")
    store.put_if_absent("a/c", b"3")
    assert sorted(os.listdir(tmp_path / "s" / "a")) == ["b", "c"]
    assert not (tmp_path / "escape").exists()


def test_durable_puts_fsync_and_transient_ones_do_not(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []          # what each fsync made durable: a file, or a folder's rename
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"),
        real_fsync(fd)))
    store = LocalStore(tmp_path / "s")
    store.put("run/1/stage-0/replica-0", b"contribution", durable=False)  # a new prefix too
    assert synced == []
    store.put("run/checkpoints/latest.json", b"pointer")
    store.put_if_absent("run/1/stage-0/manifest.json", b"{}")
    assert synced == ["file", "folder", "file", "folder"]
    assert store.get("run/1/stage-0/replica-0") == b"contribution"
    assert sorted(os.listdir(tmp_path / "s" / "run" / "1" / "stage-0")) == [
        "manifest.json", "replica-0"]                                       # no temp files left


def test_local_store_list_ignores_a_temp_file_of_a_crashed_writer(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"1")
    (tmp_path / "a" / ".tmp-crashed").write_bytes(b"half")
    assert store.list("a/") == ["a/b"]


def _plant(path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Something that is not a regular file at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        monkeypatch.chdir(path.parent)   # a socket path is limited to ~100 characters
        server = socket.socket(socket.AF_UNIX)
        server.bind(path.name)
        server.close()
    elif kind == "directory":
        path.mkdir()
    elif kind == "symbolic link":
        (path.parent / "target").write_bytes(b"x")
        path.symlink_to(path.parent / "target")
    else:  # a link to a device: reading it would never end (or have side effects)
        path.symlink_to("/dev/zero")


@pytest.mark.timeout(30)   # a FIFO opened for reading blocks until a writer comes
@pytest.mark.parametrize("kind", ["FIFO", "socket", "directory", "symbolic link",
                                  "link to a device"])
@pytest.mark.parametrize("max_bytes", [None, 4096])
def test_an_object_that_is_not_a_regular_file_is_refused_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, max_bytes: int | None) -> None:
    store = LocalStore(tmp_path / "s")
    _plant(tmp_path / "s" / "r" / "x", kind, monkeypatch)
    with pytest.raises(InvalidObject, match="'r/x' is a .*not a regular file") as info:
        store.get("r/x", max_bytes=max_bytes)
    assert isinstance(info.value, StoreError) and not isinstance(info.value, KeyNotFound)
    assert "s/r/x" not in str(info.value)      # the same reason on every peer, wherever mounted
    if kind != "directory":                     # it holds the key, so a reader can reject it
        assert "r/x" in store.sizes("r/") and "r/x" in store.list("r/")
    assert store.put_if_absent("r/x", b"new") is False


def test_a_directory_in_the_place_of_an_object_is_a_store_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    (tmp_path / "r" / "x").mkdir(parents=True)
    with pytest.raises(StoreError, match="'r/x'.*a directory is in its place"):
        store.put("r/x", b"data")
    assert os.listdir(tmp_path / "r") == ["x"]   # no temporary file left behind


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
