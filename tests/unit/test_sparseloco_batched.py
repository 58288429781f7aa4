"""The batched SparseLoCo encoder against the per-replica one: the same bytes, the same error."""
from __future__ import annotations

import pytest
import torch

from crucible.sparseloco.codec import encode_contribution, encode_contributions_batched

# A stage-like mix: 1-D, 0-D, 2-D non-multiples of 64, tiny tensors, repeated shapes, rank 3.
STAGE_SHAPES = {"ln.w": (64,), "ln.b": (64,), "bias": (100,), "scalar": (), "one": (1,),
                "odd": (5,), "wq": (64, 64), "wk": (64, 64), "w1": (100, 70), "w2": (67, 3),
                "tiny": (1, 1), "wide": (128, 192), "r3": (2, 3, 4), "tall": (130, 64)}


def _stage(shapes, n_rep: int, gen: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {n: torch.randn((n_rep, *s), generator=gen) * scale for n, s in shapes.items()}


def _assert_matches_per_replica(delta, error, *, replicas, beta=0.95, chunk=64, topk=64):
    blobs, new_error = encode_contributions_batched(
        delta, error, beta=beta, stage=2, replicas=replicas, global_step=7, chunk=chunk, topk=topk)
    assert len(blobs) == len(replicas)
    assert list(new_error) == list(delta)
    for i, replica in enumerate(replicas):
        want_blob, want_error = encode_contribution(
            {n: d[i] for n, d in delta.items()}, {n: e[i] for n, e in error.items()}, beta=beta,
            stage=2, replica=replica, global_step=7, chunk=chunk, topk=topk)
        assert blobs[i] == want_blob, f"replica {replica}: blob differs"
        for name in delta:
            assert torch.equal(new_error[name][i], want_error[name]), f"{replica}/{name}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_blobs_and_errors_equal_the_per_replica_encoder(seed):
    gen = torch.Generator().manual_seed(seed)
    delta = _stage(STAGE_SHAPES, 5, gen, scale=1e-3)
    error = _stage(STAGE_SHAPES, 5, gen, scale=1e-2)
    _assert_matches_per_replica(delta, error, replicas=[0, 2, 3, 6, 7])


def test_missing_error_counts_as_zeros_and_chunking_options_are_honoured():
    gen = torch.Generator().manual_seed(3)
    delta = _stage(STAGE_SHAPES, 3, gen)
    error = {n: e for n, e in _stage(STAGE_SHAPES, 3, gen).items() if n.startswith("w")}
    _assert_matches_per_replica(delta, error, replicas=[4, 1, 5], chunk=16, topk=8, beta=0.5)


def test_ties_go_to_the_lower_index_in_every_replica():
    gen = torch.Generator().manual_seed(4)
    shapes = {"zeros": (64, 64), "steps": (100,), "w": (64, 130)}
    delta = _stage(shapes, 4, gen)
    delta["zeros"][1:] = 0.0                      # all tied, and all-zero (scale floor)
    delta["steps"] = torch.randint(-2, 3, (4, 100), generator=gen).float()
    delta["w"][2] = delta["w"][2].round()         # many ties at the k-th magnitude
    _assert_matches_per_replica(delta, {}, replicas=[0, 1, 2, 3])


def test_long_rows_take_the_serial_statistics():
    gen = torch.Generator().manual_seed(5)
    shapes = {"big": (1024, 2112)}                # 33792 kept values: beyond one serial reduce
    _assert_matches_per_replica(_stage(shapes, 2, gen), _stage(shapes, 2, gen), replicas=[0, 1])


def test_single_replica_batch_is_the_per_replica_encoder():
    gen = torch.Generator().manual_seed(6)
    delta = _stage(STAGE_SHAPES, 1, gen)
    _assert_matches_per_replica(delta, _stage(STAGE_SHAPES, 1, gen), replicas=[3])


def test_non_finite_input_names_the_first_bad_replica_and_parameter():
    gen = torch.Generator().manual_seed(7)
    delta = _stage(STAGE_SHAPES, 3, gen)
    delta["w1"][2, 0, 0] = float("inf")
    delta["wq"][1, 3, 3] = float("nan")
    with pytest.raises(ValueError, match=r"'wq' of stage 2, replica 5 has a non-finite"):
        encode_contributions_batched(delta, {}, beta=0.95, stage=2, replicas=[0, 5, 9],
                                     global_step=1)


def _topk_by_rule(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The selection rule, literally: order by (-|value|, index), keep the first k, ascending."""
    out = []
    for row in mag.tolist():
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        out.append(sorted(order))
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize(("length", "k"), [(4096, 64), (2752, 44), (64, 2), (30, 2), (130, 3),
                                           (256, 4), (96, 2), (40, 40)])
def test_selection_is_the_rule_on_ties_zeros_and_padded_rows(length: int, k: int) -> None:
    # (2752, 44) and (96, 2) take the padded heap path, (4096, 64) the plain heap path,
    # (130, 3) and (30, 2) the nth-element path, (40, 40) keeps everything
    from crucible.sparseloco.codec import _select_topk
    gen = torch.Generator().manual_seed(length + k)
    rows = [torch.randn(length, generator=gen),
            torch.zeros(length),                                       # all tied at zero
            torch.randint(-2, 3, (length,), generator=gen).float(),    # many ties at the k-th
            -torch.randn(length, generator=gen).abs(),                 # all negative
            torch.cat([torch.zeros(length - 1), torch.ones(1)])]       # one winner, zeros tie
    chunks = torch.stack(rows)
    assert torch.equal(_select_topk(chunks, k), _topk_by_rule(chunks.abs(), k))
