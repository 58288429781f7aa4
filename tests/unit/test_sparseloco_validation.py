"""Every malformed contribution is rejected with `InvalidContribution` and a precise reason;
garbage (truncations, bit flips, random bytes) never raises anything else."""
from __future__ import annotations

import functools
import math
import struct
import zlib

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from crucible.sparseloco import (
    Contribution,
    InvalidContribution,
    contribution_bytes,
    decode_contribution,
    decode_dense,
    dense_bytes,
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


# ---------------------------------------------------------------------------------------------
# fuzzing: properties over generated corruptions (hypothesis, derandomised so every run draws
# the same examples; shrinking names the smallest corruption that breaks a property)
# ---------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, derandomize=True, database=None, deadline=None)
SIZE = contribution_bytes(SHAPES)       # every valid sparse blob of SHAPES has exactly this size
CRC_AT = SIZE - 4
DENSE_SHAPES = {"w": (8, 4), "b": (4,)}
DENSE_SIZE = dense_bytes(DENSE_SHAPES)
# header: magic 0..3 | version u16 4 | kind u8 6 | reserved u8 7 | stage u32 8 | replica u32 12
# | global_step u32 16 | run_tag u32 20 | n_params u32 24
U32 = st.integers(0, 2**32 - 1)


@functools.cache
def _valid() -> bytes:
    blob = _blob()
    assert len(blob) == SIZE
    return blob


@functools.cache
def _valid_decoded() -> Contribution:
    return decode_contribution(_valid(), SHAPES, stage=1)


@functools.cache
def _valid_dense() -> bytes:
    gen = torch.Generator().manual_seed(7)
    blob = encode_dense({n: torch.randn(s, generator=gen) for n, s in DENSE_SHAPES.items()},
                        stage=0, replica=0, global_step=0)
    assert len(blob) == DENSE_SIZE
    return blob


def _within_the_contract(got: Contribution, blob: bytes, shapes: dict[str, tuple[int, ...]], *,
                         stage: int, kind: str) -> None:
    """What a decode that does not raise promises: the stage asked for, the exact size the
    shapes fix, exactly the expected parameters, unique in-range indices, finite values."""
    assert (got.stage, got.kind, got.nbytes) == (stage, kind, len(blob))
    assert len(blob) == (SIZE if kind == "sparse" else DENSE_SIZE)
    assert list(got.params) == list(shapes)
    for name, shape in shapes.items():
        p = got.params[name]
        assert bool(torch.isfinite(p.values).all()), name
        if kind == "dense":
            assert p.indices is None and p.values.shape == (math.prod(shape),)
            continue
        original = _valid_decoded().params[name]
        assert p.indices is not None and p.indices.shape == p.values.shape
        assert p.values.shape == original.values.shape   # the chunking fixes how many
        assert p.indices.unique().numel() == p.indices.numel(), name
        assert 0 <= int(p.indices.min()) and int(p.indices.max()) < math.prod(shape), name


def test_every_truncation_is_refused_with_the_reason_for_its_length() -> None:
    blob = _valid()
    assert "empty object (0 bytes)" in _reason(blob[:0])
    for cut in range(1, HEADER + 4):
        assert (f"truncated: {cut} bytes is shorter than the 32-byte header and trailer"
                in _reason(blob[:cut]))
    for cut in range(HEADER + 4, len(blob)):   # the last 4 bytes left are read as the CRC
        assert "checksum mismatch" in _reason(blob[:cut]), cut


@FUZZ
@given(bit=st.integers(0, 8 * SIZE - 1))
def test_any_single_bit_flip_is_refused_naming_what_it_broke(bit: int) -> None:
    flipped = bytearray(_valid())
    pos = bit // 8
    flipped[pos] ^= 1 << (bit % 8)
    reason = _reason(bytes(flipped))
    if pos < 4:
        assert f"bad magic {bytes(flipped[:4])!r}" in reason
    elif pos < 6:   # version 2 with one bit flipped: 0, 3, 6, 10, ..., 514, ...: never 1 or 2
        version = struct.unpack_from("<H", flipped, 4)[0]
        assert f"format version {version} is not supported" in reason
    else:           # the CRC covers the rest of the body, and a flip in the CRC breaks it too
        assert "checksum mismatch" in reason


@settings(FUZZ, max_examples=100)
@example(b"\0")
@example(b"\0" * 31)
@example(b"\0" * 32)
@example(b"SLCO\x02\x00" + b"\0" * 26)
@given(data=st.one_of(st.binary(max_size=2000),
                      st.binary(min_size=26, max_size=2000).map(lambda b: b"SLCO\x02\x00" + b)))
def test_random_bytes_are_refused_by_the_first_check_they_fail(data: bytes) -> None:
    reason = _reason(data)
    if not data:
        assert "empty object" in reason
    elif len(data) < HEADER + 4:
        assert f"truncated: {len(data)} bytes is shorter" in reason
    elif data[:4] != b"SLCO":
        assert "bad magic" in reason
    elif data[4:6] not in (b"\x01\x00", b"\x02\x00"):
        assert "format version" in reason
    else:
        assert "checksum mismatch" in reason


@FUZZ
@given(writes=st.lists(st.tuples(st.integers(0, CRC_AT - 1), st.integers(0, 255)),
                       min_size=1, max_size=3),
       cut=st.none() | st.integers(0, CRC_AT - 1))
def test_resealed_garbage_is_refused_or_decodes_within_the_contract(
        writes: list[tuple[int, int]], cut: int | None) -> None:
    """With a valid CRC the structural checks alone must hold the line: anything they let through
    is a well-formed contribution (a new byte in the codes is one), and nothing else escapes."""
    body = bytearray(_valid()[:-4])
    for pos, value in writes:
        body[pos] = value
    blob = _reseal(bytes(body if cut is None else body[:cut]))
    try:
        got = decode_contribution(blob, SHAPES, stage=1)
    except InvalidContribution as exc:
        assert exc.reason and exc.reason == str(exc)
    else:
        assert cut is None      # a cut blob is never the size the shapes fix
        _within_the_contract(got, blob, SHAPES, stage=1, kind="sparse")


@settings(FUZZ, max_examples=200)
@given(field=st.sampled_from(["kind", "stage", "replica", "global_step", "n_params", "run_tag"]),
       value=U32)
def test_a_resealed_header_field_is_refused_by_name_or_read_as_written(field: str,
                                                                       value: int) -> None:
    offset, fmt, valid = {"kind": (6, "<B", 0), "stage": (8, "<I", 1), "replica": (12, "<I", 0),
                          "global_step": (16, "<I", 4), "n_params": (24, "<I", 2),
                          "run_tag": (20, "<I", 0)}[field]
    if fmt == "<B":
        value %= 256
    assume(value != valid)
    blob = _patch(_valid(), offset, fmt, value)
    if field == "run_tag":   # not checked by the decoder (the gather compares it): read as is
        assert decode_contribution(blob, SHAPES, stage=1, replica=0, global_step=4).run_tag == value
        return
    reason = _reason(blob, replica=0, global_step=4)
    if field == "kind":
        assert f"kind {value} where 0 was expected" in reason
    elif field == "stage":
        assert f"contribution is for stage {value}, expected stage 1" in reason
    elif field == "replica":
        assert f"contribution is from replica {value}, expected replica 0" in reason
    elif field == "global_step":
        assert f"contribution is for global step {value}, expected 4" in reason
    elif value > 2:
        assert f"blob lists {value} parameters, stage 1 has 2" in reason
    else:           # 0 or 1 records read, the other's bytes are left over
        assert "trailing bytes" in reason


def test_every_dense_truncation_is_refused() -> None:
    blob = _valid_dense()
    for cut in range(len(blob)):
        with pytest.raises(InvalidContribution):
            decode_dense(blob[:cut], DENSE_SHAPES, stage=0)


@settings(FUZZ, max_examples=200)
@given(writes=st.lists(st.tuples(st.integers(0, DENSE_SIZE - 5), st.integers(0, 255)),
                       min_size=1, max_size=3))
def test_resealed_dense_garbage_is_refused_or_decodes_within_the_contract(
        writes: list[tuple[int, int]]) -> None:
    body = bytearray(_valid_dense()[:-4])
    for pos, value in writes:
        body[pos] = value
    blob = _reseal(bytes(body))
    try:
        got = decode_dense(blob, DENSE_SHAPES, stage=0)
    except InvalidContribution as exc:
        assert exc.reason and exc.reason == str(exc)
    else:
        _within_the_contract(got, blob, DENSE_SHAPES, stage=0, kind="dense")


def test_more_parameters_than_the_stage_has() -> None:
    assert "blob lists 2 parameters, stage 1 has 1" in _reason(_blob(), expected={"w": (128, 64)})
