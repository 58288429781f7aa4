"""The run page: what happened in one run, and why its loss is what it is.

Facts against the baseline, validation loss against the baseline, each replica's training loss,
the fault timeline, then the diagnostics a researcher checks next: what was done about the faults
(events counted by kind over the whole run), contributions made/missed/rejected, bytes on the
wire and where the wall time went. Every table and figure offers its rows as CSV and JSON. The
view is bounded for a big run by `api.dashboards.queries.run_view` (events and train-loss
points are capped; the counts are not, they are counted in SQL).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from crucible.grid.names import UNFINISHED_STATUSES
from dashboards import figures
from dashboards.datasets import export_links
from dashboards.pages._common import (
    Live,
    PrefectHref,
    RunHref,
    banner,
    document,
    esc,
    figure_html,
    flatten_config,
    fmt_num,
    fmt_pct,
    notes_html,
    owed_count,
    prefect_link,
    status_text,
    strategy_text,
)
from dashboards.pages._widgets import tag_chips
from dashboards.style import arm_label
from dashboards.timeline import fault_timeline

__all__ = ["run_page", "COUNTED"]

# (what, event kind, run summary's number): the run page's counts table, in this order
COUNTED: tuple[tuple[str, str | None, tuple[str, ...] | None], ...] = (
    ("failures (a stage of a replica going down)", "failure_start", ("faults",)),
    ("down steps bypassed (stage skipped)", "bypass", None),
    ("down steps dropped (the replica's tokens)", "drop", None),
    ("down steps rerouted (through a donor)", "reroute", None),
    ("rejoins (state reset)", "rejoin", None),
    ("contributions made", None, ("contributions", "made")),
    ("contributions missing", "contribution_missing", ("contributions", "missed")),
    ("contributions rejected", "contribution_rejected", ("contributions", "rejected")),
    ("manifests rejected", "manifest_rejected", ("manifests_rejected",)),
    ("checkpoints rejected on resume", "checkpoint_rejected", None),
    ("outer steps skipped (no contribution)", None, ("skipped_outer_steps",)),
)
_BYTES = (("boundary_forward", "boundary, forward"), ("boundary_backward", "boundary, backward"),
          ("boundary_rerouted", "boundary, rerouted (part of the two above)"),
          ("upload", "upload (SparseLoCo)"),
          ("dense_upload_equivalent", "dense upload equivalent"),
          ("upload_per_global_step", "upload per global step"))
_TIMING = (("inner_s", "inner steps (forward/backward)"), ("sync_s", "outer sync"),
           ("eval_s", "evaluation"))
# the outer sync's phases (crucible.sync.PHASES), shown under it where the run recorded them;
# `upload_s` is the upload threads' own time, beside the round, so it is no part of the sync's
_SYNC_PHASES = (("encode_s", "outer sync: encode"), ("upload_wait_s", "outer sync: waiting for uploads"),
                ("decode_s", "outer sync: decode"), ("aggregate_s", "outer sync: aggregate"),
                ("outer_s", "outer sync: outer step"),
                ("upload_s", "uploads (on threads, beside the sync)"))


def _config_table(config: Mapping[str, Any]) -> str:
    """Every resolved config key, sorted so a component's keys sit together, in a dense grid
    (about 60 keys: a one-column table would be a long scroll)."""
    cells = "".join(f"<div><code>{esc(k)}</code> = <code>{esc(json.dumps(v))}</code></div>"
                    for k, v in sorted(flatten_config(config)))
    return (f'<div class="config-grid" id="config">{cells}</div>' if cells
            else "<p>No config recorded.</p>")


def _run_title(run: Mapping[str, Any]) -> str:
    return (f"{arm_label(str(run.get('compression')))} · {strategy_text(run)}, "
            f"p = {fmt_pct(run.get('p'))}, seed {run.get('seed')}")


def _loss_series(view: Mapping[str, Any]) -> list[dict[str, Any]]:
    run, baseline = view["run"], view.get("baseline")
    series = [{"name": f"this run ({_run_title(run)})", "compression": run.get("compression"),
               "strategy": run.get("strategy"),
               "points": figures.val_loss_points(metrics=view.get("metrics"),
                                                 summary=run.get("summary"))}]
    if baseline and baseline.get("id") != run.get("id"):
        series.append({"name": f"baseline ({arm_label(str(baseline.get('compression')))}, p = 0,"
                               f" seed {baseline.get('seed')})", "baseline": True,
                       "points": figures.val_loss_points(metrics=view.get("baseline_metrics"),
                                                         summary=baseline.get("summary"))})
    return series


def _loss_rows(view: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The validation-loss points drawn, as metric-shaped rows (run_id says run or baseline)."""
    rows = []
    runs = [(view["run"], view.get("metrics"))]
    if view.get("baseline") and view["baseline"].get("id") != view["run"].get("id"):
        runs.append((view["baseline"], view.get("baseline_metrics")))
    for run, metrics in runs:
        for tokens, value in figures.val_loss_points(metrics=metrics, summary=run.get("summary")):
            rows.append({"run_id": run.get("id"), "name": "val_loss", "tokens": tokens,
                         "value": value})
    return rows


def _facts(run: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> str:
    base_final = (baseline or {}).get("final_val_loss")
    final = run.get("final_val_loss")
    rel = (f"{100.0 * (final - base_final) / base_final:+.2f}%"
           if isinstance(final, (int, float)) and base_final else "—")
    budget, done = run.get("tokens_budget"), run.get("tokens_processed")
    facts = [("status", status_text(run)),
             ("initial val loss", fmt_num(run.get("initial_val_loss"), ".4f")),
             ("final val loss", fmt_num(final, ".4f")),
             ("baseline final val loss", fmt_num(base_final, ".4f")),
             ("increase vs baseline", rel),
             ("tokens processed / budget", f"{fmt_num(done, ',.0f')} / {fmt_num(budget, ',.0f')}"),
             ("failure duration", f"{esc(run.get('duration'))} global steps"),
             ("wall time", _seconds((run.get("summary") or {}).get("wall_s"))),
             ("preset", esc(run.get("preset")))]
    ids = {"status": "run-status", "final val loss": "final-loss"}  # what a reader watches
    rows = "".join(f"<tr><th>{k}</th><td{f' id={ids[k]}' if k in ids else ''}>{v}</td></tr>"
                   for k, v in facts)
    export = export_links(f"run-{run.get('id')}-facts", [{
        "id": run.get("id"), "status": run.get("status"),
        "initial_val_loss": run.get("initial_val_loss"), "final_val_loss": final,
        "baseline_run_id": (baseline or {}).get("id"), "baseline_final_val_loss": base_final,
        "tokens_processed": done, "tokens_budget": budget, "duration": run.get("duration"),
        "wall_s": (run.get("summary") or {}).get("wall_s"), "preset": run.get("preset")}],
        label="run facts")
    return f'<table class="data" id="facts">{rows}</table>{export}'


def _seconds(value: Any) -> str:
    return f"{fmt_num(value, ',.1f')} s" if isinstance(value, (int, float)) else "—"


def _summary_number(summary: Mapping[str, Any], path: tuple[str, ...] | None) -> Any:
    """The number at `path` in the run summary (a list counts its items); None if absent."""
    value: Any = summary
    for key in path or ():
        value = value.get(key) if isinstance(value, Mapping) else None
    if isinstance(value, list):
        return len(value)
    return value if path and isinstance(value, (int, float)) else None


def _table(table_id: str, head: Sequence[str], rows: Sequence[Sequence[str]], export: str) -> str:
    cells = "".join("<tr>" + "".join(f"<td{' class=num' if i else ''}>{c}</td>"
                                     for i, c in enumerate(row)) + "</tr>" for row in rows)
    heading = "".join(f"<th>{h}</th>" for h in head)
    return (f'<section class="card"><table class="data" id="{table_id}"><tr>{heading}</tr>'
            f"{cells}</table>{export}</section>")


def _counts_table(run: Mapping[str, Any], counts: Mapping[str, int]) -> str:
    """What was done about the faults: each event kind counted over the whole run, beside the
    run summary's own counter where it keeps one (they agree for a complete run)."""
    summary = run.get("summary") or {}
    rows, export = [], []
    for what, kind, path in COUNTED:
        events = counts.get(kind, 0) if kind else None
        total = _summary_number(summary, path)
        rows.append((esc(what), fmt_num(events, ",d"), fmt_num(total, ",d")))
        export.append({"what": what, "event_kind": kind, "events": events, "summary": total})
    return _table("counts", ("what", "events", "run summary"), rows,
                  export_links(f"run-{run.get('id')}-counts", export, label="counts"))


def _bytes_table(run: Mapping[str, Any]) -> str:
    counters = (run.get("summary") or {}).get("bytes") or {}
    rows, export = [], []
    for key, label in _BYTES:
        value = counters.get(key)
        rows.append((esc(label), fmt_num(value / 1e6 if isinstance(value, (int, float)) else None,
                                         ",.3f")))
        export.append({"counter": key, "bytes": value})
    return _table("bytes", ("bytes sent", "MB"), rows,
                  export_links(f"run-{run.get('id')}-bytes", export, label="bytes"))


def _timing_table(run: Mapping[str, Any]) -> str:
    """Where the wall time went: the trainer's timers (the outer sync's phases under it, where
    recorded), the rest (setup, checkpoints, reporting) as "other", each with its share of the
    wall time."""
    summary = run.get("summary") or {}
    timing, wall = summary.get("timing") or {}, summary.get("wall_s")
    parts = [(key, label, timing.get(key)) for key, label in _TIMING]
    timed = [v for _k, _l, v in parts if isinstance(v, (int, float))]
    if isinstance(wall, (int, float)) and timed:
        parts.append(("other_s", "other (setup, checkpoints, reporting)",
                      max(0.0, wall - sum(timed))))
    at = next(i for i, (key, _l, _v) in enumerate(parts) if key == "sync_s") + 1
    parts[at:at] = [(key, label, timing[key]) for key, label in _SYNC_PHASES
                    if isinstance(timing.get(key), (int, float))]
    parts.append(("wall_s", "wall time", wall))
    rows, export = [], []
    for key, label, value in parts:
        share = (100.0 * value / wall if isinstance(value, (int, float))
                 and isinstance(wall, (int, float)) and wall > 0 else None)
        rows.append((esc(label), _seconds(value), fmt_num(share, ".1f") + ("%" if share is not None
                                                                       else "")))
        export.append({"part": key, "seconds": value, "share_of_wall_pct": share})
    return _table("timing", ("time", "seconds", "share"), rows,
                  export_links(f"run-{run.get('id')}-timing", export, label="timing"))


def _faults(summary: Mapping[str, Any], events: Sequence[Mapping[str, Any]]
            ) -> list[dict[str, Any]]:
    """The run's faults: its summary's plan once it has one; while it runs (no summary yet),
    the failures that started so far, from its failure_start events (detail.duration)."""
    if summary.get("faults"):
        return list(summary["faults"])
    return [{"replica": e.get("replica"), "stage": e.get("stage"), "start": e.get("global_step"),
             "duration": (e.get("detail") or {}).get("duration")}
            for e in events if e.get("kind") == "failure_start"]


def _header(run: Mapping[str, Any], *, sweep_href: Callable[[str], str] | None,
            prefect_href: PrefectHref | None) -> list[str]:
    nav = ""
    if sweep_href and run.get("sweep_id"):
        nav = f'<nav><a href="{esc(sweep_href(str(run["sweep_id"])))}">&larr; sweep</a></nav>'
    meta = [f'id <code>{esc(run.get("id"))}</code>']
    if run.get("name"):
        meta.insert(0, f"<b>{esc(run['name'])}</b>")
    flow = prefect_link(run.get("prefect_flow_run_id"), prefect_href)
    if flow:
        meta.append(flow)
    chips = tag_chips(run.get("tags"))
    return [nav, f"<h1>Run: {esc(_run_title(run))}</h1>",
            f'<p class="meta">{" · ".join(meta)}</p>',
            f'<p class="meta tags">tags: {chips}</p>' if chips else "",
            notes_html(run.get("notes"))]


def _banners(run: Mapping[str, Any], baseline: Mapping[str, Any] | None,
             run_href: RunHref | None, live: bool) -> list[str]:
    parts = []
    if owed_count(run):
        parts.append(banner("warn", f"<b>Incomplete.</b> This run owes {owed_count(run):,} records "
                                     "to the registry: its reporter could not deliver them yet "
                                     "(they wait in its spool). The figures miss them, and the "
                                     "run is not counted as finished until they arrive "
                                     "(<code>crucible api replay</code>)."))
    elif run.get("status") in UNFINISHED_STATUSES:
        follow = ("this page updates itself as records arrive" if live
                  else "reload to see progress")
        parts.append(banner("info", "This run is still in progress; figures show what has been "
                                     f"recorded so far ({follow})."))
    if baseline is None and (run.get("p") or 0) > 0:
        parts.append(banner("warn", "<b>Missing baseline.</b> No finished no-failure run (p = 0) "
                                     "of this arm and seed; the loss is shown alone."))
    elif baseline is not None and run_href and baseline.get("id") != run.get("id"):
        parts.append(f'<p class="meta">baseline run: <a href="{esc(run_href(str(baseline["id"])))}'
                     f'">{esc(str(baseline["id"])[:8])}</a></p>')
    return parts


def run_page(view: Mapping[str, Any], *, plotly_tag: str,
             sweep_href: Callable[[str], str] | None = None,
             run_href: RunHref | None = None, prefect_href: PrefectHref | None = None,
             live: Live | None = None) -> str:
    """One run: facts, validation loss against its baseline, training loss per replica, fault
    timeline, counts, bytes, timing and config; each table and figure with CSV/JSON links.

    `view` = `api.dashboards.queries.run_view`'s {"run", "metrics", "train_loss", "events",
    "event_counts", "baseline", "baseline_metrics"} (the last five may be missing). A run
    without a baseline or without failures says so. `prefect_href` links the Prefect flow run
    (None: its id only); `live` makes the page refresh itself while the run is unfinished.
    """
    run, baseline = view["run"], view.get("baseline")
    config = run.get("config") or {}
    summary = run.get("summary") or {}
    ident = f"run-{run.get('id')}"
    events = list(view.get("events") or [])
    faults = _faults(summary, events)
    timeline = fault_timeline(
        faults=faults, events=events,
        strategy=str(run.get("strategy") or (config.get("faults") or {}).get("strategy")),
        replicas=config.get("replicas"),
        global_steps=(config.get("train") or {}).get("global_steps"))
    train_rows = list(view.get("train_loss") or [])
    parts = [
        *_header(run, sweep_href=sweep_href, prefect_href=prefect_href),
        *_banners(run, baseline, run_href, live is not None),
        _facts(run, baseline),
        figure_html(figures.loss_curves(_loss_series(view)), "fig-loss",
                    extra=export_links(f"{ident}-val-loss", _loss_rows(view),
                                       label="validation loss")),
        figure_html(figures.train_loss_per_replica(train_rows), "fig-train",
                    extra=export_links(f"{ident}-train-loss", train_rows,
                                       label="train loss per replica")),
        figure_html(timeline, "fig-faults",
                    extra=export_links(f"{ident}-faults", faults, label="faults")
                    + export_links(f"{ident}-events", events, label="events")),
        "<h2>Diagnostics</h2>", '<div class="grid">',
        _counts_table(run, view.get("event_counts") or {}),
        '<div>', _bytes_table(run), _timing_table(run), "</div>", "</div>",
        "<h2>Resolved config</h2>", _config_table(config),
        export_links(f"{ident}-config", [{"key": k, "value": v}
                                         for k, v in sorted(flatten_config(config))],
                     label="config"),
    ]
    return document(f"Crucible run {run.get('id')}", "".join(parts), plotly_tag, live=live)
