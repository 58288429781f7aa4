"""The stack survives its own faults (issue 37): a sweep on the real `infra/stack.sh` stack goes
through a 60 s Postgres outage, a `kill -9` of serve and of the sweep's process, and a
`stack.sh stop` mid-training, and completes once re-run, each cell trained to its end exactly
once.

Real parts only: `infra/stack.sh` starts its own Postgres cluster, the Prefect server on it, the
Crucible API on it and `crucible deploy` (serve), in a state folder of this test's own
(`STACK_DIR`) on free loopback ports, with the test session's GPU slot folder; the sweep is
started as the Prefect UI starts it (a flow run of the `failure-sweep` deployment) and trains
smoke cells under serve. The stack runs a copy of this checkout's code taken as the test starts
(`stack.sh` from it, `PYTHONPATH` on it): a commit or an edit made meanwhile in the checkout
neither changes the code under test halfway nor its code version (a re-run skips only the cells
completed by the same code version, so a commit between the sweep and its re-run would train
every cell again). Faults, in order:

1. Postgres stopped (`pg_ctl -m fast stop`) for 60 s while the first cell trains, then
   started again by `stack.sh start` (which leaves what still runs alone): serve stays up and
   the sweep goes on to its next cell without a person.
2. `kill -9` of serve while the second cell trains (the sweep goes on, orphaned), then of the
   sweep's process; `stack.sh start` starts serve again and marks the dead flow runs `Crashed`.
3. The spec re-run (the documented recovery); `stack.sh stop` while it trains the second cell
   again, `stack.sh start`, the spec re-run once more: the sweep completes.

Then: every cell trained to its end exactly once, counted from the run folders' training
journals (`<run folder>/trainings.jsonl`, `flows.processes.training_journal`), every other
training one the faults interrupted; no GPU slot left to a dead holder's lease; no Prefect flow
run open; Postgres holds exactly what each run folder's metrics.jsonl and events.jsonl hold.
The form of the sweep deployment, read back from this Postgres-backed Prefect, keeps the
model's field order (issue 37, item 5).

Every wait has a deadline, a failure names what it waited for and carries the tail of each of
the stack's logs, and the stack is stopped (then killed, where `stop` left anything) in a
`finally`. Measured on 2 cores shared with other work: docs/OPERATIONS.md, "Failure modes".
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
import pytest

from crucible.grid.spec import SweepSpec
from crucible.runfiles import read_jsonl
from flows.processes import TRAININGS_FILE, process_alive
from tests.fixtures.postgres import free_port
from tests.integration.test_sweep_form_postgres import form_order
from tests.unit.test_sweepspec_deployments import _field_names

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# what the stack runs: the packages, the script, the project file (no .git: one code version)
_CODE = ("api", "cli", "crucible", "dashboards", "db", "flows", "infra", "pyproject.toml")
OUTAGE_S = 60.0
# a dead holder's slot freed only by its lease would hold the next training back for minutes
# (flows.gpu._LEASE_S, 300 s); the flows free it at once
SLOT_WAIT_LIMIT_S = 120.0
_OPEN_STATES = ["RUNNING", "PENDING", "CANCELLING", "SCHEDULED", "PAUSED"]

T = TypeVar("T")


class Stack:
    """`infra/stack.sh` on a state folder and ports of its own."""

    def __init__(self, state: Path) -> None:
        self.code = state / "code"
        for name in _CODE:
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, self.code / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(ROOT / name, self.code / name)
        self.dir = state / "stack"
        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port())
        self.pg_port, self.prefect_port, self.api_port = sorted(ports)
        # the test session's own slot folder (conftest), the user's corpus cache
        keep = {"CRUCIBLE_GPU_SLOTS_DIR", "CRUCIBLE_CACHE_DIR"}
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("PREFECT_", "CRUCIBLE_")) or k in keep}
        self.env.update({
            "STACK_DIR": str(self.dir), "VENV": str(Path(sys.executable).parent.parent),
            "PYTHONPATH": str(self.code),
            "PG_PORT": str(self.pg_port), "PREFECT_PORT": str(self.prefect_port),
            "API_PORT": str(self.api_port),
            # serve's and the flow runs' own settings, inherited through stack.sh: poll every
            # 2 s (default 10), one torch thread per training on the shared cores
            "PREFECT_RUNNER_POLL_FREQUENCY": "2", "CRUCIBLE_TORCH_THREADS": "1",
            "OMP_NUM_THREADS": "1", "CRUCIBLE_LOG_LEVEL": "INFO"})
        self.timings: dict[str, float] = {}
        self.prefect = httpx.Client(base_url=f"http://127.0.0.1:{self.prefect_port}/api",
                                    timeout=20.0)

    # -- the script ---------------------------------------------------------------------------
    def sh(self, command: str, *, timeout_s: float) -> str:
        """`infra/stack.sh COMMAND`; its output, or a failure with it and the stack's logs."""
        began = time.monotonic()
        try:
            done = subprocess.run(["bash", str(self.code / "infra" / "stack.sh"), command],
                                  env=self.env, cwd=self.code,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"infra/stack.sh {command} did not return in {timeout_s:.0f} "
                                 f"s: {exc.stdout!r} {exc.stderr!r}") from None
        self.timings[f"stack.sh {command} (last)"] = time.monotonic() - began
        assert done.returncode == 0, (f"infra/stack.sh {command} exited {done.returncode}:\n"
                                      f"{done.stdout}\n{done.stderr}")
        return done.stdout + done.stderr

    def exports(self) -> dict[str, str]:
        out = self.sh("env", timeout_s=60)
        pairs = (line.removeprefix("export ").split("=", 1) for line in out.splitlines()
                 if line.startswith("export "))
        return dict(pairs)

    def pid(self, name: str) -> int:
        return int((self.dir / f"{name}.pid").read_text())

    def alive(self, name: str) -> bool:
        path = self.dir / f"{name}.pid"
        return path.exists() and process_alive({"pid": self.pid(name)})

    def stop_postgres(self) -> None:
        cmd = [_pg_ctl(), "-D", str(self.dir / "pg"), "-m", "fast", "-w", "stop"]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"pg_ctl stop failed: {done.stdout}{done.stderr}"

    def logs(self) -> str:
        """The tail of each of the stack's logs, for a failure's message."""
        parts = []
        for log in sorted((self.dir / "logs").glob("*.log")):
            text = log.read_text(errors="replace")
            parts.append(f"---- {log.name} (last 4000 of {len(text)} characters) ----\n"
                         f"{text[-4000:]}")
        return "\n".join(parts)

    def teardown(self) -> None:
        """SIGKILL to everything of the stack (servers, flow-run processes: their process
        groups) and an immediate Postgres stop: the test has stopped it gracefully already, and
        its state folder is removed next."""
        for name in ("serve", "crucible-api", "prefect-server"):
            if self.alive(name):
                _kill_group(self.pid(name))
        for record in (self.dir / "work" / "flow-runs").glob("*.json"):
            try:
                data = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            if process_alive(data):
                _kill_group(int(data.get("pgid") or data["pid"]))
        if (self.dir / "pg" / "postmaster.pid").exists():
            cmd = [_pg_ctl(), "-D", str(self.dir / "pg"), "-m", "immediate", "-w", "stop"]
            if os.geteuid() == 0:
                cmd = ["runuser", "-u", "postgres", "--", *cmd]
            subprocess.run(cmd, capture_output=True, timeout=60)
        self.prefect.close()

    # -- Prefect, over its REST API (no client retries: every wait here has its own deadline) --
    def deployment(self, name: str) -> dict[str, Any] | None:
        try:
            answer = self.prefect.get(f"/deployments/name/{name}")
        except httpx.TransportError:
            return None
        return answer.json() if answer.status_code == 200 else None

    def run_sweep(self, deployment_id: str, spec: dict[str, Any]) -> str:
        answer = self.prefect.post(f"/deployments/{deployment_id}/create_flow_run",
                                   json={"parameters": {"spec": spec}})
        assert answer.status_code == 201, answer.text
        return str(answer.json()["id"])

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        answer = self.prefect.get(f"/flow_runs/{flow_run_id}")
        answer.raise_for_status()
        return answer.json()

    def state(self, flow_run_id: str) -> str:
        return str(self.flow_run(flow_run_id)["state"]["type"])

    def open_flow_runs(self) -> list[dict[str, Any]]:
        answer = self.prefect.post("/flow_runs/filter", json={
            "flow_runs": {"state": {"type": {"any_": _OPEN_STATES}}}, "limit": 200})
        answer.raise_for_status()
        return [{"name": r["name"], "state": r["state"]["type"]} for r in answer.json()]

    def active_slots(self) -> int:
        import socket

        answer = self.prefect.get(f"/v2/concurrency_limits/gpu:{socket.gethostname()}")
        answer.raise_for_status()
        return int(answer.json()["active_slots"])

    # -- the work folder ----------------------------------------------------------------------
    @property
    def work(self) -> Path:
        return self.dir / "work"

    def trainings(self) -> dict[str, list[dict[str, Any]]]:
        """run id -> its run folder's training journal."""
        return {path.parent.name: read_jsonl(path)
                for path in sorted(self.work.glob(f"runs/*/{TRAININGS_FILE}"))}

    def flow_process(self, flow_run_id: str) -> dict[str, Any] | None:
        path = self.work / "flow-runs" / f"{flow_run_id}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None


def _pg_ctl() -> str:
    from tests.fixtures.postgres import _find_binary

    return _find_binary("pg_ctl")


def _kill_group(pgid: int) -> None:
    if pgid == os.getpgrp():        # never this test's own group
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(what: str, probe: Callable[[], T | None], timeout_s: float,
              every_s: float = 0.5) -> T:
    """`probe()`'s first truthy answer within `timeout_s`, else a failure naming `what`; a
    probe that raises a transport error (a server restarting) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = probe()
        except (httpx.TransportError, psycopg.OperationalError):
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(every_s)


def _new_training(stack: Stack, seen: dict[str, int],
                  others_than: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """A training start line that `seen` (run id -> start lines counted so far) does not
    count yet, of a run other than `others_than`: (run id, the line)."""
    for run_id, lines in stack.trainings().items():
        if run_id == others_than:
            continue
        starts = [line for line in lines if line["event"] == "start"]
        if len(starts) > seen.get(run_id, 0):
            return run_id, starts[seen.get(run_id, 0)]
    return None


def _starts(stack: Stack) -> dict[str, int]:
    return {run_id: sum(1 for line in lines if line["event"] == "start")
            for run_id, lines in stack.trainings().items()}


def _registry(stack: Stack, sweep_name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The sweep and its runs, read from the stack's Postgres."""
    url = f"host=127.0.0.1 port={stack.pg_port} user=postgres dbname=crucible"
    with psycopg.connect(url, autocommit=True) as conn:
        sweep_row = conn.execute("select id, status from sweeps where name = %s",
                                 (sweep_name,)).fetchall()
        assert len(sweep_row) == 1, f"sweeps named {sweep_name}: {sweep_row}"
        sweep = {"id": str(sweep_row[0][0]), "status": sweep_row[0][1]}
        runs = [{"id": str(r[0]), "name": r[1], "status": r[2], "status_reason": r[3],
                 "owed_records": r[4], "code_version": r[5]}
                for r in conn.execute("select id, name, status, status_reason, owed_records, "
                                      "code_version from runs where sweep_id = %s order by name",
                                      (sweep_row[0][0],))]
    return sweep, runs


def _stored_records(stack: Stack, run_id: str) -> tuple[list[tuple[Any, ...]], list[str]]:
    url = f"host=127.0.0.1 port={stack.pg_port} user=postgres dbname=crucible"
    with psycopg.connect(url, autocommit=True) as conn:
        metrics = [tuple(r) for r in conn.execute(
            "select name, global_step, replica, value from metrics where run_id = %s",
            (run_id,))]
        events = [r[0] for r in conn.execute("select event_id from events where run_id = %s",
                                             (run_id,))]
    return metrics, events


def _folder_records(run_dir: Path) -> tuple[set[tuple[Any, ...]], set[str]]:
    metrics = {(m["name"], m["global_step"], m["replica"], m["value"])
               for m in read_jsonl(run_dir / "metrics.jsonl")}
    events = {e["id"] for e in read_jsonl(run_dir / "events.jsonl")}
    return metrics, events


@pytest.fixture
def stack() -> Any:
    # not tmp_path: the stack's Postgres runs as the `postgres` OS user when this runs as root,
    # and pytest's temporary root is private to this user
    state = Path(tempfile.mkdtemp(prefix="crucible-chaos-"))
    state.chmod(0o755)
    running = Stack(state)
    try:
        yield running
    finally:
        running.teardown()
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.timeout(900)
def test_a_sweep_survives_an_outage_kills_and_a_stop_of_the_stack(stack: Stack) -> None:
    began = time.monotonic()
    try:
        _chaos(stack)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n\nphases (s): {stack.timings}\n\n{stack.logs()}") from exc
    finally:
        stack.timings["total"] = time.monotonic() - began
        print(f"chaos test phases (s): "
              f"{ {k: round(v, 1) for k, v in stack.timings.items()} }")


def _phase(stack: Stack, name: str, since: float) -> float:
    now = time.monotonic()
    stack.timings[name] = now - since
    return now


def _chaos(stack: Stack) -> None:
    t = time.monotonic()
    stack.sh("start", timeout_s=300)
    deployment = _wait_for("serve to apply the failure-sweep deployment",
                           lambda: stack.deployment("failure-sweep/failure-sweep"), 180)
    t = _phase(stack, "start", t)

    # item 5: the form, as this Postgres-backed Prefect gives it back, in the model's order
    schema = deployment["parameter_openapi_schema"]
    assert form_order(schema["definitions"]["SweepSpec"]["properties"]) == \
        _field_names(SweepSpec)

    name = f"chaos-{uuid.uuid4().hex[:8]}"
    spec = {"name": name, "preset": "smoke", "arms": ["none"], "strategies": ["skip"],
            "failure_probabilities": [0.1, 0.2], "seeds": [0], "global_steps": 16,
            "overrides": ["train.checkpoint_every=2"], "max_concurrent_runs": 1}
    n_cells = len(SweepSpec(**spec).cells())
    sweep1 = stack.run_sweep(deployment["id"], spec)

    # 1. Postgres down for 60 s while the first cell trains
    first, _ = _wait_for("the sweep's first training", lambda: _new_training(stack, {}), 240,
                         every_s=0.25)
    t = _phase(stack, "sweep to its first training", t)
    stack.stop_postgres()
    down = time.monotonic()
    while time.monotonic() - down < OUTAGE_S:
        assert stack.alive("serve"), f"serve died {time.monotonic() - down:.0f} s into the " \
                                     "Postgres outage"
        time.sleep(1)
    stack.sh("start", timeout_s=300)        # Postgres again; what runs is left alone
    assert stack.alive("serve")
    t = _phase(stack, "outage", t)
    second, line = _wait_for("the sweep to go on to its next cell after the outage, unattended",
                             lambda: _new_training(stack, {}, others_than=first), 300,
                             every_s=0.25)
    t = _phase(stack, "outage to the next cell's training", t)
    assert [x.get("outcome") for x in stack.trainings()[first] if x["event"] == "end"] == \
        ["completed"]

    # 2. kill -9 serve mid-training (the sweep goes on, orphaned), then the sweep's process,
    # early in the cell's training: the re-run has most of it left to train when it is stopped
    os.kill(stack.pid("serve"), signal.SIGKILL)
    record = stack.flow_process(sweep1)
    assert record is not None and record["flow"] == "failure-sweep"
    assert line["pid"] == record["pid"]     # the cell trains in the sweep's process
    time.sleep(0.5)
    assert process_alive(record), "the sweep's process died with serve"
    os.kill(record["pid"], signal.SIGKILL)
    _wait_for("the killed sweep's process to be gone", lambda: not process_alive(record), 30)
    assert not any(x["event"] == "end" for x in stack.trainings()[second])
    stack.sh("start", timeout_s=300)        # serve again; its reconciler marks the dead runs
    assert stack.alive("serve")
    assert stack.state(sweep1) == "CRASHED"
    assert stack.state(line["flow_run_id"]) == "CRASHED"
    assert stack.open_flow_runs() == []
    assert stack.active_slots() == 0, "the killed sweep's GPU slot waits for its lease"
    t = _phase(stack, "kill -9 serve and the sweep, start", t)

    # 3. the spec re-run; stack.sh stop while it trains the killed cell again; start; re-run
    before = _starts(stack)
    asked = time.monotonic()
    sweep2 = stack.run_sweep(deployment["id"], spec)
    again, line = _wait_for("the re-run to train the killed cell again",
                            lambda: _new_training(stack, before), 240, every_s=0.25)
    assert again == second
    t = _phase(stack, "re-run to its training", t)
    assert time.monotonic() - asked < SLOT_WAIT_LIMIT_S
    stopped = time.monotonic()
    stack.sh("stop", timeout_s=240)
    stack.timings["stack.sh stop mid-training"] = time.monotonic() - stopped
    assert not any(process_alive({"pid": x["pid"]}) for lines in stack.trainings().values()
                   for x in lines), "a training outlived stack.sh stop"
    assert not process_alive(line)
    stack.sh("start", timeout_s=300)
    assert stack.state(sweep2) == "CANCELLED"
    assert stack.open_flow_runs() == []
    assert stack.active_slots() == 0, "the stopped run's GPU slot waits for its lease"
    t = _phase(stack, "stop mid-training, start", t)
    sweep3 = stack.run_sweep(deployment["id"], spec)
    _wait_for("the re-run sweep to complete",
              lambda: stack.state(sweep3) in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
              420, every_s=1)
    t = _phase(stack, "last re-run to completion", t)
    assert stack.state(sweep3) == "COMPLETED", stack.flow_run(sweep3)["state"]

    # the sweep completed, every cell recorded completed and owing nothing
    sweep, runs = _registry(stack, name)
    assert sweep["status"] == "completed"
    assert len(runs) == n_cells
    assert [(r["status"], r["owed_records"] or 0) for r in runs] == [("completed", 0)] * n_cells
    assert list(stack.work.rglob("*.spool.jsonl")) == []
    assert all("+g" not in r["code_version"] for r in runs), "the stack ran the checkout itself"

    # each cell trained to its end exactly once; the others were the faults' interruptions
    journals = stack.trainings()
    told = json.dumps({run_id: [[x["event"], x["pid"], x.get("outcome")] for x in lines]
                       for run_id, lines in journals.items()})
    assert sorted(journals) == sorted(r["id"] for r in runs), told
    for lines in journals.values():
        ends = [x for x in lines if x["event"] == "end"]
        assert [x["outcome"] for x in ends].count("completed") == 1, told
        # nothing trained it after it was complete
        assert (lines[-1]["event"], lines[-1].get("outcome")) == ("end", "completed"), told
        # one training at a time (the run folder's lock): none interleaves with another, each
        # end line follows its own start
        for before, end in zip(lines, lines[1:], strict=False):
            if end["event"] == "end":
                assert (before["event"], before["pid"], before["flow_run_id"]) == \
                    ("start", end["pid"], end["flow_run_id"]), told
    # the others once each; the second cell killed with the sweep, then either stopped with
    # the stack and trained to its end by the last re-run, or trained to its end during the
    # stop's grace period (serve gives a flow run 30 s; the training thread goes on meanwhile)
    # and not trained again
    starts = {run_id: sum(x["event"] == "start" for x in lines)
              for run_id, lines in journals.items()}
    assert starts.pop(second) in (2, 3), told
    assert set(starts.values()) == {1}, told
    rerun = [x for x in journals[second] if x["pid"] == line["pid"]]
    assert rerun[0]["event"] == "start" and (len(journals[second]) == 3) == \
        (rerun[-1].get("outcome") == "completed"), told

    # stack.sh appends to the logs: the killed serve's lines are still there, after each start's
    # marker
    serve_log = (stack.dir / "logs" / "serve.log").read_text(errors="replace")
    assert serve_log.count("infra/stack.sh starts serve ====") == 3
    assert f"flow-run/{sweep1}" in serve_log

    # no slot held, no flow run open
    assert stack.active_slots() == 0
    assert stack.open_flow_runs() == []

    # Postgres holds exactly what the run folders hold
    for run in runs:
        metrics, events = _folder_records(stack.work / "runs" / run["id"])
        stored_metrics, stored_events = _stored_records(stack, run["id"])
        assert len(stored_metrics) == len(set(stored_metrics)) and set(stored_metrics) == \
            metrics, run["name"]
        assert len(stored_events) == len(set(stored_events)) and set(stored_events) == \
            events, run["name"]
        assert metrics, run["name"]
