"""The failure study: a committed grid spec, run on the failure-sweep flow, and the generated results
document.

    crucible study run studies/table1-d128.toml [--jobs 2] [--seeds 0,1] [--dry-run]
    crucible study render studies/table1-d128.toml [--check] [--no-figures]
    crucible study adopt studies/table1-d128.toml   # identical runs of its `reuse` specs

A spec (TOML, loaded into the one spec model of sweeps and studies, `crucible.spec.SweepSpec`;
the `failure-sweep` flow takes the same grid) names a preset, the seeds and a list of grid blocks (arms x strategies x p, plus
optional `key=value` overrides, a label and the block's own `seeds`; an arm's baselines cover
every seed one of its blocks runs). Optional spec keys: `pilots` (candidate-preset specs whose
table the document shows, crucible.study.pilot), `token_check` (half-tokens and full pilot specs),
`scale` (specs running some cells at a larger model, crucible.study.scale), `reuse` (specs whose runs
with exactly a cell's configuration count as that cell), `close_margin`, `resolve_threshold`
(or `target_half_width`: the target half-width), `equivalence_margin` (claim (e)), `duration`,
`global_steps` and `max_seeds` (seeds by precision: the rounds' seeds are read back too). It expands into cells with stable
ids:

    none-base-s0                      the p = 0 baseline of an arm and seed, shared by every
                                      strategy and block of that arm
    mapl-skip-p0.2-s3                 arm, strategy, p, seed
    mapl-skip-p0.2-decode_sender-s1   the same with a block label (its overrides)

`study run` runs every cell whose result file `<results_dir>/<cell-id>.json` is missing on the
`failure-sweep` flow (crucible.spec's model is its parameter; the embedded stack: ephemeral
Prefect and the registry over SQLite in `<runs_dir>`, one torch thread a cell, `--jobs` at a
time), and the flow keeps each finished cell's summary there, so a grid can be completed over
several sittings and the results committed. `study render` turns the committed results into the Markdown document and
its PNG figures; `--check` fails when the document differs from what the data render.

Statistics: a cell's degradation for seed s is 100 (L - L0) / L0 of the final validation loss,
L0 being the same arm's p = 0 baseline with the same seed (every arm and strategy at the same p
and seed sees the same failure schedule, so comparisons are paired by seed). Means come with a
95% Student-t interval over seeds (crucible.stats); one seed gives no interval.

Paths inside a spec are relative to the spec file's folder. Relative paths printed in the
document are relative to the folder above it (the repository root for `studies/NAME.toml`).

The code, one concern a module: crucible.study.spec (the spec and its cells),
crucible.study.runner (keeping, adopting and loading results), crucible.study.data
(`StudyData`, the noise floor), crucible.study.document (the Markdown document and `render`),
crucible.study.formatting (how it writes numbers and verdicts), crucible.study.figures (the PNG
figures) and cli.study (`crucible study ...`). This package re-exports their names.
"""
from __future__ import annotations

from crucible.study.data import NOISE_FLOOR_Z, StudyData, noise_floor
from crucible.study.data import _row as _row
from crucible.study.data import noise_floor_of as noise_floor_of
from crucible.study.document import _extras as _extras
from crucible.study.document import _missing_count as _missing_count
from crucible.study.document import _rendered as _rendered
from crucible.study.document import render, render_markdown
from crucible.study.document import table_files as table_files
from crucible.study.figures import CHROMIUM as CHROMIUM
from crucible.study.figures import CHROMIUM_ARGS as CHROMIUM_ARGS
from crucible.study.figures import build_figures, write_figures
from crucible.study.figures import figure_files as figure_files
from crucible.study.formatting import _cell_name as _cell_name
from crucible.study.formatting import _ci as _ci
from crucible.study.formatting import _claim_sentence as _claim_sentence
from crucible.study.formatting import _claim_summary as _claim_summary
from crucible.study.formatting import _num as _num
from crucible.study.formatting import _pct as _pct
from crucible.study.formatting import _pts as _pts
from crucible.study.formatting import _table as _table
from crucible.study.runner import BULKY_FIELDS as BULKY_FIELDS
from crucible.study.runner import MAX_RESULT_BYTES as MAX_RESULT_BYTES
from crucible.study.runner import adopt_results as adopt_results
from crucible.study.runner import check_result as check_result
from crucible.study.runner import check_same_cpu as check_same_cpu
from crucible.study.runner import comparable_config as comparable_config
from crucible.study.runner import cpu_model as cpu_model
from crucible.study.runner import keep_result as keep_result
from crucible.study.runner import load_results
from crucible.study.runner import machine_description as machine_description
from crucible.study.runner import portable as portable
from crucible.study.runner import slim_summary as slim_summary
from crucible.study.spec import (
    DEFAULT_SPEC,
    FigureError,
    StudyError,
    completed_cells,
    load_spec,
)
from crucible.study.spec import result_cells as result_cells
from crucible.study.spec import result_path as result_path

__all__ = ["StudyError", "FigureError", "load_spec", "completed_cells", "load_results", "StudyData",
           "render_markdown", "build_figures", "write_figures", "render", "noise_floor",
           "NOISE_FLOOR_Z", "DEFAULT_SPEC"]
