"""The results document: `render_markdown` writes the whole Markdown document from a
`StudyData` (deterministic: only the data and the spec), `render` writes it with Table 1 as CSV
and LaTeX (crucible.study.paper) and the figures, or with `check` compares them with the files.

The document's prose is the template `results.md.j2` beside this module; `render_markdown`
fills it with what the data say (tables, numbers, verdicts; their formatting lives in
crucible.study.formatting, and the pilot, scale and alignment sections are written by their own
modules).
"""
from __future__ import annotations

import functools
import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from crucible.grid.cells import expand_cells
from crucible.grid.key import CellKey
from crucible.grid.names import ARM_LABEL, ARMS
from crucible.grid.spec import SweepSpec
from crucible.runfiles import write_text_atomic
from crucible.stats import (
    BLOG_DROP,
    BLOG_SKIP,
    CLAIM_PS,
    LOW_P,
    TABLE1_ARMS,
    Claim,
    paired_stat,
    skip_minus_drop,
)
from crucible.study.data import NOISE_FLOOR_Z, StudyData, noise_floor_of
from crucible.study.figures import build_figures, figure_files, write_figures
from crucible.study.formatting import (
    _cell_name,
    _ci,
    _claim_sentence,
    _claim_summary,
    _decide_text,
    _duration,
    _num,
    _pct,
    _pts,
    _range,
    _seeds_for_target,
    _seeds_needed,
    _table,
    _variant,
    _verdict_word,
)
from crucible.study.runner import load_results


def _share(run: Mapping[str, Any]) -> float | None:
    budget = run.get("tokens_budget")
    return run["tokens_processed"] / budget if budget else None


def _setting(data: StudyData) -> dict[str, Any]:
    """What the runs were: from the data where it has it (configs, versions, wall time)."""
    from crucible.config import Config, ConfigError
    from crucible.presets import get_preset, parameter_count, tokens_per_global_step

    runs = [data.results[c.id] for c in data.cells if c.id in data.results]
    config = None
    source = "preset"
    base_runs = [r for arm in ARMS for r in data.baseline(arm).values()]
    for run in base_runs + runs:
        try:
            config = Config.from_dict(run["config"])
            source = "results"
            break
        except (ConfigError, KeyError, TypeError):
            continue
    if config is None:
        from crucible.config import apply_overrides
        config = apply_overrides(get_preset(data.spec.preset), list(data.spec.common_overrides()))
    shapes = {_shape(r) for r in runs}
    digests = {r["data_digest"] for r in runs if r.get("data_digest")}
    shas: dict[str, int] = {}
    machines: dict[str, int] = {}
    for run in runs:
        sha = (run.get("versions") or {}).get("git_sha") or "unknown"
        shas[sha] = shas.get(sha, 0) + 1
        machine = (run.get("study") or {}).get("machine")
        if machine:
            machines[machine] = machines.get(machine, 0) + 1
    params = parameter_count(config)
    tokens = tokens_per_global_step(config) * config.train.global_steps
    return {"config": config, "source": source, "params": params, "tokens": tokens,
            "chinchilla": tokens / (20.0 * params), "shapes": len(shapes), "shas": shas,
            "machines": machines, "runs": len(runs), "digests": sorted(digests),
            "undigested": sum(1 for r in runs if not r.get("data_digest")),
            "wall_s": math.fsum(float(r["wall_s"]) for r in runs)}


def _shape(run: Mapping[str, Any]) -> str:
    """A run's configuration beyond what the grid varies (seed, arm, p, strategy, decode),
    beyond the name of the preset it was written as (a pilot's `study` preset with
    `model.d_model=128` is the same configuration as `study-d128`) and beyond where its corpus
    lay: corpora are compared by content (`data_digest`), never by path."""
    varying = ("seed", "pipeline", "faults", "preset")
    config = {k: v for k, v in run["config"].items() if k not in varying}
    if isinstance(config.get("data"), dict):
        data = {k: v for k, v in config["data"].items() if k != "path"}
        path = config["data"].get("path")
        if not run.get("data_digest") and isinstance(path, str):
            data["file"] = Path(path).name    # no digest: the file's name is all there is
        config["data"] = data
    return json.dumps(config, sort_keys=True)


def _answer(data: StudyData, claims: Sequence[Claim], setting: Mapping[str, Any],
            resolvable: float | None) -> list[str]:
    """The opening three sentences, templated from the data."""
    spec = data.spec
    by_tag = {c.tag: c for c in claims}
    scale = (f"{setting['params'] / 1e6:.2f}M-parameter runs of {setting['tokens'] / 1e6:.2f}M "
             "tokens on a CPU")

    def means(strategy: str) -> list[float]:
        return [s.mean for k in data.grid() if k.strategy == strategy and k.p in CLAIM_PS
                and not k.label for s in [data.stat(k)] if s.mean is not None]

    skip, drop = means("skip"), means("drop")
    if not skip and not drop:
        return [f"No failure cell has a result yet, so this document answers nothing so far. "
                f"Run `crucible study run {spec.shown(spec.path)}` (it skips the cells already "
                f"in `{spec.shown(spec.results_dir)}/`) and render this file again with "
                f"`{spec.command}`. The study's runs are {scale}, not the blog's 178M "
                "Chinchilla-budget runs."]
    # the grid's own failure rates and arms, as many as it has (one arm, one p: said so)
    ps = sorted({k.p for k in data.grid() if k.p in CLAIM_PS and not k.label
                 and k.strategy in ("skip", "drop")})
    arms = {k.arm for k in data.grid() if k.p in ps and not k.label}
    at = " and ".join(f"{p:g}" for p in ps)
    over = " over the arms (cell means)" if len(arms) > 1 else f" ({ARM_LABEL[min(arms)]})"
    first = (f"At p = {at}, skipping a failed stage raised the final validation loss by "
             f"{_range(skip)}{over} and dropping the replica's tokens by "
             f"{_range(drop)}, against the blog's +0.6-0.9% and {BLOG_DROP}")
    a = by_tag.get("a")
    every = "at every p" if len(ps) > 1 else f"at every p (tested at p = {at})"
    first += ("." if a is None else
              f"; the blog's \"skip costs less than drop {every}\" is {_verdict_word(a)} "
              f"here ({a.count('supports')} of {len(a.comparisons)} paired "
              f"comparison{'s' if len(a.comparisons) != 1 else ''} "
              f"{'have their' if len(a.comparisons) != 1 else 'has its'} 95% interval below 0).")
    named = {"b": "\"degradation grows with p\"", "c": "\"SSN degrades least\"",
             "d": f"\"MAPL is close to uncompressed\" (within ±{spec.close_margin:g} points)"}
    words = [f"{name} is {_verdict_word(by_tag[tag])}" for tag, name in named.items()
             if tag in by_tag]
    second = ""
    if words:
        listed = ", ".join(words[:-1]) + ", and " + words[-1] if len(words) > 2 else \
            " and ".join(words)
        second = f"Of the blog's {'other ' if a is not None else ''}claims, {listed}."
    e = by_tag.get("e")
    if e is not None:
        second += (f" The seed texts' \"at p = {LOW_P:g} the loss stays close to baseline\" "
                   f"(within ±{spec.equivalence_margin:g} points) is "
                   + (f"{_verdict_word(e)}." if e.comparisons else
                      f"not tested: p = {LOW_P:g} is not in this grid."))
    second = second.strip()
    ns = sorted({data.stat(k).n for k in data.grid()} - {0})
    seeds = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    run = sum(1 for k in data.grid() if data.stat(k).n)
    cells = ("" if run == len(data.grid()) else
             f" ({run} of {len(data.grid())} failure cells run so far)")
    res = ("" if resolvable is None else
           f"; differences smaller than about {resolvable:.2f} points are within this study's noise")
    third = (f"These are {scale} with {seeds} seed{'s' if ns[-1] != 1 else ''} per cell{cells}, "
             f"not the blog's 178M Chinchilla-budget runs{res}.")
    return [" ".join(part for part in (first, second, third) if part)]


def _missing_count(data: StudyData) -> tuple[int, int]:
    """(not run, expected) over the grid's listed cells (a precision round's seeds are extra,
    never owed)."""
    cells = expand_cells(data.spec)
    return len(cells) - sum(1 for c in cells if c.id in data.results), len(cells)


_TEMPLATE = "results.md.j2"


@functools.cache
def _template() -> Any:
    """The document's template (beside this module), its whitespace as written."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent),
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    env.globals["block"] = lambda lines: "\n".join(lines) + "\n" if lines else ""
    return env.get_template(_TEMPLATE)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def render_markdown(data: StudyData, *, figure_names: Mapping[str, str] | None = None) -> str:
    """The whole results document as Markdown (deterministic: only the data and the spec):
    the template `results.md.j2` holds its prose, this function the numbers it prints."""
    spec = data.spec
    claims = data.claims()
    setting = _setting(data)
    cfg = setting["config"]
    halves = [s.half for s in (data.stat(k) for k in data.grid()) if s.half is not None]
    resolvable = statistics.median(halves) if halves else None
    missing, expected = _missing_count(data)
    figures = figure_names or figure_files(spec)
    img = {name: Path(os.path.relpath(path, spec.document.parent)).as_posix()
           for name, path in figures.items()}
    seeds_per_cell: dict[int, int] = {}
    for key in data.grid():
        n = data.stat(key).n
        seeds_per_cell[n] = seeds_per_cell.get(n, 0) + 1
    pilots: list[str] = []
    if spec.files.pilots:
        from crucible.study.pilot import pilot_rows, pilot_section

        pilots += pilot_section(spec, pilot_rows(spec), ARM_LABEL)
    if spec.files.token_check:
        from crucible.study.pilot import token_section

        pilots += token_section(spec, ARM_LABEL)
    from crucible.study.alignment import alignment_section

    extras = _extras(data, img) + alignment_section(data, ARM_LABEL, img.get("alignment"))
    if spec.files.scale:
        from crucible.study.scale import scale_section

        extras += scale_section(data, ARM_LABEL)
    if spec.files.processes:
        from crucible.study.processes import processes_section

        extras += processes_section(data, ARM_LABEL)
    from crucible.study.costs import cost_section

    costs = cost_section(data, ARM_LABEL)
    from crucible.study.blocks import blocks_section, load_proofs
    from crucible.study.estimand import estimand_section
    from crucible.study.price import price_section

    seed_blocks = blocks_section(spec, data.results, load_proofs(spec))
    estimand = estimand_section(spec, ARM_LABEL)
    prices = price_section(data, claims, _gpu(spec))
    return _template().render(
        title=spec.title or "Failure study: the blog's Table 1 and Figure 3, with intervals",
        command=spec.command, results=spec.shown(spec.results_dir),
        spec_path=spec.shown(spec.path), name=spec.name, preset=spec.preset, img=img,
        answer="\n".join(_answer(data, claims, setting, resolvable)),
        params=setting["params"], model=cfg.model, train=cfg.train, lr=f"{cfg.train.lr:g}",
        common=", ".join(f"`{s}`" for s in spec.common_overrides()),
        replicas=cfg.replicas, stages=cfg.pipeline.stages,
        inner_steps=cfg.sparseloco.inner_steps, factor=cfg.pipeline.factor,
        tokens=f"{setting['tokens']:,}", chinchilla=setting["chinchilla"],
        fault_duration=cfg.faults.duration,
        seeds=", ".join(str(s) for s in spec.all_seeds),
        seeds_per_cell=", ".join(f"{_plural(c, 'cell')} with {n}"
                                 for n, c in sorted(seeds_per_cell.items(), reverse=True)),
        expected=expected, missing=missing, cell_count=len(data.keys),
        commits=", ".join(f"`{sha[:12]}` ({_plural(n, 'run')})"
                          for sha, n in sorted(setting["shas"].items())),
        wall=_duration(setting["wall_s"]), runs=setting["runs"],
        machines="; ".join(f"{name} ({n} runs)" for name, n in sorted(setting["machines"].items())),
        preset_note=setting["source"] == "preset" and setting["runs"],
        shapes=setting["shapes"], digests=setting["digests"], undigested=setting["undigested"],
        notes=spec.notes, pilots=pilots, extras=extras, costs=costs,
        seed_blocks=seed_blocks, estimand=estimand, prices=prices,
        table1=_lines(_table1(data)), target=f"{spec.target_half_width:g}",
        cells_table=_lines(_cells_table(data)), baselines_table=_lines(_baselines_table(data)),
        claims=claims, claims_table=_lines(_claims_table(spec, claims)),
        comparison_tables=[_lines(_comparisons_table(claim)) for claim in claims],
        sentences=[_claim_sentence(claim) for claim in claims],
        cannot_resolve=_cannot_resolve(data, resolvable, missing, expected))


def _gpu(spec: SweepSpec) -> dict[str, Any] | None:
    """The GPU estimate of the spec's `gpu` companion, when the study has one (the spec
    `gpu-<d>.toml` named in GPU_SPECS beside it, priced on GPU_DEPLOYMENT)."""
    from crucible.study.price import GPU_DEPLOYMENT, GPU_SPECS, gpu_estimate

    name = GPU_SPECS.get(spec.name)
    if name is None:
        return None
    root = spec.path.parent
    return gpu_estimate(root / name, root.parent / GPU_DEPLOYMENT)


def _lines(lines: Sequence[str]) -> str:
    return "\n".join(lines)


def _table1(data: StudyData) -> list[str]:
    header = ["p"]
    for arm in TABLE1_ARMS:
        header += [f"{ARM_LABEL[arm]} (Crucible)", f"{ARM_LABEL[arm]} (blog)"]
    rows = []
    for p in CLAIM_PS:
        row = [f"{p:g}"]
        for arm in TABLE1_ARMS:
            key = data.find(arm, "skip", p)
            row += [_pct(data.stat(key)) if key else "not in the spec",
                    f"+{BLOG_SKIP[(arm, p)]:.1f}%"]
        rows.append(row)
    return _table(header, rows)


def _cells_table(data: StudyData) -> list[str]:
    target = data.spec.target_half_width
    rows = []
    for key in data.grid():
        s = data.stat(key)
        share = data.mean_of(key, _share)
        down = data.mean_of(key, lambda r: r.get("replica_down_fraction"))
        present = len(data.runs(key))
        n_text = str(s.n) if present == s.n else f"{s.n} ({present - s.n} without baseline)"
        rows.append([ARM_LABEL[key.arm], key.strategy, _variant(key), f"{key.p:g}", n_text,
                     "not run yet" if s.mean is None else f"{s.mean:+.2f}%",
                     _ci(s) if s.n != 1 else "n=1, no interval", _num(s.half),
                     _seeds_for_target(s, target),
                     "-" if share is None else f"{100 * share:.1f}%",
                     "-" if down is None else f"{100 * down:.1f}%"])
    return _table(["arm", "strategy", "variant", "p", "n", "mean", "95% CI", "half-width",
                   f"seeds for ±{target:g}", "tokens processed", "replica-steps down"], rows)


def _baselines_table(data: StudyData) -> list[str]:
    rows = []
    for arm in ARMS:
        runs = data.baseline(arm)
        if CellKey.baseline_of(arm) not in data.keys:
            continue
        losses = [r["final_val_loss"] for r in runs.values()]
        initial = [r["initial_val_loss"] for r in runs.values()
                   if r.get("initial_val_loss") is not None]
        wall = [float(r["wall_s"]) for r in runs.values()]
        rows.append([ARM_LABEL[arm], str(len(losses)),
                     _num(statistics.fmean(losses) if losses else None, ".4f"),
                     _num(statistics.stdev(losses) if len(losses) > 1 else None, ".4f"),
                     _num(statistics.fmean(initial) if initial else None, ".4f"),
                     _num(statistics.fmean(wall) if wall else None, ".0f")])
    return _table(["arm", "n", "final val loss (mean)", "sd", "initial val loss",
                   "wall s (mean)"], rows)


def _claims_table(spec: SweepSpec, claims: Sequence[Claim]) -> list[str]:
    rows = [[f"({claim.tag}) {claim.title}", claim.blog, _claim_summary(claim),
             f"**{claim.verdict}**", _seeds_needed(claim)] for claim in claims]
    return _table(["claim", "blog" if spec.references is None else "reference",
                   "Crucible (95% CI)", "agrees?", "seeds that would decide it"], rows)


def _comparisons_table(claim: Claim) -> list[str]:
    return _table(["comparison", "n", "mean [95% CI]", "reads as", "seeds to decide"],
                  [[c.label, str(c.stat.n), _pts(c.stat), c.status, _decide_text(c)]
                   for c in claim.comparisons]
                  or [["-", "0", "not in the grid or not run yet", "missing", "-"]])


def _cannot_resolve(data: StudyData, resolvable: float | None, missing: int,
                    expected: int) -> list[str]:
    """The items of "What the measurement cannot resolve"."""
    spec = data.spec
    sd_floor, floor = noise_floor_of(data)
    diff_halves = [s.half for _, _, s in skip_minus_drop(data.claim_cells())
                   if s.half is not None]
    wide = [(key, s) for key in data.grid() for s in [data.stat(key)]
            if s.half is not None and round(s.half, 2) > spec.target_half_width]
    one = [key for key in data.grid() if data.stat(key).n == 1]
    out = []
    if resolvable is None:
        out.append("No cell has two seeds yet, so no interval and no noise floor exist.")
    else:
        out.append(f"Smallest resolvable degradation: the median 95% half-width over the cells "
                   f"is {resolvable:.2f} points, so a cell whose mean is closer to 0 than that "
                   "cannot be told from no degradation.")
        if diff_halves:
            out.append(f"Smallest resolvable skip - drop difference: the median half-width of "
                       f"the paired differences is {statistics.median(diff_halves):.2f} points.")
        out.append(f"Noise floor of one seed: the median per-cell sd of the degradation is "
                   f"{sd_floor:.2f} points, so one seed's value lies within about "
                   f"±{floor:.2f} points ({NOISE_FLOOR_Z:g} sd) of its cell's mean; `crucible "
                   "sweep` quotes this figure for a sweep's one-seed cells.")
        n_seeds = max(s.n for s in (data.stat(k) for k in data.grid()))
        out.append(f"Halving these widths takes about four times the seeds ({4 * n_seeds} "
                   f"instead of {n_seeds}).")
    if wide:
        out.append(f"Cells whose half-width exceeds {spec.target_half_width:g} points "
                   f"({len(wide)}): " + "; ".join(
                       f"{_cell_name(k)} ±{s.half:.2f}" for k, s in wide) + ".")
    elif resolvable is not None:
        out.append(f"No cell's half-width exceeds {spec.target_half_width:g} points.")
    if one:
        out.append(f"Cells with one seed, no interval ({len(one)}): "
                   + ", ".join(_cell_name(k) for k in one) + ".")
    if missing:
        out.append(f"Not run yet: {missing} of {expected} runs; "
                   f"`crucible study run {spec.shown(spec.path)}` runs only those.")
    out.append("This is a CPU-sized model on a small corpus; the blog's absolute numbers (178M "
               "parameters, Chinchilla tokens) are not expected to match, only the direction and "
               "the ordering of the effects.")
    return out


def _extras(data: StudyData, img: Mapping[str, str]) -> list[str]:
    """Strategies beyond skip/drop and the labelled variants (MAPL decode options)."""
    extra_keys = [k for k in data.grid() if k.label or k.strategy not in ("skip", "drop")]
    if not extra_keys:
        return []
    out = ["## Beyond the blog: other strategies and variants", "",
           "Each row: the same arm's cells at one p, degradation in % with the 95% interval; "
           "variants are the labelled grid blocks (their overrides below). \"Minus skip\" is "
           "paired by seed: another strategy against the same variant's skip where the variant "
           "has one (the same failure schedule), a variant's skip against the unlabelled "
           "skip.", ""]
    groups = sorted({(k.arm, k.p) for k in extra_keys}, key=lambda g: (ARMS.index(g[0]), g[1]))
    for arm, p in groups:
        keys = [k for k in data.grid() if k.arm == arm and k.p == p]
        out += [f"**{ARM_LABEL[arm]}, p = {p:g}**", ""]
        rows = []
        for key in keys:
            # another strategy against the same variant's skip (its failure schedule, seed by
            # seed) where it has one; a variant's skip against the unlabelled skip
            ref = (key.strategy != "skip" and data.find(arm, "skip", p, key.label)) \
                or data.find(arm, "skip", p)
            s = data.stat(key)
            vs = "-"
            if ref is not None and key != ref:
                vs = _pts(paired_stat(data.degradation(key), data.degradation(ref)))
            rows.append([key.strategy, _variant(key), _pct(s), vs])
        out += _table(["strategy", "variant", "degradation", "minus skip (paired, points)"], rows)
        out.append("")
    labelled = {}
    for block in data.spec.blocks:
        if block.label:
            labelled[block.label] = tuple(block.overrides)
    if labelled:
        from crucible.config import apply_overrides
        from crucible.presets import get_preset

        base = apply_overrides(get_preset(data.spec.preset), list(data.spec.common_overrides())).to_dict()
        varied = sorted({item.split("=", 1)[0].strip() for sets in labelled.values()
                         for item in sets})
        defaults = []
        for key in varied:
            node: Any = base
            for part in key.split("."):
                node = node[part]
            defaults.append(f"`{key}={node}`")
        out += ["Variants: " + "; ".join(f"`{label}` = {', '.join(f'`{s}`' for s in sets)}"
                                         for label, sets in sorted(labelled.items()))
                + f" (unlabelled cells use the preset's defaults: {', '.join(defaults)}).", ""]
    out += [f"![Other strategies and variants]({img['extras']})", ""]
    return out


def table_files(spec: SweepSpec) -> dict[str, Path]:
    """Table 1 for a paper (crucible.study.paper), beside the document."""
    folder = spec.document.parent / "tables"
    return {"csv": folder / f"{spec.name}-table1.csv", "tex": folder / f"{spec.name}-table1.tex"}


def _rendered(spec: SweepSpec, data: StudyData) -> dict[Path, str]:
    """Every text file the data render: the document and Table 1 as CSV and LaTeX."""
    from crucible.study.paper import table1_csv, table1_latex

    tables = table_files(spec)
    return {spec.document: render_markdown(data), tables["csv"]: table1_csv(data),
            tables["tex"]: table1_latex(data)}


def render(spec: SweepSpec, *, check: bool = False, figures: bool = True,
           echo: Callable[[str], None] = print) -> int:
    """Render (or, with `check`, compare) the document and its tables; returns the exit code."""
    data = StudyData(spec, load_results(spec))
    texts = _rendered(spec, data)
    if check:
        stale = 0
        for path, text in texts.items():
            try:
                current = path.read_text(encoding="utf-8")
            except OSError:
                current = None
            if current == text:
                continue
            stale += 1
            import difflib

            echo(f"{spec.shown(path)} differs from what {spec.shown(spec.results_dir)} "
                 f"renders; run `{spec.command}` and commit the result")
            if current is not None:
                diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(),
                                                 "committed", "rendered", lineterm="", n=1))
                for line in diff[:40]:
                    echo(line)
        if stale:
            return 1
        echo(f"{spec.shown(spec.document)} and its tables are up to date with "
             f"{spec.shown(spec.results_dir)}")
        return 0
    for path, text in texts.items():
        write_text_atomic(path, text)
    missing, expected = _missing_count(data)
    echo(f"wrote {spec.shown(spec.document)} from {expected - missing} of {expected} runs "
         f"({missing} not run yet)")
    for path in list(texts)[1:]:
        echo(f"wrote {spec.shown(path)}")
    if figures:
        for path in write_figures(build_figures(data), figure_files(spec)):
            echo(f"wrote {spec.shown(path)}")
    return 0
