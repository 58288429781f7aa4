"""The dashboards' figures and pages, pure: Plotly figure builders (`figures`, `timeline`,
`costs`), the owed-records and run accounting (`accounting`), palette and labels (`style`), the
CSV/JSON rows of each table (`datasets`), the HTML pages (`pages`) and made-up registry data for
tests and previews (`sample`). Plain dicts in, HTML and figures out: this package imports
neither the registry service (`api`) nor the database (`db`); `api.dashboards` reads the rows
and serves or exports the pages (tests/unit/test_imports.py checks it).
"""
