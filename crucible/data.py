"""Training data: a token stream, a held-out validation tail, and per-replica seeded sampling.

Sources (`data.path`): None -> the cached Shakespeare corpus (`crucible.corpus`); a text file ->
its UTF-8 bytes as byte-level tokens; a folder -> its `*.bin` shards (uint16, nanoGPT layout) if
any, else its `*.txt` files in sorted order; a `.bin` file -> one shard. The last `val_fraction`
of the stream is the validation split. Each replica draws window offsets from its own generator,
seeded by (seed, replica), so the data order is the same in every arm at the same seed.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crucible.config import ConfigError, DataConfig, ModelConfig
from crucible.seeding import DATA_STREAM, generator

__all__ = ["TokenData", "load_tokens", "count_tokens", "check_token_budget",
           "check_config_budget", "token_digest"]

log = logging.getLogger(__name__)

def _sources(path: str | None) -> tuple[str, list[Path]]:
    """What `data.path` names: ("bytes", [text files]) or ("bin", [uint16 shards])."""
    if path is None:
        from crucible.corpus import default_corpus_path
        return "bytes", [default_corpus_path()]
    source = Path(path).expanduser()
    if not source.exists():
        raise ConfigError(f"data.path={path!r} does not exist; point it at a text file, a folder "
                          "of .txt files or of .bin shards, or unset it for the default corpus")
    if source.is_file():
        return ("bin" if source.suffix == ".bin" else "bytes"), [source]
    shards = sorted(source.glob("*.bin"))
    if shards:
        return "bin", shards
    texts = sorted(source.glob("*.txt"))
    if not texts:
        raise ConfigError(f"data.path={path!r} holds no *.bin shards and no *.txt files")
    return "bytes", texts


def load_tokens(path: str | None, *, vocab_size: int) -> np.ndarray:
    """Load the token stream named by `data.path` as a 1-D integer array."""
    kind, files = _sources(path)
    if kind == "bin":
        tokens = _bin_tokens(files)
    else:
        tokens = _bytes_tokens(b"\n\n".join(p.read_bytes() for p in files))
    top = int(tokens.max()) if tokens.size else 0
    if top >= vocab_size:
        raise ConfigError(f"data.path={path!r} has token id {top} >= model.vocab_size="
                          f"{vocab_size}; set model.vocab_size to at least {top + 1}")
    return tokens


def token_digest(*parts: np.ndarray) -> str:
    """'sha256:<hex>' of the token stream's content (little-endian int64 ids), given whole or as
    consecutive parts (a TokenData's train and val splits): two runs trained on the same corpus
    carry the same digest wherever the corpus lay on disk."""
    import hashlib
    digest = hashlib.sha256()
    for part in parts:
        digest.update(np.ascontiguousarray(part, dtype="<i8").tobytes())
    return "sha256:" + digest.hexdigest()


def count_tokens(path: str | None) -> int:
    """How many tokens `load_tokens` would return, from file sizes alone (no reading)."""
    kind, files = _sources(path)
    sizes = [p.stat().st_size for p in files]
    if kind == "bin":
        return sum(size // 2 for size in sizes)
    return sum(sizes) + 2 * (len(files) - 1)     # the "\n\n" between text files


def check_config_budget(config: Any) -> None:  # a crucible.config.Config (no import cycle)
    """`check_token_budget` for a config before anything runs: the training split's size comes
    from the files' sizes, the budget from the config (ConfigError as `check_token_budget`)."""
    from crucible.corpus import CorpusMissingError
    from crucible.presets import tokens_per_global_step

    try:
        total = count_tokens(config.data.path)
    except CorpusMissingError:
        return   # training reports the missing default corpus, with its fix

    n_val = max(int(total * config.data.val_fraction), config.model.seq_len + 2)
    check_token_budget(total - n_val,
                       budget=tokens_per_global_step(config) * config.train.global_steps,
                       data=config.data, preset=config.preset)


def check_token_budget(train_tokens: int, *, budget: int, data: DataConfig, preset: str) -> None:
    """Refuse a run whose token budget needs more than one pass over the training split, unless
    `data.allow_repeat` is set: a model trained on many passes of a small corpus memorises it,
    and its numbers say nothing about the model the preset is named after."""
    if budget <= train_tokens or data.allow_repeat:
        return
    source = f"data.path={data.path!r}" if data.path else "the default corpus (Shakespeare)"
    raise ConfigError(
        f"preset {preset} trains on {budget:,} tokens but {source} holds "
        f"{train_tokens:,} training tokens ({budget / train_tokens:.0f} passes). Point data.path "
        "at a folder of nanoGPT-layout .bin shards (uint16 tokens, e.g. FineWeb's) holding at "
        "least the budget, or pass --set data.allow_repeat=true to train on repeats anyway")


def _bytes_tokens(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)


def _bin_tokens(shards: list[Path]) -> np.ndarray:
    parts = []
    for shard in shards:
        if shard.stat().st_size % 2:
            raise ConfigError(f"shard {shard} has an odd byte count; .bin shards are uint16 tokens")
        parts.append(np.memmap(shard, dtype=np.uint16, mode="r").astype(np.int64))
    return np.concatenate(parts)


class TokenData:
    """Train/validation windows of `seq_len + 1` tokens, sampled per replica.

    `batch(replica=r)` draws from that replica's generator; `state_dict()` captures every
    generator so a resumed run continues the same sequence.
    """

    def __init__(self, tokens: np.ndarray, *, model: ModelConfig, data: DataConfig,
                 replicas: int, seed: int) -> None:
        self.seq_len = model.seq_len
        n_val = max(int(len(tokens) * data.val_fraction), self.seq_len + 2)
        if len(tokens) - n_val < 4 * (self.seq_len + 1):
            raise ConfigError(f"corpus of {len(tokens)} tokens is too small for model.seq_len="
                              f"{self.seq_len}; use a larger data.path or a shorter seq_len")
        self.train = torch.from_numpy(np.ascontiguousarray(tokens[:-n_val]))
        self.val = torch.from_numpy(np.ascontiguousarray(tokens[-n_val:]))
        self.generators = [generator(seed, DATA_STREAM, r) for r in range(replicas)]
        self.epoch_tokens = len(self.train)

    def batch(self, *, replica: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (B, T) int64, for one replica's next micro-batch."""
        high = len(self.train) - self.seq_len - 1
        offsets = torch.randint(0, high, (batch_size,), generator=self.generators[replica])
        return _windows(self.train, offsets, self.seq_len)

    def batches(self, *, replicas: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch per replica, stacked: (R, B, T) inputs and targets."""
        pairs = [self.batch(replica=r, batch_size=batch_size) for r in range(replicas)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def validation(self, *, tokens: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed held-out set: the same windows for every run, seed, arm and evaluation.

        Non-overlapping windows of `seq_len` predicted tokens tile the held-out split; `tokens`
        > 0 keeps that many tokens' worth of them, evenly spaced over the split (0 keeps all).
        Returned as batches of at most `batch_size` windows, each (B, T) inputs and targets."""
        available = (len(self.val) - 1) // self.seq_len
        wanted = available if tokens <= 0 else min(available, max(1, tokens // self.seq_len))
        # evenly spaced window indices: a prefix of the split would score one play, not all
        index = (torch.arange(wanted, dtype=torch.float64) * (available / wanted)).long()
        offsets = index * self.seq_len
        x, y = _windows(self.val, offsets, self.seq_len)
        return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, wanted, batch_size)]

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"generators": [g.get_state() for g in self.generators]}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        if len(state["generators"]) != len(self.generators):
            raise ValueError(f"checkpoint has {len(state['generators'])} data streams, "
                             f"run has {len(self.generators)} replicas")
        for gen, gen_state in zip(self.generators, state["generators"], strict=True):
            gen.set_state(gen_state)


def _windows(stream: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = offsets[:, None] + torch.arange(seq_len + 1)[None, :]
    window = stream[index]
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()

