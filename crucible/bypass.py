"""Instant bypass damage: how much a trained model's validation loss rises when one inner stage
is skipped, forward only, for each way a compressed boundary can be bridged.

This separates the modelling choice (how the stage after a skipped one reads a message that was
not meant for it) from training dynamics: the same trained weights, the same held-out windows,
one stage bypassed at a time. `crucible bypass-damage RUN_DIR` runs it on a finished run's
`model.pt` (the global weights `crucible run` writes at the end).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from crucible.config import Config, ConfigError, apply_overrides
from crucible.evaluation import Evaluator, bypass_damage_pct, bypass_mask, decoding
from crucible.grid.names import BYPASS_DECODES
from crucible.model_file import MODEL_FILE, load_global_weights

__all__ = ["bypass_damage", "evaluate_run"]


def _config_of(run_dir: Path) -> Config:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} holds no summary.json: pass the --out folder of a "
                          "finished `crucible run`")
    try:
        return Config.from_dict(json.loads(path.read_text())["config"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} has no valid config: {exc}") from None


def _evaluator(run: Path, eval_tokens: int | None) -> Evaluator:
    """An evaluator of the run's final global weights (its `model.pt`), scoring as the run's
    trainer scored."""
    config = _config_of(run)
    if eval_tokens is not None:
        config = apply_overrides(config, {"train.eval_tokens": eval_tokens})
    weights = load_global_weights(run / MODEL_FILE)
    try:
        return Evaluator.of_weights(config, weights)
    except ConfigError as exc:
        raise ConfigError(f"{run / MODEL_FILE}: {exc}") from None


@torch.no_grad()
def evaluate_run(run_dir: str | os.PathLike[str], *,
                 eval_tokens: int | None = None) -> dict[str, Any]:
    """Re-score a finished run's final global model: {"val_loss", "val_loss_stderr",
    "stderr_pct" (of the loss), "eval_tokens", "eval_s"} on `eval_tokens` held-out tokens
    (default: the run's own setting)."""
    evaluator = _evaluator(Path(run_dir), eval_tokens)
    started = time.perf_counter()
    loss = evaluator.evaluate()
    elapsed = time.perf_counter() - started
    stderr = evaluator.last_eval_stderr
    return {"val_loss": loss, "val_loss_stderr": stderr,
            "stderr_pct": None if stderr is None else 100 * stderr / loss,
            "eval_tokens": evaluator.eval_tokens,
            "eval_s": elapsed}


@torch.no_grad()
def bypass_damage(run_dir: str | os.PathLike[str], *, eval_tokens: int | None = None,
                  options: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Validation loss of the run's final global model with no stage skipped, then with each
    inner stage skipped under each decode option (MAPL: identity, sender, receiver; the other
    codecs have one way to bypass). Returns {"config", "eval_tokens", "intact", "rows": [{stage,
    decode, val_loss, damage_pct, damage_stderr_pct}]}; damage is paired (same windows), its
    standard error taken over windows."""
    evaluator = _evaluator(Path(run_dir), eval_tokens)
    config, S = evaluator.config, evaluator.S
    intact = evaluator.window_losses()
    kinds = options or (BYPASS_DECODES if config.pipeline.compression == "mapl" else ("-",))
    rows = []
    for stage in range(1, S - 1):
        skip = bypass_mask(S, stage, evaluator.device)
        for decode in kinds:
            with decoding(evaluator.model, None if decode == "-" else decode):
                losses = evaluator.window_losses(bypass=skip)
            damage, stderr = bypass_damage_pct(losses, intact)
            rows.append({"stage": stage, "decode": decode,
                         "val_loss": float(losses.mean()),
                         "damage_pct": damage, "damage_stderr_pct": stderr})
    return {"config": config.to_dict(), "eval_tokens": evaluator.eval_tokens,
            "intact": float(intact.mean()), "rows": rows}
