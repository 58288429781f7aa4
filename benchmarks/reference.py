"""The plain reference for the simulation-efficiency benchmark: one ordinary PyTorch training loop.

Same architecture as a Crucible replica with `compression = none` (pre-norm blocks, RMSNorm,
RoPE attention, SwiGLU or GELU MLP, untied LM head, no biases), written the way a practitioner
writes it (`nn.Linear`, `nn.RMSNorm`, `nn.Embedding`), one `torch.optim.AdamW` over all of it,
gradient clipping to `train.grad_clip`, the same warm-up + cosine schedule. No replicas, no
stages, no codecs, no outer sync, no evaluation, no logging: the compute floor.

One step consumes the same tokens as one Crucible inner step: R*B sequences of T tokens, drawn
from the same corpus the trainer reads.

`codec="mapl"` adds MAPL's boundaries to the plain model the way a practitioner would write them
(issue 38: the simulator's own overhead on a MAPL run, against a loop that does MAPL's arithmetic
too): the layers split into `pipeline.stages` stages; stage p has an anchor table E_p (an
`nn.Embedding` of width k = d / factor) and a fixed orthonormal P_p; after stage s < S-1 the
activation leaves as Z = (X - E_s[ids] P_s) A_s and enters stage s+1 as Z A_s^T + E_{s+1}[ids]
P_{s+1}; each basis A_s takes a SPEL step (the formula of docs/ALGORITHMS.md, written out) after
every AdamW step. One model, so one basis per boundary where the simulator steps R.
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

    def __init__(self, m: ModelConfig, *, mapl: tuple[int, int] | None = None) -> None:
        """`mapl=(stages, factor)`: MAPL boundaries between that many stages (module docstring)."""
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
        self.stages = 1
        self.bases = nn.ParameterList()   # MAPL's, stepped by SPEL rather than AdamW; none without
        if mapl is not None:
            self.stages, factor = mapl
            k = m.d_model // factor
            self.anchors = nn.ModuleList(nn.Embedding(m.vocab_size, k) for _ in range(self.stages))
            for table in self.anchors:
                nn.init.normal_(table.weight, std=m.init_std)
            self.bases = nn.ParameterList(nn.Parameter(_orthonormal(m.d_model, k))
                                          for _ in range(self.stages - 1))
            self.register_buffer("fixed", torch.stack([_orthonormal(m.d_model, k).T
                                                       for _ in range(self.stages)]),
                                 persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(ids)
        per_stage = len(self.blocks) // self.stages
        message = None   # what crosses the last boundary (MAPL): Z, (N, T, k)
        for s in range(self.stages):
            anchor = self.anchors[s](ids) @ self.fixed[s] if self.stages > 1 else None
            if message is not None:
                x = message @ self.bases[s - 1].T + anchor
            for block in self.blocks[s * per_stage:(s + 1) * per_stage]:
                x = block(x, cos, sin)
            if s < self.stages - 1:
                message = (x - anchor) @ self.bases[s]
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _orthonormal(rows: int, cols: int) -> torch.Tensor:
    # the plain loop's own (no code of crucible's codec): a practitioner's QR of a Gaussian
    q, _ = torch.linalg.qr(torch.randn(rows, cols))
    return q


@torch.no_grad()
def _spel_step(basis: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, *, lr: float,
               beta: float, steps: int) -> None:
    """One SPEL step of a (d, k) basis, in place: the formula of docs/ALGORITHMS.md, one line per
    term (Riemannian gradient, momentum, quintic Newton-Schulz msign, cubic Newton-Schulz
    retraction)."""
    sym = basis.T @ grad
    riemannian = grad - basis @ (0.5 * (sym + sym.T))
    momentum.mul_(beta).add_(riemannian, alpha=1 - beta)
    x = momentum / (momentum.norm() + 1e-7)
    for _ in range(steps):
        gram = x.T @ x
        x = 3.4445 * x + x @ (-4.7750 * gram + 2.0315 * gram @ gram)
    y = basis - lr * x
    for _ in range(steps):
        y = 1.5 * y - 0.5 * y @ (y.T @ y)
    basis.copy_(y)


def _optimizer(model: ReferenceModel, config: Config) -> torch.optim.AdamW:
    t = config.train
    bases = {id(p) for p in model.bases}
    trained = [p for p in model.parameters() if id(p) not in bases]
    decay = [p for p in trained if p.dim() >= 2]
    rest = [p for p in trained if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


class ReferenceLoop:
    """The plain loop, one step at a time (so a benchmark can interleave it with other work).
    Deterministic given `config.seed`; `total_steps` sets the learning-rate schedule's length."""

    def __init__(self, config: Config, *, total_steps: int, codec: str = "none") -> None:
        """`codec="mapl"`: the model with MAPL's boundaries (module docstring), at
        `config.pipeline`'s stages and factor; "none": the plain model."""
        if codec not in ("none", "mapl"):
            raise ValueError(f"codec must be 'none' or 'mapl', got {codec!r}")
        torch.manual_seed(config.seed)
        self.config, self.total_steps, self.done = config, total_steps, 0
        m, pipe = config.model, config.pipeline
        self.model = ReferenceModel(m, mapl=(pipe.stages, pipe.factor) if codec == "mapl" else None)
        self.opt = _optimizer(self.model, config)
        self.momenta = [torch.zeros_like(b) for b in self.model.bases]
        self.data = TokenData(load_tokens(config.data.path, vocab_size=m.vocab_size), model=m,
                              data=config.data, replicas=config.replicas, seed=config.seed)

    @property
    def tokens_per_step(self) -> int:
        c = self.config
        return c.replicas * c.train.batch_size * c.model.seq_len

    def step(self) -> None:
        t = self.config.train
        ids, targets = self.data.batches(replicas=self.config.replicas, batch_size=t.batch_size)
        lr = lr_at(self.done, train=t, total_steps=self.total_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss = self.model(ids.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        # AdamW's parameters only: MAPL's bases are not clipped (nor are the simulator's)
        nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]],
                                 t.grad_clip)
        self.opt.step()
        pipe = self.config.pipeline
        for basis, momentum in zip(self.model.bases, self.momenta, strict=True):
            _spel_step(basis, basis.grad, momentum, lr=lr * pipe.mapl_lr_scale,
                       beta=pipe.mapl_momentum, steps=pipe.mapl_ns_steps)
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


def reference_tokens_per_s(config: Config, *, steps: int, warmup: int = 1,
                           codec: str = "none") -> float:
    """Train the reference (`codec`: as `ReferenceLoop`'s) for `steps` steps of R*B sequences
    of T tokens (after `warmup` untimed steps) and return tokens per second. Deterministic given
    `config.seed`."""
    loop = ReferenceLoop(config, total_steps=steps + warmup, codec=codec)
    for _ in range(warmup):
        loop.step()
    started = time.perf_counter()
    for _ in range(steps):
        loop.step()
    return steps * loop.tokens_per_step / (time.perf_counter() - started)
