"""The `crucible` command line: the one place where the library, the registry, the flows and the
dashboards meet.

    crucible presets
    crucible run --preset NAME [--set key.path=value ...] [--out DIR] [--resume]
    crucible sweep ... | crucible deploy ...      (flows)
    crucible report --sweep ID --out FILE.html    (dashboards)
    crucible api ... | crucible db upgrade        (registry)

Exit codes: 0 success, 2 bad input (a message names the key and the allowed values), 1 failure.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import typer

__all__ = ["app", "main"]

app = typer.Typer(help="Crucible: fault-tolerance experiments for low-bandwidth pipelined "
                       "LLM training.", no_args_is_help=True, add_completion=False)


def _setup_logging() -> None:
    level = os.environ.get("CRUCIBLE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=code)


@app.command()
def presets(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List the named configurations with their sizes and expected time on this CPU."""
    from crucible.presets import PRESETS, parameter_count, tokens_per_global_step

    rows = []
    for name, info in PRESETS.items():
        cfg = info.build()
        rows.append({"name": name, "description": info.description, "parameters": parameter_count(cfg),
                     "replicas": cfg.replicas, "stages": cfg.pipeline.stages,
                     "layers": cfg.model.layers, "d_model": cfg.model.d_model,
                     "global_steps": cfg.train.global_steps,
                     "tokens": tokens_per_global_step(cfg) * cfg.train.global_steps,
                     "expected_cpu": info.expected_cpu})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Crucible presets")
    for column in ("name", "parameters", "R x S", "layers", "d_model", "global steps", "tokens",
                   "expected on CPU", "description"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["name"], f"{r['parameters'] / 1e6:.2f}M", f"{r['replicas']} x {r['stages']}",
                      str(r["layers"]), str(r["d_model"]), str(r["global_steps"]),
                      f"{r['tokens'] / 1e6:.1f}M", r["expected_cpu"], r["description"])
    Console().print(table)


@app.command()
def run(preset: str = typer.Option("smoke", "--preset", help="named configuration"),
        overrides: list[str] = typer.Option([], "--set", help="key.path=value (repeatable)"),
        out: Path = typer.Option(Path("runs/latest"), "--out", help="output folder"),
        resume: bool = typer.Option(False, "--resume", help="continue from the last checkpoint"),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
        ) -> None:
    """Train one run locally (no server needed) and write OUT/summary.json."""
    _setup_logging()
    from crucible.config import ConfigError, apply_overrides
    from crucible.faults import FaultPlanError
    from crucible.presets import get_preset

    try:
        config = apply_overrides(get_preset(preset), overrides)
        _warn_about_corpus(config)
        from crucible.train import TrainingDiverged, train

        summary = train(config, out_dir=out, resume=resume, progress=progress and sys.stderr.isatty())
    except (ConfigError, FaultPlanError) as exc:
        raise _fail(str(exc)) from None
    except TrainingDiverged as exc:
        raise _fail(str(exc), code=1) from None
    typer.echo(f"initial val loss {summary['initial_val_loss']:.4f} -> final "
               f"{summary['final_val_loss']:.4f} in {summary['wall_s']:.1f} s; "
               f"{summary['tokens_processed']} tokens")
    typer.echo(f"summary: {out / 'summary.json'}")


def _warn_about_corpus(config) -> None:  # noqa: ANN001 - Config, imported lazily
    from crucible.corpus import CorpusMissingError, default_corpus_path
    from crucible.presets import tokens_per_global_step

    if config.data.path is not None:
        return
    try:
        corpus = default_corpus_path().stat().st_size   # byte-level: one token per byte
    except CorpusMissingError:
        return   # training itself reports the missing corpus with the fix
    tokens = tokens_per_global_step(config) * config.train.global_steps
    if tokens > 20 * corpus:
        logging.getLogger("crucible").warning(
            "preset %s consumes %.1fB tokens but the default corpus has %.1fM: the data repeats "
            "about %dx. Set data.path to your own corpus (.bin shards, nanoGPT layout) for a "
            "meaningful run.", config.preset, tokens / 1e9, corpus / 1e6, tokens // corpus)


def _register_packages() -> None:
    import importlib

    for module in ("api.cli", "flows.cli", "dashboards.cli"):
        importlib.import_module(module).register(app)


def main() -> None:
    _register_packages()
    app()


if __name__ == "__main__":
    main()
