"""model.pt: the global weights of every stage that a finished `crucible run` (or `crucible
launch`) writes at the end, and reads back for `crucible evaluate` / `crucible bypass-damage`.

Kept apart from `crucible.bypass` (which re-scores a trained model and so needs the Trainer) so
that the trainer can write the file without importing the module that imports it. torch loads
with the first save or load, not with this module.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from crucible.config import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["save_global_weights", "load_global_weights", "MODEL_FILE", "MAX_MODEL_BYTES"]

MODEL_FILE = "model.pt"
MAX_MODEL_BYTES = 8 << 30          # a 178M fp32 model is 0.7 GB; refuse anything absurd


def save_global_weights(path: Path, weights: list[dict[str, torch.Tensor]]) -> None:
    """Write the global weights of every stage (write-then-rename)."""
    import torch

    from crucible.runfiles import write_bytes_atomic

    buffer = io.BytesIO()
    torch.save({"format": 1, "stages": [{n: t.detach().cpu() for n, t in w.items()}
                                        for w in weights]}, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def load_global_weights(path: Path) -> list[dict[str, torch.Tensor]]:
    """The stages' global weights from `save_global_weights`; ConfigError on a bad file."""
    import torch

    if not path.is_file():
        raise ConfigError(f"{path} does not exist: bypass-damage needs a run folder that "
                          f"`crucible run` finished (it writes {MODEL_FILE} at the end)")
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise ConfigError(f"{path} is {size} bytes, over the {MAX_MODEL_BYTES}-byte limit")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
        stages = payload["stages"]
        if payload.get("format") != 1 or not isinstance(stages, list):
            raise ValueError("unknown format")
        return [{str(n): t for n, t in w.items()} for w in stages]
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear error
        raise ConfigError(f"{path} is not a Crucible model file ({exc}); re-run the run") from None
