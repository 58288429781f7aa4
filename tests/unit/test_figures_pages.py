"""Page assembly: figures present, plotly.js loaded once, empty states, escaping."""
from __future__ import annotations

import re
from typing import Any

from dashboards import pages, sample

_TAG = pages.served_plotly_tag()


def _view(**overrides: Any) -> dict[str, Any]:
    view = {"sweep": {"id": sample.SWEEP_ID, "name": "demo", "status": "completed"},
            "robustness": sample.robustness(), "table": sample.table(), "runs": sample.runs()}
    view.update(overrides)
    return view


def _figure_ids(html: str) -> list[str]:
    return re.findall(r'data-figure="([^"]+)"', html)


def test_sweep_page_has_every_figure_and_links_each_run() -> None:
    html = pages.sweep_page(_view(), plotly_tag=_TAG, run_href=lambda i: f"/r/{i}")
    assert _figure_ids(html) == ["fig-robustness", "fig-table", "fig-tokens", "fig-bytes"]
    assert html.count("Plotly.newPlot(") == 4
    assert html.count(pages.PLOTLY_JS_URL) == 1
    for run in sample.runs():
        assert f'href="/r/{run["id"]}"' in html
    assert 'class="banner' not in html  # a complete sweep needs no notice


def test_sweep_page_escapes_user_text() -> None:
    html = pages.sweep_page(_view(sweep={"id": "x", "name": "<script>alert(1)</script>",
                                         "status": "completed"}), plotly_tag=_TAG)
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_sweep_still_running_shows_what_is_done() -> None:
    runs = sample.runs()
    for run in runs[len(runs) // 2:]:
        run.update(status="running", final_val_loss=None, tokens_processed=None, summary={})
    robustness = sample.robustness()
    robustness["pending_runs"] = len(runs) - len(runs) // 2
    html = pages.sweep_page(_view(sweep={"id": "s", "name": "s", "status": "running"},
                                  runs=runs, robustness=robustness), plotly_tag=_TAG)
    assert f"still running: <b>{len(runs) // 2} of {len(runs)}</b>" in html
    assert len(_figure_ids(html)) == 4


def test_sweep_without_runs_or_numbers_renders_explanations() -> None:
    empty = {"items": [], "missing_baselines": [], "pending_runs": 0}
    html = pages.sweep_page(_view(sweep={"id": "s", "name": "s", "status": "pending"},
                                  runs=[], robustness=empty,
                                  table={"columns": [], "rows": []}), plotly_tag=_TAG)
    assert "no runs yet" in html
    assert "No robustness numbers yet" in html
    assert "No finished runs with token counts yet" in html


def test_missing_baseline_is_named_in_a_warning() -> None:
    robustness = sample.robustness()
    robustness["missing_baselines"] = [{"compression": "ssn", "seed": 1, "duration": 6}]
    html = pages.sweep_page(_view(robustness=robustness), plotly_tag=_TAG)
    assert "Missing baseline." in html and "SSN seed 1 (duration 6)" in html


def test_failed_runs_are_reported() -> None:
    runs = sample.runs()
    runs[3].update(status="failed")
    html = pages.sweep_page(_view(runs=runs), plotly_tag=_TAG)
    assert "1 run(s) failed" in html and 'class="status-failed"' in html


def _run_view(p: float = 0.1, *, with_baseline: bool = True,
              strategy: str = "skip") -> dict[str, Any]:
    runs = sample.runs()
    run = next(r for r in runs if r["p"] == p and r["strategy"] == strategy)
    base = next(r for r in runs if r["id"] == run["baseline_run_id"]) if with_baseline else None
    return {"run": run, "metrics": sample.val_loss_metrics(run["summary"]),
            "events": sample.events(strategy=strategy), "baseline": base, "baseline_metrics": []}


def test_run_page_has_loss_timeline_config_and_links() -> None:
    view = _run_view()
    html = pages.run_page(view, plotly_tag=_TAG, sweep_href=lambda i: f"/s/{i}",
                          run_href=lambda i: f"/r/{i}")
    assert _figure_ids(html) == ["fig-loss", "fig-train", "fig-faults"]
    assert f'href="/s/{sample.SWEEP_ID}"' in html
    assert f'href="/r/{view["baseline"]["id"]}"' in html
    assert "<code>train.global_steps</code> = <code>20</code>" in html
    assert "+2.50%" in html  # 2.05 vs 2.00 baseline


def test_run_page_timeline_says_what_was_done_about_each_failure() -> None:
    skip = pages.run_page(_run_view(), plotly_tag=_TAG)
    assert "stage down: stage skipped (bypass)" in skip and "tokens dropped" not in skip
    drop = pages.run_page(_run_view(strategy="drop"), plotly_tag=_TAG)
    assert "stage down: tokens dropped" in drop and "(bypass)" not in drop


def test_run_page_without_baseline_warns() -> None:
    html = pages.run_page(_run_view(with_baseline=False), plotly_tag=_TAG)
    assert "Missing baseline." in html
    assert len(_figure_ids(html)) == 3


def test_not_found_page_names_the_id_and_loads_no_script() -> None:
    html = pages.not_found_page("sweep", "<nope>")
    assert "Sweep not found" in html and "&lt;nope&gt;" in html
    assert "<script" not in html


def test_inline_plotly_tag_embeds_the_library_once() -> None:
    tag = pages.inline_plotly_tag()
    html = pages.sweep_page(_view(), plotly_tag=tag)
    assert html.count("* plotly.js v") == 1 and html.count("Copyright 2012-") == 1
    assert tag.count("</script>") == 1  # the library itself never closes the tag early
    assert "cdn" not in tag[:200].lower() and "src=" not in tag[:100]
