"""The dashboards the registry serves and exports: `routes` (the index, sweep and run pages and
their live state, mounted by `api.app`), `routes_compare` (the compare page), `queries` (the
registry rows each page shows, as plain dicts) and `export` (a sweep's offline report, one HTML
file: `crucible report`, `crucible sweep`). They read the database through the API's
data-access functions and render with the pure figure and page builders of the `dashboards`
package, which imports neither `api` nor `db`.
"""
