"""Checkpoints in the object store: the full training state, written so a killed run resumes.

Layout under the run's key: `checkpoints/step-<global_step:08d>.pt`, one self-verifying object
each:

    magic b"CRUCKPT2" | payload length u64 | SHA-256 of the payload (32 bytes) | payload

where the payload is `torch.save` of plain tensors, lists, dicts and numbers. Each store `put`
is atomic, so an object that exists is whole; the digest catches what happens to it later (bit
rot, a partial overwrite, a copy gone wrong). Loading lists the run's checkpoints and takes the
newest that passes every check - size (at most `max_bytes`, refused unread), magic, length,
digest, `torch.load(weights_only=True)`, format version, step, and the configuration (store
location and `train.keep_checkpoints` aside: they do not change a run's numbers). A newer
checkpoint that fails is reported to the caller and skipped, so a run resumes from the previous
good one; if checkpoints exist and none passes, `CheckpointError` says so (a run never silently
starts over). `save_checkpoint(..., keep=N)` deletes all but the newest N (2 by default: one to
fall back on). The `latest.json` pointer earlier versions wrote is neither written nor read: the
listing and the digests say which checkpoint is the newest good one.

Checkpoints of earlier versions (format 1: a bare `torch.save`, no digest) are recognised and
not resumed: when they are all a run has, `CheckpointError` says so and that the run must start
again without --resume, with --overwrite (their weights and config fields differ from what this
version trains).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from crucible.events import detail_text
from crucible.store import InvalidObject, KeyNotFound, ObjectTooLarge, Store

__all__ = ["CheckpointError", "LoadedCheckpoint", "save_checkpoint", "load_latest",
           "checkpoint_limit"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
_MAGIC = b"CRUCKPT2"
_FRAME = struct.Struct("<8sQ32s")
_NAME = re.compile(r"step-([0-9]{8})\.pt")
_ZIP = b"PK\x03\x04"   # torch.save's own container: how format 1 checkpoints begin
_FORMAT_1 = "written by an older version of crucible (format 1, without a SHA-256)"
# Resolved-config keys that say where and how much is kept, not what is computed.
_OPERATIONAL = (("store",), ("train", "keep_checkpoints"))


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or belongs to another configuration."""


@dataclass
class LoadedCheckpoint:
    """The state a run resumes from; `skipped` lists (global step, key, reason) of newer
    checkpoints that failed their checks."""

    global_step: int
    state: dict[str, Any]
    skipped: list[tuple[int, str, str]] = field(default_factory=list)


def _prefix(run_key: str) -> str:
    return f"{run_key}/checkpoints/step-"


def _key(run_key: str, global_step: int) -> str:
    return f"{_prefix(run_key)}{global_step:08d}.pt"


def checkpoint_limit(state: Any) -> int:
    """Most bytes a checkpoint of a run whose state looks like `state` can take: twice its
    tensors (a run's shapes never change) plus 64 MiB for counters, plan and pickle framing."""
    return 2 * _tensor_bytes(state) + 64 * 2**20


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _comparable(config_json: str) -> dict[str, Any]:
    config = json.loads(config_json)
    for path in _OPERATIONAL:
        node = config
        for part in path[:-1]:
            node = node.get(part, {})
        node.pop(path[-1], None)
    return config


def same_configuration(config_json: str, other_json: str) -> bool:
    """Whether two configurations describe the same run (where its store lives and how many
    checkpoints it keeps may differ): the test a resume must pass."""
    return _comparable(config_json) == _comparable(other_json)


def save_checkpoint(store: Store, run_key: str, *, global_step: int, config_json: str,
                    state: dict[str, Any], keep: int = 2) -> str:
    """Write the state reached after `global_step` steps; returns its key. Checkpoints older
    than the newest `keep` are deleted afterwards."""
    if keep < 1:
        raise ValueError(f"train.keep_checkpoints must be >= 1, got {keep}")
    buffer = io.BytesIO()
    buffer.write(bytes(_FRAME.size))  # the frame goes in front once the payload is known
    torch.save({"format": FORMAT_VERSION, "global_step": global_step, "config": config_json,
                "state": state}, buffer)
    with buffer.getbuffer() as view:
        payload = view[_FRAME.size:]
        frame = _FRAME.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest())
        payload.release()
    buffer.seek(0)
    buffer.write(frame)
    key = _key(run_key, global_step)
    store.put(key, buffer.getvalue())
    for old in _steps(store, run_key)[:-keep]:
        store.delete(_key(run_key, old))
    return key


def _steps(store: Store, run_key: str) -> list[int]:
    """Global steps of the run's checkpoints, ascending."""
    prefix = _prefix(run_key)
    steps = []
    for key in store.list(prefix):
        match = _NAME.fullmatch(key[len(prefix) - len("step-"):])
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def load_latest(store: Store, run_key: str, *, config_json: str,
                max_bytes: int) -> LoadedCheckpoint | None:
    """The newest checkpoint that passes every check, or None when the run has none.

    Raises CheckpointError when checkpoints exist but none passes (each reason in the
    message), or when the newest valid one was written with another configuration."""
    steps = _steps(store, run_key)
    skipped: list[tuple[int, str, str]] = []
    for step in reversed(steps):
        key = _key(run_key, step)
        try:
            payload = _read(store, key, step, max_bytes)
        except CheckpointError as exc:
            skipped.append((step, key, detail_text(str(exc))))
            continue
        if _comparable(payload["config"]) != _comparable(config_json):
            raise CheckpointError(f"checkpoint {key} was written with a different configuration "
                                  "(or by an older crucible whose config fields or initial "
                                  "weights differ); resume with the same preset and --set "
                                  "values, start again with --overwrite, or use a new --out")
        for _, bad, reason in skipped:
            log.warning("skipped checkpoint %s (%s); resuming from %s", bad, reason, key)
        return LoadedCheckpoint(global_step=step, state=payload["state"], skipped=skipped)
    if skipped and all(reason == _FORMAT_1 for *_, reason in skipped):
        raise CheckpointError(f"the checkpoints of run {run_key} were {_FORMAT_1} and cannot be "
                              "resumed; start the run again without --resume, with "
                              "--overwrite (or with a new --out)")
    if skipped:
        reasons = "; ".join(f"{key}: {reason}" for _, key, reason in skipped)
        raise CheckpointError(f"no usable checkpoint for run {run_key} ({reasons}); start it "
                              "again without --resume, with --overwrite, or with a new --out")
    return None


def _read(store: Store, key: str, step: int, max_bytes: int) -> dict[str, Any]:
    """The checked payload of one checkpoint; CheckpointError saying what is wrong."""
    try:
        raw = store.get(key, max_bytes=max_bytes)
    except KeyNotFound:
        raise CheckpointError("it vanished while being read") from None
    except ObjectTooLarge as exc:
        raise CheckpointError(f"{exc.size} bytes is more than a checkpoint of this run can "
                              f"take ({max_bytes}); not read") from None
    except InvalidObject as exc:  # e.g. a FIFO left at the key: reading it would never end
        raise CheckpointError(str(exc)) from None
    if len(raw) < _FRAME.size:
        raise CheckpointError(f"truncated: {len(raw)} bytes")
    magic, length, digest = _FRAME.unpack_from(raw)
    if magic.startswith(_ZIP):
        raise CheckpointError(_FORMAT_1)
    if magic != _MAGIC:
        raise CheckpointError(f"unknown format (magic {magic!r}, expected {_MAGIC!r}; written "
                              "by an older crucible?)")
    payload = memoryview(raw)[_FRAME.size:]
    if len(payload) != length:
        raise CheckpointError(f"payload has {len(payload)} bytes, its header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError("SHA-256 mismatch: the checkpoint was changed or damaged after "
                              "it was written")
    try:
        content = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:  # a digest-valid payload torch cannot read: any error is possible
        raise CheckpointError(f"unreadable: {exc}") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT_VERSION:
        raise CheckpointError("unknown payload format")
    if content.get("global_step") != step or not isinstance(content.get("config"), str):
        raise CheckpointError(f"holds step {content.get('global_step')!r}, its name says {step}")
    return content
