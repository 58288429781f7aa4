"""Page assembly: plain view data -> complete HTML strings (the sweep overview, a run, a 404).

A page never fetches anything: the caller passes the view (registry query results as dicts) and
the tag that loads plotly.js, which is a `<script src>` to the API's local copy when served and
the whole library inlined once when exported, so the same function makes both. Every string that
came from a user (sweep names, config values) is HTML-escaped; figure data is JSON-escaped by
Plotly. Empty states are explicit banners, never a blank page. A served page given `Live`
refreshes itself in place while its sweep or run is unfinished.
"""
from dashboards.pages._common import (
    PLOTLY_JS_PATH,
    PLOTLY_JS_URL,
    Live,
    RunHref,
    inline_plotly_tag,
    not_found_page,
    served_plotly_tag,
)
from dashboards.pages.index import index_page
from dashboards.pages.run import run_page
from dashboards.pages.sweep import sweep_page

__all__ = ["PLOTLY_JS_PATH", "PLOTLY_JS_URL", "served_plotly_tag", "inline_plotly_tag",
           "sweep_page", "run_page", "index_page", "not_found_page", "RunHref", "Live"]
