"""infra/stack.sh remembers the ports it was started on: `status`, `env` and `stop` use them, and
a running stack is never silently swapped for the defaults (somebody else's server on a shared
host). The real script runs under bash with a temporary STACK_DIR; `start` saves its ports
before starting anything, so a start that stops at its next check (a VENV without Python)
leaves exactly the state a real start leaves, without Postgres or Prefect."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "infra" / "stack.sh"
CUSTOM = {"PG_PORT": "55999", "PREFECT_PORT": "4299", "API_PORT": "8099"}


def _stack(command, stack_dir, **env):
    clean = {k: v for k, v in os.environ.items() if k not in CUSTOM}
    clean.update({"STACK_DIR": str(stack_dir), "VENV": str(Path(sys.executable).parent.parent),
                  **env})
    return subprocess.run(["bash", str(SCRIPT), command], capture_output=True, text=True,
                          env=clean, timeout=60)


def _start_saving_ports(stack_dir, tmp_path):
    done = _stack("start", stack_dir, **CUSTOM, VENV=str(tmp_path / "no-venv"))
    assert done.returncode == 2 and "VENV=" in done.stderr, done.stderr
    return done


@pytest.fixture()
def live_pid(tmp_path):
    """A live process standing for a running server of the stack (its pid file)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_env_and_status_use_the_ports_start_saved(tmp_path):
    stack_dir = tmp_path / "stack"
    _start_saving_ports(stack_dir, tmp_path)
    assert (stack_dir / "ports.env").read_text().splitlines() == [
        f"{k}={v}" for k, v in CUSTOM.items()]
    env = _stack("env", stack_dir)
    assert env.returncode == 0, env.stderr
    assert "export PREFECT_API_URL=http://127.0.0.1:4299/api" in env.stdout
    assert "export CRUCIBLE_API_URL=http://127.0.0.1:8099" in env.stdout
    assert "@127.0.0.1:55999/crucible" in env.stdout
    status = _stack("status", stack_dir)
    assert status.returncode == 0, status.stderr
    assert "ports: PG_PORT=55999 PREFECT_PORT=4299 API_PORT=8099 (saved in" in status.stdout


def test_running_stack_refuses_other_ports_on_start_and_warns_elsewhere(tmp_path, live_pid):
    stack_dir = tmp_path / "stack"
    _start_saving_ports(stack_dir, tmp_path)
    (stack_dir / "crucible-api.pid").write_text(f"{live_pid}\n")
    saved = (stack_dir / "ports.env").read_text()

    refused = _stack("start", stack_dir, API_PORT="8000")
    assert refused.returncode == 2
    assert "API_PORT=8000 (running: API_PORT=8099)" in refused.stderr
    assert "infra/stack.sh stop" in refused.stderr
    assert (stack_dir / "ports.env").read_text() == saved

    env = _stack("env", stack_dir, API_PORT="8000")
    assert env.returncode == 0
    assert "warning:" in env.stderr and "API_PORT=8000 (running: API_PORT=8099)" in env.stderr
    assert "export CRUCIBLE_API_URL=http://127.0.0.1:8099" in env.stdout
    status = _stack("status", stack_dir)
    assert f"crucible-api: running (pid {live_pid})" in status.stdout
    assert status.stderr == ""


def test_stopped_stack_starts_on_the_ports_asked_for(tmp_path):
    stack_dir = tmp_path / "stack"
    _start_saving_ports(stack_dir, tmp_path)
    _stack("start", stack_dir, PG_PORT="56000", VENV=str(tmp_path / "no-venv"))
    assert "PG_PORT=56000\nPREFECT_PORT=4299\n" in (stack_dir / "ports.env").read_text()


@pytest.mark.parametrize("value", ["abc", "0", "70000"])
def test_a_port_that_is_not_a_number_exits_2_naming_it(tmp_path, value):
    done = _stack("start", tmp_path / "stack", PREFECT_PORT=value)
    assert done.returncode == 2
    assert f"PREFECT_PORT='{value}' is not a port number" in done.stderr \
        or f"PREFECT_PORT={value} is not a port number" in done.stderr
    assert not (tmp_path / "stack" / "ports.env").exists()


def test_a_server_that_exited_unreaped_counts_as_stopped(tmp_path):
    """A killed serve whose parent has not reaped it yet (a zombie: under an init that reaps
    late) is stopped: `start` starts it again and runs the reconciler, rather than taking the
    zombie for a running serve."""
    stack_dir = tmp_path / "stack"
    _start_saving_ports(stack_dir, tmp_path)
    proc = subprocess.Popen(["sleep", "300"])
    try:
        proc.kill()
        stat = Path(f"/proc/{proc.pid}/stat")
        for _ in range(200):
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        (stack_dir / "serve.pid").write_text(f"{proc.pid}\n")
        status = _stack("status", stack_dir)
        assert "serve: stopped" in status.stdout, status.stdout
    finally:
        proc.wait()
