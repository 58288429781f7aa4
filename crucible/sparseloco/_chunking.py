"""Chunk geometry of SparseLoCo's top-k: how a tensor is cut into equal chunks, and back.

A tensor is viewed as 2-D (rows, cols): 1-D and 0-D tensors as one row, higher ranks with their
trailing dimensions flattened. Each dimension is cut by its largest divisor <= `chunk`, so every
chunk has the same size and a whole tensor is reshaped into (n_chunks, chunk_len) with no loop and
no padding. Chunk-local indices are row-major inside the block; they fit 12 bits because
`chunk <= 64` (a chunk holds at most 4096 values).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# 64 x 64 = 4096 local positions: the most a 12-bit index can address (the config refuses a
# larger sparseloco.chunk up front)
from crucible.config import MAX_SPARSELOCO_CHUNK as MAX_CHUNK


@dataclass(frozen=True)
class Geometry:
    """How one tensor of `shape` is chunked, and how many values each chunk keeps.

    `rows x cols` is the tensor's 2-D view; blocks are `block_rows x block_cols`; `k` values are
    kept per block.
    """

    shape: tuple[int, ...]
    rows: int
    cols: int
    block_rows: int
    block_cols: int
    k: int

    @property
    def chunk_len(self) -> int:
        return self.block_rows * self.block_cols

    @property
    def n_chunks(self) -> int:
        return (self.rows // self.block_rows) * (self.cols // self.block_cols)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def n_values(self) -> int:
        return self.n_chunks * self.k


def _largest_divisor_at_most(n: int, limit: int) -> int:
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


def kept_per_chunk(chunk_len: int, *, chunk: int, topk: int) -> int:
    """k for a chunk of `chunk_len` values: `topk` for a full `chunk x chunk` block, otherwise
    `max(2, round(chunk_len * density))` made even (the reference code's rescaling), and never
    more than the chunk holds."""
    if chunk_len == chunk * chunk:
        return min(topk, chunk_len)
    density = topk / (chunk * chunk)
    k = max(2, round(chunk_len * density))
    k += k % 2
    return min(k, chunk_len)


def view_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the 2-D view of a tensor of `shape`."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def geometry(shape: tuple[int, ...], *, chunk: int, topk: int) -> Geometry:
    """Chunk geometry of a tensor of `shape`; raises ValueError for an empty tensor or a chunk
    edge that 12-bit indices cannot address."""
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"sparseloco.chunk must be in [1, {MAX_CHUNK}] (12-bit chunk-local "
                         f"indices), got {chunk}")
    if not 1 <= topk <= chunk * chunk:
        raise ValueError(f"sparseloco.topk must be in [1, {chunk * chunk}], got {topk}")
    rows, cols = view_2d(tuple(shape))
    if rows * cols == 0:
        raise ValueError(f"cannot chunk an empty tensor of shape {tuple(shape)}")
    block_rows = 1 if len(shape) < 2 else _largest_divisor_at_most(rows, chunk)
    block_cols = _largest_divisor_at_most(cols, chunk)
    k = kept_per_chunk(block_rows * block_cols, chunk=chunk, topk=topk)
    return Geometry(tuple(shape), rows, cols, block_rows, block_cols, k)


def to_chunks(x: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """(n_chunks, chunk_len) copy of `x`, chunks in row-major block order."""
    grid_r, grid_c = geo.rows // geo.block_rows, geo.cols // geo.block_cols
    blocks = x.reshape(grid_r, geo.block_rows, grid_c, geo.block_cols).permute(0, 2, 1, 3)
    return blocks.reshape(geo.n_chunks, geo.chunk_len)


def from_chunks(chunks: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Inverse of `to_chunks`: a tensor of `geo.shape`."""
    grid_r, grid_c = geo.rows // geo.block_rows, geo.cols // geo.block_cols
    blocks = chunks.reshape(grid_r, grid_c, geo.block_rows, geo.block_cols).permute(0, 2, 1, 3)
    return blocks.reshape(geo.shape)


def flat_indices(local: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Flat (row-major, whole-tensor) indices of chunk-local indices `local` (..., n_chunks, k),
    on its device: (..., n_chunks * k). Each chunk's first flat index plus the local index's
    row and column inside the block (a shift and a mask where the block's width is a power of
    two, as 64 is)."""
    grid_c, bc = geo.cols // geo.block_cols, geo.block_cols
    chunk = torch.arange(geo.n_chunks, dtype=torch.int64, device=local.device)
    base = ((chunk // grid_c) * (geo.block_rows * geo.cols) + (chunk % grid_c) * bc)[:, None]
    if geo.block_rows == 1:       # a block is part of one row: the local index is its column
        flat = base + local
    elif bc & (bc - 1) == 0:
        flat = base + (local >> (bc.bit_length() - 1)) * geo.cols + (local & (bc - 1))
    else:
        row = torch.div(local, bc, rounding_mode="floor")
        flat = base + row * geo.cols + (local - row * bc)
    return flat.reshape(*local.shape[:-2], -1)
