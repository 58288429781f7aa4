"""Seed blocks: every cell of one seed is made with one arithmetic; seeds may come from any.

A study's estimate is a mean over seeds of differences paired within a seed (a failure cell
against its arm's same-seed baseline, one arm against another at one seed). Training is
chaotic, so two machines whose kernels round differently turn one seed into two different
runs; a pair is only a pair when both of its runs were made with one arithmetic. Different
seeds need not share it: seeds are exchangeable draws, and the machine a seed's block ran on is
one more source of seed-to-seed variation, which the interval over seeds already measures. A
paired difference is unchanged in expectation and costs nothing within a pair; the spread
between seeds of different machines can only be as wide as the spread between seeds, which the
interval reports.

So a study's results fall into seed blocks. A block's arithmetic is the digest its results
record (`crucible.arithmetic`, `study.arithmetic`), or, for results made before the probe
existed, the digest of a machine that re-ran one of the block's committed cells to the bit
(a proof, `PROOFS_DIR/<cell>--<digest>.json`, written by `crucible study prove`; a failed
re-run is kept too, as evidence that the two differ). `crucible study run` adds a cell to a
block only when this machine's digest is the block's.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible.arithmetic import digest_of
from crucible.grid.cells import Cell
from crucible.grid.spec import SweepSpec
from crucible.study.spec import StudyError, result_cells

PROOFS_DIR = "arithmetic-proofs"
MAX_PROOF_BYTES = 20_000
_DIGEST = re.compile(r"^sha256:[0-9a-f]{16}$")
PROOF_KEYS = ("cell", "seed", "arithmetic", "matches", "committed_final_val_loss",
              "rerun_final_val_loss", "machine", "commit")


@dataclass
class Block:
    """One seed's results: the digests they record, the cells that record none, and the
    proofs made for it."""

    seed: int
    cells: list[str] = field(default_factory=list)
    digests: dict[str, list[str]] = field(default_factory=dict)    # digest -> its cells
    undigested: list[str] = field(default_factory=list)
    proven: dict[str, str] = field(default_factory=dict)            # digest -> proving cell
    disproven: dict[str, str] = field(default_factory=dict)         # digest -> cell that differed

    def accepts(self, digest: str) -> bool:
        """True when a cell made with `digest` pairs with this block's cells."""
        if not self.cells:
            return True
        if set(self.digests) - {digest}:
            return False
        return not self.undigested or digest in self.proven

    def describe(self) -> str:
        parts = [f"{len(c)} cell{'s' if len(c) != 1 else ''} of arithmetic {d}"
                 for d, c in sorted(self.digests.items())]
        if self.undigested:
            proven = f", proven {', '.join(sorted(self.proven))}" if self.proven else ""
            n = len(self.undigested)
            parts.append(f"{n} cell{'s' if n != 1 else ''} without a digest (made before the "
                         f"probe, or on a GPU){proven}")
        return "; ".join(parts) or "empty"


def proofs_dir(spec: SweepSpec) -> Path:
    return spec.results_dir / PROOFS_DIR


def read_proof(path: Path) -> dict[str, Any]:
    """A proof file, checked (StudyError naming the file and the fault)."""
    try:
        if path.stat().st_size > MAX_PROOF_BYTES:
            raise StudyError(f"{path}: over {MAX_PROOF_BYTES} bytes, not a proof; delete it")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StudyError(f"{path}: not readable JSON ({exc}); delete it and run "
                         "`crucible study prove` again") from None
    if not isinstance(data, dict) or any(k not in data for k in PROOF_KEYS):
        raise StudyError(f"{path}: a proof needs the keys {', '.join(PROOF_KEYS)}; delete it "
                         "and run `crucible study prove` again")
    if not isinstance(data["arithmetic"], str) or not _DIGEST.match(data["arithmetic"]) \
            or not isinstance(data["matches"], bool) or not isinstance(data["seed"], int):
        raise StudyError(f"{path}: `arithmetic` must be a digest like sha256:0123456789abcdef, "
                         "`matches` a boolean and `seed` an integer; delete it and prove again")
    for key in ("committed_final_val_loss", "rerun_final_val_loss"):
        value = data[key]
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise StudyError(f"{path}: {key} is {value!r}, not a finite number")
    if data["matches"] != (data["committed_final_val_loss"] == data["rerun_final_val_loss"]):
        raise StudyError(f"{path}: `matches` disagrees with the two losses it records; delete "
                         "it and prove again")
    expected = f"{data['cell']}--{data['arithmetic'].removeprefix('sha256:')}.json"
    if path.name != expected:
        raise StudyError(f"{path}: a proof of {data['cell']} with arithmetic "
                         f"{data['arithmetic']} is named {expected}; rename or delete it")
    data["_path"] = str(path)
    return data


def load_proofs(spec: SweepSpec) -> list[dict[str, Any]]:
    folder = proofs_dir(spec)
    if not folder.is_dir():
        return []
    return [read_proof(path) for path in sorted(folder.glob("*.json"))]


def seed_blocks(spec: SweepSpec, results: Mapping[str, Mapping[str, Any]],
                proofs: Iterable[Mapping[str, Any]] = ()) -> dict[int, Block]:
    """The results' seed blocks, by seed ({cell id: result} as `load_results` reads them)."""
    seeds = {cell.id: cell.seed for cell in result_cells(spec)}
    blocks: dict[int, Block] = {}
    for cell_id, result in results.items():
        seed = seeds.get(cell_id, result.get("seed"))
        block = blocks.setdefault(int(seed), Block(int(seed)))
        block.cells.append(cell_id)
        digest = digest_of(dict(result))
        if digest is None:
            block.undigested.append(cell_id)
        else:
            block.digests.setdefault(digest, []).append(cell_id)
    for proof in proofs:
        _check_proof_against(proof, results, seeds)
        block = blocks.setdefault(int(proof["seed"]), Block(int(proof["seed"])))
        (block.proven if proof["matches"] else block.disproven)[proof["arithmetic"]] = \
            proof["cell"]
    return blocks


def _check_proof_against(proof: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]],
                         seeds: Mapping[str, int]) -> None:
    """A proof speaks for its seed's block only when it re-ran one of that block's results:
    its cell has a result, of its seed, ending at the loss the proof says was committed."""
    where = proof.get("_path", f"the proof of {proof['cell']}")
    cell = proof["cell"]
    result = results.get(cell)
    if result is None:
        raise StudyError(f"{where}: cell {cell!r} has no result; a proof re-runs a committed "
                         "cell: delete the file and run `crucible study prove` again")
    if seeds.get(cell, result.get("seed")) != proof["seed"]:
        raise StudyError(f"{where}: says seed {proof['seed']} but cell {cell} is of seed "
                         f"{seeds.get(cell, result.get('seed'))}; delete the file and prove again")
    if result.get("final_val_loss") != proof["committed_final_val_loss"]:
        raise StudyError(f"{where}: its committed_final_val_loss "
                         f"{proof['committed_final_val_loss']!r} is not {cell}'s "
                         f"{result.get('final_val_loss')!r}; the result changed since: delete the "
                         "file and prove again")


def refusal(spec: SweepSpec, cell: Cell, block: Block, here: str) -> str:
    """The message that refuses `cell` on this machine (digest `here`)."""
    if block.undigested and not (set(block.digests) - {here}):
        fix = (f"prove this machine computes the block's arithmetic: `crucible study prove "
               f"{spec.shown(spec.path)} --cell "
               f"{sorted(block.undigested)[0]}` re-runs that committed cell and records the "
               "proof if it ends on the same bits")
        if here in block.disproven:
            fix = (f"this machine's arithmetic was already shown to differ (re-running "
                   f"{block.disproven[here]} did not end on its bits): run this seed on a "
                   "machine of the block's kind")
    else:
        fix = "run this seed on a machine whose arithmetic digest is the block's"
    return (f"seed {cell.seed}'s block ({cell.id} would join it) holds {block.describe()}; "
            f"this machine computes arithmetic {here}. A cell pairs only with "
            f"same-seed cells of one arithmetic. Fix: {fix}, or run new seeds here "
            "(`--seeds` with seeds that have no results yet)")


def runnable(spec: SweepSpec, cells: list[Cell], blocks: Mapping[int, Block], here: str
             ) -> tuple[list[Cell], dict[int, str]]:
    """(the cells this machine may add, {seed: refusal} for the seeds it may not)."""
    ok: list[Cell] = []
    refused: dict[int, str] = {}
    for cell in cells:
        block = blocks.get(cell.seed)
        if block is None or block.accepts(here):
            ok.append(cell)
        elif cell.seed not in refused:
            refused[cell.seed] = refusal(spec, cell, block, here)
    return ok, refused


def rerun(result: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """Train a committed result's `config` again in this process (one torch thread, as the
    study's cells run) in `folder` (removed afterwards); returns the re-run's summary, its
    corpus digest as `data_digest` and this process's arithmetic."""
    import shutil

    import torch

    from crucible.arithmetic import arithmetic
    from crucible.config import Config
    from crucible.data import token_digest
    from crucible.events import JsonlCallback
    from crucible.store import LocalStore
    from crucible.train import Trainer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(Config.from_dict(dict(result["config"])),
                          store=LocalStore(folder / "store"), run_key="rerun",
                          callback=JsonlCallback(folder))
        summary = trainer.run()
        trainer.callback.close()
        summary["data_digest"] = token_digest(trainer.data.train.numpy(), trainer.data.val.numpy())
        summary["arithmetic"] = arithmetic()
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(folder, ignore_errors=True)
    return summary


def prove(spec: SweepSpec, cell_id: str, *, work_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Re-run the committed result `cell_id` of `spec` here and record whether it ended on the
    same bits (`PROOFS_DIR/<cell>--<digest>.json`, written whole or not at all): proof that
    this machine's arithmetic is the block's, or evidence that it is not. Raises StudyError for
    a cell without a result, one already carrying a digest (its block's arithmetic is known), or
    a corpus that is not the cell's (its re-run would prove nothing)."""
    import uuid

    from crucible.study.runner import load_results, machine_description
    from crucible.summary import git_sha, write_json_atomic

    results = load_results(spec)
    if cell_id not in results:
        raise StudyError(f"--cell {cell_id!r}: {spec.shown(spec.results_dir)} has no such result;"
                         " choose a committed cell of the block, e.g. "
                         f"{sorted(results)[0] if results else 'none-base-s0'}")
    result = results[cell_id]
    if digest_of(dict(result)) is not None:
        raise StudyError(f"--cell {cell_id}: its result records its arithmetic "
                         f"({digest_of(dict(result))}); only blocks made before the probe need a "
                         "proof")
    seed = int(result["config"]["seed"])
    summary = rerun(result, work_dir / f"prove-{cell_id}-{uuid.uuid4().hex[:8]}")
    if result.get("data_digest") and summary["data_digest"] != result["data_digest"]:
        raise StudyError(f"--cell {cell_id}: this machine's corpus ({summary['data_digest']}) "
                         f"is not the one the cell was trained on ({result['data_digest']}); "
                         "`crucible corpus fetch` installs the default corpus")
    digest = str(summary["arithmetic"]["digest"])
    proof = {"cell": cell_id, "seed": seed, "arithmetic": digest,
             "matches": summary["final_val_loss"] == result["final_val_loss"],
             "committed_final_val_loss": result["final_val_loss"],
             "rerun_final_val_loss": summary["final_val_loss"],
             "committed_machine": (result.get("study") or {}).get("machine"),
             "machine": machine_description(), "commit": git_sha(),
             "wall_s": summary.get("wall_s"), "probe": summary["arithmetic"]}
    path = proofs_dir(spec) / f"{cell_id}--{digest.removeprefix('sha256:')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, proof)
    return path, proof


SOUNDNESS = (
    "Why seeds may come from different machines: the study's estimates are means over seeds of "
    "differences paired within a seed, and every cell of one seed (all arms' baselines and "
    "failure cells) is made with one arithmetic, so each pair is a pair of twins. Seeds are "
    "exchangeable draws; the machine that made a seed's block is one more source of "
    "seed-to-seed variation, which the interval over seeds already measures. Within a pair it "
    "costs nothing; between seeds it widens the spread the interval reports. That it does not "
    "bias a paired difference is an assumption (a machine's rounding shifts a trajectory as "
    "another seed would), to be checked once blocks of two kinds hold enough seeds each. The "
    "arithmetic is identified by what it computes "
    "(`python -m crucible.arithmetic`: a digest of a fixed probe through the simulator's "
    "kernels), not by the CPU's name.")


def blocks_section(spec: SweepSpec, results: Mapping[str, Mapping[str, Any]],
                   proofs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The document's "Seeds, machines and arithmetic" section: per seed, its cells, the
    arithmetic they record (or the proofs made for a block made before the probe) and the
    machines named in the results."""
    proofs = list(proofs)
    blocks = seed_blocks(spec, results, proofs)
    if not blocks:
        return []
    seeds = {cell.id: cell.seed for cell in result_cells(spec)}
    machines: dict[int, set[str]] = {}
    for cell_id, result in results.items():
        # "x86_64, 2 CPUs, Intel(R) Xeon(R) Processor": the CPU's name, where it gives one
        parts = str((result.get("study") or {}).get("machine") or "").split(", ")
        model = (", ".join(parts[2:]) if len(parts) >= 3 and parts[1].endswith("CPUs")
                 else "not named")
        machines.setdefault(seeds.get(cell_id, -1), set()).add(model)
    rows = []
    for seed in sorted(blocks):
        block = blocks[seed]
        if block.digests:
            arithmetic = ", ".join(f"`{d}`" for d in sorted(block.digests))
        else:
            arithmetic = "no digest (made before the probe, or on a GPU)"
        if block.undigested:
            shown = [f"proven `{d}` ({c})" for d, c in sorted(block.proven.items())]
            shown += [f"not `{d}` ({c})" for d, c in sorted(block.disproven.items())]
            arithmetic += ("; " + "; ".join(shown)) if shown else "; no proof yet"
        rows.append([str(seed), str(len(block.cells)), arithmetic,
                     ", ".join(sorted(machines.get(seed, set()))) or "-"])
    mixed = [seed for seed, block in sorted(blocks.items()) if len(block.digests) > 1]
    out = ["## Seeds, machines and arithmetic", "", SOUNDNESS, "",
           "Per seed: its result files, the arithmetic digest they record (results made before "
           "the probe record none; a re-run of one of them that ended on the same bits proves a "
           "machine's digest for the block, one that did not shows it differs: `crucible study "
           "prove`), and the CPU the results name.", ""]
    from crucible.study.formatting import _table

    out += _table(["seed", "cells", "arithmetic", "machine"], rows)
    out.append("")
    if mixed:
        out += [f"Warning: seed{'s' if len(mixed) > 1 else ''} "
                f"{', '.join(str(s) for s in mixed)} mix{'es' if len(mixed) == 1 else ''} "
                "arithmetics: their pairs are not twins.", ""]
    return out

