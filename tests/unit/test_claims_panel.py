"""The sweep page's Claims panel: REST's claims as HTML, every value escaped, nothing claimed
that the data do not hold."""
from __future__ import annotations

from crucible import stats
from dashboards.pages.sweep import claims_panel


def _claims(cells):
    return {"duration": 6, "close_margin": 0.5, "equivalence_margin": 0.5,
            "target_half_width": 0.5,
            "claims": stats.claims_to_dict(stats.evaluate_claims(cells), target_half_width=0.5)}


def test_panel_shows_each_verdict_and_interval():
    cells = {stats.CellKey("none", "skip", 0.1): {0: 0.5, 1: 0.7, 2: 0.6},
             stats.CellKey("none", "drop", 0.1): {0: 3.5, 1: 3.9, 2: 3.6}}
    html = claims_panel(_claims(cells))
    assert 'data-claim="a">agrees<' in html and 'data-claim="d">not run yet<' in html
    diff = stats.paired_stat(cells[stats.CellKey("none", "skip", 0.1)],
                             cells[stats.CellKey("none", "drop", 0.1)])
    assert f"{diff.mean:+.2f} [{diff.lo:+.2f}, {diff.hi:+.2f}]" in html
    assert "3 / " in html            # seeds it has / needs for the target


def test_one_seed_is_not_resolved_and_shows_no_interval():
    cells = {stats.CellKey("none", "skip", 0.1): {0: 0.5},
             stats.CellKey("none", "drop", 0.1): {0: 3.5}}
    html = claims_panel(_claims(cells))
    assert 'data-claim="a">not resolved<' in html
    assert "(1 seed, no interval)" in html


def test_every_value_from_the_data_is_escaped():
    claims = _claims({stats.CellKey("none", "skip", 0.1): {0: 0.5, 1: 0.7}})
    claims["claims"][0]["title"] = "<script>alert(1)</script>"
    claims["claims"][0]["comparisons"] = [{"label": "<b>x</b>", "status": "<i>", "n_seeds": "<u>",
                                           "seeds_to_decide": "<s>", "mean": "<m>"}]
    claims["duration"] = "<d>"
    html = claims_panel(claims)
    for raw in ("<script>", "<b>x", "<i>", "<u>", "<s>", "<m>", "<d>"):
        assert raw not in html, raw
    assert "&lt;script&gt;" in html and "&lt;b&gt;x&lt;/b&gt;" in html


def test_the_panel_names_where_its_reference_values_come_from():
    cells = {stats.CellKey("mapl", "skip", 0.1): {0: 0.5, 1: 0.7, 2: 0.6},
             stats.CellKey("none", "skip", 0.1): {0: 0.4, 1: 0.5, 2: 0.7}}
    blog = claims_panel(_claims(cells))
    assert "reference values: the blog's Table 1" in blog
    refs = {("mapl", "skip", 0.1): 2.0, ("none", "skip", 0.1): 1.25}
    own = {**_claims(cells), "references": "spec",
           "claims": stats.claims_to_dict(stats.evaluate_claims(cells, references=refs,
                                                                only=["d"]),
                                          target_half_width=0.5)}
    html = claims_panel(own)
    assert "reference values: the sweep spec" in html
    assert 'data-claim="d"' in html and 'data-claim="a"' not in html
    assert "<td class=num>+0.75</td>" in html           # MAPL - uncompressed, the spec's values
