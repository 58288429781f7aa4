"""The sweep form's tags and notes, the names and tags its cells get in Prefect, and the columns
of the robustness table artifact."""
from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from crucible.grid.spec import SweepSpec
from flows.sweep_flow import ROBUSTNESS_COLUMNS, cell_run_name, cell_tags, robustness_rows


def test_tags_are_stored_sorted_and_once() -> None:
    spec = SweepSpec(tags=["paper/fig3", "lr:3e-4", "paper/fig3"], notes="first try")
    assert spec.tags == ["lr:3e-4", "paper/fig3"] and spec.notes == "first try"
    assert SweepSpec().tags == [] and SweepSpec().notes is None


@pytest.mark.parametrize("tags, needle", [
    (["two words"], "tag 'two words' is not a valid tag"),
    (["x" * 65], "is not a valid tag: a tag is 1-64 characters from A-Za-z0-9._:/+=-"),
    ([""], "tag '' is not a valid tag"),
    ([f"t{i}" for i in range(33)], "33 distinct tags, at most 32 allowed"),
])
def test_a_bad_tag_is_refused_naming_the_field_and_the_rule(tags: list[str], needle: str) -> None:
    with pytest.raises(ValidationError) as raised:
        SweepSpec(tags=tags)
    errors = raised.value.errors()
    assert errors[0]["loc"] == ("tags",) and needle in errors[0]["msg"]


def test_notes_longer_than_10000_characters_are_refused() -> None:
    with pytest.raises(ValidationError) as raised:
        SweepSpec(notes="n" * 10_001)
    assert raised.value.errors()[0]["loc"] == ("notes",)


def test_tags_and_notes_do_not_change_which_sweep_it_is() -> None:
    plain, annotated = SweepSpec(), SweepSpec(tags=["a"], notes="why")
    assert plain.identity() == annotated.identity()
    assert "tags" not in plain.identity() and "notes" not in plain.identity()
    assert SweepSpec(seeds=[1]).identity() != plain.identity()


def test_cell_names_and_prefect_tags_identify_sweep_and_cell() -> None:
    spec = SweepSpec(name="fig3 {draft}", arms=["mapl"], strategies=["drop"],
                     failure_probabilities=[0.05], seeds=[2], tags=["paper/fig3"])
    baseline, cell = spec.cells()
    sweep_id = "0123abcd-0000-0000-0000-000000000000"
    assert cell_run_name(spec, cell) == "fig3 {draft} · mapl/drop/p=0.05/seed=2"
    assert cell_tags(spec, sweep_id, cell) == [
        "sweep:fig3 {draft}", "sweep-id:0123abcd", "cell:mapl/drop/p=0.05/seed=2", "arm:mapl",
        "strategy:drop", "p:0.05", "tag:paper/fig3"]
    assert "strategy:baseline" in cell_tags(spec, sweep_id, baseline)
    assert "p:0" in cell_tags(spec, sweep_id, baseline)


def test_a_long_sweep_name_is_shortened_to_fit_a_run_name() -> None:
    from api.schemas import RunCreate

    spec = SweepSpec(name="n" * 200, arms=["ssn"], strategies=["reroute"],
                     failure_probabilities=[0.125], seeds=[10])
    name = cell_run_name(spec, spec.cells()[1])
    assert len(name) == 200 and name.endswith("… · ssn/reroute/p=0.125/seed=10")
    RunCreate(config={}, name=name)       # the registry takes it


def test_robustness_artifact_columns_are_the_rest_field_names() -> None:
    """The table artifact's keys are api.analysis_schemas.RobustnessItem's fields without the
    per-seed lists (seeds, run_ids), which a table cell cannot show."""
    from api.analysis_schemas import RobustnessItem

    rest = [name for name in RobustnessItem.model_fields if name not in ("seeds", "run_ids")]
    item = {"compression": "ssn", "strategy": "drop", "label": "", "duration": 6, "p": 0.1,
            "mean_pct": 1.23456, "ci_low_pct": None, "ci_high_pct": None, "n_seeds": 1,
            "seeds": [0], "run_ids": ["r"]}
    baseline = {**item, "p": 0.0, "mean_pct": 0.0}
    rows = robustness_rows({"items": [baseline, item]})
    assert len(rows) == 1                       # the baseline's increase over itself is left out
    assert list(rows[0]) == list(ROBUSTNESS_COLUMNS) == rest
    assert rows[0]["mean_pct"] == 1.235 and rows[0]["ci_low_pct"] is None


def test_flows_link_to_the_pages_the_dashboards_serve() -> None:
    from api.dashboards.routes import RUN_PATH, SWEEP_PATH
    from crucible.registry.connect import run_page, sweep_page
    from flows.settings import FlowSettings

    settings = FlowSettings(api_url="http://api:8000", public_url="https://crucible.example")

    def served(path: str, ident: str) -> str:
        return "https://crucible.example" + re.sub(r"\{[^}]+\}", ident, path)

    assert run_page(settings, "r1") == served(RUN_PATH, "r1")
    assert sweep_page(settings, "s1") == served(SWEEP_PATH, "s1")


def test_claim_lines_say_unresolved_and_what_would_decide_it() -> None:
    from cli.flows import claim_lines

    def comparison(label, status, mean, lo, hi, n, decide=None):
        return {"label": label, "status": status, "mean": mean, "ci_low": lo, "ci_high": hi,
                "n_seeds": n, "seeds_to_decide": decide}

    claims = {"claims": [
        {"tag": "a", "title": "skip costs less than drop at every p", "verdict": "not resolved",
         "comparisons": [comparison("SSN skip - drop, p = 0.1", "unresolved", -1.5, -4.0, 1.0,
                                    3, decide=9),
                         comparison("MAPL skip - drop, p = 0.1", "missing", -2.0, None, None,
                                    1),
                         comparison("none skip - drop, p = 0.1", "missing", None, None, None, 0)]},
        {"tag": "b", "title": "degradation grows with p", "verdict": "not run yet",
         "comparisons": []}]}
    assert claim_lines(claims) == [
        "claims, on paired 95% intervals (points of the baseline's loss):",
        "(a) skip costs less than drop at every p: not resolved",
        "    SSN skip - drop, p = 0.1: -1.50 points [-4.00, +1.00], 3 seeds: unresolved; "
        "about 9 seeds would decide it",
        "    MAPL skip - drop, p = 0.1: -2.00 points (no interval), 1 seed: no verdict below 2 "
        "seeds"]
    assert claim_lines(None) == [] and claim_lines({"claims": claims["claims"][1:]}) == []
