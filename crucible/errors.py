"""Errors the simulator raises that callers classify (retry or not)."""
from __future__ import annotations

__all__ = ["TrainingDiverged"]


class TrainingDiverged(RuntimeError):
    """The loss or a pseudo-gradient became NaN or infinite: deterministic, retrying will not help."""
