"""Checkpoints verify their payload on load (issue 14, point 7): a damaged newest checkpoint is
skipped for the previous good one (with a `checkpoint_rejected` event) and the run still ends
bit for bit where an uninterrupted run ends; with none left the run stops with one clear line;
temporary files of a killed write are removed at the next start; old checkpoints and rounds are
pruned to exactly what the config keeps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crucible.checkpoint import CheckpointError
from crucible.events import Callback
from crucible.train import train
from tests.unit.helpers import tiny

VOLATILE = ("wall_s", "run_key", "store_url", "versions", "timing")
CLI = [sys.executable, "-c", "from cli.main import main; main()"]


class _Crash(Callback):
    """Raises at the `after`-th flush (a killed process, in-process)."""

    def __init__(self, after: int) -> None:
        self.after, self.flushed = after, 0

    def metric(self, item: object) -> None:
        pass

    def event(self, item: object) -> None:
        pass

    def flush(self) -> None:
        self.flushed += 1
        if self.flushed == self.after:
            raise KeyboardInterrupt("killed")

    def close(self) -> None:
        pass


def _stable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in VOLATILE}


def _checkpoints(out: Path) -> list[Path]:
    return sorted(out.glob("store/*/checkpoints/step-*.pt"))


def _flip_64(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _overwrite_4k(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[1024:1024 + 4096] = bytes(range(256)) * 16
    path.write_bytes(bytes(data))


CFG = {"faults.p": 0.5, "faults.duration": 2, "train.global_steps": 5,
       "train.checkpoint_every": 1}


def _fifo(path: Path) -> None:
    """A FIFO in the checkpoint's place: opened for reading, it would wait for a writer."""
    path.unlink()
    os.mkfifo(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage, reason", [(_flip_64, "SHA-256 mismatch"),
                                            (_overwrite_4k, "SHA-256 mismatch"),
                                            (_fifo, "is a FIFO, not a regular file")])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage,
                                                                  reason: str) -> None:
    cfg = tiny(**CFG)
    whole = train(cfg, out_dir=tmp_path / "whole")
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=cut, callback=_Crash(after=4))   # checkpoints of steps 2 and 3 kept
    newest = _checkpoints(cut)[-1]
    assert newest.name == "step-00000003.pt"
    damage(newest)
    resumed = train(cfg, out_dir=cut, resume=True)
    assert _stable(resumed) == _stable(whole)
    events = [json.loads(line) for line in (cut / "events.jsonl").read_text().splitlines()]
    (rejected,) = [e for e in events if e["kind"] == "checkpoint_rejected"]
    assert rejected["global_step"] == 3 and rejected["detail"]["resumed_from"] == 2
    assert reason in rejected["detail"]["reason"]


def test_no_good_checkpoint_left_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tiny(**CFG, **{"train.keep_checkpoints": 1})
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path, callback=_Crash(after=4))
    (only,) = _checkpoints(tmp_path)
    _flip_64(only)
    with pytest.raises(CheckpointError, match="no usable checkpoint .*SHA-256 mismatch"):
        train(cfg, out_dir=tmp_path, resume=True)


def test_cli_reports_a_corrupt_checkpoint_in_one_line_with_exit_2(tmp_path: Path) -> None:
    args = ["run", "--preset", "smoke", "--no-progress", "--out", str(tmp_path),
            "--set", "train.global_steps=3", "--set", "train.checkpoint_every=1",
            "--set", "train.keep_checkpoints=1", "--set", "train.eval_tokens=256"]
    first = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    (only,) = _checkpoints(tmp_path)
    _flip_64(only)
    again = subprocess.run([*CLI, *args, "--resume"], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 2
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no usable checkpoint" in lines[0], again.stderr
    assert "Traceback" not in again.stderr


def _as_format_1(path: Path) -> None:
    """Rewrite a checkpoint as crucible wrote it before checkpoints carried a SHA-256 (format
    1: a bare `torch.save` of the payload, with a `latest.json` pointer beside it)."""
    step = int(path.stem.split("-")[1])
    torch.save({"format": 1, "global_step": step, "config": "{}", "state": {}}, path)
    key = f"{path.parent.parent.name}/checkpoints/{path.name}"
    (path.parent / "latest.json").write_text(json.dumps({"format": 1, "global_step": step,
                                                         "key": key}))


def test_checkpoints_of_an_older_version_say_so_and_how_to_go_on(tmp_path: Path) -> None:
    args = ["run", "--preset", "smoke", "--no-progress", "--out", str(tmp_path),
            "--set", "train.global_steps=2", "--set", "train.checkpoint_every=1",
            "--set", "train.eval_tokens=256"]
    first = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    for path in _checkpoints(tmp_path):
        _as_format_1(path)
    again = subprocess.run([*CLI, *args, "--resume"], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 2
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in again.stderr, again.stderr
    assert "written by an older version of crucible" in lines[0]
    assert "start the run again without --resume" in lines[0]
    assert "SHA-256 mismatch" not in lines[0] and "different configuration" not in lines[0]
    fresh = subprocess.run([*CLI, *args, "--overwrite"], capture_output=True, text=True,
                           timeout=600)
    assert fresh.returncode == 0, fresh.stderr


def test_temporary_files_of_a_killed_write_are_removed_at_the_next_start(tmp_path: Path) -> None:
    cfg = tiny(**CFG)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path, callback=_Crash(after=3))
    checkpoints = _checkpoints(tmp_path)[-1].parent
    (checkpoints / ".tmp-k1ll3d").write_bytes(b"\0" * (1 << 20))   # a torn checkpoint write
    (checkpoints.parent / "00000002" / "stage-1" / ".tmp-b10b").write_bytes(b"\1" * 100)
    train(cfg, out_dir=tmp_path, resume=True)
    assert list(tmp_path.glob("store/**/.tmp-*")) == []


def test_pruning_keeps_exactly_the_configured_checkpoints_and_rounds(tmp_path: Path) -> None:
    cfg = tiny(**{"train.global_steps": 6, "train.checkpoint_every": 1,
                  "train.keep_checkpoints": 3, "store.keep_rounds": 2})
    pruned = train(cfg, out_dir=tmp_path / "pruned")
    assert [p.name for p in _checkpoints(tmp_path / "pruned")] == [
        "step-00000003.pt", "step-00000004.pt", "step-00000005.pt"]
    run_dir = _checkpoints(tmp_path / "pruned")[0].parent.parent
    assert sorted(p.name for p in run_dir.iterdir() if p.name != "checkpoints") == [
        "00000004", "00000005"]
    kept_all = train(tiny(**{"train.global_steps": 6}), out_dir=tmp_path / "all")
    assert len(list((tmp_path / "all" / "store").glob("*/0000000?"))) == 6
    assert pruned["final_val_loss"] == kept_all["final_val_loss"]


def test_resume_passes_over_a_garbage_manifest(tmp_path: Path) -> None:
    """A 12-byte garbage manifest in a round the resumed run replays: passed over (event), the
    run ends where the uninterrupted run ends."""
    cfg = tiny(**CFG)
    whole = train(cfg, out_dir=tmp_path / "whole")
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=cut, callback=_Crash(after=4))   # rounds 0-3 done, checkpoint at 3
    (manifest,) = cut.glob("store/*/00000003/stage-1/manifest.json")
    manifest.write_bytes(b"garbage\x00\xff{[]")
    resumed = train(cfg, out_dir=cut, resume=True)
    assert resumed["manifests_rejected"] == 1
    assert {k: v for k, v in _stable(resumed).items() if k != "manifests_rejected"} == {
        k: v for k, v in _stable(whole).items() if k != "manifests_rejected"}
    events = [json.loads(line) for line in (cut / "events.jsonl").read_text().splitlines()]
    assert [(e["global_step"], e["stage"]) for e in events if e["kind"] == "manifest_rejected"] \
        == [(3, 1)]


def test_resume_may_change_what_is_kept(tmp_path: Path) -> None:
    """`train.keep_checkpoints` and `store.*` say what is kept and where, not what is computed:
    a resume may change them; any other key is still refused."""
    cfg = tiny(**CFG)
    whole = train(cfg, out_dir=tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path / "cut", callback=_Crash(after=4))
    with pytest.raises(CheckpointError, match="different configuration"):
        train(tiny(**CFG, **{"train.lr": 0.01}), out_dir=tmp_path / "cut", resume=True)
    more = tiny(**CFG, **{"train.keep_checkpoints": 4, "store.keep_rounds": 3})
    resumed = train(more, out_dir=tmp_path / "cut", resume=True)
    assert resumed["final_val_loss"] == whole["final_val_loss"]
    assert resumed["evals"] == whole["evals"]
