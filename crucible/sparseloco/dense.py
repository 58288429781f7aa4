"""Dense fp32 contribution format for the baselines (`diloco`, and `ddp`'s byte accounting).

Same header, CRC trailer and validation frame as the sparse codec, so both travel the same store
and gather path. Tensor record: name | shape | numel fp32 values (little-endian, row-major).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from crucible.sparseloco import _wire
from crucible.sparseloco._wire import InvalidContribution
from crucible.sparseloco.codec import Contribution, SparseValues, read_records

__all__ = ["encode_dense", "decode_dense", "dense_bytes"]


def encode_dense(delta: Mapping[str, torch.Tensor], *, stage: int, replica: int,
                 global_step: int, run_tag: int = 0) -> bytes:
    """Encode one stage's dense pseudo-gradient; raises ValueError for a non-finite value."""
    writer = _wire.Writer()
    writer.header(kind=_wire.KIND_DENSE, stage=stage, replica=replica, global_step=global_step,
                  run_tag=run_tag, n_params=len(delta))
    for name, d in delta.items():
        d = d.detach().to(device="cpu", dtype=torch.float32).contiguous()  # the bytes: on the host
        if not bool(torch.isfinite(d).all()):
            raise ValueError(f"parameter {name!r} of stage {stage}, replica {replica} has a "
                             "non-finite pseudo-gradient; refusing to encode it")
        writer.name(name)
        writer.shape(tuple(d.shape))
        writer.raw(d.numpy().astype("<f4", copy=False).tobytes())
    return writer.finish()


def dense_bytes(expected: Mapping[str, tuple[int, ...]]) -> int:
    """Size in bytes of every valid dense blob for a stage of `expected` (name -> shape)."""
    return _wire.HEADER_BYTES + _wire.TRAILER_BYTES + sum(
        2 + len(name.encode("utf-8")) + 1 + 4 * len(shape) + 4 * math.prod(shape)
        for name, shape in expected.items())


def _read_dense(reader: _wire.Reader, name: str, shape: tuple[int, ...]) -> SparseValues:
    numel = math.prod(shape)
    raw = reader.take(4 * numel, f"{name} values")
    values = torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(values).all()):
        raise InvalidContribution(f"{name}: non-finite value in a dense contribution")
    return SparseValues(indices=None, values=values)


def decode_dense(blob: bytes, expected: Mapping[str, tuple[int, ...]], *, stage: int,
                 replica: int | None = None, global_step: int | None = None,
                 device: torch.device | str | None = None) -> Contribution:
    """Validate and decode a dense contribution (contract as `decode_contribution`)."""
    return read_records(bytes(blob), expected, kind=_wire.KIND_DENSE, stage=stage,
                        replica=replica, global_step=global_step, read_one=_read_dense,
                        device=device)
