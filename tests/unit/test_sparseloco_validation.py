"""Every malformed contribution is rejected with `InvalidContribution` and a precise reason;
garbage (truncations, bit flips, random bytes) never raises anything else."""
from __future__ import annotations

import random
import struct
import zlib

import pytest
import torch

from crucible.sparseloco import (
    InvalidContribution,
    decode_contribution,
    decode_dense,
    encode_contribution,
    encode_dense,
)

SHAPES = {"w": (128, 64), "v": (100,)}
HEADER = 28


def _blob(stage: int = 1) -> bytes:
    gen = torch.Generator().manual_seed(11)
    delta = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    return encode_contribution(delta, {}, beta=0.95, stage=stage, replica=0, global_step=4)[0]


def _reseal(body: bytes) -> bytes:
    """A corrupted body with a valid CRC, so the field checks (not the checksum) must catch it."""
    return body + struct.pack("<I", zlib.crc32(body))


def _quant_offset(name: str = "w", ndim: int = 2) -> int:
    """Offset of the first record's block_rows field (records follow the 28-byte header)."""
    return HEADER + 2 + len(name) + 1 + 4 * ndim


def _patch(blob: bytes, offset: int, fmt: str, *values: object) -> bytes:
    body = bytearray(blob[:-4])
    struct.pack_into(fmt, body, offset, *values)
    return _reseal(bytes(body))


def _reason(blob: bytes, **kwargs: object) -> str:
    kwargs.setdefault("stage", 1)
    with pytest.raises(InvalidContribution) as info:
        decode_contribution(blob, kwargs.pop("expected", SHAPES), **kwargs)  # type: ignore[arg-type]
    assert info.value.reason == str(info.value)
    return info.value.reason


def test_valid_blob_decodes() -> None:
    assert decode_contribution(_blob(), SHAPES, stage=1).replica == 0


def test_empty_object() -> None:
    assert "empty object" in _reason(b"")


def test_truncated_bytes() -> None:
    blob = _blob()
    assert "truncated or corrupted" in _reason(blob[:-7])
    assert "truncated" in _reason(blob[:20])
    # A truncation that is resealed still fails on the structure, not the checksum.
    assert "truncated while reading" in _reason(_reseal(blob[:-40]))


def test_wrong_version() -> None:
    assert "format version 3" in _reason(_patch(_blob(), 4, "<H", 3))


def test_version_1_blobs_still_decode_without_a_run_tag() -> None:
    """Version 1 kept the global step in a u64 where version 2 keeps step u32 + run tag u32: a
    version 1 blob of a step < 2**32 reads the same, with no run tag (the gather refuses it)."""
    v2 = encode_contribution({n: torch.ones(s) for n, s in SHAPES.items()}, {}, beta=0.95,
                             stage=1, replica=0, global_step=4, run_tag=0)[0]
    v1 = _patch(v2, 4, "<H", 1)
    got = decode_contribution(v1, SHAPES, stage=1, global_step=4)
    assert (got.version, got.global_step, got.run_tag) == (1, 4, None)
    assert decode_contribution(v2, SHAPES, stage=1).run_tag == 0


def test_bad_magic() -> None:
    assert "magic" in _reason(b"XXXX" + _blob()[4:])


def test_nan_table() -> None:
    off = _quant_offset() + 6 + 8  # after block_rows, block_cols, k, shift, scale
    assert "non-finite" in _reason(_patch(_blob(), off + 4, "<f", float("nan")))


def test_infinite_shift() -> None:
    assert "non-finite" in _reason(_patch(_blob(), _quant_offset() + 6, "<f", float("inf")))


def test_scale_1e9() -> None:
    assert "scale 1e+09 outside" in _reason(_patch(_blob(), _quant_offset() + 10, "<f", 1e9))


def test_scale_zero() -> None:
    assert "scale 0 outside" in _reason(_patch(_blob(), _quant_offset() + 10, "<f", 0.0))


def test_wrong_k_in_the_record() -> None:
    assert "k=63" in _reason(_patch(_blob(), _quant_offset() + 4, "<H", 63))


def test_wrong_k_for_the_receivers_configuration() -> None:
    assert "sparseloco.topk=32" in _reason(_blob(), topk=32)


def test_out_of_range_index() -> None:
    # "v" (100,) is cut into 2 chunks of 50 values, so a 12-bit index of 63 is out of range.
    blob = _blob()
    rec_w = _quant_offset() + 30 + 3 * (128 * 64 // 4096 * 64 // 2) + 128 * 64 // 4096 * 64 // 4
    off_v = rec_w + 2 + 1 + 1 + 4 + 30  # name "v", ndim 1, one dim, quant fields
    body = bytearray(blob[:-4])
    body[off_v + 1] = (body[off_v + 1] & 0xF0)
    body[off_v] = 63
    assert "index 63 out of range" in _reason(_reseal(bytes(body)))


def test_duplicate_index() -> None:
    blob = _blob()
    off = _quant_offset() + 30
    body = bytearray(blob[:-4])
    first = body[off] | ((body[off + 1] & 0xF) << 8)
    body[off + 1] = (body[off + 1] & 0x0F) | ((first & 0xF) << 4)
    body[off + 2] = first >> 4  # second index := first index
    assert "strictly increasing" in _reason(_reseal(bytes(body)))


def test_missing_parameter() -> None:
    expected = dict(SHAPES, extra=(4, 4))
    assert "missing parameter(s): extra" in _reason(_blob(), expected=expected)


def test_unexpected_parameter() -> None:
    assert "unexpected parameter 'v'" in _reason(_blob(), expected={"w": (128, 64), "u": (100,)})


def test_shape_mismatch() -> None:
    assert "shape (128, 64) does not match" in _reason(_blob(),
                                                       expected={"w": (64, 128), "v": (100,)})


def test_wrong_stage() -> None:
    assert "for stage 1, expected stage 2" in _reason(_blob(stage=1), stage=2)


def test_wrong_replica_and_step() -> None:
    assert "from replica 0, expected replica 5" in _reason(_blob(), replica=5)
    assert "global step 4, expected 3" in _reason(_blob(), global_step=3)


def test_trailing_bytes() -> None:
    assert "trailing bytes" in _reason(_reseal(_blob()[:-4] + b"\0\0"))


def test_dense_blob_is_not_a_sparse_one() -> None:
    dense = encode_dense({n: torch.ones(s) for n, s in SHAPES.items()}, stage=1, replica=0,
                         global_step=4)
    assert "kind 1" in _reason(dense)
    with pytest.raises(InvalidContribution, match="kind 0"):
        decode_dense(_blob(), SHAPES, stage=1)


def test_dense_non_finite_value() -> None:
    blob = encode_dense({"v": torch.ones(100)}, stage=0, replica=0, global_step=0)
    body = bytearray(blob[:-4])
    struct.pack_into("<f", body, len(body) - 4, float("nan"))
    with pytest.raises(InvalidContribution, match="non-finite"):
        decode_dense(_reseal(bytes(body)), {"v": (100,)}, stage=0)


def _only_invalid_contribution(blob: bytes) -> None:
    try:
        decode_contribution(blob, SHAPES, stage=1)
    except InvalidContribution as exc:
        assert exc.reason
    else:
        raise AssertionError("garbage decoded")


def test_fuzz_truncations_bit_flips_and_random_bytes() -> None:
    blob = _blob()
    rng = random.Random(1234)
    for cut in range(0, len(blob), 7):
        _only_invalid_contribution(blob[:cut])
    for _ in range(300):
        flipped = bytearray(blob)
        pos = rng.randrange(len(flipped))
        flipped[pos] ^= 1 << rng.randrange(8)
        _only_invalid_contribution(bytes(flipped))
    for n in (1, 3, 31, 32, 33, 100, 2000):
        _only_invalid_contribution(bytes(rng.randrange(256) for _ in range(n)))


def test_fuzz_resealed_garbage_raises_only_invalid_contribution() -> None:
    """With a valid CRC the structural checks alone must hold the line."""
    blob = _blob()
    rng = random.Random(99)
    for _ in range(300):
        body = bytearray(blob[:-4])
        for _ in range(rng.randrange(1, 4)):
            pos = rng.randrange(len(body))
            body[pos] = rng.randrange(256)
        if rng.random() < 0.3:
            body = body[:rng.randrange(len(body))]
        try:
            decode_contribution(_reseal(bytes(body)), SHAPES, stage=1)
        except InvalidContribution:
            pass


def test_dense_fuzz_raises_only_invalid_contribution() -> None:
    shapes = {"w": (8, 4), "b": (4,)}
    blob = encode_dense({n: torch.randn(s) for n, s in shapes.items()}, stage=0, replica=0,
                        global_step=0)
    rng = random.Random(7)
    for cut in range(len(blob)):
        with pytest.raises(InvalidContribution):
            decode_dense(blob[:cut], shapes, stage=0)
    for _ in range(200):
        body = bytearray(blob[:-4])
        body[rng.randrange(len(body))] = rng.randrange(256)
        try:
            decode_dense(_reseal(bytes(body)), shapes, stage=0)
        except InvalidContribution:
            pass


def test_more_parameters_than_the_stage_has() -> None:
    assert "blob lists 2 parameters, stage 1 has 1" in _reason(_blob(), expected={"w": (128, 64)})
