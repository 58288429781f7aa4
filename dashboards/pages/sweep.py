"""The sweep overview page.

Its tags, notes and Prefect flow run head the page; each figure and the runs table offer their
data as CSV and JSON (`dashboards.datasets`, REST field names); runs can be ticked and compared.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from crucible.stats import claim_rows
from dashboards import accounting, figures
from dashboards.datasets import export_links, robustness_rows, run_rows, table_rows
from dashboards.pages._common import (
    Live,
    PrefectHref,
    RunHref,
    banner,
    document,
    esc,
    figure_html,
    fmt_num,
    fmt_pct,
    is_finished,
    notes_html,
    owed_count,
    prefect_link,
    status_text,
    strategy_text,
)
from dashboards.pages._costs import cost_panel
from dashboards.pages._widgets import (
    COMPARE_PATH,
    compare_form,
    select_cell,
    select_header,
    tag_chips,
)
from dashboards.style import arm_label

__all__ = ["sweep_page", "claims_panel"]


def _sweep_banners(sweep: Mapping[str, Any], robustness: Mapping[str, Any],
                   runs: Sequence[Mapping[str, Any]], *, live: bool = False) -> list[str]:
    """Status banners; `live`: the served page refreshes itself (an offline file cannot)."""
    banners = []
    progress = ("this page updates itself as they do" if live else "reload to see progress")
    finished = sum(1 for r in runs if is_finished(r))
    pending = int(robustness.get("pending_runs") or 0)
    running = sweep.get("status") in {"pending", "running"} or (
        pending > 0 and sweep.get("status") not in {"cancelled", "failed"})
    if not runs:
        banners.append(banner("info", "This sweep has no runs yet. The page fills in as runs "
                                       f"finish; {progress}."))
    elif running:
        banners.append(banner("info", f"This sweep is still running: <b>{finished} of "
                                       f"{len(runs)}</b> runs finished. The figures show what "
                                       f"is done so far; {progress}."))
    owing = [r for r in runs if owed_count(r)]
    if owing:
        banners.append(banner("warn", f"{len(owing)} run(s) still owe records to the registry "
                                       f"({sum(owed_count(r) for r in owing):,} in all: their "
                                       "reporter could not deliver them yet). They count as "
                                       "unfinished and are left out of the numbers until the "
                                       "records arrive (<code>crucible api replay</code>)."))
    failed = [r for r in runs if r.get("status") == "failed"]
    if failed:
        banners.append(banner("error", f"{len(failed)} run(s) failed and are left out of the "
                                        "numbers; see the runs table below."))
    cancelled = [r for r in runs if r.get("status") == "cancelled"]
    if sweep.get("status") == "cancelled" or cancelled:
        banners.append(banner("warn", f"<b>Cancelled.</b> This sweep was cancelled; "
                                       f"{len(cancelled)} run(s) did not finish and are left out "
                                       "of the numbers."))
    missing = robustness.get("missing_baselines") or []
    if missing:
        items = ", ".join(f"{esc(arm_label(str(m.get('compression'))))} seed {esc(m.get('seed'))}"
                          f" (duration {esc(m.get('duration'))})" for m in missing)
        banners.append(banner("warn", "<b>Missing baseline.</b> No finished no-failure run "
                                       f"(p = 0) for: {items}. Runs of those arms and seeds "
                                       "cannot be compared and are left out of the curves and "
                                       "the table."))
    return banners


_VERDICT_CLASS = {"agrees": "ok", "disagrees": "bad", "not resolved": "open",
                  "not run yet": "none"}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def _interval(c: Mapping[str, Any]) -> str:
    mean, lo, hi = _number(c.get("mean")), _number(c.get("ci_low")), _number(c.get("ci_high"))
    if mean is None:
        return "not run yet"
    if lo is None or hi is None:
        return f"{mean:+.2f} (1 seed, no interval)"
    return f"{mean:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def _width(c: Mapping[str, Any], target: float) -> str:
    half = _number(c.get("half_width"))
    if half is None:
        return "—"
    mark = "≤" if half <= target else "&gt;"
    cls = "ok" if half <= target else "open"
    return f'<span class="width-{cls}">±{half:.2f} {mark} {target:g}</span>'


def _count(value: Any) -> str | None:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _seeds(c: Mapping[str, Any], max_seeds: str) -> str:
    need, have, decide = (_count(c.get(k)) for k in ("seeds_for_target", "n_seeds",
                                                      "seeds_to_decide"))
    beyond = f"&gt; {max_seeds}"
    text = need if need is not None else (beyond if c.get("sd") is not None else "—")
    if c.get("status") == "unresolved":
        text += f" · decides at {decide if decide is not None else beyond}"
    return f"{have or '0'} / {text}"


def claims_panel(claims: Mapping[str, Any], export: str = "") -> str:
    """The Claims panel: per claim of the blog its verdict, and per comparison the paired 95%
    interval against the reference value (the blog's, or the sweep spec's own `references`),
    the half-width against the sweep's target, and the seeds it has / needs for the target
    (· the seeds that would decide it, if unresolved)."""
    if claims.get("error"):
        return (f'<section id="claims"><h2>Claims</h2>'
                f'{banner("info", esc(claims["error"]))}</section>')
    items = claims.get("claims") or []
    if not items:
        return ""
    target = _number(claims.get("target_half_width")) or 0.5
    own = claims.get("references") == "spec"
    source = "the sweep spec's references" if own else "the blog's Table 1"
    head = ("<tr><th>claim</th><th>verdict</th><th>comparison</th><th>status</th>"
            "<th>paired 95% interval, points</th><th>reference</th><th>half-width vs target</th>"
            "<th>seeds: have / need for target</th></tr>")
    rows = []
    for claim in items:
        comparisons = claim.get("comparisons") or [{}]
        verdict = str(claim.get("verdict"))
        most = _count(claim.get("max_seeds")) or "1000"
        span = f' rowspan="{len(comparisons)}"'
        lead = (f'<td{span} title="{esc(claim.get("rule"))}"><b>({esc(claim.get("tag"))})</b> '
                f'{esc(claim.get("title"))}<br><small>{"reference" if own else "blog"}: '
                f'{esc(claim.get("blog"))}</small></td>'
                f'<td{span} class="verdict verdict-{_VERDICT_CLASS.get(verdict, "none")}" '
                f'data-claim="{esc(claim.get("tag"))}">{esc(verdict)}</td>')
        for i, c in enumerate(comparisons):
            ref = _number(c.get("reference"))
            cells = (f"<td>{esc(c.get('label') or '—')}</td>"
                     f"<td class=\"status-{esc(c.get('status'))}\">{esc(c.get('status') or '—')}</td>"
                     f"<td class=num>{esc(_interval(c)) if c else '—'}</td>"
                     f"<td class=num>{'—' if ref is None else f'{ref:+.2f}'}</td>"
                     f"<td class=num>{_width(c, target)}</td>"
                     f"<td class=num>{_seeds(c, most) if c else '—'}</td>")
            rows.append(f"<tr>{lead if i == 0 else ''}{cells}</tr>")
    duration = claims.get("duration")
    note = (f'<p class="meta">Decided on paired 95% intervals over seeds, in points of each '
            f"arm's own no-failure loss"
            f"{f' (failure duration {esc(duration)})' if duration is not None else ''}; "
            f"close = ±{_number(claims.get('close_margin')) or 0.5:g}, equivalence = "
            f"±{_number(claims.get('equivalence_margin')) or 0.5:g}, target half-width "
            f"±{target:g}; reference values: {source}. A verdict never rests on one seed; "
            f"hover a claim for its rule.</p>")
    return (f'<section id="claims"><h2>Claims</h2>{note}'
            f'<table class="data" id="claims-table">{head}{"".join(rows)}</table>'
            f"{export}</section>")


def _relative(run: Mapping[str, Any], finals: Mapping[str, float]) -> str:
    base = finals.get(str(run.get("baseline_run_id")))
    final = run.get("final_val_loss")
    if base and isinstance(final, (int, float)):
        return f"{100.0 * (final - base) / base:+.2f}%"
    return "—"


def _runs_table(runs: Sequence[Mapping[str, Any]], run_href: RunHref | None,
               selectable: bool) -> str:
    finals = {str(r["id"]): r["final_val_loss"] for r in runs
              if isinstance(r.get("final_val_loss"), (int, float))}
    ordered = sorted(runs, key=lambda r: (str(r.get("compression")), r.get("strategy") or "",
                                          r.get("p") or 0, r.get("seed") or 0))
    head = (f"<tr>{select_header() if selectable else ''}"
            "<th>arm</th><th>strategy</th><th>p</th><th>seed</th><th>status</th>"
            "<th>final val loss</th><th>vs baseline</th><th>tokens (% of budget)</th>"
            "<th>run</th><th>tags</th></tr>")
    rows = []
    for run in ordered:
        budget, done = run.get("tokens_budget"), run.get("tokens_processed")
        share = fmt_num(100.0 * done / budget, ".1f") if budget and done is not None else "—"
        run_id = str(run.get("id"))
        link = (f'<a href="{esc(run_href(run_id))}">{esc(run_id[:8])}</a>' if run_href
                else f"<code>{esc(run_id[:8])}</code>")
        status = "running" if owed_count(run) else esc(run.get("status"))
        rows.append(
            f"<tr>{select_cell(run_id, run_id[:8]) if selectable else ''}"
            f"<td>{esc(arm_label(str(run.get('compression'))))}</td>"
            f"<td>{esc(strategy_text(run))}</td><td class=num>{fmt_pct(run.get('p'))}</td>"
            f"<td class=num>{esc(run.get('seed'))}</td>"
            f'<td class="status-{status}">{status_text(run)}</td>'
            f"<td class=num>{fmt_num(run.get('final_val_loss'), '.4f')}</td>"
            f"<td class=num>{_relative(run, finals)}</td><td class=num>{share}</td>"
            f"<td>{link}</td><td>{tag_chips(run.get('tags'))}</td></tr>")
    return f'<table class="data" id="runs">{head}{"".join(rows)}</table>'


def _token_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("id", "compression", "strategy", "p", "seed", "status", "tokens_budget",
            "tokens_processed")
    return [{key: run.get(key) for key in keys} for run in runs]


def _byte_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each run's byte counters (its `summary.bytes`, by counter name)."""
    rows = []
    for run in runs:
        counters = (run.get("summary") or {}).get("bytes") or {}
        rows.append({**{key: run.get(key) for key in ("id", "compression", "strategy", "p",
                                                       "seed", "status")},
                     **{kind: counters.get(kind) for kind, _label in accounting.BYTE_KINDS}})
    return rows


def _meta(sweep: Mapping[str, Any], finished: int, total: int,
          flow_run_href: PrefectHref | None) -> str:
    status = esc(sweep.get("status"))
    flow = prefect_link(sweep.get("prefect_flow_run_id"), flow_run_href)
    tags = tag_chips(sweep.get("tags"))
    return (f'<p class="meta">id <code>{esc(sweep.get("id"))}</code> · status '
            f"<b>{status}</b> · {finished} of {total} "
            f'runs finished{f" · <span id=flow-run>{flow}</span>" if flow else ""}</p>'
            + (f'<p class="tags" id="sweep-tags">{tags}</p>' if tags else "")
            + notes_html(sweep.get("notes")))


def sweep_page(view: Mapping[str, Any], *, plotly_tag: str,
               run_href: RunHref | None = None,
               flow_run_href: PrefectHref | None = None,
               compare_action: str | None = COMPARE_PATH, live: Live | None = None) -> str:
    """The sweep overview: tags, notes, status banners, the Claims panel, robustness curves,
    Table 1, tokens, bytes, costs (dashboards.costs), runs; every figure and table with CSV/JSON
    downloads of its data.

    `view` = {"sweep": {id, name, status, tags, notes, ...}, "robustness": ..., "table": ...,
    "claims": ..., "costs": [...], "runs": [...]} in the registry's shapes. `run_href` maps a run id to its page (None: no
    links); `flow_run_href` a Prefect flow-run id to its page in the Prefect UI (None: the id is
    shown without a link); `compare_action` is the compare page (None: runs cannot be selected,
    as in the offline file); `live` makes the served page refresh itself while the sweep runs.
    Always returns a full page, whatever is missing.
    """
    sweep, runs = view.get("sweep") or {}, list(view.get("runs") or [])
    robustness = view.get("robustness") or {}
    name = sweep.get("name") or sweep.get("id")
    finished = sum(1 for r in runs if is_finished(r))
    items = robustness_rows(robustness.get("items") or [])
    table = _runs_table(runs, run_href, compare_action is not None) if runs else ""
    parts = [
        f"<h1>Sweep: {esc(name)}</h1>",
        _meta(sweep, finished, len(runs), flow_run_href),
        *_sweep_banners(sweep, robustness, runs, live=live is not None),
        claims_panel(view.get("claims") or {},
                     export_links(f"{name}-claims", claim_rows(view.get("claims") or {}),
                                  label="claims")),
        figure_html(figures.robustness_curves(robustness), "fig-robustness",
                    extra=export_links(f"{name}-robustness", items, label="robustness curves")),
        figure_html(figures.robustness_table(view.get("table") or {}), "fig-table",
                    extra=export_links(f"{name}-table-1", table_rows(view.get("table") or {}),
                                       label="Table 1")),
        '<div class="grid">',
        figure_html(accounting.token_accounting(runs), "fig-tokens",
                    extra=export_links(f"{name}-tokens", _token_rows(runs),
                                       label="token accounting")),
        figure_html(accounting.bytes_sent(runs), "fig-bytes",
                    extra=export_links(f"{name}-bytes", _byte_rows(runs), label="bytes sent")),
        "</div>",
        cost_panel(view.get("costs") or []),
        f"<h2>Runs ({len(runs)})</h2>",
        (compare_form(table, compare_action) if compare_action else table) if runs
        else "<p>No runs yet.</p>",
        export_links(f"{name}-runs", run_rows(runs), label="runs"),
    ]
    return document(f"Crucible sweep {name}", "".join(parts), plotly_tag, live=live)


