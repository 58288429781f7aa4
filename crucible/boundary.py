"""Boundary codecs: what crosses between pipeline stage s and s+1 (boundary s).

- `none`: the activation X (B, T, d) itself; bf16 on the wire.
- `ssn`: one fixed orthonormal U (d x k) and one frozen token table Tfix (V x d) shared by every
  stage and replica. Send C = (X - Tfix[ids]) @ U and the ids; receive C @ U^T + Tfix[ids]. Exact,
  because every residual write lies in span(U).
- `mapl`: boundary s has its own trainable basis A_s (d x k, orthonormal columns, owned by the
  sending stage s); stage p has a trainable anchor table E_p (V x k) and a fixed orthonormal
  P_p (k x d). Send Z = (X - E_s[ids] @ P_s) @ A_s; the receiver adds its own anchor back:
  X' = Z @ A_s^T + E_{s+1}[ids] @ P_{s+1}. A_s is kept on the Stiefel manifold by `stiefel_step`
  (SPEL: Riemannian gradient, momentum, msign direction, msign retraction).

All functions take replica-batched tensors: X (R, B, T, d), ids (R, B, T), bases (R, d, k).
"""
from __future__ import annotations

import torch

from crucible.config import Config
from crucible.seeding import generator

__all__ = ["FixedTensors", "fixed_tensors", "anchor_term", "anchor_twice", "encode", "decode", "message_width", "wire_bytes",
           "Workspace", "msign", "retract", "stiefel_step", "stiefel_steps", "centred", "energy_kept", "largest_angle_deg",
           "principal_angles_deg"]

_SUBSPACE_STREAM = 0x55A5


class FixedTensors:
    """The never-trained tensors of a compression arm (shared seed, never synchronised)."""

    def __init__(self, subspace: torch.Tensor | None = None, token_table: torch.Tensor | None = None,
                 anchors_fixed: list[torch.Tensor] | None = None) -> None:
        self.subspace = subspace            # U (d, k), ssn
        self.token_table = token_table      # Tfix (V, d), ssn
        self.anchors_fixed = anchors_fixed  # P_p (k, d) per stage, mapl

    def to(self, device: torch.device) -> FixedTensors:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return FixedTensors(move(self.subspace), move(self.token_table),
                            None if self.anchors_fixed is None else [move(p) for p in self.anchors_fixed])


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))[None, :]   # unique QR: deterministic sign
    return q.float()


def fixed_tensors(config: Config) -> FixedTensors:
    """U and Tfix (ssn) or the fixed anchor projections P_p (mapl), from the shared subspace seed."""
    pipe, m = config.pipeline, config.model
    k = m.d_model // pipe.factor
    gen = generator(pipe.subspace_seed, _SUBSPACE_STREAM)
    if pipe.compression == "ssn":
        subspace = _orthonormal(m.d_model, k, gen)
        token_table = torch.randn(m.vocab_size, m.d_model, generator=gen)
        return FixedTensors(subspace=subspace, token_table=token_table)
    if pipe.compression == "mapl":
        return FixedTensors(anchors_fixed=[_orthonormal(m.d_model, k, gen).T.contiguous()
                                           for _ in range(pipe.stages)])
    return FixedTensors()


def initial_basis(config: Config, stage: int) -> torch.Tensor:
    """A_s at initialisation: QR of a Gaussian (seeded per boundary)."""
    k = config.model.d_model // config.pipeline.factor
    return _orthonormal(config.model.d_model, k, generator(config.seed, _SUBSPACE_STREAM, stage))


def _rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each replica's row index (R, 1, 1) into its anchor table (R, V, k)."""
    return torch.arange(table.shape[0], device=ids.device)[:, None, None]


def _lookup(table: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
            fixed: torch.Tensor) -> torch.Tensor:
    """E[ids] P (R, B, T, d): the one expression every anchor term is computed by."""
    return table[rows, ids] @ fixed


def _anchor(params: dict[str, torch.Tensor], ids: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    table = params["anchor"]
    return _lookup(table, _rows(table, ids), ids, fixed)


def anchor_term(params: dict[str, torch.Tensor], ids: torch.Tensor, *, stage: int,
                fixed: FixedTensors) -> torch.Tensor:
    """mapl: stage `stage`'s anchor term E_p[ids] P_p (R, B, T, d), what its decode adds back
    and its encode takes off (`anchor=` of `decode` and `encode`)."""
    assert fixed.anchors_fixed is not None
    return _anchor(params, ids, fixed.anchors_fixed[stage])


class _AnchorTwice(torch.autograd.Function):
    """E_p[ids] P_p computed once and handed out twice, to a stage's decode and to its encode,
    with the gradient two lookups of their own give the table: each use's gradient is taken
    back through its own matmul (g @ P^T) and scattered into a zero table (accumulating in index
    order) as autograd's `MmBackward` and `IndexBackward` do, and the two tables are added once,
    as autograd adds what two uses send to one tensor (an addition of two terms commutes
    exactly). So the values and every gradient are those of two separate lookups, bit for bit,
    for one lookup's forward."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,  # type: ignore[override]
                fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(rows, ids, fixed)
        ctx.table_shape = table.shape
        anchor = _lookup(table, rows, ids, fixed)
        return anchor, anchor.detach()

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        rows, ids, fixed = ctx.saved_tensors
        total = None
        for grad in grads:
            looked_up = grad.reshape(-1, grad.shape[-1]).mm(fixed.t()).view(*ids.shape, -1)
            # IndexBackward's own call: accumulate, indices known to be in range (no check)
            table = torch.ops.aten._index_put_impl_(grad.new_zeros(ctx.table_shape), (rows, ids),
                                                    looked_up, True, True)
            total = table if total is None else total + table
        return total, None, None, None


def anchor_twice(params: dict[str, torch.Tensor], ids: torch.Tensor, *, stage: int,
                 fixed: FixedTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """mapl with gradients: stage `stage`'s `anchor_term` for its decode and for its encode,
    from one lookup, with the gradients of two (`_AnchorTwice`). Not under autocast, where a
    lookup's backward also passes through autocast's casts: there each use looks up its own."""
    assert fixed.anchors_fixed is not None
    if torch.is_autocast_enabled(ids.device.type):
        return (anchor_term(params, ids, stage=stage, fixed=fixed),
                anchor_term(params, ids, stage=stage, fixed=fixed))
    table = params["anchor"]
    return _AnchorTwice.apply(table, _rows(table, ids), ids, fixed.anchors_fixed[stage])


def encode(kind: str, x: torch.Tensor, ids: torch.Tensor, *, sender: dict[str, torch.Tensor],
           stage: int, fixed: FixedTensors, anchor: torch.Tensor | None = None) -> torch.Tensor:
    """The message stage `stage` sends over boundary `stage`; mapl: `anchor` is the stage's
    `anchor_term` when the caller already has it (computed here otherwise)."""
    if kind == "none":
        return x
    if kind == "ssn":
        return (x - fixed.token_table[ids]) @ fixed.subspace
    if anchor is None:
        anchor = anchor_term(sender, ids, stage=stage, fixed=fixed)
    centred = x - anchor
    return torch.matmul(centred.flatten(1, 2), sender["basis"]).view(*x.shape[:3], -1)


def decode(kind: str, message: torch.Tensor, ids: torch.Tensor, *, receiver: dict[str, torch.Tensor],
           stage: int, basis: torch.Tensor | None, fixed: FixedTensors,
           anchor: torch.Tensor | None = None) -> torch.Tensor:
    """What stage `stage` reconstructs from a message; `basis` (R, d, k) is the mapl basis to
    decode with (the sender's, or the receiver's under the naive bypass decode), `anchor` the
    receiver's `anchor_term` when the caller already has it (computed here otherwise)."""
    if kind == "none":
        return message
    if kind == "ssn":
        return message @ fixed.subspace.T + fixed.token_table[ids]
    assert basis is not None
    if anchor is None:
        anchor = anchor_term(receiver, ids, stage=stage, fixed=fixed)
    R, B, T, k = message.shape
    x = torch.matmul(message.reshape(R, B * T, k), basis.transpose(1, 2)).view(R, B, T, -1)
    return x + anchor


def centred(x: torch.Tensor, ids: torch.Tensor, *, sender: dict[str, torch.Tensor], stage: int,
            fixed: FixedTensors) -> torch.Tensor:
    """What a MAPL basis projects at boundary `stage`: X - E_s[ids] P_s, (R, B, T, d)."""
    return x - anchor_term(sender, ids, stage=stage, fixed=fixed)


def energy_kept(centred_x: torch.Tensor, basis: torch.Tensor) -> float:
    """Share of the centred boundary activation's energy that a basis (d, k) with orthonormal
    columns keeps: ||C A||^2 / ||C||^2 (1 = lossless, k/d for isotropic C and a random A)."""
    flat = centred_x.reshape(-1, centred_x.shape[-1]).double()
    total = float(flat.pow(2).sum())
    return float((flat @ basis.double()).pow(2).sum()) / total if total > 0 else float("nan")


def principal_angles_deg(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All principal angles (degrees, ascending) between the column spaces of two (d, k)
    bases: arccos of the singular values of Qa^T Qb (float64)."""
    qa, _ = torch.linalg.qr(a.double())
    qb, _ = torch.linalg.qr(b.double())
    sigma = torch.linalg.svdvals(qa.T @ qb).clamp(min=0.0, max=1.0)
    return torch.rad2deg(torch.arccos(sigma))     # svdvals descend, so the angles ascend


def largest_angle_deg(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest principal angle (degrees) between the column spaces of two (d, k) bases."""
    return float(principal_angles_deg(a, b).max())


def message_width(config: Config) -> int:
    """Values per token that cross a boundary."""
    if config.pipeline.compression == "none":
        return config.model.d_model
    return config.model.d_model // config.pipeline.factor


def wire_bytes(config: Config) -> tuple[int, int]:
    """(forward, backward) bytes per token per boundary crossing: values at bf16, plus the token
    id forward for the compressed arms (the receiver needs it for Tfix / its anchor)."""
    width = message_width(config)
    id_bytes = 0
    if config.pipeline.compression != "none":
        V = config.model.vocab_size
        id_bytes = 1 if V <= 256 else 2 if V <= 65536 else 4
    return 2 * width + id_bytes, 2 * width


class Workspace:
    """Scratch tensors that the Stiefel step reuses from call to call, by name, instead of a
    fresh tensor per operation (a step makes a few dozen; on a CPU each fresh (R (S-1), d, k)
    tensor is fresh pages to fault in). Results never live here: the step copies them into the
    bases and momenta it updates. One per caller (a trainer, a stage).

    `work(name, like)`: a buffer of `like`'s shape *and strides*, the layout the written-out
    formula's elementwise result on `like` has (a matmul of a column-major operand rounds
    otherwise than of a contiguous one); `work(name, like, shape)`: a contiguous one, the
    layout of a matmul's result."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, like: torch.Tensor,
                 shape: tuple[int, ...] | None = None) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != like.dtype or buffer.device != like.device:
            fits = False
        elif shape is None:
            fits = buffer.shape == like.shape and buffer.stride() == like.stride()
        else:
            fits = buffer.shape == shape and buffer.is_contiguous()
        if not fits:
            buffer = torch.empty_like(like) if shape is None else like.new_empty(shape)
            self._buffers[name] = buffer
        return buffer


def _scalar(value: float, like: torch.Tensor) -> float | torch.Tensor:
    # `torch.mul(t, value, out=)` converts a Python number on every call; a 0-dim CPU tensor of
    # t's dtype is the same float (`t * value` computes in float32 for float32 t, float64 for
    # float64 t) without that. Not for a reduced dtype, whose 0-dim tensor would round the
    # number itself: there the number stays a number.
    if like.dtype in (torch.float32, torch.float64):
        return torch.tensor(value, dtype=like.dtype)
    return value


def msign(m: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximate polar factor of tall matrices m (R, d, k) by quintic Newton-Schulz iterations
    (the direction of a Stiefel step; exact orthonormality is not needed there)."""
    return _msign(m, steps, Workspace())   # a buffer of a workspace no one else holds


def _msign(m: torch.Tensor, steps: int, work: Workspace) -> torch.Tensor:
    # x <- a * x + x @ (b * gram + c * gram @ gram), gram = x^T x: the same operations in the
    # same order as that line (c * gram @ gram is (c * gram) @ gram), so the same bits, into
    # `work`'s buffers; the result is one of them
    a, b, c = 3.4445, -4.7750, 2.0315
    n, _, k = m.shape
    a_, c_ = _scalar(a, m), _scalar(c, m)
    norms = m.flatten(1).norm(dim=1)[:, None, None] + 1e-7
    x = torch.div(m, norms, out=work("msign.x", m))
    other = work("msign.other", m)
    product = work("msign.product", m, m.shape)
    gram, scaled, poly = (work(f"msign.{name}", m, (n, k, k)) for name in ("gram", "scaled", "poly"))
    for _ in range(steps):
        torch.bmm(x.transpose(1, 2), x, out=gram)
        torch.mul(gram, c_, out=scaled)
        torch.bmm(scaled, gram, out=poly)
        gram.mul_(b)
        torch.add(gram, poly, out=poly)
        torch.bmm(x, poly, out=product)
        torch.mul(x, a_, out=other)
        torch.add(other, product, out=other)
        x, other = other, x
    return x


def retract(a: torch.Tensor, steps: int) -> torch.Tensor:
    """Polar retraction onto the Stiefel manifold by cubic Newton-Schulz iterations; converges
    quadratically for the near-orthonormal inputs it gets (singular values within (0, sqrt 3))."""
    return _retract_(a.clone(), steps, Workspace())


def _retract_(x: torch.Tensor, steps: int, work: Workspace) -> torch.Tensor:
    # `retract` in place on x: x <- 1.5 * x - 0.5 * x @ (x^T x), the same operations in the same
    # order as that line (0.5 * x @ g is (0.5 * x) @ g), into `work`'s buffers
    n, _, k = x.shape
    gram = work("retract.gram", x, (n, k, k))
    half = work("retract.half", x)
    product = work("retract.product", x, x.shape)
    half_ = _scalar(0.5, x)
    for _ in range(steps):
        torch.bmm(x.transpose(1, 2), x, out=gram)
        torch.mul(x, half_, out=half)
        torch.bmm(half, gram, out=product)
        x.mul_(1.5)
        torch.sub(x, product, out=x)
    return x


@torch.no_grad()
def stiefel_step(basis: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, *, lr: float,
                 beta: float, steps: int, mask: torch.Tensor, work: Workspace | None = None) -> None:
    """One SPEL update of the replicas selected by `mask` (R,), in place on `basis` and
    `momentum`: g_R = g - A sym(A^T g); m = beta m + (1-beta) g_R; A = retract(A - lr msign(m)).
    `work`: scratch buffers to reuse across calls (fresh ones otherwise); the arithmetic is
    that formula's, operation for operation, on contiguous tensors (the batched step's always
    are; a lone boundary's column-major basis or gradient is copied first)."""
    if not bool(mask.any()):
        return
    work = work or Workspace()
    n, _, k = basis.shape
    # the matmuls round a column-major operand otherwise than a contiguous one: the step works
    # on contiguous tensors (the batched step's already are) and writes back into the caller's
    target_basis, target_momentum = basis, momentum
    basis, grad, momentum = basis.contiguous(), grad.contiguous(), momentum.contiguous()
    sym = torch.bmm(basis.transpose(1, 2), grad, out=work("step.sym", basis, (n, k, k)))
    both = torch.add(sym, sym.transpose(1, 2), out=work("step.both", basis, (n, k, k)))
    both.mul_(0.5)
    riemannian = torch.bmm(basis, both, out=work("step.riemannian", basis, basis.shape))
    torch.sub(grad, riemannian, out=riemannian)
    new_momentum = torch.mul(momentum, _scalar(beta, basis),
                             out=work("step.momentum", momentum))
    riemannian.mul_(1 - beta)
    torch.add(new_momentum, riemannian, out=new_momentum)
    direction = _msign(new_momentum, steps, work)
    direction.mul_(lr)
    new_basis = _retract_(torch.sub(basis, direction, out=direction), steps, work)
    if bool(mask.all()):   # every replica steps (no fault): nothing to select
        target_momentum.copy_(new_momentum)
        target_basis.copy_(new_basis)
        return
    keep = mask[:, None, None]
    target_momentum.copy_(torch.where(keep, new_momentum, momentum))
    target_basis.copy_(torch.where(keep, new_basis, basis))


@torch.no_grad()
def stiefel_steps(bases: list[torch.Tensor], grads: list[torch.Tensor],
                  momenta: list[torch.Tensor], masks: list[torch.Tensor], *, lr: float,
                  beta: float, steps: int, work: Workspace | None = None) -> None:
    """`stiefel_step` of several boundaries at once: their (R, d, k) bases, gradients, momenta
    and (R,) masks are stacked into one (n R, d, k) batch, so the Newton-Schulz iterations run
    as one batched matmul per iteration instead of one per boundary (every matrix is still
    normalised and iterated on its own), and the results are copied back in place. All the
    bases must have one shape. `work`: as `stiefel_step`'s."""
    if not bases:
        return
    work = work or Workspace()
    shape = (sum(b.shape[0] for b in bases), *bases[0].shape[1:])
    basis = torch.cat(bases, out=work("steps.basis", bases[0], shape))
    momentum = torch.cat(momenta, out=work("steps.momentum", bases[0], shape))
    grad = torch.cat(grads, out=work("steps.grad", bases[0], shape))
    stiefel_step(basis, grad, momentum, lr=lr, beta=beta, steps=steps, mask=torch.cat(masks),
                 work=work)
    for i, (b, m) in enumerate(zip(bases, momenta, strict=True)):
        rows = slice(i * b.shape[0], (i + 1) * b.shape[0])
        b.copy_(basis[rows])
        m.copy_(momentum[rows])
