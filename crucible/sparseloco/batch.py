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
from crucible.sparseloco._chunking import Geometry, flat_indices, geometry
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
                         global_step: int | None = None, chunk: int = 64, topk: int = 64,
                         device: torch.device | str | None = None,
                         ) -> list[Contribution | InvalidContribution]:
    """`decode_contribution` of every blob in `blobs`: element i is the Contribution of blob i,
    or the InvalidContribution that decoding blob i alone raises. `replicas[i]`, when given,
    must match blob i's header (as `decode_contribution`'s `replica`). The values are decoded,
    checked and left on `device` (default: the CPU); only the blobs' frames are read on the
    host, and each valid tensor's squared norm comes back with it."""
    device = torch.device("cpu" if device is None else device)
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
        _decode_parameter(name, geo, frames, values, device)  # drops blobs failing a check
    out: list[Contribution | InvalidContribution] = []
    for i, blob in enumerate(blobs):
        frame = frames.get(i)
        if frame is None:  # not on the fast path: the single-blob decoder decides, and says why
            try:
                out.append(decode_contribution(blob, expected, stage=stage, replica=want[i],
                                               global_step=global_step, chunk=chunk, topk=topk,
                                               device=device))
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
                      values: dict[int, dict[str, SparseValues]], device: torch.device) -> None:
    """Check and decode parameter `name` of every frame at once, on `device`; a frame that fails
    a check is removed from `frames` (and `values`), for the single-blob decoder to explain."""
    order = list(frames)
    if not order:
        return
    quant = np.array([frames[i].quant[name] for i in order], dtype=np.float64)  # shift, scale, table
    shift32 = quant[:, 0].astype(np.float32)
    table32 = quant[:, 2:].astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        levels = table32 + shift32[:, None]
    ok_host = (np.isfinite(quant[:, [0, 2, 3, 4, 5]]).all(axis=1)
               & (quant[:, 1] >= _SCALE_RANGE[0]) & (quant[:, 1] <= _SCALE_RANGE[1])
               & np.isfinite(levels).all(axis=1))
    B = len(order)
    if device.type == "cpu":
        local, codes, ok = _unpacked_on_host(name, geo, [frames[i] for i in order], ok_host)
    else:
        local, codes, ok = _unpacked_on_device(name, geo, [frames[i] for i in order], ok_host,
                                               device)
    ok_list = ok.tolist()
    keep = [j for j, good in enumerate(ok_list) if good]
    for j, good in enumerate(ok_list):
        if not good:
            frames.pop(order[j])
            values.pop(order[j])
    if not keep:
        return
    rows = torch.tensor(keep, dtype=torch.int64, device=device) if len(keep) < B else None

    def kept(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    # table[code] + shift in fp32: the decoder's `_dequantise`, row by row
    table_t = torch.from_numpy(table32[keep]).to(device)
    shift_t = torch.from_numpy(shift32[keep]).to(device)
    decoded = table_t.gather(1, kept(codes)) + shift_t[:, None]
    flat = flat_indices(kept(local), geo)
    for row, (j, norm_sq) in enumerate(zip(keep, _row_norms_sq(decoded), strict=True)):
        values[order[j]][name] = SparseValues(indices=flat[row], values=decoded[row],
                                              norm_sq_known=norm_sq)


def _unpacked_on_host(name: str, geo: Geometry, frames: list[_Frame], ok: np.ndarray,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices (B, n_chunks, k), codes (B, n) and `ok` (B,) narrowed by the bounds and
    ordering checks, for parameter `name` of `frames`, unpacked and checked in numpy: on the
    CPU its small integer operations cost a fraction of torch's per call (a round decodes
    about a hundred parameters)."""
    n = geo.n_values
    local = _unpack_each(_wire.unpack_indices12, [f.indices[name] for f in frames], n,
                         whole=n % 2 == 0).reshape(len(frames), geo.n_chunks, geo.k)
    codes = _unpack_each(_wire.unpack_codes2, [f.codes[name] for f in frames], n,
                         whole=n % 4 == 0)
    if local.size:
        ok = ok & (local.max(axis=(1, 2)) < geo.chunk_len)
        if geo.k > 1:
            ok &= (np.diff(local, axis=2) > 0).all(axis=(1, 2))
    return torch.from_numpy(local), torch.from_numpy(codes), torch.from_numpy(ok)


def _unpack_each(unpack, parts: list[memoryview], count: int, *, whole: bool) -> np.ndarray:
    """`unpack(part, count)` of every part, stacked (len(parts), count); with `whole` (each
    part ends on a whole byte group) the parts are unpacked as one buffer."""
    if whole:
        return unpack(memoryview(b"".join(parts)), count * len(parts)).reshape(len(parts), count)
    return np.stack([unpack(part, count) for part in parts])


def _unpacked_on_device(name: str, geo: Geometry, frames: list[_Frame], ok_host: np.ndarray,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `_unpacked_on_host` gives, computed on `device`: the raw parts of all blobs side by
    side (each row padded to whole byte groups, as sent), one copy to the device, unpacked and
    checked there."""
    n, B = geo.n_values, len(frames)
    raw = torch.frombuffer(bytearray(b"".join(
        part for f in frames for part in (f.indices[name], f.codes[name]))),
        dtype=torch.uint8).to(device).reshape(B, -1)
    n_ix = _wire.indices12_bytes(n)
    local = _unpack_rows12(raw[:, :n_ix], n).reshape(B, geo.n_chunks, geo.k)
    codes = _unpack_rows2(raw[:, n_ix:], n)
    ok = torch.from_numpy(ok_host).to(device)
    if local.numel():
        ok &= local.reshape(B, -1).amax(dim=1) < geo.chunk_len
        if geo.k > 1:
            ok &= local.diff(dim=2).reshape(B, -1).amin(dim=1) > 0
    return local, codes, ok


def _unpack_rows12(raw: torch.Tensor, count: int) -> torch.Tensor:
    """`_wire.unpack_indices12` of every row of `raw` (B, bytes) uint8: (B, count) int64."""
    t = raw.reshape(raw.shape[0], -1, 3).to(torch.int32)
    pairs = torch.empty((*t.shape[:2], 2), dtype=torch.int64, device=raw.device)
    pairs[..., 0] = t[..., 0] | ((t[..., 1] & 0xF) << 8)
    pairs[..., 1] = (t[..., 1] >> 4) | (t[..., 2] << 4)
    return pairs.reshape(raw.shape[0], -1)[:, :count]


_CODE_SHIFTS = (0, 2, 4, 6)   # 4 codes a byte, the first in the lowest bits


def _unpack_rows2(raw: torch.Tensor, count: int) -> torch.Tensor:
    """`_wire.unpack_codes2` of every row of `raw` (B, bytes) uint8: (B, count) int64."""
    shifts = torch.tensor(_CODE_SHIFTS, dtype=torch.uint8, device=raw.device)
    codes = (raw[..., None] >> shifts) & 3                        # (B, bytes, 4), uint8
    return codes.reshape(raw.shape[0], -1)[:, :count].to(torch.int64)


def _row_norms_sq(decoded: torch.Tensor) -> list[float]:
    """`SparseValues.norm_sq` of every row of `decoded` (B, n), one host copy: the very sum
    `norm_sq` takes, so a peer that decodes one blob alone gets the same norm on any device and
    batch size. On the CPU one reduction over the rows is that sum (torch reduces each
    contiguous row on its own, with the algorithm of a 1-D sum); on a GPU a batched reduction's
    order depends on the batch, so each row is summed alone there."""
    if not len(decoded):
        return []
    if decoded.device.type == "cpu":
        return (decoded.double() ** 2).sum(dim=1).tolist()
    return torch.stack([torch.sum(row.double() ** 2) for row in decoded]).tolist()
