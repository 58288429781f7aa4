"""Object stores: where contributions, manifests and checkpoints live.

One small protocol (`put`, `get`, `list`, `delete`, `exists`, `put_if_absent`) with two
implementations that behave identically: `LocalStore` (a directory, the embedded default) and
`S3Store` (boto3 against AWS, R2, MinIO or any S3-compatible endpoint). `open_store` picks one
from a URL: `file:///abs/path` or `s3://bucket/prefix`.

Keys are '/'-separated relative paths, validated the same way for both stores (no '..', '.',
empty segments, absolute paths or backslashes), so a key means the same object everywhere.
Errors: `KeyNotFound` for a missing key, `TransientStoreError` for what a retry may cure
(network, 5xx, throttling: the orchestration layer retries those), `StoreError` for the rest.
`delete` of a missing key is a no-op, as in S3.

`put(..., durable=False)` is for objects that are rewritten, byte for byte, whenever they are
needed again (an outer round's contributions: a resumed run re-encodes and re-uploads them
before it reads them). `LocalStore` then skips the fsync; the write is still atomic, and a blob
torn by a power cut fails its CRC instead of being used. S3 is always durable.

Sizes before reads: anything another peer could have written is read with
`get(key, max_bytes=N)`, which checks the object's size first (`fstat` of the opened file; the
`Content-Length` of the GET response, before its body is read) and raises `ObjectTooLarge`
without reading it; it never returns more than N bytes, even if the object grew in between.
`sizes(prefix)` is `list` with each object's size (a stat per file; the size S3's listing
already carries), so a caller can refuse an object without asking for it at all.
`remove_temporaries(prefix)` deletes the `.tmp-*` files a killed `LocalStore` writer left
(S3 writes whole objects and leaves none).

Only regular files are objects. Anyone who can write to a `LocalStore`'s folder can also leave a
FIFO (opening it for reading would wait forever for a writer), a socket, a device, a directory
or a symbolic link (to /dev/zero, or to a file outside the store) where an object belongs.
`get` opens without following a link at the key and without blocking (`O_NOFOLLOW |
O_NONBLOCK`), checks the opened file (`fstat`) and raises `InvalidObject` for anything but a
regular file (or for a file this process may not open), unread; its message names the key and the kind, never the local path, so every
peer gives the same reason. Links in the folders above a key are still followed (an operator
may keep a run's folder on another disk). `list` and `sizes` name everything at a key that is
not a directory, regular or not (a size as `lstat` gives it), so a reader meets such an entry
and rejects it instead of taking the slot for empty. A directory at a key blocks it: `get`
raises `InvalidObject`, `put_if_absent` returns False, `put` raises `StoreError`.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import unquote, urlparse

from crucible.runfiles import write_bytes_atomic, write_bytes_if_absent, write_temp

__all__ = ["Store", "StoreError", "TransientStoreError", "KeyNotFound", "ObjectTooLarge",
           "InvalidObject", "LocalStore", "S3Store", "open_store", "parse_store_url", "validate_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_TMP_PREFIX = ".tmp-"


class StoreError(Exception):
    """An object-store operation failed for a reason a retry will not fix."""


class TransientStoreError(StoreError):
    """A network error, a 5xx or throttling: retrying later may succeed."""


class KeyNotFound(StoreError):
    """The key does not exist in the store."""


class ObjectTooLarge(StoreError):
    """An object is larger than the reader's limit; it was not read."""

    def __init__(self, key: str, size: int, limit: int) -> None:
        super().__init__(f"object {key!r} has {size} bytes, more than the {limit} allowed")
        self.key, self.size, self.limit = key, size, limit


class InvalidObject(StoreError):
    """Something other than an object holds the key (a `LocalStore` entry that is not a
    regular file); it was not read. A reader treats it like an object with invalid content."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"object {key!r} {why}; not read")
        self.key = key


# Opens an object for reading: never through a link at the key (it may point at a device or
# outside the store), never waiting (opening a FIFO for reading blocks until a writer comes).
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# What opening something at a key that is not an object gives: a link (ELOOP), a socket or a
# device without a driver (ENXIO, ENODEV), a file of someone else's (EACCES, EPERM).
_NOT_AN_OBJECT = {errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EACCES, errno.EPERM}
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "of an unknown file type")


class Store(Protocol):
    """A flat key -> bytes object store."""

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def sizes(self, prefix: str = "") -> dict[str, int]: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...
    def remove_temporaries(self, prefix: str = "") -> tuple[int, int]: ...


def validate_key(key: str) -> str:
    """Return `key` if it is a valid relative '/'-separated key, else raise ValueError."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"store key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"store key {key!r} must be relative, '/'-separated, without NUL")
    bad = [seg for seg in key.split("/") if seg in ("", ".", "..") or seg.startswith(_TMP_PREFIX)]
    if bad:
        raise ValueError(f"store key {key!r} has an invalid segment {bad[0]!r} "
                         f"(no empty, '.', '..' or '{_TMP_PREFIX}*' segments)")
    return key


def _validate_prefix(prefix: str) -> str:
    if prefix and (prefix.startswith("/") or ".." in prefix.split("/") or "\\" in prefix):
        raise ValueError(f"store prefix {prefix!r} must be relative and free of '..'")
    return prefix


class LocalStore:
    """A directory as an object store. Writes are atomic (`crucible.runfiles`: temp file in the
    same directory, fsync, rename, folder fsync; no fsync with `durable=False`), so a reader
    never sees half an object."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def write_temporary(self, key: str, data: bytes) -> str:
        """Write `data` to a temporary `.tmp-*` file beside `key`'s path and stop there: what a
        writer killed before its rename leaves (`remove_temporaries` removes it; no read sees
        it). The fault injection of `crucible.distributed.injection` stops an upload here."""
        return str(write_temp(self._path(key), data, durable=True, temp_prefix=_TMP_PREFIX))

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        try:
            write_bytes_atomic(self._path(key), data, durable=durable, temp_prefix=_TMP_PREFIX)
        except IsADirectoryError:  # nothing this class writes; someone else's, not ours to remove
            raise StoreError(f"cannot write object {key!r} in {self!r}: a directory is in its "
                             "place (not written by crucible; remove it)") from None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` only if it does not exist (atomically, via a hard link); True if written."""
        return write_bytes_if_absent(self._path(key), data, temp_prefix=_TMP_PREFIX)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The object's bytes. Raises KeyNotFound, InvalidObject (not a regular file) or
        ObjectTooLarge (more than `max_bytes`), the last two without reading it."""
        fd = self._open(key)
        with open(fd, "rb") as fh:  # owns fd from here
            if max_bytes is None:
                return fh.read()
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise ObjectTooLarge(key, size, max_bytes)
            data = fh.read(max_bytes + 1)  # the file may have grown since the fstat
        if len(data) > max_bytes:
            raise ObjectTooLarge(key, len(data), max_bytes)
        return data

    def _open(self, key: str) -> int:
        """A descriptor of the regular file at `key` (see the module docstring)."""
        try:
            fd = os.open(self._path(key), _OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyNotFound(f"no object {key!r} in {self!r}") from None
        except OSError as exc:
            if exc.errno not in _NOT_AN_OBJECT:  # this machine's trouble (EMFILE, EIO, ...)
                raise StoreError(f"cannot open object {key!r} in {self!r}: {exc}") from None
            try:
                mode = os.lstat(self._path(key)).st_mode
            except OSError:
                mode = stat.S_IFREG
            if stat.S_ISREG(mode):  # a file this process may not read
                raise InvalidObject(key, f"cannot be opened ({os.strerror(exc.errno)})"
                                    ) from None
            raise InvalidObject(key, f"is {_kind(mode)}, not a regular file") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise InvalidObject(key, f"is {_kind(mode)}, not a regular file")
        return fd

    def _walk(self, prefix: str, *, temporaries: bool = False) -> list[tuple[str, Path]]:
        """(key, path) of every object under `prefix` (or, with `temporaries`, of every
        temporary file instead), in key order."""
        _validate_prefix(prefix)
        # Walk only the deepest directory the prefix names, then filter by the full prefix.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*base.split("/")) if base else self.root
        if not start.is_dir():
            return []
        found = []
        for dirpath, _dirs, files in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(_TMP_PREFIX) != temporaries:
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    found.append((key, Path(dirpath) / name))
        return sorted(found)

    def list(self, prefix: str = "") -> list[str]:
        return [key for key, _ in self._walk(prefix)]

    def sizes(self, prefix: str = "") -> dict[str, int]:
        out = {}
        for key, path in self._walk(prefix):
            try:  # the entry itself, as `get` sees it: a link is not followed
                out[key] = path.lstat().st_size
            except FileNotFoundError:  # deleted since the walk: not there
                continue
        return out

    def remove_temporaries(self, prefix: str = "") -> tuple[int, int]:
        """Delete the temporary files of interrupted writes under `prefix`; returns (files,
        bytes). Only for a prefix no live writer uses (a run's own, when it starts): a writer
        in flight would lose its temporary file."""
        files = size = 0
        for _key, path in self._walk(prefix, temporaries=True):
            try:
                size += path.stat().st_size
                path.unlink()
                files += 1
            except FileNotFoundError:
                continue
        return files, size

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Folders left empty go too (pruned rounds would pile them up); a writer that loses its
        # folder this way recreates it (`runfiles.write_temp`).
        for folder in path.parents:
            if folder == self.root:
                break
            try:
                folder.rmdir()
            except OSError:  # not empty, or gone
                break

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()


_TRANSIENT_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable",
                    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "TooManyRequestsException", "429",
                    "TooManyRequests", "RequestLimitExceeded", "BandwidthLimitExceeded",
                    "RequestThrottled", "ProvisionedThroughputExceededException"}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
# 409: a concurrent conditional write to the same key is in flight; the other writer wins.
_EXISTS_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class S3Store:
    """An S3 bucket (under an optional key prefix) as an object store, through boto3.

    Credentials come from the usual boto3 chain. Checksums are computed and validated only when
    required, which S3-compatible stores (R2, MinIO) need. Transient failures are retried
    `attempts` times with exponential backoff and jitter, then raised as `TransientStoreError`.
    That loop is the only retry layer: botocore's own retries are off (`total_max_attempts` 1),
    so an outage costs `attempts` requests, not `attempts` x botocore's.
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, attempts: int = 5, backoff_s: float = 0.2) -> None:
        import boto3
        from botocore.config import Config as BotoConfig

        if not bucket:
            raise ValueError("S3Store needs a bucket name (store.url = s3://BUCKET/prefix)")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        if self.prefix:
            validate_key(self.prefix)
        self.attempts, self.backoff_s = max(1, attempts), backoff_s
        config = BotoConfig(request_checksum_calculation="when_required",
                            response_checksum_validation="when_required",
                            retries={"total_max_attempts": 1, "mode": "standard"},
                            connect_timeout=10, read_timeout=60)
        self._client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region,
                                    config=config)

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}')"

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient failures with backoff; map errors onto StoreError."""
        from botocore.exceptions import BotoCoreError, ClientError

        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
                if code in _MISSING_CODES:
                    raise KeyNotFound(f"{what}: no such object in {self!r}") from None
                if code not in _TRANSIENT_CODES and status not in _TRANSIENT_CODES:
                    raise StoreError(f"{what} failed on {self!r}: {code} {exc}") from exc
                error: StoreError = TransientStoreError(f"{what} failed on {self!r}: {code}")
            except BotoCoreError as exc:  # connection refused/reset, timeouts, incomplete reads
                error = TransientStoreError(f"{what} failed on {self!r}: {exc}")
            if attempt == self.attempts:
                raise error
            delay = self.backoff_s * 2 ** (attempt - 1) * (1 + random.random())
            log.warning("%s (attempt %d/%d), retrying in %.2fs", error, attempt, self.attempts,
                        delay)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        full = self._full(validate_key(key))
        self._call(f"put {key!r}", lambda: self._client.put_object(
            Bucket=self.bucket, Key=full, Body=bytes(data)))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` only if absent (S3 conditional write, `If-None-Match: *`)."""
        from botocore.exceptions import ClientError

        full = self._full(validate_key(key))

        def _put() -> bool:
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=bytes(data),
                                        IfNoneMatch="*")
                return True
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _EXISTS_CODES:
                    return False
                raise

        return self._call(f"put_if_absent {key!r}", _put)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        full = self._full(validate_key(key))

        def _get() -> bytes:
            response = self._client.get_object(Bucket=self.bucket, Key=full)
            stream = response["Body"]
            if max_bytes is None:
                return stream.read()
            try:  # the headers carry the size: refuse before a byte of the body is read
                size = int(response.get("ContentLength", 0))
                if size > max_bytes:
                    raise ObjectTooLarge(key, size, max_bytes)
                data = stream.read(max_bytes + 1)
            finally:
                stream.close()
            if len(data) > max_bytes:
                raise ObjectTooLarge(key, len(data), max_bytes)
            return data

        return self._call(f"get {key!r}", _get)

    def _listing(self, prefix: str) -> dict[str, int]:
        full = self._full(_validate_prefix(prefix)) if prefix else (
            f"{self.prefix}/" if self.prefix else "")
        skip = len(self.prefix) + 1 if self.prefix else 0

        def _list() -> dict[str, int]:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full)
            return {obj["Key"][skip:]: int(obj["Size"])
                    for page in pages for obj in page.get("Contents", [])}

        return dict(sorted(self._call(f"list {prefix!r}", _list).items()))

    def list(self, prefix: str = "") -> list[str]:
        return list(self._listing(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        return self._listing(prefix)

    def remove_temporaries(self, prefix: str = "") -> tuple[int, int]:
        """S3 stores whole objects only: nothing to remove."""
        return 0, 0

    def delete(self, key: str) -> None:
        full = self._full(validate_key(key))
        self._call(f"delete {key!r}", lambda: self._client.delete_object(
            Bucket=self.bucket, Key=full))

    def exists(self, key: str) -> bool:
        full = self._full(validate_key(key))
        try:
            self._call(f"head {key!r}", lambda: self._client.head_object(
                Bucket=self.bucket, Key=full))
            return True
        except KeyNotFound:
            return False


# System pseudo-filesystems: a path under one of these is never a place to keep objects.
_PSEUDO_FS = ("/proc", "/sys", "/dev")
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")   # what botocore itself accepts


def parse_store_url(url: str, *, field: str = "store.url") -> tuple[str, str, str]:
    """Split a store URL into ("file", absolute path, "") or ("s3", bucket, key prefix).

    Checks the form only (nothing is opened): a file URL needs an absolute path outside the
    system pseudo-filesystems (/proc, /sys, /dev); an S3 URL needs a bucket and a prefix that is
    a valid key. Raises ValueError naming `field`, the value and the accepted forms."""
    parsed = urlparse(url or "")
    if parsed.scheme == "file":
        path = unquote(parsed.path)  # Path.as_uri() percent-encodes
        if parsed.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ValueError(f"{field}={url!r}: a file URL needs an absolute path, "
                             "e.g. file:///var/crucible/store (three slashes)")
        norm = os.path.normpath(path)
        if any(norm == top or norm.startswith(top + "/") for top in _PSEUDO_FS):
            raise ValueError(f"{field}={url!r} is inside a system pseudo-filesystem "
                             f"({', '.join(_PSEUDO_FS)}); point it at a folder on a real disk, "
                             "e.g. file:///var/crucible/store")
        return "file", norm, ""
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{field}={url!r}: an S3 URL needs a bucket, "
                             "e.g. s3://bucket/prefix")
        if not _BUCKET.fullmatch(parsed.netloc):
            raise ValueError(f"{field}={url!r}: {parsed.netloc!r} is not a bucket name "
                             "(letters, digits, '.', '_' and '-'; no port or credentials)")
        prefix = parsed.path.strip("/")
        if prefix:
            try:
                validate_key(prefix)
            except ValueError as exc:
                raise ValueError(f"{field}={url!r}: bad key prefix: {exc}") from None
        return "s3", parsed.netloc, prefix
    raise ValueError(f"{field}={url!r} is not supported; use file:///abs/path or "
                     "s3://bucket/prefix")


def open_store(url: str, endpoint_url: str | None = None, region: str | None = None) -> Store:
    """The store named by `url`: `file:///abs/path` (a local directory) or `s3://bucket/prefix`.
    Raises ValueError naming `store.url` and the accepted forms for anything else
    (`parse_store_url`)."""
    scheme, location, prefix = parse_store_url(url)
    if scheme == "file":
        return LocalStore(location)
    return S3Store(location, prefix, endpoint_url=endpoint_url, region=region)
