"""A run that still owes records to the registry is shown as incomplete, whatever its status
says, and is not a finished data point in the figures."""
from __future__ import annotations

from dashboards import accounting, pages, sample
from dashboards.pages._common import Live

_TAG = pages.served_plotly_tag()


def _owing(run: dict, owed: int) -> dict:
    return {**run, "owed_records": owed}


def test_sweep_page_labels_owing_runs_and_does_not_count_them_finished() -> None:
    runs = sample.runs()
    runs[0] = _owing(runs[0], 123)
    view = {"sweep": {"id": sample.SWEEP_ID, "name": "demo", "status": "completed"},
            "robustness": sample.robustness(), "table": sample.table(), "runs": runs}
    html = pages.sweep_page(view, plotly_tag=_TAG)
    assert f"{len(runs) - 1} of {len(runs)} runs finished" in html
    assert "1 run(s) still owe records to the registry (123 in all" in html
    assert f'<td class="status-running">{runs[0]["status"]} · owes 123 records</td>' in html


def test_run_page_says_the_run_is_incomplete() -> None:
    run = _owing(sample.runs()[1], 7)
    html = pages.run_page({"run": run, "metrics": [], "events": [], "baseline": None,
                           "baseline_metrics": []}, plotly_tag=_TAG)
    assert "<b>Incomplete.</b> This run owes 7 records" in html
    assert "owes 7 records</td>" in html


def test_token_and_byte_figures_leave_owing_runs_out() -> None:
    runs = sample.runs()
    owing = [_owing(run, 1) for run in runs]
    assert accounting.token_accounting(runs).data and accounting.bytes_sent(runs).data
    assert not accounting.token_accounting(owing).data
    assert not accounting.bytes_sent(owing).data


def test_a_running_sweeps_banner_says_how_the_page_gets_its_progress() -> None:
    """Served live, the page refreshes itself; the offline file must be reloaded."""
    view = {"sweep": {"id": sample.SWEEP_ID, "name": "demo", "status": "running"},
            "robustness": sample.robustness(), "table": sample.table(), "runs": sample.runs()}
    offline = pages.sweep_page(view, plotly_tag=_TAG)
    served = pages.sweep_page(view, plotly_tag=_TAG, live=Live("/state", "v1"))
    assert "reload to see progress" in offline and "updates itself" not in offline
    assert "this page updates itself as they do" in served
    assert "reload to see progress" not in served
