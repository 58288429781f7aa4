"""A study's result files, kept by the `failure-sweep` flow: when the spec is a study's
(`spec.files` set, as `crucible study run` makes it), each completed cell's slim summary is
written to `<results_dir>/<cell id>.json` from its registry record, checked against the cell
as `crucible study render` will read it; cells whose file exists are not run again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect import get_run_logger

from crucible.grid.cells import Cell
from crucible.grid.key import CellKey
from crucible.grid.spec import SweepSpec
from crucible.registry.connect import make_client
from flows.settings import FlowSettings

if TYPE_CHECKING:
    from flows.sweep_flow import _Planned

__all__ = ["has_result", "keep_study_result", "keeper", "keep_all", "with_result_files",
           "seeded_key", "finished"]


def keeper(spec: SweepSpec, by_run: dict[str | None, _Planned],
            settings: FlowSettings) -> Any:
    """An `on_done` for `flows.sweep_flow._run_cells` that keeps each completed cell's study result."""
    def keep(result: dict[str, Any]) -> None:
        if result["status"] == "completed" and result["run_id"] in by_run:
            keep_study_result(spec, by_run[result["run_id"]], settings)
    return keep


def keep_all(spec: SweepSpec, items: list[_Planned], settings: FlowSettings) -> None:
    """Keep the result of every completed cell of `items` that has no file yet (a run that a
    spool replay completed after its cell ended)."""
    for item in items:
        keep_study_result(spec, item, settings)


def has_result(spec: SweepSpec, cell: Cell) -> bool:
    """A study's cell whose result file exists (never for a plain sweep)."""
    if spec.files is None:
        return False
    from crucible.study.spec import result_path

    return result_path(spec, cell).is_file()


def keep_study_result(spec: SweepSpec, item: _Planned, settings: FlowSettings) -> None:
    """A study's completed cell: its run's summary, from the registry (checked against the
    cell, as `crucible study render` will read it), kept as the cell's result file. A run that
    still owes records is not complete yet: its file is written by the run that finds it
    completed. Nothing for a plain sweep, or when the file exists."""
    if spec.files is None or item.run_id is None or has_result(spec, item.cell):
        return
    from crucible.study.runner import check_result, keep_result
    from crucible.study.spec import StudyError, result_path

    with make_client(settings) as client:
        run = client.get_run(item.run_id)
    if run.get("status") != "completed" or not run.get("summary"):
        return
    summary = {"config": run["config"], **run["summary"]}
    try:
        check_result(summary, item.cell, result_path(spec, item.cell))
        keep_result(spec, item.cell, summary, jobs=spec.max_concurrent_runs)
    except (OSError, StudyError) as exc:   # the run stays in the registry; the sweep goes on
        get_run_logger().error("cell %s: its result file was not written (%s); the next "
                               "`crucible study run` writes it from the registry",
                               item.cell.id, exc)


def seeded_key(run: dict[str, Any], *, duration: int | None = None) -> tuple[CellKey, int]:
    """(the grid cell a run row is of, its seed), as a `Cell`'s (key, seed): registry rows and
    result-file rows alike (a p = 0 row is its arm's baseline)."""
    return CellKey.of_row(run, duration=duration), int(run["seed"])


def finished(run: dict[str, Any]) -> bool:
    """A usable run that owes the registry nothing: a data point of its cell."""
    from crucible.stats import usable

    return usable(run) and not run.get("owed_records")


def with_result_files(spec: SweepSpec, runs: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A study's precision round reads its cells' widths from every seed it has: the sweep's
    registry runs plus the result files the registry lacks (runs of an earlier sitting whose
    registry is gone, a fresh clone, the committed results). None when there is no such file
    (a plain sweep; a study whose files all have runs here): the registry alone is the data."""
    if spec.files is None:
        return None
    from crucible.study.data import _row
    from crucible.study.runner import load_results
    from crucible.study.spec import result_cells

    results = load_results(spec)
    # a failed, cancelled or unfinished registry run of a cell does not hide the cell's file
    have = {seeded_key(run, duration=run.get("duration")) for run in runs if finished(run)}
    files = [row for cell in result_cells(spec) if cell.id in results
             for row in [_row(cell.key, cell.seed, results[cell.id])]
             if seeded_key(row, duration=row["duration"]) not in have]
    if not files:
        return None
    # a run still owing records is no finished data point yet (as the registry reads it)
    registry = [{**run, "status": "running"} if run.get("owed_records") else run for run in runs]
    return registry + files
