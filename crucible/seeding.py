"""Seeded random streams. Each concern (initial weights, data order, fault schedule, shared
subspaces) has its own stream derived from the run seed, so changing one never shifts another."""
from __future__ import annotations

import torch

__all__ = ["mix_seed", "generator", "INIT_STREAM", "DATA_STREAM", "FAULT_STREAM"]

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


def generator(*values: int) -> torch.Generator:
    """A CPU generator seeded by `mix_seed(*values)`."""
    return torch.Generator().manual_seed(mix_seed(*values))
