"""The dashboards in a real headless Chromium: served by the real API (uvicorn over Postgres) and
exported as one offline file. Data goes in through the registry's own HTTP API.

Every figure must be a Plotly graph with drawn traces, the console must stay clean, and a
screenshot of each page is saved under test-artifacts/ for a human to look at.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from api.dashboards.export import write_report
from dashboards import sample
from tests.fixtures.browser import serve_in_thread

pytestmark = [pytest.mark.browser, pytest.mark.integration]

SWEEP_FIGURES = ["fig-robustness", "fig-table", "fig-tokens", "fig-bytes"]
RUN_FIGURES = ["fig-loss", "fig-train", "fig-faults"]
_RENDERED_JS = """() => Array.from(document.querySelectorAll('[data-figure]')).map(sec => {
  const gd = sec.querySelector('.js-plotly-plot');
  return {id: sec.dataset.figure, data: gd && gd.data ? gd.data.length : 0,
          drawn: gd ? gd.querySelectorAll('g.trace, g.table').length : 0,
          width: gd ? gd.getBoundingClientRect().width : 0};
})"""


# --- putting a sweep into the registry through its HTTP API ------------------------------------

def _config(run: dict[str, Any]) -> dict[str, Any]:
    return {"preset": "smoke", "seed": run["seed"], "replicas": 4,
            "train": {"global_steps": 20},
            "faults": {"p": run["p"], "strategy": run["strategy"], "duration": run["duration"]},
            "pipeline": {"compression": run["compression"]}}


def _post_results(client: httpx.Client, run_id: str, run: dict[str, Any]) -> None:
    results = {k: run[k] for k in ("initial_val_loss", "final_val_loss", "tokens_budget",
                                   "tokens_processed", "summary")}
    client.patch(f"/api/v1/runs/{run_id}", json={"status": "completed", **results}
                 ).raise_for_status()
    client.post(f"/api/v1/runs/{run_id}/metrics:batch",
                json={"items": sample.val_loss_metrics(run["summary"])
                      + sample.train_loss_metrics()}).raise_for_status()
    if run["p"] > 0:
        client.post(f"/api/v1/runs/{run_id}/events:batch",
                    json={"items": sample.events(strategy=run["strategy"])}).raise_for_status()


def _seed_sweep(base_url: str, token: str, *, name: str, finished: int | None = None,
                skip_baseline_seed: int | None = None, status: str = "completed") -> str:
    """Register the sample sweep; only the first `finished` runs get results (None: all);
    `skip_baseline_seed` leaves that seed's baselines out. Returns the sweep id."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        sweep = client.post("/api/v1/sweeps", json={"name": name})
        sweep.raise_for_status()
        sweep_id = sweep.json()["id"]
        runs = sorted(sample.runs(), key=lambda r: r["p"] > 0)  # baselines first
        runs = [r for r in runs if not (r["p"] == 0 and r["seed"] == skip_baseline_seed)]
        for index, run in enumerate(runs):
            created = client.post("/api/v1/runs", json={"sweep_id": sweep_id,
                                                        "config": _config(run)})
            created.raise_for_status()
            if finished is None or index < finished:
                _post_results(client, created.json()["id"], run)
        client.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": status}).raise_for_status()
    return sweep_id


# --- one real API for the module: uvicorn on a loopback port over the Postgres test database --

@dataclass(frozen=True)
class Served:
    url: str
    token: str
    database_url: str


@pytest.fixture(scope="module")
def served(pg_url: str) -> Iterator[Served]:
    """The registry app (with the dashboards) under uvicorn in a thread, for the whole module.

    Every test registers its own sweep, so nothing needs emptying between tests.
    """
    from api.app import create_app
    from api.settings import Settings

    token = "crc_dashboard-browser-tests"
    app = create_app(Settings(database_url=pg_url, api_token=token))
    with serve_in_thread(app, name="dashboard-uvicorn") as url:
        yield Served(url=url, token=token, database_url=pg_url)


@pytest.fixture(scope="module")
def full_sweep(served: Served) -> str:
    """The sample sweep, complete, registered once for the module."""
    return _seed_sweep(served.url, served.token, name="browser sweep")


# --- checks ------------------------------------------------------------------------------------

def _assert_rendered(probe: Any, expected: list[str]) -> None:
    page = probe.page
    page.wait_for_function(
        f"document.querySelectorAll('[data-figure] .js-plotly-plot').length === {len(expected)}")
    figures = page.evaluate(_RENDERED_JS)
    assert [f["id"] for f in figures] == expected
    for figure in figures:
        assert figure["data"] > 0 and figure["drawn"] > 0, f"{figure['id']} drew nothing: {figure}"
        assert figure["width"] > 400, f"{figure['id']} is squeezed: {figure}"
    assert probe.errors == [], f"console errors: {probe.errors}"


def _screenshot(probe: Any, path: Path) -> None:
    probe.page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000


# --- the served pages ----------------------------------------------------------------------------

def test_sweep_page_served_by_the_api_renders_every_figure(
        served: Served, full_sweep: str, browser_page: Any, artifacts_dir: Path) -> None:
    sweep_id, api_server = full_sweep, served
    browser_page.page.goto(f"{api_server.url}/dashboards/sweeps/{sweep_id}")
    _assert_rendered(browser_page, SWEEP_FIGURES)
    # the API served plotly.js itself; nothing came from elsewhere
    assert all(url.startswith(api_server.url) for url in browser_page.requests)
    assert any(url.endswith("/dashboards/static/plotly.min.js") for url in browser_page.requests)
    curves = browser_page.page.evaluate(
        "() => document.getElementById('fig-robustness').data.filter(t => t.showlegend !== false)"
        ".map(t => t.name)")
    assert sorted(curves) == ["SSN · drop", "SSN · skip", "uncompressed · drop",
                              "uncompressed · skip"]
    _screenshot(browser_page, artifacts_dir / "dashboard-sweep.png")

    browser_page.page.click("#runs tr:nth-child(8) a")  # drill into a run with failures
    _assert_rendered(browser_page, RUN_FIGURES)
    assert browser_page.page.locator("#config").count() == 1
    _screenshot(browser_page, artifacts_dir / "dashboard-run.png")


def test_claims_panel_shows_the_verdicts_rest_serves(
        served: Served, full_sweep: str, browser_page: Any, artifacts_dir: Path) -> None:
    page = browser_page.page
    page.goto(f"{served.url}/dashboards/sweeps/{full_sweep}")
    page.wait_for_selector("#claims-table")
    shown = page.evaluate("() => Object.fromEntries(Array.from(document.querySelectorAll("
                          "'#claims-table td[data-claim]')).map(td => [td.dataset.claim, "
                          "td.textContent.trim()]))")
    headers = {"Authorization": f"Bearer {served.token}"}
    served_claims = httpx.get(f"{served.url}/api/v1/sweeps/{full_sweep}/claims",
                              headers=headers, timeout=30).json()["claims"]
    assert shown == {c["tag"]: c["verdict"] for c in served_claims}
    # the sample sweep has skip and drop at two rates with two seeds: (a) is decided on data
    [a] = [c for c in served_claims if c["tag"] == "a"]
    assert a["comparisons"] and all(c["n_seeds"] == 2 for c in a["comparisons"])
    first = a["comparisons"][0]
    row = page.locator("#claims-table tr", has_text=first["label"]).first.inner_text()
    assert f"{first['mean']:+.2f} [{first['ci_low']:+.2f}, {first['ci_high']:+.2f}]" in row
    assert first["status"] in row
    # the claims also come as CSV and JSON, with the REST numbers
    assert page.locator("#claims a", has_text="CSV").count() == 1
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"
    page.locator("#claims").screenshot(path=str(artifacts_dir / "dashboard-claims.png"))
    assert (artifacts_dir / "dashboard-claims.png").stat().st_size > 5_000


def test_drop_run_timeline_shows_dropped_tokens_and_no_bypass(
        served: Served, full_sweep: str, browser_page: Any, artifacts_dir: Path) -> None:
    headers = {"Authorization": f"Bearer {served.token}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=30) as client:
        (run, *_) = client.get("/api/v1/runs", params={"sweep_id": full_sweep, "strategy": "drop",
                                                       "p": 0.2}).json()["items"]
        kinds = [e["kind"] for e in client.get(f"/api/v1/runs/{run['id']}/events").json()["items"]]
        bypassed = client.get(f"/api/v1/runs/{run['id']}/events", params={"kind": "bypass"})
    assert bypassed.json()["items"] == [] and kinds.count("drop") == 12 and "bypass" not in kinds
    page = browser_page.page
    page.goto(f"{served.url}/dashboards/runs/{run['id']}")
    _assert_rendered(browser_page, RUN_FIGURES)
    bars = page.evaluate("() => document.getElementById('fig-faults').data"
                         ".filter(t => t.type === 'bar').map(t => [t.name, t.y])")
    assert bars == [["stage down: tokens dropped", [1, 3]]]
    _screenshot(browser_page, artifacts_dir / "dashboard-run-drop.png")


def test_running_sweep_and_missing_baseline_show_clear_messages(
        served: Served, browser_page: Any, artifacts_dir: Path) -> None:
    api_server = served
    running = _seed_sweep(api_server.url, api_server.token, name="half done", finished=9,
                          status="running")
    browser_page.page.goto(f"{api_server.url}/dashboards/sweeps/{running}")
    _assert_rendered(browser_page, SWEEP_FIGURES)
    notice = browser_page.page.locator(".banner.info").inner_text()
    assert re.search(r"still running: 9 of 20 runs finished", notice), notice
    _screenshot(browser_page, artifacts_dir / "dashboard-sweep-running.png")

    orphan = _seed_sweep(api_server.url, api_server.token, name="no seed-1 baseline",
                         skip_baseline_seed=1)
    response = httpx.get(f"{api_server.url}/dashboards/sweeps/{orphan}")
    assert response.status_code == 200
    browser_page.page.goto(f"{api_server.url}/dashboards/sweeps/{orphan}")
    _assert_rendered(browser_page, SWEEP_FIGURES)
    warning = browser_page.page.locator(".banner.warn").inner_text()
    assert "Missing baseline" in warning and "seed 1" in warning
    _screenshot(browser_page, artifacts_dir / "dashboard-sweep-missing-baseline.png")


def test_unknown_or_malformed_ids_get_a_404_page(served: Served) -> None:
    api_server = served
    for path in ("/dashboards/sweeps/00000000-0000-4000-8000-00000000dead",
                 "/dashboards/runs/00000000-0000-4000-8000-00000000dead",
                 "/dashboards/sweeps/not-a-uuid"):
        response = httpx.get(api_server.url + path)
        assert response.status_code == 404
        assert response.headers["content-type"].startswith("text/html")
        assert "not found" in response.text
    script = httpx.get(f"{api_server.url}/dashboards/static/plotly.min.js")
    assert script.status_code == 200 and "plotly.js v" in script.text[:200]


# --- the offline file ----------------------------------------------------------------------------

def test_exported_report_renders_offline_from_disk(
        served: Served, full_sweep: str, browser_page: Any, artifacts_dir: Path) -> None:
    sweep_id, api_server = full_sweep, served
    out = artifacts_dir / "dashboard-report.html"
    written = write_report(sweep_id, out, database_url=api_server.database_url)
    assert written == out
    text = out.read_text(encoding="utf-8")
    assert text.count("* plotly.js v") == 1
    assert not list(out.parent.glob(f".{out.name}.*.tmp"))  # no temp file left behind

    page = browser_page.page
    page.route(re.compile(r"^https?://"), lambda route: route.abort())  # no network at all
    page.goto(out.as_uri())
    _assert_rendered(browser_page, SWEEP_FIGURES)
    assert all(url.startswith("file://") for url in browser_page.requests)
    _screenshot(browser_page, artifacts_dir / "dashboard-report.png")


def test_report_command_writes_the_file_and_refuses_unknown_sweeps(
        served: Served, full_sweep: str, tmp_path: Path) -> None:
    api_server = served
    import typer

    from cli.report import register

    app = typer.Typer()
    register(app)
    app.command("noop", hidden=True)(lambda: None)  # a second command keeps `report` a subcommand
    sweep_id = full_sweep
    out = tmp_path / "report.html"
    runner = CliRunner()
    result = runner.invoke(app, ["report", "--sweep", sweep_id, "--out", str(out),
                                 "--database-url", api_server.database_url])
    assert result.exit_code == 0, result.output
    assert out.exists() and "Sweep: browser sweep" in out.read_text(encoding="utf-8")

    missing = tmp_path / "missing.html"
    result = runner.invoke(app, ["report", "--sweep", "00000000-0000-4000-8000-00000000dead",
                                 "--out", str(missing), "--database-url",
                                 api_server.database_url])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not missing.exists()
    result = runner.invoke(app, ["report", "--sweep", "nope", "--out", str(missing),
                                 "--database-url", api_server.database_url])
    assert result.exit_code == 2 and "not a UUID" in result.output


# --- the fault timeline's labels and legend ----------------------------------------------------

_BOXES_JS = """(id) => {
  const gd = document.getElementById(id), svg = gd.querySelector('.main-svg');
  const box = el => { const r = el.getBoundingClientRect();
                      return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
  const all = sel => Array.from(gd.querySelectorAll(sel)).map(box);
  return {svg: box(svg), labels: all('.ytick text, .xtick text, .g-xtitle text, .g-ytitle text'),
          xtitle: all('.g-xtitle text')[0], legend: box(gd.querySelector('.legend')),
          legendItems: Array.from(gd.querySelectorAll('.legend .traces')).length};
}"""


def _inside(inner: dict[str, float], outer: dict[str, float]) -> bool:
    return (inner["left"] >= outer["left"] - 1 and inner["right"] <= outer["right"] + 1
            and inner["top"] >= outer["top"] - 1 and inner["bottom"] <= outer["bottom"] + 1)


@pytest.mark.parametrize("width", [1280, 720])
def test_fault_timeline_labels_and_legend_are_never_clipped(
        browser_page: Any, artifacts_dir: Path, width: int) -> None:
    from dashboards import timeline
    from dashboards.pages._common import document, figure_html, inline_plotly_tag

    replicas = 24
    faults = [{"replica": r, "stage": r % 4, "start": r % 7, "duration": 5}
              for r in range(replicas)]
    kinds = ("bypass", "drop", "reroute", "contribution_missing", "contribution_rejected",
             "rejoin")
    events = [{"kind": kind, "global_step": r % 7 + 1, "replica": r, "stage": r % 4,
               "detail": {"donor": (r + 1) % replicas} if kind == "reroute" else {}}
              for r, kind in zip(range(replicas), kinds * 4, strict=True)]
    fig = timeline.fault_timeline(
        faults=faults, events=events, replicas=replicas, global_steps=40,
        strategy="an_unusually_long_mitigation_strategy_name_from_a_later_release")
    out = artifacts_dir / f"dashboard-timeline-labels-{width}.html"
    out.write_text(document("timeline", figure_html(fig, "fig-faults"), inline_plotly_tag()),
                   encoding="utf-8")
    page = browser_page.page
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(out.as_uri())
    page.wait_for_function("document.querySelector('#fig-faults .legend') !== null")
    boxes = page.evaluate(_BOXES_JS, "fig-faults")
    assert boxes["legendItems"] == len([t for t in fig.data if t.showlegend is not False])
    assert len(boxes["labels"]) > replicas
    clipped = [label for label in boxes["labels"] if not _inside(label, boxes["svg"])]
    assert clipped == [], clipped
    assert _inside(boxes["legend"], boxes["svg"]), boxes
    assert boxes["legend"]["top"] >= boxes["xtitle"]["bottom"], "legend overlaps the axis title"
    _screenshot(browser_page, artifacts_dir / f"dashboard-timeline-labels-{width}.png")
