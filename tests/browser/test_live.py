"""Live pages in a real headless Chromium: a running run's page and its sweep's page refresh
themselves in place when the run finishes through the REST API (no navigation, figures updated
with the new points), show a "live" pill, say so when the state cannot be read, and stop polling
once finished. The offline report never polls."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from api.dashboards import routes
from api.dashboards.export import write_report
from dashboards import sample
from tests.browser.test_dashboards import Served, _config
from tests.browser.test_dashboards import served as served  # noqa: PLC0414 - the fixture

pytestmark = [pytest.mark.browser, pytest.mark.integration]

_PAGE_TIMEOUT_MS = 30_000


@pytest.fixture(autouse=True)
def _fast_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Poll twice a second instead of every 5 s (the server runs in this process)."""
    monkeypatch.setattr(routes, "LIVE_INTERVAL_S", 0.5)


@pytest.fixture
def api(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=30,
                      headers={"Authorization": f"Bearer {served.token}"}) as client:
        yield client


def _running_sweep(api: httpx.Client, name: str) -> tuple[str, str, dict[str, Any]]:
    """A running sweep: a finished baseline and one failure run that is running with its first
    two evaluations and its first fault's events, no train loss yet. Returns (sweep id, running
    run id, the sample run it will finish as)."""
    sweep_id = api.post("/api/v1/sweeps", json={"name": name}).raise_for_status().json()["id"]
    runs = sample.runs(seeds=1, arms=("ssn",), strategies=("skip",), ps=(0.0, 0.2))
    base, failing = sorted(runs, key=lambda r: r["p"])
    base_id = api.post("/api/v1/runs", json={"sweep_id": sweep_id, "config": _config(base)}
                       ).raise_for_status().json()["id"]
    api.patch(f"/api/v1/runs/{base_id}", json={
        "status": "completed", **{k: base[k] for k in ("initial_val_loss", "final_val_loss",
                                                       "tokens_budget", "tokens_processed",
                                                       "summary")}}).raise_for_status()
    api.post(f"/api/v1/runs/{base_id}/metrics:batch",
             json={"items": sample.val_loss_metrics(base["summary"])}).raise_for_status()
    run_id = api.post("/api/v1/runs", json={"sweep_id": sweep_id, "config": _config(failing)}
                      ).raise_for_status().json()["id"]
    api.patch(f"/api/v1/runs/{run_id}", json={"status": "running"}).raise_for_status()
    api.post(f"/api/v1/runs/{run_id}/metrics:batch",
             json={"items": sample.val_loss_metrics(failing["summary"])[:2]}).raise_for_status()
    api.post(f"/api/v1/runs/{run_id}/events:batch",
             json={"items": sample.events()[:5]}).raise_for_status()
    api.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": "running"}).raise_for_status()
    return sweep_id, run_id, failing


def _finish(api: httpx.Client, run_id: str, run: dict[str, Any]) -> None:
    """What a reporter does at the end: the remaining records, then PATCH completed."""
    api.post(f"/api/v1/runs/{run_id}/metrics:batch",
             json={"items": sample.val_loss_metrics(run["summary"])
                   + sample.train_loss_metrics(steps=20)}).raise_for_status()
    api.post(f"/api/v1/runs/{run_id}/events:batch",
             json={"items": sample.events()}).raise_for_status()
    api.patch(f"/api/v1/runs/{run_id}", json={
        "status": "completed", **{k: run[k] for k in ("initial_val_loss", "final_val_loss",
                                                      "tokens_budget", "tokens_processed",
                                                      "summary")}}).raise_for_status()


def _mark(page: Any) -> None:
    """A window variable and a property on each drawn figure: both survive only if the page
    was updated in place (no navigation, figures not re-created)."""
    page.evaluate("() => { window.__beforeRefresh = 'kept'; document.querySelectorAll("
                  "'.js-plotly-plot').forEach(gd => { gd.__kept = true; }); }")


def _kept(page: Any) -> dict[str, Any]:
    return page.evaluate("() => ({window: window.__beforeRefresh, figures: Array.from("
                         "document.querySelectorAll('.js-plotly-plot')).map(gd => "
                         "[gd.id, gd.__kept === true])})")


def test_running_run_and_sweep_pages_pick_up_the_finished_run_in_place(
        served: Served, api: httpx.Client, browser_page: Any, artifacts_dir: Path) -> None:
    sweep_id, run_id, run = _running_sweep(api, "live sweep")
    page = browser_page.page
    page.goto(f"{served.url}/dashboards/runs/{run_id}")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length === 3")
    assert page.locator("#run-status").inner_text() == "running"
    assert page.locator("#final-loss").inner_text() == "—"
    page.wait_for_function("document.getElementById('live-status').textContent"
                           ".startsWith('live · updated')", timeout=_PAGE_TIMEOUT_MS)
    loss_points = page.evaluate("() => document.getElementById('fig-loss').data[0].x.length")
    assert page.evaluate("() => document.getElementById('fig-train').data.length") == 0
    _mark(page)
    page.evaluate("() => window.scrollTo(0, 600)")

    # the sweep page, by name, in a second tab of the same browser
    sweep_page = page.context.new_page()
    sweep_page.on("pageerror", lambda exc: browser_page.errors.append(f"sweep tab: {exc}"))
    sweep_page.goto(f"{served.url}/dashboards/sweeps/{quote('live sweep')}")
    sweep_page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length > 0")
    assert "1 of 2 runs finished" in sweep_page.locator(".meta").first.inner_text()
    _mark(sweep_page)
    sweep_page.check(f"input[name=runs][value='{run_id}']")  # picked for comparison

    _finish(api, run_id, run)

    page.wait_for_function("document.getElementById('run-status').textContent === 'completed'",
                           timeout=_PAGE_TIMEOUT_MS)
    assert page.locator("#final-loss").inner_text() == f"{run['final_val_loss']:.4f}"
    assert page.evaluate("() => document.getElementById('fig-loss').data[0].x.length") \
        > loss_points
    assert page.evaluate("() => document.getElementById('fig-train').data.length") == 4
    kept = _kept(page)
    assert kept["window"] == "kept"
    assert kept["figures"] == [["fig-loss", True], ["fig-train", True], ["fig-faults", True]]
    assert page.evaluate("() => window.scrollY") == 600
    # each figure takes its new height (train loss was a shorter empty-state figure before)
    heights = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                            ".map(gd => [gd.layout.height, gd.getBoundingClientRect().height])")
    assert all(abs(want - got) < 2 for want, got in heights), heights
    page.wait_for_function("document.getElementById('live-status').textContent"
                           ".startsWith('finished')", timeout=_PAGE_TIMEOUT_MS)
    assert page.locator(".banner.info").count() == 0  # "still in progress" is gone
    page.screenshot(path=str(artifacts_dir / "dashboard-run-live-finished.png"), full_page=True)

    sweep_page.wait_for_function("document.querySelector('.meta').textContent"
                                 ".includes('2 of 2 runs finished')", timeout=_PAGE_TIMEOUT_MS)
    assert _kept(sweep_page)["window"] == "kept"
    assert sweep_page.is_checked(f"input[name=runs][value='{run_id}']")
    assert all(flag for _id, flag in _kept(sweep_page)["figures"])
    assert browser_page.errors == [], browser_page.errors
    assert sweep_id


def test_live_page_shows_a_paused_state_on_errors_and_recovers(
        served: Served, api: httpx.Client, browser_page: Any) -> None:
    _sweep_id, run_id, run = _running_sweep(api, "live errors")
    page = browser_page.page
    failures = {"left": 2}

    def flaky(route: Any) -> None:
        if failures["left"]:
            failures["left"] -= 1
            route.fulfill(status=503, body="{}", content_type="application/json")
        else:
            route.continue_()

    page.route("**/state", flaky)
    page.goto(f"{served.url}/dashboards/runs/{run_id}")
    page.wait_for_function("document.getElementById('live-status').textContent"
                           ".includes('paused (state: HTTP 503)')", timeout=_PAGE_TIMEOUT_MS)
    assert "retrying in" in page.locator("#live-status").inner_text()
    _finish(api, run_id, run)
    page.wait_for_function("document.getElementById('run-status').textContent === 'completed'",
                           timeout=_PAGE_TIMEOUT_MS)
    # the failed polls were console errors of the browser's own (503), nothing else
    assert [e for e in browser_page.errors if "503" not in e] == []


def test_finished_pages_and_the_offline_report_do_not_poll(
        served: Served, api: httpx.Client, browser_page: Any, artifacts_dir: Path) -> None:
    sweep_id, run_id, run = _running_sweep(api, "live done")
    _finish(api, run_id, run)
    api.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": "completed"}).raise_for_status()
    for path in (f"/dashboards/runs/{run_id}", f"/dashboards/sweeps/{sweep_id}"):
        html = httpx.get(served.url + path).text
        assert "data-live-url" not in html and 'id="live-status"' not in html
    state = httpx.get(f"{served.url}/dashboards/runs/{run_id}/state").json()
    assert state["finished"] is True and state["status"] == "completed"

    out = artifacts_dir / "dashboard-live-report.html"
    api.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": "running"}).raise_for_status()
    write_report(sweep_id, out, database_url=served.database_url)
    text = out.read_text(encoding="utf-8")
    assert "data-live-url" not in text
    page = browser_page.page
    page.goto(out.as_uri())
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length > 0")
    assert page.locator("#live-status").count() == 0
