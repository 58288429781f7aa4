"""The batched decoder returns, blob by blob, exactly what the single-blob decoder returns: the
same tensors bit for bit for valid blobs, the same rejection reason for invalid ones, whatever
mix of valid and invalid blobs a round holds."""
from __future__ import annotations

import random
import struct
import zlib

import pytest
import torch

from crucible.sparseloco import (
    InvalidContribution,
    decode_contribution,
    encode_contributions_batched,
)
from crucible.sparseloco.batch import decode_contributions

# a matrix of whole 64x64 blocks, one of rescaled blocks with an odd value count, a vector, a
# scalar-ish vector whose k is the whole chunk
SHAPES = {"w": (128, 64), "odd": (43, 7), "v": (100,), "g": (3,)}
STAGE, STEP = 2, 5


def _blobs(replicas: list[int], *, seed: int = 0, chunk: int = 64, topk: int = 64) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    delta = {n: torch.randn((len(replicas), *s), generator=gen) for n, s in SHAPES.items()}
    blobs, _ = encode_contributions_batched(delta, {}, beta=0.9, stage=STAGE, replicas=replicas,
                                            global_step=STEP, chunk=chunk, topk=topk)
    return blobs


def _single(blob: bytes, replica: int | None, **kw: object) -> object:
    try:
        return decode_contribution(blob, SHAPES, stage=STAGE, replica=replica, global_step=STEP,
                                   **kw)  # type: ignore[arg-type]
    except InvalidContribution as exc:
        return exc


def _assert_same(batched: object, single: object) -> None:
    if isinstance(single, InvalidContribution):
        assert isinstance(batched, InvalidContribution), f"expected rejection {single.reason!r}"
        assert batched.reason == single.reason
        return
    assert not isinstance(batched, InvalidContribution), batched
    assert (batched.stage, batched.replica, batched.global_step, batched.version, batched.kind,
            batched.nbytes) == (single.stage, single.replica, single.global_step, single.version,
                                single.kind, single.nbytes)
    assert list(batched.params) == list(single.params)
    for name, part in single.params.items():
        got = batched.params[name]
        assert torch.equal(got.indices, part.indices), name
        assert got.values.dtype == part.values.dtype == torch.float32
        assert torch.equal(got.values, part.values), name
        # the norm the batch took for the gather and the clipping is the single blob's own sum
        assert got.norm_sq() == float(torch.sum(part.values.double() ** 2)), name


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize(("chunk", "topk"), [(64, 64), (16, 8), (8, 3)])
def test_valid_blobs_decode_bit_for_bit_as_one_by_one(chunk: int, topk: int) -> None:
    replicas = [0, 1, 3, 6, 7]
    blobs = _blobs(replicas, chunk=chunk, topk=topk)
    out = decode_contributions(blobs, SHAPES, stage=STAGE, replicas=replicas, global_step=STEP,
                               chunk=chunk, topk=topk)
    assert len(out) == len(blobs)
    for blob, replica, got in zip(blobs, replicas, out, strict=True):
        _assert_same(got, _single(blob, replica, chunk=chunk, topk=topk))


def _corruptions(blob: bytes) -> list[bytes]:
    """Valid-CRC corruptions in every record field, plus raw damage."""
    body = bytearray(blob[:-4])
    out = [b"", blob[:-9], blob[:40], b"XXXX" + blob[4:], blob + b"\0"]
    first = 28 + 2 + 1 + 1 + 8            # 'w' record: name length, name, ndim, 2 dims
    for offset, fmt, value in [
        (first + 6, "<f", float("nan")),    # shift
        (first + 10, "<f", 1e9),            # scale out of range
        (first + 10, "<f", 0.0),            # scale zero
        (first + 14, "<f", float("inf")),   # table
        (first + 14, "<f", 3e38),           # table + shift overflows? (finite alone)
        (first + 4, "<H", 7),               # k
        (first, "<H", 32),                  # block rows
        (12, "<I", 9),                      # replica in the header
        (8, "<I", 0),                       # stage in the header
        (16, "<Q", 99),                     # global step
        (24, "<I", 3),                      # fewer parameters than the stage has
    ]:
        patched = bytearray(body)
        struct.pack_into(fmt, patched, offset, value)
        out.append(_reseal(bytes(patched)))
    idx = first + 30                        # inside the first record's packed indices
    for delta in (1, 7, 200):
        patched = bytearray(body)
        patched[idx] = (patched[idx] + delta) % 256
        out.append(_reseal(bytes(patched)))
    patched = bytearray(body)
    patched[idx:idx + 6] = bytes(6)         # duplicate zero indices
    out.append(_reseal(bytes(patched)))
    rng = random.Random(3)
    for _ in range(20):
        patched = bytearray(body)
        patched[rng.randrange(28, len(patched))] ^= 1 << rng.randrange(8)
        out.append(_reseal(bytes(patched)))
    return out


def test_every_corruption_gets_the_single_decoders_verdict_and_reason() -> None:
    replicas = list(range(8))
    good = _blobs(replicas, seed=1)
    bad = _corruptions(good[2])
    for corrupt in bad:
        blobs = [good[0], corrupt, good[4], good[7]]
        want = [0, 2, 4, 7]
        out = decode_contributions(blobs, SHAPES, stage=STAGE, replicas=want, global_step=STEP)
        for blob, replica, got in zip(blobs, want, out, strict=True):
            _assert_same(got, _single(blob, replica))
    rejected = [decode_contributions([b], SHAPES, stage=STAGE, replicas=[2], global_step=STEP)[0]
                for b in bad]
    # the corruption set is not vacuous: most of it is rejected, some bit flips stay decodable
    assert sum(isinstance(r, InvalidContribution) for r in rejected) >= len(bad) // 2


def test_a_round_with_only_invalid_blobs_and_an_empty_round() -> None:
    blob = _blobs([0])[0]
    out = decode_contributions([blob[:-1], b"junk"], SHAPES, stage=STAGE)
    assert all(isinstance(r, InvalidContribution) for r in out)
    assert decode_contributions([], SHAPES, stage=STAGE) == []


def test_replica_and_step_checks_are_optional_as_in_the_single_decoder() -> None:
    blobs = _blobs([4, 5])
    out = decode_contributions(blobs, SHAPES, stage=STAGE)
    assert [c.replica for c in out] == [4, 5]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="2 replicas for 1 blobs"):
        decode_contributions(blobs[:1], SHAPES, stage=STAGE, replicas=[4, 5])
    with pytest.raises(ValueError, match="sparseloco.chunk"):
        decode_contributions(blobs, SHAPES, stage=STAGE, chunk=65)
