"""Checkpoints in the object store: the full training state, written so a killed run resumes.

Layout under the run's key: `checkpoints/step-<global_step:08d>.pt` (torch.save of plain tensors,
lists, dicts and numbers) and `checkpoints/latest.json`, written after the checkpoint object, so
the pointer never names a half-written checkpoint (each store `put` is itself atomic). Loading
validates before use: the pointer parses, the object unpickles with `weights_only=True`, its
format version and resolved config match the run.
"""
from __future__ import annotations

import io
import json
import logging
from typing import Any

import torch

from crucible.store import KeyNotFound, Store

__all__ = ["CheckpointError", "save_checkpoint", "load_latest"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_KEEP = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or belongs to another configuration."""


def _key(run_key: str, global_step: int) -> str:
    return f"{run_key}/checkpoints/step-{global_step:08d}.pt"


def save_checkpoint(store: Store, run_key: str, *, global_step: int, config_json: str,
                    state: dict[str, Any]) -> str:
    """Write the state reached after `global_step` steps; returns its key. Older checkpoints
    beyond the newest two are deleted afterwards."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, "global_step": global_step, "config": config_json,
                "state": state}, buffer)
    key = _key(run_key, global_step)
    store.put(key, buffer.getvalue())
    pointer = json.dumps({"format": FORMAT_VERSION, "global_step": global_step, "key": key})
    store.put(f"{run_key}/checkpoints/latest.json", pointer.encode())
    for old in sorted(store.list(f"{run_key}/checkpoints/step-"))[:-_KEEP]:
        store.delete(old)
    return key


def load_latest(store: Store, run_key: str, *, config_json: str) -> tuple[int, dict[str, Any]] | None:
    """(global_step, state) of the newest checkpoint, or None when the run has none."""
    try:
        raw = store.get(f"{run_key}/checkpoints/latest.json")
    except KeyNotFound:
        return None
    try:
        pointer = json.loads(raw)
        key, step = str(pointer["key"]), int(pointer["global_step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint pointer of run {run_key} is corrupt: {exc}") from None
    try:
        payload = torch.load(io.BytesIO(store.get(key)), weights_only=True, map_location="cpu")
    except KeyNotFound:
        raise CheckpointError(f"checkpoint {key} named by latest.json is missing") from None
    except Exception as exc:  # unpickling garbage can raise nearly anything
        raise CheckpointError(f"checkpoint {key} is unreadable: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {key} has an unknown format")
    if payload.get("global_step") != step:
        raise CheckpointError(f"checkpoint {key} is for step {payload.get('global_step')}, "
                              f"latest.json says {step}")
    if payload.get("config") != config_json:
        raise CheckpointError(f"checkpoint {key} was written with a different configuration; "
                              "resume with the same preset and --set values, or use a new --out")
    return step, payload["state"]
