"""A dishonest or broken peer beside a real run (issue 14, points 3-5): a real LocalStore whose
`put` lets a tampering function write into the run's round folders right after the honest
upload, as a peer with write access to the store could. Each case runs the trainer for a few
rounds and checks what the round did with the tampered object: rejected and counted (with a
`contribution_rejected` / `manifest_rejected` event), and, where the honest set survives, the
same numbers as the honest run."""
from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from crucible.events import Event, Metric
from crucible.faults import FaultPlan
from crucible.manifest import MANIFEST_VERSION
from crucible.sparseloco import encode_contribution
from crucible.store import LocalStore
from crucible.train import Trainer
from tests.unit.helpers import tiny

Tamper = Callable[["TamperedStore", str, bytes], None]


class TamperedStore(LocalStore):
    """A LocalStore with a dishonest peer: after every `put`, `tamper(store, key, data)` may
    write (with `write`, which bypasses the hook). `gets` records every key read."""

    def __init__(self, root: Path, tamper: Tamper) -> None:
        super().__init__(root)
        self.tamper, self.gets = tamper, []

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        super().put(key, data, durable=durable)
        self.tamper(self, key, data)

    def write(self, key: str, data: bytes) -> None:
        LocalStore.put(self, key, data)

    def get(self, key: str, **kwargs: object) -> bytes:
        self.gets.append(key)
        return super().get(key, **kwargs)


class Collect:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def metric(self, item: Metric) -> None:
        pass

    def event(self, item: Event) -> None:
        self.events.append(item)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _run(store: LocalStore, cfg, plan: FaultPlan | None = None, run_key: str = "t"):
    sink = Collect()
    trainer = Trainer(cfg, store=store, run_key=run_key, callback=sink, plan=plan)
    summary = trainer.run()
    return trainer, summary, sink.events


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _rewrite(blob: bytes, *, replica: int) -> bytes:
    """The same blob with its header's replica field (bytes 12-16) changed, CRC made valid."""
    body = bytearray(blob[:-4])
    struct.pack_into("<I", body, 12, replica)
    return _reseal(bytes(body))


def _same_weights(a: Trainer, b: Trainer) -> bool:
    return all(torch.equal(x[n], y[n]) for x, y in zip(a.sync.global_weights,
                                                       b.sync.global_weights, strict=True)
               for n in x)


def _rejections(events: list[Event]) -> list[tuple[int, int, int, str]]:
    return [(e.global_step, e.stage, e.replica, e.detail["reason"]) for e in events
            if e.kind == "contribution_rejected"]


def test_forged_blob_in_a_down_replicas_slot_is_rejected_and_changes_nothing(tmp_path: Path):
    """The issue's attack: replica 0's real blob, replica field rewritten to 1, put in the slot
    of replica 1 whose stage 1 the fault plan has down at steps 0 and 1."""
    cfg = tiny(**{"faults.p": 0.01})
    plan = FaultPlan().down(replica=1, stage=1, start=0, steps=2)

    def forge(store: TamperedStore, key: str, data: bytes) -> None:
        if key.endswith("/stage-1/replica-0") and key.split("/")[1] in ("00000000", "00000001"):
            store.write(key[:-1] + "1", _rewrite(data, replica=1))

    honest, h_summary, _ = _run(LocalStore(tmp_path / "honest"), cfg, plan)
    forged, f_summary, events = _run(TamperedStore(tmp_path / "forged", forge), cfg, plan)
    rejected = _rejections(events)
    assert [(g, s, r) for g, s, r, _ in rejected] == [(0, 1, 1), (1, 1, 1)]
    assert all("fault plan has replica 1 idle at stage 1" in reason for *_, reason in rejected)
    assert f_summary["contributions"]["rejected"] == 2
    assert f_summary["final_val_loss"] == h_summary["final_val_loss"]
    assert _same_weights(honest, forged)


def test_huge_norm_contribution_is_rejected(tmp_path: Path):
    """A well-formed blob in a live replica's own slot, every value at 1e4 (the largest scale
    the codec admits): far beyond the round's median norm, so it is left out."""
    cfg = tiny(**{"replicas": 4})
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}

    def inflate(store: TamperedStore, key: str, data: bytes) -> None:
        if key == "t/00000001/stage-2/replica-3":
            delta = {n: torch.full(s, 1e4) for n, s in shapes["stage-2"].items()}
            huge = encode_contribution(delta, {}, beta=0.95, stage=2, replica=3,
                                       global_step=1)[0]
            store.write(key, _reseal(huge[:8] + data[8:28] + huge[28:-4]))  # honest header

    store = TamperedStore(tmp_path, inflate)
    sink = Collect()
    trainer = Trainer(cfg, store=store, run_key="t", callback=sink)
    shapes["stage-2"] = trainer.sync.shapes[2]
    summary = trainer.run()
    rejected = _rejections(sink.events)
    assert [(g, s, r) for g, s, r, _ in rejected] == [(1, 2, 3)]
    assert "times the round's median" in rejected[0][3]
    assert summary["contributions"]["rejected"] == 1
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_replayed_blob_of_an_earlier_round_is_rejected(tmp_path: Path):
    cfg = tiny()

    def replay(store: TamperedStore, key: str, data: bytes) -> None:
        if key == "t/00000002/stage-1/replica-0":
            store.write(key, LocalStore.get(store, "t/00000001/stage-1/replica-0"))

    _, summary, events = _run(TamperedStore(tmp_path, replay), cfg)
    rejected = _rejections(events)
    assert [(g, s, r) for g, s, r, _ in rejected] == [(2, 1, 0)]
    assert "global step 1, expected 2" in rejected[0][3]
    assert summary["contributions"]["rejected"] == 1


def test_blob_of_another_run_is_rejected(tmp_path: Path):
    """Another run (another seed) shares the store; its blob for the same step, stage and
    replica is copied over this run's own: same header fields but the run."""
    root = tmp_path / "shared"
    _run(LocalStore(root), tiny(seed=1), run_key="other")

    def swap(store: TamperedStore, key: str, data: bytes) -> None:
        if key == "t/00000001/stage-2/replica-1":
            store.write(key, LocalStore.get(store, "other/00000001/stage-2/replica-1"))

    honest, h_summary, _ = _run(LocalStore(tmp_path / "honest"), tiny())
    _, summary, events = _run(TamperedStore(root, swap), tiny())
    rejected = _rejections(events)
    assert [(g, s, r) for g, s, r, _ in rejected] == [(1, 2, 1)]
    assert "run tag" in rejected[0][3]
    assert summary["contributions"]["rejected"] == 1


def test_oversized_object_is_rejected_without_being_read(tmp_path: Path):
    """8 MiB of junk in a live replica's slot (a real blob here is a few KB): refused from the
    listing's size, never read."""
    cfg = tiny()
    junk_key = "t/00000001/stage-1/replica-1"

    def bloat(store: TamperedStore, key: str, data: bytes) -> None:
        if key == junk_key:
            store.write(key, b"\0" * (8 << 20))

    store = TamperedStore(tmp_path, bloat)
    _, summary, events = _run(store, cfg)
    rejected = _rejections(events)
    assert [(g, s, r) for g, s, r, _ in rejected] == [(1, 1, 1)]
    assert "larger than any valid contribution" in rejected[0][3]
    assert junk_key not in store.gets
    assert summary["contributions"]["rejected"] == 1


def _plant_manifest(body: bytes) -> Tamper:
    """Writes `body` as round 1, stage 1's manifest as soon as that round's first blob lands
    (before any peer agrees)."""
    def plant(store: TamperedStore, key: str, data: bytes) -> None:
        if key == "t/00000001/stage-1/replica-0":
            store.write("t/00000001/stage-1/manifest.json", body)
    return plant


def test_garbage_manifest_is_rejected_and_the_run_goes_on(tmp_path: Path):
    cfg = tiny()
    honest, h_summary, _ = _run(LocalStore(tmp_path / "honest"), cfg)
    store = TamperedStore(tmp_path / "bad", _plant_manifest(b"\x00garbage\xff{[]"))
    bad, summary, events = _run(store, cfg)
    rejected = [e for e in events if e.kind == "manifest_rejected"]
    assert [(e.global_step, e.stage) for e in rejected] == [(1, 1)]
    assert rejected[0].detail["key"] == "t/00000001/stage-1/manifest.json"
    assert "unreadable manifest" in rejected[0].detail["reason"]
    assert summary["manifests_rejected"] == 1
    assert summary["final_val_loss"] == h_summary["final_val_loss"]
    assert _same_weights(honest, bad)
    agreed = json.loads(LocalStore.get(store, "t/00000001/stage-1/manifest-1.json"))
    assert agreed["included"] == [0, 1]


def test_empty_manifest_does_not_skip_the_outer_step(tmp_path: Path):
    """A well-formed manifest that lists no replica, planted before the round agrees: it does
    not match what the store holds, so it is rejected instead of skipping stage 1's step."""
    cfg = tiny()
    empty = json.dumps({"version": MANIFEST_VERSION, "run": "t", "global_step": 1, "stage": 1,
                        "expected": [], "included": [], "rejected": [], "missing": [],
                        "sizes": {}, "digests": {}}).encode()
    honest, h_summary, _ = _run(LocalStore(tmp_path / "honest"), cfg)
    bad, summary, events = _run(TamperedStore(tmp_path / "bad", _plant_manifest(empty)), cfg)
    assert summary["skipped_outer_steps"] == 0
    assert [e.kind for e in events if e.kind == "manifest_rejected"] == ["manifest_rejected"]
    assert summary["final_val_loss"] == h_summary["final_val_loss"]
    assert _same_weights(honest, bad)


def _fifo_at(target: str) -> Tamper:
    """Replaces whatever is at `target` with a FIFO once round 1, stage 1's replica-1 blob has
    landed (a FIFO opened for reading waits for a writer that never comes)."""
    def plant(store: TamperedStore, key: str, data: bytes) -> None:
        if key == "t/00000001/stage-1/replica-1":
            path = store.root / target
            path.unlink(missing_ok=True)
            os.mkfifo(path)
    return plant


@pytest.mark.timeout(30)
def test_a_fifo_in_a_live_replicas_slot_is_rejected_and_the_round_goes_on(tmp_path: Path):
    _, summary, events = _run(TamperedStore(tmp_path, _fifo_at("t/00000001/stage-1/replica-1")),
                              tiny())
    rejected = _rejections(events)
    assert [(g, s, r) for g, s, r, _ in rejected] == [(1, 1, 1)]
    assert "is a FIFO, not a regular file" in rejected[0][3]
    assert summary["contributions"]["rejected"] == 1
    assert summary["final_val_loss"] < summary["initial_val_loss"]


@pytest.mark.timeout(30)
def test_a_fifo_at_the_manifest_key_is_passed_over_and_the_run_goes_on(tmp_path: Path):
    cfg = tiny()
    honest, h_summary, _ = _run(LocalStore(tmp_path / "honest"), cfg)
    bad, summary, events = _run(
        TamperedStore(tmp_path / "bad", _fifo_at("t/00000001/stage-1/manifest.json")), cfg)
    rejected = [e for e in events if e.kind == "manifest_rejected"]
    assert [(e.global_step, e.stage, e.detail["key"]) for e in rejected] == [
        (1, 1, "t/00000001/stage-1/manifest.json")]
    assert "is a FIFO, not a regular file" in rejected[0].detail["reason"]
    assert summary["final_val_loss"] == h_summary["final_val_loss"]
    assert _same_weights(honest, bad)
