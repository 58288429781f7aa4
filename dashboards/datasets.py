"""Dataset export: "CSV" and "JSON" download links for the data behind a table or figure.

`export_links` embeds the rows ONCE in the page as JSON (`<script type="application/json">`)
and renders two links whose downloads are built in the browser (a Blob and an object URL), so
they work the same on a served page and in the offline report opened from `file://`, with no
server round trip. Numbers are kept exactly as stored (Python's shortest round-trip repr in the
JSON; JavaScript's `String(number)` in the CSV, which round-trips the same double); non-finite
floats become null / an empty cell. Columns are the keys of the first row, in order; rows that
lack a column give an empty cell. CSV follows RFC 4180: CRLF line ends, a cell holding a comma,
quote, CR or LF is quoted with inner quotes doubled; nested values (lists, dicts) are written as
JSON text. A text cell starting with = + - @ TAB or CR (a run name is anyone's text) gets a
leading apostrophe, so a spreadsheet shows it instead of running it as a formula ("CSV
injection"); numbers and the JSON download are never altered. Field names are the REST API's (the caller passes rows shaped that way).
"""
from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["export_links", "embedded_json", "run_rows", "robustness_rows", "table_rows",
           "EXPORT_SCRIPT", "RUN_FIELDS", "ROBUSTNESS_FIELDS", "TABLE_CELL_FIELDS"]

# The REST API's names (RunPublic, the /robustness items); `config` and `summary` are left out of
# run rows (nested, and the config is one click away on the run's page or the REST API).
RUN_FIELDS = ("id", "name", "sweep_id", "compression", "strategy", "p", "label", "duration", "seed",
              "preset", "status", "initial_val_loss", "final_val_loss", "tokens_budget",
              "tokens_processed", "baseline_run_id", "tags", "created_at")
ROBUSTNESS_FIELDS = ("compression", "strategy", "label", "duration", "p", "mean_pct",
                     "ci_low_pct", "ci_high_pct", "n_seeds")
# a Table 1 cell (/sweeps/{ref}/table), one column per "<compression>/<strategy> <field>"
TABLE_CELL_FIELDS = ("mean_pct", "ci_low_pct", "ci_high_pct", "n_seeds")

# Defined once per page: `dashboards.pages._common.document` puts it in every page's head (a
# page swapped in by the live refresh, or a run page mounted in the offline report, reuses it).
EXPORT_SCRIPT = """<script>window.crucibleExport=window.crucibleExport||function(a){
var box=a.closest('.export'),d=JSON.parse(box.querySelector('script[type="application/json"]').textContent);
var text,type;
if(a.dataset.format==='csv'){
var cell=function(v){if(v===null||v===undefined)return'';
var s=typeof v==='object'?JSON.stringify(v):String(v);
if(typeof v==='string'&&/^[=+\\-@\\t\\r]/.test(s))s="'"+s;
return /[",\\r\\n]/.test(s)?'"'+s.replace(/"/g,'""')+'"':s;};
var lines=[d.columns.map(cell).join(',')];
d.rows.forEach(function(r){lines.push(d.columns.map(function(c){return cell(r[c]);}).join(','));});
text=lines.join('\\r\\n')+'\\r\\n';type='text/csv;charset=utf-8';
}else{text=JSON.stringify(d.rows,null,1)+'\\n';type='application/json';}
var url=URL.createObjectURL(new Blob([text],{type:type})),tmp=document.createElement('a');
tmp.href=url;tmp.download=a.getAttribute('download');document.body.appendChild(tmp);tmp.click();
tmp.remove();setTimeout(function(){URL.revokeObjectURL(url);},60000);return false;};</script>"""

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def _finite(value: Any) -> Any:
    """JSON-ready copy of `value` with NaN and infinities as None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def embedded_json(data: Any) -> str:
    """`data` as JSON that is safe inside a `<script>` element (no `</script>`, no `<!--`)."""
    text = json.dumps(_finite(data), allow_nan=False, default=str, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def export_links(name: str, rows: Sequence[Mapping[str, Any]], *, label: str) -> str:
    """HTML offering `rows` as `<name>.csv` and `<name>.json` downloads, built client-side.

    `name` becomes the file name (characters outside `A-Za-z0-9._-` are replaced by `-`);
    `label` says what the data is ("robustness curves", "runs"). Columns = the first row's
    keys, in order. An empty `rows` still gives the links (a header-less CSV, `[]`).
    """
    columns = [str(key) for key in rows[0]] if rows else []
    payload = embedded_json({"columns": columns, "rows": [dict(r) for r in rows]})
    stem = _SAFE_NAME.sub("-", name).strip("-") or "data"
    links = "".join(
        f' <a href="#" class="export-link" data-format="{fmt}" download="{html.escape(stem)}.{fmt}"'
        f' title="Download the {html.escape(label)} data as {fmt.upper()}"'
        f' onclick="return crucibleExport(this)">{fmt.upper()}</a>'
        for fmt in ("csv", "json"))
    return (f'<span class="export" data-export="{html.escape(stem)}">'
            f'<script type="application/json">{payload}</script>'
            f'Data ({html.escape(label)}, {len(rows)} rows):{links}</span>')


def run_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Runs (RunPublic dicts) as export rows: the `RUN_FIELDS`, in that order."""
    return [{key: run.get(key) for key in RUN_FIELDS} for run in runs]


def robustness_rows(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Robustness items (`/sweeps/{ref}/robustness`) as export rows: the `ROBUSTNESS_FIELDS`."""
    return [{key: item.get(key) for key in ROBUSTNESS_FIELDS} for item in items]


def table_rows(table: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Table 1 (`/sweeps/{ref}/table`) in its own wide shape: one row per p, and per column
    "<compression>/<strategy>" the cell's `TABLE_CELL_FIELDS` as "<column> <field>" (empty where
    the cell is)."""
    columns = [str(c) for c in table.get("columns") or []]
    rows = []
    for row in table.get("rows") or []:
        out: dict[str, Any] = {"p": row.get("p")}
        cells = row.get("cells") or {}
        for column in columns:
            cell = cells.get(column) or {}
            out.update({f"{column} {field}": cell.get(field) for field in TABLE_CELL_FIELDS})
        rows.append(out)
    return rows
