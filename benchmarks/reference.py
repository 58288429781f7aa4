"""The plain reference for the simulation-efficiency benchmark: one ordinary PyTorch training loop.

Same architecture as a Crucible replica with `compression = none` (pre-norm blocks, RMSNorm,
RoPE attention, SwiGLU or GELU MLP, untied LM head, no biases), written the way a practitioner
writes it (`nn.Linear`, `nn.RMSNorm`, `nn.Embedding`), one `torch.optim.AdamW` over all of it,
gradient clipping to `train.grad_clip`, the same warm-up + cosine schedule. No replicas, no
stages, no codecs, no outer sync, no evaluation, no logging: the compute floor.

One step consumes the same tokens as one Crucible inner step: R*B sequences of T tokens, drawn
from the same corpus the trainer reads.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from crucible.config import Config, ModelConfig
from crucible.data import TokenData, load_tokens
from crucible.model import rope_tables
from crucible.optim import lr_at

__all__ = ["ReferenceModel", "ReferenceLoop", "reference_tokens_per_s"]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Block(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        d = m.d_model
        self.heads, self.mlp, self.hidden = m.heads, m.mlp, m.hidden
        self.ln1, self.ln2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 2 * m.hidden if m.mlp == "swiglu" else m.hidden, bias=False)
        self.down = nn.Linear(m.hidden, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        hd = d // self.heads
        q, k, v = (t.view(B, T, self.heads, hd).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(d, dim=-1))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        h = self.up(self.ln2(x))
        if self.mlp == "swiglu":
            gate, up = h.split(self.hidden, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.down(h)


class ReferenceModel(nn.Module):
    """A single decoder-only transformer of `config.model`'s shape; `forward` returns the mean
    next-token cross-entropy of ids/targets (N, T)."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleList(_Block(m) for _ in range(m.layers))
        self.ln_f = nn.RMSNorm(m.d_model, eps=1e-6)
        self.head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        cos, sin = rope_tables(m.seq_len, m.d_model // m.heads, m.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=m.init_std)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _optimizer(model: nn.Module, config: Config) -> torch.optim.AdamW:
    t = config.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


class ReferenceLoop:
    """The plain loop, one step at a time (so a benchmark can interleave it with other work).
    Deterministic given `config.seed`; `total_steps` sets the learning-rate schedule's length."""

    def __init__(self, config: Config, *, total_steps: int) -> None:
        torch.manual_seed(config.seed)
        self.config, self.total_steps, self.done = config, total_steps, 0
        m = config.model
        self.model = ReferenceModel(m)
        self.opt = _optimizer(self.model, config)
        self.data = TokenData(load_tokens(config.data.path, vocab_size=m.vocab_size), model=m,
                              data=config.data, replicas=config.replicas, seed=config.seed)

    @property
    def tokens_per_step(self) -> int:
        c = self.config
        return c.replicas * c.train.batch_size * c.model.seq_len

    def step(self) -> None:
        t = self.config.train
        ids, targets = self.data.batches(replicas=self.config.replicas, batch_size=t.batch_size)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.done, train=t, total_steps=self.total_steps)
        loss = self.model(ids.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise RuntimeError(f"reference loss is {float(loss)} at step {self.done}")
        self.done += 1


    @torch.no_grad()
    def evaluate(self, windows: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over held-out batches (the same (B, T) windows the trainer scores), so a
        benchmark can give the reference the evaluation work the trainer does."""
        total, count = 0.0, 0
        for ids, targets in windows:
            total += float(self.model(ids, targets)) * ids.shape[0]
            count += ids.shape[0]
        return total / max(count, 1)


def reference_tokens_per_s(config: Config, *, steps: int, warmup: int = 1) -> float:
    """Train the reference for `steps` steps of R*B sequences of T tokens (after `warmup`
    untimed steps) and return tokens per second. Deterministic given `config.seed`."""
    loop = ReferenceLoop(config, total_steps=steps + warmup)
    for _ in range(warmup):
        loop.step()
    started = time.perf_counter()
    for _ in range(steps):
        loop.step()
    return steps * loop.tokens_per_step / (time.perf_counter() - started)
