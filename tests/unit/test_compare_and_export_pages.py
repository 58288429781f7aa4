"""The compare page, the index's and sweep page's additions (sweep column, tags, notes, Prefect
link, run selection, export links) and the parsing behind them, without a database."""
from __future__ import annotations

import copy
from typing import Any

from api.dashboards import queries
from dashboards import pages, sample
from dashboards.pages.compare import compare_page, config_diff

_TAG = pages.served_plotly_tag()


def _runs(n: int = 3) -> list[dict[str, Any]]:
    runs = copy.deepcopy(sample.runs()[:n])
    for run in runs:
        run["config"] = {"seed": run["seed"], "model": {"d_model": 64, "layers": 4},
                         "faults": {"p": run["p"], "strategy": run["strategy"]}}
    return runs


def test_config_diff_keeps_only_differing_keys_and_counts_the_equal_ones() -> None:
    runs = _runs(2)
    runs[0]["config"]["faults"]["p"], runs[1]["config"]["faults"]["p"] = 0.0, 0.1
    runs[0]["config"]["seed"] = runs[1]["config"]["seed"] = 7
    runs[1]["config"]["optim"] = {"lr": 0.001}  # a key only one run has differs
    rows, equal = config_diff(runs)
    a, b = (str(r["id"]) for r in runs)
    assert rows == [{"key": "faults.p", a: 0.0, b: 0.1}, {"key": "optim.lr", a: None, b: 0.001}]
    assert equal == 4  # seed, model.d_model, model.layers, faults.strategy


def test_compare_page_overlays_curves_and_names_what_was_left_out() -> None:
    runs = _runs(3)
    metrics = {str(r["id"]): sample.val_loss_metrics(r["summary"]) for r in runs}
    html = compare_page({"runs": runs, "metrics": metrics, "errors": ["no run with id abc"]},
                        plotly_tag=_TAG, run_href=lambda i: f"/r/{i}",
                        sweep_href=lambda i: f"/s/{i}")
    assert "Left out: no run with id abc" in html
    assert 'data-figure="fig-compare"' in html and 'id="config-diff"' in html
    assert "key(s) are equal in every run and hidden" in html
    for run in runs:
        assert f'href="/r/{run["id"]}"' in html
    assert html.count('class="export"') == 3  # curve data, runs, config diff


def test_compare_page_with_fewer_than_two_runs_explains_how_to_pick() -> None:
    html = compare_page({"runs": [], "metrics": {}, "errors": ["not a run id: 'x'"]},
                        plotly_tag=_TAG, run_href=str, sweep_href=str)
    assert "Pick at least two runs" in html and "not a run id: &#x27;x&#x27;" in html
    assert "fig-compare" not in html


def test_run_ids_are_split_deduplicated_and_bad_ones_named() -> None:
    a, b = sample.runs()[0]["id"], sample.runs()[1]["id"]
    ids, bad = queries._parse_run_ids([f"{a}, {b},,nope", a])
    assert [str(i) for i in ids] == [a, b] and bad == ["nope"]


def test_index_tag_filter_accepts_a_tag_and_names_a_bad_one() -> None:
    filters, errors = queries._parse_filters({"tag": "ablation:v2"})
    assert filters == {"tag": "ablation:v2"} and errors == []
    filters, errors = queries._parse_filters({"tag": "two words"})
    assert filters == {} and errors and errors[0].startswith("tag: 'two words' is not a tag")


def _index_view() -> dict[str, Any]:
    runs = _runs(2)
    runs[0].update(sweep_name="grid <a>", tags=["baseline", "v2"])
    runs[1].update(sweep_id=None)
    sweep = {"id": sample.SWEEP_ID, "name": "grid", "status": "cancelled", "tags": ["v2"],
             "runs_total": 2, "runs_completed": 1, "arms": ["ssn"]}
    return {"filters": {}, "errors": [], "sweeps": [sweep], "runs": runs}


def test_index_runs_show_their_sweep_tags_and_a_selection_for_compare() -> None:
    html = pages.index_page(_index_view(), choices=queries.INDEX_FILTERS, action="/",
                            sweep_href=lambda i: f"/s/{i}", run_href=lambda i: f"/r/{i}")
    assert f'<a href="/s/{sample.SWEEP_ID}">grid &lt;a&gt;</a>' in html
    assert '<td class="meta">standalone</td>' in html
    assert '<span class="tag">baseline</span><span class="tag">v2</span>' in html
    assert html.count('type="checkbox" name="runs"') == 2 and "Compare selected" in html
    assert 'name="tag"' in html and 'class="status-cancelled">cancelled' in html
    assert html.count('class="export"') == 2  # sweeps, recent runs


def _sweep_view(**sweep: Any) -> dict[str, Any]:
    return {"sweep": {"id": sample.SWEEP_ID, "name": "demo", "status": "completed", **sweep},
            "robustness": sample.robustness(), "table": sample.table(), "runs": sample.runs()}


def test_sweep_page_shows_tags_notes_and_links_its_prefect_flow_run() -> None:
    view = _sweep_view(tags=["paper"], notes="line one\n<b>two</b>", prefect_flow_run_id="fr-1")
    view["runs"][0]["tags"] = ["outlier"]
    html = pages.sweep_page(view, plotly_tag=_TAG, run_href=lambda i: f"/r/{i}",
                            flow_run_href=lambda f: f"http://prefect/runs/flow-run/{f}")
    assert '<span class="tag">paper</span>' in html
    assert '<span class="tag">outlier</span>' in html  # a run's tags, in the runs table
    assert "line one\n&lt;b&gt;two&lt;/b&gt;" in html
    assert 'href="http://prefect/runs/flow-run/fr-1"' in html
    assert html.count('class="export"') == 5  # 4 figures + the runs table
    assert html.count('type="checkbox" name="runs"') == len(sample.runs())
    unlinked = pages.sweep_page(view, plotly_tag=_TAG, compare_action=None)
    assert "<code>fr-1</code>" in unlinked and "http://prefect" not in unlinked
    assert 'type="checkbox"' not in unlinked


_HOSTILE = '</script><img src=x onerror=alert(1)>"\'&<!--'


def test_hostile_names_notes_and_config_never_escape_their_text_or_json() -> None:
    """Run and sweep names, notes, config keys and values are anyone's text: in every page they
    are escaped in HTML and can never close an embedded JSON `<script>` (or open a comment)."""
    runs = _runs(2)
    for run in runs:
        run.update(name=_HOSTILE, sweep_name=_HOSTILE, preset=_HOSTILE, notes=_HOSTILE,
                   config={**run["config"], _HOSTILE: _HOSTILE, "x": str(run["id"])})
    view = _index_view()
    view["runs"], view["sweeps"][0]["name"] = runs, _HOSTILE
    view["filters"], view["errors"] = {"q": _HOSTILE}, [_HOSTILE]
    metrics = {str(r["id"]): sample.val_loss_metrics(r["summary"]) for r in runs}
    rendered = {
        "index": pages.index_page(view, choices=queries.INDEX_FILTERS, action="/",
                                  sweep_href=str, run_href=str),
        "sweep": pages.sweep_page({**_sweep_view(notes=_HOSTILE), "runs": runs,
                                   "sweep": {"id": sample.SWEEP_ID, "name": _HOSTILE,
                                             "notes": _HOSTILE, "status": "completed"}},
                                  plotly_tag="", run_href=str),
        "compare": compare_page({"runs": runs, "metrics": metrics, "errors": [_HOSTILE]},
                                plotly_tag="", run_href=str, sweep_href=str),
    }
    for name, html in rendered.items():
        assert "<img" not in html and "<!--" not in html, name
        assert html.count("<script") == html.count("</script>"), name
