"""MAPL's Stiefel (SPEL) update: one batched call for every boundary against one call per
boundary, in the same process, interleaved, at a preset's shapes.

After every inner step each of the S-1 boundary bases of every replica takes a SPEL step (two
Newton-Schulz loops of `pipeline.mapl_ns_steps` iterations on (R, d, k) matrices). Issue 21
batches the boundaries into one (R (S-1), d, k) call (`crucible.boundary.stiefel_steps`); on the
CPU the result is bit-identical (tests/unit/test_alignment.py). This times both on the same
inputs, alternating, and reports the median time of each and their ratio.

    python -m benchmarks.stiefel_batch --preset study-d128 --repeats 200 --threads 1 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from crucible import boundary
from crucible.presets import get_preset


def _inputs(preset: str, seed: int = 0):
    config = get_preset(preset)
    R, S = config.replicas, config.pipeline.stages
    d = config.model.d_model
    k = d // config.pipeline.factor
    gen = torch.Generator().manual_seed(seed)
    bases = [boundary.retract(torch.linalg.qr(torch.randn(R, d, k, generator=gen))[0], 5)
             for _ in range(S - 1)]
    grads = [torch.randn(R, d, k, generator=gen) for _ in range(S - 1)]
    momenta = [0.1 * torch.randn(R, d, k, generator=gen) for _ in range(S - 1)]
    masks = [torch.ones(R, dtype=torch.bool) for _ in range(S - 1)]
    pipe = config.pipeline
    kw = {"lr": config.train.lr * pipe.mapl_lr_scale, "beta": pipe.mapl_momentum,
          "steps": pipe.mapl_ns_steps}
    return config, bases, grads, momenta, masks, kw


def measure(preset: str, repeats: int) -> dict:
    config, bases, grads, momenta, masks, kw = _inputs(preset)
    times: dict[str, list[float]] = {"per_boundary": [], "batched": []}
    for i in range(repeats + 10):
        for name in (("per_boundary", "batched") if i % 2 else ("batched", "per_boundary")):
            b = [x.clone() for x in bases]
            m = [x.clone() for x in momenta]
            started = time.perf_counter()
            if name == "batched":
                boundary.stiefel_steps(b, grads, m, masks, **kw)
            else:
                for bb, g, mm, mask in zip(b, grads, m, masks, strict=True):
                    boundary.stiefel_step(bb, g, mm, mask=mask, **kw)
            if i >= 10:                                   # the first ten warm up
                times[name].append(time.perf_counter() - started)
    per, bat = (statistics.median(times[n]) for n in ("per_boundary", "batched"))
    return {"preset": preset, "replicas": config.replicas,
            "boundaries": config.pipeline.stages - 1, "d": config.model.d_model,
            "k": config.model.d_model // config.pipeline.factor,
            "ns_steps": config.pipeline.mapl_ns_steps, "repeats": repeats,
            "per_boundary_ms": 1e3 * per, "batched_ms": 1e3 * bat, "speedup": per / bat,
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="preset(s); default small, study-d128")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(p, args.repeats) for p in (args.preset or ["small", "study-d128"])]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(f"{r['preset']}: {r['boundaries']} boundaries x R={r['replicas']} "
              f"({r['d']}x{r['k']}, {r['ns_steps']} NS steps): per boundary "
              f"{r['per_boundary_ms']:.3f} ms, batched {r['batched_ms']:.3f} ms, "
              f"x{r['speedup']:.2f}")


if __name__ == "__main__":
    main()
