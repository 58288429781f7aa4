"""A cancelled sweep is shown as cancelled, not as still running; a queued run as in progress."""
from __future__ import annotations

from dashboards import pages, sample

_TAG = pages.served_plotly_tag()


def test_cancelled_sweep_is_shown_cancelled_not_running() -> None:
    runs = sample.runs()
    runs[0] = {**runs[0], "status": "cancelled", "final_val_loss": None}
    runs[1] = {**runs[1], "status": "cancelled", "final_val_loss": None}
    robustness = {**sample.robustness(), "pending_runs": 0}
    view = {"sweep": {"id": sample.SWEEP_ID, "name": "demo", "status": "cancelled"},
            "robustness": robustness, "table": sample.table(), "runs": runs}
    html = pages.sweep_page(view, plotly_tag=_TAG)
    assert "status <b>cancelled</b>" in html
    assert "<b>Cancelled.</b> This sweep was cancelled; 2 run(s) did not finish" in html
    assert "still running" not in html
    assert html.count('<td class="status-cancelled">cancelled</td>') == 2
    assert ".status-cancelled {" in html


def test_queued_run_page_says_it_is_in_progress() -> None:
    run = {**sample.runs()[1], "status": "queued"}
    html = pages.run_page({"run": run, "metrics": [], "events": [], "baseline": None,
                           "baseline_metrics": []}, plotly_tag=_TAG)
    assert "This run is still in progress" in html
