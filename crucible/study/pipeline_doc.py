"""The real-failure study's document, from its result files alone
(`crucible study render studies/pipeline-real.toml`).

Per arm and strategy, paired by seed: the real runs' degradation against the shared baseline,
the simulator's replay of the same failure schedule, and their difference with a 95% interval
(what it says is worded from the interval, never by hand); the recovery times; the wall-clock
against the same seed's run without kills; and the cost model (crucible.pricing.cost) against
the measured wall-clock, calibrated on the runs without kills of the *other* seeds (so no run
is priced with numbers taken from itself), first as it prices planned failures, then with what
it had to learn from real deaths: the restart the next round waits for.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from crucible.stats import Stat, paired_stat, relative_degradation, stat_of
from crucible.study.formatting import _ci, _num, _pct, _table
from crucible.study.pipeline_real import RealSpec, all_cells, cell_id, load_real_results

__all__ = ["render_real", "real_rows"]

Result = Mapping[str, Any]


def _reads(diff: Stat) -> str:
    if diff.lo is None or diff.hi is None:
        return "too few seeds"
    if diff.lo > 0:
        return "real deaths cost more"
    if diff.hi < 0:
        return "real deaths cost less"
    return f"no difference resolved (±{diff.half:.2f} points)"


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _range(values: Sequence[float]) -> str:
    return "-" if not values else f"{min(values):.2f}-{max(values):.2f}"


# -- the cost model, calibrated on the other seeds' runs without kills --------------------------
def _calibration(bases: Sequence[Result], kills: Sequence[Result], H: int, S: int
                 ) -> dict[str, float] | None:
    """The machine as the runs without kills measure it (medians over runs): seconds per inner
    step of a stage (the first stage's inner-step time of a round over H x S: with one
    micro-batch a replica's chain runs one stage at a time), the rest of a round (the outer
    round), and the fixed part of a run (start-up, the first round's wait, the launcher's
    evaluations: the run's wall less its rounds); and the kill runs' back-after seconds (a
    death to its stage's rejoin)."""
    if not bases:
        return None
    steps, syncs, fixed = [], [], []
    for b in bases:
        real = b["real"]
        walls, inner = real["round_walls"], real["inner_s"]
        rounds = [y - x for x, y in zip(walls, walls[1:], strict=False)]
        step = statistics.median(inner[1:]) / (H * S)
        steps.append(step)
        syncs.append(statistics.median(r - i for r, i in zip(rounds, inner[1:], strict=False)))
        fixed.append(real["wall_s"] - sum(rounds) - statistics.median(rounds))
    back = [r["rejoin_s"] for k in kills for r in k["real"].get("recoveries", [])
            if r.get("rejoin_s") is not None]
    return {"step_s": statistics.median(steps), "sync_compute_s": statistics.median(syncs),
            "startup_s": statistics.median(fixed), "back_after_s": _median(back) or 0.0}


def _deployment(spec: RealSpec, cal: Mapping[str, float]) -> Any:
    from crucible.pricing.deployment import load_deployment

    template = load_deployment(spec.deployment)
    return dataclasses.replace(
        template, step_s=(cal["step_s"],), flops_per_s=None, eval_fraction=0.0,
        sync_compute_s=cal["sync_compute_s"], startup_s=cal["startup_s"],
        restart_s=cal["back_after_s"], rejoin_s=0.0)


def _deaths(result: Result) -> list[dict[str, Any]]:
    """The run's deaths as the cost model takes them (`pipeline.deaths`): the round each died
    in and how far into it, by the first stage's round clock (the end of the round before,
    and the median round)."""
    walls = result["real"]["round_walls"]
    rounds = [y - x for x, y in zip(walls, walls[1:], strict=False)]
    typical = statistics.median(rounds) if rounds else 0.0
    killed = [k for k in result.get("kills", []) if k["outcome"] == "killed"]
    out = []
    for kill, rec in zip(killed, result["real"].get("recoveries", []), strict=False):
        d = rec.get("died_in")
        if d is None:
            continue
        began = walls[d - 1] if 0 < d <= len(walls) else None
        fraction = 0.5 if began is None or typical <= 0 else \
            min(1.0, max(0.0, (float(kill["wall"]) - began) / typical))
        out.append({"replica": rec["replica"], "stage": rec["stage"], "global_step": d,
                    "fraction": fraction})
    return out


def _priced(result: Result, deployment: Any, *, learned: bool) -> float:
    from crucible.pricing.cost import run_cost

    part = result["replay"] if "replay" in result else result["sim"]
    summary = {**part, "config": result["config"]}
    if learned and "replay" in result:
        summary["pipeline"] = {"deaths": _deaths(result)}
    return float(run_cost(summary, deployment)["wall_s"])


# -- the rows -----------------------------------------------------------------------------------
def real_rows(spec: RealSpec, results: Mapping[str, Result]) -> list[dict[str, Any]]:
    """One row per arm and strategy: the paired statistics of the document's tables."""
    rows = []
    for arm in spec.arms:
        bases = {s: results[cell_id(arm, "base", s)] for s in spec.seeds
                 if cell_id(arm, "base", s) in results}
        for strategy in spec.strategies:
            kills = {s: results[cell_id(arm, strategy, s)] for s in spec.seeds
                     if cell_id(arm, strategy, s) in results and s in bases}
            base_loss = {s: float(bases[s]["sim"]["final_val_loss"]) for s in kills}
            real = {s: relative_degradation(float(k["real"]["final_val_loss"]), base_loss[s])
                    for s, k in kills.items()}
            replay = {s: relative_degradation(float(k["replay"]["final_val_loss"]),
                                              base_loss[s]) for s, k in kills.items()}
            slow = {s: float(k["real"]["wall_s"]) / float(bases[s]["real"]["wall_s"])
                    for s, k in kills.items()}
            kept = {s: (float(k["real"]["tokens"]) / float(k["real"]["wall_s"]))
                    / (float(bases[s]["real"]["tokens"]) / float(bases[s]["real"]["wall_s"]))
                    for s, k in kills.items()}
            recov = [r for k in kills.values() for r in k["real"].get("recoveries", [])]
            pred, pred_learned, pred_base = {}, {}, {}
            for s, k in kills.items():
                config = k["config"]
                H, S = config["sparseloco"]["inner_steps"], config["pipeline"]["stages"]
                cal = _calibration(
                    [b for t, b in bases.items() if t != s],
                    [x for t, x in kills.items() if t != s], H, S)
                if cal is None:
                    continue
                deployment = _deployment(spec, cal)
                measured = float(k["real"]["wall_s"])
                pred[s] = _priced(k, deployment, learned=False) / measured
                pred_learned[s] = _priced(k, deployment, learned=True) / measured
                pred_base[s] = _priced(bases[s], deployment, learned=False) / \
                    float(bases[s]["real"]["wall_s"])
            rows.append({
                "arm": arm, "strategy": strategy, "seeds": sorted(kills),
                "kills": [sum(1 for x in k["kills"] if x["outcome"] == "killed")
                          for k in kills.values()],
                "attempted": [len(k["kills"]) for k in kills.values()],
                "real": stat_of(real), "replay": stat_of(replay),
                "diff": paired_stat(real, replay), "slowdown": stat_of(slow),
                "tokens_kept": stat_of(kept),
                "notice_s": [r["notice_s"] for r in recov if r.get("notice_s") is not None],
                "restart_s": [r["restart_s"] for r in recov if r.get("restart_s") is not None],
                "rejoin_s": [r["rejoin_s"] for r in recov if r.get("rejoin_s") is not None],
                "retried": [k["real"]["retried_steps"] for k in kills.values()],
                "dropped": [k["real"]["dropped_steps"] for k in kills.values()],
                "model_base": stat_of(pred_base), "model_planned": stat_of(pred),
                "model_learned": stat_of(pred_learned)})
    return rows


# -- the document -------------------------------------------------------------------------------
def _provenance(results: Mapping[str, Result]) -> list[str]:
    kinds: dict[tuple[str, str, str], list[str]] = {}
    for cell, r in sorted(results.items()):
        st = r["study"]
        cpu = st.get("cpu") or {}
        key = (str(st.get("commit", "?"))[:7],
               f"{cpu.get('name', '?')} (family {cpu.get('family')}, model {cpu.get('model')})",
               str(st.get("arithmetic")))
        kinds.setdefault(key, []).append(cell)
    lines = []
    for (commit, cpu, digest), cells in sorted(kinds.items()):
        loads = [float(results[c]["study"]["load_average"]) for c in cells
                 if results[c]["study"].get("load_average") is not None]
        load = f"; host load average {_range(loads)} at the cells' ends" if loads else ""
        lines.append(f"- {len(cells)} cells at commit `{commit}` on {cpu}, arithmetic "
                     f"`{digest}`, one torch thread per process{load}")
    return lines


def _sentences(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for row in rows:
        d: Stat = row["diff"]
        if d.mean is None:
            continue
        name = f"{row['arm']} / {row['strategy']}"
        reads = _reads(d)
        out.append(f"- **{name}**: {reads}: real {_pct(row['real'])} against the replay's "
                   f"{_pct(row['replay'])} ({d.n} seeds, {sum(row['kills'])} real deaths).")
    return out


def _wall_sentences(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for row in rows:
        slow, planned, learned = row["slowdown"], row["model_planned"], row["model_learned"]
        if slow.mean is None:
            continue
        text = (f"- **{row['arm']} / {row['strategy']}**: the runs with real deaths took "
                f"{slow.mean:.2f}x the wall-clock of the same seed's run without kills")
        if planned.mean is not None and learned.mean is not None:
            gap = "under" if learned.mean < 1 else "over"
            text += (f"; priced as planned failures the model predicts {planned.mean:.2f} of "
                     f"the measured wall-clock, with the restart waits {learned.mean:.2f} "
                     f"({gap}-predicting by {abs(1 - learned.mean) * 100:.0f}%)")
        out.append(text + ".")
    return out


def _in_short(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The document's answer in two sentences, from the rows."""
    decided = [r for r in rows if r["diff"].half is not None]
    if not decided:
        return ["In short: too few seeds for an interval yet."]
    counts: dict[str, list[str]] = {}
    for r in decided:
        counts.setdefault(_reads(r["diff"]).split(" (")[0], []).append(
            f"{r['arm']} / {r['strategy']}")
    widest = max(r["diff"].half for r in decided)
    loss = "; ".join(f"{word}: {', '.join(names)}" for word, names in sorted(counts.items()))
    text = [f"In short. Loss: real deaths against the simulator's replay of the same schedule, "
            f"paired by seed at 95% ({loss}; the widest interval ±{widest:.2f} points)."]
    planned = [r["model_planned"].mean for r in rows if r["model_planned"].mean is not None]
    learned = [r["model_learned"].mean for r in rows if r["model_learned"].mean is not None]
    slow = [r["slowdown"].mean for r in rows if r["slowdown"].mean is not None]
    if planned and learned and slow:
        text.append(
            f"Wall-clock: real deaths made the runs {min(slow):.2f}-{max(slow):.2f}x as long as "
            f"the same seeds' runs without kills; the cost model pricing them as planned "
            f"failures (the simulator's view) predicts {min(planned):.2f}-{max(planned):.2f} of "
            f"the measured wall-clock, and with the restart each death makes the next round "
            f"wait for, {min(learned):.2f}-{max(learned):.2f} (means over seeds per arm and "
            "strategy; intervals below).")
    return [" ".join(text)]


def render_real(spec: RealSpec) -> str:
    """The document's text (deterministic: the same results give the same bytes)."""
    results = load_real_results(spec)
    rows = real_rows(spec, results)
    first = next(iter(results.values()), None)
    config = first["config"] if first else spec.config(spec.arms[0], "base", spec.seeds[0]).to_dict()
    H, S, R = (config["sparseloco"]["inner_steps"], config["pipeline"]["stages"],
               config["replicas"])
    steps = config["train"]["global_steps"]
    expected = len(all_cells(spec))
    bases = [r for c, r in results.items() if r["study"]["strategy"] == "base"]
    same = sum(1 for r in bases if r.get("same_bits"))
    lines = [
        f"# {spec.title}", "",
        f"Generated by `crucible study render {spec.path.parent.name}/{spec.path.name}` from "
        f"the {len(results)} result files in `results/{spec.results_dir.name}/` "
        f"({expected} planned); do not edit by hand.", "",
        f"What ran: the `{spec.preset}` preset with {R} replicas x {S} stages, every stage its "
        f"own process (`crucible launch --pipeline`: {R * S} processes, ZeroMQ links on "
        f"loopback), {steps} global steps of H = {H} inner steps; arms "
        f"{', '.join(spec.arms)}; strategies {', '.join(spec.strategies)}; seeds "
        f"{', '.join(str(s) for s in spec.seeds)}. In every global step after the first, each "
        f"inner stage-replica is killed (`kill -9` from outside, at a seeded moment inside the "
        f"round) with probability {spec.rate:g}; the killed process restarts and rejoins at the "
        "next round with the current global weights and fresh state. A kill that would hit a "
        "stage already down, or a second stage of a replica with one down, is not made (the "
        "simulator's plans fail one stage of a replica at a time). The simulator then runs the "
        "same config with the failure schedule the kills made (each death from the round it "
        "happened in to the round its next life rejoined): the replay.",
        "", *_provenance(results), "", *_in_short(rows), ""]
    if spec.notes:
        lines += [spec.notes, ""]
    lines += [
        "## The baselines", "",
        f"Per arm and seed, the pipeline run without kills and the simulator's run of the same "
        f"config: {same} of {len(bases)} pairs end on the same bits (final validation loss "
        "equal as floats). Every degradation below is against the simulator's baseline of its "
        "seed.", "",
        "## Real deaths against the simulator's replay", "",
        "Degradation: the final validation loss over the same seed's baseline, in percent, mean "
        "over seeds with a 95% t-interval; real minus replay: paired by seed, in points.", ""]
    lines += _table(
        ["arm", "strategy", "seeds", "real deaths per run", "real", "replay (same schedule)",
         "real - replay (points)", "interval", "reads"],
        [[r["arm"], r["strategy"], str(len(r["seeds"])),
          f"{_num(statistics.mean(r['kills']) if r['kills'] else None, '.1f')} "
          f"({min(r['kills'], default='-')}-{max(r['kills'], default='-')})",
          _pct(r["real"]), _pct(r["replay"]), _num(r["diff"].mean, "+.2f"), _ci(r["diff"]),
          _reads(r["diff"])] for r in rows])
    lines += ["", *_sentences(rows), "",
              "## Recovery", "",
              "Seconds after the signal, over every real death of the cell's runs (median, "
              "range): the launcher's notice to the other stages, the new process started, "
              "and rejoined. Retried: inner steps run again with the dead stage bypassed (the "
              "micro-batch in flight); dropped: inner steps the replica dropped.", ""]
    lines += _table(
        ["arm", "strategy", "deaths", "notice s", "restart s", "rejoin s", "retried per run",
         "dropped per run"],
        [[r["arm"], r["strategy"], str(len(r["rejoin_s"])),
          f"{_num(_median(r['notice_s']))} ({_range(r['notice_s'])})",
          f"{_num(_median(r['restart_s']))} ({_range(r['restart_s'])})",
          f"{_num(_median(r['rejoin_s']))} ({_range(r['rejoin_s'])})",
          _num(statistics.mean(r["retried"]) if r["retried"] else None, ".1f"),
          _num(statistics.mean(r["dropped"]) if r["dropped"] else None, ".1f")]
         for r in rows])
    lines += ["", "## Wall-clock and the cost model", "",
              "Slowdown: the run's wall-clock over the same seed's run without kills; tokens/s "
              "kept: the run's trained tokens per second of wall-clock over that run's. The cost "
              "model (`crucible.pricing.cost`) prices each run on this machine calibrated from "
              "the runs without kills of the other seeds of its arm (seconds per inner step of "
              "a stage, the outer round, the fixed part of a run) and the other seeds' restart "
              "times: predicted over measured wall-clock. `planned` prices the failure schedule "
              "as the simulator's planned failures (no wait: a planned failure is known in "
              "advance); `learned` adds what real deaths taught it: the next round waits for "
              "the restarted stage (`pipeline.deaths`).", ""]
    lines += _table(
        ["arm", "strategy", "slowdown", "tokens/s kept", "model / measured, no kills",
         "model / measured, planned", "model / measured, learned"],
        [[r["arm"], r["strategy"], _pct(r["slowdown"], unit="x").replace("+", ""),
          _pct(r["tokens_kept"], unit="").replace("+", ""),
          _pct(r["model_base"], unit="").replace("+", ""),
          _pct(r["model_planned"], unit="").replace("+", ""),
          _pct(r["model_learned"], unit="").replace("+", "")] for r in rows])
    lines += ["", *_wall_sentences(rows), "", "## Every run", ""]
    lines += _table(
        ["cell", "deaths (attempted)", "schedule (replica, stage, round, rounds down)",
         "real loss", "replay loss", "baseline", "wall s", "baseline wall s"],
        _run_rows(spec, results))
    return "\n".join(lines) + "\n"


def _run_rows(spec: RealSpec, results: Mapping[str, Result]) -> list[list[str]]:
    rows = []
    for arm, strategy, seed in all_cells(spec):
        k = results.get(cell_id(arm, strategy, seed))
        b = results.get(cell_id(arm, "base", seed))
        if k is None or b is None or strategy == "base":
            continue
        plan = "; ".join(f"({f['replica']}, {f['stage']}, {f['start']}, {f['duration']})"
                         for f in k["plan"]) or "-"
        rows.append([cell_id(arm, strategy, seed),
                     f"{sum(1 for x in k['kills'] if x['outcome'] == 'killed')} "
                     f"({len(k['kills'])})", plan,
                     f"{k['real']['final_val_loss']:.4f}", f"{k['replay']['final_val_loss']:.4f}",
                     f"{b['sim']['final_val_loss']:.4f}", f"{k['real']['wall_s']:.1f}",
                     f"{b['real']['wall_s']:.1f}"])
    return rows
