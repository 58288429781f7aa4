"""The real-failure study of the pipeline mode (crucible.study.pipeline_real, pipeline_doc): its
spec's checks, the seed blocks of one arithmetic, the statistics its document states (from
hand-made results), and the committed document against the committed results."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crucible.study.pipeline_doc import real_rows, render_real
from crucible.study.pipeline_real import load_real_spec, refused_seeds
from crucible.study.spec import StudyError

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "studies" / "pipeline-real.toml"


def _spec_text(**changes: str) -> str:
    text = SPEC.read_text()
    for key, value in changes.items():
        lines = [line for line in text.splitlines() if not line.startswith(f"{key} =")]
        text = "\n".join(lines) + f"\n{key} = {value}\n"
    return text.replace('"../infra/', f'"{ROOT}/infra/')


def _write(tmp_path: Path, **changes: str) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(_spec_text(**changes))
    return path


@pytest.mark.parametrize("change, message", [
    ({"rate": "0.9"}, "`rate`"),
    ({"strategies": '["reroute"]'}, "`strategies`"),
    ({"arms": '["fast"]'}, "`arms`"),
    ({"seeds": "[1, 1]"}, "`seeds`"),
    ({"set": '["replicas=1", "train.global_steps=4"]'}, "replicas=2"),
    ({"colour": '"red"'}, "unknown field(s) colour"),
])
def test_a_bad_spec_names_the_field_and_the_fix(tmp_path: Path, change, message) -> None:
    with pytest.raises(StudyError) as err:
        load_real_spec(_write(tmp_path, **change))
    assert message in str(err.value)


def _crucible(*args: str):
    """`crucible ARGS` in this process; a traceback fails the test as it would reach the user."""
    from cli.main import _register_packages, app

    _register_packages()
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_the_cli_refuses_a_bad_spec_and_cells_with_exit_2(tmp_path: Path) -> None:
    bad = _write(tmp_path, rate="2")
    out = _crucible("study", "render", str(bad))
    assert out.exit_code == 2 and "`rate`" in out.output
    out = _crucible("study", "run", str(SPEC), "--cells", "none-*")
    assert out.exit_code == 2 and "--seeds" in out.output
    out = _crucible("study", "run", str(SPEC), "--seeds", "0,x")
    assert out.exit_code == 2 and "--seeds" in out.output


def _base(arm: str, seed: int, loss: float, wall: float) -> dict:
    spec = load_real_spec(SPEC)
    config = spec.config(arm, "base", seed)
    steps = config.train.global_steps
    walls = [100.0 + 1.0 * g for g in range(steps)]       # 1 s rounds
    sim = {"final_val_loss": loss, "global_steps": steps, "faults": [],
           "bytes": {"upload": 1000 * 8 * steps}, "contributions": {"made": 8 * steps},
           "evals": [{"global_step": steps, "val_loss": loss}], "eval_tokens": 8192,
           "initial_val_loss": None, "wall_s": 10.0}
    return {"study": {"cell": f"{arm}-base-s{seed}", "arm": arm, "strategy": "base",
                      "seed": seed, "arithmetic": "sha256:aaaa", "commit": "abc1234"},
            "config": config.to_dict(), "same_bits": True, "sim": sim,
            "real": {"final_val_loss": loss, "wall_s": wall, "round_walls": walls, "tokens": 8192,
                     "inner_s": [0.8] * steps, "recoveries": []}}


def _killed(arm: str, strategy: str, seed: int, real: float, replay: float, wall: float,
            base: dict) -> dict:
    out = json.loads(json.dumps(base))
    out["study"].update(cell=f"{arm}-{strategy}-s{seed}", strategy=strategy)
    out["config"]["faults"]["strategy"] = strategy
    out["kills"] = [{"replica": 0, "stage": 1, "global_step": 3, "fraction": 0.5,
                     "outcome": "killed", "wall": 102.5},
                    {"replica": 1, "stage": 2, "global_step": 9, "fraction": 0.1,
                     "outcome": "skipped", "why": "down or coming back"}]
    out["plan"] = [{"replica": 0, "stage": 1, "start": 3, "duration": 1}]
    out["real"].update(final_val_loss=real, wall_s=wall, retried_steps=1, dropped_steps=0,
                       recoveries=[{"replica": 0, "stage": 1, "died_in": 3, "notice_s": 0.1,
                                    "restart_s": 4.0, "rejoin_s": 4.5, "rejoined_at": 4}])
    out["replay"] = {**out.pop("sim"), "final_val_loss": replay,
                     "faults": out["plan"]}
    return out


def _study(tmp_path: Path, cells: list[dict]) -> object:
    spec = dataclasses.replace(load_real_spec(SPEC), results_dir=tmp_path / "results",
                               arms=("none",), strategies=("skip",), seeds=(0, 1, 2))
    spec.results_dir.mkdir()
    for cell in cells:
        (spec.results_dir / f"{cell['study']['cell']}.json").write_text(json.dumps(cell))
    return spec


def test_the_rows_pair_real_and_replay_by_seed(tmp_path: Path) -> None:
    cells = []
    for seed, (real, replay) in enumerate([(3.03, 3.00), (3.06, 3.00), (3.09, 3.03)]):
        base = _base("none", seed, 3.0, wall=20.0)
        cells += [base, _killed("none", "skip", seed, real, replay, 25.0, base)]
    spec = _study(tmp_path, cells)
    (row,) = real_rows(spec, {c["study"]["cell"]: c for c in cells})
    # real: +1, +2, +3 %; replay: 0, 0, +1 %; real - replay: +1, +2, +2 points
    assert row["real"].mean == pytest.approx(2.0)
    assert row["replay"].mean == pytest.approx(1.0 / 3.0)
    assert row["diff"].values == pytest.approx((1.0, 2.0, 2.0))
    assert row["diff"].lo > 0          # the interval is above 0: real deaths cost more
    assert row["slowdown"].mean == pytest.approx(1.25)
    assert row["tokens_kept"].mean == pytest.approx(0.8)     # the same tokens in 1.25x the time
    assert row["kills"] == [1, 1, 1] and row["attempted"] == [2, 2, 2]
    # each run priced with the other seeds' calibration: the model with restart waits
    # predicts more wall-clock than the model that prices the deaths as planned failures
    assert row["model_learned"].mean > row["model_planned"].mean
    text = render_real(spec)
    assert "| none | skip | 3 |" in text and "real deaths cost more" in text


def test_a_seed_begun_with_another_arithmetic_is_refused(tmp_path: Path) -> None:
    base = _base("none", 1, 3.0, wall=20.0)
    spec = _study(tmp_path, [base])
    assert refused_seeds(spec, "sha256:aaaa") == {}
    refused = refused_seeds(spec, "sha256:bbbb")
    assert list(refused) == [1] and "sha256:aaaa" in refused[1] and "new seed" in refused[1]


def test_the_committed_document_is_what_the_committed_results_render() -> None:
    spec = load_real_spec(SPEC)
    assert spec.document.exists(), f"render it: crucible study render {SPEC}"
    assert spec.document.read_text() == render_real(spec), (
        f"{spec.document} is stale: crucible study render studies/pipeline-real.toml")
