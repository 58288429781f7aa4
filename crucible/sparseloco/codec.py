"""SparseLoCo's contribution codec: error feedback, chunked top-k, 2-bit quantisation, packing.

Per stage and replica (ALGORITHMS.md section 3):

    e <- beta * e + delta                       (fp32 error feedback)
    keep the k largest |e| of every chunk       (64x64 blocks / 64-chunks, k rescaled when smaller)
    quantise kept values to 2 bits per tensor   (shift = mean, scale = 1.5 std, 4-entry bin-mean table)
    e <- e - decoded                            (the residual absorbs sparsification and quantisation)

so that `e_new + decoded == beta * e_old + delta` up to fp32 round-off. Indices are chunk-local,
12 bits, two per three bytes; codes four per byte: 14 bits per kept value, 0.21875 bits per
parameter at density 1/64. Ties in |e| are broken by the lower chunk-local index, so encoding is
deterministic. Kept indices are sent in ascending order inside each chunk, which lets the decoder
reject duplicates with one comparison.

Tensor record (after the header described in `_wire`):
    name | shape | block_rows u16 | block_cols u16 | k u16 | shift f32 | scale f32 | table 4 x f32
    | indices (12-bit packed, n_chunks * k) | codes (2-bit packed, n_chunks * k)
"""
from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from crucible.sparseloco import _wire
from crucible.sparseloco._chunking import Geometry, flat_indices, from_chunks, geometry, to_chunks
from crucible.sparseloco._wire import InvalidContribution

__all__ = ["Contribution", "SparseValues", "InvalidContribution", "ErrorFeedbackCodec",
           "encode_contribution", "encode_contributions_batched", "decode_contribution",
           "contribution_bytes", "MIN_SCALE", "MAX_SCALE"]

MIN_SCALE = 1e-12
MAX_SCALE = 1e4
_QUANT = struct.Struct("<HHHff4f")
# The bounds as the fp32 the scale travels in (fp32(1e-12) is slightly below 1e-12).
_SCALE_RANGE = struct.unpack("<2f", struct.pack("<2f", MIN_SCALE, MAX_SCALE))
# torch splits a reduction longer than this across threads (at::internal::GRAIN_SIZE), which
# changes its rounding; rows this long take the per-row statistics of `_quantise` instead.
_SERIAL_REDUCE = 32768


@dataclass(frozen=True)
class SparseValues:
    """Decoded values of one parameter: `values[i]` belongs at flat index `indices[i]` of the
    parameter (row-major). `indices is None` means dense: `values` covers every coordinate."""

    indices: torch.Tensor | None  # (n,) int64, unique
    values: torch.Tensor          # (n,) fp32, dequantised
    # `norm_sq()` when the decoder has already taken it (a batch of them in one host copy)
    norm_sq_known: float | None = field(default=None, repr=False, compare=False)

    def norm_sq(self) -> float:
        """Squared L2 norm (fp64 sum), computed once: the gather's norm rule and the
        aggregation's clipping both ask for it."""
        cached = self.norm_sq_known
        if cached is None:
            cached = float(torch.sum(self.values.double() ** 2))
            object.__setattr__(self, "norm_sq_known", cached)  # frozen; the values never change
        return cached

    def to(self, device: torch.device | str | None) -> SparseValues:
        """These values on `device` (self when they are there, or `device` is None)."""
        if device is None or self.values.device == torch.device(device):
            return self
        return SparseValues(indices=None if self.indices is None else self.indices.to(device),
                            values=self.values.to(device), norm_sq_known=self.norm_sq_known)


@dataclass(frozen=True)
class Contribution:
    """One replica's validated, decoded contribution for one stage and global step."""

    stage: int
    replica: int
    global_step: int
    version: int
    kind: str                                   # "sparse" or "dense"
    params: dict[str, SparseValues] = field(repr=False)
    nbytes: int = 0                             # size of the blob it was decoded from
    run_tag: int | None = None                  # `_wire.run_tag` of its run; None: version 1

    def norm(self) -> float:
        """L2 norm of the whole stage vector (all parameters)."""
        return math.sqrt(sum(p.norm_sq() for p in self.params.values()))


# torch.topk (CPU) uses a partial heap sort when k * _HEAP_RATIO <= the row length.
_HEAP_RATIO = 64


def _select_topk(chunks: torch.Tensor, k: int) -> torch.Tensor:
    """Chunk-local indices (n_chunks, k), ascending, of the k largest |value| per chunk; ties at
    the k-th magnitude go to the lower index, so the choice never depends on topk's internals."""
    n_chunks, chunk_len = chunks.shape
    if k == chunk_len:
        return torch.arange(chunk_len, device=chunks.device).expand(n_chunks, chunk_len).clone()
    mag = chunks.abs()
    # torch.topk takes its fast heap path when k <= row length / 64: the default 64 of 4096 is
    # exactly that (k + 1 is not, and costs 1.6x). A chunk a little short of 64 k values (the
    # rescaled blocks, e.g. 44 of 2752) is padded with -1s, which are never kept. Whether the
    # k-th magnitude is tied with a value left out is then one count: more than k values reach it.
    pad = _HEAP_RATIO * k - chunk_len
    if chunks.device.type == "cpu" and 0 < pad <= chunk_len // 2:  # CPU topk's heap path only
        top = torch.topk(F.pad(mag, (0, pad), value=-1.0), k, dim=1, sorted=False)
    else:
        top = torch.topk(mag, k, dim=1, sorted=False)
    threshold = top.values.amin(dim=1, keepdim=True)
    local = top.indices.sort(dim=1).values
    reach = (mag >= threshold).view(torch.uint8).sum(dim=1, dtype=torch.int32)
    ambiguous = (reach > k).nonzero().reshape(-1)
    if ambiguous.numel():  # rare in real deltas (exact zeros, repeated values)
        local[ambiguous] = _lowest_index_ties(mag[ambiguous], threshold[ambiguous], k)
    return local


def _lowest_index_ties(mag: torch.Tensor, threshold: torch.Tensor, k: int) -> torch.Tensor:
    """The slow, exact rule for rows with ambiguous ties: every value above the threshold, then
    the lowest-indexed values equal to it."""
    above = mag > threshold
    at = mag == threshold
    need = k - above.sum(dim=1, keepdim=True)
    chosen = above | (at & (at.cumsum(dim=1) <= need))
    return chosen.nonzero()[:, 1].reshape(mag.shape[0], k)


def _quantise(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """2-bit codes, fp32 table (offsets from shift), fp32 shift and scale of `values` (flat)."""
    shift = values.mean()
    scale = max(1.5 * float(values.std(correction=0)), MIN_SCALE)
    codes = torch.clamp(torch.round((values - shift) / scale + 2), 0, 3).to(torch.int64)
    sums = torch.bincount(codes, weights=(values - shift).double(), minlength=4)
    counts = torch.bincount(codes, minlength=4)
    centres = (torch.arange(4, dtype=torch.float64) - 2) * scale  # empty bins: harmless, finite
    table = torch.where(counts > 0, sums / counts.clamp(min=1), centres).to(torch.float32)
    return codes, table, shift, scale


def _dequantise(codes: torch.Tensor, table: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The one dequantisation both sides use, so encoder and decoder agree bit for bit."""
    return table[codes] + shift


def _encode_tensor(writer: _wire.Writer, name: str, e: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Append `e`'s record to `writer`; return the dense decoded tensor (what peers will see)."""
    chunks = to_chunks(e, geo)
    local = _select_topk(chunks, geo.k)                         # (n_chunks, k)
    kept = chunks.gather(1, local).reshape(-1)
    codes, table, shift, scale = _quantise(kept)
    decoded = _dequantise(codes, table, shift.to(torch.float32))
    writer.name(name)
    writer.shape(geo.shape)
    writer.pack(_QUANT.format, geo.block_rows, geo.block_cols, geo.k, float(shift), scale,
                *table.tolist())
    writer.raw(_wire.pack_indices12(local.reshape(-1).numpy()))
    writer.raw(_wire.pack_codes2(codes.numpy()))
    dense = torch.zeros_like(chunks).scatter_(1, local, decoded.reshape(local.shape))
    return from_chunks(dense, geo)


def encode_contribution(delta: Mapping[str, torch.Tensor], error: Mapping[str, torch.Tensor], *,
                        beta: float, stage: int, replica: int, global_step: int, chunk: int = 64,
                        topk: int = 64, run_tag: int = 0) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Encode one stage's pseudo-gradient `delta` with error feedback.

    `error` holds the previous buffers (a missing name counts as zeros; nothing is mutated).
    `run_tag` (`_wire.run_tag(run)`) names the run in the header.
    Returns the blob and the new error buffers, with `new_error + decoded == beta*error + delta`
    to fp32 round-off. Raises ValueError for a non-finite delta or error (naming the parameter):
    a diverged replica must not poison its peers.
    """
    writer = _wire.Writer()
    writer.header(kind=_wire.KIND_SPARSE, stage=stage, replica=replica, global_step=global_step,
                  run_tag=run_tag, n_params=len(delta))
    new_error: dict[str, torch.Tensor] = {}
    for name, d in delta.items():
        d = d.detach().to(torch.float32)
        prev = error.get(name)
        e = d.clone() if prev is None else beta * prev.detach().to(torch.float32) + d
        if not math.isfinite(float(e.sum())):  # NaN and inf survive a sum; one cheap pass
            raise ValueError(f"parameter {name!r} of stage {stage}, replica {replica} has a "
                             "non-finite pseudo-gradient or error buffer; refusing to encode it")
        geo = geometry(tuple(d.shape), chunk=chunk, topk=topk)
        decoded = _encode_tensor(writer, name, e.reshape(geo.shape), geo)
        new_error[name] = e - decoded
    return writer.finish(), new_error


def encode_contributions_batched(
        delta: Mapping[str, torch.Tensor], error: Mapping[str, torch.Tensor], *, beta: float,
        stage: int, replicas: Sequence[int], global_step: int, chunk: int = 64,
        topk: int = 64, run_tag: int = 0) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    """`encode_contribution` for several replicas of one stage at once.

    `delta[name]` and `error[name]` are (R', ...) with row i belonging to `replicas[i]` (a
    missing error name counts as zeros). Returns one blob per replica and the new error buffers
    (R', ...); blob i and row i are exactly (bytes, torch.equal) what `encode_contribution` gives
    for replica `replicas[i]` alone. Same-shape parameters of all replicas go through top-k and
    quantisation as one batch, so the per-tensor overhead is paid once per shape, not per replica
    and parameter. Raises ValueError naming the parameter and replica on a non-finite input.
    """
    n_rep = len(replicas)
    for name, d in delta.items():
        if d.dim() == 0 or d.shape[0] != n_rep:
            raise ValueError(f"delta {name!r} has shape {tuple(d.shape)}, expected a leading "
                             f"replica dimension of {n_rep}")
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name, d in delta.items():
        by_shape.setdefault(tuple(d.shape[1:]), []).append(name)
    # e = beta * error + delta, written straight into one (T, R', ...) block per shape
    stacked: dict[tuple[int, ...], torch.Tensor] = {}
    e_all: dict[str, torch.Tensor] = {}
    device = next(iter(delta.values())).device if delta else torch.device("cpu")
    for shape, names in by_shape.items():
        block = torch.empty((len(names), n_rep, *shape), dtype=torch.float32, device=device)
        for t, name in enumerate(names):
            d, prev = delta[name].detach(), error.get(name)
            if prev is None:
                block[t].copy_(d)
            else:  # the same two roundings as `beta * prev + d`
                torch.mul(prev.detach().to(device=device, dtype=torch.float32), beta,
                          out=block[t])
                block[t].add_(d.to(device=device, dtype=torch.float32))
            e_all[name] = block[t]
        stacked[shape] = block
    _check_finite({n: e_all[n] for n in delta}, stage=stage, replicas=replicas)
    records: dict[str, list[bytes]] = {}
    new_error: dict[str, torch.Tensor] = {}
    for shape, names in by_shape.items():
        geo = geometry(shape, chunk=chunk, topk=topk)
        block = stacked[shape]
        rows = block.view(len(names) * n_rep, geo.rows, geo.cols)       # (T*R', rows, cols)
        residual, tails = _encode_rows(rows, geo)
        residual = residual.view(block.shape)
        for t, name in enumerate(names):
            new_error[name] = residual[t]
            records[name] = tails[t * n_rep:(t + 1) * n_rep]
    blobs = []
    for i, replica in enumerate(replicas):
        writer = _wire.Writer()
        writer.header(kind=_wire.KIND_SPARSE, stage=stage, replica=replica,
                      global_step=global_step, run_tag=run_tag, n_params=len(delta))
        for name in delta:
            writer.name(name)
            writer.shape(tuple(e_all[name].shape[1:]))
            writer.raw(records[name][i])
        blobs.append(writer.finish())
    return blobs, {n: new_error[n] for n in delta}


def _check_finite(e_all: Mapping[str, torch.Tensor], *, stage: int,
                  replicas: Sequence[int]) -> None:
    """Raise the error `encode_contribution` would raise first, replica by replica."""
    if not e_all:
        return
    finite = torch.stack([torch.isfinite(e.reshape(e.shape[0], -1).sum(dim=1))
                          for e in e_all.values()])                     # (n_params, R')
    if bool(finite.all()):
        return
    bad_rep = int((~finite).any(dim=0).nonzero()[0])
    bad_name = list(e_all)[int((~finite[:, bad_rep]).nonzero()[0])]
    raise ValueError(f"parameter {bad_name!r} of stage {stage}, replica {replicas[bad_rep]} has "
                     "a non-finite pseudo-gradient or error buffer; refusing to encode it")


def _encode_rows(x: torch.Tensor, geo: Geometry) -> tuple[torch.Tensor, list[bytes]]:
    """Top-k and quantise every row of `x` (G, rows, cols) as its own tensor. Returns the
    residual `x - decoded` (G, rows, cols), which is the new error feedback, and per row its
    record after name and shape. `x` is scratch: it may be overwritten."""
    G = x.shape[0]
    grid_r, grid_c = geo.rows // geo.block_rows, geo.cols // geo.block_cols
    chunks = (x.reshape(G, grid_r, geo.block_rows, grid_c, geo.block_cols)
              .permute(0, 1, 3, 2, 4).reshape(G, geo.n_chunks, geo.chunk_len))
    local = _select_topk(chunks.reshape(G * geo.n_chunks, geo.chunk_len), geo.k)
    local = local.reshape(G, geo.n_chunks, geo.k)
    kept = chunks.gather(2, local).reshape(G, geo.n_values)
    codes, table, shift, scale = _quantise_rows(kept)
    decoded = table.gather(1, codes) + shift[:, None]                  # == _dequantise per row
    # x - decoded: decoded is zero off the kept positions, where x - 0 is x bit for bit
    chunks.scatter_(2, local, (kept - decoded).reshape(local.shape))
    residual = (chunks.reshape(G, grid_r, grid_c, geo.block_rows, geo.block_cols)
                .permute(0, 1, 3, 2, 4).reshape(G, geo.rows, geo.cols))
    packed = _packed_rows(local.reshape(G, geo.n_values), codes)
    scalars = torch.cat([shift.double()[:, None], scale[:, None], table.double()], dim=1)
    tails = [_QUANT.pack(geo.block_rows, geo.block_cols, geo.k, sh, sc, *tb) + row
             for (sh, sc, *tb), row in zip(scalars.tolist(), packed, strict=True)]
    return residual, tails


def _packed_rows(local: torch.Tensor, codes: torch.Tensor) -> list[bytes]:
    """Per row of `local` and `codes` (G, n): its packed indices, then its packed codes, as
    `_wire.pack_indices12` and `_wire.pack_codes2` pack one row. Off the CPU the packing runs
    on the device and the packed rows come to the host in one copy; on the CPU it runs in numpy,
    whose small integer operations cost a fraction of torch's per call (a round packs about 45
    groups of rows), and rows whose packing ends on a whole byte group pack as one buffer."""
    if local.device.type != "cpu":
        packed = torch.cat([_pack_rows12(local), _pack_rows2(codes)], dim=1).cpu().numpy()
        return [row.tobytes() for row in packed]
    n = codes.shape[1]
    indices = _pack_each(_wire.pack_indices12, local.numpy(), whole=n % 2 == 0)
    values = _pack_each(_wire.pack_codes2, codes.numpy(), whole=n % 4 == 0)
    return [ix + cd for ix, cd in zip(indices, values, strict=True)]


def _pack_each(pack, rows: np.ndarray, *, whole: bool) -> list[bytes]:
    """`pack(row)` of every row of `rows` (G, n); with `whole` (no row's packing shares a byte
    group with the next row's) all rows are packed in one call and cut apart."""
    if not whole:
        return [pack(row) for row in rows]
    flat = pack(rows.reshape(-1))
    size = len(flat) // len(rows)
    return [flat[i * size:(i + 1) * size] for i in range(len(rows))]


def _quantise_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
    """`_quantise` of every row of `values` (G, n): codes (G, n), table (G, 4) fp32, shift (G,)
    fp32, scale (G,) fp64, bit for bit what `_quantise` gives row by row."""
    G, n = values.shape
    on_cpu = values.device.type == "cpu"
    if not on_cpu:  # a GPU's reductions: another order, fp32 round-off from the CPU's
        shift = values.mean(dim=1)
        std = values.std(dim=1, correction=0)
    elif n > _SERIAL_REDUCE:
        shift = torch.stack([row.mean() for row in values])
        std = torch.stack([row.std(correction=0) for row in values])
    else:
        shift = values.mean(dim=1)
        # what torch does for one 1-D tensor: fp32 mean, then a sequential fp64 sum of squares
        dev = values.double() - shift.double()[:, None]
        std = ((dev * dev).cumsum(dim=1)[:, -1] / n).sqrt().to(torch.float32)
    scale = (1.5 * std.double()).clamp(min=MIN_SCALE)                  # (G,) fp64, as Python's
    centred = values - shift[:, None]
    codes = torch.clamp(torch.round(centred / scale.to(torch.float32)[:, None] + 2), 0, 3)
    codes = codes.to(torch.int64)
    if on_cpu:
        bins = (codes + 4 * torch.arange(G)[:, None]).reshape(-1)      # bin 4*row + code
        sums = torch.bincount(bins, weights=centred.double().reshape(-1), minlength=4 * G)
        sums = sums.reshape(G, 4)
        counts = torch.bincount(bins, minlength=4 * G).reshape(G, 4)
    else:  # a GPU's bincount adds with atomics, in no fixed order: per-bin sums are repeatable
        wide = centred.double()
        sums = torch.stack([torch.where(codes == c, wide, 0.0).sum(dim=1) for c in range(4)], 1)
        counts = torch.stack([(codes == c).sum(dim=1) for c in range(4)], 1)
    centres = ((torch.arange(4, dtype=torch.float64, device=values.device) - 2)[None, :]
               * scale[:, None])
    table = torch.where(counts > 0, sums / counts.clamp(min=1), centres)
    return codes, table.to(torch.float32), shift, scale


def _pack_rows12(idx: torch.Tensor) -> torch.Tensor:
    """`_wire.pack_indices12` of every row of `idx` (G, n), on its device: uint8 (G, bytes)."""
    v = idx.to(torch.int32)
    if v.shape[1] % 2:
        v = F.pad(v, (0, 1))
    a, b = v[:, 0::2], v[:, 1::2]
    out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=2)
    return out.to(torch.uint8).reshape(v.shape[0], -1)


def _pack_rows2(codes: torch.Tensor) -> torch.Tensor:
    """`_wire.pack_codes2` of every row of `codes` (G, n), on its device: uint8 (G, bytes)."""
    c = codes.to(torch.int32)
    pad = (-c.shape[1]) % 4
    if pad:
        c = F.pad(c, (0, pad))
    c = c.reshape(c.shape[0], -1, 4)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).to(torch.uint8)


def _check_header(kind: int, want_kind: int, stage: int, replica: int, global_step: int, *,
                  expect_stage: int, expect_replica: int | None,
                  expect_step: int | None) -> None:
    if kind != want_kind:
        raise InvalidContribution(f"kind {kind} where {want_kind} was expected "
                                  "(sparse and dense contributions are not interchangeable)")
    if stage != expect_stage:
        raise InvalidContribution(f"contribution is for stage {stage}, expected stage {expect_stage}")
    if expect_replica is not None and replica != expect_replica:
        raise InvalidContribution(f"contribution is from replica {replica}, "
                                  f"expected replica {expect_replica}")
    if expect_step is not None and global_step != expect_step:
        raise InvalidContribution(f"contribution is for global step {global_step}, "
                                  f"expected {expect_step}")


def read_records(blob: bytes, expected: Mapping[str, tuple[int, ...]], *, kind: int, stage: int,
                 replica: int | None, global_step: int | None, read_one,
                 device: torch.device | str | None = None) -> Contribution:
    """Shared frame of the sparse and dense decoders: header, one `read_one(reader, name, shape)`
    per record, the expected-parameter bookkeeping and the trailing-bytes check; the decoded
    values end on `device` (None: where `read_one` left them, the CPU)."""
    reader = _wire.Reader(blob)
    version, got_kind, got_stage, got_replica, got_step, got_run, n_params = reader.header()
    _check_header(got_kind, kind, got_stage, got_replica, got_step, expect_stage=stage,
                  expect_replica=replica, expect_step=global_step)
    if n_params > len(expected):
        raise InvalidContribution(f"blob lists {n_params} parameters, stage {stage} has "
                                  f"{len(expected)}")
    found: dict[str, SparseValues] = {}
    for _ in range(n_params):
        name = reader.name()
        if name not in expected:
            raise InvalidContribution(f"unexpected parameter {name!r} for stage {stage}")
        if name in found:
            raise InvalidContribution(f"parameter {name!r} appears twice")
        shape = reader.shape(name)
        if shape != tuple(expected[name]):
            raise InvalidContribution(f"{name}: shape {shape} does not match the model's "
                                      f"{tuple(expected[name])}")
        found[name] = read_one(reader, name, shape)
    reader.done()
    missing = [n for n in expected if n not in found]
    if missing:
        raise InvalidContribution(f"missing parameter(s): {', '.join(missing)}")
    return Contribution(stage=got_stage, replica=got_replica, global_step=got_step,
                        version=version, kind="sparse" if kind == _wire.KIND_SPARSE else "dense",
                        params={n: found[n].to(device) for n in expected}, nbytes=len(blob),
                        run_tag=got_run)


def _read_sparse(reader: _wire.Reader, name: str, shape: tuple[int, ...], *, chunk: int,
                 topk: int) -> SparseValues:
    geo = geometry(shape, chunk=chunk, topk=topk)
    block_rows, block_cols, k, shift, scale, *table = reader.unpack(_QUANT.format)
    if (block_rows, block_cols, k) != (geo.block_rows, geo.block_cols, geo.k):
        raise InvalidContribution(
            f"{name}: chunking {block_rows}x{block_cols} with k={k}, expected "
            f"{geo.block_rows}x{geo.block_cols} with k={geo.k} (sparseloco.chunk={chunk}, "
            f"sparseloco.topk={topk})")
    if not all(math.isfinite(x) for x in (shift, *table)):
        raise InvalidContribution(f"{name}: non-finite quantisation shift or table "
                                  f"(shift={shift}, table={table})")
    if not _SCALE_RANGE[0] <= scale <= _SCALE_RANGE[1]:
        raise InvalidContribution(f"{name}: scale {scale:g} outside [{MIN_SCALE:g}, {MAX_SCALE:g}]")
    table_t = torch.tensor(table, dtype=torch.float32)
    shift_t = torch.tensor(shift, dtype=torch.float32)
    levels = _dequantise(torch.arange(4), table_t, shift_t)
    if not bool(torch.isfinite(levels).all()):
        raise InvalidContribution(f"{name}: table + shift overflows fp32")
    n = geo.n_values
    local = _wire.unpack_indices12(reader.take(_wire.indices12_bytes(n), f"{name} indices"), n)
    codes = _wire.unpack_codes2(reader.take(_wire.codes2_bytes(n), f"{name} codes"), n)
    local = local.reshape(geo.n_chunks, geo.k)
    if local.size and int(local.max()) >= geo.chunk_len:
        raise InvalidContribution(f"{name}: index {int(local.max())} out of range for a chunk of "
                                  f"{geo.chunk_len} values")
    if geo.k > 1 and bool((np.diff(local, axis=1) <= 0).any()):
        raise InvalidContribution(f"{name}: indices inside a chunk are not strictly increasing "
                                  "(duplicate or unordered index)")
    local_t = torch.from_numpy(local)
    values = _dequantise(torch.from_numpy(codes), table_t, shift_t)
    return SparseValues(indices=flat_indices(local_t, geo), values=values)


def decode_contribution(blob: bytes, expected: Mapping[str, tuple[int, ...]], *, stage: int,
                        replica: int | None = None, global_step: int | None = None,
                        chunk: int = 64, topk: int = 64,
                        device: torch.device | str | None = None) -> Contribution:
    """Validate and decode a sparse contribution for `stage` whose parameters must be exactly
    `expected` (name -> shape). `replica` / `global_step`, when given, must match the header.
    The blob is checked and decoded on the host; the values are then moved to `device`.

    Raises `InvalidContribution(reason)` for anything wrong (ALGORITHMS.md section 4: version,
    parameters, chunking and k, index bounds and uniqueness, finite table and shift, scale range,
    truncation, corruption) and never any other exception for malformed bytes.
    """
    geometry((1,), chunk=chunk, topk=topk)  # a bad chunk/topk is the caller's error: ValueError

    def read_one(reader: _wire.Reader, name: str, shape: tuple[int, ...]) -> SparseValues:
        if math.prod(shape) == 0:
            raise InvalidContribution(f"{name}: empty shape {shape}")
        return _read_sparse(reader, name, shape, chunk=chunk, topk=topk)

    return read_records(bytes(blob), expected, kind=_wire.KIND_SPARSE, stage=stage,
                        replica=replica, global_step=global_step, read_one=read_one,
                        device=device)


def contribution_bytes(expected: Mapping[str, tuple[int, ...]], *, chunk: int = 64,
                       topk: int = 64) -> int:
    """Size in bytes of every valid sparse blob for a stage of `expected` (name -> shape): the
    chunking fixes how many values each tensor keeps, so the size is exact, and a larger object
    can be refused before it is read."""
    size = _wire.HEADER_BYTES + _wire.TRAILER_BYTES
    for name, shape in expected.items():
        n = geometry(tuple(shape), chunk=chunk, topk=topk).n_values
        size += (2 + len(name.encode("utf-8")) + 1 + 4 * len(shape) + _QUANT.size
                 + _wire.indices12_bytes(n) + _wire.codes2_bytes(n))
    return size


class ErrorFeedbackCodec:
    """The encoder state of one (replica, stage): its error-feedback buffers.

    `encode` updates the buffers in place and returns the blob; `reset` zeroes them (a rejoining
    stage has lost its buffer). Not thread-safe; one instance per stage-replica.
    """

    def __init__(self, *, stage: int, replica: int, beta: float = 0.95, chunk: int = 64,
                 topk: int = 64, run_tag: int = 0) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"sparseloco.beta must be in [0, 1), got {beta}")
        geometry((1,), chunk=chunk, topk=topk)
        self.stage, self.replica, self.run_tag = stage, replica, run_tag
        self.beta, self.chunk, self.topk = beta, chunk, topk
        self.error: dict[str, torch.Tensor] = {}

    def encode(self, delta: Mapping[str, torch.Tensor], *, global_step: int) -> bytes:
        blob, self.error = encode_contribution(
            delta, self.error, beta=self.beta, stage=self.stage, replica=self.replica,
            global_step=global_step, chunk=self.chunk, topk=self.topk, run_tag=self.run_tag)
        return blob

    def decode(self, blob: bytes, expected: Mapping[str, tuple[int, ...]], *,
               replica: int | None = None, global_step: int | None = None) -> Contribution:
        """Decode a peer's blob for this codec's stage with this codec's chunking."""
        return decode_contribution(blob, expected, stage=self.stage, replica=replica,
                                   global_step=global_step, chunk=self.chunk, topk=self.topk)

    def reset(self) -> None:
        self.error = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.error.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.error = {name: t.detach().to(torch.float32).clone() for name, t in state.items()}
