"""`crucible report SWEEP`: one offline HTML file with the sweep page and every run's page,
opened from disk (file://, every network request refused) in a real headless Chromium.

The runs table links to each run's page inside the file; the run's figures are drawn visible and
full width; its back link returns to the sweep, whose figures are still drawn; a run with more
events than the report keeps says it is capped; the CSV links work from file://.
"""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.dashboards import export
from tests.browser.registry_data import served_sample_sweep

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TOKEN = "crc_report-browser-tests"
SWEEP = "report grid"
_FIGURES_JS = """(sel) => Array.from(document.querySelectorAll(sel + ' [data-figure]')).map(c => {
  const gd = c.querySelector('.js-plotly-plot'), box = gd ? gd.getBoundingClientRect() : null;
  return {id: c.dataset.figure, drawn: gd ? gd.querySelectorAll('g.trace, g.table').length : 0,
          width: box ? box.width : 0, svgWidth: gd ? gd._fullLayout.width : 0};
})"""


@pytest.fixture(scope="module")
def seeded(pg_url: str) -> tuple[str, dict[str, Any]]:
    """A completed sample sweep (2 arms, 1 seed: 10 runs) registered through the API."""
    with served_sample_sweep(pg_url, name=SWEEP, token=TOKEN, arms=("none", "ssn")) as (_, data):
        return pg_url, data


def _cli(*args: str) -> Any:
    import typer

    from cli.report import register

    app = typer.Typer()
    register(app)
    app.command("noop", hidden=True)(lambda: None)  # a second command keeps `report` a subcommand
    return CliRunner().invoke(app, ["report", *args])


def _figures(page: Any, section: str) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in page.evaluate(_FIGURES_JS, section)}


def test_report_by_name_holds_every_run_page_linked_offline(
        seeded: tuple[str, dict[str, Any]], browser_page: Any, artifacts_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pg_url, data = seeded
    capped = next(r for r in data["runs"] if r["p"] > 0)
    monkeypatch.setattr(export, "REPORT_MAX_EVENTS", 10)  # sample failure runs log 28 events
    monkeypatch.setattr(export, "REPORT_MAX_TRAIN_POINTS", 20)  # and 80 train-loss points
    out = artifacts_dir / "dashboard-report-runs.html"
    result = _cli(SWEEP, "--out", str(out), "--database-url", pg_url)
    assert result.exit_code == 0, result.output
    text = out.read_text(encoding="utf-8")
    assert text.count("* plotly.js v") == 1
    assert text.count('<template id="run-') == len(data["runs"])

    page = browser_page.page
    page.route(re.compile(r"^https?://"), lambda route: route.abort())  # no network at all
    page.goto(out.as_uri())
    page.wait_for_function("document.querySelectorAll('#sweep .js-plotly-plot').length === 4")
    assert page.locator("#run-view").is_hidden()

    # a runs-table link opens that run's page, its figures drawn, visible and full width
    page.click(f"#runs a[href='#run-{capped['id']}']")
    page.wait_for_function("document.querySelectorAll('#run-view .js-plotly-plot').length >= 2")
    assert page.locator("#sweep").is_hidden() and page.locator("#run-view").is_visible()
    assert page.locator("#run-view h1").inner_text().startswith("Run: ")
    assert capped["id"] in page.locator("#run-view").inner_text()
    run_figures = _figures(page, "#run-view")
    assert {"fig-loss", "fig-faults"} <= set(run_figures)
    for figure in run_figures.values():
        assert figure["drawn"] > 0 and figure["width"] > 1000, figure
        assert abs(figure["svgWidth"] - figure["width"]) < 2, f"laid out hidden: {figure}"
    note = page.locator("#run-view .banner.warn").first.inner_text()
    assert "first 10 of this run's 28 events" in note and "every 4th recorded global step" in note
    train_x = page.evaluate("() => document.getElementById('fig-train').data[0].x")
    assert train_x == [0, 4, 8, 12, 16, 19]
    page.screenshot(path=str(artifacts_dir / "dashboard-report-run.png"), full_page=True)

    # the run's CSV download works from file:// too
    with page.expect_download() as info:
        page.click("#run-view .export[data-export$='-val-loss'] a[data-format=csv]")
    rows = list(csv.reader(io.StringIO(info.value.path().read_text(encoding="utf-8"))))
    assert len(rows) > 2 and rows[0][0]

    # the back link returns to the sweep, whose figures are still drawn
    page.click("#run-view nav a")
    page.wait_for_function("!document.getElementById('sweep').hidden")
    assert page.url.endswith("#sweep") and page.locator("#run-view").is_hidden()
    for figure in _figures(page, "#sweep").values():
        assert figure["drawn"] > 0 and figure["width"] > 400, figure
    # and the browser's back button walks the pages
    page.go_back()
    page.wait_for_function("!document.getElementById('run-view').hidden")
    assert capped["id"] in page.locator("#run-view").inner_text()
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"
    assert all(url.startswith(("file://", "blob:")) for url in browser_page.requests)


def test_report_opened_at_a_run_link_shows_that_run(
        seeded: tuple[str, dict[str, Any]], browser_page: Any, tmp_path: Path) -> None:
    pg_url, data = seeded
    out = export.write_report(data["sweep"], tmp_path / "r.html", database_url=pg_url)
    run = data["runs"][-1]
    page = browser_page.page
    page.goto(f"{out.as_uri()}#run-{run['id']}")
    page.wait_for_function("document.querySelectorAll('#run-view .js-plotly-plot').length >= 2")
    assert page.locator("#sweep").is_hidden()
    for figure in _figures(page, "#run-view").values():
        assert figure["drawn"] > 0 and figure["width"] > 1000, figure
    page.click("#run-view nav a")  # back to the sweep, hidden since the file opened
    page.wait_for_function("!document.getElementById('sweep').hidden")
    for figure in _figures(page, "#sweep").values():
        assert figure["width"] > 400 and abs(figure["svgWidth"] - figure["width"]) < 2, figure
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"


def test_report_command_names_an_unknown_sweep(
        seeded: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    pg_url, _data = seeded
    missing = tmp_path / "missing.html"
    result = _cli("no such sweep", "--out", str(missing), "--database-url", pg_url)
    assert result.exit_code == 2
    assert "'no such sweep' is not a UUID and no sweep is named exactly so" in result.output
    result = _cli("--out", str(missing), "--database-url", pg_url)
    assert result.exit_code == 2 and "give the sweep's id or name" in result.output
    assert not missing.exists()
