"""The run page's diagnostics (counts, bytes, timing), tags and notes, the Prefect link, the
CSV/JSON links under every table and figure, and the live-refresh markup."""
from __future__ import annotations

import json
import re
from typing import Any

from dashboards import pages, sample

_TAG = pages.served_plotly_tag()


def _view(**run_fields: Any) -> dict[str, Any]:
    runs = sample.runs()
    run = next(r for r in runs if r["p"] == 0.1 and r["strategy"] == "skip")
    metrics = sample.val_loss_metrics(run["summary"])
    run.update(run_fields)
    base = next(r for r in runs if r["id"] == run["baseline_run_id"])
    return {"run": run, "metrics": metrics,
            "train_loss": sample.train_loss_metrics(), "events": sample.events(),
            "event_counts": {"failure_start": 2, "bypass": 12, "contribution_missing": 12,
                             "rejoin": 2, "contribution_rejected": 3},
            "baseline": base, "baseline_metrics": []}


def _row(html: str, table: str, label: str) -> list[str]:
    """The cells of the row of `table` whose first cell starts with `label`."""
    body = re.search(rf'<table class="data" id="{table}">(.*?)</table>', html, re.S)
    assert body, f"no table {table}"
    for row in re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S):
        cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        if cells and cells[0].startswith(label):
            return cells[1:]
    raise AssertionError(f"no row {label!r} in {table}")


def test_counts_come_from_event_counts_beside_the_summary_counters() -> None:
    html = pages.run_page(_view(), plotly_tag=_TAG)
    assert _row(html, "counts", "failures") == ["2", "2"]  # events, len(summary.faults)
    assert _row(html, "counts", "down steps bypassed") == ["12", "—"]
    assert _row(html, "counts", "down steps dropped") == ["0", "—"]
    assert _row(html, "counts", "contributions missing") == ["12", "12"]
    assert _row(html, "counts", "contributions rejected") == ["3", "0"]
    assert _row(html, "counts", "contributions made") == ["—", "308"]


def test_bytes_and_timing_tables_read_the_summary() -> None:
    html = pages.run_page(_view(), plotly_tag=_TAG)
    assert _row(html, "bytes", "boundary, forward") == ["2.000"]
    assert _row(html, "bytes", "dense upload equivalent") == ["19.000"]
    assert _row(html, "timing", "inner steps") == ["31.5 s", "71.6%"]
    assert _row(html, "timing", "other") == ["3.2 s", "7.3%"]  # 44.0 - 31.5 - 6.2 - 3.1
    assert _row(html, "timing", "wall time") == ["44.0 s", "100.0%"]


def test_the_outer_syncs_phases_sit_under_it_and_leave_other_as_it_was() -> None:
    view = _view()
    summary = dict(view["run"]["summary"])
    summary["timing"] = {**summary["timing"], "encode_s": 2.2, "upload_s": 1.1,
                         "upload_wait_s": 0.0, "decode_s": 1.0, "aggregate_s": 0.5,
                         "outer_s": 0.25}
    view["run"]["summary"] = summary
    html = pages.run_page(view, plotly_tag=_TAG)
    assert _row(html, "timing", "outer sync: encode") == ["2.2 s", "5.0%"]
    assert _row(html, "timing", "outer sync: waiting for uploads") == ["0.0 s", "0.0%"]
    assert _row(html, "timing", "uploads (on threads") == ["1.1 s", "2.5%"]
    assert _row(html, "timing", "other") == ["3.2 s", "7.3%"]  # the phases are in sync_s
    export = json.loads(re.findall(
        r'<span class="export"[^>]*><script type="application/json">(.*?)</script>', html)[
        re.findall(r'data-export="([^"]+)"', html).index(f"run-{view['run']['id']}-timing")])
    assert [r["part"] for r in export["rows"]] == [
        "inner_s", "sync_s", "encode_s", "upload_wait_s", "decode_s", "aggregate_s", "outer_s",
        "upload_s", "eval_s", "other_s", "wall_s"]


def test_a_running_run_without_summary_shows_dashes_not_errors() -> None:
    html = pages.run_page(_view(status="running", summary={}, final_val_loss=None),
                          plotly_tag=_TAG)
    assert _row(html, "timing", "wall time") == ["—", "—"]
    assert _row(html, "bytes", "upload (SparseLoCo)") == ["—"]
    assert _row(html, "counts", "down steps bypassed") == ["12", "—"]
    assert "still in progress" in html and "reload to see progress" in html
    # the timeline draws the failures that started so far, from their failure_start events
    assert "No failures in this run." not in html and "stage down: stage skipped" in html


def test_every_table_and_figure_offers_csv_and_json() -> None:
    view = _view()
    html = pages.run_page(view, plotly_tag=_TAG)
    ident = f"run-{view['run']['id']}"
    exports = re.findall(r'data-export="([^"]+)"', html)
    assert exports == [f"{ident}-{name}" for name in (
        "facts", "val-loss", "train-loss", "faults", "events", "counts", "bytes", "timing",
        "config")]
    assert html.count('data-format="csv"') == html.count('data-format="json"') == len(exports)
    payloads = [json.loads(p) for p in re.findall(
        r'<span class="export"[^>]*><script type="application/json">(.*?)</script>', html)]
    train = payloads[exports.index(f"{ident}-train-loss")]
    assert train["columns"] == ["name", "global_step", "tokens", "replica", "value"]
    assert len(train["rows"]) == len(view["train_loss"])
    timing = payloads[exports.index(f"{ident}-timing")]
    assert [r["part"] for r in timing["rows"]] == ["inner_s", "sync_s", "eval_s", "other_s",
                                                   "wall_s"]


def test_tags_notes_and_prefect_link() -> None:
    view = _view(tags=["ablation", "h100"], notes="<b>first</b> try\nsecond line",
                 prefect_flow_run_id="0f1e2d3c-0000-4000-8000-000000000abc")
    linked = pages.run_page(view, plotly_tag=_TAG,
                            prefect_href=lambda i: f"http://prefect.local/runs/flow-run/{i}")
    assert '<span class="tag">ablation</span><span class="tag">h100</span>' in linked
    assert "&lt;b&gt;first&lt;/b&gt; try\nsecond line" in linked and "<b>first</b>" not in linked
    assert ('<a href="http://prefect.local/runs/flow-run/0f1e2d3c-0000-4000-8000-000000000abc">'
            "Prefect flow run</a>") in linked
    plain = pages.run_page(view, plotly_tag=_TAG)
    assert "Prefect flow run <code>0f1e2d3c-0000-4000-8000-000000000abc</code>" in plain
    assert "prefect.local" not in plain
    assert "Prefect flow run" not in pages.run_page(_view(), plotly_tag=_TAG)


def test_only_a_live_page_polls() -> None:
    static = pages.run_page(_view(status="running"), plotly_tag=_TAG)
    assert "data-live-url" not in static and 'id="live-status"' not in static
    live = pages.run_page(_view(status="running"), plotly_tag=_TAG,
                          live=pages.Live(state_url="/dashboards/runs/x/state", version="v1"))
    assert 'data-live-url="/dashboards/runs/x/state" data-live-version="v1"' in live
    assert 'id="live-status"' in live and "this page updates itself" in live


def test_figure_json_cannot_close_its_script() -> None:
    view = _view(compression="</script><script>alert(1)</script>")
    html = pages.run_page(view, plotly_tag=_TAG)
    assert "</script><script>alert(1)" not in html
    spec = re.search(r'data-figure-json="fig-loss">(.*?)</script>', html, re.S)
    assert spec and "alert(1)" in json.loads(spec.group(1))["data"][0]["name"]
