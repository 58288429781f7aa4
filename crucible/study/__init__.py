"""The failure study: a committed grid spec, run on the failure-sweep flow, and the generated results
document.

    crucible study run studies/table1-d128.toml [--jobs 2] [--seeds 0,1] [--dry-run]
    crucible study render studies/table1-d128.toml [--check] [--no-figures]
    crucible study adopt studies/table1-d128.toml   # identical runs of its `reuse` specs

A spec (TOML, loaded into the one spec model of sweeps and studies, `crucible.grid.spec.SweepSpec`;
the `failure-sweep` flow takes the same grid) names a preset, the seeds and a list of grid blocks (arms x strategies x p, plus
optional `key=value` overrides, a label and the block's own `seeds`; an arm's baselines cover
every seed one of its blocks runs). Optional spec keys: `pilots` (candidate-preset specs whose
table the document shows, crucible.study.pilot), `token_check` (half-tokens and full pilot specs),
`scale` (specs running some cells at a larger model, crucible.study.scale), `processes` (specs
running its strategies under other failure processes, one labelled block each,
crucible.study.processes), `reuse` (specs whose runs
with exactly a cell's configuration count as that cell), `close_margin`, `resolve_threshold`
(or `target_half_width`: the target half-width), `equivalence_margin` (claim (e)), `duration`,
`global_steps` and `max_seeds` (seeds by precision: the rounds' seeds are read back too). It expands into cells with stable
ids:

    none-base-s0                      the p = 0 baseline of an arm and seed, shared by every
                                      strategy and block of that arm
    mapl-skip-p0.2-s3                 arm, strategy, p, seed
    mapl-skip-p0.2-decode_sender-s1   the same with a block label (its overrides)

`study run` runs every cell whose result file `<results_dir>/<cell-id>.json` is missing on the
`failure-sweep` flow (crucible.grid.spec's model is its parameter; the embedded stack: ephemeral
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

The code, one concern a module: crucible.study.spec (loading a spec, its result files),
crucible.study.runner (keeping, adopting and loading results), crucible.study.data
(`StudyData`, the noise floor), crucible.study.document (the Markdown document and `render`,
through the template results.md.j2), crucible.study.formatting (how it writes numbers and
verdicts), crucible.study.figures (the PNG figures), the document's sections crucible.study.pilot,
.scale, .alignment and .paper (Table 1 as CSV and LaTeX), and cli.study (`crucible study ...`).
This package's face holds their public names only.
"""
from __future__ import annotations

from crucible.study.data import NOISE_FLOOR_Z, StudyData, noise_floor
from crucible.study.document import render, render_markdown, table_files
from crucible.study.figures import CHROMIUM, build_figures, write_figures
from crucible.study.runner import (
    adopt_results,
    keep_result,
    load_results,
    portable,
    slim_summary,
)
from crucible.study.spec import (
    DEFAULT_SPEC,
    FigureError,
    StudyError,
    completed_cells,
    load_spec,
    result_cells,
    result_path,
)

__all__ = ["StudyError", "FigureError", "load_spec", "completed_cells", "result_cells",
           "result_path", "load_results", "keep_result", "adopt_results",
           "portable", "slim_summary", "StudyData", "render_markdown", "render",
           "table_files", "build_figures", "write_figures", "noise_floor", "NOISE_FLOOR_Z",
           "CHROMIUM", "DEFAULT_SPEC"]
