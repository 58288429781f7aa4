"""Seeded random streams. Each concern (initial weights, data order, fault schedule, shared
subspaces) has its own stream derived from the run seed, so changing one never shifts another."""
from __future__ import annotations

import hashlib

import torch

__all__ = ["mix_seed", "name_seed", "generator", "INIT_STREAM", "DATA_STREAM", "FAULT_STREAM"]

INIT_STREAM = 0x1A17
DATA_STREAM = 0xD47A
FAULT_STREAM = 0xFA17


def mix_seed(*values: int) -> int:
    """A stable 63-bit seed from several integers (splitmix64 steps)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return state & 0x7FFFFFFFFFFFFFFF


def name_seed(name: str) -> int:
    """A stable 63-bit integer for a name (BLAKE2b of its UTF-8 bytes): unlike a sum of
    character codes, two different names never share it by accident (`h0_proj` and `h3_down`
    have the same letters)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


def generator(*values: int) -> torch.Generator:
    """A CPU generator seeded by `mix_seed(*values)`."""
    return torch.Generator().manual_seed(mix_seed(*values))
