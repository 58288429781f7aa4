"""Named configurations. Every preset is a function returning a fresh, validated `Config`.

All presets default to R=8 replicas and S=4 pipeline stages (so two inner stages can fail).
`smoke` runs in seconds on a CPU, `small` in a few minutes, `paper-178m` is the blog's 178M
setting (R=8, S=4, Chinchilla token budget) for a GPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from crucible.config import (
    Config,
    ConfigError,
    DataConfig,
    FaultConfig,
    ModelConfig,
    PipelineConfig,
    SparseLoCoConfig,
    TrainConfig,
)

__all__ = ["PRESETS", "PresetInfo", "get_preset", "tokens_per_global_step", "parameter_count"]


def smoke() -> Config:
    return Config(
        preset="smoke",
        model=ModelConfig(d_model=64, layers=4, heads=4, seq_len=32),
        pipeline=PipelineConfig(stages=4, factor=8),
        sparseloco=SparseLoCoConfig(inner_steps=4),
        # a toy for tests and demos: 32,768 held-out tokens (s.e. ~0.35% of the loss) keep its
        # evaluations cheap; the study preset scores the whole split
        train=TrainConfig(global_steps=10, batch_size=4, lr=5e-3, warmup_steps=8,
                          eval_every=5, eval_tokens=32_768),
        faults=FaultConfig(duration=3),
    )


def small() -> Config:
    return Config(
        preset="small",
        model=ModelConfig(d_model=128, layers=4, heads=4, seq_len=64),
        pipeline=PipelineConfig(stages=4, factor=8),
        sparseloco=SparseLoCoConfig(inner_steps=8),
        train=TrainConfig(global_steps=30, batch_size=4, lr=3e-3, warmup_steps=20,
                          eval_every=15, checkpoint_every=10),
        faults=FaultConfig(duration=6),
    )


def study() -> Config:
    # The first failure study at CPU scale (docs/RESULTS-d64.md says how it was chosen): the smoke model,
    # but H = 16 inner steps (near SparseLoCo's 15) so that every replica's pseudo-gradient
    # carries real progress and dropping a replica's tokens costs something, and 60 global steps
    # (0.98M tokens, ~0.2x a Chinchilla budget for 0.23M parameters: token-limited), decaying
    # to the schedule's floor at the end. Evaluated on the whole held-out split.
    return Config(
        preset="study",
        model=ModelConfig(d_model=64, layers=4, heads=4, seq_len=32),
        pipeline=PipelineConfig(stages=4, factor=8),
        sparseloco=SparseLoCoConfig(inner_steps=16),
        train=TrainConfig(global_steps=60, batch_size=4, lr=5e-3, warmup_steps=32,
                          eval_every=60, eval_initial=False),
        faults=FaultConfig(duration=6),
    )


def study_d128() -> Config:
    # The decided study's preset (docs/RESULTS.md, "How the preset was chosen"): the study model
    # twice as wide, so that the blog's compression factor 8 leaves 16 boundary dimensions
    # instead of 8, at a lower peak learning rate (0.002: the wider model at 0.005 trained
    # noisier); H = 16, 60 global steps (0.98M tokens, ~0.06x a Chinchilla budget for 0.85M
    # parameters: token-limited). MAPL bypasses with the `sender` decode, the MAPL paper's own
    # decode applied to a bypassed message (docs/ALGORITHMS.md).
    config = study()
    return replace(config, preset="study-d128",
                   model=replace(config.model, d_model=128),
                   pipeline=replace(config.pipeline, bypass_decode="sender"),
                   train=replace(config.train, lr=2e-3))


def paper_178m() -> Config:
    # d=960, L=16 -> 12*L*d^2 = 177M block parameters (+ 0.5M embedding/head at byte vocab).
    # Chinchilla: ~20 tokens/param = 3.55B tokens = 8 replicas x 30 inner x 16 seq x 1024 tok
    # x 904 global steps.
    return Config(
        preset="paper-178m",
        model=ModelConfig(d_model=960, layers=16, heads=15, seq_len=1024),
        pipeline=PipelineConfig(stages=4, factor=8),
        sparseloco=SparseLoCoConfig(inner_steps=30),
        train=TrainConfig(global_steps=904, batch_size=16, lr=1e-3, warmup_steps=1000,
                          eval_every=50, eval_tokens=4_194_304, checkpoint_every=50,
                          device="auto", dtype="bf16"),
        faults=FaultConfig(duration=6),
        data=DataConfig(),
    )


@dataclass(frozen=True)
class PresetInfo:
    build: Callable[[], Config]
    description: str
    expected_cpu: str


PRESETS: dict[str, PresetInfo] = {
    "smoke": PresetInfo(smoke, "tiny model for tests and demos", "~10 s"),
    "small": PresetInfo(small, "loss curves that mean something", "~3 min"),
    "study": PresetInfo(study, "the first failure study's preset (docs/RESULTS-d64.md), R=8 S=4 "
                        "H=16",
                        "~1 min"),
    "study-d128": PresetInfo(study_d128, "the decided study's preset (docs/RESULTS.md): the "
                             "study at d_model 128, lr 0.002", "~2.2 min"),
    "paper-178m": PresetInfo(paper_178m, "the blog's 178M, R=8 S=4, Chinchilla tokens (GPU)",
                             "days; use a GPU"),
}


def get_preset(name: str) -> Config:
    """The named preset's config; raises `ConfigError` listing the names for an unknown one."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name].build()


def tokens_per_global_step(config: Config) -> int:
    """Training tokens one global step consumes when no replica is down."""
    return (config.replicas * config.sparseloco.inner_steps * config.train.batch_size
            * config.model.seq_len)


def parameter_count(config: Config) -> int:
    """Approximate trainable parameters of one replica (blocks + embedding + head)."""
    m = config.model
    mlp_in = 2 * m.hidden if m.mlp == "swiglu" else m.hidden
    block = m.d_model * 3 * m.d_model + m.d_model * m.d_model + m.d_model * mlp_in
    block += m.hidden * m.d_model + 2 * m.d_model
    return m.layers * block + 2 * m.vocab_size * m.d_model + m.d_model
