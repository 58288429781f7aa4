"""Replica-batched decoder-only transformer kernels and each stage's parameter layout.

Every trainable tensor carries a leading replica axis, (R, ...), so R replicas of a stage run
as one batched matmul instead of R small ones: simulating 8x4 stage-replicas then costs little
over the arithmetic itself. Pre-norm blocks with RMSNorm, RoPE attention (nothing positional is
added to the residual stream, which keeps subspace compression exact) and a SwiGLU or GELU MLP.

With `ssn` compression every write into the residual stream of stages 0..S-2 is reparametrised
as `W = Z @ U^T` (Z trainable, k columns), so activations stay in `span(U) + Tfix[ids]` under any
update; the last stage's blocks stay full-rank because nothing leaves it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from crucible.config import Config

__all__ = ["ParamSpec", "stage_layout", "reparametrised", "layers_of", "rms_norm", "bmm", "rope_tables",
           "block_forward", "embed_forward", "head_losses"]

_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ParamSpec:
    """One trainable tensor of a stage, per replica: its shape and how it is initialised."""
    name: str
    shape: tuple[int, ...]
    init: str               # "normal", "ones", "zeros", "stiefel"
    std: float = 0.0
    decay: bool = True      # AdamW weight decay applies (matrices, not norm gains)
    inner: str = "adamw"    # "adamw" or "stiefel" (MAPL boundary bases)


def layers_of(config: Config, stage: int) -> range:
    per_stage = config.model.layers // config.pipeline.stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def reparametrised(config: Config, stage: int) -> bool:
    return config.pipeline.compression == "ssn" and stage < config.pipeline.stages - 1


def stage_layout(config: Config, stage: int) -> list[ParamSpec]:
    """The trainable tensors of `stage` (shapes without the replica axis)."""
    m, pipe = config.model, config.pipeline
    d, V = m.d_model, m.vocab_size
    k = d // pipe.factor
    std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.layers)
    specs: list[ParamSpec] = []
    if stage == 0:
        width = k if pipe.compression == "ssn" else d
        specs.append(ParamSpec("embed", (V, width), "normal", std))
    write = k if reparametrised(config, stage) else d
    mlp_in = 2 * m.hidden if m.mlp == "swiglu" else m.hidden
    for layer in layers_of(config, stage):
        specs += [
            ParamSpec(f"h{layer}_ln1", (d,), "ones", decay=False),
            ParamSpec(f"h{layer}_qkv", (d, 3 * d), "normal", std),
            ParamSpec(f"h{layer}_proj", (d, write), "normal", out_std),
            ParamSpec(f"h{layer}_ln2", (d,), "ones", decay=False),
            ParamSpec(f"h{layer}_up", (d, mlp_in), "normal", std),
            ParamSpec(f"h{layer}_down", (m.hidden, write), "normal", out_std),
        ]
    if stage == pipe.stages - 1:
        specs += [ParamSpec("ln_f", (d,), "ones", decay=False),
                  ParamSpec("head", (d, V), "normal", std)]
    if pipe.compression == "mapl":
        specs.append(ParamSpec("anchor", (V, k), "normal", std))
        if stage < pipe.stages - 1:
            specs.append(ParamSpec("basis", (d, k), "stiefel", decay=False, inner="stiefel"))
    return specs


def rms_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """x (R, B, T, d), gain (R, d)."""
    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _NORM_EPS)
    return x * scale * gain[:, None, None, :]


def bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-replica matmul: x (R, B, T, din) @ weight (R, din, dout) -> (R, B, T, dout)."""
    R, B, T, din = x.shape
    return torch.matmul(x.reshape(R, B * T, din), weight).reshape(R, B, T, weight.shape[-1])


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (T, head_dim / 2)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float(), angles.sin().float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (N, H, T, hd): rotate interleaved-free halves (GPT-NeoX layout)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    T = x.shape[-2]
    c, s = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def _write(h: torch.Tensor, weight: torch.Tensor, subspace: torch.Tensor | None) -> torch.Tensor:
    """A residual-stream write: h @ W, or (h @ Z) @ U^T when reparametrised into span(U)."""
    out = bmm(h, weight)
    return out if subspace is None else out @ subspace.T


def block_forward(params: dict[str, torch.Tensor], layer: int, x: torch.Tensor, *,
                  config: Config, rope: tuple[torch.Tensor, torch.Tensor],
                  subspace: torch.Tensor | None) -> torch.Tensor:
    """One pre-norm transformer block on x (R, B, T, d); `subspace` is U when the block's
    residual writes are reparametrised (ssn, stages before the last), else None."""
    m = config.model
    R, B, T, d = x.shape
    heads, hd = m.heads, d // m.heads
    p = f"h{layer}_"
    qkv = bmm(rms_norm(x, params[p + "ln1"]), params[p + "qkv"])
    q, k, v = (t.reshape(R * B, T, heads, hd).transpose(1, 2) for t in qkv.split(d, dim=-1))
    q, k = _rope(q, *rope), _rope(k, *rope)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    att = att.transpose(1, 2).reshape(R, B, T, d)
    x = x + _write(att, params[p + "proj"], subspace)
    h = bmm(rms_norm(x, params[p + "ln2"]), params[p + "up"])
    if m.mlp == "swiglu":
        gate, up = h.split(m.hidden, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    return x + _write(h, params[p + "down"], subspace)


def embed_forward(params: dict[str, torch.Tensor], ids: torch.Tensor, *,
                  subspace: torch.Tensor | None, token_table: torch.Tensor | None) -> torch.Tensor:
    """Stage 0's input: ids (R, B, T) -> x (R, B, T, d). With ssn (`subspace` = U),
    x = E[ids] @ U^T + Tfix[ids]."""
    table = params["embed"]                                    # (R, V, width)
    rows = torch.arange(table.shape[0], device=ids.device)[:, None, None]
    x = table[rows, ids]                                       # (R, B, T, width)
    if subspace is not None:
        x = x @ subspace.T + token_table[ids]
    return x


def head_losses(params: dict[str, torch.Tensor], x: torch.Tensor,
                targets: torch.Tensor, *, per_sequence: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy per replica (R,), or per replica and sequence (R, B)."""
    logits = bmm(rms_norm(x, params["ln_f"]), params["head"]).float()
    R = logits.shape[0]
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                             reduction="none")
    if per_sequence:
        return losses.reshape(R, targets.shape[1], -1).mean(dim=2)
    return losses.reshape(R, -1).mean(dim=1)
