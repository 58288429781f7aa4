"""Binary layout shared by the sparse and dense contribution formats.

All integers and floats are little-endian. A blob is

    header   magic b"SLCO" | version u16 | kind u8 | reserved u8 | stage u32 | replica u32
             | global_step u64 | n_params u32                                      (28 bytes)
    n_params tensor records (kind-specific, see codec.py)
    trailer  crc32 of everything before it, u32

The CRC makes truncation and bit flips detectable before any field is trusted; every other
check still runs, because a well-formed blob can carry bad numbers. `Reader` turns every short
read into `InvalidContribution`, so garbage never escapes as `struct.error` or `IndexError`.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

MAGIC = b"SLCO"
FORMAT_VERSION = 1
KIND_SPARSE = 0
KIND_DENSE = 1
_HEADER = struct.Struct("<4sHBBIIQI")
_CRC = struct.Struct("<I")
MAX_NAME_BYTES = 1024
MAX_NDIM = 8


class InvalidContribution(ValueError):
    """A contribution blob failed validation; `reason` says which field and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Writer:
    """Accumulates the parts of one blob; `finish` appends the CRC trailer."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def header(self, *, kind: int, stage: int, replica: int, global_step: int,
               n_params: int) -> None:
        self._parts.append(_HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, stage, replica,
                                        global_step, n_params))

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
        if version != FORMAT_VERSION:
            raise InvalidContribution(f"format version {version} is not supported "
                                      f"(this build reads version {FORMAT_VERSION})")
        if zlib.crc32(body) != crc:
            raise InvalidContribution("checksum mismatch: the object is truncated or corrupted")
        self._buf = memoryview(body)
        self._pos = 0

    def header(self) -> tuple[int, int, int, int, int, int]:
        """(version, kind, stage, replica, global_step, n_params)."""
        _magic, version, kind, _res, stage, replica, step, n = self.unpack(_HEADER.format)
        return version, kind, stage, replica, step, n

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
