"""`crucible study run|render|adopt`: the command line of the study (`register` adds it to the
`crucible` app).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crucible.grid.cells import Cell
from crucible.grid.spec import SweepSpec
from crucible.study.document import render
from crucible.study.runner import adopt_results
from crucible.study.spec import FigureError, StudyError, completed_cells, load_spec


def for_run(spec: SweepSpec, *, jobs: int, seeds: list[int] | None = None,
            cells: list[str] | None = None) -> SweepSpec:
    """The spec as `study run` runs it: `jobs` cells at a time, and with `seeds` only those
    seeds' cells, with `cells` only the cells matching one of those patterns (`run_seeds`,
    `run_cells`: the study stays one sweep in its registry)."""
    return spec.model_copy(update={"max_concurrent_runs": jobs, "run_seeds": seeds,
                                   "run_cells": cells})


def _parse_cells(text: str | None) -> list[str] | None:
    if text is None:
        return None
    patterns = [part.strip() for part in text.split(",") if part.strip()]
    if not patterns:
        raise StudyError("--cells must name cell ids or shell patterns such as "
                         "'none-*,ssn-skip-p0.2-*'; got nothing")
    return patterns


def here_arithmetic(threads: int = 1) -> str:
    """This machine's arithmetic digest as the study's one-thread runs compute it."""
    import torch

    from crucible.arithmetic import arithmetic

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return str(arithmetic()["digest"])
    finally:
        torch.set_num_threads(before)


def arithmetic_check(spec: SweepSpec, todo: list[Cell], *, explicit_seeds: bool,
                     here: str | None = None) -> tuple[list[Cell], dict[int, str]]:
    """The cells of `todo` this machine may add (`crucible.study.blocks`), and the seeds it
    leaves with the reason. Raises StudyError when `explicit_seeds` (the user named them) and
    one of them is refused."""
    from crucible.study.blocks import load_proofs, runnable, seed_blocks
    from crucible.study.runner import load_results

    here = here_arithmetic() if here is None else here
    blocks = seed_blocks(spec, load_results(spec), load_proofs(spec))
    ok, refused = runnable(spec, todo, blocks, here)
    if refused and explicit_seeds:
        raise StudyError("; ".join(refused[s] for s in sorted(refused)))
    return ok, refused


def _parse_seeds(text: str | None, spec: SweepSpec) -> list[int] | None:
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise StudyError(f"--seeds must be comma-separated integers such as 0,1; got {text!r}"
                         ) from None
    unknown = [s for s in seeds if s not in spec.all_seeds]
    if not seeds or unknown:
        raise StudyError(f"--seeds {text!r}: choose from the spec's seeds "
                         f"{','.join(str(s) for s in spec.all_seeds)}")
    return seeds


def _same_arithmetic(spec: SweepSpec, todo: list[Cell], adoptable: dict[str, str]
                     ) -> dict[str, str]:
    """The adoptions that keep each seed's block within one arithmetic: where cells of a seed
    are still to run here, an identical run of a `reuse` spec joins the block only when it
    records this machine's digest (otherwise the cell runs here)."""
    from crucible.arithmetic import digest_of
    from crucible.study.spec import load_spec as load

    sources = {other.name: other for other in (load(path) for path in spec.files.reuse)}
    here = here_arithmetic()
    running = {c.seed for c in todo if c.id not in adoptable}
    kept = {}
    for cell in todo:
        source = adoptable.get(cell.id)
        if source is None:
            continue
        if cell.seed in running:
            path = sources[source].results_dir / f"{cell.id}.json"
            if digest_of(json.loads(path.read_text(encoding="utf-8"))) != here:
                continue
        kept[cell.id] = source
    return kept


def _run_real(spec_path: Path, *, seeds: str | None, dry_run: bool, echo: Any) -> int:
    """`study run` of a pipeline-real spec (crucible.study.pipeline_real): its cells one at a
    time (each is R x S processes), in this process. 2 for a bad spec or option."""
    from crucible.study.pipeline_real import (
        all_cells,
        cell_id,
        load_real_results,
        load_real_spec,
        refused_seeds,
        run_study,
    )

    try:
        spec = load_real_spec(spec_path)
        chosen = None
        if seeds is not None:
            chosen = [int(x) for x in seeds.split(",") if x.strip()]
            unknown = [x for x in chosen if x not in spec.seeds]
            if not chosen or unknown:
                raise StudyError(f"--seeds {seeds!r}: choose from the spec's seeds "
                                 f"{','.join(str(x) for x in spec.seeds)}")
        here = here_arithmetic()
        refused = refused_seeds(spec, here)
        named = [x for x in (chosen or []) if x in refused]
        if named:
            raise StudyError("; ".join(refused[x] for x in named))
    except ValueError:
        echo(f"error: --seeds must be comma-separated integers such as 0,1; got {seeds!r}",
             err=True)
        return 2
    except StudyError as exc:
        echo(f"error: {exc}", err=True)
        return 2
    for seed in sorted(refused):
        echo(f"study {spec.name}: seed {seed} left out: {refused[seed]}", err=True)
    allowed = [x for x in (chosen or spec.seeds) if x not in refused]
    done = load_real_results(spec)
    todo = [cell_id(*c) for c in all_cells(spec) if c[2] in allowed
            and cell_id(*c) not in done]
    echo(f"study {spec.name}: {len(all_cells(spec))} cells, {len(done)} in "
         f"{spec.results_dir}, {len(todo)} to run, one at a time")
    if dry_run:
        for cell in todo:
            echo(f"  {cell}")
        return 0
    try:
        made = run_study(spec, seeds=allowed, scratch=Path("runs") / spec.name, log=echo)
    except StudyError as exc:
        echo(f"error: {exc}", err=True)
        return 1
    echo(f"study {spec.name}: {len(made)} cells made")
    return 0


def _render_real(spec_path: Path, *, check: bool, echo: Any) -> int:
    """`study render` of a pipeline-real spec: its document from its results alone."""
    from crucible.runfiles import write_text_atomic
    from crucible.study.pipeline_doc import render_real
    from crucible.study.pipeline_real import load_real_spec

    spec = load_real_spec(spec_path)
    text = render_real(spec)
    if check:
        current = spec.document.read_text() if spec.document.exists() else ""
        if current != text:
            echo(f"{spec.document} is stale: run `crucible study render {spec_path}`", err=True)
            return 1
        echo(f"{spec.document} matches the data")
        return 0
    write_text_atomic(spec.document, text)
    echo(f"wrote {spec.document}")
    return 0


def register(app: Any) -> None:
    """Add the `crucible study run|render` commands to the `crucible` command line."""
    import typer

    study_app = typer.Typer(help="The failure study: run a committed grid spec, render "
                                 "docs/RESULTS.md from its results.", no_args_is_help=True)

    def fail(message: str, code: int = 2) -> typer.Exit:
        typer.echo(f"error: {message}", err=True)
        return typer.Exit(code=code)

    @study_app.command("run")
    def run_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec, e.g. "
                                                                   "studies/table1.toml"),
        jobs: int = typer.Option(2, "--jobs", help="runs at a time (one torch thread each)"),
        seeds: str | None = typer.Option(None, "--seeds", help="only these of the spec's seeds, "
                                                               "e.g. 0,1"),
        cells_opt: str | None = typer.Option(
            None, "--cells", help="only the cells whose id matches one of these shell "
                                  "patterns, e.g. 'none-*,ssn-skip-p0.2-*'"),
        dry_run: bool = typer.Option(False, "--dry-run", help="list the cells that would run"),
        skip_memory_check: bool = typer.Option(
            False, "--skip-memory-check", help="start runs whatever their memory estimate"),
        allow_mixed: bool = typer.Option(
            False, "--allow-mixed-arithmetic",
            help="add cells made here to seed blocks made with another arithmetic (their "
                 "pairs are then not twins; docs/ALGORITHMS.md)"),
    ) -> None:
        """Run the cells of SPEC that have no result file yet on the failure-sweep flow.

        The flow runs on the embedded stack (ephemeral Prefect, the registry over SQLite in the
        study's runs folder), JOBS cells at a time; cells with a results/NAME/CELL.json are
        skipped, and each finished cell's summary is kept there. Ends with the offline report.

        Every cell of one seed is made with one arithmetic (crucible.arithmetic's digest): the
        seeds whose results were made with another are left out (named, with the fix), and
        naming such a seed in --seeds is refused (exit 2).

        Exit 1 if a run failed (the others still run), 2 for a bad spec or option."""
        if jobs < 1:
            raise fail(f"--jobs must be >= 1, got {jobs}")
        from crucible.study.pipeline_real import is_real_spec
        if is_real_spec(spec_path):
            if cells_opt is not None:
                raise fail("--cells: a pipeline-real study runs every cell of a seed (its "
                           "baseline and its kill runs pair); choose seeds with --seeds")
            code = _run_real(spec_path, seeds=seeds, dry_run=dry_run, echo=typer.echo)
            if code:
                raise typer.Exit(code=code)
            return
        from crucible.config import ConfigError
        from crucible.preflight import check_spec_here

        try:
            spec = load_spec(spec_path)
            spec = for_run(spec, jobs=jobs, seeds=_parse_seeds(seeds, spec),
                           cells=_parse_cells(cells_opt))
            if not dry_run:
                check_spec_here(spec, memory_check=not skip_memory_check)
            cells = spec.runs_now()
            if not cells:
                raise StudyError(f"--seeds/--cells select none of {spec.name}'s cells; "
                                 "`crucible study run SPEC --dry-run` lists them")
            done, todo = completed_cells(spec, cells)
            refused: dict[int, str] = {}
            if not allow_mixed:
                todo, refused = arithmetic_check(spec, todo, explicit_seeds=seeds is not None)
            adoptable = adopt_results(spec, todo, write=False)
            if not allow_mixed:
                adoptable = _same_arithmetic(spec, todo, adoptable)
            adopted = adopt_results(spec, [c for c in todo if c.id in adoptable],
                                    write=not dry_run)
        except (StudyError, ConfigError) as exc:
            raise fail(str(exc)) from None
        if adopted:
            typer.echo(f"study {spec.name}: {len(adopted)} cells taken from identical runs of "
                       + ", ".join(sorted(set(adopted.values()))))
        todo = [cell for cell in todo if cell.id not in adopted]
        for seed in sorted(refused):
            typer.echo(f"study {spec.name}: seed {seed} left out: {refused[seed]}", err=True)
        if refused:     # the flow runs exactly the cells this machine may add
            spec = for_run(spec, jobs=jobs, cells=[cell.id for cell in todo] or ["-"])
        left_out = (f", {len(cells) - len(done) - len(todo) - len(adopted)} left out"
                    if refused else "")
        typer.echo(f"study {spec.name}: {len(cells)} cells, {len(done) + len(adopted)} already in "
                   f"{spec.shown(spec.results_dir)} (skipped){left_out}, {len(todo)} to run"
                   + ("" if dry_run or not todo else f", {jobs} at a time"))
        if dry_run:
            for cell in todo:
                typer.echo(f"  {cell.id}: crucible run --preset {spec.preset} "
                           + " ".join(f"--set {o}" for o in cell.overrides(spec)))
            return
        if not todo:
            return
        from cli.embedded import run_sweep_embedded

        report = run_sweep_embedded(spec, spec.runs_dir, skip_memory_check=skip_memory_check)
        kept = len(completed_cells(spec, cells)[0])
        if report.outcome is not None:
            typer.echo(f"study {spec.name}: {report.outcome['completed']} ran, "
                       f"{report.outcome['failed']} failed; {kept} of {len(cells)} cells in "
                       f"{spec.shown(spec.results_dir)}")
        else:       # the flow failed: some cells failed (the others ran and were kept)
            typer.echo(f"study {spec.name}: {kept} of {len(cells)} cells in "
                       f"{spec.shown(spec.results_dir)}; failed: {report.message}", err=True)
        typer.echo(f"registry sweep {report.sweep_id} (SQLite in {spec.shown(spec.runs_dir)})")
        typer.echo(f"report: {report.report_path}")
        if report.outcome is None or report.outcome["failed"]:
            raise typer.Exit(code=1)

    @study_app.command("render")
    def render_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec"),
        check: bool = typer.Option(False, "--check", help="exit 1 if the document differs from "
                                                          "what the data render (no writing)"),
        figures: bool = typer.Option(True, "--figures/--no-figures",
                                     help="also render the PNG figures (headless Chromium)"),
    ) -> None:
        """Render the results document and its PNG figures from the committed results.

        --check writes nothing and exits 1 if the document differs (figures are not checked)."""
        from crucible.study.pipeline_real import is_real_spec
        if is_real_spec(spec_path):
            try:
                code = _render_real(spec_path, check=check, echo=typer.echo)
            except StudyError as exc:
                raise fail(str(exc)) from None
            if code:
                raise typer.Exit(code=code)
            return
        try:
            spec = load_spec(spec_path)
            code = render(spec, check=check, figures=figures and not check, echo=typer.echo)
        except FigureError as exc:
            raise fail(str(exc), code=1) from None
        except StudyError as exc:
            raise fail(str(exc)) from None
        if code:
            raise typer.Exit(code=code)

    @study_app.command("prove")
    def prove_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec"),
        cell: str = typer.Option(..., "--cell", help="a committed cell of the seed block to "
                                                     "prove, e.g. none-base-s3"),
        work_dir: Path = typer.Option(Path("runs/prove"), "--work-dir",
                                      help="where the re-run trains (removed afterwards)"),
    ) -> None:
        """Re-run one committed cell of a seed block made before the arithmetic probe, and
        record in the results whether this machine ended on the same bits.

        A match is the proof that lets `study run` add cells of that seed here; a mismatch is
        kept as evidence that this machine's arithmetic differs. Exit 0 on a match, 1 when the
        re-run differs (the record is written either way), 2 for a bad spec or cell."""
        from crucible.study.blocks import prove

        try:
            spec = load_spec(spec_path)
            path, proof = prove(spec, cell, work_dir=work_dir)
        except StudyError as exc:
            raise fail(str(exc)) from None
        verdict = ("the same bits: this machine computes the block's arithmetic"
                   if proof["matches"] else "other bits: this machine's arithmetic is not the "
                   "block's")
        typer.echo(f"{cell}: committed {proof['committed_final_val_loss']!r}, re-run "
                   f"{proof['rerun_final_val_loss']!r} ({proof['arithmetic']}): {verdict}")
        typer.echo(f"recorded: {spec.shown(path)}")
        if not proof["matches"]:
            raise typer.Exit(code=1)

    @study_app.command("adopt")
    def adopt_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec"),
    ) -> None:
        """Copy the runs of the spec's `reuse` specs that have its cells' exact configuration
        into its results (what `study run` does before it runs anything); runs nothing."""
        try:
            spec = load_spec(spec_path)
            _, todo = completed_cells(spec, spec.cells())
            adopted = adopt_results(spec, todo)
        except StudyError as exc:
            raise fail(str(exc)) from None
        typer.echo(f"study {spec.name}: {len(adopted)} cells taken from identical runs"
                   + (f" of {', '.join(sorted(set(adopted.values())))}" if adopted else "")
                   + f" into {spec.shown(spec.results_dir)}/")

    app.add_typer(study_app, name="study")
