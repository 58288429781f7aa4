"""The compare view and the served CSV/JSON downloads in a real headless Chromium, over the real
API and Postgres (data put in through the registry's HTTP API).

Runs picked with the checkboxes of a sweep's runs table (and of the index) open
`/dashboards/compare?runs=...`: their validation-loss curves overlaid, a facts table, and a
config diff of only the differing keys. A sweep page's runs CSV downloads with the REST field
names and the registry's exact numbers.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dashboards.datasets import RUN_FIELDS
from tests.browser.registry_data import served_sample_sweep

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TOKEN = "crc_compare-browser-tests"
SWEEP = "compare grid"


@pytest.fixture(scope="module")
def served(pg_url: str) -> Iterator[tuple[str, dict[str, Any]]]:
    with served_sample_sweep(pg_url, name=SWEEP, token=TOKEN) as (url, data):
        yield url, data


def _traces(page: Any) -> list[str]:
    page.wait_for_function("document.querySelector('#fig-compare.js-plotly-plot') !== null")
    return page.evaluate("() => document.getElementById('fig-compare').data.map(t => t.name)")


def test_runs_picked_in_a_sweep_table_are_compared_with_a_config_diff(
        served: tuple[str, dict[str, Any]], browser_page: Any, artifacts_dir: Path) -> None:
    url, data = served
    page = browser_page.page
    page.goto(f"{url}/dashboards/sweeps/{data['sweep']}")
    picked = [r for r in data["runs"] if r["p"] in (0.1, 0.2) and r["strategy"] == "drop"]
    picked.append(next(r for r in data["runs"] if r["p"] == 0.1 and r["strategy"] == "skip"))
    for run in picked:
        page.check(f"#runs input[value='{run['id']}']")
    page.reload()  # the selection outlives a reload (and a live page's refresh)
    for run in picked:
        assert page.is_checked(f"#runs input[value='{run['id']}']")
    page.click("form.compare button[type=submit]")
    page.wait_for_url("**/dashboards/compare?runs=*")
    assert set(page.url.split("runs=", 1)[1].split(",")) == {r["id"] for r in picked}

    assert len(_traces(page)) == 3  # every run recorded val_loss
    drawn = page.evaluate("() => document.querySelectorAll('#fig-compare g.trace').length")
    assert drawn == 3
    # facts: swatch, run, sweep, arm, strategy, p, seed, status, final val loss, tokens, tags
    finals = page.locator("#compare-runs tr td:nth-child(9)").all_inner_texts()
    assert sorted(finals) == sorted(f"{r['final_val_loss']:.4f}" for r in picked)

    diff_keys = page.locator("#config-diff tr th:first-child code").all_inner_texts()
    assert "faults.p" in diff_keys and "faults.strategy" in diff_keys
    assert "pipeline.compression" not in diff_keys and "seed" not in diff_keys
    note = page.locator("#config-diff-note").inner_text()
    assert note.startswith(f"{len(diff_keys)} config key(s) differ") and "hidden" in note
    p_row = page.locator("#config-diff tr", has_text="faults.p").locator("td")
    assert sorted(p_row.all_inner_texts()) == ["0.1", "0.1", "0.2"]

    # the x-axis toggle redraws the curves over global steps
    page.click("#fig-compare .updatemenu-button >> nth=1")
    page.wait_for_function("document.getElementById('fig-compare').data[0].x[0] === 0")
    page.screenshot(path=str(artifacts_dir / "dashboard-compare.png"), full_page=True)
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"


def test_compare_from_the_index_and_bad_ids_are_named_not_fatal(
        served: tuple[str, dict[str, Any]], browser_page: Any) -> None:
    url, data = served
    page = browser_page.page
    page.goto(f"{url}/?q={SWEEP}")
    page.click("form.compare button[type=submit]")  # nothing ticked: a hint, no navigation
    assert "Select 2 to 12 runs" in page.locator(".compare-note").inner_text()
    boxes = page.locator("#recent-runs input[name=runs]")
    boxes.nth(0).check()
    boxes.nth(1).check()
    page.click("form.compare button[type=submit]")
    page.wait_for_url("**/dashboards/compare?runs=*")
    assert len(_traces(page)) == 2

    one = data["runs"][0]["id"]
    missing = "00000000-0000-4000-8000-00000000dead"
    response = httpx.get(f"{url}/dashboards/compare",
                         params={"runs": f"{one},nope,{missing}"})
    assert response.status_code == 200
    assert "not a run id: &#x27;nope&#x27;" in response.text
    assert f"no run with id {missing}" in response.text
    assert "Pick at least two runs" in response.text
    too_many = ",".join(r["id"] for r in data["runs"]) + "," + ",".join(
        f"00000000-0000-4000-8000-{i:012d}" for i in range(12))
    response = httpx.get(f"{url}/dashboards/compare", params={"runs": too_many})
    assert response.status_code == 200 and "compare at most 12 runs" in response.text
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"


def test_sweep_runs_csv_download_has_rest_names_and_exact_numbers(
        served: tuple[str, dict[str, Any]], browser_page: Any, tmp_path: Path) -> None:
    url, data = served
    page = browser_page.page
    page.goto(f"{url}/dashboards/sweeps/{data['sweep']}")
    with page.expect_download() as info:
        page.click(".export[data-export$='-runs'] a[data-format=csv]")
    download = info.value
    assert download.suggested_filename == "compare-grid-runs.csv"
    target = tmp_path / download.suggested_filename
    download.save_as(target)
    table = list(csv.DictReader(io.StringIO(target.read_bytes().decode("utf-8"), newline="")))
    assert list(table[0]) == list(RUN_FIELDS)
    by_id = {row["id"]: row for row in table}
    assert set(by_id) == {r["id"] for r in data["runs"]}
    for run in data["runs"]:
        assert float(by_id[run["id"]]["final_val_loss"]) == run["final_val_loss"]
        assert by_id[run["id"]]["status"] == "completed"

    with page.expect_download() as info:
        page.click(".export[data-export$='-robustness'] a[data-format=csv]")
    header = info.value.path().read_text(encoding="utf-8").splitlines()[0]
    assert header == "compression,strategy,label,duration,p,mean_pct,ci_low_pct,ci_high_pct,n_seeds"
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"
