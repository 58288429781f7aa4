"""Small parts shared by the index, sweep and compare pages: tag chips and the run selection
that leads to the compare page (a checkbox per table row and a "Compare selected" button)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dashboards.pages._common import esc

__all__ = ["COMPARE_PATH", "MIN_COMPARE", "MAX_COMPARE", "tag_chips", "select_cell",
           "select_header", "compare_form"]

COMPARE_PATH = "/dashboards/compare"
MIN_COMPARE, MAX_COMPARE = 2, 12

# The form still works without JavaScript (`?runs=A&runs=B`, which the compare route accepts);
# with it, the button asks for 2..12 runs and opens the shareable `?runs=A,B` form of the link.
_SUBMIT = ("var ids=Array.from(this.querySelectorAll('input[name=runs]:checked'),"
           "function(c){return c.value;}),note=this.querySelector('.compare-note');"
           f"if(ids.length<{MIN_COMPARE}||ids.length>{MAX_COMPARE})"
           f"{{note.textContent='Select {MIN_COMPARE} to {MAX_COMPARE} runs to compare ('"
           "+ids.length+' selected).';return false;}"
           "window.location.href=this.action+'?runs='+ids.join(',');return false;")
# The ticked runs are kept per page in sessionStorage, so a live page that swaps in fresh
# content (and runs this script again) or a visit back keeps the selection.
_KEEP = ("(function(){var form=document.currentScript.previousElementSibling,"
         "key='crucible-compare:'+location.pathname,kept=[];"
         "try{kept=JSON.parse(sessionStorage.getItem(key)||'[]');}catch(e){}"
         "form.querySelectorAll('input[name=runs]').forEach(function(c){"
         "if(kept.indexOf(c.value)>=0)c.checked=true;});"
         "form.addEventListener('change',function(){sessionStorage.setItem(key,JSON.stringify("
         "Array.from(form.querySelectorAll('input[name=runs]:checked'),"
         "function(c){return c.value;})));});})();")


def tag_chips(tags: Sequence[str] | None) -> str:
    """A run's or sweep's tags as small labels ("" when it has none)."""
    return "".join(f'<span class="tag">{esc(tag)}</span>' for tag in tags or [])


def select_header() -> str:
    return '<th><span class="visually-hidden">select</span></th>'


def select_cell(run_id: str, label: Any) -> str:
    """The checkbox cell that selects one run for comparison."""
    return (f'<td class="select"><input type="checkbox" name="runs" value="{esc(run_id)}" '
            f'aria-label="select {esc(label)} to compare"></td>')


def compare_form(table: str, action: str) -> str:
    """`table` (whose rows carry `select_cell`s) inside the form that opens the compare page;
    the selection survives a live page's refresh."""
    return (f'<form class="compare" method="get" action="{esc(action)}" onsubmit="{_SUBMIT}">'
            f'<div class="compare-bar"><button type="submit">Compare selected</button> '
            f'<span class="compare-note meta">tick {MIN_COMPARE} to {MAX_COMPARE} runs</span>'
            f"</div>{table}</form><script>{_KEEP}</script>")
