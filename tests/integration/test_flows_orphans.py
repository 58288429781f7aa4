"""Flow runs whose process is gone (issue 37): Prefect and the registry say so, the stack's
`stop` ends every flow run's processes and records them cancelled, and a re-run never trains a
cell an orphaned process still trains.

Real processes: each flow run's process is a real subprocess that records itself
(`flows.processes.flow_process`) and is killed with SIGKILL, or ended by `end_processes`, as
serve's death or `infra/stack.sh stop` ends it; Prefect is the test harness, the registry the
embedded one.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Running

import crucible.train
from crucible.registry.identity import code_version, config_fingerprint
from crucible.registry.reporting import ApiClient
from flows.processes import end_processes, live_records, reconcile
from flows.run_flow import resolve_config, train_run
from flows.settings import FlowSettings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64", "train.global_steps=2"]

# a flow run's process: records itself, starts a child in its process group (a distributed
# run's agent, say), says so, and waits to be killed
_FLOW_PROCESS = """
import subprocess, sys, time
from pathlib import Path
from flows.processes import flow_process
with flow_process(Path(sys.argv[1]), sys.argv[2], "train-run"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
"""


def _env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(ROOT)}


@contextmanager
def _flow_process(work_dir: Path, flow_run_id: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A real process recorded as flow run `flow_run_id`'s, in a process group of its own (as
    serve's are); yields it and its child's pid once it is recorded."""
    proc = subprocess.Popen([sys.executable, "-c", _FLOW_PROCESS, str(work_dir), flow_run_id],
                            env=_env(), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        yield proc, child
    finally:
        for pid in (proc.pid, child if "child" in locals() else 0):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()


def _running_train_flow_run(api: ApiClient, name: str) -> tuple[str, str]:
    """A registry run `running` under a Prefect flow run of `train-run` in state Running, as a
    flow run that trains: (flow run id, registry run id)."""
    config = resolve_config("smoke", TINY)
    run = api.create_run(config=config.to_dict(), config_hash=config_fingerprint(config),
                         code_version=code_version(), name=name)
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(train_run, name=name,
                                          parameters={"run_id": str(run["id"])})
        client.set_flow_run_state(flow_run.id, Running(), force=True)
    api.update_run(str(run["id"]), status="running", prefect_flow_run_id=str(flow_run.id))
    return str(flow_run.id), str(run["id"])


def _state(flow_run_id: str) -> str:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.type.name


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a child of the test process that died is a zombie until reaped: dead all the same
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.timeout(240)
def test_a_flow_run_whose_process_was_sigkilled_is_marked_crashed_in_prefect_and_the_registry(
        prefect_harness: None, flow_client: ApiClient) -> None:
    work_dir = FlowSettings().work_dir
    dead_id, dead_run = _running_train_flow_run(flow_client, "killed")
    live_id, live_run = _running_train_flow_run(flow_client, "alive")
    with _flow_process(work_dir, dead_id) as (dead, _child), \
            _flow_process(work_dir, live_id) as (live, _):
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        marked = reconcile(work_dir, reason="its process died")
        assert marked == ["killed"]
        assert _state(dead_id) == "CRASHED"
        assert _state(live_id) == "RUNNING"          # its process still runs: left alone
        run = flow_client.get_run(dead_run)
        assert run["status"] == "failed"
        assert run["status_reason"] == "flow run crashed: its process died"
        assert flow_client.get_run(live_run)["status"] == "running"
        assert [r["flow_run_id"] for r in live_records(work_dir)] == [live_id]
        assert live.poll() is None


@pytest.mark.timeout(240)
def test_stop_ends_every_flow_runs_process_group_and_records_it_cancelled(
        prefect_harness: None, flow_client: ApiClient) -> None:
    work_dir = FlowSettings().work_dir
    flow_run_id, run_id = _running_train_flow_run(flow_client, "stopped")
    with _flow_process(work_dir, flow_run_id) as (proc, child):
        ended = end_processes(work_dir, grace_s=30)
        assert [r["flow_run_id"] for r in ended] == [flow_run_id]
        proc.wait()
        assert _gone(child)                          # the whole process group
        assert reconcile(work_dir, cancelled=True, reason="stack stopped") == ["stopped"]
    assert _state(flow_run_id) == "CANCELLED"
    run = flow_client.get_run(run_id)
    assert run["status"] == "cancelled"
    assert run["status_reason"] == "flow run cancelled: stack stopped"


# an orphaned flow run's process that still trains the cell: it holds the run folder's lock,
# says so, waits for the word, then trains the run to its end
_ORPHAN = """
import sys
from pathlib import Path
from crucible.train import train
from flows.processes import run_folder_lock
from flows.run_flow import resolve_config
out, run_id, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with run_folder_lock(out):
    print("locked", flush=True)
    sys.stdin.readline()
    train(resolve_config("smoke", sys.argv[4:]), out_dir=out, resume=True,
          run_key=f"run-{run_id}")
"""


class _LogWatch(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle, self.seen = needle, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.set()


@pytest.mark.timeout(300)
def test_a_rerun_waits_for_the_orphan_still_training_its_cell_and_trains_it_no_second_time(
        prefect_harness: None, flow_client: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = FlowSettings()
    overrides = [*TINY, "seed=21"]
    config = resolve_config("smoke", overrides)
    run_id = str(flow_client.create_run(config=config.to_dict(),
                                        config_hash=config_fingerprint(config),
                                        code_version=code_version())["id"])
    out_dir = settings.work_dir.resolve() / "runs" / run_id
    trained_here: list[int] = []
    real_train = crucible.train.train

    def counting_train(*args: Any, **kwargs: Any) -> dict[str, Any]:
        trained_here.append(1)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(crucible.train, "train", counting_train)
    watch = _LogWatch("is being trained by another process")
    logging.getLogger("prefect.task_runs").addHandler(watch)
    orphan = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(out_dir), run_id, "-",
                               *overrides], env={**_env(), "CRUCIBLE_TORCH_THREADS": "1"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    states: list[Any] = []
    rerun = None
    try:
        assert orphan.stdout is not None and orphan.stdout.readline() == "locked\n"
        rerun = threading.Thread(target=lambda: states.append(train_run(
            preset="smoke", overrides=overrides, run_id=run_id, return_state=True)))
        rerun.start()
        assert watch.seen.wait(timeout=180), "the re-run never waited for the orphan"
        assert orphan.stdin is not None
        orphan.stdin.write("go\n")
        orphan.stdin.flush()
        assert orphan.wait(timeout=200) == 0
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(watch)
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        if rerun is not None:
            rerun.join(timeout=200)
    assert trained_here == []                        # the orphan trained it, once
    assert states and states[0].is_completed(), states
    orphan_summary = (out_dir / "summary.json").read_text()
    run = flow_client.get_run(run_id)
    assert run["status"] == "completed"
    assert run["final_val_loss"] == json.loads(orphan_summary)["final_val_loss"]
