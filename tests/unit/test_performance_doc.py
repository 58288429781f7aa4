"""docs/PERFORMANCE.md's tables that name a measurement (`<!-- NAME.json -->` above the table)
hold the numbers of docs/measurements/NAME.json, rounded as printed: a table typed from memory,
or a measurement replaced without its table, fails here."""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks.sim_throughput import interval_text, ratio_interval

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = re.compile(r"<!-- (?P<name>[\w.-]+\.json) -->\n(?P<table>(?:\|.*\n)+)")


def _tables() -> list[tuple[str, list[list[str]]]]:
    text = (DOCS / "PERFORMANCE.md").read_text()
    found = []
    for match in MARKER.finditer(text):
        lines = match["table"].strip().splitlines()[2:]      # past the header and the rule
        found.append((match["name"], [[c.strip() for c in line.strip("|").split("|")]
                                      for line in lines]))
    markers = re.findall(r"<!-- [\w.-]+\.json -->", text)
    assert len(markers) == len(found), "a `<!-- NAME.json -->` marker not right above its table"
    return found


def _sim_rows(data: dict) -> dict[str, list[str]]:
    rows = {}
    for arm, r in data["arms"].items():
        p = r["phases_s"]
        # a measurement from before the JSON kept its interval: the interval of the pairs it
        # keeps (each rounded to 4 places)
        interval = r.get("interval") or ratio_interval(r["ratios"])
        rows[arm] = [arm, f"{r['ratio']:.3f}", interval_text(interval),
                     ", ".join(f"{x:.3f}" for x in r["ratios"]),
                     f"{r['ratio_loop']:.3f}",
                     *(f"{p[k]:.2f}" for k in ("inner_steps", "outer_sync", "evaluate", "other",
                                               "total"))]
        if data.get("reference") == "both":   # the same runs' pairs with the codec's loop
            coded = r.get("against_codec")
            rows[arm] += ([f"{coded['ratio']:.3f}", interval_text(coded["interval"]),
                           interval_text(r["codec_loop_over_plain"]["interval"])]
                          if coded else ["-", "-", "-"])
    return rows


def _inner_rows(data: dict) -> dict[str, list[str]]:
    rows = {}
    for arm, r in data["arms"].items():
        ms = r["ms_per_inner_step"]
        name, _, change = arm.partition(":")
        label = f"{name}, `{change.removeprefix('pipeline.')}`" if change else name
        rows[label] = [label, f"{r['median_s']:.3f}", f"{r['reference_over_arm']:.3f}",
                       *(f"{ms[k]:.1f}" for k in ("forward", "backward", "clip", "adamw")),
                       f"{ms['stiefel']:.1f}" if name == "mapl" else "-"]
    return rows


ROWS = {"sim_throughput": _sim_rows, "step_parts-inner": _inner_rows}


def test_every_marked_table_matches_its_measurement() -> None:
    tables = _tables()
    assert tables, "PERFORMANCE.md names no measurement"
    for name, rows in tables:
        path = DOCS / "measurements" / name
        assert path.is_file(), f"PERFORMANCE.md names {name}, which docs/measurements lacks"
        kind = next(k for k in ROWS if name.startswith(k))
        expected = ROWS[kind](json.loads(path.read_text()))
        assert [row[0] for row in rows] == list(expected), name
        for row in rows:
            assert row == expected[row[0]], f"{name}: {row[0]}"


def test_a_changed_number_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = DOCS
    shutil.copytree(real / "measurements", tmp_path / "measurements")
    name = "sim_throughput-f83d214-amd.json"
    data = json.loads((DOCS / "measurements" / name).read_text())
    data["arms"]["mapl"]["ratio"] += 0.01
    (tmp_path / "measurements" / name).write_text(json.dumps(data))
    (tmp_path / "PERFORMANCE.md").write_text((DOCS / "PERFORMANCE.md").read_text())
    monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path)
    with pytest.raises(AssertionError, match="mapl"):
        test_every_marked_table_matches_its_measurement()
    # the intervals are checked too: the JSON's own, and the same runs' pairs with MAPL's loop
    both = "sim_throughput-7e192b7-zen5-both.json"
    original = (real / "measurements" / both).read_text()
    for path in (("interval", "lo"), ("against_codec", "interval", "hi"),
                 ("codec_loop_over_plain", "interval", "mean")):
        changed = json.loads(original)
        entry = changed["arms"]["mapl"]
        for key in path[:-1]:
            entry = entry[key]
        entry[path[-1]] += 0.01
        (tmp_path / "measurements" / both).write_text(json.dumps(changed))
        with pytest.raises(AssertionError, match="mapl"):
            test_every_marked_table_matches_its_measurement()
    (tmp_path / "measurements" / both).write_text(original)
    # a marker parted from its table by a blank line is not skipped in silence
    text = (real / "PERFORMANCE.md").read_text().replace("amd.json -->\n|", "amd.json -->\n\n|", 1)
    (tmp_path / "PERFORMANCE.md").write_text(text)
    shutil.copy(real / "measurements" / name, tmp_path / "measurements" / name)
    with pytest.raises(AssertionError, match="marker"):
        test_every_marked_table_matches_its_measurement()
