"""Evaluation of a global model, as a component: the validation loss over the fixed held-out
windows, per-window losses, MAPL basis reports. `Evaluator(model, validation, config, device)`
scores row 0 of a `ReplicatedPipeline` (where the global weights are after every outer step);
the trainer holds one, and `Evaluator.of_weights` builds one for a finished run's model file
(`crucible bypass-damage`, `crucible.alignment`) without a trainer."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from crucible import boundary
from crucible.config import Config

__all__ = ["Evaluator", "standard_error", "bypass_mask", "decoding", "bypass_damage_pct",
           "BASIS_WINDOWS"]

# held-out windows the MAPL basis report scores (1,024 in runs made at 13f030d and f889fd0)
BASIS_WINDOWS = 256


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


class Evaluator:
    """Scores row 0 of `model` (the global weights) on `validation`, a list of (ids, targets)
    held-out batches (`TokenData.validation`)."""

    def __init__(self, model: Any, validation: list[tuple[torch.Tensor, torch.Tensor]],
                 config: Config, device: torch.device) -> None:
        self.model, self.validation, self.config, self.device = model, validation, config, device
        self.S = config.pipeline.stages
        self.last_eval_stderr: float | None = None             # of the latest evaluation
        self.last_window_losses: torch.Tensor | None = None    # per held-out window, latest
        # `evaluate(taps_of=n)`: the boundary activations of its first n windows, {boundary s:
        # (1, n, T, d)}, for a basis report of the same weights without a forward of its own
        self.last_taps: dict[int, torch.Tensor] | None = None

    @classmethod
    def of_weights(cls, config: Config, weights: list[dict[str, torch.Tensor]], *,
                   device: torch.device | None = None) -> Evaluator:
        """An evaluator of `weights` (one dict per stage, a run's `model.pt`) with `config`'s
        validation windows: the model is built as the run's trainer built it (every replica
        row, each holding the weights), so its scores are the trainer's to the bit."""
        from crucible.config import ConfigError
        from crucible.data import TokenData, load_tokens
        from crucible.pipeline import ReplicatedPipeline, resolve_device

        device = resolve_device(config.train.device) if device is None else device
        if len(weights) != config.pipeline.stages:
            raise ConfigError(f"the model file has {len(weights)} stages, the config "
                              f"{config.pipeline.stages}")
        tokens = load_tokens(config.data.path, vocab_size=config.model.vocab_size)
        data = TokenData(tokens, model=config.model, data=config.data,
                         replicas=config.replicas, seed=config.seed)
        model = ReplicatedPipeline(config).to_device(device)
        for s, w in enumerate(weights):
            model.set_stage(s, {n: t.to(device) for n, t in w.items()})
        return cls(model, data.validation(tokens=config.train.eval_tokens,
                                          batch_size=config.train.eval_batch_size),
                   config, device)

    @property
    def autocasting(self) -> bool:
        """Whether evaluations run under bf16 autocast: on a GPU when the run trains in bf16."""
        return self.device.type == "cuda" and self.config.train.dtype == "bf16"

    def autocast(self):
        """bf16 autocast when `autocasting`; off otherwise."""
        if self.autocasting:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    @torch.no_grad()
    def evaluate(self, *, taps_of: int = 0) -> float:
        """Validation loss of the global model, all stages, no bypass: the mean over the fixed
        held-out windows. Its standard error (over windows) is kept in `last_eval_stderr`, the
        windows' losses in `last_window_losses`. `taps_of=n`: also keep the boundary
        activations of the first n windows in `last_taps` (None under autocast, whose
        activations a basis report does not use; otherwise they are what the report's own
        forward computes); they cost memory only, the evaluation is the same."""
        self.last_taps = None
        window_losses = self.window_losses(taps_of=0 if self.autocasting else taps_of)
        self.last_window_losses = window_losses
        self.last_eval_stderr = standard_error(window_losses)
        return float(window_losses.mean())

    @property
    def eval_tokens(self) -> int:
        """Held-out tokens one evaluation scores."""
        return sum(int(targets.numel()) for _, targets in self.validation)

    @torch.no_grad()
    def window_losses(self, *, bypass: torch.Tensor | None = None,
                      taps_of: int = 0) -> torch.Tensor:
        """Mean loss of every held-out window (float64, on the CPU), global model, optionally
        with `bypass` (1, S) stages skipped (bypass-damage measurements). `taps_of=n` (no
        bypass): the boundary activations of the first n windows go to `last_taps`."""
        assert not (taps_of and bypass is not None), "taps are of the intact model"
        select = torch.tensor([0], device=self.device)
        parts = []
        kept: dict[int, list[torch.Tensor]] = {}
        seen = 0
        for ids, targets in self.validation:
            taps: dict[int, torch.Tensor] | None = {} if seen < taps_of else None
            with self.autocast():
                parts.append(self.model.window_losses(ids[None].to(self.device),
                                                      targets[None].to(self.device),
                                                      select=select, bypass=bypass,
                                                      taps=taps)[0])
            for s, x in (taps or {}).items():
                kept.setdefault(s, []).append(x)
            seen += ids.shape[0]
        if kept:
            self.last_taps = {s: torch.cat(xs, dim=1)[:, :taps_of] for s, xs in kept.items()}
        return torch.cat(parts).double().cpu()

    @torch.no_grad()
    def basis_report(self, *, windows: int = BASIS_WINDOWS,
                     taps: dict[int, torch.Tensor] | None = None) -> list[dict[str, Any]]:
        """Per MAPL boundary: how far the learned (global) basis moved from its initial one
        (largest principal angle) and the share of the boundary's centred activation energy each
        keeps, on up to `windows` held-out windows through the global model. `taps`: those
        windows' boundary activations of the current weights, when an evaluation just computed
        them (`evaluate(taps_of=windows)`); without them the report runs its own forward."""
        select = torch.tensor([0], device=self.device)
        ids = torch.cat([x for x, _ in self.validation])[:windows][None].to(self.device)
        params = [{n: p[select] for n, p in self.model.stage_params(s).items()}
                  for s in range(self.S)]
        if taps is None or any(taps.get(s) is None or taps[s].shape[1] != ids.shape[1]
                               for s in range(self.S - 1)):
            taps = {}
            self.model(ids, ids, select=select, taps=taps, last=self.S - 2)  # the taps it needs
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
