"""Durable run files: the one module that replaces a file atomically, appends a JSON line
durably, reads JSON lines and repairs a torn tail. Stdlib only: the API, the command line and
the flows use it without torch.

Atomic write (`atomic_file`, `write_bytes_atomic`, `write_text_atomic`, `write_json_atomic`):
the data goes to a temporary file beside the target (so the rename stays on one file system),
is fsync'd, renamed over the target with `os.replace`, and the folder is fsync'd where the
platform allows it (POSIX), so that the rename itself survives a power cut. A reader sees the
old file whole or the new one whole, never a mix; a write that fails leaves the old file as it
was and removes its temporary. `durable=False` skips both fsyncs (a file rewritten whenever it
is needed again); the write is still atomic. The new file gets the permissions `open` would
give it (0o666 less the umask).

JSON lines, one rule everywhere: a record counts once its line, newline included, is on disk.
Every append writes the line and its newline in one write and fsyncs before it returns
(`append_jsonl`, `append_line`; `JsonlAppender` batches lines and is durable at `sync`), so
the only damage a killed writer can leave is a **torn tail**: bytes after the last newline.
Readers ignore a torn tail (`read_jsonl`, with a warning); `repair_torn_tail` cuts it in place
(truncate, fsync) before anyone appends, so that the next line starts a line of its own. A line
that ends with its newline but is not JSON was written whole and damaged later: `read_jsonl`
raises `CorruptLine` naming the file and the line, never skips it silently. Blank lines are
passed over. (The registry's spool and final-state files share the torn-tail rule; their
drain sets a complete line it cannot use aside instead of raising: see
`crucible.registry.spool`.)
"""
from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_file", "write_bytes_atomic", "write_text_atomic", "write_json_atomic",
           "write_bytes_if_absent", "write_temp", "replace", "append_line", "append_jsonl",
           "JsonlAppender", "read_jsonl", "CorruptLine", "repair_torn_tail", "git_sha"]

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
_SCAN_BYTES = 65536     # read backwards this much at a time when looking for the last newline


# -- atomic replacement ---------------------------------------------------------------------
def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable. Where a folder cannot be opened or fsync'd (not
    POSIX; some file systems refuse with EINVAL), the rename is as durable as the platform
    makes it."""
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open_temp(path: Path, prefix: str | None) -> tuple[IO[bytes], Path]:
    """A new, empty file beside `path` (the folder made if missing), open for writing."""
    stem = f".{path.name}." if prefix is None else prefix
    while True:
        tmp = path.with_name(f"{stem}{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        except FileNotFoundError:       # the first file in this folder
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        return os.fdopen(fd, "wb"), tmp


def write_temp(path: PathLike, data: bytes, *, durable: bool = True,
               temp_prefix: str | None = None) -> Path:
    """The first half of an atomic write: `data` in a new temporary file beside `path`
    (fsync'd unless `durable=False`), named as `atomic_file` names it; returns its path.
    What a writer killed before the rename leaves behind (a test stops a writer here)."""
    path = Path(path)
    fh, tmp = _open_temp(path, temp_prefix)
    try:
        with fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


@contextmanager
def atomic_file(path: PathLike, *, durable: bool = True,
                temp_prefix: str | None = None) -> Iterator[IO[bytes]]:
    """A binary file to write `path`'s new content to: it replaces `path` when the block ends
    without an exception (fsync'd, renamed, folder fsync'd; no fsync with `durable=False`); an
    exception removes it and leaves `path` as it was. The temporary file is named
    `<temp_prefix><random>.tmp` beside `path` (default prefix `.<name>.`)."""
    path = Path(path)
    fh, tmp = _open_temp(path, temp_prefix)
    try:
        with fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def write_bytes_atomic(path: PathLike, data: bytes, *, durable: bool = True,
                       temp_prefix: str | None = None) -> None:
    """Replace `path` with `data` atomically (see `atomic_file`). Raises what `os.replace`
    raises (IsADirectoryError when a folder is in the way), with the temporary removed."""
    with atomic_file(path, durable=durable, temp_prefix=temp_prefix) as fh:
        fh.write(data)


def write_text_atomic(path: PathLike, text: str) -> None:
    """`write_bytes_atomic` of `text` as UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: PathLike, data: Any) -> None:
    """`write_bytes_atomic` of `data` as indented, key-sorted, newline-terminated JSON."""
    write_bytes_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def write_bytes_if_absent(path: PathLike, data: bytes, *, temp_prefix: str | None = None) -> bool:
    """Create `path` holding `data` only if nothing is there, atomically (a durable temporary
    hard-linked into place); True if this call created it. Of concurrent callers exactly one
    wins, and a reader never sees the file partly written."""
    path = Path(path)
    tmp = write_temp(path, bytes(data), temp_prefix=temp_prefix)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    _fsync_dir(path.parent)
    return True


def replace(src: PathLike, dst: PathLike) -> None:
    """Rename `src` over `dst` (`os.replace`) and make the rename durable (both folders
    fsync'd where the platform allows)."""
    src, dst = Path(src), Path(dst)
    os.replace(src, dst)
    _fsync_dir(dst.parent)
    if src.parent != dst.parent:
        _fsync_dir(src.parent)


# -- JSON lines -----------------------------------------------------------------------------
def _encode(record: Any) -> bytes:
    return json.dumps(record).encode("utf-8") + b"\n"


def append_line(file: PathLike | IO[bytes], line: bytes) -> None:
    """Append one whole line (or several: bytes ending in a newline) to `file`, a path or a
    binary file open for writing (written at its end), in one write, fsync'd before this
    returns: once it returns, the lines survive a SIGKILL or a power cut."""
    if not line.endswith(b"\n"):
        raise ValueError(f"a line to append must end with a newline, got {line[-20:]!r}")
    if isinstance(file, (str, os.PathLike)):
        with open(file, "ab") as fh:
            append_line(fh, line)
        return
    file.seek(0, os.SEEK_END)
    file.write(line)
    file.flush()
    os.fsync(file.fileno())


def append_jsonl(file: PathLike | IO[bytes], record: Any) -> None:
    """Append `record` as one JSON line, durable before this returns (see `append_line`)."""
    append_line(file, _encode(record))


class JsonlAppender:
    """Appends JSON lines to one file, buffered: what was appended is durable once `sync`
    returns (for a writer that makes a batch of lines durable at once, e.g. once a step).
    A caller opening an existing file repairs its torn tail first (`repair_torn_tail`)."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "ab")

    def append(self, record: Any) -> None:
        self._fh.write(_encode(record))

    def sync(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if not self._fh.closed:
            self.sync()
            self._fh.close()


class CorruptLine(ValueError):
    """A complete line of a JSON-lines file is not JSON: the file was damaged after the line
    was written (a torn tail is never this; see the module docstring)."""


def read_jsonl(path: PathLike) -> list[Any]:
    """The records of the JSON-lines file `path` ([] when it does not exist). A torn tail
    (bytes after the last newline) is passed over with a warning; raises `CorruptLine` for a
    complete line that is not JSON."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n") + 1
    if end != len(data):
        log.warning("%s: passing over a torn last line (%d bytes: a process died writing it)",
                    path, len(data) - end)
    records = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            raise CorruptLine(f"{path}: line {number} is not JSON; the file is damaged "
                              f"({line[:60]!r})") from None
    return records


def _last_line_end(fh: IO[bytes], size: int) -> int:
    """The offset just after the last newline of `fh` (0 when there is none), read backwards
    so that a long file is not read whole."""
    end = size
    while end > 0:
        start = max(0, end - _SCAN_BYTES)
        fh.seek(start)
        newline = fh.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def repair_torn_tail(file: PathLike | IO[bytes]) -> int:
    """Cut a torn tail (bytes after the last newline, left by a writer killed mid-append) off
    `file`, a path or a binary file open for reading and writing, in place (truncated,
    fsync'd), so that the next append starts a line of its own. Returns the bytes cut (0 for
    a whole or absent file)."""
    if isinstance(file, (str, os.PathLike)):
        try:
            fh = open(file, "r+b")
        except FileNotFoundError:
            return 0
        with fh:
            return repair_torn_tail(fh)
    size = os.fstat(file.fileno()).st_size
    end = _last_line_end(file, size)
    if end == size:
        return 0
    log.warning("%s: cutting a torn last line (%d bytes: a process died writing it)",
                getattr(file, "name", "a file"), size - end)
    file.truncate(end)
    file.flush()
    os.fsync(file.fileno())
    return size - end


# -- what wrote a run ------------------------------------------------------------------------
@functools.cache
def git_sha() -> str | None:
    """The full commit of the git checkout holding crucible, or None outside one (an
    installed wheel, a container). Asked once per process."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None
