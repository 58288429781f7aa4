"""Table 1 for a paper (crucible.study.paper): CSV and LaTeX rendered from the study's data, checked
by `study render --check` like the document."""
from __future__ import annotations

import csv
import io

import pytest

from crucible import study
from crucible.study import paper
from tests.unit.test_study import fill, write_spec


@pytest.fixture
def filled(tmp_path):
    spec = study.load_spec(write_spec(tmp_path))
    fill(spec, {"ssn-skip-p0.1": [1.0, 2.0, 4.0], "none-skip-p0.2": [0.5, 1.5, 1.0]})
    return spec


def test_csv_holds_every_number_at_full_precision(filled):
    data = study.StudyData(filled, study.load_results(filled))
    rows = list(csv.DictReader(io.StringIO(paper.table1_csv(data))))
    assert [(r["p"], r["arm"]) for r in rows] == [
        (p, a) for p in ("0.1", "0.2") for a in ("ssn", "mapl", "none")]
    by = {(float(r["p"]), r["arm"]): r for r in rows}
    ssn = by[(0.1, "ssn")]
    # three seeds at +1, +2, +4 %: mean 7/3, sd sqrt(7/3), t(0.975, 2) = 4.302653
    assert float(ssn["mean_pct"]) == pytest.approx(7 / 3, abs=1e-9)
    assert float(ssn["sd_pct"]) == pytest.approx((7 / 3) ** 0.5, abs=1e-9)
    half = 4.302652729911275 * (7 / 3) ** 0.5 / 3 ** 0.5
    assert float(ssn["ci_high_pct"]) - float(ssn["mean_pct"]) == pytest.approx(half, abs=1e-6)
    assert (ssn["n_seeds"], ssn["blog_pct"]) == ("3", "0.6")
    assert by[(0.1, "mapl")]["mean_pct"] == "" and by[(0.1, "mapl")]["n_seeds"] == "0"


def test_latex_is_a_booktabs_table_with_the_documents_rounding(filled):
    data = study.StudyData(filled, study.load_results(filled))
    tex = paper.table1_latex(data)
    assert tex.count("\\begin{tabular}") == 1 and "\\toprule" in tex and "\\bottomrule" in tex
    [row] = [line for line in tex.splitlines() if line.startswith("0.1 & ")]
    cells = row.removesuffix(" \\\\").split(" & ")
    assert len(cells) == 1 + 2 * 3                  # p, then (this study, blog) per arm
    assert cells[1].startswith("$+2.33$ {\\footnotesize [$") and cells[2] == "$+0.6$"
    assert cells[3] == "--"                          # MAPL at p = 0.1 not run
    assert tex.count("{") == tex.count("}")


def test_check_fails_when_a_table_is_stale(filled, capsys):
    assert study.render(filled, figures=False, echo=lambda _: None) == 0
    assert study.render(filled, check=True, figures=False, echo=lambda _: None) == 0
    tables = study.table_files(filled)
    tables["tex"].write_text(tables["tex"].read_text().replace("+2.33", "+2.34"))
    lines: list[str] = []
    assert study.render(filled, check=True, figures=False, echo=lines.append) == 1
    assert any("table1.tex differs" in line for line in lines)
