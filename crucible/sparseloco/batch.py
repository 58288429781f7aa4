"""Validating and decoding many sparse contributions of one stage at once.

An outer round downloads one blob per contributing replica of a stage, all with the same
parameters, shapes and sizes. `decode_contribution` validates and decodes them one record at a
time, paying Python and small-tensor overhead for every (replica, parameter). Here each blob's
frame (CRC, header, record headers) is still read blob by blob, but the numeric work - unpacking
12-bit indices and 2-bit codes, the bounds, ordering and finiteness checks, dequantisation and
flat indices - runs once per parameter for all blobs together.

The result for each blob is exactly what `decode_contribution` returns for it (same tensors, bit
for bit), or the `InvalidContribution` it raises: any blob that fails any check here, or that
does not fit the fast path, is decoded again by `decode_contribution`, so the rejection reasons
are the single-blob decoder's own.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from crucible.sparseloco import _wire
from crucible.sparseloco._chunking import Geometry, geometry
from crucible.sparseloco._wire import InvalidContribution
from crucible.sparseloco.codec import (
    _QUANT,
    _SCALE_RANGE,
    Contribution,
    SparseValues,
    decode_contribution,
)

__all__ = ["decode_contributions"]


@dataclass
class _Frame:
    """One blob's header fields and, per parameter, its raw record parts (not yet checked)."""

    version: int
    stage: int
    replica: int
    global_step: int
    run_tag: int | None
    nbytes: int
    quant: dict[str, tuple[float, float, float, float, float, float]]  # shift, scale, table
    indices: dict[str, memoryview]
    codes: dict[str, memoryview]


def decode_contributions(blobs: Sequence[bytes], expected: Mapping[str, tuple[int, ...]], *,
                         stage: int, replicas: Sequence[int | None] | None = None,
                         global_step: int | None = None, chunk: int = 64,
                         topk: int = 64) -> list[Contribution | InvalidContribution]:
    """`decode_contribution` of every blob in `blobs`: element i is the Contribution of blob i,
    or the InvalidContribution that decoding blob i alone raises. `replicas[i]`, when given,
    must match blob i's header (as `decode_contribution`'s `replica`)."""
    geometry((1,), chunk=chunk, topk=topk)  # a bad chunk/topk is the caller's error: ValueError
    if replicas is not None and len(replicas) != len(blobs):
        raise ValueError(f"{len(replicas)} replicas for {len(blobs)} blobs")
    want = [None] * len(blobs) if replicas is None else list(replicas)
    frames: dict[int, _Frame] = {}
    try:
        geos = {n: geometry(tuple(s), chunk=chunk, topk=topk) for n, s in expected.items()}
    except ValueError:  # an empty expected shape: every blob takes the single-blob decoder
        geos, blobs_fast = {}, []
    else:
        blobs_fast = list(blobs)
    for i, blob in enumerate(blobs_fast):
        frame = _read_frame(bytes(blob), geos, stage=stage, replica=want[i],
                            global_step=global_step)
        if frame is not None:
            frames[i] = frame
    values: dict[int, dict[str, SparseValues]] = {i: {} for i in frames}
    for name, geo in geos.items():
        _decode_parameter(name, geo, frames, values)   # drops blobs that fail a check
    out: list[Contribution | InvalidContribution] = []
    for i, blob in enumerate(blobs):
        frame = frames.get(i)
        if frame is None:  # not on the fast path: the single-blob decoder decides, and says why
            try:
                out.append(decode_contribution(blob, expected, stage=stage, replica=want[i],
                                               global_step=global_step, chunk=chunk, topk=topk))
            except InvalidContribution as exc:
                out.append(exc)
            continue
        out.append(Contribution(stage=frame.stage, replica=frame.replica,
                                global_step=frame.global_step, version=frame.version,
                                kind="sparse", params={n: values[i][n] for n in expected},
                                nbytes=frame.nbytes, run_tag=frame.run_tag))
    return out


def _read_frame(blob: bytes, geos: Mapping[str, Geometry], *, stage: int, replica: int | None,
                global_step: int | None) -> _Frame | None:
    """The blob's frame if its structure is exactly what `geos` expects, else None."""
    try:
        reader = _wire.Reader(blob)
        version, kind, got_stage, got_replica, got_step, got_run, n_params = reader.header()
        if (kind != _wire.KIND_SPARSE or got_stage != stage or n_params != len(geos)
                or (replica is not None and got_replica != replica)
                or (global_step is not None and got_step != global_step)):
            return None
        frame = _Frame(version, got_stage, got_replica, got_step, got_run, len(blob), {}, {}, {})
        for _ in range(n_params):
            name = reader.name()
            geo = geos.get(name)
            if geo is None or name in frame.quant or reader.shape(name) != geo.shape:
                return None
            block_rows, block_cols, k, *quant = reader.unpack(_QUANT.format)
            if (block_rows, block_cols, k) != (geo.block_rows, geo.block_cols, geo.k):
                return None
            frame.quant[name] = tuple(quant)  # type: ignore[assignment]
            n = geo.n_values
            frame.indices[name] = reader.take(_wire.indices12_bytes(n), "indices")
            frame.codes[name] = reader.take(_wire.codes2_bytes(n), "codes")
        reader.done()
    except InvalidContribution:
        return None
    return frame


def _decode_parameter(name: str, geo: Geometry, frames: dict[int, _Frame],
                      values: dict[int, dict[str, SparseValues]]) -> None:
    """Check and decode parameter `name` of every frame at once; a frame that fails a check is
    removed from `frames` (and `values`), for the single-blob decoder to explain."""
    order = list(frames)
    if not order:
        return
    quant = np.array([frames[i].quant[name] for i in order], dtype=np.float64)  # shift, scale, table
    shift32 = quant[:, 0].astype(np.float32)
    table32 = quant[:, 2:].astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        levels = table32 + shift32[:, None]
    ok = (np.isfinite(quant[:, [0, 2, 3, 4, 5]]).all(axis=1)
          & (quant[:, 1] >= _SCALE_RANGE[0]) & (quant[:, 1] <= _SCALE_RANGE[1])
          & np.isfinite(levels).all(axis=1))
    n = geo.n_values
    local = _unpack_all(_wire.unpack_indices12, [frames[i].indices[name] for i in order], n,
                        per_group=2)
    local = local.reshape(len(order), geo.n_chunks, geo.k)
    if local.size:
        ok &= local.max(axis=(1, 2)) < geo.chunk_len
        if geo.k > 1:
            ok &= (np.diff(local, axis=2) > 0).all(axis=(1, 2))
    codes = _unpack_all(_wire.unpack_codes2, [frames[i].codes[name] for i in order], n,
                        per_group=4)
    keep = np.flatnonzero(ok)
    for j in np.flatnonzero(~ok):
        frames.pop(order[j])
        values.pop(order[j])
    if not keep.size:
        return
    codes_t = torch.from_numpy(codes[keep])
    # table[code] + shift in fp32: the decoder's `_dequantise`, row by row
    decoded = (torch.from_numpy(table32[keep]).gather(1, codes_t)
               + torch.from_numpy(shift32[keep])[:, None])
    flat = _flat_indices(torch.from_numpy(local[keep]), geo)
    for row, j in enumerate(keep):
        values[order[j]][name] = SparseValues(indices=flat[row], values=decoded[row])


def _unpack_all(unpack, raws: list[memoryview], count: int, *, per_group: int) -> np.ndarray:
    """`unpack(raw, count)` of every raw part, stacked (len(raws), count). When `count` fills
    whole byte groups (`per_group` values each: 2 indices in 3 bytes, 4 codes in 1), the parts
    carry no padding and are unpacked as one buffer."""
    if count % per_group == 0:
        return unpack(memoryview(b"".join(raws)), count * len(raws)).reshape(len(raws), count)
    return np.stack([unpack(raw, count) for raw in raws])


def _flat_indices(local: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """`_chunking.flat_indices` of every row of `local` (B, n_chunks, k): (B, n_chunks * k)."""
    grid_c = geo.cols // geo.block_cols
    chunk_id = torch.arange(geo.n_chunks, dtype=torch.int64)[None, :, None]
    row = (chunk_id // grid_c) * geo.block_rows + local // geo.block_cols
    col = (chunk_id % grid_c) * geo.block_cols + local % geo.block_cols
    return (row * geo.cols + col).reshape(local.shape[0], -1)

