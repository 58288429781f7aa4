"""The sweep page's cost figures (dashboards.costs) and panel (dashboards.pages._costs) from
hand-made records: what they draw and say follows the data."""
from dashboards.costs import cost_curves
from dashboards.pages._costs import cost_panel


def _record():
    def cell(strategy, p, costs, losses):
        curve = [{"global_step": 10 * i, "val_loss": v, "wall_s": 3600.0 * c, "cost": c}
                 for i, (c, v) in enumerate(zip(costs, losses, strict=True))]
        return {"arm": "ssn", "strategy": strategy, "p": p, "label": "", "curve": curve}

    return {"deployment": "cloud", "pricing": "spot", "currency": "USD",
            "cells": [cell("base", 0.0, [0, 10], [5, 2.0]), cell("skip", 0.2, [0, 9], [5, 2.1])],
            "cheapest": [{"arm": "ssn", "label": "", "p": 0.2, "strategy": "skip",
                          "by": "budget", "cost": 9.0, "loss_at_budget": 2.1}]}


def test_curves_put_each_cell_on_the_chosen_axis():
    money = cost_curves(_record(), axis="money")
    assert [t.name for t in money.data] == ["SSN · baseline", "SSN · skip · p = 0.2"]
    assert list(money.data[0].x) == [0, 10] and list(money.data[1].y) == [5, 2.1]
    assert "Money (USD)" in money.layout.xaxis.title.text
    wall = cost_curves(_record(), axis="wall")
    assert list(wall.data[0].x) == [0.0, 10.0]          # hours
    empty = cost_curves({"deployment": "cloud", "cells": []}, axis="wall")
    assert empty.data == () and "No priced run" in empty.layout.annotations[0].text


def test_panel_names_the_cheapest_and_says_when_nothing_is_priced():
    html = cost_panel([_record()])
    assert 'data-cheapest="skip"' in html
    assert "lowest loss on its budget: 2.1000" in html
    assert html.count("data-figure=") == 2
    assert "No run of this sweep is priced yet" in cost_panel([])
    assert "data-figure" not in cost_panel([])
