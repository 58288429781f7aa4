"""Benchmark of the SparseLoCo codec: encode+decode throughput and wire size per stage size.

For stages of 10M-100M parameters (matrices of 1024-multiples, as in a transformer stage) it
measures, in the same process and on the same tensors:

- `sparseloco`: error feedback + chunked top-k + 2-bit codes packed four per byte (this codec);
- `dense_fp32`: the dense baseline format (what `diloco` uploads);
- `uint8_codes`: the production trainer's layout (12-bit indices, one byte per 2-bit code),
  sized analytically (same selection, 20 bits per kept value instead of 14).

and prints one JSON document. Times are the median of `--repeats` runs; throughput is parameters
per second of encode + decode. Usage:

    .venv/bin/python benchmarks/codec.py --sizes 10e6,30e6,100e6 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch

from crucible.sparseloco import decode_contribution, decode_dense, encode_contribution, encode_dense

log = logging.getLogger("benchmarks.codec")
_HEADER_BYTES = 28 + 4  # header + CRC trailer, as in crucible/sparseloco/_wire.py


def stage_shapes(params: int, width: int = 1024) -> dict[str, tuple[int, ...]]:
    """(width, width) matrices plus one width-vector each, totalling about `params`."""
    n = max(1, round(params / (width * width + width)))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n):
        shapes[f"layers.{i}.weight"] = (width, width)
        shapes[f"layers.{i}.norm.weight"] = (width,)
    return shapes


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _uint8_layout_bytes(blob_len: int, n_values: int) -> int:
    """Same message with one byte per code: replace ceil(n/4) code bytes by n bytes."""
    return blob_len + n_values - math.ceil(n_values / 4)


def bench(params: int, repeats: int, seed: int = 0) -> dict[str, object]:
    shapes = stage_shapes(params)
    gen = torch.Generator().manual_seed(seed)
    delta = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    error = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    numel = sum(t.numel() for t in delta.values())

    def sparse_round() -> bytes:
        blob, _ = encode_contribution(delta, error, beta=0.95, stage=1, replica=0, global_step=0)
        decode_contribution(blob, shapes, stage=1)
        return blob

    def dense_round() -> bytes:
        blob = encode_dense(delta, stage=1, replica=0, global_step=0)
        decode_dense(blob, shapes, stage=1)
        return blob

    sparse_blob, dense_blob = sparse_round(), dense_round()  # warm-up, and the sizes
    n_values = decode_contribution(sparse_blob, shapes, stage=1).params
    kept = sum(p.values.numel() for p in n_values.values())
    t_sparse = _median_time(sparse_round, repeats)
    t_dense = _median_time(dense_round, repeats)
    uint8_bytes = _uint8_layout_bytes(len(sparse_blob), kept)
    return {
        "params": numel, "tensors": len(shapes), "kept_values": kept,
        "sparseloco": {"bytes": len(sparse_blob), "bits_per_param": 8 * len(sparse_blob) / numel,
                       "encode_decode_s": t_sparse, "params_per_s": numel / t_sparse},
        "dense_fp32": {"bytes": len(dense_blob), "bits_per_param": 8 * len(dense_blob) / numel,
                       "encode_decode_s": t_dense, "params_per_s": numel / t_dense},
        "uint8_codes": {"bytes": uint8_bytes, "bits_per_param": 8 * uint8_bytes / numel},
        "ratio": {"fp32_over_sparseloco_bytes": len(dense_blob) / len(sparse_blob),
                  "uint8_over_sparseloco_bytes": uint8_bytes / len(sparse_blob),
                  "sparseloco_over_dense_time": t_sparse / t_dense},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10e6,30e6,100e6",
                        help="comma-separated stage sizes in parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [bench(int(float(s)), args.repeats) for s in args.sizes.split(",")]
    print(json.dumps({"benchmark": "sparseloco_codec", "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "machine": platform.machine(),
                      "processor": platform.processor() or platform.machine(),
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
