"""Small shared builders for the unit tests."""
from __future__ import annotations

from crucible.config import Config, apply_overrides
from crucible.presets import get_preset


def tiny(**overrides: object) -> Config:
    """A model small enough for exact comparisons in milliseconds."""
    base = {"model.d_model": 32, "model.layers": 4, "model.heads": 2, "model.seq_len": 16,
            "replicas": 2, "train.batch_size": 2, "sparseloco.inner_steps": 2,
            "train.global_steps": 3, "train.eval_every": 3, "train.eval_tokens": 256,
            "train.warmup_steps": 2}
    base.update({k: v for k, v in overrides.items()})
    return apply_overrides(get_preset("smoke"), {k.replace("__", "."): v for k, v in base.items()})
