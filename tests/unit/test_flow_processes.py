"""The run folder's training journal and what counts as a live process (`flows.processes`).

Each training of a run folder is on disk (`training_journal`, `<run folder>/trainings.jsonl`): a
start line before it, an end line with its outcome after it, and a process killed mid-training
leaves a start with no end, so a test (the stack's chaos test) counts the trainings themselves,
not only the registry's records.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from crucible.runfiles import read_jsonl
from flows.processes import TRAININGS_FILE, training_journal

ROOT = Path(__file__).resolve().parents[2]

_KILLED = """
import sys, time
from pathlib import Path
from flows.processes import training_journal
with training_journal(Path(sys.argv[1]), "killed"):
    print("training", flush=True)
    time.sleep(600)
"""


def test_the_journal_has_each_training_and_a_killed_one_has_no_end(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "training\n"
    finally:
        proc.kill()
        proc.wait()
    with open(tmp_path / TRAININGS_FILE, "ab") as torn:      # killed while writing a line
        torn.write(b'{"event": "st')
    with training_journal(tmp_path, "completed"):
        pass
    with pytest.raises(ValueError), training_journal(tmp_path, "failed"):
        raise ValueError("diverged")
    lines = read_jsonl(tmp_path / TRAININGS_FILE)
    assert [(r["event"], r["flow_run_id"], r.get("outcome")) for r in lines] == [
        ("start", "killed", None),
        ("start", "completed", None), ("end", "completed", "completed"),
        ("start", "failed", None), ("end", "failed", "ValueError")]
    assert lines[0]["pid"] == proc.pid and lines[1]["pid"] != proc.pid
    assert lines[1]["at"] <= lines[2]["at"]


def test_a_process_that_exited_unreaped_is_not_alive() -> None:
    """A zombie (exited; its parent, here this test, has not reaped it: a flow run orphaned by
    a killed serve under an init that reaps late) holds no slot, lock or flow run: dead."""
    import time

    from flows.processes import process_alive, process_start

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record = {"pid": proc.pid, "started": process_start(proc.pid)}
    try:
        assert process_alive(record)
        assert not process_alive({**record, "started": "1"})   # a reused pid
        proc.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.05)
        assert not process_alive(record)
    finally:
        proc.kill()
        proc.wait()
