"""The SparseLoCo outer round, phase by phase, on the CPU: before and after a change, in one run.

Two measurements, each against a reference taken in the same run:

- `codec`: one stage of a transformer (`--layers` blocks of width `--d-model`: four (d, d)
  attention matrices, (4d, d) and (d, 4d) MLP matrices, two norms) at R = `--replicas`, through
  the public codec API: `encode` (error feedback, top-k, quantisation, packing:
  `encode_contributions_batched`), `upload` (R blobs into a `LocalStore` under `--out`),
  `decode` (`decode_contributions`: validation and decoding), `aggregate` (median clipping,
  selected mean) and `outer` (`OuterSGD.step`). Each side runs in its own process with one torch
  thread: this tree, and with `--before REV` the package of git revision REV (checked out under
  `--out`), alternating, `--rounds` times each; reported are the medians, the throughput of
  encode + decode in parameters per second, the ratio after / before of every phase, and
  whether the two sides made the same blobs and the same aggregate (a digest of each).
- `overlap`: `--overlap-steps` global steps of the `--overlap-preset` preset (R = `--replicas`),
  once with the uploads inline (`transfer_threads = 0`) and once on 4 threads beside the next
  stage's encoding, through a `LocalStore` and through moto's S3 server over HTTP (started
  here, as the tests do): per round, `upload` (the upload threads' time), `upload_wait` (what
  the round waited for), the share hidden (1 - wait / upload) and `sync_s`, and whether both
  runs ended with the same global weights.

    python -m benchmarks.round_phases [--before REV] [--rounds 5] [--d-model 512] [--layers 4] \
        [--replicas 8] [--only codec overlap] [--out runs/bench-round]

Prints one JSON object. Numbers are this machine's; docs/PERFORMANCE.md records a run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve()
_REPO = _HERE.parents[1]
PHASES = ("encode", "upload", "decode", "aggregate", "outer")


# -- codec: one side, in a child process ---------------------------------------------------------
def stage_shapes(d_model: int, layers: int) -> dict[str, tuple[int, ...]]:
    """A pre-norm transformer stage's parameters (no biases)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"blocks.{i}.attn.{name}"] = (d_model, d_model)
        shapes[f"blocks.{i}.mlp.w_in"] = (4 * d_model, d_model)
        shapes[f"blocks.{i}.mlp.w_out"] = (d_model, 4 * d_model)
        shapes[f"blocks.{i}.norm1"] = (d_model,)
        shapes[f"blocks.{i}.norm2"] = (d_model,)
    return shapes


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def codec_side(d_model: int, layers: int, replicas: int, out: Path) -> dict[str, Any]:
    """One timed round of every phase with the `crucible` on sys.path (one torch thread)."""
    import torch

    import crucible
    from crucible.sparseloco import OuterSGD, aggregate, decode_contributions
    from crucible.sparseloco.codec import encode_contributions_batched
    from crucible.store import LocalStore

    torch.set_num_threads(1)
    shapes = stage_shapes(d_model, layers)
    gen = torch.Generator().manual_seed(0)
    delta = {n: torch.randn((replicas, *s), generator=gen) * 1e-3 for n, s in shapes.items()}
    error = {n: torch.randn((replicas, *s), generator=gen) * 1e-2 for n, s in shapes.items()}
    theta = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    store = LocalStore(out / f"store-{uuid.uuid4().hex[:8]}")
    times: dict[str, float] = {}

    def timed(name: str, fn):
        started = time.perf_counter()
        value = fn()
        times[name] = time.perf_counter() - started
        return value

    blobs, new_error = timed("encode", lambda: encode_contributions_batched(
        delta, error, beta=0.95, stage=1, replicas=list(range(replicas)), global_step=0,
        run_tag=7))
    timed("upload", lambda: [store.put(f"r/00000000/stage-1/replica-{r}", b, durable=False)
                             for r, b in enumerate(blobs)])
    decoded = timed("decode", lambda: decode_contributions(blobs, shapes, stage=1,
                                                           global_step=0))
    update = timed("aggregate", lambda: aggregate(decoded, shapes))
    timed("outer", lambda: OuterSGD(lr=1.0).step(theta, update))
    shutil.rmtree(store.root, ignore_errors=True)
    return {"crucible": str(Path(crucible.__file__).parents[1]), "seconds": times,
            "params": replicas * sum(torch.Size(s).numel() for s in shapes.values()),
            "blobs": _digest(*blobs),
            "result": _digest(*(t.numpy().tobytes() for t in new_error.values()),
                              *(t.numpy().tobytes() for t in theta.values()))}


def _checkout(rev: str, out: Path) -> Path:
    """`rev`'s `crucible` package, extracted under `out` (once per revision; `git archive`,
    so the repository's worktrees are left alone)."""
    commit = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--verify", rev + "^{commit}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    tree = out / f"before-{commit[:12]}"
    if not (tree / "crucible" / "__init__.py").exists():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(_REPO), "archive", commit, "crucible"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _run_side(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(_HERE), "--child", "--d-model", str(args.d_model), "--layers",
         str(args.layers), "--replicas", str(args.replicas), "--out", str(args.out)],
        env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"codec side in {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def codec(args: argparse.Namespace) -> dict[str, Any]:
    trees = {"after": _REPO}
    if args.before:
        trees = {"before": _checkout(args.before, args.out), **trees}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in trees}
    for _ in range(args.rounds):  # alternate, so drift in the machine's speed hits both
        for side, tree in trees.items():
            runs[side].append(_run_side(tree, args))
    result: dict[str, Any] = {"d_model": args.d_model, "layers": args.layers,
                              "replicas": args.replicas, "rounds": args.rounds}
    for side, rs in runs.items():
        med = {p: statistics.median(r["seconds"][p] for r in rs) for p in PHASES}
        result[side] = {"crucible": rs[0]["crucible"], "params": rs[0]["params"],
                        "median_s": med, "round_s": sum(med.values()),
                        "codec_params_per_s": rs[0]["params"] / (med["encode"] + med["decode"]),
                        "blobs": sorted({r["blobs"] for r in rs}),
                        "result": sorted({r["result"] for r in rs})}
    if "before" in result:
        before, after = result["before"], result["after"]
        result["ratio_after_over_before"] = {
            p: after["median_s"][p] / before["median_s"][p] for p in PHASES}
        result["ratio_after_over_before"]["round"] = after["round_s"] / before["round_s"]
        result["same_blobs"] = before["blobs"] == after["blobs"] and len(after["blobs"]) == 1
        result["same_result"] = before["result"] == after["result"] and len(after["result"]) == 1
    return result


# -- overlap: the trainer's rounds with and without upload threads -------------------------------
def _moto(out: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    log = open(out / "moto.log", "wb")  # noqa: SIM115 - the server's, closed with it
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's S3 server did not start within 30 s")


def _rounds(args: argparse.Namespace, store, threads: int) -> dict[str, Any]:
    import torch

    from crucible.config import apply_overrides
    from crucible.events import NullCallback
    from crucible.presets import get_preset
    from crucible.train import Trainer

    config = apply_overrides(get_preset(args.overlap_preset), [
        f"replicas={args.replicas}", f"train.global_steps={args.overlap_steps}",
        "train.eval_initial=false", f"train.eval_every={10 * args.overlap_steps}"])
    trainer = Trainer(config, store=store, run_key=f"bench-{threads}", callback=NullCallback())
    trainer.sync.transfer_threads = threads
    for g in range(args.overlap_steps):
        trainer.global_step(g)
    codec_s, steps = trainer.sync.codec_s, args.overlap_steps
    weights = _digest(*(t.detach().numpy().tobytes()
                        for w in trainer.sync.global_weights for t in w.values()))
    del torch
    return {"upload_s_per_round": codec_s["upload"] / steps,
            "upload_wait_s_per_round": codec_s["upload_wait"] / steps,
            "hidden": 1 - codec_s["upload_wait"] / codec_s["upload"],
            "sync_s_per_round": trainer.counters.timing["sync_s"] / steps,
            "phases_s_per_round": {k: v / steps for k, v in codec_s.items()},
            "weights": weights}


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    import boto3
    import torch

    from crucible.store import LocalStore, open_store

    torch.set_num_threads(1)
    proc, endpoint = _moto(args.out)
    try:
        result: dict[str, Any] = {"preset": args.overlap_preset, "replicas": args.replicas,
                                  "global_steps": args.overlap_steps}
        for kind in ("local", "s3"):
            sides = {}
            for threads in (0, 4):
                if kind == "local":
                    store = LocalStore(args.out / f"overlap-{uuid.uuid4().hex[:8]}")
                else:
                    bucket = f"bench-{uuid.uuid4().hex[:12]}"
                    boto3.client("s3", endpoint_url=endpoint,
                                 region_name="us-east-1").create_bucket(Bucket=bucket)
                    store = open_store(f"s3://{bucket}", endpoint_url=endpoint,
                                       region="us-east-1")
                sides[f"threads_{threads}"] = _rounds(args, store, threads)
            sides["same_weights"] = (sides["threads_0"]["weights"]
                                     == sides["threads_4"]["weights"])
            sides["sync_ratio_threads_over_inline"] = (
                sides["threads_4"]["sync_s_per_round"] / sides["threads_0"]["sync_s_per_round"])
            result[kind] = sides
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--overlap-preset", default="small")
    parser.add_argument("--overlap-steps", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=["codec", "overlap"],
                        default=["codec", "overlap"])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-round"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(codec_side(args.d_model, args.layers, args.replicas, args.out)))
        return
    started = time.perf_counter()
    result: dict[str, Any] = {"python": sys.version.split()[0]}
    from benchmarks import provenance  # the parent only: a child's path holds one `crucible`
    result["commit"] = provenance.commit()
    if "codec" in args.only:
        result["codec"] = codec(args)
    if "overlap" in args.only:
        result["overlap"] = overlap(args)
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
