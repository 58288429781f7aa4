"""Binary layout shared by the sparse and dense contribution formats.

All integers and floats are little-endian. A blob is

    header   magic b"SLCO" | version u16 | kind u8 | reserved u8 | stage u32 | replica u32
             | global_step u32 | run_tag u32 | n_params u32                     (28 bytes)
    n_params tensor records (kind-specific, see codec.py)
    trailer  crc32 of everything before it, u32

Version 2 (written since issue 14) names the run: `run_tag` is the first four bytes of the
BLAKE2b hash of the run's store key (`run_tag(run)`), so a blob copied from another run's
folder is told apart from this run's. It took the upper half of version 1's u64 global step,
so a blob keeps its size (and a run its byte counts); version 1 blobs still decode, with
`run_tag` None, and the gather rejects them for carrying no run. The tag guards against
mix-ups, not forgery: anyone who can read the store can compute it.

The CRC makes truncation and bit flips detectable before any field is trusted; every other
check still runs, because a well-formed blob can carry bad numbers. `Reader` turns every short
read into `InvalidContribution`, so garbage never escapes as `struct.error` or `IndexError`.
"""
from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np

MAGIC = b"SLCO"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
KIND_SPARSE = 0
KIND_DENSE = 1
_HEADER = struct.Struct("<4sHBBIIIII")      # version 2
_HEADER_V1 = struct.Struct("<4sHBBIIQI")    # same size: global_step u64, no run tag
HEADER_BYTES = _HEADER.size
_CRC = struct.Struct("<I")
TRAILER_BYTES = _CRC.size
MAX_GLOBAL_STEP = 2**32 - 1
MAX_NAME_BYTES = 1024
MAX_NDIM = 8


class InvalidContribution(ValueError):
    """A contribution blob failed validation; `reason` says which field and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def run_tag(run: str) -> int:
    """The u32 a blob's header carries to name its run: the first 4 bytes (little-endian) of
    the BLAKE2b hash of the run's store key."""
    return int.from_bytes(hashlib.blake2b(run.encode("utf-8"), digest_size=4).digest(), "little")


class Writer:
    """Accumulates the parts of one blob; `finish` appends the CRC trailer."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def header(self, *, kind: int, stage: int, replica: int, global_step: int, run_tag: int,
               n_params: int) -> None:
        """Raises ValueError for a global step or run tag that does not fit 32 bits."""
        if not 0 <= global_step <= MAX_GLOBAL_STEP or not 0 <= run_tag <= 0xFFFFFFFF:
            raise ValueError(f"global_step {global_step} and run_tag {run_tag} must fit an "
                             "unsigned 32-bit field")
        self._parts.append(_HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, stage, replica,
                                        global_step, run_tag, n_params))

    def pack(self, fmt: str, *values: object) -> None:
        self._parts.append(struct.pack(fmt, *values))

    def name(self, name: str) -> None:
        raw = name.encode("utf-8")
        if len(raw) > MAX_NAME_BYTES:
            raise ValueError(f"parameter name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
        self.pack("<H", len(raw))
        self._parts.append(raw)

    def shape(self, shape: tuple[int, ...]) -> None:
        if len(shape) > MAX_NDIM:
            raise ValueError(f"tensors of rank {len(shape)} are not supported (max {MAX_NDIM})")
        self.pack(f"<B{len(shape)}I", len(shape), *shape)

    def raw(self, data: bytes) -> None:
        self._parts.append(data)

    def finish(self) -> bytes:
        body = b"".join(self._parts)
        return body + _CRC.pack(zlib.crc32(body))


class Reader:
    """Bounds-checked sequential reader over a blob whose CRC has been verified."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) == 0:
            raise InvalidContribution("empty object (0 bytes)")
        if len(blob) < _HEADER.size + _CRC.size:
            raise InvalidContribution(f"truncated: {len(blob)} bytes is shorter than the "
                                      f"{_HEADER.size + _CRC.size}-byte header and trailer")
        body, (crc,) = blob[:-_CRC.size], _CRC.unpack(blob[-_CRC.size:])
        if blob[:4] != MAGIC:
            raise InvalidContribution(f"bad magic {bytes(blob[:4])!r}, expected {MAGIC!r}")
        version = struct.unpack_from("<H", blob, 4)[0]
        if version not in READABLE_VERSIONS:
            raise InvalidContribution(f"format version {version} is not supported "
                                      f"(this build reads versions {READABLE_VERSIONS})")
        if zlib.crc32(body) != crc:
            raise InvalidContribution("checksum mismatch: the object is truncated or corrupted")
        self._buf = memoryview(body)
        self._pos = 0

    def header(self) -> tuple[int, int, int, int, int, int | None, int]:
        """(version, kind, stage, replica, global_step, run_tag, n_params); run_tag is None
        for a version 1 blob, which has none."""
        version = struct.unpack_from("<H", self._buf, 4)[0]
        if version == 1:
            _magic, version, kind, _res, stage, replica, step, n = self.unpack(_HEADER_V1.format)
            return version, kind, stage, replica, step, None, n
        _magic, version, kind, _res, stage, replica, step, tag, n = self.unpack(_HEADER.format)
        return version, kind, stage, replica, step, tag, n

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self._need(size, fmt)
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return values

    def take(self, n: int, what: str) -> memoryview:
        self._need(n, what)
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def name(self) -> str:
        (length,) = self.unpack("<H")
        if length > MAX_NAME_BYTES:
            raise InvalidContribution(f"parameter name of {length} bytes exceeds {MAX_NAME_BYTES}")
        try:
            return bytes(self.take(length, "parameter name")).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidContribution(f"parameter name is not UTF-8: {exc}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        (ndim,) = self.unpack("<B")
        if ndim > MAX_NDIM:
            raise InvalidContribution(f"{name}: rank {ndim} exceeds {MAX_NDIM}")
        return tuple(self.unpack(f"<{ndim}I"))

    def done(self) -> None:
        left = len(self._buf) - self._pos
        if left:
            raise InvalidContribution(f"{left} unexpected trailing bytes after the last tensor")

    def _need(self, n: int, what: str) -> None:
        if self._pos + n > len(self._buf):
            raise InvalidContribution(f"truncated while reading {what}: need {n} bytes at offset "
                                      f"{self._pos}, only {len(self._buf) - self._pos} left")


def pack_indices12(idx: np.ndarray) -> bytes:
    """Pack indices < 4096 two per three bytes (an odd count is padded with a zero index)."""
    v = idx.astype(np.uint16, copy=False)
    if v.size % 2:
        v = np.concatenate([v, np.zeros(1, dtype=np.uint16)])
    a, b = v[0::2], v[1::2]
    out = np.empty((a.size, 3), dtype=np.uint8)
    out[:, 0] = a & 0xFF
    out[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    out[:, 2] = b >> 4
    return out.tobytes()


def unpack_indices12(raw: memoryview, count: int) -> np.ndarray:
    """Inverse of `pack_indices12`: `count` indices as int64."""
    triples = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int64)
    out = np.empty(triples.shape[0] * 2, dtype=np.int64)
    out[0::2] = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    out[1::2] = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return out[:count]


def indices12_bytes(count: int) -> int:
    return (count + 1) // 2 * 3


def pack_codes2(codes: np.ndarray) -> bytes:
    """Pack 2-bit codes four per byte, first code in the lowest bits (zero-padded)."""
    c = codes.astype(np.uint8, copy=False)
    pad = (-c.size) % 4
    if pad:
        c = np.concatenate([c, np.zeros(pad, dtype=np.uint8)])
    c = c.reshape(-1, 4)
    return (c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)).astype(np.uint8).tobytes()


def unpack_codes2(raw: memoryview, count: int) -> np.ndarray:
    """Inverse of `pack_codes2`: `count` codes as int64 in [0, 3]."""
    b = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty((b.size, 4), dtype=np.int64)
    for j in range(4):  # 4 bit positions, not a loop over data
        out[:, j] = (b >> (2 * j)) & 3
    return out.reshape(-1)[:count]


def codes2_bytes(count: int) -> int:
    return (count + 3) // 4
