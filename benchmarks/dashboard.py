"""Benchmark: time to build the sweep dashboard page for a 200-run sweep, and its size.

Builds the page from synthetic registry-shaped data (`dashboards.sample`: 3 arms x 4 strategies,
4 failure rates, 4 seeds, trimmed to 200 runs), both as served (plotly.js by URL) and as the
offline file (plotly.js inlined). The plain reference, measured in the same run, is serialising
the same view as JSON (what the API's JSON endpoints cost for the same data): the table reports
page time as a ratio of it. Prints one JSON object.

    .venv/bin/python benchmarks/dashboard.py [--runs 200] [--repeat 7]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from dashboards import pages, sample

_log = logging.getLogger(__name__)
ARMS = ("none", "ssn", "mapl")
STRATEGIES = ("skip", "drop", "drop_extend", "reroute")
PS = (0.0, 0.05, 0.1, 0.15, 0.2)


def _view(n_runs: int) -> dict[str, Any]:
    seeds = 1
    while len(sample.runs(seeds=seeds, arms=ARMS, strategies=STRATEGIES, ps=PS)) < n_runs:
        seeds += 1
    runs = sample.runs(seeds=seeds, arms=ARMS, strategies=STRATEGIES, ps=PS)
    runs = sorted(runs, key=lambda r: r["p"] > 0)[:n_runs]  # keep every baseline
    robust = sample.robustness(seeds=seeds, arms=ARMS, strategies=STRATEGIES, ps=PS)
    return {"sweep": {"id": sample.SWEEP_ID, "name": "benchmark", "status": "completed"},
            "robustness": robust, "table": sample.table(robust), "runs": runs}


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs in the synthetic sweep")
    parser.add_argument("--repeat", type=int, default=7, help="timed repetitions (median)")
    args = parser.parse_args()
    view = _view(args.runs)
    inline = pages.inline_plotly_tag()
    served_html = pages.sweep_page(view, plotly_tag=pages.served_plotly_tag(),
                                   run_href=lambda i: f"/dashboards/runs/{i}")
    offline_html = pages.sweep_page(view, plotly_tag=inline)
    reference_s = _median_s(lambda: json.dumps(view), args.repeat)
    served_s = _median_s(lambda: pages.sweep_page(view, plotly_tag=pages.served_plotly_tag(),
                                                  run_href=lambda i: i), args.repeat)
    offline_s = _median_s(lambda: pages.sweep_page(view, plotly_tag=pages.inline_plotly_tag()),
                          args.repeat)
    result = {
        "runs": len(view["runs"]), "repeat": args.repeat,
        "served_page_s": round(served_s, 4), "offline_report_s": round(offline_s, 4),
        "reference_json_dumps_s": round(reference_s, 5),
        "served_vs_reference": round(served_s / reference_s, 1),
        "served_page_bytes": len(served_html.encode()),
        "offline_report_bytes": len(offline_html.encode()),
        "plotly_js_bytes": len(inline.encode()),
        "view_json_bytes": len(json.dumps(view).encode()),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
