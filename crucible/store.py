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
"""
from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import unquote, urlparse

__all__ = ["Store", "StoreError", "TransientStoreError", "KeyNotFound", "LocalStore", "S3Store",
           "open_store", "validate_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_TMP_PREFIX = ".tmp-"


class StoreError(Exception):
    """An object-store operation failed for a reason a retry will not fix."""


class TransientStoreError(StoreError):
    """A network error, a 5xx or throttling: retrying later may succeed."""


class KeyNotFound(StoreError):
    """The key does not exist in the store."""


class Store(Protocol):
    """A flat key -> bytes object store."""

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...


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
    """A directory as an object store. Writes are atomic (temp file in the same directory, fsync,
    `os.replace`), so a reader never sees half an object."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _write_temp(self, path: Path, data: bytes, *, durable: bool = True) -> str:
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        except FileNotFoundError:  # first object under this prefix
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                if durable:
                    fh.flush()
                    os.fsync(fh.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, bytes(data), durable=durable)
        os.replace(tmp, path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` only if it does not exist (atomically, via a hard link); True if written."""
        path = self._path(key)
        tmp = self._write_temp(path, bytes(data))
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyNotFound(f"no object {key!r} in {self!r}") from None

    def list(self, prefix: str = "") -> list[str]:
        _validate_prefix(prefix)
        # Walk only the deepest directory the prefix names, then filter by the full prefix.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*base.split("/")) if base else self.root
        if not start.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()


_TRANSIENT_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable",
                    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "TooManyRequestsException"}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
# 409: a concurrent conditional write to the same key is in flight; the other writer wins.
_EXISTS_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class S3Store:
    """An S3 bucket (under an optional key prefix) as an object store, through boto3.

    Credentials come from the usual boto3 chain. Checksums are computed and validated only when
    required, which S3-compatible stores (R2, MinIO) need. Transient failures are retried
    `attempts` times with exponential backoff and jitter, then raised as `TransientStoreError`.
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
                            retries={"max_attempts": 3, "mode": "standard"},
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

    def get(self, key: str) -> bytes:
        full = self._full(validate_key(key))

        def _get() -> bytes:
            return self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read()

        return self._call(f"get {key!r}", _get)

    def list(self, prefix: str = "") -> list[str]:
        full = self._full(_validate_prefix(prefix)) if prefix else (
            f"{self.prefix}/" if self.prefix else "")
        skip = len(self.prefix) + 1 if self.prefix else 0

        def _list() -> list[str]:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full)
            return [obj["Key"][skip:] for page in pages for obj in page.get("Contents", [])]

        return sorted(self._call(f"list {prefix!r}", _list))

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


def open_store(url: str, endpoint_url: str | None = None, region: str | None = None) -> Store:
    """The store named by `url`: `file:///abs/path` (a local directory) or `s3://bucket/prefix`.
    Raises ValueError naming `store.url` and the accepted forms for anything else."""
    parsed = urlparse(url or "")
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ValueError(f"store.url {url!r}: a file URL needs an absolute path, "
                             "e.g. file:///var/crucible/store")
        return LocalStore(unquote(parsed.path))  # Path.as_uri() percent-encodes
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store.url {url!r}: an S3 URL needs a bucket, e.g. s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path.strip("/"), endpoint_url=endpoint_url,
                       region=region)
    raise ValueError(f"store.url {url!r} is not supported; use file:///abs/path or "
                     "s3://bucket/prefix")
