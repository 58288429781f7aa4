"""Typed, validated configuration: one dataclass per component, resolved from a preset plus
`--set a.b=c` overrides.

Every dataclass validates itself in `__post_init__`, so an impossible combination can never reach
the trainer; cross-component checks (layers divisible by stages, factor dividing d_model) live in
`Config.__post_init__`. Errors are `ConfigError` (a `ValueError`) naming the key, the value and the
fix. The dotted keys (`model.d_model`, `faults.p`, ...) are a public contract shared with the CLI,
the flows and the registry.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlparse

from crucible.grid.names import BypassDecode, Compression, Strategy
from crucible.store import parse_store_url  # stdlib only: boto3 loads with the first S3Store

__all__ = [
    "ConfigError", "ModelConfig", "PipelineConfig", "SparseLoCoConfig", "TrainConfig",
    "FaultConfig", "DataConfig", "StoreConfig", "Config", "apply_overrides", "LATER_DEFAULTS",
    "without_later_defaults",
]

OuterMethod = Literal["sparseloco", "diloco", "ddp"]
Aggregate = Literal["selected_mean", "mean_over_all"]
ClipGranularity = Literal["tensor", "stage"]
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["fp32", "bf16"]
Mlp = Literal["swiglu", "gelu"]
FaultProcess = Literal["independent", "correlated", "spot", "trace"]
DownTimes = Literal["fixed", "pareto"]
# The SparseLoCo codec's largest chunk edge: chunk-local indices are 12 bits, so a chunk holds at
# most 64 x 64 = 4096 values (crucible.sparseloco._chunking reads it from here).
MAX_SPARSELOCO_CHUNK = 64


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(obj: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value > 0, f"{prefix}.{name} must be > 0, got {value!r}")


@dataclass
class ModelConfig:
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    vocab_size: int = 256          # byte-level tokens
    mlp: Mlp = "swiglu"
    mlp_ratio: float = 4.0         # hidden width = mlp_ratio * d_model (2/3 of it for swiglu)
    rope_base: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _positive(self, "model", "d_model", "layers", "heads", "seq_len", "vocab_size", "mlp_ratio")
        _require(self.d_model % self.heads == 0,
                 f"model.heads={self.heads} must divide model.d_model={self.d_model}; "
                 "pick heads from the divisors of d_model")
        _require((self.d_model // self.heads) % 2 == 0,
                 f"model.d_model/model.heads = {self.d_model // self.heads} must be even for RoPE")

    @property
    def hidden(self) -> int:
        width = self.mlp_ratio * self.d_model
        if self.mlp == "swiglu":
            width = width * 2 / 3
        return max(8, int(math.ceil(width / 8) * 8))


@dataclass
class PipelineConfig:
    stages: int = 4
    compression: Compression = "none"
    factor: int = 8                 # k = d_model / factor coordinates cross a compressed boundary
    bypass_decode: BypassDecode = "identity"
    mapl_lr_scale: float = 1.0      # Stiefel step (radians, msign direction) = scale * inner lr
    mapl_momentum: float = 0.9
    mapl_ns_steps: int = 8          # Newton-Schulz iterations of msign
    subspace_seed: int = 1234       # shared seed of U, Tfix and the fixed anchors

    def __post_init__(self) -> None:
        _require(self.stages >= 1, f"pipeline.stages must be >= 1, got {self.stages}")
        _positive(self, "pipeline", "factor", "mapl_ns_steps")
        _require(self.mapl_lr_scale >= 0, f"pipeline.mapl_lr_scale must be >= 0, got {self.mapl_lr_scale}")
        _require(0 <= self.mapl_momentum < 1,
                 f"pipeline.mapl_momentum must be in [0, 1), got {self.mapl_momentum}")


@dataclass
class SparseLoCoConfig:
    inner_steps: int = 4            # H
    method: OuterMethod = "sparseloco"
    outer_lr: float | None = None   # None: 1.0 for sparseloco, 0.6 for diloco
    outer_momentum: float = 0.9     # diloco's Nesterov momentum
    beta: float = 0.95              # error-feedback decay
    chunk: int = 64                 # top-k chunk edge (64x64 blocks, 64-element 1-D chunks)
    topk: int = 64                  # values kept per full 64x64 chunk (density 1/64)
    aggregate: Aggregate = "selected_mean"
    clip_granularity: ClipGranularity = "tensor"   # median-norm clipping per tensor (Templar)
    max_norm_ratio: float = 50.0    # reject a tensor norm above 50x the round median; 0 = off
    # distributed mode: how long a peer waits for a round's contributions before it agrees
    # without the missing ones (the simulator's gather never waits: every upload is in)
    round_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _positive(self, "sparseloco", "inner_steps", "chunk", "topk")
        _require(self.chunk <= MAX_SPARSELOCO_CHUNK,
                 f"sparseloco.chunk={self.chunk} is too large: chunk-local indices are 12 bits, "
                 f"so a chunk edge is at most {MAX_SPARSELOCO_CHUNK} ({MAX_SPARSELOCO_CHUNK}x"
                 f"{MAX_SPARSELOCO_CHUNK} = 4096 positions); use a chunk in [1, "
                 f"{MAX_SPARSELOCO_CHUNK}]")
        _require(0 <= self.beta < 1, f"sparseloco.beta must be in [0, 1), got {self.beta}")
        _require(self.topk <= self.chunk * self.chunk,
                 f"sparseloco.topk={self.topk} exceeds a chunk of {self.chunk}x{self.chunk}")
        _require(self.outer_lr is None or self.outer_lr > 0,
                 f"sparseloco.outer_lr must be > 0, got {self.outer_lr}")
        _require(0 <= self.outer_momentum < 1,
                 f"sparseloco.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        _require(self.max_norm_ratio == 0 or self.max_norm_ratio > 1,
                 f"sparseloco.max_norm_ratio must be 0 (off) or > 1 (a multiple of the round's "
                 f"median norm), got {self.max_norm_ratio}")
        _require(0 < self.round_timeout_s <= 86_400,
                 f"sparseloco.round_timeout_s must be in (0, 86400] seconds (how long a "
                 f"distributed peer waits for missing contributions), got {self.round_timeout_s}")

    @property
    def resolved_outer_lr(self) -> float:
        if self.outer_lr is not None:
            return self.outer_lr
        return 0.6 if self.method == "diloco" else 1.0

    @property
    def density(self) -> float:
        return self.topk / (self.chunk * self.chunk)


@dataclass
class TrainConfig:
    global_steps: int = 10
    batch_size: int = 4             # sequences per replica per inner step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10          # inner steps of linear warm-up
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    eval_every: int = 5             # global steps between validation evaluations
    eval_tokens: int = 0            # held-out tokens scored per evaluation; 0 = the whole split
    eval_batch_size: int = 64       # held-out windows per evaluation forward pass (64 was
                                    # the fastest on a CPU; larger batches leave the cache)
    eval_initial: bool = True       # also score the untrained model (global step 0)
    checkpoint_every: int = 0       # global steps between checkpoints; 0 = never
    keep_checkpoints: int = 2       # newest checkpoints kept (2: one to fall back on)
    device: Device = "auto"
    dtype: DType = "fp32"
    tail_average: float = 0.0       # share of the last outer steps whose global weights are
                                    # averaged and scored once at the end (tail_val_loss); 0 = off

    def __post_init__(self) -> None:
        _require(0 <= self.tail_average < 1,
                 f"train.tail_average must be in [0, 1) (a share of the outer steps, e.g. 0.1; "
                 f"0 turns it off), got {self.tail_average}")
        _positive(self, "train", "global_steps", "batch_size", "lr", "eval_every",
                  "eval_batch_size", "eps")
        _require(self.eval_tokens >= 0,
                 f"train.eval_tokens must be >= 0 (0 scores the whole held-out split), "
                 f"got {self.eval_tokens}")
        _require(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.checkpoint_every >= 0,
                 f"train.checkpoint_every must be >= 0 (0 disables), got {self.checkpoint_every}")
        _require(self.keep_checkpoints >= 1,
                 f"train.keep_checkpoints must be >= 1 (2 keeps one to fall back on if the "
                 f"newest is corrupt), got {self.keep_checkpoints}")
        _require(0 <= self.min_lr_ratio <= 1,
                 f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _require(self.grad_clip > 0, f"train.grad_clip must be > 0, got {self.grad_clip}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"train.{name} must be in [0, 1), got {value}")


@dataclass
class FaultConfig:
    """What fails and what a replica does about it (crucible.faults draws the plan).

    Every process keeps `p` the expected number of failures a replica starts per global step
    (while it is up), so processes compare at one failure rate: `independent` (the blog's: each
    replica on its own), `correlated` (an outage takes one stage down in `group` replicas at
    once), `spot` (reclaim waves take a `wave` fraction of the replicas, each at one of its
    stages, announced `notice` global steps ahead) and `trace` (the failures of a recorded CSV,
    `trace`; p = 0 still means none). Down times are `duration` steps, or heavy-tailed
    (`down_times = "pareto"`, shape `tail`, mean about `duration`).
    """
    p: float = 0.0                  # failure probability per replica per global step
    duration: int = 6               # global steps a failed stage stays down (the mean, if pareto)
    strategy: Strategy = "skip"
    process: FaultProcess = "independent"
    group: int = 2                  # correlated: replicas one outage takes down together
    wave: float = 0.5               # spot: fraction of the replicas a reclaim wave takes
    notice: int = 0                 # spot: global steps between a wave's notice and the reclaim
    down_times: DownTimes = "fixed"
    tail: float = 1.5               # pareto shape (> 1: a finite mean); smaller is heavier
    trace: str | None = None        # trace: CSV of replica,stage,start,end (end exclusive)

    def __post_init__(self) -> None:
        _require(isinstance(self.p, (int, float)) and 0.0 <= self.p <= 1.0,
                 f"faults.p must be a probability in [0, 1], got {self.p!r}")
        _require(self.duration >= 1, f"faults.duration must be >= 1 global step, got {self.duration}")
        _require(self.group >= 2, f"faults.group must be >= 2 replicas (one outage takes down "
                                  f"several at once; use faults.process=independent for one), "
                                  f"got {self.group}")
        _require(0 < self.wave <= 1, f"faults.wave must be a fraction of the replicas in (0, 1], "
                                     f"got {self.wave}")
        _require(self.notice >= 0, f"faults.notice must be >= 0 global steps, got {self.notice}")
        _require(self.tail > 1, f"faults.tail must be > 1 (a pareto shape <= 1 has no mean down "
                                f"time); try 1.5, got {self.tail}")
        if self.process == "trace":
            _require(bool(self.trace), "faults.process=trace needs faults.trace=PATH, a CSV with "
                                       "the header replica,stage,start,end")
        else:
            _require(self.trace is None,
                     f"faults.trace={self.trace!r} is read only by faults.process=trace "
                     f"(now {self.process!r}); set faults.process=trace or unset faults.trace")


@dataclass
class DataConfig:
    path: str | None = None         # None: the bundled Shakespeare corpus
    val_fraction: float = 0.05      # tail of the token stream held out for validation
    allow_repeat: bool = False      # permit a token budget larger than the training split

    def __post_init__(self) -> None:
        _require(0 < self.val_fraction < 0.5,
                 f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")


@dataclass
class StoreConfig:
    url: str | None = None          # None: file://<out>/store ; or s3://bucket/prefix
    endpoint_url: str | None = None
    region: str | None = None
    keep_rounds: int = 0            # rounds of contributions and manifests kept; 0 = all

    def __post_init__(self) -> None:
        if self.url is not None:
            try:
                parse_store_url(self.url)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.endpoint_url is not None:
            endpoint = urlparse(self.endpoint_url)
            _require(endpoint.scheme in ("http", "https") and bool(endpoint.hostname),
                     f"store.endpoint_url={self.endpoint_url!r} is not an http(s) URL; give the "
                     "S3 endpoint's address, e.g. http://127.0.0.1:9000 (MinIO) or "
                     "https://<account>.r2.cloudflarestorage.com, or unset it for AWS")
        _require(self.keep_rounds >= 0,
                 f"store.keep_rounds must be >= 0 (0 keeps every round), got {self.keep_rounds}")


@dataclass
class Config:
    preset: str = "custom"
    seed: int = 0
    replicas: int = 8
    model: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sparseloco: SparseLoCoConfig = field(default_factory=SparseLoCoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    data: DataConfig = field(default_factory=DataConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    def __post_init__(self) -> None:
        _require(self.replicas >= 1, f"replicas must be >= 1, got {self.replicas}")
        _require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        # contribution headers carry the global step in 32 bits; drop_extend may run up to
        # global_steps * (duration + 1) + duration steps (crucible.train.Trainer._max_steps)
        steps, duration = self.train.global_steps, self.faults.duration
        longest = steps * (duration + 1) + duration if self.faults.strategy == "drop_extend" \
            else steps
        _require(longest < 2**32, f"train.global_steps={steps} can run {longest} global steps, "
                                  f"more than a contribution header's 32-bit step holds; lower "
                                  f"train.global_steps (or faults.duration with drop_extend)")
        layers, stages = self.model.layers, self.pipeline.stages
        _require(layers % stages == 0,
                 f"pipeline.stages={stages} must divide model.layers={layers}; "
                 f"use a multiple of {stages} layers or a divisor of {layers} stages")
        d, factor = self.model.d_model, self.pipeline.factor
        if self.pipeline.compression != "none":
            _require(d % factor == 0,
                     f"pipeline.factor={factor} must divide model.d_model={d}; "
                     f"pick a divisor of {d}")
            _require(d // factor >= 2, f"pipeline.factor={factor} leaves k < 2 for d_model={d}")
        if self.faults.p > 0:
            _require(stages >= 3,
                     f"faults.p={self.faults.p} needs inner stages to fail, but pipeline.stages="
                     f"{stages}; use pipeline.stages >= 3 or faults.p=0")
        if self.faults.process == "correlated":
            _require(self.faults.group <= self.replicas,
                     f"faults.group={self.faults.group} exceeds replicas={self.replicas}; an "
                     f"outage takes down at most every replica")

    def identity(self) -> dict[str, Any]:
        """`to_dict` without the keys added after runs were recorded (`LATER_DEFAULTS`) where
        they hold their default: a run recorded before a key existed and one run today with the
        key at its default are the same computation (fingerprints, study adoption)."""
        return without_later_defaults(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return _build(cls, data, prefix="")

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


# Keys added after runs were recorded, with the value that reproduces those runs. A key at this
# value is left out of a run's identity, so no earlier run is re-identified by the addition.
LATER_DEFAULTS: dict[str, Any] = {
    "faults.process": "independent", "faults.group": 2, "faults.wave": 0.5, "faults.notice": 0,
    "faults.down_times": "fixed", "faults.tail": 1.5, "faults.trace": None,
    "train.tail_average": 0.0,
}


def without_later_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict (`Config.to_dict`, or a recorded run's) without the `LATER_DEFAULTS` keys
    that hold their default; other keys as they are (a new dict, the input unchanged)."""
    out = json.loads(json.dumps(data))
    for key, default in LATER_DEFAULTS.items():
        section, leaf = key.split(".")
        node = out.get(section)
        if isinstance(node, dict) and leaf in node and node[leaf] == default:
            del node[leaf]
    return out


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    # the config classes' annotations never change; resolving them is most of a from_dict
    return typing.get_type_hints(cls)


def _allowed(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    args = [a for a in get_args(tp) if a is not type(None)]
    if args:
        return " or ".join(getattr(a, "__name__", str(a)) for a in args) + " or null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Turn `value` (possibly a string from the command line) into `tp`, or raise ConfigError."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not allowed; allowed values: {_allowed(tp)}")
        return value
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(key, inner[0], value)
    try:
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if tp is float:
            result = float(value)
            if not math.isfinite(result):
                raise ValueError(value)
            return result
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is not a valid {_allowed(tp)}") from None
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            raise ConfigError(f"unknown key {prefix + str(key)!r}; "
                              f"{_did_you_mean(prefix + str(key), [prefix + k for k in hints])}"
                              f"allowed keys: {', '.join(prefix + k for k in hints)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(prefix + key, tp, value)
    return cls(**kwargs)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key that `--set` can reach."""
    keys: list[str] = []
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, prefix=f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys


def _did_you_mean(key: str, allowed: list[str]) -> str:
    """'did you mean X? ' for the allowed dotted key nearest to `key` (a misspelled section,
    leaf or both), or '' when none is close."""
    import difflib

    nearest = difflib.get_close_matches(key, allowed, n=1)
    return f"did you mean {nearest[0]}? " if nearest else ""


def apply_overrides(config: Config, overrides: list[str] | dict[str, Any]) -> Config:
    """Return a new, validated config with `key.path=value` overrides applied.

    Raises `ConfigError` for an unknown key (listing the allowed keys), a malformed override,
    a value of the wrong type or an impossible combination.
    """
    if isinstance(overrides, dict):
        pairs = list(overrides.items())
    else:
        pairs = []
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key.path=value")
            key, value = item.split("=", 1)
            pairs.append((key.strip(), value.strip()))
    data = config.to_dict()
    allowed = all_keys()
    for key, value in pairs:
        if key not in allowed:
            raise ConfigError(f"unknown key {key!r}; {_did_you_mean(key, allowed)}"
                              f"allowed keys: {', '.join(allowed)}")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    return Config.from_dict(data)
