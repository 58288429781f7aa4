"""SparseLoCo codec: round trip against a plain reference, error-feedback mass conservation,
determinism, k rescaling, wire size, and the dense baseline format."""
from __future__ import annotations

import math

import pytest
import torch

from crucible.sparseloco import (
    ErrorFeedbackCodec,
    decode_contribution,
    decode_dense,
    encode_contribution,
    encode_dense,
)

AWKWARD_SHAPES = [(), (1,), (3,), (5,), (64,), (100,), (130,), (7, 5), (1, 1), (64, 64),
                  (100, 70), (67, 3), (128, 192), (2, 3, 4), (65, 64)]


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _reference(x: torch.Tensor, chunk: int = 64, topk: int = 64) -> torch.Tensor:
    """Dense dequantised top-k of `x`, written chunk by chunk in plain Python (the spec, slowly)."""
    shape = tuple(x.shape)
    rows, cols = (1, 1) if not shape else (1, shape[0]) if len(shape) == 1 else (
        shape[0], math.prod(shape[1:]))
    view = x.reshape(rows, cols)
    br = 1 if len(shape) < 2 else _largest_divisor(rows, chunk)
    bc = _largest_divisor(cols, chunk)
    length = br * bc
    if length == chunk * chunk:
        k = topk
    else:
        k = max(2, round(length * topk / chunk / chunk))
        k = min(k + k % 2, length)
    positions, kept = [], []
    for r0 in range(0, rows, br):
        for c0 in range(0, cols, bc):
            block = view[r0:r0 + br, c0:c0 + bc].reshape(-1)
            order = sorted(range(length), key=lambda i: (-abs(float(block[i])), i))[:k]
            for i in sorted(order):
                positions.append((r0 + i // bc, c0 + i % bc))
                kept.append(block[i])
    values = torch.stack(kept)
    shift = values.mean()
    scale = max(1.5 * float(values.std(correction=0)), 1e-12)
    codes = torch.clamp(torch.round((values - shift) / scale + 2), 0, 3).long()
    out = torch.zeros(rows, cols)
    for c in range(4):
        members = values[codes == c]
        if len(members):
            level = float((members.double() - float(shift)).mean()) + float(shift)
            for pos, code in zip(positions, codes.tolist(), strict=True):
                if code == c:
                    out[pos] = level
    return out.reshape(shape)


def _shapes(params: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in params.items()}


def _densify(contribution, shapes) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        part = contribution.params[name]
        flat = torch.zeros(math.prod(shape))
        flat[part.indices] = part.values
        out[name] = flat.reshape(shape)
    return out


@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_roundtrip_equals_dequantised_topk(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 1000 + math.prod(shape))
    x = torch.randn(shape, generator=gen)
    blob, _ = encode_contribution({"p": x}, {}, beta=0.95, stage=1, replica=2, global_step=7)
    contribution = decode_contribution(blob, {"p": shape}, stage=1, replica=2, global_step=7)
    decoded = _densify(contribution, {"p": shape})["p"]
    expected = _reference(x)
    kept = torch.nonzero(expected.reshape(-1) != 0).reshape(-1)
    assert torch.equal(contribution.params["p"].indices.sort().values, kept)
    torch.testing.assert_close(decoded, expected, rtol=1e-5, atol=1e-6)
    assert (contribution.stage, contribution.replica, contribution.global_step) == (1, 2, 7)


def test_kept_indices_are_the_reference_topk_positions() -> None:
    x = torch.randn(100, 70, generator=torch.Generator().manual_seed(3))
    blob, _ = encode_contribution({"w": x}, {}, beta=0.9, stage=0, replica=0, global_step=0)
    got = decode_contribution(blob, {"w": (100, 70)}, stage=0).params["w"].indices
    # 50x35 blocks of 1750 values keep round(1750/64)=27 -> 28 each; 4 blocks.
    assert got.numel() == 4 * 28
    ref = torch.nonzero(_reference(x).reshape(-1) != 0).reshape(-1)
    assert torch.equal(got.sort().values, ref)


def test_error_feedback_conserves_mass_over_rounds() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (96, 130), "b": (130,), "t": (3, 4, 5)}
    codec = ErrorFeedbackCodec(stage=2, replica=1, beta=0.95)
    for step in range(4):
        delta = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        old = {n: codec.error.get(n, torch.zeros(s)) for n, s in shapes.items()}
        blob = codec.encode(delta, global_step=step)
        decoded = _densify(codec.decode(blob, shapes, global_step=step), shapes)
        for n in shapes:
            torch.testing.assert_close(codec.error[n] + decoded[n], 0.95 * old[n] + delta[n],
                                       rtol=0, atol=1e-6)
            assert codec.error[n].abs().sum() > 0


def test_encoding_is_deterministic() -> None:
    x = {"w": torch.randn(256, 128, generator=torch.Generator().manual_seed(5))}
    e = {"w": torch.randn(256, 128, generator=torch.Generator().manual_seed(6))}
    first = encode_contribution(x, e, beta=0.95, stage=1, replica=0, global_step=1)
    second = encode_contribution(x, e, beta=0.95, stage=1, replica=0, global_step=1)
    assert first[0] == second[0]
    assert torch.equal(first[1]["w"], second[1]["w"])


def test_ties_go_to_the_lowest_chunk_index() -> None:
    x = torch.zeros(64, 128)
    x[10, 5] = 3.0  # one clear winner in the first block; the rest of both blocks is tied at 0
    blob, _ = encode_contribution({"w": x}, {}, beta=0.95, stage=0, replica=0, global_step=0)
    idx = decode_contribution(blob, {"w": (64, 128)}, stage=0).params["w"].indices
    first = sorted([10 * 128 + 5] + [c for c in range(64)][:63])
    second = list(range(64, 128))
    assert sorted(idx.tolist()) == sorted(first + second)


def test_k_is_rescaled_for_small_chunks_and_made_even() -> None:
    shapes = {"big": (128, 128), "row": (4096,), "vec": (100,), "tiny": (3,), "one": (1,)}
    delta = {n: torch.randn(s) for n, s in shapes.items()}
    blob, _ = encode_contribution(delta, {}, beta=0.95, stage=0, replica=0, global_step=0)
    c = decode_contribution(blob, shapes, stage=0)
    counts = {n: c.params[n].indices.numel() for n in shapes}
    # 4 blocks x 64; 64 chunks of 64 -> k=max(2, round(1))=2 each; 2 chunks of 50 -> 2 each;
    # one chunk of 3 -> 2; one of 1 -> 1 (never more than the chunk holds).
    assert counts == {"big": 256, "row": 128, "vec": 4, "tiny": 2, "one": 1}


def test_wire_size_under_0_23_bits_per_parameter_with_headers() -> None:
    shapes = {"blocks.0.attn.qkv.weight": (768, 256), "blocks.0.attn.proj.weight": (256, 256),
              "blocks.0.mlp.up.weight": (1024, 256), "blocks.0.mlp.down.weight": (256, 1024),
              "blocks.1.attn.qkv.weight": (768, 256), "blocks.1.mlp.up.weight": (1024, 256)}
    delta = {n: torch.randn(s) for n, s in shapes.items()}
    blob, _ = encode_contribution(delta, {}, beta=0.95, stage=1, replica=0, global_step=0)
    params = sum(math.prod(s) for s in shapes.values())
    bits_per_param = 8 * len(blob) / params
    assert 0.21875 <= bits_per_param <= 0.23
    assert 32 / bits_per_param >= 139  # about 146x under fp32 before headers


def test_non_finite_delta_is_refused_naming_the_parameter() -> None:
    delta = {"ok": torch.ones(8), "bad": torch.tensor([1.0, float("nan")])}
    with pytest.raises(ValueError, match="'bad'"):
        encode_contribution(delta, {}, beta=0.95, stage=0, replica=0, global_step=0)


def test_codec_reset_and_state_dict() -> None:
    codec = ErrorFeedbackCodec(stage=0, replica=3)
    codec.encode({"w": torch.randn(64, 64)}, global_step=0)
    state = codec.state_dict()
    other = ErrorFeedbackCodec(stage=0, replica=3)
    other.load_state_dict(state)
    delta = {"w": torch.randn(64, 64)}
    assert codec.encode(delta, global_step=1) == other.encode(delta, global_step=1)
    codec.reset()
    assert codec.error == {}


def test_bad_chunk_configuration_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="sparseloco.chunk"):
        ErrorFeedbackCodec(stage=0, replica=0, chunk=128)


def test_dense_roundtrip_is_exact() -> None:
    delta = {"w": torch.randn(33, 17), "b": torch.randn(17), "s": torch.randn(())}
    shapes = _shapes(delta)
    blob = encode_dense(delta, stage=3, replica=1, global_step=9)
    c = decode_dense(blob, shapes, stage=3, replica=1, global_step=9)
    assert c.kind == "dense" and c.nbytes == len(blob)
    for n, t in delta.items():
        assert c.params[n].indices is None
        assert torch.equal(c.params[n].values.reshape(t.shape), t)


def test_encoding_does_not_depend_on_the_thread_count() -> None:
    delta = {"w": torch.randn(512, 256), "z": torch.zeros(64, 64)}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = encode_contribution(delta, {}, beta=0.95, stage=0, replica=0, global_step=0)[0]
        torch.set_num_threads(max(2, threads))
        many = encode_contribution(delta, {}, beta=0.95, stage=0, replica=0, global_step=0)[0]
    finally:
        torch.set_num_threads(threads)
    assert one == many
