"""`make demo`'s command end to end: the demo grid through ephemeral Prefect, ending with the
offline report's path as the last line of output."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_demo_sweep_writes_the_report_and_prints_its_path_last(tmp_path: Path) -> None:
    crucible = Path(sys.executable).parent / "crucible"
    result = subprocess.run([str(crucible), "sweep", "--demo", "--work-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=840, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("report: ")
    report = Path(last.removeprefix("report: "))
    assert report.is_file() and report.parent == tmp_path
    html = report.read_text()
    assert "<html" in html.lower()
    assert "mapl" in html.lower() and "ssn" in html.lower()     # both arms are on the page
    for column in ("ssn/skip", "ssn/drop", "mapl/skip", "mapl/drop"):
        assert column in result.stdout            # the printed robustness table
    # the claims it speaks to, each comparison as it stands: one seed is no interval, and no
    # verdict either way
    lines = result.stdout.splitlines()
    [claim] = [line for line in lines if line.startswith("(a) skip costs less than drop")]
    assert claim.endswith(": not resolved")
    assert any("(no interval), 1 seed: no verdict below 2 seeds" in line for line in lines)
