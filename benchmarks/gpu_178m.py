"""GPU throughput and model FLOPs utilisation of the `paper-178m` preset, against a plain loop.

Prepared for one NVIDIA H200 (bf16 dense peak 989 TFLOP/s, `--peak-tflops` to change), written to
finish in well under 8 minutes. Both sides use bf16 autocast with fp32 weights and optimiser
state, and see the same tokens per step (R*B sequences of T tokens):

- `crucible`: `crucible.train.Trainer` on `paper-178m` (R=8 replicas x S=4 stages, SparseLoCo
  sync through a local store, no faults), `--global-steps` timed outer rounds of H inner steps
  after one untimed warm-up round; evaluation and checkpoints are outside the timed loop;
- `reference`: `benchmarks.reference.ReferenceModel` (one model, one `torch.optim.AdamW` with
  `fused=True`), `--reference-steps` timed steps after `--warmup` untimed ones.

MFU = tokens/s x model FLOPs per token / peak, with model FLOPs per token = 6 N + 12 L d T
(N non-embedding parameters of one replica; the PaLM appendix-B count, causal masking ignored).
If a micro-batch does not fit, it is halved (both sides alike) and the batch actually used is
reported. Per side: peak GPU memory (`max_memory_allocated`, reset before each side) and seconds
per round by phase - for crucible the inner steps and the outer round's `encode`, `upload` (the
upload threads' time), `upload_wait` (what the round waited for), `decode`, `aggregate`,
`outer` and `other` (the rest of the sync: listing, manifests, store reads), from the timed
rounds only; for the plain loop its H steps. `target_ratio` is issue 24's 0.85. Prints one JSON
object.

    python -m benchmarks.gpu_178m [--global-steps 2] [--inner-steps 30] [--reference-steps 20]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.reference import ReferenceModel
from crucible.config import Config, apply_overrides
from crucible.events import JsonlCallback
from crucible.presets import get_preset
from crucible.store import LocalStore
from crucible.train import Trainer

log = logging.getLogger("benchmarks.gpu_178m")

H200_BF16_DENSE_TFLOPS = 989.0
TARGET_RATIO = 0.85   # issue 24: crucible at >= 0.85 of the plain loop (R = 8, S = 4, H = 30)


def flops_per_token(config: Config) -> float:
    """6 N + 12 L d T: matmul FLOPs of forward and backward per token, one replica."""
    m = config.model
    mlp_in = 2 * m.hidden if m.mlp == "swiglu" else m.hidden
    per_layer = m.d_model * 3 * m.d_model + m.d_model * m.d_model + m.d_model * mlp_in
    per_layer += m.hidden * m.d_model
    n = m.layers * per_layer + m.d_model * m.vocab_size       # blocks + LM head
    return 6.0 * n + 12.0 * m.layers * m.d_model * m.seq_len


def _config(args: argparse.Namespace, batch_size: int) -> Config:
    # a throughput measurement: the corpus may repeat (data.allow_repeat), which the preset
    # refuses for a real run
    return apply_overrides(get_preset(args.preset), {
        "train.device": _DEVICE, "train.dtype": "bf16", "train.batch_size": batch_size,
        "train.global_steps": args.global_steps + 1, "train.eval_every": 10_000,
        "train.checkpoint_every": 0, "sparseloco.inner_steps": args.inner_steps,
        "pipeline.compression": args.compression, "data.path": args.data_path,
        "data.allow_repeat": True, "train.eval_tokens": args.eval_tokens})


_DEVICE = "cuda"   # `--dry-run`: "cpu", to check this script where no GPU is


def _sync() -> None:
    if _DEVICE == "cuda":
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if _DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if _DEVICE == "cuda" else None


PHASES = ("encode", "upload", "upload_wait", "decode", "aggregate", "outer")


def crucible_tokens_per_s(config: Config, global_steps: int) -> tuple[float, dict[str, Any]]:
    """Timed outer rounds of the trainer after one warm-up round (evaluation not included);
    also the validation loss before and after the 1 + `global_steps` rounds, the peak memory
    and the timed rounds' seconds per round by phase."""
    with tempfile.TemporaryDirectory(prefix="crucible-gpu-") as tmp:
        _reset_peak()
        trainer = Trainer(config, store=LocalStore(Path(tmp) / "store"), run_key="gpu",
                          callback=JsonlCallback(Path(tmp) / "out"))
        initial = trainer.evaluate()
        trainer.global_step(0)
        _sync()
        timing0, codec0 = dict(trainer.counters.timing), dict(trainer.sync.codec_s)
        start = time.perf_counter()
        for g in range(1, global_steps + 1):
            trainer.global_step(g)
        _sync()
        elapsed = time.perf_counter() - start
        tokens = (config.replicas * config.sparseloco.inner_steps * config.train.batch_size
                  * config.model.seq_len * global_steps)
        per_round = {p: (trainer.sync.codec_s[p] - codec0[p]) / global_steps for p in PHASES}
        sync_s = (trainer.counters.timing["sync_s"] - timing0["sync_s"]) / global_steps
        per_round["other"] = sync_s - sum(v for p, v in per_round.items() if p != "upload")
        losses = {"val_loss_initial": initial, "val_loss_after": trainer.evaluate(),
                  "val_loss_stderr": trainer.last_eval_stderr,
                  "global_steps_trained": global_steps + 1,
                  "eval_tokens": trainer.eval_tokens,
                  "crucible_max_memory_gib": _peak_gib(),
                  "sync_s_per_round": sync_s,
                  "inner_s_per_round": (trainer.counters.timing["inner_s"]
                                        - timing0["inner_s"]) / global_steps,
                  "round_phases_s": per_round,
                  "round_hidden_upload_share": (1 - per_round["upload_wait"] / per_round["upload"]
                                                if per_round["upload"] else None)}
        trainer.callback.close()
    return tokens / elapsed, losses


def reference_tokens_per_s(config: Config, steps: int, warmup: int) -> tuple[float, float]:
    """The plain loop on the GPU: one model, fused AdamW, bf16 autocast, R*B sequences a step.
    Returns tokens/s and the peak memory in GiB."""
    m, t = config.model, config.train
    _reset_peak()
    torch.manual_seed(config.seed)
    model = ReferenceModel(m).to(_DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay, fused=True)
    n = config.replicas * t.batch_size
    ids = torch.randint(0, m.vocab_size, (n, m.seq_len + 1), device=_DEVICE)
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync()
            start = time.perf_counter()
        with torch.autocast(_DEVICE, dtype=torch.bfloat16):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync()
    return steps * n * m.seq_len / (time.perf_counter() - start), _peak_gib()


def _fitting(measure: Callable[[int], Any], batch_size: int) -> tuple[Any, int]:
    """measure(batch) at the largest batch <= batch_size (halving) that fits in memory."""
    while True:
        try:
            return measure(batch_size), batch_size
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if batch_size == 1:
                raise
            log.warning("batch %d does not fit; halving", batch_size)
            batch_size //= 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-steps", type=int, default=2, help="timed outer rounds")
    parser.add_argument("--inner-steps", type=int, default=30, help="H (the preset's is 30)")
    parser.add_argument("--batch-size", type=int, default=16, help="B per replica (preset: 16)")
    parser.add_argument("--compression", default="none", choices=["none", "ssn", "mapl"])
    parser.add_argument("--reference-steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--data-path", default=None, help="corpus (default: the cached one)")
    parser.add_argument("--eval-tokens", type=int, default=262_144,
                        help="held-out tokens scored before and after the timed rounds")
    parser.add_argument("--preset", default="paper-178m", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true",
                        help="check this script on the CPU with the `smoke` model (no numbers "
                             "worth recording): what a GPU run will do, minutes sooner")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    global _DEVICE
    if args.dry_run:
        _DEVICE, args.preset = "cpu", "smoke"
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.gpu_178m needs a CUDA device; none is visible (--dry-run checks "
                 "the script on the CPU)")
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    (ref, ref_memory), ref_batch = _fitting(lambda b: reference_tokens_per_s(_config(args, b),
                                                               args.reference_steps, args.warmup),
                              args.batch_size)
    if _DEVICE == "cuda":
        torch.cuda.empty_cache()
    (cru, losses), cru_batch = _fitting(
        lambda b: crucible_tokens_per_s(_config(args, b), args.global_steps), ref_batch)
    config = _config(args, cru_batch)
    fpt = flops_per_token(config)
    peak = args.peak_tflops * 1e12
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if _DEVICE == "cuda" else "cpu (dry run)",
        "preset": args.preset, "torch": torch.__version__,
        "compression": args.compression, "replicas": config.replicas,
        "stages": config.pipeline.stages, "inner_steps": args.inner_steps,
        "batch_size_crucible": cru_batch, "batch_size_reference": ref_batch,
        "seq_len": config.model.seq_len, "flops_per_token": fpt,
        "crucible_tokens_per_s": cru, "reference_tokens_per_s": ref, "ratio": cru / ref,
        "target_ratio": TARGET_RATIO, "meets_target": cru / ref >= TARGET_RATIO,
        "crucible_mfu": cru * fpt / peak, "reference_mfu": ref * fpt / peak,
        "peak_tflops": args.peak_tflops, "reference_max_memory_gib": ref_memory,
        # the plain loop's H inner steps at its own speed: the round crucible's inner steps
        # and outer round are measured against
        "reference_s_per_round": (config.replicas * ref_batch * config.model.seq_len
                                  * args.inner_steps / ref),
        "wall_s": time.perf_counter() - started, "cpu_threads": torch.get_num_threads(),
        **losses,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
