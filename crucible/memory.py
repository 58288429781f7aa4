"""How much memory a run will need, from its config alone, and how much this machine has.

A run that cannot fit must be refused before it starts: the kernel's OOM killer otherwise ends it
minutes later with no message (a `train.batch_size=1000000` run grew to 22.3 GB before it was
killed). `estimate(config)` adds up what the trainer allocates (docs/OPERATIONS.md, "Memory
estimate", has the formula and a table of estimates against measured peak RSS):

    process        what this process already holds (interpreter, torch, imported modules)
    data           the token stream, int64: 8 bytes per token of data.path
    model state    R x P fp32 weights, AdamW's 2 moments, the error-feedback buffer, plus the
                   global copy (and DiLoCo's outer momentum): (4 R + 1 [+ 1]) x P x 4 bytes
    + the largest of the phases that take turns:
      training step  R x P gradients + the activations autograd keeps for one inner step
                     (R x B x T tokens, per token about L (12 d + 4 h) + 3 V + 5 d fp32 values
                     for swiglu; x 1.5 on a CPU for what glibc's heap keeps)
      outer sync     ~6 copies of the largest stage's R x P_stage pseudo-gradients (encoding)
      evaluation     one eval batch through one replica without autograd
    + checkpoint     the serialised state (4 R + 1) x P x 4 bytes, 2.25 times (buffer and copy),
                     on top: glibc's heap keeps what the phases freed, the buffers are mmapped

P is one replica's parameter count (exact, from each stage's layout), d the width, h the MLP's
hidden width, L the layers, V the vocabulary, T the sequence length, B the batch size. The
activation count follows `model.block_forward` (what each op saves for backward, measured per
op with autograd's saved-tensor hooks); attention saves O(T) per token because torch's CPU and
CUDA kernels are flash-style, not the T x T matrix.

On a CUDA device the model state, the training step and the outer sync live on the GPU (under
bf16 autocast matmul outputs take 2 bytes and autocast caches a bf16 copy of the weights,
R x P x 2 bytes; the round's codec, aggregation and outer step run there too, and take turns
with the training step) and are compared with the device's free memory; the host then holds the
process (with CUDA's runtime, started before the estimate reads the RSS), the data, the model's
construction ((R + 1) x P x 4 bytes, built on the host), and the checkpoint (one more copy, the
state brought to the host). The round's host side is only its packed blobs (under 2 bytes per
kept value, 1/64 of the values), which the estimate leaves out.

`available()` is the smallest of MemAvailable and the cgroup's remaining limit (v2 or v1, page
cache not counted). `check_fits` raises `ConfigError` with both numbers and the keys that would shrink it.

What a run compares is what it needs beyond what its process already holds (`host_bytes -
process`), so runs that share one process (the cells of an embedded sweep) never count each
other's resident memory as their own; a sibling that is training takes memory from `available()`
and GPU free memory instead, which is real while it trains. So the flows check memory only once
the run holds its GPU slot (`crucible.preflight.check_memory`), with `shared=True`: a shortfall
the machine would cover if this run were alone there (MemTotal or the cgroup limit; the GPU's
total memory) raises `MemoryBusy`, which the flows retry, and only a run that cannot fit even
alone is a `ConfigError`. On the GPU, the blocks PyTorch's allocator caches in this process
(left by an earlier run of the process) count as free: the allocator reuses them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from crucible.config import Config, ConfigError

__all__ = ["MemoryEstimate", "MemoryBusy", "estimate", "available", "total", "check_fits",
           "current_rss", "format_bytes"]

log = logging.getLogger(__name__)

_F32 = 4
_I64 = 8
_ENCODE_COPIES = 6        # delta, e, chunk view copy, |e|, residual, new error (sparseloco codec)
_CHECKPOINT_COPIES = 2.25  # BytesIO buffer (1/8 overallocation) + the framed payload
# Freed activations below glibc's mmap threshold (which rises to 32 MiB once a large block is
# freed) stay in the process's heap, fragmented: peak RSS of repeated CPU steps settles ~1.4-1.5x
# above the activations autograd saves (docs/OPERATIONS.md, Memory estimate: the B=256 row).
_HEAP_SLACK = 1.5
_CGROUP = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60      # cgroup v1 writes "no limit" as a number near 2**63


class MemoryBusy(RuntimeError):
    """The run would fit this machine alone, but not in what other runs or programs leave free
    now: worth waiting for and trying again (the flows retry it)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one run, in bytes, by part (see the module docstring). On a GPU run the
    model state, the training step, the outer sync and evaluation live on the device, the rest
    on the host."""

    process: int
    data: int
    model_state: int
    step: int
    sync: int
    evaluation: int
    checkpoint: int
    on_gpu: bool = False
    init: int = 0            # a GPU run's replicas are built on the host, then moved

    @property
    def host_phases(self) -> dict[str, int]:
        """The transient phases that take turns on the host (the largest one counts)."""
        if self.on_gpu:
            return {"model init": self.init}
        return {"outer sync": self.sync, "training step": self.step,
                "evaluation": self.evaluation}

    @property
    def phase(self) -> str:
        """The largest of `host_phases`."""
        return max(self.host_phases, key=self.host_phases.__getitem__)

    @property
    def host_bytes(self) -> int:
        """Peak host bytes (on a CPU run, the expected peak RSS). A checkpoint adds to the
        largest phase instead of taking turns with it: its buffers are large enough to be
        mmapped, while glibc's heap keeps what the phases before it freed."""
        state = 0 if self.on_gpu else self.model_state
        return (self.process + self.data + state + self.host_phases[self.phase]
                + self.checkpoint)

    @property
    def device_bytes(self) -> int:
        """Peak bytes on the GPU (0 on a CPU run)."""
        return (self.model_state + max(self.step, self.evaluation, self.sync) if self.on_gpu
                else 0)

    def describe(self) -> str:
        state = "" if self.on_gpu else f" + model state {format_bytes(self.model_state)}"
        checkpoint = f" + checkpoint {format_bytes(self.checkpoint)}" if self.checkpoint else ""
        return (f"{format_bytes(self.host_bytes)} = process {format_bytes(self.process)} + data "
                f"{format_bytes(self.data)}{state} + {self.phase} "
                f"{format_bytes(self.host_phases[self.phase])}{checkpoint}")


def format_bytes(n: int | float) -> str:
    """`n` bytes in the largest binary unit it reaches, one decimal: "1.5 GiB"."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _stage_params(config: Config) -> list[int]:
    """Parameters of one replica, per stage (from the layouts the model is built from)."""
    from math import prod

    from crucible.model import stage_layout

    return [sum(prod(spec.shape) for spec in stage_layout(config, s))
            for s in range(config.pipeline.stages)]


def _saved_bytes_per_token(config: Config, *, bf16: bool) -> int:
    """Bytes per token that one training forward saves for backward (`model.block_forward`,
    `embed_forward`, `head_losses`).

    `a` is the size of a matmul output: 4 (fp32), or 2 under bf16 autocast, where the residual
    stream, norms and the loss stay fp32 and each matmul keeps a bf16 cast of its input."""
    m = config.model
    d, h, V, a = m.d_model, m.hidden, m.vocab_size, (2 if bf16 else 4)
    # per block: each rms_norm keeps x*scale (fp32) and the matmul's input (8d fp32, 6d bf16);
    # qkv, roped q and k, the attention output (6 d matmul outputs); the residual after
    # attention and the block output (fp32); the MLP's up projection and activation (swiglu:
    # 2h up, then h gate and h product; gelu: h and h); attention's log-sum-exp (heads) and
    # the two norm scales (fp32)
    norm = 4 * d + a * d
    mlp = (4 if m.mlp == "swiglu" else 2) * h
    per_layer = 2 * norm + 6 * a * d + 2 * 4 * d + a * mlp + 4 * (m.heads + 2)
    # embedding output, final norm, logits and their fp32 log-softmax
    head = 4 * d + norm + (a + 4) * V
    return m.layers * per_layer + head


def _step_bytes_per_token(config: Config, *, bf16: bool) -> int:
    """Bytes per token at the start of backward: what the forward saved, the logits' fp32
    gradient and two d-wide gradients, and the batch's ids, targets and window indices."""
    m = config.model
    return (_saved_bytes_per_token(config, bf16=bf16) + 4 * m.vocab_size + 2 * 4 * m.d_model
            + 3 * _I64)


def _eval_bytes_per_token(config: Config) -> int:
    """Bytes per token live at once in a forward without autograd: the widest block's
    temporaries (about 4 h + 8 d values) or the logits and their log-softmax (2 V)."""
    m = config.model
    return _F32 * (2 * m.vocab_size + 4 * m.hidden + 8 * m.d_model)


def _data_bytes(config: Config) -> int:
    from crucible.corpus import CorpusMissingError
    from crucible.data import count_tokens

    try:
        return _I64 * count_tokens(config.data.path)
    except (CorpusMissingError, ConfigError):   # reported with its fix when training starts
        return 0


def estimate(config: Config, *, process_bytes: int | None = None,
             on_gpu: bool = False) -> MemoryEstimate:
    """The run's peak memory (see the module docstring). `process_bytes` is what the process
    already holds (default: this process's RSS now); `on_gpu` puts the model state, the
    training step and evaluation on the device (with bf16 autocast if `train.dtype=bf16`)."""
    R, m, t = config.replicas, config.model, config.train
    stages = _stage_params(config)
    P = sum(stages)
    bf16 = on_gpu and t.dtype == "bf16"
    copies = 4 * R + 1 + (1 if config.sparseloco.method == "diloco" else 0)
    tokens = R * t.batch_size * m.seq_len
    activations = tokens * _step_bytes_per_token(config, bf16=bf16)
    if not on_gpu:   # glibc keeps freed activation memory in its heap (see _HEAP_SLACK)
        activations = int(activations * _HEAP_SLACK)
    # gradients, activations, and under autocast the bf16 copies of the weights it caches
    step = R * P * _F32 + activations + (R * P * 2 if bf16 else 0)
    state = (4 * R + 1) * P * _F32       # what a checkpoint holds
    return MemoryEstimate(
        process=current_rss() if process_bytes is None else process_bytes,
        data=_data_bytes(config), model_state=copies * P * _F32, step=step,
        sync=_ENCODE_COPIES * R * max(stages) * _F32,
        evaluation=t.eval_batch_size * m.seq_len * _eval_bytes_per_token(config),
        # serialised into a BytesIO (grown up to 1/8 over) and framed into one more copy
        # (from a GPU the state is first copied to the host); a resume holds 2 x state
        checkpoint=int(((1 if on_gpu else 0) + _CHECKPOINT_COPIES) * state)
        if t.checkpoint_every else 0,
        on_gpu=on_gpu, init=(R + 1) * P * _F32 if on_gpu else 0)


def current_rss() -> int:
    """Resident memory of this process now, in bytes (0 where /proc is not there)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None   # "max": no limit


def _inactive_file(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room(root: Path = _CGROUP) -> int | None:
    """Bytes the cgroup may still charge (limit - usage + reclaimable page cache), or None
    without a limit. cgroup v2 first, then v1."""
    for limit_file, usage_file, stat_key, stat_dir in (
            ("memory.max", "memory.current", "inactive_file", root),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "total_inactive_file", root / "memory")):
        limit = _read_int(root / limit_file)
        usage = _read_int(root / usage_file)
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        return max(0, limit - usage + _inactive_file(stat_dir / "memory.stat", stat_key))
    return None


def _meminfo(key: str, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    return _meminfo("MemAvailable", meminfo)


def _cgroup_limit(root: Path = _CGROUP) -> int | None:
    for limit_file in ("memory.max", "memory/memory.limit_in_bytes"):
        limit = _read_int(root / limit_file)
        if limit is not None and limit < _UNLIMITED:
            return limit
    return None


def available() -> tuple[int | None, str]:
    """(bytes this process may still allocate, where the number comes from); (None, reason)
    where neither /proc/meminfo nor a cgroup limit can be read."""
    found = [(n, what) for n, what in ((_mem_available(), "MemAvailable"),
                                       (_cgroup_room(), "cgroup memory limit")) if n is not None]
    if not found:
        return None, "unknown (no /proc/meminfo, no cgroup limit)"
    return min(found)


def total() -> tuple[int | None, str]:
    """(bytes a process alone on this machine could use, where the number comes from): the
    smallest of MemTotal and the cgroup's limit; (None, reason) where neither can be read."""
    found = [(n, what) for n, what in ((_meminfo("MemTotal"), "MemTotal"),
                                       (_cgroup_limit(), "cgroup memory limit")) if n is not None]
    return min(found) if found else (None, "unknown (no /proc/meminfo, no cgroup limit)")


def _gpu_free(device: object) -> tuple[int, int]:
    """(bytes this process can still allocate on `device`, the device's total): the driver's
    free memory plus what PyTorch's allocator caches here unused (it reuses that first)."""
    import torch

    free, size = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached), int(size)


def check_fits(config: Config, *, device: object | None = None,
               shared: bool = False) -> MemoryEstimate:
    """Refuse (ConfigError) a run whose estimated peak exceeds what this machine has left:
    host memory (MemAvailable or the cgroup limit, whichever is smaller) and, for a CUDA
    `device`, the GPU's free memory. Returns the estimate otherwise.

    `shared`: other runs may be using the machine now (a flow worker): a shortfall that the
    machine's total memory (`total()`; the GPU's size) would cover raises MemoryBusy instead."""
    on_gpu = getattr(device, "type", None) == "cuda"
    # asking the GPU first starts CUDA in this process, so its host memory (the runtime and
    # its libraries, about a gigabyte) is in the process's RSS that the estimate starts from
    free, size = _gpu_free(device) if on_gpu else (0, 0)
    est = estimate(config, on_gpu=on_gpu)
    fix = ("lower train.batch_size, replicas or the model size (model.d_model, model.layers)"
           if est.phase == "training step" or on_gpu else
           "lower replicas or the model size (model.d_model, model.layers)")
    override = "or pass --skip-memory-check if you know better"
    if on_gpu:
        if est.device_bytes > free:
            _refuse(shared and est.device_bytes <= size,
                    f"not enough GPU memory: this run's estimated peak on {device} is "
                    f"{format_bytes(est.device_bytes)} (model state "
                    f"{format_bytes(est.model_state)} + training step {format_bytes(est.step)}), "
                    f"but {format_bytes(free)} is free", f"{fix}, {override}")
    room, source = available()
    needed = est.host_bytes - est.process       # what the process holds is already counted
    log.info("memory estimate: %s; %s available (%s)", est.describe(),
             "?" if room is None else format_bytes(room), source,
             extra={"memory_estimate": est})   # benchmarks.memory_estimate reads it
    if room is not None and needed > room:
        alone = total()[0] if shared else None
        _refuse(alone is not None and needed <= alone,
                f"not enough memory: this run's estimated peak is {est.describe()}, "
                f"{format_bytes(needed)} more than this process holds, but "
                f"{format_bytes(room)} is available ({source})", f"{fix}, {override}")
    return est


def _refuse(busy: bool, shortfall: str, fix: str) -> None:
    """Raise MemoryBusy when the run would fit the machine alone (`busy`), else ConfigError."""
    if busy:
        raise MemoryBusy(f"{shortfall} now; the run fits this machine alone, so it waits for "
                         "the memory other runs or programs hold and tries again")
    raise ConfigError(f"{shortfall}; {fix}")
