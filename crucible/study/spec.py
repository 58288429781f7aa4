"""A study's spec file: `load_spec` reads a TOML spec (the format is in crucible.study's
docstring) into the one spec model, `crucible.grid.spec.SweepSpec`, with its files resolved
(`StudyFiles`); `result_path` / `completed_cells` say where a cell's result file lies and which
are there. The cells themselves are the spec's (`crucible.grid.cells.expand_cells`).

The TOML's keys are the model's (those a study's runner honours: name, preset, seeds, grid,
duration, global_steps, max_seeds, title, notes and the claims' margins and target), with two of the
study's own names: `set` (the model's `overrides`) and `resolve_threshold` (its
`target_half_width`, the half-width a study lists as not resolved); a grid block's `set` is its
baseline-neutral overrides. The other keys say where its files are (`StudyFiles`). A study's cells take the
preset's failure duration unless the spec sets `duration`.
"""
from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from crucible.grid.cells import Cell
from crucible.grid.spec import StudyFiles, SweepSpec

DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "studies" / "table1.toml"

# TOML key -> SweepSpec field
_RENAMED = {"set": "overrides", "resolve_threshold": "target_half_width"}
_MODEL_KEYS = {"name", "preset", "seeds", "set", "grid", "title", "notes", "close_margin",
               "resolve_threshold", "target_half_width", "equivalence_margin", "duration",
               "global_steps", "max_seeds", "references", "claims"}
_FILE_KEYS = {"results_dir", "runs_dir", "document", "figures_dir"}
_SPEC_LISTS = {"pilots": '["pilot-w128-lr2.toml"]',
               "token_check": '["pilot-half.toml", "pilot-full.toml"]',
               "scale": '["scale-d256.toml"]', "reuse": '["pilot-w128-lr2.toml"]',
               "processes": '["processes.toml"]', "estimand": '["estimand-pilot.toml"]'}
_SPEC_KEYS = _MODEL_KEYS | _FILE_KEYS | set(_SPEC_LISTS)
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class StudyError(Exception):
    """Bad input (a spec, a result file): the message names the field and the fix."""


class FigureError(StudyError):
    """The figures cannot be rendered here (no Chromium or Playwright)."""


def _where(path: Path, field_name: str) -> str:
    return f"{path}: {field_name}"


def _loc(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the TOML names it: grid[1].set, resolve_threshold."""
    back = {v: k for k, v in _RENAMED.items()}
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if i == 0:
            part = back.get(part, part)
        elif part == "overrides":     # a block's
            part = "set"
        out += ("." if out else "") + str(part)
    return out or "spec"


_EXAMPLES = {"seeds": "[0, 1, 2, 3, 4]", "arms": '["ssn", "mapl"]', "strategies": '["skip"]',
             "p": "[0.1, 0.2]", "overrides": '["pipeline.bypass_decode=sender"]',
             "grid": "[[grid]] blocks"}
_BLOCK_KEYS = "arms, label, p, seeds, set, strategies"


def _problem(path: Path, err: Any) -> str:
    """One pydantic error as the spec's author reads it: the TOML's field, what is wrong and
    an example of what is right."""
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden" and len(loc) >= 2:      # a grid block's or reference's key
        takes = "a reference takes arm, strategy, p and pct" if loc[0] == "references" else \
            f"a grid block takes {_BLOCK_KEYS}"
        return f"{_where(path, _loc(loc[:-1]))}: unknown key {loc[-1]!r}; {takes}"
    message = err["msg"].removeprefix("Value error, ")
    names = [part for part in loc if isinstance(part, str)]
    if err["type"] != "value_error" and names and names[-1] in _EXAMPLES \
            and loc[0] != "references":
        message += f"; e.g. {names[-1] if names[-1] != 'overrides' else 'set'} = " \
                   f"{_EXAMPLES[names[-1]]}"
    return f"{_where(path, _loc(loc))}: {message}"


def _str_list(value: Any, where: str, example: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StudyError(f"{where} must be a list of strings, e.g. {example}; got {value!r}")
    return list(value)


def _files(data: dict[str, Any], path: Path, name: str) -> StudyFiles:
    folder = path.resolve().parent
    paths: dict[str, Any] = {"spec": path.resolve()}
    defaults = {"results_dir": f"../results/{name}", "runs_dir": f"../runs/study/{name}",
                "document": "../docs/RESULTS.md", "figures_dir": "../docs/img"}
    for key, default in defaults.items():
        value = data.get(key, default)
        if not isinstance(value, str) or not value:
            raise StudyError(f"{_where(path, key)} must be a path (relative to the spec's "
                             f"folder), got {value!r}")
        paths[key] = Path(os.path.normpath(folder / value))
    for key, example in _SPEC_LISTS.items():
        paths[key] = []
        for item in _str_list(data.get(key, []), _where(path, key), example):
            other = Path(os.path.normpath(folder / item))
            if not other.is_file() or other == path.resolve():
                raise StudyError(f"{_where(path, key)}: {item!r} is not another study spec "
                                 f"(looked for {other}); list other specs relative to this file")
            paths[key].append(other)
    if paths["token_check"] and len(paths["token_check"]) != 2:
        raise StudyError(f"{_where(path, 'token_check')} must name two specs: the preset's "
                         "baselines with half the global steps, then with all of them")
    return StudyFiles(**paths)


def load_spec(path: str | os.PathLike[str]) -> SweepSpec:
    """Read and validate a study spec; raises `StudyError` naming the field and the fix."""
    given = Path(path)
    if not given.is_file():
        raise StudyError(f"spec {given} not found; pass a study spec such as studies/table1.toml")
    path = given          # as the user wrote it, for messages
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise StudyError(f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - _SPEC_KEYS)
    if unknown:
        raise StudyError(f"{path}: unknown key {unknown[0]!r}; a spec takes "
                         f"{', '.join(sorted(_SPEC_KEYS))}")
    for key in ("name", "preset", "seeds", "grid"):
        if key not in data:
            raise StudyError(f"{path}: missing {key!r} (a spec needs name, preset, seeds and at "
                             "least one [[grid]] block)")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise StudyError(f"{_where(path, 'name')} must be lower-case letters, digits, - and _ "
                         f"(it names results/<name>/), got {name!r}")
    if not isinstance(data["grid"], list) or not data["grid"]:
        raise StudyError(f"{_where(path, 'grid')} must be one or more [[grid]] blocks")
    for key in ("title", "notes"):
        if key in data:
            if not isinstance(data[key], str):
                raise StudyError(f"{_where(path, key)} must be a string, got {data[key]!r}")
            data[key] = data[key].strip()
    if "resolve_threshold" in data and "target_half_width" in data:
        raise StudyError(f"{path}: resolve_threshold and target_half_width are one setting "
                         "(the half-width a cell should reach); keep one of them")
    fields = {_RENAMED.get(k, k): v for k, v in data.items() if k in _MODEL_KEYS}
    fields.setdefault("duration", None)        # the preset's, unless the spec sets one
    try:
        spec = SweepSpec(**fields, files=_files(data, path, name))
    except ValidationError as exc:
        raise StudyError(_problem(path, exc.errors()[0])) from None
    _check_configs(spec, path)
    return spec


def _check_configs(spec: SweepSpec, path: Path) -> None:
    """Before anything runs: every cell's configuration must be valid, and no two cells may
    have one (a block whose `set` is the preset's own value would be one run under two
    names; `SweepSpec.refuse_duplicates` names both)."""
    from crucible.config import ConfigError, apply_overrides
    from crucible.presets import get_preset

    base = get_preset(spec.preset)
    keyed = []
    for cell in spec.cells():
        try:
            keyed.append((cell, apply_overrides(base, cell.overrides(spec)).to_json()))
        except ConfigError as exc:
            where = "set" if cell.block is None else f"grid[{cell.block}]"
            raise StudyError(f"{_where(path, where)}: cell {cell.id}: {exc}") from None
    try:
        spec.refuse_duplicates(keyed)
    except ValueError as exc:
        raise StudyError(f"{path}: {exc}") from None


def result_cells(spec: SweepSpec) -> list[Cell]:
    """The cells whose result files a study reads: its grid's, then, with `max_seeds`, every
    seed a precision round may add (rounds take the lowest seeds a cell has no run of, and the
    arm's baseline of each)."""
    import dataclasses

    cells = spec.cells()
    if spec.max_seeds is None:
        return cells
    have = {cell.id for cell in cells}
    templates = {cell.key: cell for cell in cells}
    for seed in range(max(spec.all_seeds) + 1 + spec.max_seeds):
        for template in templates.values():
            cell = dataclasses.replace(template, seed=seed)
            if cell.id not in have:
                have.add(cell.id)
                cells.append(cell)
    return cells


def result_path(spec: SweepSpec, cell: Cell) -> Path:
    return spec.results_dir / f"{cell.id}.json"


def completed_cells(spec: SweepSpec, cells: Iterable[Cell]) -> tuple[list[Cell], list[Cell]]:
    """(done, todo): cells whose result file exists, and the others, in the given order."""
    done, todo = [], []
    for cell in cells:
        (done if result_path(spec, cell).is_file() else todo).append(cell)
    return done, todo
