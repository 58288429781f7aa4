"""benchmarks.provenance: a benchmark's JSON names the commit, the tree's state, the CPU and the
arithmetic it was measured with, read from the checkout and the machine, not typed."""
import re
import subprocess
from pathlib import Path

import torch

from benchmarks import provenance

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_it_names_the_checkouts_commit_and_whether_the_tree_has_changes() -> None:
    found = provenance.provenance()
    assert _git("rev-parse", "HEAD").startswith(found["commit"]) and len(found["commit"]) == 7
    assert provenance.commit(short=False) == _git("rev-parse", "HEAD")
    changed = _git("status", "--porcelain", "--untracked-files=no") != ""
    assert found["dirty"] is changed


def test_it_names_the_cpu_and_the_arithmetic_of_this_thread_count() -> None:
    from crucible.arithmetic import arithmetic

    found = provenance.provenance()
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", found["arithmetic"])
    assert found["arithmetic"] == arithmetic()["digest"]
    assert found["threads"] == torch.get_num_threads()
    assert set(found["cpu"]) == {"vendor", "family", "model", "name", "kernels"}
    assert len(found["load_avg"]) == 3


def test_outside_a_checkout_or_without_git_it_says_none(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(provenance, "_REPO", tmp_path)
    assert provenance.dirty() is None
    monkeypatch.setenv("PATH", str(tmp_path))        # no git at all: None, not an OSError
    assert provenance.dirty() is None
    from crucible.runfiles import git_sha
    git_sha.cache_clear()                            # it asks git once per process
    try:
        assert provenance.commit() is None
    finally:
        git_sha.cache_clear()
