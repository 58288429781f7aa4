"""The trainer's evaluation of the global model: the validation loss over the fixed held-out
windows, per-window losses, MAPL basis reports. A mixin of `crucible.train.Trainer` (it reads the
trainer's model, validation windows, config, counters and callback), in a module of its own to
keep train.py under 500 lines."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from crucible import boundary
from crucible.errors import TrainingDiverged
from crucible.events import Metric

__all__ = ["Evaluation", "standard_error", "bypass_mask", "decoding", "bypass_damage_pct"]


def standard_error(values: torch.Tensor) -> float | None:
    """Standard error of the mean of per-window values; None for fewer than two (one window
    has no spread to measure, and None keeps summary.json strict JSON)."""
    n = values.numel()
    return float(values.std() / n ** 0.5) if n > 1 else None


def bypass_mask(stages: int, stage: int, device: torch.device | str) -> torch.Tensor:
    """The (1, S) mask that skips `stage` of one replica's forward (`model(..., bypass=)`)."""
    mask = torch.zeros(1, stages, dtype=torch.bool, device=device)
    mask[0, stage] = True
    return mask


@contextlib.contextmanager
def decoding(model: Any, decode: str | None) -> Iterator[None]:
    """`model` bypasses with MAPL's `decode` inside the block (None: its own), then its own
    again."""
    own = model.bypass_decode
    model.bypass_decode = own if decode is None else decode
    try:
        yield
    finally:
        model.bypass_decode = own


def bypass_damage_pct(skipped: torch.Tensor, intact: torch.Tensor) -> tuple[float, float | None]:
    """The instant damage of a bypass, paired by window: the mean over windows of
    100 (L_skipped - L_intact) / mean(L_intact), and its standard error over windows."""
    diff = (skipped - intact) / intact.mean() * 100
    return float(diff.mean()), standard_error(diff.flatten())


class Evaluation:
    """`Trainer`'s evaluation methods."""

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss of the global model (replica 0 holds the global weights after every
        outer step), all stages, no bypass: the mean over the fixed held-out windows. Its
        standard error (over windows) is kept in `last_eval_stderr`."""
        window_losses = self.window_losses()
        self.last_window_losses = window_losses
        self.last_eval_stderr = standard_error(window_losses)
        return float(window_losses.mean())

    @property
    def eval_tokens(self) -> int:
        """Held-out tokens one evaluation scores."""
        return sum(int(targets.numel()) for _, targets in self.validation)

    @torch.no_grad()
    def window_losses(self, *, bypass: torch.Tensor | None = None) -> torch.Tensor:
        """Mean loss of every held-out window (float64, on the CPU), global model, optionally
        with `bypass` (1, S) stages skipped (bypass-damage measurements)."""
        select = torch.tensor([0], device=self.device)
        parts = []
        for ids, targets in self.validation:
            with self._autocast():
                parts.append(self.model.window_losses(ids[None].to(self.device),
                                                      targets[None].to(self.device),
                                                      select=select, bypass=bypass)[0])
        return torch.cat(parts).double().cpu()

    def _maybe_evaluate(self, budget: int) -> None:
        g = self.next_step
        if g % self.config.train.eval_every == 0 or self._finished(budget):
            started = time.perf_counter()
            val = self.evaluate()
            self.counters.timing["eval_s"] += time.perf_counter() - started
            if not torch.isfinite(torch.tensor(val)):
                raise TrainingDiverged(f"validation loss is {val} after global step {g}")
            self.counters.evals.append({"global_step": g, "tokens": self.counters.tokens_processed,
                                        "val_loss": val, "val_loss_stderr": self.last_eval_stderr})
            self.callback.metric(Metric("val_loss", g, val, tokens=self.counters.tokens_processed))

    @torch.no_grad()
    def basis_report(self, *, windows: int = 256) -> list[dict[str, Any]]:
        """Per MAPL boundary: how far the learned (global) basis moved from its initial one
        (largest principal angle) and the share of the boundary's centred activation energy each
        keeps, on up to `windows` held-out windows through the global model."""
        select = torch.tensor([0], device=self.device)
        ids = torch.cat([x for x, _ in self.validation])[:windows][None].to(self.device)
        taps: dict[int, torch.Tensor] = {}
        params = [{n: p[select] for n, p in self.model.stage_params(s).items()}
                  for s in range(self.S)]
        self.model(ids, ids, select=select, taps=taps)
        rows = []
        for s in range(self.S - 1):
            learned = params[s]["basis"][0]
            initial = boundary.initial_basis(self.config, s).to(learned.device)
            c = boundary.centred(taps[s], ids, sender=params[s], stage=s, fixed=self.model.fixed)
            rows.append({"boundary": s,
                         "angle_deg": boundary.largest_angle_deg(initial, learned),
                         "energy_kept": boundary.energy_kept(c, learned),
                         "energy_kept_initial": boundary.energy_kept(c, initial)})
        return rows
