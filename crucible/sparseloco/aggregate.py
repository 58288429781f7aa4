"""Aggregation of a stage's agreed contributions into one dense outer pseudo-gradient.

Each contribution is first clipped to the median L2 norm of the contributors
(`scale = min(1, median / ||v||)`; the median of an even count is the mean of the two middle
norms), which bounds what one outlier can do. `granularity="tensor"` (the default, as Templar
does) takes norms and medians per parameter tensor; `"stage"` clips each contributor's whole stage
vector by one factor. Then, per coordinate:

- `selected_mean` (default, as both public codebases do): mean over the contributors that selected
  that coordinate; a coordinate nobody selected stays 0.
- `mean_over_all` (the paper's formula): sum divided by the number of contributors.

Dense contributions (every coordinate selected) make the two modes equal. Contributions are summed
in the order given (the gather returns them in replica order), so the result is deterministic.
`tensor_norm_ratios` measures how far each contributor's tensors stray from those medians; the
gather rejects, before aggregation, a contribution beyond `sparseloco.max_norm_ratio`.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import torch

from crucible.sparseloco.codec import Contribution

__all__ = ["aggregate", "clip_scales", "tensor_clip_scales", "tensor_norm_ratios",
           "AGGREGATE_MODES", "CLIP_GRANULARITIES"]

AGGREGATE_MODES = ("selected_mean", "mean_over_all")
CLIP_GRANULARITIES = ("tensor", "stage")


def _median_scales(norms: Sequence[float]) -> list[float]:
    median = statistics.median(norms)
    return [1.0 if n == 0 or n <= median else median / n for n in norms]


def clip_scales(contributions: Sequence[Contribution]) -> list[float]:
    """Per-contributor factor `min(1, median_norm / norm)` of the whole stage vector (1.0 for a
    zero vector)."""
    return _median_scales([c.norm() for c in contributions])


def tensor_clip_scales(contributions: Sequence[Contribution],
                       names: Sequence[str]) -> dict[str, list[float]]:
    """Per parameter tensor, per contributor: `min(1, median_norm / norm)` of that tensor."""
    return {name: _median_scales([math.sqrt(c.params[name].norm_sq()) for c in contributions])
            for name in names}


def tensor_norm_ratios(contributions: Mapping[int, Contribution],
                       ) -> dict[int, tuple[str, float]]:
    """replica -> (tensor, ratio) of its tensor whose L2 norm is the largest multiple of that
    tensor's median norm over `contributions` (a zero median counts as no ratio: 0). Empty for
    fewer than three contributions: the median of two is their mean, which no ratio >= 2 can
    exceed."""
    if len(contributions) < 3:
        return {}
    worst = {r: ("", 0.0) for r in contributions}
    for name in next(iter(contributions.values())).params:
        norms = {r: math.sqrt(c.params[name].norm_sq()) for r, c in contributions.items()}
        median = statistics.median(norms.values())
        for r, norm in norms.items():
            if median > 0 and norm / median > worst[r][1]:
                worst[r] = (name, norm / median)
    return worst


def aggregate(contributions: Sequence[Contribution], shapes: Mapping[str, tuple[int, ...]], *,
              mode: str = "selected_mean", clip: bool = True, granularity: str = "tensor",
              device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Dense fp32 aggregate per parameter of `shapes` (name -> shape), computed on `device`
    (default: where the first contribution's values are). The clipping norms come to the host
    (one float per tensor and contributor, taken once); the sums stay on the device, and are
    the same on every device: each contribution's indices are unique, so every coordinate gets
    one addition per contribution, in the order given.

    Raises ValueError for an empty list (the stage must skip its outer step instead), an unknown
    `mode`, or a contribution whose parameters differ from `shapes`.
    """
    if mode not in AGGREGATE_MODES:
        raise ValueError(f"sparseloco.aggregate must be one of {AGGREGATE_MODES}, got {mode!r}")
    if granularity not in CLIP_GRANULARITIES:
        raise ValueError(f"sparseloco.clip_granularity must be one of {CLIP_GRANULARITIES}, "
                         f"got {granularity!r}")
    if not contributions:
        raise ValueError("no contributions to aggregate; the stage should skip its outer step")
    for c in contributions:
        if set(c.params) != set(shapes):
            raise ValueError(f"replica {c.replica}'s contribution has parameters "
                             f"{sorted(c.params)}, expected {sorted(shapes)}")
    ones = [1.0] * len(contributions)
    if not clip:
        scales = {name: ones for name in shapes}
    elif granularity == "tensor":
        scales = tensor_clip_scales(contributions, list(shapes))
    else:
        whole = clip_scales(contributions)
        scales = {name: whole for name in shapes}
    if device is None:
        device = next(iter(contributions[0].params.values())).values.device
    return {name: _aggregate_one(name, shape, contributions, scales[name], mode,
                                 torch.device(device))
            for name, shape in shapes.items()}


def _add_at(total: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """`total[indices] += values` for unique `indices`: one addition per coordinate, so the same
    on every device (a GPU's index_add_ adds with atomics, which is only safe to rely on where
    no two land on one coordinate; the gather-add-scatter makes that independent of it)."""
    if total.device.type == "cpu":
        total.index_add_(0, indices, values)
    else:
        total[indices] = total[indices] + values


def _aggregate_one(name: str, shape: tuple[int, ...], contributions: Sequence[Contribution],
                   scales: Sequence[float], mode: str, device: torch.device) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    total = torch.zeros(numel, dtype=torch.float32, device=device)
    count = torch.zeros(numel, dtype=torch.float32, device=device)
    for contribution, scale in zip(contributions, scales, strict=True):
        part = contribution.params[name].to(device)
        values = part.values * scale if scale != 1.0 else part.values
        if part.indices is None:
            total += values
            count += 1
        else:
            _add_at(total, part.indices, values)
            _add_at(count, part.indices, torch.ones_like(values))
    if mode == "selected_mean":
        total = total / count.clamp(min=1)
    else:
        total = total / len(contributions)
    return total.reshape(shape)
