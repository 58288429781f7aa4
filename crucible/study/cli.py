"""`crucible study run|render|adopt`: the command line of the study (`register` adds it to the
`crucible` app).
"""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from crucible.spec import SweepSpec, expand_cells
from crucible.study.document import render
from crucible.study.runner import adopt_results, check_same_cpu, run_command, run_study
from crucible.study.spec import FigureError, StudyError, completed_cells, load_spec


def _check_machine(spec: SweepSpec, *, memory_check: bool = True) -> None:
    """Refuse (ConfigError) a spec whose cells this machine cannot run (device, memory estimate
    of one run), before any run starts; each cell's `crucible run` checks again for itself."""
    from crucible.config import apply_overrides
    from crucible.preflight import check_machine
    from crucible.presets import get_preset

    base, seen = get_preset(spec.preset), set()
    for cell in expand_cells(spec):
        config = apply_overrides(base, [o for o in cell.overrides(spec) if not o.startswith("seed=")])
        if config.to_json() not in seen:
            seen.add(config.to_json())
            check_machine(config, memory_check=memory_check)


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
        limit: int | None = typer.Option(None, "--limit", help="run at most N missing cells "
                                                               "this sitting"),
        dry_run: bool = typer.Option(False, "--dry-run", help="list the cells that would run"),
        skip_memory_check: bool = typer.Option(
            False, "--skip-memory-check", help="start runs whatever their memory estimate "
                                               "(passed on to each `crucible run`)"),
        allow_mixed_cpus: bool = typer.Option(
            False, "--allow-mixed-cpus", help="add runs made on this CPU model to results made "
                                              "on another (they are not bit-comparable)"),
    ) -> None:
        """Run the cells of SPEC that have no result file yet, JOBS at a time.

        Cells with a results/NAME/CELL.json are skipped; each finished run's summary is kept there.

        Exit 1 if a run failed (the others still run), 2 for a bad spec or option."""
        if jobs < 1:
            raise fail(f"--jobs must be >= 1, got {jobs}")

        def stop(signum: int, frame: Any) -> None:   # SIGTERM: stop the runs as Ctrl-C does
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        if limit is not None and limit < 1:
            raise fail(f"--limit must be >= 1, got {limit}")
        from crucible.config import ConfigError

        try:
            spec = load_spec(spec_path)
            if not dry_run:
                _check_machine(spec, memory_check=not skip_memory_check)
                if not allow_mixed_cpus:
                    check_same_cpu(spec)
            command = ((lambda spec, cell: [*run_command(spec, cell), "--skip-memory-check"])
                       if skip_memory_check else None)
            outcome = run_study(spec, jobs=jobs, seeds=_parse_seeds(seeds, spec), limit=limit,
                                dry_run=dry_run, echo=typer.echo, command=command)
        except (StudyError, ConfigError) as exc:
            raise fail(str(exc)) from None
        if outcome.interrupted:
            raise typer.Exit(code=130)
        if outcome.failed:
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
        try:
            spec = load_spec(spec_path)
            code = render(spec, check=check, figures=figures and not check, echo=typer.echo)
        except FigureError as exc:
            raise fail(str(exc), code=1) from None
        except StudyError as exc:
            raise fail(str(exc)) from None
        if code:
            raise typer.Exit(code=code)

    @study_app.command("adopt")
    def adopt_cmd(
        spec_path: Path = typer.Argument(..., metavar="SPEC", help="study spec"),
    ) -> None:
        """Copy the runs of the spec's `reuse` specs that have its cells' exact configuration
        into its results (what `study run` does before it runs anything); runs nothing."""
        try:
            spec = load_spec(spec_path)
            _, todo = completed_cells(spec, expand_cells(spec))
            adopted = adopt_results(spec, todo)
        except StudyError as exc:
            raise fail(str(exc)) from None
        typer.echo(f"study {spec.name}: {len(adopted)} cells taken from identical runs"
                   + (f" of {', '.join(sorted(set(adopted.values())))}" if adopted else "")
                   + f" into {spec.shown(spec.results_dir)}/")

    app.add_typer(study_app, name="study")
