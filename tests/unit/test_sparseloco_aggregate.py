"""Aggregation (hand-computed selected_mean / mean_over_all, median clipping) and the outer SGD
step (plain, and Nesterov checked against torch.optim.SGD)."""
from __future__ import annotations

import math

import pytest
import torch

from crucible.sparseloco import (
    Contribution,
    NonFiniteUpdate,
    OuterSGD,
    SparseValues,
    aggregate,
    clip_scales,
    decode_contribution,
    decode_dense,
    encode_contribution,
    encode_dense,
)

SHAPES = {"w": (2, 3), "b": (2,)}


def _c(replica: int, w: tuple[list[int], list[float]], b: tuple[list[int], list[float]]
       ) -> Contribution:
    def sv(pair: tuple[list[int], list[float]]) -> SparseValues:
        return SparseValues(torch.tensor(pair[0], dtype=torch.int64),
                            torch.tensor(pair[1], dtype=torch.float32))
    return Contribution(stage=1, replica=replica, global_step=0, version=1, kind="sparse",
                        params={"w": sv(w), "b": sv(b)})


def test_selected_mean_with_overlapping_and_disjoint_indices() -> None:
    a = _c(0, ([0, 2], [1.0, 3.0]), ([0], [2.0]))
    b = _c(1, ([2, 5], [5.0, -7.0]), ([1], [4.0]))
    out = aggregate([a, b], SHAPES, clip=False)
    # index 2 chosen by both: (3 + 5) / 2; the others by one contributor each; 1, 3, 4 by none.
    assert torch.equal(out["w"], torch.tensor([[1.0, 0.0, 4.0], [0.0, 0.0, -7.0]]))
    assert torch.equal(out["b"], torch.tensor([2.0, 4.0]))


def test_mean_over_all_divides_by_the_number_of_contributors() -> None:
    a = _c(0, ([0, 2], [1.0, 3.0]), ([0], [2.0]))
    b = _c(1, ([2, 5], [5.0, -7.0]), ([1], [4.0]))
    out = aggregate([a, b], SHAPES, mode="mean_over_all", clip=False)
    assert torch.equal(out["w"], torch.tensor([[0.5, 0.0, 4.0], [0.0, 0.0, -3.5]]))
    assert torch.equal(out["b"], torch.tensor([1.0, 2.0]))


def test_median_clipping_bounds_an_outlier() -> None:
    small = _c(0, ([0], [3.0]), ([0], [4.0]))          # norm 5
    medium = _c(1, ([1], [6.0]), ([1], [8.0]))         # norm 10 (the median)
    outlier = _c(2, ([0, 1], [600.0, 0.0]), ([0], [800.0]))  # norm 1000 -> scaled by 0.01
    assert clip_scales([small, medium, outlier]) == [1.0, 1.0, pytest.approx(0.01)]
    out = aggregate([small, medium, outlier], SHAPES)
    # w[0]: (3 + 6) / 2 ; w[1]: (6 + 0) / 2 ; b[0]: (4 + 8) / 2 ; b[1]: 8
    torch.testing.assert_close(out["w"].reshape(-1)[:2], torch.tensor([4.5, 3.0]))
    torch.testing.assert_close(out["b"], torch.tensor([6.0, 8.0]))
    unclipped = aggregate([small, medium, outlier], SHAPES, clip=False)
    assert unclipped["b"][0] == pytest.approx(402.0)


def test_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    a = _c(0, ([0], [1.0]), ([0], [0.0]))
    b = _c(1, ([0], [3.0]), ([0], [0.0]))
    assert clip_scales([a, b]) == [1.0, pytest.approx(2.0 / 3.0)]


def test_aggregate_of_one_contribution_is_its_decoded_message() -> None:
    delta = {"w": torch.randn(128, 96), "b": torch.randn(96)}
    shapes = {n: tuple(t.shape) for n, t in delta.items()}
    blob, err = encode_contribution(delta, {}, beta=0.95, stage=0, replica=0, global_step=0)
    out = aggregate([decode_contribution(blob, shapes, stage=0)], shapes)
    for n in shapes:
        torch.testing.assert_close(out[n] + err[n], delta[n], rtol=0, atol=1e-6)


def test_dense_contributions_average_plainly() -> None:
    shapes = {"w": (4, 3)}
    deltas = [torch.randn(4, 3) for _ in range(3)]
    cs = [decode_dense(encode_dense({"w": d}, stage=0, replica=r, global_step=0), shapes, stage=0)
          for r, d in enumerate(deltas)]
    expected = sum(deltas) / 3
    for mode in ("selected_mean", "mean_over_all"):
        torch.testing.assert_close(aggregate(cs, shapes, mode=mode, clip=False)["w"], expected)


def test_aggregate_refuses_empty_and_unknown_mode() -> None:
    with pytest.raises(ValueError, match="skip its outer step"):
        aggregate([], SHAPES)
    with pytest.raises(ValueError, match="sparseloco.aggregate"):
        aggregate([_c(0, ([0], [1.0]), ([0], [1.0]))], SHAPES, mode="median")


def test_plain_sgd_outer_step() -> None:
    theta = {"w": torch.ones(2, 2)}
    OuterSGD(lr=1.0).step(theta, {"w": torch.tensor([[0.5, 0.0], [-1.0, 2.0]])})
    assert torch.equal(theta["w"], torch.tensor([[0.5, 1.0], [2.0, -1.0]]))


def test_nesterov_matches_torch_sgd_and_survives_a_checkpoint() -> None:
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, 4, generator=gen)
    grads = [torch.randn(5, 4, generator=gen) for _ in range(5)]
    ref = torch.nn.Parameter(start.clone())
    torch_opt = torch.optim.SGD([ref], lr=0.6, momentum=0.9, nesterov=True)
    ours = OuterSGD(lr=0.6, momentum=0.9, nesterov=True)
    theta = {"w": start.clone()}
    for i, g in enumerate(grads):
        ref.grad = g.clone()
        torch_opt.step()
        if i == 2:  # checkpoint and restore mid-way
            state = ours.state_dict()
            ours = OuterSGD(lr=1.0)
            ours.load_state_dict(state)
        ours.step(theta, {"w": g})
        torch.testing.assert_close(theta["w"], ref.detach(), rtol=1e-6, atol=1e-6)


def test_non_finite_update_is_refused_and_nothing_changes() -> None:
    theta = {"a": torch.zeros(3), "b": torch.zeros(3)}
    opt = OuterSGD(lr=0.6, momentum=0.9, nesterov=True)
    opt.step(theta, {"a": torch.ones(3), "b": torch.ones(3)})
    before = {n: t.clone() for n, t in theta.items()}
    buffers = {n: t.clone() for n, t in opt.buffers.items()}
    with pytest.raises(NonFiniteUpdate, match="'b'"):
        opt.step(theta, {"a": torch.ones(3), "b": torch.tensor([1.0, math.inf, 0.0])})
    for n in theta:
        assert torch.equal(theta[n], before[n])
        assert torch.equal(opt.buffers[n], buffers[n])


def test_outer_sgd_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="outer_lr"):
        OuterSGD(lr=0.0)
    with pytest.raises(ValueError, match="outer_momentum"):
        OuterSGD(lr=1.0, momentum=1.0)
