"""The distributed mode against the simulator: real processes (one torch.distributed.elastic
agent per replica), contributions only through the store, the same numbers.

Tolerance: none. A replica process runs the simulator's own code on one replica row; torch's CPU
kernels give each row of a replica-batched matmul, norm, AdamW step and top-k the same bits as a
lone row, and the one reduction whose order depends on the number of rows (the clipping norm's
sum over replicas) is computed at the simulator's width (`worker.clip_as_batched`). So global
weights after the first outer step, final global weights and the final validation loss are
compared with `torch.equal` / `==`. (On a GPU, cuBLAS may pick other kernels for a batch of 1;
agreement there is to fp32 round-off, not tested here.)
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crucible.config import ConfigError, apply_overrides
from crucible.distributed.launch import launch
from crucible.distributed.sync import snapshot_key
from crucible.events import NullCallback
from crucible.presets import get_preset
from crucible.store import LocalStore, open_store
from crucible.train import Trainer

pytestmark = pytest.mark.timeout(600)


def _config(replicas: int, steps: int, *extra: str):
    return apply_overrides(get_preset("smoke"), [
        f"replicas={replicas}", f"train.global_steps={steps}", f"train.eval_every={steps}",
        "train.eval_tokens=8192", "sparseloco.round_timeout_s=120", *extra])


def _simulate(config, tmp_path: Path) -> tuple[list[dict[str, torch.Tensor]], dict, list]:
    """The simulator's global weights after global step 0, its summary and final weights."""
    trainer = Trainer(config, store=LocalStore(tmp_path / "sim-store"), run_key="sim",
                      callback=NullCallback())
    trainer.global_step(0)
    after_first = [{n: t.clone() for n, t in w.items()} for w in trainer.sync.global_weights]
    trainer.next_step = 1
    summary = trainer.run()
    return after_first, summary, trainer.sync.global_weights


def _largest_difference(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    return max(float((a[s][n] - b[s][n]).abs().max()) for s in range(len(a)) for n in a[s])


def _check_agreement(replicas: int, steps: int, tmp_path: Path, *store_keys: str) -> None:
    config = _config(replicas, steps, *store_keys)
    out = tmp_path / "dist"
    summary = launch(config, out_dir=out)
    first_sim, sim, final_sim = _simulate(config, tmp_path)

    ident = json.loads((out / "run.json").read_text())
    store = open_store(ident["store_url"], endpoint_url=config.store.endpoint_url,
                       region=config.store.region)
    first = torch.load(io.BytesIO(store.get(snapshot_key(ident["run_key"], 0))),
                       weights_only=True)
    final = torch.load(out / "model.pt", weights_only=True)["stages"]
    print(f"R={replicas}: largest |difference| after step 0: "
          f"{_largest_difference(first, first_sim)}, final: "
          f"{_largest_difference(final, final_sim)}; val loss {summary['final_val_loss']!r} vs "
          f"{sim['final_val_loss']!r}")
    for s in range(config.pipeline.stages):
        for name in first_sim[s]:
            assert torch.equal(first[s][name], first_sim[s][name]), (s, name)
            assert torch.equal(final[s][name], final_sim[s][name]), (s, name)
    assert summary["final_val_loss"] == sim["final_val_loss"]
    assert summary["distributed"]["final_val_loss_spread"] == 0.0
    assert summary["contributions"] == sim["contributions"]
    assert summary["tokens_processed"] == sim["tokens_processed"]
    assert summary["bytes"]["upload"] == sim["bytes"]["upload"]
    assert summary["inner_steps"] == sim["inner_steps"]
    assert summary["distributed"]["exit_codes"] == [0] * replicas


def test_two_processes_match_the_simulator_bit_for_bit(tmp_path: Path) -> None:
    _check_agreement(2, 2, tmp_path)


def _fault_events(run_dir: Path) -> list[tuple]:
    kinds = {"failure_start", "bypass", "drop", "rejoin", "contribution_missing",
             "contribution_rejected", "manifest_rejected"}
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return sorted((e["kind"], e["global_step"], e["replica"], e["stage"],
                   json.dumps(e["detail"], sort_keys=True)) for e in events if e["kind"] in kinds)


def test_the_merged_summary_is_the_simulators_summary_plus_a_distributed_section(
        tmp_path: Path) -> None:
    # one summary builder for both modes: the same keys, and the same values wherever the two
    # runs are the same run. The plan makes the fault counters non-trivial: stage 1 down in both
    # replicas at step 0 (no contribution: a skipped outer step), replica 1's stage 2 at step 1
    from crucible.faults import FaultPlan
    from crucible.train import train

    config = _config(2, 2, "faults.strategy=skip")
    plan = FaultPlan().down(replica=0, stage=1, start=0, steps=1).down(
        replica=1, stage=1, start=0, steps=1).down(replica=1, stage=2, start=1, steps=1)
    dist = launch(config, out_dir=tmp_path / "dist", plan=plan)
    sim = train(config, out_dir=tmp_path / "sim", plan=plan)
    assert set(dist) == set(sim) | {"distributed"}
    for key in ("bytes", "contributions", "timing", "versions"):
        assert set(dist[key]) == set(sim[key]), key
    assert sim["skipped_outer_steps"] == 1
    assert sim["replica_down_fraction"] == 3 / 4
    same = ("preset", "seed", "config", "initial_val_loss", "final_val_loss", "val_loss_stderr",
            "evals", "global_steps", "tokens_budget", "tokens_processed", "budget_met",
            "inner_steps", "contributions", "manifests_rejected", "skipped_outer_steps", "bytes",
            "synced_params", "faults", "replica_down_fraction", "donor_load",
            "donor_extra_fraction", "eval_tokens", "data_digest")
    assert {k: dist[k] for k in same} == {k: sim[k] for k in same}
    ident = json.loads((tmp_path / "dist" / "run.json").read_text())
    assert (dist["run_key"], dist["store_url"]) == (ident["run_key"], ident["store_url"])
    assert dist["wall_s"] > 0 and all(v >= 0 for v in dist["timing"].values())
    # the fault events come from the same code too: failures, bypasses, rejoins, missing
    assert _fault_events(tmp_path / "dist") == _fault_events(tmp_path / "sim")
    # and the metrics: losses to the bit, at the run's token counts
    assert _records(tmp_path / "dist" / "metrics.jsonl") == _records(tmp_path / "sim" / "metrics.jsonl")


def _records(path: Path) -> list[str]:
    return sorted(json.dumps(json.loads(x), sort_keys=True) for x in path.read_text().splitlines())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_processes_on_one_gpu_agree_with_the_simulator_to_round_off(tmp_path: Path) -> None:
    """Both replica processes on the one GPU (`cuda:LOCAL_RANK`, each agent seeing GPU 0), the
    simulator on it too. The two processes hold the same global weights bit for bit (every peer
    aggregates the same agreed set the same way); against the simulator they agree to round-off
    (cuBLAS may pick other kernels for one replica row than for two, and a top-k choice may
    then flip where two magnitudes tie, moving a few values of a tensor by about a
    pseudo-gradient entry), so each stage's weights are compared by relative norm."""
    config = _config(2, 2, "train.device=cuda")
    out = tmp_path / "dist"
    summary = launch(config, out_dir=out)
    assert summary["distributed"]["devices"] == {"0": "cuda:0", "1": "cuda:0"}
    _, sim, final_sim = _simulate(config, tmp_path)
    final = torch.load(out / "model.pt", weights_only=True)["stages"]
    peers = [torch.load(p, weights_only=True)["stages"]
             for p in sorted((out / "replicas").glob("replica-*/model.pt"))]
    assert len(peers) == 2
    for s in range(config.pipeline.stages):
        for name in final_sim[s]:
            assert torch.equal(peers[0][s][name], peers[1][s][name]), (s, name)
        ours = torch.cat([final[s][n].float().reshape(-1) for n in final_sim[s]])
        theirs = torch.cat([final_sim[s][n].detach().cpu().float().reshape(-1)
                            for n in final_sim[s]])
        assert float((ours - theirs).norm() / theirs.norm()) < 1e-4, s
    assert summary["final_val_loss"] == pytest.approx(sim["final_val_loss"], rel=1e-3)
    assert summary["contributions"] == sim["contributions"]


@pytest.mark.slow
def test_four_processes_through_s3_match_the_simulator_bit_for_bit(
        tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    # the store many hosts would share: moto's S3 server, reached over HTTP by every process
    _check_agreement(4, 3, tmp_path, f"store.url=s3://{s3_bucket}/runs",
                     f"store.endpoint_url={s3_endpoint}", "store.region=us-east-1")


@pytest.mark.slow
def test_skip_faults_inside_a_process_match_the_simulator(tmp_path: Path) -> None:
    # in-replica stage failures stay simulated inside the process, from the same drawn plan
    config = _config(3, 3, "faults.p=0.5", "faults.duration=1", "faults.strategy=skip")
    summary = launch(config, out_dir=tmp_path / "dist")
    _, sim, final_sim = _simulate(config, tmp_path)
    assert sim["faults"], "the drawn plan must hold failures for this test to mean anything"
    assert summary["faults"] == sim["faults"]
    final = torch.load(tmp_path / "dist" / "model.pt", weights_only=True)["stages"]
    assert _largest_difference(final, final_sim) == 0.0
    assert summary["final_val_loss"] == sim["final_val_loss"]
    assert summary["contributions"] == sim["contributions"]


@pytest.mark.parametrize(("override", "key"), [
    ("faults.strategy=reroute", "faults.strategy=reroute"),
    ("sparseloco.method=diloco", "sparseloco.method=diloco"),
])
def test_unsupported_config_is_refused_naming_the_key(override: str, key: str,
                                                      tmp_path: Path) -> None:
    config = _config(2, 2, override, "faults.p=0.1")
    with pytest.raises(ConfigError, match=key):
        launch(config, out_dir=tmp_path / "dist")
    assert not (tmp_path / "dist" / "run.json").exists()


def test_cli_bad_input_exits_2_naming_the_option(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "cli", "launch", "--nproc", "2",
                             "--out", str(tmp_path / "x"), "--kill", "one@two"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--kill" in result.stderr and "REPLICA@GLOBAL_STEP" in result.stderr
    result = subprocess.run([sys.executable, "-m", "cli", "launch", "--nproc", "2",
                             "--out", str(tmp_path / "x"),
                             "--set", "sparseloco.round_timeout_s=0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "sparseloco.round_timeout_s" in result.stderr


def _weights(path: Path) -> list[dict[str, torch.Tensor]]:
    return torch.load(path, weights_only=True)["stages"]


@pytest.mark.slow
def test_two_planned_kills_rejoin_from_the_store_with_fresh_state(tmp_path: Path) -> None:
    config = _config(3, 5, "sparseloco.round_timeout_s=10")
    kills = [{"replica": 1, "global_step": 1, "rejoin": True},
             {"replica": 2, "global_step": 3, "rejoin": True}]
    out = tmp_path / "dist"
    summary = launch(config, out_dir=out, kills=kills)
    dist = summary["distributed"]
    print(json.dumps(dist["recoveries"]), dist["round_waits_s"])
    assert dist["exit_codes"] == [0, 0, 0]
    process = [json.loads(x) for x in (out / "process.jsonl").read_text().splitlines()]
    # in wall-clock order per replica (across replicas, rounds overlap)
    process.sort(key=lambda p: (p["replica"], p["wall"]))
    assert [(p["kind"], p["replica"]) for p in process if p["kind"] == "start"] == [
        ("start", 0), ("start", 1), ("start", 2)]
    assert all(p["planned"] for p in process if p["kind"] == "kill")
    assert [(p["kind"], p["replica"], p["global_step"]) for p in process
            if p["kind"] != "start"] == [
        ("kill", 1, 1), ("restart", 1, 1), ("caught_up", 1, 2), ("first_contribution", 1, 2),
        ("kill", 2, 3), ("restart", 2, 3), ("caught_up", 2, 4), ("first_contribution", 2, 4)]
    # a killed replica misses the round it died in and no other; the rest of the run is whole
    assert dist["missing_rounds"] == {"0": [], "1": [1], "2": [3]}
    assert dist["trained_rounds"] == {"0": [0, 1, 2, 3, 4], "1": [0, 2, 3, 4], "2": [0, 1, 2, 4]}
    S = config.pipeline.stages
    assert summary["contributions"] == {"made": 3 * 5 * S - 2 * S, "missed": 2 * S, "rejected": 0}
    assert [(r["replica"], r["killed_at_step"], r["rejoin_step"])
            for r in dist["recoveries"]] == [(1, 1, 2), (2, 3, 4)]
    assert all(0 < r["kill_to_restart_s"] < r["kill_to_rejoin_s"] for r in dist["recoveries"])
    # the real faults are events too (the registry and the dashboards get them with the rest)
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    real = sorted((e["kind"], e["replica"], e["global_step"]) for e in events
                  if e["kind"].startswith("process_"))
    assert real == [("process_killed", 1, 1), ("process_killed", 2, 3),
                    ("process_rejoined", 1, 2), ("process_rejoined", 2, 4),
                    ("process_restarted", 1, 1), ("process_restarted", 2, 3)]
    rejoined = {e["replica"]: e["detail"] for e in events if e["kind"] == "process_rejoined"}
    assert [round(rejoined[r["replica"]]["seconds_after_kill"], 3) for r in dist["recoveries"]] \
        == [round(r["kill_to_rejoin_s"], 3) for r in dist["recoveries"]]
    # the restarted processes hold the global weights every peer holds
    finals = [_weights(out / "replicas" / f"replica-{r}" / "model.pt") for r in range(3)]
    assert _largest_difference(finals[0], finals[1]) == 0.0
    assert _largest_difference(finals[0], finals[2]) == 0.0
    # nobody waited for a dead peer past the round's deadline (plus polling and listing)
    waits = [w for per in dist["round_waits_s"].values() for w in per]
    assert max(waits) <= config.sparseloco.round_timeout_s + 2.0
    # the simulator's equivalent: each killed replica dropped for the round it died in, and
    # back with none of its state in any stage; the same weights and loss, to the bit
    from crucible.faults import FaultPlan

    dropped = config.replace(faults=config.faults.__class__(strategy="drop", duration=1))
    plan = FaultPlan().down(replica=1, stage=1, start=1, steps=1).down(
        replica=2, stage=2, start=3, steps=1)
    trainer = _KilledReplicaTrainer(dropped, store=LocalStore(tmp_path / "sim"), run_key="sim",
                                    callback=NullCallback(), plan=plan)
    sim = trainer.run()
    assert _largest_difference(finals[0], trainer.sync.global_weights) == 0.0
    assert summary["final_val_loss"] == sim["final_val_loss"]
    assert summary["contributions"] == sim["contributions"]


class _KilledReplicaTrainer(Trainer):
    """The simulator with `drop`, except that a rejoining replica has lost the AdamW state and
    error feedback of every stage, not only the failed one's: what a killed process loses."""

    def _apply_rejoins(self, g: int) -> None:
        for failure in self.plan.rejoining(g):
            for stage in range(self.S):
                self.optimizer.reset(replica=failure.replica, stage=stage)
                self.sync.reset_error(replica=failure.replica, stage=stage)


@pytest.mark.slow
def test_a_replica_that_never_comes_back_is_a_dropped_replica(tmp_path: Path) -> None:
    from crucible.faults import FaultPlan

    config = _config(2, 3, "sparseloco.round_timeout_s=3")
    out = tmp_path / "dist"
    summary = launch(config, out_dir=out,
                     kills=[{"replica": 1, "global_step": 1, "rejoin": False}])
    dist = summary["distributed"]
    # its agent restarts it (every replica has a restart budget); the new life reads that it
    # was killed for good and exits at once; the run completes without it and says so
    assert dist["exit_codes"] == [0, 0]
    assert dist["finished"] == [0]
    assert [(r["replica"], r["last_step"]) for r in dist["lost"]] == [(1, 1)]
    assert "--kill-forever" in dist["lost"][0]["reason"]
    assert dist["missing_rounds"] == {"0": [], "1": [1, 2]}
    S = config.pipeline.stages
    assert summary["contributions"]["missed"] == 2 * S
    # the simulator dropping replica 1 from step 1 on ends with the same global weights
    dropped = config.replace(faults=config.faults.__class__(strategy="drop", duration=2))
    plan = FaultPlan().down(replica=1, stage=1, start=1, steps=2)
    trainer = Trainer(dropped, store=LocalStore(tmp_path / "sim"), run_key="sim",
                      callback=NullCallback(), plan=plan)
    sim = trainer.run()
    assert _largest_difference(_weights(out / "model.pt"), trainer.sync.global_weights) == 0.0
    assert summary["final_val_loss"] == sim["final_val_loss"]


def _processes_of(run_dir: Path, *, launcher: int) -> list[int]:
    """Live processes other than `launcher` whose command line names `run_dir`: the run's
    agents and workers."""
    needle = str(run_dir.resolve()).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == launcher:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:          # gone meanwhile
            continue
        if needle in argv:
            found.append(int(entry.name))
    return found


def test_a_stopped_launcher_leaves_no_replica_running(tmp_path: Path) -> None:
    # what a test timeout, Ctrl-C or a cancelled flow does to the launcher: its agents and their
    # workers go with it instead of training on, orphaned, into a folder nobody reads
    import os
    import signal
    import time

    out = tmp_path / "dist"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cli", "launch", "--nproc", "2", "--out", str(out),
         "--set", "train.global_steps=200", "--set", "sparseloco.round_timeout_s=600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        ready = out / "store"
        deadline = time.monotonic() + 240
        while not (ready.exists() and len(list(ready.glob("run-*/ready/replica-*"))) == 2):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        assert len(_processes_of(out, launcher=launcher.pid)) == 4            # two agents, two workers
        launcher.send_signal(signal.SIGTERM)           # the launcher alone, not its group
        _, err = launcher.communicate(timeout=180)
        assert launcher.returncode == 130, err
        assert "stopped" in err.decode()
        assert _processes_of(out, launcher=launcher.pid) == []
    finally:
        for pid in _processes_of(out, launcher=launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.parametrize(("kills", "message"), [
    ([{"replica": 1, "global_step": 1, "rejoin": False},
      {"replica": 1, "global_step": 2, "rejoin": True}], "--kill-forever 1@1"),
    ([{"replica": 0, "global_step": 1, "rejoin": True},
      {"replica": 0, "global_step": 1, "rejoin": True}], "twice"),
    ([{"replica": 0, "global_step": 2, "rejoin": True},
      {"replica": 1, "global_step": 2, "rejoin": True}], "every replica is killed"),
])
def test_contradictory_kill_plans_are_refused(kills: list[dict], message: str,
                                              tmp_path: Path) -> None:
    # a replica killed for good cannot be killed again (its agent would be given a restart for
    # the later kill and spend it on the first); one kill per replica and step
    with pytest.raises(ConfigError, match=message):
        launch(_config(2, 4), out_dir=tmp_path / "dist", kills=kills)
    assert not (tmp_path / "dist" / "run.json").exists()


def test_cli_out_that_is_a_file_exits_2(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("x")
    result = subprocess.run([sys.executable, "-m", "cli", "launch", "--nproc", "2",
                             "--out", str(target)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--out" in result.stderr
