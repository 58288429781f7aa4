"""Seeds on any machine (issue 34): the arithmetic probe tells machines apart by what they
compute, every run records it, and a study keeps each seed's block within one arithmetic:
`crucible study run` refuses (exit 2) a cell of a block made with another, leaves such seeds
out when none is named, and accepts a block made before the probe once a re-run proved it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.study import here_arithmetic
from crucible import arithmetic, study
from crucible.study.blocks import PROOFS_DIR, load_proofs, runnable, seed_blocks
from tests.unit.test_study import cli_app, fill, write_spec

SMALL = """
name = "t"
preset = "smoke"
seeds = [0, 1]

[[grid]]
arms = ["none"]
strategies = ["skip"]
p = [0, 0.2]
seeds = [0, 1, 2]
"""
OTHER = "sha256:0123456789abcdef"


def _probe_in_a_process(env: dict[str, str] | None = None) -> dict:
    import os

    out = subprocess.run([sys.executable, "-m", "crucible.arithmetic"], capture_output=True,
                         text=True, check=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout)


def test_the_probe_is_the_same_in_two_processes_and_names_its_threads() -> None:
    first, second = _probe_in_a_process(), _probe_in_a_process()
    assert first["digest"] == second["digest"]
    assert first["digest"].startswith("sha256:") and len(first["digest"]) == 23
    assert first["threads"] == 1 and first["probe"] == arithmetic.PROBE_VERSION


def test_another_kernel_path_is_another_arithmetic() -> None:
    """Torch's generic kernels round differently from its vectorised ones: the probe sees it
    (the same machine, another arithmetic), and the variable is recorded beside the digest."""
    native = _probe_in_a_process()
    generic = _probe_in_a_process({"ATEN_CPU_CAPABILITY": "default"})
    assert generic["digest"] != native["digest"]
    assert generic["env"] == {"ATEN_CPU_CAPABILITY": "default"}


def test_two_threads_are_another_arithmetic() -> None:
    one = _probe_in_a_process()
    two = _probe_in_a_process({"CRUCIBLE_TORCH_THREADS": "2"})
    assert two["threads"] == 2 and two["digest"] != one["digest"]


def test_a_run_on_another_device_is_not_identified_by_the_cpu_probe() -> None:
    meta = arithmetic.arithmetic("meta")
    assert meta["digest"] is None and "not identified" in meta["unidentified"]
    assert arithmetic.digest_of({"arithmetic": meta}) is None       # its blocks need a proof
    assert arithmetic.arithmetic("cpu")["digest"] == arithmetic.arithmetic()["digest"]


def test_digest_of_reads_a_study_result_and_a_run_summary() -> None:
    assert arithmetic.digest_of({"study": {"arithmetic": OTHER}}) == OTHER
    assert arithmetic.digest_of({"arithmetic": {"digest": OTHER}}) == OTHER
    assert arithmetic.digest_of({"study": {"machine": "x86_64"}}) is None


def _mark(spec, cell_id: str, digest: str | None) -> None:
    path = spec.results_dir / f"{cell_id}.json"
    data = json.loads(path.read_text())
    if digest is not None:
        data["study"]["arithmetic"] = digest
    path.write_text(json.dumps(data))


def _run(spec_path: Path, *args: str):
    return CliRunner().invoke(cli_app(), ["study", "run", str(spec_path), "--dry-run", *args])


def test_study_run_refuses_a_cell_of_a_block_of_another_arithmetic(tmp_path: Path) -> None:
    path = write_spec(tmp_path, SMALL)
    spec = study.load_spec(path)
    fill(spec, {"none-skip-p0.2": [1.0]}, seeds=(0, 1))      # seed 0 whole, seed 1 baseline only
    for cell_id in ("none-base-s0", "none-skip-p0.2-s0", "none-base-s1"):
        _mark(spec, cell_id, OTHER)
    here = here_arithmetic()
    refused = _run(path, "--seeds", "1")
    assert refused.exit_code == 2, refused.output
    message = refused.output
    assert "seed 1" in message and OTHER in message and here in message
    assert "run new seeds here" in message and "Traceback" not in message
    # no seed named: the foreign block is left out (said why), the new seed 2 runs
    result = _run(path)
    assert result.exit_code == 0, result.output
    assert "seed 1 left out" in result.output
    assert "none-skip-p0.2-s1" not in result.output.split("to run")[-1]
    assert "none-base-s2:" in result.output and "none-skip-p0.2-s2:" in result.output
    # a block made with this machine's arithmetic takes its missing cell
    for cell_id in ("none-base-s1",):
        _mark(spec, cell_id, here)
    assert _run(path, "--seeds", "1").exit_code == 0


def test_a_block_made_before_the_probe_needs_a_proof(tmp_path: Path) -> None:
    path = write_spec(tmp_path, SMALL)
    spec = study.load_spec(path)
    fill(spec, {"none-skip-p0.2": []}, seeds=(0, 1))          # baselines
    for path in spec.results_dir.glob("*.json"):               # made before the probe
        data = json.loads(path.read_text())
        del data["study"]["arithmetic"]
        path.write_text(json.dumps(data))
    here = "sha256:" + "a" * 16
    blocks = seed_blocks(spec, study.load_results(spec))
    cells = [c for c in spec.cells() if c.seed == 1 and not c.key.is_baseline]
    ok, refused = runnable(spec, cells, blocks, here)
    assert not ok and "crucible study prove" in refused[1] and "--cell none-base-s1" in refused[1]
    proof = {"cell": "none-base-s1", "seed": 1, "arithmetic": here, "matches": True,
             "committed_final_val_loss": 2.0, "rerun_final_val_loss": 2.0,
             "machine": "x86_64, 2 CPUs", "commit": "abc"}
    folder = spec.results_dir / PROOFS_DIR
    folder.mkdir()
    (folder / f"none-base-s1--{'a' * 16}.json").write_text(json.dumps(proof))
    blocks = seed_blocks(spec, study.load_results(spec), load_proofs(spec))
    assert runnable(spec, cells, blocks, here)[0] == cells
    assert not runnable(spec, cells, blocks, "sha256:" + "b" * 16)[0]     # proven for `here` only
    # a failed re-run is kept as evidence: the refusal says the kinds differ
    other = "sha256:" + "c" * 16
    (folder / f"none-base-s1--{'c' * 16}.json").write_text(json.dumps(
        {**proof, "arithmetic": other, "matches": False, "rerun_final_val_loss": 2.01}))
    blocks = seed_blocks(spec, study.load_results(spec), load_proofs(spec))
    assert "already shown to differ" in runnable(spec, cells, blocks, other)[1][1]


@pytest.mark.parametrize("change, needle", [
    ({"matches": True, "rerun_final_val_loss": 2.5}, "disagrees with the two losses"),
    ({"arithmetic": "AMD"}, "must be a digest"),
    ({"rerun_final_val_loss": None}, "not a finite number"),
    ({"seed": 1}, "says seed 1 but cell none-base-s0 is of seed 0"),
    ({"cell": "none-base-s9"}, "has no result"),
    ({"committed_final_val_loss": 2.5, "rerun_final_val_loss": 2.5}, "the result changed"),
    ({"_name": "other.json"}, "is named none-base-s0--0123456789abcdef.json"),
])
def test_a_bad_proof_is_refused_naming_the_file(tmp_path: Path, change: dict, needle: str
                                                ) -> None:
    path = write_spec(tmp_path, SMALL)
    spec = study.load_spec(path)
    fill(spec, {"none-skip-p0.2": [1.0]}, seeds=(0,))
    proof = {"cell": "none-base-s0", "seed": 0, "arithmetic": OTHER, "matches": True,
             "committed_final_val_loss": 2.0, "rerun_final_val_loss": 2.0,
             "machine": "x", "commit": "abc", **change}
    name = proof.pop("_name", None)
    if name is None:
        digest = proof["arithmetic"].removeprefix("sha256:")
        name = f"{proof['cell']}--{digest}.json"
    folder = spec.results_dir / PROOFS_DIR
    folder.mkdir()
    (folder / name).write_text(json.dumps(proof))
    result = _run(path, "--seeds", "0")
    assert result.exit_code == 2 and needle in result.output and name in result.output


def test_cells_option_selects_cells_by_pattern(tmp_path: Path) -> None:
    path = write_spec(tmp_path, SMALL)
    result = _run(path, "--cells", "none-skip-p*", "--seeds", "2")
    assert result.exit_code == 0, result.output
    listed = [line.split(":")[0].strip() for line in result.output.splitlines()
              if line.startswith("  ")]
    assert listed == ["none-skip-p0.2-s2"]
    nothing = _run(path, "--cells", "ssn-*")
    assert nothing.exit_code == 2 and "select none" in nothing.output


def test_prove_refuses_a_cell_without_a_result_or_with_a_digest(tmp_path: Path) -> None:
    path = write_spec(tmp_path, SMALL)
    spec = study.load_spec(path)
    fill(spec, {"none-skip-p0.2": [1.0]}, seeds=(0,))
    _mark(spec, "none-skip-p0.2-s0", OTHER)
    runner = CliRunner()
    missing = runner.invoke(cli_app(), ["study", "prove", str(path), "--cell", "none-base-s9"])
    assert missing.exit_code == 2 and "has no such result" in missing.output
    known = runner.invoke(cli_app(), ["study", "prove", str(path), "--cell", "none-skip-p0.2-s0"])
    assert known.exit_code == 2 and "records its arithmetic" in known.output


@pytest.mark.slow
def test_prove_re_runs_a_cell_to_the_bit_and_records_it(tmp_path: Path) -> None:
    """A smoke cell trained here, its result stripped of its digest (as results made before
    the probe are): `study prove` re-runs it to the same bits and writes the proof, which then
    lets `study run` add that seed's cells here."""
    from crucible.study.blocks import rerun

    path = write_spec(tmp_path, SMALL.replace('preset = "smoke"', 'preset = "smoke"\n'
                                              'global_steps = 2'))
    spec = study.load_spec(path)
    cell = next(c for c in spec.cells() if c.id == "none-base-s0")
    from crucible.config import apply_overrides
    from crucible.presets import get_preset

    config = apply_overrides(get_preset("smoke"), cell.overrides(spec)).to_dict()
    made = rerun({"config": config}, tmp_path / "made")
    result = {**made, "config": config, "study": {"machine": "x86_64, 2 CPUs"}}
    result.pop("arithmetic")
    spec.results_dir.mkdir(parents=True)
    (spec.results_dir / "none-base-s0.json").write_text(json.dumps(result))
    proved = CliRunner().invoke(cli_app(), ["study", "prove", str(path), "--cell",
                                            "none-base-s0", "--work-dir", str(tmp_path / "w")])
    assert proved.exit_code == 0, proved.output
    (proof,) = load_proofs(spec)
    assert proof["matches"] and proof["arithmetic"] == made["arithmetic"]["digest"]
    assert _run(path, "--seeds", "0").exit_code == 0


def test_an_identical_run_of_another_arithmetic_is_not_adopted_into_a_seed_run_here(
        tmp_path: Path) -> None:
    """`reuse`: a pilot's identical run joins a seed's block only with this machine's digest
    when cells of that seed still run here (otherwise it runs here too)."""
    from tests.unit.test_study_decided import PILOT

    source = study.load_spec(write_spec(tmp_path, PILOT, name="pilot-x.toml"))
    fill(source, {"none-skip-p0.2": [1.0, 2.0]}, seeds=(0, 1))     # ssn-skip not run there
    _mark(source, "none-base-s1", OTHER)
    _mark(source, "none-skip-p0.2-s1", OTHER)
    main = write_spec(tmp_path, PILOT.replace('name = "pilot-x"', 'name = "main"').replace(
        'title = "Pilot x"', 'title = "Main"\nreuse = ["pilot-x.toml"]'), name="main.toml")
    planned = _run(main, "--seeds", "0,1")
    assert planned.exit_code == 0, planned.output
    to_run = sorted(line.split(":")[0].strip() for line in planned.output.splitlines()
                    if line.startswith("  "))
    # seed 0's none cells are this machine's: adopted; seed 1's are another's: run here
    assert to_run == ["none-base-s1", "none-skip-p0.2-s1", "ssn-base-s0", "ssn-base-s1",
                      "ssn-skip-p0.2-s0", "ssn-skip-p0.2-s1"]
    assert "2 cells taken from identical runs of pilot-x" in planned.output
    mixed = _run(main, "--seeds", "0,1", "--allow-mixed-arithmetic")    # the rule off: all 4
    assert "4 cells taken from identical runs of pilot-x" in mixed.output
