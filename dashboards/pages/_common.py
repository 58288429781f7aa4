"""Shared page parts: the document shell and CSS, figure cards, banners, number and status
formatting, and the 404 page. Every page module builds on these."""
from __future__ import annotations

import functools
import html
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly
import plotly.graph_objects as go

from dashboards import style
from dashboards.datasets import EXPORT_SCRIPT

__all__ = ["PLOTLY_JS_PATH", "PLOTLY_JS_URL", "served_plotly_tag", "inline_plotly_tag",
           "not_found_page", "RunHref", "esc", "banner", "document", "figure_html",
           "is_finished", "fmt_num", "owed_count", "fmt_pct", "status_text", "strategy_text",
           "flatten_config", "Live", "notes_html", "prefect_link", "PrefectHref"]

PLOTLY_JS_PATH = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
PLOTLY_JS_URL = "/dashboards/static/plotly.min.js"
RunHref = Callable[[str], str]  # run id -> link target
PrefectHref = Callable[[str], str]  # Prefect flow-run id -> its page in the Prefect UI
_DONE = frozenset({"completed", "finished"})  # the registry says "completed"

_FIGURE_CONFIG = {"displaylogo": False, "responsive": True,
                  "modeBarButtonsToRemove": ["lasso2d", "select2d"]}

_CSS = """
:root { --ink:#1f2328; --muted:#59636e; --line:#d0d7de; --accent:#0072B2; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif;
       color: var(--ink); margin: 0; background: #f6f8fa; }
main { max-width: 1240px; margin: 0 auto; padding: 20px 24px 48px; }
h1 { font-size: 24px; margin: 8px 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; }
.meta { color: var(--muted); margin: 0 0 12px; font-size: 14px; }
.meta code { font-size: 13px; }
.card { background: white; border: 1px solid var(--line); border-radius: 8px; padding: 8px;
        margin: 12px 0; }
/* Fixed tracks: a figure is laid out when its script runs, before later cards exist. */
.grid { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 12px; }
@media (max-width: 1000px) { .grid { grid-template-columns: minmax(0, 1fr); } }
.grid .card { margin: 0; }
.banner { border-radius: 8px; padding: 10px 14px; margin: 10px 0; font-size: 15px; }
.banner.info { background: #ddf4ff; border: 1px solid #54aeff; }
.banner.warn { background: #fff8c5; border: 1px solid #d4a72c; }
.banner.error { background: #ffebe9; border: 1px solid #ff8182; }
table.data { border-collapse: collapse; width: 100%; background: white; font-size: 14px; }
table.data th, table.data td { border-bottom: 1px solid var(--line); padding: 6px 10px;
        text-align: left; }
table.data th { background: #eef2f6; position: sticky; top: 0; }
table.data#facts { max-width: 640px; }
table.data#facts th { position: static; }
table.data td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status-completed, .status-finished { color: #1a7f37; } .status-failed { color: #cf222e; }
td.verdict { font-weight: 600; } .verdict-ok { color: #1a7f37; } .verdict-bad { color: #cf222e; }
.verdict-open { color: #9a6700; } .verdict-none { color: #57606a; }
.status-supports { color: #1a7f37; } .status-contradicts { color: #cf222e; }
.status-unresolved { color: #9a6700; } .status-missing { color: #57606a; }
.width-ok { color: #1a7f37; } .width-open { color: #9a6700; }
.status-running, .status-pending, .status-queued { color: #9a6700; }
.status-cancelled { color: #57606a; }
a { color: var(--accent); }
nav { font-size: 14px; margin-bottom: 4px; }
.config-grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr));
        gap: 2px 16px; background: white; border: 1px solid var(--line); border-radius: 8px;
        padding: 10px 14px; font-size: 13px; }
.config-grid div { padding: 2px 0; border-bottom: 1px solid #eef2f6; }
footer { color: var(--muted); font-size: 12px; margin-top: 32px; }
form.filters { display: flex; flex-wrap: wrap; gap: 8px 12px; align-items: end; font-size: 14px;
        background: white; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
form.filters label { display: flex; flex-direction: column; gap: 2px; color: var(--muted); }
form.filters input, form.filters select { font: inherit; padding: 4px 6px; }
.export { display: block; text-align: right; font-size: 12px; color: var(--muted);
        margin: 2px 6px 10px; } .export a { margin-left: 6px; }
.compare-bar { margin: 6px 0; font-size: 14px; } td.select { width: 28px; }
.swatch { display: inline-block; width: 14px; height: 14px; border-radius: 3px; }
.scroll-x { overflow-x: auto; } .nowrap { white-space: nowrap; }
.visually-hidden { position: absolute; width: 1px; height: 1px; overflow: hidden;
        clip: rect(0 0 0 0); }
.live { position: fixed; top: 10px; right: 14px; font-size: 13px; padding: 3px 10px;
        border-radius: 12px; background: #ddf4ff; border: 1px solid #54aeff; z-index: 10; }
.live.done { background: #dafbe1; border-color: #4ac26b; }
.live.error { background: #ffebe9; border-color: #ff8182; }
.tag { display: inline-block; font-size: 12px; padding: 1px 8px; margin: 0 4px 2px 0;
        border-radius: 10px; background: #eef2f6; border: 1px solid var(--line); }
.notes { white-space: pre-wrap; background: white; border: 1px solid var(--line);
        border-radius: 8px; padding: 8px 12px; font-size: 14px; margin: 8px 0; }
"""


def served_plotly_tag(url: str = PLOTLY_JS_URL) -> str:
    """The tag that loads the API's local copy of plotly.js (no CDN)."""
    return f'<script src="{html.escape(url)}" charset="utf-8"></script>'


@functools.cache
def inline_plotly_tag() -> str:
    """The whole plotly.js library inlined in one `<script>` (for the offline file; read once)."""
    return f'<script type="text/javascript">{PLOTLY_JS_PATH.read_text(encoding="utf-8")}</script>'


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def figure_html(fig: go.Figure, div_id: str, *, extra: str = "") -> str:
    """A card holding the figure: its data as JSON (which a live page re-reads to update the
    drawn figure in place) and a one-line script that draws it; `extra` goes under it (export
    links). Needs only plotly.js on the page, so a card also works pasted into another page."""
    height = fig.layout.height or 450
    fig.update_layout(uirevision=div_id)  # a live update keeps the reader's zoom and legend
    config = json.dumps(_FIGURE_CONFIG)
    spec = fig.to_json(validate=False, pretty=False)[:-1] + f',"config":{config}}}'
    spec = spec.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    draw = (f"(function(){{var f=JSON.parse(document.querySelector('script[data-figure-json="
            f'"{div_id}"]\').textContent);Plotly.newPlot("{div_id}",f.data,f.layout,f.config);}})();')
    return (f'<section class="card figure" data-figure="{div_id}">'
            f'<div id="{div_id}" class="plotly-graph-div" style="height:{height}px; width:100%;">'
            f'</div><script type="application/json" data-figure-json="{div_id}">{spec}</script>'
            f'<script>{draw}</script>{extra}</section>')


@dataclass(frozen=True)
class Live:
    """A page that refreshes itself while its sweep or run is unfinished: the JSON state it
    polls (`state_url`) and the state's version when the page was rendered."""

    state_url: str
    version: str
    interval_s: float = 5.0


# The live loop (served pages only; the offline file has no server to ask). Every interval it
# asks the state URL for the version; when it changed, it fetches the page again and swaps the
# new <main> in: drawn figures are kept and updated with Plotly.react from the new page's JSON,
# other scripts (not figure drawing) run again (the compare form restores its ticked runs so),
# the scroll position is kept. A hidden tab polls
# every minute; errors show in the status pill and back off (up to a minute); a page rendered
# finished (no data-live-url) ends the loop.
_LIVE_JS = """(function(){
var body=document.body,url=body.dataset.liveUrl,version=body.dataset.liveVersion;
var base=1000*parseFloat(body.dataset.liveInterval||'5'),slow=60000,errors=0,timer=null;
var pill=document.getElementById('live-status');
function now(){return new Date().toTimeString().slice(0,8);}
function say(text,kind){pill.textContent=text;pill.className='live '+(kind||'');}
function later(ms){clearTimeout(timer);timer=setTimeout(poll,ms);}
function swap(doc){
  var main=document.querySelector('main'),x=window.scrollX,y=window.scrollY,draw=[];
  var incoming=document.importNode(doc.querySelector('main'),true);
  incoming.querySelectorAll('[data-figure]').forEach(function(card){
    var id=card.dataset.figure,json=card.querySelector('script[data-figure-json]');
    card.querySelectorAll('script:not([type])').forEach(function(s){s.remove();});
    var fresh=card.querySelector('.plotly-graph-div'),kept=document.getElementById(id);
    if(kept&&kept.closest('main')===main){
      kept.style.height=fresh.style.height;fresh.replaceWith(kept);fresh=kept;}
    draw.push([fresh,JSON.parse(json.textContent)]);
  });
  var rerun=Array.from(incoming.querySelectorAll('script:not([type="application/json"])'));
  main.replaceChildren.apply(main,Array.from(incoming.childNodes));
  rerun.forEach(function(old){var s=document.createElement('script');s.text=old.text;
    old.replaceWith(s);});
  draw.forEach(function(d){Plotly.react(d[0],d[1].data,d[1].layout,d[1].config);});
  document.title=doc.title;
  window.scrollTo(x,y);
}
async function poll(){
  try{
    var r=await fetch(url,{cache:'no-store',headers:{Accept:'application/json'}});
    if(!r.ok)throw new Error('state: HTTP '+r.status);
    var state=await r.json(),live=true;
    if(state.version!==version){
      var page=await fetch(location.href,{cache:'no-store',headers:{Accept:'text/html'}});
      if(!page.ok)throw new Error('page: HTTP '+page.status);
      var doc=new DOMParser().parseFromString(await page.text(),'text/html');
      if(!doc.querySelector('main'))throw new Error('page: no content');
      swap(doc);
      version=doc.body.dataset.liveVersion||state.version;
      live=Boolean(doc.body.dataset.liveUrl);
    }
    errors=0;
    if(state.finished||!live){say('finished · updated '+now(),'done');return;}
    say('live · updated '+now());
    later(document.hidden?slow:base);
  }catch(e){
    errors+=1;var wait=Math.min(slow,base*Math.pow(2,errors));
    say('live updates paused ('+e.message+'); retrying in '+Math.round(wait/1000)+' s','error');
    later(wait);
  }
}
document.addEventListener('visibilitychange',function(){if(!document.hidden)later(0);});
later(base);
})();"""


def document(title: str, body: str, plotly_tag: str, *, live: Live | None = None) -> str:
    """The whole page. With `live`, it polls `live.state_url` and refreshes itself in place
    (see _LIVE_JS) and shows a "live" pill; without, it is static (the offline file)."""
    live_attrs = live_part = ""
    # the download function of every export block (dashboards.datasets), once per page
    export_script = EXPORT_SCRIPT if 'class="export"' in body else ""
    if live is not None:
        live_attrs = (f' data-live-url="{esc(live.state_url)}" data-live-version='
                      f'"{esc(live.version)}" data-live-interval="{live.interval_s:g}"')
        live_part = (f'<div id="live-status" class="live" role="status" aria-live="polite">'
                     f'live</div><script>{_LIVE_JS}</script>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="icon" href="data:,">'
            f'<title>{esc(title)}</title><style>{_CSS}</style>{plotly_tag}{export_script}</head>'
            f'<body{live_attrs}><main>{body}<footer>Crucible robustness dashboard</footer></main>'
            f'{live_part}</body></html>')


def banner(kind: str, text: str) -> str:
    return f'<div class="banner {kind}" role="status">{text}</div>'


def owed_count(run: Mapping[str, Any]) -> int:
    """Records the run's reporter still holds (the registry has not got them): such a run is
    incomplete whatever its status says."""
    owed = run.get("owed_records")
    return owed if isinstance(owed, int) and owed > 0 else 0


def is_finished(run: Mapping[str, Any]) -> bool:
    return run.get("status") in _DONE and not owed_count(run)


def status_text(run: Mapping[str, Any]) -> str:
    owed = owed_count(run)
    status = esc(run.get("status"))
    return f"{status} · owes {owed:,} records" if owed else status


def fmt_pct(value: Any) -> str:
    return f"{100.0 * value:g}%" if isinstance(value, (int, float)) else "—"


def fmt_num(value: Any, spec: str) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return format(value, spec)
    return "—"



def strategy_text(run: Mapping[str, Any]) -> str:
    """A run's strategy; a baseline (strategy None in the registry) has none of its own."""
    return str(run.get("strategy") or style.BASELINE_LABEL)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(flatten_config(value, path + "."))
        else:
            out.append((path, value))
    return out



def notes_html(notes: Any) -> str:
    """Free-text notes, escaped, line breaks kept (empty string when there are none)."""
    return f'<div class="notes">{esc(notes)}</div>' if notes else ""


def prefect_link(flow_run_id: Any, href: PrefectHref | None) -> str:
    """The Prefect flow run: a link to its page when the Prefect UI's address is configured
    (`CRUCIBLE_PREFECT_UI_URL`), else its id; empty string for no flow run."""
    if not flow_run_id:
        return ""
    ident = f"<code>{esc(flow_run_id)}</code>"
    if href is None:
        return f"Prefect flow run {ident}"
    return f'<a href="{esc(href(str(flow_run_id)))}">Prefect flow run</a> {ident}'


def not_found_page(kind: str, ident: str) -> str:
    """A plain 404 page naming what was not found (no plotly needed)."""
    body = (f"<h1>{esc(kind.capitalize())} not found</h1>"
            + banner("error", f"There is no {esc(kind)} with id <code>{esc(ident)}</code>. "
                               "Check the id in the link, or list sweeps at "
                               "<code>/api/v1/sweeps</code>."))
    return document(f"{kind} not found", body, "")
