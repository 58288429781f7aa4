"""Which arithmetic this machine computes, told by what it computes rather than by its name.

Two CPUs whose names agree can round differently (a virtual machine names a Zen 1 and a later
EPYC alike "AMD EPYC"), and two that are named differently can compute the same bits. Training
is chaotic: one last-bit difference in a kernel grows into a final loss that differs by about a
seed's spread, so a study pairs a failure cell only with a baseline made by the same
arithmetic. `probe()` runs a short fixed computation through the simulator's own kernels at the
study's shapes (the pipeline's forward and backward for the uncompressed and MAPL boundaries,
gradient clipping, the fused AdamW step, the Stiefel step, the SparseLoCo quantiser) on
synthetic data from a fixed seed, and hashes every output's bytes: two machines with one
`digest` compute these kernels alike, two with different digests do not.

The module imports torch only when it probes (`digest_of` reads records without it). The
probe runs with the calling process's torch thread count and environment (the thread
count changes the order of reductions, and `MKL_CBWR`, `ATEN_CPU_CAPABILITY` and
`ONEDNN_MAX_CPU_ISA` select kernels), so a run records the digest of the arithmetic it trains
with. It takes about a second and is computed once per process (`arithmetic()`); a summary
records it under `arithmetic`, a study result under `study.arithmetic`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PROBE_VERSION = 1
# environment variables that choose kernels; recorded beside the digest
KERNEL_ENV = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
_SEED = 20261206

_cached: dict[tuple[Any, ...], dict[str, Any]] = {}


def _outputs() -> list[torch.Tensor]:
    """The probe's outputs, in a fixed order."""
    import torch

    from crucible import boundary
    from crucible.optim import ReplicaAdamW, clip_per_replica
    from crucible.pipeline import ReplicatedPipeline
    from crucible.presets import get_preset
    from crucible.sparseloco.codec import _quantise

    outputs: list[torch.Tensor] = []
    base = get_preset("study-d128")
    for compression in ("none", "mapl"):
        config = base.replace(replicas=2, seed=_SEED,
                              pipeline=replace(base.pipeline, compression=compression))
        model = ReplicatedPipeline(config)
        S, R = config.pipeline.stages, config.replicas
        optimizer = ReplicaAdamW([model.stage_params(s) for s in range(S)], model.layouts,
                                 train=config.train, replicas=R)
        generator = torch.Generator().manual_seed(_SEED)
        shape = (R, 4, config.model.seq_len + 1)
        tokens = torch.randint(config.model.vocab_size, shape, generator=generator)
        ids, targets = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()
        active = torch.ones(R, S, dtype=torch.bool)
        start = [p.detach().clone() for p in optimizer.parameters()]
        for _ in range(2):
            losses = model(ids, targets)
            losses.sum().backward()
            outputs.append(losses.detach())
            clip_per_replica([p for p in optimizer.parameters() if p.grad is not None],
                             config.train.grad_clip)
            optimizer.step(lr=config.train.lr, active=active)
            moving = [model.stage_params(s)["basis"] for s in range(S)
                      if "basis" in model.stage_params(s)]
            if moving:
                boundary.stiefel_steps([b.data for b in moving], [b.grad for b in moving],
                                       [torch.zeros_like(b) for b in moving],
                                       [active[:, 0] for _ in moving], lr=config.train.lr,
                                       beta=config.pipeline.mapl_momentum,
                                       steps=config.pipeline.mapl_ns_steps)
            model.zero_grad(set_to_none=True)
        for before, after in zip(start, optimizer.parameters(), strict=True):
            outputs.append(after.detach())
            delta = (before - after.detach()).flatten()
            outputs.extend(t for t in _quantise(delta)[:3] if isinstance(t, torch.Tensor))
    return outputs


def probe() -> dict[str, Any]:
    """Run the probe now: {digest, probe (its version), threads, torch, env (the kernel
    variables that are set)}."""
    import torch

    hasher = hashlib.sha256(f"crucible-arithmetic-v{PROBE_VERSION}".encode())
    for tensor in _outputs():
        t = tensor.detach().contiguous().cpu()
        hasher.update(str((t.dtype, tuple(t.shape))).encode())
        hasher.update(t.numpy().tobytes())
    return {"digest": "sha256:" + hasher.hexdigest()[:16], "probe": PROBE_VERSION,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ}}


def arithmetic(device: Any = None) -> dict[str, Any]:
    """`probe()`, computed once per process for its thread count and kernel environment. A run
    on another device than the CPU (`device`, a torch.device or its name) is not identified:
    the probe runs the CPU's kernels, so its digest is None and `device` names what the run
    used (its blocks then need a proof, like results made before the probe)."""
    import torch

    if device is not None and torch.device(device).type != "cpu":
        kind = torch.device(device)
        name = torch.cuda.get_device_name(kind) if kind.type == "cuda" else str(kind)
        return {"digest": None, "probe": PROBE_VERSION, "device": f"{kind} ({name})",
                "unidentified": f"the probe runs on the CPU; a run on {kind.type} is not "
                                "identified by it"}
    key = (torch.get_num_threads(), tuple(os.environ.get(k) for k in KERNEL_ENV))
    if key not in _cached:
        _cached[key] = probe()
    return dict(_cached[key])


def digest_of(summary: dict[str, Any]) -> str | None:
    """The arithmetic digest a summary or a study result records (None for one made before
    the probe existed): `study.arithmetic`, else the run's own `arithmetic.digest`."""
    study = summary.get("study")
    if isinstance(study, dict) and isinstance(study.get("arithmetic"), str):
        return study["arithmetic"]
    own = summary.get("arithmetic")
    if isinstance(own, dict) and isinstance(own.get("digest"), str):
        return own["digest"]
    return None


def main() -> None:
    """`python -m crucible.arithmetic`: print this machine's probe as JSON (one torch thread,
    as the study's runs; CRUCIBLE_TORCH_THREADS=N for N)."""
    import json
    import time

    import torch

    torch.set_num_threads(int(os.environ.get("CRUCIBLE_TORCH_THREADS", "1")))
    started = time.perf_counter()
    result = probe()
    result["seconds"] = round(time.perf_counter() - started, 3)
    print(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
