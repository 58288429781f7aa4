"""Re-run committed study cells from the configs their result files hold, and compare.

For each result file (`results/<spec>/<cell>.json`), trains its `config` again in this process
with one torch thread (as the study runs cells) and prints one JSON line: the committed final
validation loss, the re-run's, whether they are the same float, whether the corpus is the one
the cell was trained on (its digest), and the machine each ran on. A cell re-runs
to the bit only on the CPU model it was made on (docs/ALGORITHMS.md, "Reproducibility across
CPUs"); between two commits on one machine, equal re-runs show the arithmetic did not change.

    python -m benchmarks.rerun_cell results/processes/none-skip-p0.1-s0.json [...] [--out runs/rerun]
"""
from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path

import torch

from crucible.study.blocks import rerun as rerun_result
from crucible.study.runner import machine_description


def rerun(path: Path, out: Path) -> dict[str, object]:
    committed = json.loads(path.read_text())
    summary = rerun_result(committed, out / f"{path.stem}-{uuid.uuid4().hex[:8]}")
    return {"cell": str(path), "committed": committed["final_val_loss"],
            "rerun": summary["final_val_loss"],
            "equal": committed["final_val_loss"] == summary["final_val_loss"],
            "same_data": committed.get("data_digest") == summary["data_digest"],
            "made_on": (committed.get("study") or {}).get("machine"),
            "machine": machine_description()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("runs/rerun"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.results:
        print(json.dumps(rerun(path, args.out)), flush=True)


if __name__ == "__main__":
    main()
