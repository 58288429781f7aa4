"""How far honest contributions stray from their round's median norm: the evidence behind
`sparseloco.max_norm_ratio` (docs/ALGORITHMS.md, "What a dishonest peer can and cannot do").

For each finished run folder (`crucible run ... --out DIR`, the run's store kept whole:
`store.keep_rounds=0`, the default), every agreed round of every stage is loaded from the store
and, per contribution, the largest ratio of a tensor's L2 norm to that tensor's median norm in
the round is taken (`crucible.sparseloco.tensor_norm_ratios`; rounds with fewer than three
contributions have none). Prints one JSON object: per run and over all, the number of
stage-rounds measured, the largest ratio and where it was, and the 99th percentile.

    python -m benchmarks.norm_ratios runs/a runs/b ...
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from crucible.config import Config
from crucible.gather import load_agreed
from crucible.manifest import Manifest, manifest_limit
from crucible.pipeline import ReplicatedPipeline
from crucible.sparseloco import decode_contribution, decode_dense, tensor_norm_ratios
from crucible.store import open_store


def _percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))] if ordered else None


def measure(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = Config.from_dict(summary["config"])
    model = ReplicatedPipeline(config)
    shapes = [{n: tuple(t.shape[1:]) for n, t in model.stage_params(s).items()}
              for s in range(config.pipeline.stages)]
    store = open_store(summary["store_url"], endpoint_url=config.store.endpoint_url,
                       region=config.store.region)
    sl = config.sparseloco
    ratios: list[tuple[float, int, int, int, str]] = []   # ratio, step, stage, replica, tensor
    for key in store.list(f"{summary['run_key']}/"):
        if not key.endswith("/manifest.json"):
            continue
        manifest = Manifest.from_json(store.get(key, max_bytes=manifest_limit(config.replicas)))
        stage_shapes = shapes[manifest.stage]

        def decode(blob: bytes, stage_shapes=stage_shapes, stage=manifest.stage):
            if sl.method == "diloco":
                return decode_dense(blob, stage_shapes, stage=stage)
            return decode_contribution(blob, stage_shapes, stage=stage, chunk=sl.chunk,
                                       topk=sl.topk)

        agreed = dict(zip(manifest.included, load_agreed(store, manifest, decode), strict=True))
        for replica, (tensor, ratio) in tensor_norm_ratios(agreed).items():
            ratios.append((ratio, manifest.global_step, manifest.stage, replica, tensor))
    worst = max(ratios, default=None)
    return {"run": str(run_dir), "stage_rounds": len({(r[1], r[2]) for r in ratios}),
            "max_ratio": worst[0] if worst else None,
            "max_at": dict(zip(("global_step", "stage", "replica", "tensor"), worst[1:],
                               strict=True)) if worst else None,
            "p99_ratio": _percentile([r[0] for r in ratios], 0.99),
            "_ratios": [r[0] for r in ratios]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders")
    args = parser.parse_args(argv)
    runs = [measure(run) for run in args.runs]
    every = [ratio for run in runs for ratio in run.pop("_ratios")]
    print(json.dumps({"runs": runs, "stage_rounds": sum(r["stage_rounds"] for r in runs),
                      "max_ratio": max(every, default=None),
                      "p99_ratio": _percentile(every, 0.99)}, indent=2))


if __name__ == "__main__":
    main()
