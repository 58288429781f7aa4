"""The CSV and JSON downloads of `dashboards.datasets.export_links`, built by a real headless
Chromium from the embedded rows: RFC 4180 quoting (commas, quotes, newlines), unrounded numbers,
empty cells for missing values, nested values as JSON text. The served pages' downloads are
checked in tests/browser/test_compare.py; the offline file's in tests/browser/test_report.py."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from dashboards.datasets import export_links
from dashboards.pages._common import document

pytestmark = [pytest.mark.browser]

ROWS: list[dict[str, Any]] = [
    {"name": 'say "hi", then\nleave', "p": 0.1, "mean_pct": 0.1 + 0.2, "tags": ["a", "b"],
     "final_val_loss": None},
    {"name": "plain", "p": 1e-7, "mean_pct": -12.345678901234567, "tags": [],
     "final_val_loss": 3.25},
]


def _download(page: Any, fmt: str, tmp_path: Path) -> str:
    with page.expect_download() as info:
        page.click(f".export a[data-format={fmt}]")
    download = info.value
    target = tmp_path / download.suggested_filename
    download.save_as(target)
    return target.read_bytes().decode("utf-8")  # keep CRLF as written


def test_csv_download_quotes_cells_and_keeps_numbers_exact(browser_page: Any,
                                                           tmp_path: Path) -> None:
    page = browser_page.page
    page.set_content(document("export", export_links("sweep-x-runs", ROWS, label="runs"), ""))
    text = _download(page, "csv", tmp_path)
    assert text.endswith("\r\n")
    table = list(csv.reader(io.StringIO(text, newline="")))
    assert table[0] == ["name", "p", "mean_pct", "tags", "final_val_loss"]
    assert table[1] == ['say "hi", then\nleave', "0.1", "0.30000000000000004", '["a","b"]', ""]
    assert float(table[2][1]) == 1e-7 and float(table[2][2]) == -12.345678901234567
    assert table[2][4] == "3.25" and len(table) == 3
    assert browser_page.errors == []


def test_json_download_is_the_rows(browser_page: Any, tmp_path: Path) -> None:
    page = browser_page.page
    page.set_content(document("export", export_links("sweep-x-runs", ROWS, label="runs"), ""))
    assert json.loads(_download(page, "json", tmp_path)) == ROWS


def test_csv_text_cells_that_a_spreadsheet_would_run_as_formulas_are_defused(
        browser_page: Any, tmp_path: Path) -> None:
    """A run name (or note, or config text) is anyone's text: `=HYPERLINK(...)` must open in a
    spreadsheet as text, not as a formula (OWASP "CSV injection"): text cells starting with
    = + - @ TAB or CR get a leading apostrophe; numbers (negative ones too) and the JSON download
    stay exact."""
    rows = [{"name": '=HYPERLINK("http://x","y")', "p": -0.5}, {"name": "+1", "p": 1},
            {"name": "-rerun", "p": 2}, {"name": "@SUM(A1)", "p": 3},
            {"name": "\tTAB", "p": 4}, {"name": "plain=ok", "p": 5}]
    page = browser_page.page
    page.set_content(document("export", export_links("runs", rows, label="runs"), ""))
    table = list(csv.reader(io.StringIO(_download(page, "csv", tmp_path), newline="")))
    assert [r[0] for r in table[1:]] == ['\'=HYPERLINK("http://x","y")', "'+1", "'-rerun",
                                         "'@SUM(A1)", "'\tTAB", "plain=ok"]
    assert [r[1] for r in table[1:]] == ["-0.5", "1", "2", "3", "4", "5"]
    assert json.loads(_download(page, "json", tmp_path)) == rows
    assert browser_page.errors == []
