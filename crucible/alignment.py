"""How compatible each inner stage's input and output are: the alignment hypothesis, measured.

The blog's explanation of SSN's robustness is that fixed shared projections keep every stage
boundary in one coordinate system, so that skipping a stage hurts less. `alignment_report`
measures, on a trained model's global weights and a fixed set of held-out windows (evenly
spaced over the split, as every evaluation's are), for every inner stage s (the ones that can
fail):

- `cka`: linear CKA (Kornblith et al. 2019) between the residual stream entering stage s (after
  its message is decoded) and leaving it (before it is encoded for the next boundary): 1 when
  the stage's output is a scaled rotation of its input, lower the more the stage re-represents
  it;
- `update_ratio`: ||X_out - X_in||_F / ||X_in||_F, the size of the stage's contribution relative
  to what it receives. A skip removes exactly this contribution in the uncompressed and SSN arms
  (SSN's residual writes all lie in its fixed subspace); under MAPL the next stage sees the
  stage's output only through the boundary bases and anchors, so a skip removes what of it
  crosses;
- `angle_mean_deg` / `angle_max_deg` (MAPL): principal angles between the basis of the boundary
  that feeds the stage (A_{s-1}) and the one it sends over (A_s); SSN's boundaries share one
  basis (0 degrees) and the uncompressed arm has none;
- `bypass_damage_pct`: the instant damage of skipping the stage, forward only, on the same
  windows (the run's own `pipeline.bypass_decode`; MAPL also lists every decode option), with its
  standard error over windows (`crucible bypass-damage` does the same on the whole split).

The moments CKA needs are summed batch by batch (float64, d x d), so the report's memory does
not grow with the number of windows. A study asks it of its baselines (the sweep flow passes
`alignment` to their runs; `crucible run --alignment`, `train(..., alignment=True)`): their
summaries record it (`alignment`; its seconds in `timing.alignment_s`, outside `wall_s`), so the
study can test across arms and seeds whether these numbers predict the trained degradation under
skip. Other runs do not pay for it (about 7% of a MAPL run).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from crucible.evaluation import Evaluator

__all__ = ["alignment_report", "linear_cka", "CkaMoments", "ALIGNMENT_WINDOWS"]

ALIGNMENT_WINDOWS = 1024


class CkaMoments:
    """Running sums for linear CKA between paired rows of X and Y (N x d each, float64)."""

    def __init__(self, d: int, device: torch.device) -> None:
        z = dict(dtype=torch.float64, device=device)
        self.n = 0
        self.sx, self.sy = torch.zeros(d, **z), torch.zeros(d, **z)
        self.xx, self.yy, self.yx = (torch.zeros(d, d, **z) for _ in range(3))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.xx += x.T @ x
        self.yy += y.T @ y
        self.yx += y.T @ x

    def cka(self) -> float:
        """||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F), columns centred; NaN if degenerate."""
        if self.n == 0:
            return float("nan")
        mx, my = self.sx / self.n, self.sy / self.n
        cxx = self.xx - self.n * torch.outer(mx, mx)
        cyy = self.yy - self.n * torch.outer(my, my)
        cyx = self.yx - self.n * torch.outer(my, mx)
        norm = float(torch.linalg.matrix_norm(cxx) * torch.linalg.matrix_norm(cyy))
        return float(cyx.pow(2).sum()) / norm if norm > 0 else float("nan")


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA between two (N, d) activation matrices whose rows are the same tokens."""
    moments = CkaMoments(x.shape[1], x.device)
    moments.add(x, y)
    return moments.cka()


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None   # summary.json stays strict JSON


def _windows(evaluator: Evaluator, windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to `windows` of the evaluator's held-out windows, evenly spaced over them, in batches
    of `train.eval_batch_size`."""
    ids = torch.cat([x for x, _ in evaluator.validation])
    targets = torch.cat([t for _, t in evaluator.validation])
    total = ids.shape[0]
    wanted = min(total, windows)
    index = (torch.arange(wanted, dtype=torch.float64) * (total / wanted)).long()
    ids, targets = ids[index], targets[index]
    size = evaluator.config.train.eval_batch_size
    return [(ids[i:i + size], targets[i:i + size]) for i in range(0, wanted, size)]


@torch.no_grad()
def alignment_report(evaluator: Evaluator, *,
                     windows: int = ALIGNMENT_WINDOWS) -> dict[str, Any]:
    """The alignment of every inner stage of `evaluator`'s global model (row 0: a trainer's
    `evaluator`, or `Evaluator.of_weights` of a finished run's model file) on `windows`
    held-out windows."""
    from crucible.boundary import principal_angles_deg
    from crucible.evaluation import bypass_damage_pct, bypass_mask, decoding
    from crucible.grid.names import BYPASS_DECODES

    started = time.perf_counter()
    model, device, S = evaluator.model, evaluator.device, evaluator.S
    kind = evaluator.config.pipeline.compression
    own = model.bypass_decode
    decodes = BYPASS_DECODES if kind == "mapl" else (own,)
    select = torch.tensor([0], device=device)
    d = evaluator.config.model.d_model
    inner = range(1, S - 1)
    moments = {s: CkaMoments(d, device) for s in inner}
    update_sq = {s: 0.0 for s in inner}
    input_sq = {s: 0.0 for s in inner}
    intact_parts: list[torch.Tensor] = []
    skipped_parts: dict[tuple[int, str], list[torch.Tensor]] = {}
    batches = _windows(evaluator, windows)
    for ids, targets in batches:
        ids, targets = ids[None].to(device), targets[None].to(device)
        outputs: dict[int, torch.Tensor] = {}
        inputs: dict[int, torch.Tensor] = {}
        messages: dict[int, torch.Tensor] = {}
        with evaluator.autocast():
            intact_parts.append(model(ids, targets, select=select, taps=outputs, inputs=inputs,
                                      messages=messages, per_sequence=True)[0].double().cpu())
        for s in inner:
            x_in, x_out = inputs[s][0].flatten(0, 1), outputs[s][0].flatten(0, 1)
            moments[s].add(x_in, x_out)
            update_sq[s] += float((x_out.double() - x_in.double()).pow(2).sum())
            input_sq[s] += float(x_in.double().pow(2).sum())
        del outputs, inputs
        for s in inner:
            skip = bypass_mask(S, s, device)
            for decode in decodes:
                # stages 0..s-1 computed what the intact forward did: start from the message
                # they sent (the same losses, bit for bit, as the whole bypassed forward)
                with decoding(model, decode), evaluator.autocast():
                    losses = model(ids, targets, select=select, bypass=skip, per_sequence=True,
                                   resume=(s, messages[s - 1]))[0]
                skipped_parts.setdefault((s, decode), []).append(losses.double().cpu())
        del messages
    intact = torch.cat(intact_parts)
    stages = []
    for s in inner:
        row: dict[str, Any] = {
            "stage": s, "cka": _finite(moments[s].cka()),
            "update_ratio": _finite(math.sqrt(update_sq[s] / input_sq[s]))
            if input_sq[s] > 0 else None}
        if kind == "mapl":
            angles = principal_angles_deg(model.stage_params(s - 1)["basis"][0],
                                          model.stage_params(s)["basis"][0])
            row["angle_mean_deg"] = float(angles.mean())
            row["angle_max_deg"] = float(angles.max())
        elif kind == "ssn":
            row["angle_mean_deg"] = row["angle_max_deg"] = 0.0
        damage = {}
        for decode in decodes:
            mean, stderr = bypass_damage_pct(torch.cat(skipped_parts[(s, decode)]), intact)
            damage[decode] = (_finite(mean), stderr)
        row["bypass_damage_pct"], row["bypass_damage_stderr_pct"] = damage[own]
        if kind == "mapl":
            row["bypass_damage_by_decode"] = {k: v[0] for k, v in damage.items()}
        stages.append(row)
    return {"windows": int(intact.numel()),
            "tokens": int(intact.numel()) * evaluator.config.model.seq_len,
            "stages": stages, "seconds": time.perf_counter() - started}
