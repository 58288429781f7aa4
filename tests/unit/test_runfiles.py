"""Durable run files (crucible.runfiles): atomic replacement, durable JSON-line appends, and the
one torn-tail rule - bytes after the last newline are a torn tail (ignored on read, cut on
repair); a complete line that is not JSON is damage (raises)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from crucible import runfiles
from crucible.runfiles import (
    CorruptLine,
    JsonlAppender,
    append_jsonl,
    append_line,
    atomic_file,
    read_jsonl,
    repair_torn_tail,
    write_bytes_atomic,
    write_bytes_if_absent,
    write_json_atomic,
)

RECORDS = [{"kind": "start", "global_step": 0}, {"kind": "kill", "global_step": 3, "note": "é"}]
LAST = {"kind": "restart", "global_step": 3, "life": 1}


def _jsonl(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_an_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "new" / "folder" / "summary.json"     # folders made on the way
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    write_bytes_atomic(path, b"second")
    assert path.read_bytes() == b"second"
    assert _leftovers(path.parent) == []


def test_an_atomic_write_gives_the_permissions_open_would(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_bytes_atomic(tmp_path / "report.html", b"<p>shared</p>")
    finally:
        os.umask(umask)
    assert (tmp_path / "report.html").stat().st_mode & 0o777 == 0o644


def test_a_failed_atomic_write_leaves_the_old_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"old weights")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_file(path) as fh:
            fh.write(b"half of the new wei")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old weights"
    assert _leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_old_file_whole(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"old": True})

    def refuse(src: object, dst: object) -> None:
        raise OSError("rename refused")

    monkeypatch.setattr(runfiles.os, "replace", refuse)
    with pytest.raises(OSError, match="rename refused"):
        write_json_atomic(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert _leftovers(tmp_path) == []


def test_a_folder_in_the_way_is_refused_and_the_temporary_removed(tmp_path: Path) -> None:
    (tmp_path / "key").mkdir()
    with pytest.raises(IsADirectoryError):
        write_bytes_atomic(tmp_path / "key", b"x", temp_prefix=".tmp-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]


def test_write_if_absent_creates_once(tmp_path: Path) -> None:
    path = tmp_path / "a" / "manifest"
    assert write_bytes_if_absent(path, b"first") is True
    assert write_bytes_if_absent(path, b"second") is False
    assert path.read_bytes() == b"first"
    assert _leftovers(path.parent) == []


def test_appended_lines_are_read_back_in_order(tmp_path: Path) -> None:
    path = tmp_path / "process.jsonl"
    for record in RECORDS:
        append_jsonl(path, record)
    with open(path, "rb+") as fh:                        # an open file: written at its end
        fh.read(3)
        append_jsonl(fh, LAST)
    appender = JsonlAppender(path)
    appender.append({"kind": "done"})
    appender.close()
    assert read_jsonl(path) == [*RECORDS, LAST, {"kind": "done"}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_a_line_to_append_must_be_whole(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="newline"):
        append_line(tmp_path / "x.jsonl", b'{"a": 1}')
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("cut", range(len(json.dumps(LAST)) + 1))
def test_a_last_record_torn_at_any_byte_is_ignored_then_cut(tmp_path: Path, cut: int) -> None:
    """Every prefix of the last line short of its newline (the empty one included) is a torn
    tail: the reader passes over it, the repair cuts exactly it, and the next append starts a
    line of its own - the earlier records once each, the torn one never."""
    path = tmp_path / "rounds.jsonl"
    whole = _jsonl(RECORDS)
    path.write_bytes(whole + json.dumps(LAST).encode()[:cut])
    assert read_jsonl(path) == RECORDS
    assert repair_torn_tail(path) == cut
    assert path.read_bytes() == whole
    append_jsonl(path, {"kind": "restart", "global_step": 4})
    assert read_jsonl(path) == [*RECORDS, {"kind": "restart", "global_step": 4}]
    assert repair_torn_tail(path) == 0                   # a whole file is left as it is


def test_a_torn_only_line_is_cut_to_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"id": "bypa')
    assert read_jsonl(path) == []
    assert repair_torn_tail(path) == 12 and path.read_bytes() == b""
    assert repair_torn_tail(tmp_path / "absent.jsonl") == 0


def test_the_repair_finds_a_newline_far_back_and_works_on_an_open_file(tmp_path: Path) -> None:
    path = tmp_path / "w.spool.jsonl"
    whole = _jsonl([{"items": "x" * 200_000}])           # longer than one backward read
    path.write_bytes(whole + b"y" * 150_000)
    with open(path, "rb+") as fh:
        assert repair_torn_tail(fh) == 150_000
    assert path.read_bytes() == whole


@pytest.mark.parametrize("damage", [b'{"kind": "ki\n', b"\x00\x00\x00\n", b"not json\n"])
def test_a_damaged_complete_line_raises_naming_it(tmp_path: Path, damage: bytes) -> None:
    path = tmp_path / "process.jsonl"
    path.write_bytes(_jsonl(RECORDS[:1]) + damage + _jsonl(RECORDS[1:]))
    with pytest.raises(CorruptLine, match=r"process.jsonl: line 2 is not JSON"):
        read_jsonl(path)
    path.write_bytes(_jsonl(RECORDS) + damage)           # a damaged last line, newline and all
    with pytest.raises(CorruptLine, match="line 3"):
        read_jsonl(path)
    assert repair_torn_tail(path) == 0                   # damage is not a torn tail


def test_blank_lines_are_passed_over(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n" + _jsonl(RECORDS[:1]) + b"  \n" + _jsonl(RECORDS[1:]))
    assert read_jsonl(path) == RECORDS


def test_git_sha_is_the_checkout_commit_or_none() -> None:
    sha = runfiles.git_sha()
    assert sha is None or (len(sha) == 40 and int(sha, 16) >= 0)
