"""Instrument checks: per-name initial weights, the fixed held-out evaluation and its standard
error, median-norm clipping per tensor or per stage, drop_extend's learning-rate clock and the
token-budget refusal.

Every expectation is derived here (hand computations, the documented formulas, independent
re-slicing of the corpus), never copied from a run of the code under test."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import crucible.train as train_module
from crucible.config import ConfigError, DataConfig, apply_overrides
from crucible.data import TokenData, check_token_budget, load_tokens
from crucible.model import stage_layout
from crucible.pipeline import initial_tensor
from crucible.presets import PRESETS, get_preset, tokens_per_global_step
from crucible.sparseloco import Contribution, SparseValues, aggregate, clip_scales
from crucible.sparseloco.aggregate import tensor_clip_scales
from crucible.store import LocalStore
from crucible.train import Trainer, train
from tests.unit.helpers import tiny

CLI = [sys.executable, "-c", "from cli.main import main; main()"]
PREFIX = 16   # values of row 0 compared between tensors


class _Quiet:
    """A callback that records nothing."""

    def metric(self, item) -> None:
        pass

    def event(self, item) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _trainer(tmp_path: Path, cfg, key: str = "t") -> Trainer:
    return Trainer(cfg, store=LocalStore(tmp_path / f"store-{key}"), run_key=key, callback=_Quiet())


# ------------------------------------------------------------------------------------------------
# 1. initial weights: one stream per (seed, stage, full tensor name)
# ------------------------------------------------------------------------------------------------

def _row0(config, spec, stage: int) -> torch.Tensor:
    """Row 0 of a "normal" tensor, divided by its std: the raw N(0, 1) draws, so that two tensors
    drawn from the same stream compare equal whatever their init std."""
    value = initial_tensor(config, spec, stage=stage)
    row = value.reshape(value.shape[0], -1)[0] if value.dim() >= 2 else value.reshape(-1)
    return (row.double() / spec.std).clone()


def _normal_rows(config) -> dict[tuple[int, str], torch.Tensor]:
    rows = {}
    for s in range(config.pipeline.stages):
        for spec in stage_layout(config, s):
            if spec.init == "normal":
                rows[(s, spec.name)] = _row0(config, spec, s)
    return rows


def _shared_starts(rows: dict[tuple[int, str], torch.Tensor]) -> list[tuple]:
    """Pairs (a, b, offset) where the first PREFIX values of a's row 0 occur in b's row 0 at
    `offset` (offset 0: both start the same; another offset: a's stream is b's, shifted)."""
    found = []
    for a, row_a in rows.items():
        head = row_a[:PREFIX]
        for b, row_b in rows.items():
            if a == b or row_b.numel() < PREFIX:
                continue
            tol = 1e-5 * max(1.0, abs(float(head[0])))
            starts = torch.nonzero((row_b[: row_b.numel() - PREFIX + 1] - head[0]).abs() <= tol)
            for j in starts.reshape(-1).tolist():
                if torch.allclose(row_b[j:j + PREFIX], head, rtol=1e-5, atol=1e-6):
                    found.append((a, b, j))
    return found


@pytest.mark.parametrize("preset", list(PRESETS))
def test_no_two_normal_tensors_of_a_preset_share_a_starting_row(preset):
    config = get_preset(preset)
    rows = _normal_rows(config)
    # every stage contributes normal tensors (the real layout of every stage was walked)
    assert {s for s, _ in rows} == set(range(config.pipeline.stages))
    assert len(rows) >= 2 * config.model.layers   # qkv, proj, up, down per layer at least
    assert all(r.numel() >= PREFIX for r in rows.values())
    assert _shared_starts(rows) == []


def test_mapl_anchors_of_different_stages_start_differently():
    # "anchor" has the same name on every stage: the stage index must still separate the streams
    config = apply_overrides(get_preset("smoke"), {"pipeline.compression": "mapl"})
    rows = _normal_rows(config)
    assert sum(name == "anchor" for _, name in rows) == config.pipeline.stages
    assert _shared_starts(rows) == []


def test_the_old_colliding_names_now_start_differently():
    config = tiny(**{"model.layers": 16, "pipeline.stages": 4})
    names = [spec.name for spec in stage_layout(config, 0)]
    assert "h0_proj" in names and "h3_down" in names  # 4 layers per stage: h0..h3 in stage 0
    # why they collided before: same letters (same sum of codes) and the same length
    assert sum(map(ord, "h0_proj")) == sum(map(ord, "h3_down"))
    assert len("h0_proj") == len("h3_down")
    specs = {spec.name: spec for spec in stage_layout(config, 0)}
    proj = initial_tensor(config, specs["h0_proj"], stage=0)
    down = initial_tensor(config, specs["h3_down"], stage=0)
    assert specs["h0_proj"].std == specs["h3_down"].std   # same std: equal draws = equal values
    n = min(proj.numel(), down.numel())
    flat_p, flat_d = proj.reshape(-1)[:n], down.reshape(-1)[:n]
    assert not torch.allclose(flat_p[:PREFIX], flat_d[:PREFIX])
    assert not torch.allclose(proj[0], down[0])
    # independent draws: essentially no coordinate agrees
    assert int((flat_p == flat_d).sum()) <= 1


def test_initial_tensors_are_deterministic_and_depend_on_the_seed():
    config = tiny(**{"model.layers": 16, "pipeline.stages": 4})
    other = tiny(**{"model.layers": 16, "pipeline.stages": 4, "seed": 1})
    checked = 0
    for s in range(config.pipeline.stages):
        for spec in stage_layout(config, s):
            first = initial_tensor(config, spec, stage=s)
            again = initial_tensor(config, spec, stage=s)
            assert torch.equal(first, again), (s, spec.name)
            if spec.init == "normal":
                reseeded = initial_tensor(other, spec, stage=s)
                assert first.shape == reseeded.shape
                assert not torch.allclose(first, reseeded), (s, spec.name)
                # the std is the spec's (sample std of the draws within 20% of it)
                assert abs(float(first.std()) / spec.std - 1) < 0.2, (s, spec.name)
                checked += 1
    assert checked >= 4 * 16


# ------------------------------------------------------------------------------------------------
# 2. evaluation: fixed non-overlapping held-out windows, standard error, eval_initial
# ------------------------------------------------------------------------------------------------

SEQ = 16  # tiny()'s model.seq_len


@pytest.fixture()
def corpus(tmp_path) -> Path:
    """A small text corpus of random letters (no repeated 16-grams in practice)."""
    rng = np.random.default_rng(1234)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ,.\n", dtype=np.uint8)
    path = tmp_path / "corpus.txt"
    path.write_bytes(letters[rng.integers(0, len(letters), 48_000)].tobytes())
    return path


def _held_out(path: Path, val_fraction: float = 0.05) -> torch.Tensor:
    """The held-out split as documented: the last val_fraction of the byte stream (at least
    seq_len + 2 tokens)."""
    raw = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
    n_val = max(int(len(raw) * val_fraction), SEQ + 2)
    return torch.from_numpy(raw[-n_val:].copy())


def _cfg(corpus: Path, **overrides):
    base = {"data.path": str(corpus), "train.eval_initial": False, "train.eval_every": 100}
    base.update(overrides)
    return tiny(**base)


def _window_offsets(batches, val: torch.Tensor) -> list[int]:
    """Where each validation window starts in the held-out split (checked to be a tile, its
    targets the inputs shifted by one)."""
    available = (len(val) - 1) // SEQ
    tiles = val[: available * SEQ].view(available, SEQ)
    offsets = []
    for x, y in batches:
        assert x.shape == y.shape and x.shape[1] == SEQ
        for row_x, row_y in zip(x, y, strict=True):
            match = torch.nonzero((tiles == row_x).all(dim=1)).reshape(-1).tolist()
            assert len(match) == 1, "every window is exactly one tile of the held-out split"
            o = match[0] * SEQ
            assert torch.equal(row_y, val[o + 1:o + SEQ + 1])
            offsets.append(o)
    return offsets


def test_validation_with_eval_tokens_0_tiles_the_whole_held_out_split(corpus):
    val = _held_out(corpus)
    data = TokenData(load_tokens(str(corpus), vocab_size=256), model=tiny().model,
                     data=DataConfig(path=str(corpus)), replicas=2, seed=0)
    batches = data.validation(tokens=0, batch_size=7)
    available = (len(val) - 1) // SEQ
    assert available > 50
    # batches of at most 7, all full but the last
    sizes = [x.shape[0] for x, _ in batches]
    assert all(n == 7 for n in sizes[:-1]) and 1 <= sizes[-1] <= 7
    offsets = _window_offsets(batches, val)
    assert offsets == [i * SEQ for i in range(available)]
    # the inputs, concatenated, are the split itself (no overlap, no gap)
    inputs = torch.cat([x for x, _ in batches]).reshape(-1)
    assert torch.equal(inputs, val[: available * SEQ])


@pytest.mark.parametrize("tokens", [SEQ * 10, SEQ * 10 + 5, SEQ * 33])
def test_validation_with_a_token_count_keeps_evenly_spaced_windows(corpus, tokens):
    val = _held_out(corpus)
    data = TokenData(load_tokens(str(corpus), vocab_size=256), model=tiny().model,
                     data=DataConfig(path=str(corpus)), replicas=2, seed=0)
    available = (len(val) - 1) // SEQ
    wanted = tokens // SEQ
    assert wanted < available
    index = [o // SEQ for o in _window_offsets(data.validation(tokens=tokens, batch_size=64), val)]
    assert len(index) == wanted
    assert index[0] == 0
    spacing = available / wanted
    gaps = np.diff(index)
    assert gaps.min() >= math.floor(spacing) and gaps.max() <= math.ceil(spacing)
    assert index[-1] >= available - spacing - 1   # they reach the end of the split


def test_validation_windows_do_not_depend_on_seed_or_compression(tmp_path, corpus):
    a = _trainer(tmp_path, _cfg(corpus, seed=0, **{"pipeline.compression": "none"}), "a")
    b = _trainer(tmp_path, _cfg(corpus, seed=7, **{"pipeline.compression": "mapl"}), "b")
    assert len(a.validation) == len(b.validation) > 0
    for (xa, ya), (xb, yb) in zip(a.validation, b.validation, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # the training streams do depend on the seed (the two runs are not the same run)
    xa, _ = a.data.batch(replica=0, batch_size=4)
    xb, _ = b.data.batch(replica=0, batch_size=4)
    assert not torch.equal(xa, xb)


def test_eval_tokens_0_scores_every_window_and_the_stderr_is_over_windows(tmp_path, corpus):
    cfg = _cfg(corpus, **{"train.eval_tokens": 0, "train.eval_batch_size": 9,
                          "train.global_steps": 2})
    trainer = _trainer(tmp_path, cfg)
    summary = trainer.run()
    available = (len(_held_out(corpus)) - 1) // SEQ
    losses = trainer.evaluator.window_losses().numpy()
    assert losses.shape == (available,)
    assert summary["eval_tokens"] == available * SEQ
    # the final evaluation is the global model's mean over windows, its s.e. std / sqrt(n)
    assert summary["final_val_loss"] == pytest.approx(float(losses.mean()), rel=1e-12)
    expected = float(np.std(losses, ddof=1) / math.sqrt(len(losses)))
    assert expected > 0
    assert summary["val_loss_stderr"] == pytest.approx(expected, rel=1e-9)
    assert summary["evals"][-1]["val_loss_stderr"] == pytest.approx(expected, rel=1e-9)


def test_summary_json_reports_eval_tokens_and_stderr_of_every_eval(tmp_path, corpus):
    tokens = SEQ * 40
    cfg = _cfg(corpus, **{"train.eval_tokens": tokens, "train.eval_initial": True,
                          "train.eval_every": 1, "train.global_steps": 2})
    returned = train(cfg, out_dir=tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_tokens"] == tokens == returned["eval_tokens"]
    assert [e["global_step"] for e in summary["evals"]] == [0, 1, 2]
    for entry in summary["evals"]:
        assert math.isfinite(entry["val_loss_stderr"]) and entry["val_loss_stderr"] > 0
    windows = torch.load(tmp_path / "run" / "val_windows.pt").double().numpy()
    assert windows.shape == (tokens // SEQ,)
    expected = float(np.std(windows, ddof=1) / math.sqrt(len(windows)))
    assert summary["val_loss_stderr"] == pytest.approx(expected, rel=1e-5)
    assert summary["final_val_loss"] == pytest.approx(float(windows.mean()), rel=1e-6)
    assert summary["initial_val_loss"] == summary["evals"][0]["val_loss"]


def test_without_eval_initial_the_first_eval_is_at_the_last_step(tmp_path, corpus):
    cfg = _cfg(corpus, **{"train.eval_initial": False, "train.eval_every": 100,
                          "train.global_steps": 3})
    summary = train(cfg, out_dir=tmp_path / "run")
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    for s in (summary, on_disk):
        assert s["initial_val_loss"] is None
        assert [e["global_step"] for e in s["evals"]] == [3]
        assert s["evals"][0]["val_loss"] == s["final_val_loss"]


def test_negative_eval_tokens_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.eval_tokens"):
        apply_overrides(get_preset("smoke"), ["train.eval_tokens=-1"])


def test_cli_run_without_initial_eval_prints_no_initial_loss(tmp_path):
    done = subprocess.run(
        [*CLI, "run", "--preset", "smoke", "--set", "train.eval_initial=false",
         "--set", "train.global_steps=2", "--set", "train.eval_tokens=512", "--no-progress",
         "--out", "out"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "initial" not in done.stdout
    assert "final val loss" in done.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["initial_val_loss"] is None


# ------------------------------------------------------------------------------------------------
# 3. median-norm clipping: per tensor (default) or per stage
# ------------------------------------------------------------------------------------------------

SHAPES = {"a": (4,), "b": (3,)}


def _dense(replica: int, a: list[float], b: list[float]) -> Contribution:
    return Contribution(stage=1, replica=replica, global_step=0, version=1, kind="dense",
                        params={"a": SparseValues(None, torch.tensor(a, dtype=torch.float32)),
                                "b": SparseValues(None, torch.tensor(b, dtype=torch.float32))})


def _outlier_set() -> list[Contribution]:
    # tensor a: norms 5, 10, 1000 (median 10); tensor b: norms 2, 2, 2 (median 2)
    return [_dense(0, [3, 4, 0, 0], [2, 0, 0]),
            _dense(1, [0, 6, 8, 0], [0, 2, 0]),
            _dense(2, [600, 800, 0, 0], [0, 0, 2])]


def test_tensor_granularity_clips_only_the_outlying_tensor():
    cs = _outlier_set()
    scales = tensor_clip_scales(cs, ["a", "b"])
    assert scales["a"] == [1.0, 1.0, pytest.approx(10 / 1000)]
    assert scales["b"] == [1.0, 1.0, 1.0]
    out = aggregate(cs, SHAPES, granularity="tensor")
    default = aggregate(cs, SHAPES)   # "tensor" is the default
    assert all(torch.equal(out[n], default[n]) for n in SHAPES)
    # a: replica 2's [600, 800] scaled to norm 10 -> [6, 8]; mean of the three dense vectors
    expected_a = (torch.tensor([3.0, 4, 0, 0]) + torch.tensor([0.0, 6, 8, 0])
                  + torch.tensor([6.0, 8, 0, 0])) / 3
    torch.testing.assert_close(out["a"], expected_a)
    # b untouched: replica 2's own b keeps its value 2
    torch.testing.assert_close(out["b"], torch.tensor([2.0, 2.0, 2.0]) / 3)


def test_stage_granularity_scales_the_whole_contributor():
    cs = _outlier_set()
    norms = [math.sqrt(25 + 4), math.sqrt(100 + 4), math.sqrt(600**2 + 800**2 + 4)]
    median = norms[1]
    s = median / norms[2]
    assert clip_scales(cs) == [1.0, 1.0, pytest.approx(s)]
    out = aggregate(cs, SHAPES, granularity="stage")
    expected_a = (torch.tensor([3.0, 4, 0, 0]) + torch.tensor([0.0, 6, 8, 0])
                  + s * torch.tensor([600.0, 800, 0, 0])) / 3
    expected_b = (torch.tensor([2.0, 0, 0]) + torch.tensor([0.0, 2, 0])
                  + s * torch.tensor([0.0, 0, 2])) / 3
    torch.testing.assert_close(out["a"], expected_a.float())
    torch.testing.assert_close(out["b"], expected_b.float())
    # the clipped contributor's normal tensor shrank too: b[2] far below the tensor mode's 2/3
    assert float(out["b"][2]) < 0.1 * 2 / 3
    # after clipping, replica 2's whole vector has the median norm
    clipped = math.sqrt(sum((s * v) ** 2 for v in (600, 800, 2)))
    assert clipped == pytest.approx(median)


def test_tensor_granularity_with_sparse_contributions_and_an_even_count():
    # four contributors to a 6-vector "w" and a 2-vector "v", sparse; per-tensor medians of an
    # even count are the mean of the middle two norms
    def c(r, w_idx, w_val, v_idx, v_val):
        return Contribution(stage=0, replica=r, global_step=0, version=1, kind="sparse", params={
            "w": SparseValues(torch.tensor(w_idx), torch.tensor(w_val, dtype=torch.float32)),
            "v": SparseValues(torch.tensor(v_idx), torch.tensor(v_val, dtype=torch.float32))})
    cs = [c(0, [0], [1.0], [0], [1.0]),          # w 1,  v 1
          c(1, [1], [3.0], [1], [1.0]),          # w 3,  v 1
          c(2, [0, 1], [3.0, 4.0], [0], [1.0]),  # w 5,  v 1
          c(3, [5], [100.0], [1], [1.0])]        # w 100, v 1
    w_median = (3 + 5) / 2
    scales = tensor_clip_scales(cs, ["w", "v"])
    assert scales["w"] == [1.0, 1.0, pytest.approx(w_median / 5), pytest.approx(w_median / 100)]
    assert scales["v"] == [1.0] * 4
    out = aggregate(cs, {"w": (2, 3), "v": (2,)}, granularity="tensor")
    # selected_mean: w[0] from replicas 0 and 2, w[1] from 1 and 2, w[5] from 3 only
    k2 = w_median / 5
    expected_w = torch.tensor([[(1.0 + 3.0 * k2) / 2, (3.0 + 4.0 * k2) / 2, 0.0],
                               [0.0, 0.0, 100.0 * w_median / 100]])
    torch.testing.assert_close(out["w"], expected_w)
    torch.testing.assert_close(out["v"], torch.tensor([1.0, 1.0]))


def test_unknown_granularity_is_refused():
    with pytest.raises(ValueError, match="clip_granularity"):
        aggregate(_outlier_set(), SHAPES, granularity="bogus")
    with pytest.raises(ConfigError, match=r"'tensor' \| 'stage'") as info:
        apply_overrides(get_preset("smoke"), ["sparseloco.clip_granularity=bogus"])
    assert "sparseloco.clip_granularity" in str(info.value)
    for ok in ("tensor", "stage"):
        cfg = apply_overrides(get_preset("smoke"), [f"sparseloco.clip_granularity={ok}"])
        assert cfg.sparseloco.clip_granularity == ok
    assert get_preset("smoke").sparseloco.clip_granularity == "tensor"


def _final_weights(tmp_path, granularity: str, replicas: int):
    cfg = tiny(**{"sparseloco.clip_granularity": granularity, "replicas": replicas,
                  "train.eval_initial": False})
    trainer = _trainer(tmp_path, cfg, f"{granularity}-{replicas}")
    summary = trainer.run()
    return trainer.sync.global_weights, summary


def test_training_with_each_granularity_differs_only_when_there_is_something_to_clip(tmp_path):
    # one replica: its norm is the median, nothing is scaled, the two modes are the same run
    one_t, s1 = _final_weights(tmp_path, "tensor", 1)
    one_s, s2 = _final_weights(tmp_path, "stage", 1)
    for wt, ws in zip(one_t, one_s, strict=True):
        for n in wt:
            assert torch.equal(wt[n], ws[n]), n
    assert s1["final_val_loss"] == s2["final_val_loss"]
    # two replicas: the larger of two norms is clipped to their mean, per tensor or per stage:
    # different factors, different weights
    two_t, st = _final_weights(tmp_path, "tensor", 2)
    two_s, ss = _final_weights(tmp_path, "stage", 2)
    assert math.isfinite(st["final_val_loss"]) and math.isfinite(ss["final_val_loss"])
    assert st["config"]["sparseloco"]["clip_granularity"] == "tensor"
    assert ss["config"]["sparseloco"]["clip_granularity"] == "stage"
    differing = [n for wt, ws in zip(two_t, two_s, strict=True) for n in wt
                 if not torch.equal(wt[n], ws[n])]
    assert differing, "per-tensor and per-stage clipping gave identical weights"
    assert st["final_val_loss"] != ss["final_val_loss"]


# ------------------------------------------------------------------------------------------------
# 4. drop_extend's learning-rate clock
# ------------------------------------------------------------------------------------------------

def _record_lr(monkeypatch) -> list[tuple[float, float]]:
    calls: list[tuple[float, float]] = []
    real = train_module.lr_at

    def recording(step, **kwargs):
        lr = real(step, **kwargs)
        calls.append((float(step), lr))
        return lr

    monkeypatch.setattr(train_module, "lr_at", recording)
    return calls


def _fault_cfg(strategy: str):
    return tiny(**{"faults.strategy": strategy, "faults.p": 0.5, "faults.duration": 2,
                   "train.global_steps": 6, "train.eval_every": 100,
                   "train.eval_initial": False, "seed": 0})


def test_drop_extend_stretches_the_schedule_over_the_extended_run(tmp_path, monkeypatch):
    calls = _record_lr(monkeypatch)
    cfg = _fault_cfg("drop_extend")
    trainer = _trainer(tmp_path, cfg)
    summary = trainer.run()
    G, H = cfg.train.global_steps, cfg.sparseloco.inner_steps
    steps = trainer.next_step
    assert len(calls) == steps * H
    # (a) the run was extended until the budget was met
    budget = tokens_per_global_step(cfg) * G
    assert steps > G
    assert summary["tokens_processed"] >= budget
    # the nominal clock g*H + h would have run every extra global step at the floor: this
    # config is extended by at least 2 steps, so the old clock gives >= 2H floor steps
    nominal_floor = sum(1 for g in range(steps) for h in range(H) if g * H + h >= G * H)
    assert nominal_floor >= 2 * H
    # (b) at most H inner steps (the one that meets the budget) run at the floor
    floor = cfg.train.lr * cfg.train.min_lr_ratio
    at_floor = [lr for _, lr in calls if abs(lr - floor) <= 1e-12 * floor]
    assert len(at_floor) <= H
    # (c) the clock never goes backwards
    positions = [p for p, _ in calls]
    assert all(b >= a for a, b in zip(positions, positions[1:], strict=False))
    assert positions[0] == 0.0
    # the clock is tokens over one full inner step's tokens: the budget is G*H full inner steps,
    # so the last inner step is within one inner step of the schedule's end
    assert G * H - 1 <= positions[-1]
    # and every position before the budget was met is below the end of the schedule
    assert all(p < G * H for p in positions[: (steps - 1) * H])


def test_drop_keeps_the_nominal_clock(tmp_path, monkeypatch):
    calls = _record_lr(monkeypatch)
    cfg = _fault_cfg("drop")
    trainer = _trainer(tmp_path, cfg)
    summary = trainer.run()
    G, H = cfg.train.global_steps, cfg.sparseloco.inner_steps
    assert trainer.next_step == G
    assert summary["tokens_processed"] < tokens_per_global_step(cfg) * G  # some tokens dropped
    assert [p for p, _ in calls] == [float(g * H + h) for g in range(G) for h in range(H)]


# ------------------------------------------------------------------------------------------------
# 5. the token-budget refusal
# ------------------------------------------------------------------------------------------------

def test_check_token_budget_passes_within_the_split_or_with_allow_repeat():
    check_token_budget(1000, budget=1000, data=DataConfig(), preset="p")
    check_token_budget(1000, budget=10, data=DataConfig(), preset="p")
    check_token_budget(1000, budget=10**9, data=DataConfig(allow_repeat=True), preset="p")
    with pytest.raises(ConfigError) as info:
        check_token_budget(1000, budget=1001, data=DataConfig(), preset="p")
    message = str(info.value)
    for needle in ("data.path", ".bin", "data.allow_repeat"):
        assert needle in message
    with pytest.raises(ConfigError, match="data.allow_repeat"):
        check_token_budget(1000, budget=5000, data=DataConfig(path="/some/file.txt"), preset="p")


def test_paper_preset_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the 178M model was built before the budget check")

    monkeypatch.setattr(train_module, "ReplicatedPipeline", no_model)
    cfg = apply_overrides(get_preset("paper-178m"), ["train.device=cpu"])
    assert tokens_per_global_step(cfg) * cfg.train.global_steps > 10**9   # far over any corpus
    with pytest.raises(ConfigError, match="data.allow_repeat"):
        train(cfg, out_dir=tmp_path)
    assert not (tmp_path / "summary.json").exists()


def test_cli_refuses_the_paper_preset_on_the_default_corpus_quickly(tmp_path):
    started = time.perf_counter()
    done = subprocess.run(
        [*CLI, "run", "--preset", "paper-178m", "--set", "train.device=cpu", "--no-progress",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert done.returncode == 2, (done.stdout, done.stderr)
    for needle in ("data.path", ".bin", "data.allow_repeat"):
        assert needle in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "summary.json").exists()
    assert elapsed < 20, f"took {elapsed:.1f} s: the model was probably built first"


# ------------------------------------------------------------------------------------------------
# Review findings: a checkpoint that cannot be resumed, the flows' early budget check, strict JSON
# ------------------------------------------------------------------------------------------------

def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_resume_with_an_incompatible_checkpoint_exits_2_without_a_traceback(tmp_path: Path):
    sets = ["--set", "train.global_steps=3", "--set", "train.checkpoint_every=1",
            "--set", "model.d_model=32", "--set", "model.layers=4", "--set", "replicas=2",
            "--set", "train.eval_tokens=256", "--set", "sparseloco.inner_steps=1"]
    first = _cli("run", "--preset", "smoke", "--no-progress", "--out", "r", *sets, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # a checkpoint exists (written at steps 1 and 2); resume it under another config
    again = _cli("run", "--preset", "smoke", "--no-progress", "--out", "r", "--resume", *sets,
                 "--set", "train.lr=0.001", cwd=tmp_path)
    assert again.returncode == 2, again.stderr
    # the CLI refuses it from run.json's config before train() reads the checkpoint
    assert "different configuration" in again.stderr and "--overwrite" in again.stderr
    assert "Traceback" not in again.stderr


def test_the_flows_refuse_a_budget_larger_than_the_data_before_any_run():
    from flows.run_flow import resolve_config

    with pytest.raises(ConfigError, match="data.allow_repeat"):
        resolve_config("paper-178m", [])
    assert resolve_config("paper-178m", ["data.allow_repeat=true"]).data.allow_repeat
    assert resolve_config("study", []).preset == "study"


def test_one_window_gives_null_standard_errors_and_strict_json(tmp_path: Path):
    config = tiny(**{"train.eval_tokens": 1})       # one window of seq_len tokens
    summary = train(config, out_dir=tmp_path / "r")
    assert summary["eval_tokens"] == config.model.seq_len
    assert summary["val_loss_stderr"] is None
    text = (tmp_path / "r" / "summary.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict JSON: {name}"))
    assert summary["versions"]["device"] == "cpu"
    done = _cli("bypass-damage", str(tmp_path / "r"), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout, parse_constant=lambda name: pytest.fail(name))["rows"]
    assert rows and all(row["damage_stderr_pct"] is None for row in rows)
