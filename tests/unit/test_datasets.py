"""`dashboards.datasets.export_links`: the embedded JSON block carries the rows exactly (column
order, unrounded numbers, NaN as null) and can never close its `<script>` early. The CSV the
browser builds from it is checked in Chromium by tests/browser/test_export.py."""
from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from typing import Any

from dashboards.datasets import export_links


class _Scripts(HTMLParser):
    """Collects each `<script>`'s type and text, and each link's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[tuple[str | None, str]] = []
        self.links: list[dict[str, str | None]] = []
        self._type: str | None = None
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "script":
            self._in_script, self._type = True, dict(attrs).get("type")
            self.scripts.append((self._type, ""))
        elif tag == "a":
            self.links.append(dict(attrs))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            kind, text = self.scripts[-1]
            self.scripts[-1] = (kind, text + data)


def _parse(markup: str) -> _Scripts:
    parser = _Scripts()
    parser.feed(markup)
    return parser


def _payload(markup: str) -> dict[str, Any]:
    blocks = [text for kind, text in _parse(markup).scripts if kind == "application/json"]
    assert len(blocks) == 1, "the rows are embedded exactly once"
    return json.loads(blocks[0])


def test_rows_are_embedded_once_with_first_row_column_order_and_exact_numbers() -> None:
    rows = [{"strategy": "reroute", "p": 0.1, "mean_pct": 0.1 + 0.2, "n_seeds": 3},
            {"strategy": "skip", "p": 1e-7, "mean_pct": -2.0000000000000004, "n_seeds": 2}]
    payload = _payload(export_links("robustness", rows, label="robustness curves"))
    assert payload["columns"] == ["strategy", "p", "mean_pct", "n_seeds"]
    assert payload["rows"] == rows
    assert payload["rows"][0]["mean_pct"] == 0.30000000000000004  # not rounded to 0.3


def test_script_text_in_values_cannot_end_the_json_block() -> None:
    evil = "</script><script>alert(1)</script><!--"
    markup = export_links("runs", [{"name": evil, "notes": "a & b > c"}], label="runs")
    parsed = _parse(markup)
    assert [kind for kind, _ in parsed.scripts] == ["application/json"]  # the download script is in the page head
    assert _payload(markup)["rows"] == [{"name": evil, "notes": "a & b > c"}]


def test_non_finite_numbers_become_null() -> None:
    rows = [{"loss": math.nan, "best": math.inf, "nested": {"x": -math.inf}, "ok": 1.5}]
    assert _payload(export_links("x", rows, label="x"))["rows"] == [
        {"loss": None, "best": None, "nested": {"x": None}, "ok": 1.5}]


def test_links_offer_csv_and_json_named_after_the_dataset() -> None:
    markup = export_links("sweep demo/runs", [{"a": 1}], label="runs table")
    links = _parse(markup).links
    assert [link["data-format"] for link in links] == ["csv", "json"]
    assert [link["download"] for link in links] == ["sweep-demo-runs.csv", "sweep-demo-runs.json"]
    assert all("runs table" in (link["title"] or "") for link in links)


def test_empty_rows_still_give_links_and_an_empty_dataset() -> None:
    markup = export_links("empty", [], label="runs")
    assert _payload(markup) == {"columns": [], "rows": []}
    assert len(_parse(markup).links) == 2
