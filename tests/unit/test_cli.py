"""The command line contract: `crucible run` and `crucible presets`, as a user calls them."""
import json
import re
import subprocess
import sys

import pytest

CLI = [sys.executable, "-c", "from cli.main import main; main()"]


def _crucible(*args, cwd=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def _crucible_here(*args, cwd=None, env=None):
    """`crucible ARGS` in this process (the same app `main()` runs, its packages registered),
    for commands that end before they train: the same exit code, stdout and stderr as
    `_crucible` without a new interpreter importing torch (about 3 s a call). Exceptions are
    not caught, so a traceback fails the test as it would reach the user."""
    import os

    from typer.testing import CliRunner

    from cli.main import _register_packages, app

    _register_packages()
    before = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        result = CliRunner().invoke(app, [str(a) for a in args], env=env,
                                    catch_exceptions=False)
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout,
                                       result.stderr)


# one codec in `make test`, the other two in the slow lane (each trains ~10 s in a new process)
@pytest.mark.parametrize("compression", [pytest.param("none", marks=pytest.mark.slow), "ssn",
                                         pytest.param("mapl", marks=pytest.mark.slow)])
def test_smoke_run_learns_with_every_codec(tmp_path, compression):
    done = _crucible("run", "--preset", "smoke", "--set", f"pipeline.compression={compression}",
                     "--out", str(tmp_path), "--no-progress")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_val_loss"] < 0.7 * summary["initial_val_loss"]
    cfg = summary["config"]
    assert cfg["pipeline"]["compression"] == compression
    assert summary["contributions"]["made"] == cfg["replicas"] * cfg["pipeline"]["stages"] * \
        cfg["train"]["global_steps"]
    for key in ("evals", "tokens_processed", "bytes", "wall_s", "versions", "faults",
                "inner_steps", "synced_params"):
        assert key in summary
    assert summary["bytes"]["boundary_forward"] > 0
    assert f"summary: {tmp_path / 'summary.json'}" in done.stdout


@pytest.mark.parametrize("override, needle", [
    ("model.widht=3", "unknown key 'model.widht'"),
    ("fault.p=0.1", "unknown key 'fault.p'; did you mean faults.p?"),
    ("faults.strategy=jump", "allowed values: 'skip' | 'drop' | 'drop_extend' | 'reroute'"),
    ("pipeline.stages=3", "pipeline.stages=3 must divide model.layers=4"),
    ("faults.p=1.5", "faults.p must be a probability in [0, 1]"),
])
def test_bad_set_exits_2_naming_the_key(tmp_path, override, needle):
    done = _crucible_here("run", "--preset", "smoke", "--set", override, "--out", str(tmp_path))
    assert done.returncode == 2
    assert needle in done.stderr
    assert not (tmp_path / "summary.json").exists()


def test_presets_lists_every_preset():
    done = _crucible_here("presets", "--json")
    assert done.returncode == 0, done.stderr
    names = [row["name"] for row in json.loads(done.stdout)]
    assert names == ["smoke", "small", "study", "study-d128", "paper-178m"]


def _invoke_80_columns(*args):
    """The CLI in-process, as piped (CliRunner's output is no tty) into an 80-column terminal."""
    from typer.testing import CliRunner

    from cli.main import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "80"}, terminal_width=80)


def test_presets_fit_80_columns_and_never_cut_a_name_or_description():
    from crucible.presets import PRESETS

    done = _invoke_80_columns("presets")
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "\u2026" not in done.output                     # no ellipsis: nothing was cut
    flat = " ".join(done.output.split())
    for name, info in PRESETS.items():
        assert any(line.startswith(f"{name}: ") for line in lines), done.output
        assert f"{name}: {info.description}" in flat


def test_presets_json_has_name_description_and_sizes_of_each():
    from crucible.presets import PRESETS, parameter_count

    done = _invoke_80_columns("presets", "--json")
    assert done.exit_code == 0, done.output
    rows = json.loads(done.output)
    assert [row["name"] for row in rows] == list(PRESETS)
    for row in rows:
        info = PRESETS[row["name"]]
        assert row["description"] == info.description
        assert row["parameters"] == parameter_count(info.build())
        for key in ("replicas", "stages", "layers", "d_model", "global_steps", "tokens"):
            assert isinstance(row[key], int) and row[key] > 0


def test_run_help_lists_every_preset():
    from crucible.presets import PRESETS

    done = _invoke_80_columns("run", "--help")
    assert done.exit_code == 0, done.output
    for name in PRESETS:
        assert name in done.output


def test_run_ends_with_a_summary_table_of_its_summary_json(tmp_path):
    tiny = ["model.d_model=32", "model.heads=2", "model.seq_len=16", "replicas=2",
            "train.batch_size=2", "sparseloco.inner_steps=2", "train.global_steps=3",
            "train.eval_every=3", "train.eval_tokens=256", "faults.p=0.5"]
    done = _crucible("run", *[a for kv in tiny for a in ("--set", kv)], "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["faults"], "faults.p=0.5 should fail a stage in 3 global steps x 2 replicas"
    expected = {
        "final val loss": f"{summary['final_val_loss']:.4f} +- {summary['val_loss_stderr']:.4f}",
        "tokens processed": f"{summary['tokens_processed']:,}",
        "failures": str(len(summary["faults"])),
        "bytes uploaded": f"{summary['bytes']['upload']:,}",
        "wall time": f"{summary['wall_s']:.1f} s",
    }
    for what, value in expected.items():
        row = [line for line in done.stdout.splitlines() if what in line]
        assert len(row) == 1 and value in row[0], done.stdout


@pytest.mark.slow   # ~28 s: a whole embedded sweep (Prefect + registry + 2 runs)
def test_small_embedded_sweep_prints_no_traceback_or_prefect_notice(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # ephemeral
    done = subprocess.run(
        [*CLI, "sweep", "--preset", "smoke", "--arm", "none", "--strategy", "skip", "--p", "0.5",
         "--seed", "0", "--global-steps", "2", "--set", "train.eval_tokens=256",
         "--set", "model.d_model=32", "--set", "model.heads=2", "--work-dir", "work"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("report: ")
    assert "Starting temporary server" in done.stderr     # Prefect's own line stays ...
    for notice in ("Traceback", "dedicated Prefect server", "telemetry", "analytics"):
        assert notice not in output, output[-3000:]         # ... its advertisements do not


def _one_error_line(done) -> str:
    """The command's single `error:` line; a traceback or a second error fails the test."""
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("overrides, needles", [
    (["store.url=file://relative"], ["store.url='file://relative'", "file:///var/crucible"]),
    (["store.url=s3://"], ["store.url='s3://'", "needs a bucket"]),
    (["store.url=file:///proc/self"], ["store.url='file:///proc/self'", "pseudo-filesystem"]),
    (["store.endpoint_url=notaurl"], ["store.endpoint_url='notaurl'", "http://127.0.0.1:9000"]),
    (["sparseloco.chunk=128"], ["sparseloco.chunk=128", "[1, 64]"]),
    # accepted before, then grew until the kernel killed them (22.3 GB)
    (["train.batch_size=1000000", "data.allow_repeat=true"],
     ["not enough memory", "training step", "available", "lower train.batch_size"]),
    (["replicas=100000", "data.allow_repeat=true"],
     ["not enough memory", "model state", "available", "replicas"]),
])
def test_value_that_cannot_run_exits_2_with_one_line_and_writes_nothing(tmp_path, overrides,
                                                                        needles):
    out = tmp_path / "out"
    args = [item for o in overrides for item in ("--set", o)]
    done = _crucible_here("run", "--preset", "smoke", *args, "--out", str(out), "--no-progress")
    assert done.returncode == 2
    line = _one_error_line(done)
    for needle in needles:
        assert needle in line
    assert not out.exists()


def test_cuda_device_without_a_gpu_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    done = _crucible_here("run", "--preset", "smoke", "--set", "train.device=cuda", "--out",
                     str(tmp_path / "out"))
    assert done.returncode == 2
    assert "train.device=cuda but no CUDA device is available" in _one_error_line(done)


def test_file_store_that_cannot_be_a_folder_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = _crucible_here("run", "--preset", "smoke", "--set", f"store.url={blocker.as_uri()}",
                     "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert f"store.url='{blocker}' is a file, not a folder" in _one_error_line(done)


@pytest.mark.parametrize("where, needle", [
    ("a-file", "is a file, not a folder"),
    ("a-file/below", "a part of the path is a file"),
    ("/proc/self", "is not writable"),
    ("/proc/crucible-out", "cannot be created"),
])
def test_bad_out_path_exits_2_naming_it(tmp_path, where, needle):
    (tmp_path / "a-file").write_text("not a folder")
    out = where if where.startswith("/") else str(tmp_path / where)
    done = _crucible_here("run", "--preset", "smoke", "--out", out)
    assert done.returncode == 2
    line = _one_error_line(done)
    assert f"--out='{out}'" in line and needle in line


@pytest.mark.slow   # ~9 s: a new process, then the store's connection attempts time out
def test_unreachable_s3_endpoint_is_one_line_naming_it_and_resume(tmp_path, monkeypatch):
    import socket

    with socket.socket() as sock:   # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    done = _crucible("run", "--preset", "smoke", "--set", "store.url=s3://crucible-gone/runs",
                     "--set", f"store.endpoint_url=http://127.0.0.1:{port}", "--out", str(out),
                     "--no-progress")
    assert done.returncode == 1
    line = _one_error_line(done)
    for needle in (f"endpoint http://127.0.0.1:{port}", "s3://crucible-gone/runs",
                   f"crucible run --resume --out {out}"):
        assert needle in line
    assert not (out / "summary.json").exists()


@pytest.mark.slow   # trains in new processes (10-20 s)
def test_unusable_checkpoints_on_resume_are_one_line_exit_2(tmp_path):
    out = tmp_path / "out"
    first = _crucible("run", "--preset", "smoke", "--set", "train.global_steps=4",
                      "--set", "train.checkpoint_every=2", "--out", str(out), "--no-progress")
    assert first.returncode == 0, first.stderr
    run_key = json.loads((out / "run.json").read_text())["run_key"]
    written = list((out / "store" / run_key / "checkpoints").iterdir())
    assert written
    for path in written:   # every checkpoint and the pointer: nothing to fall back on
        path.write_bytes(b"\x00garbage")
    done = _crucible("run", "--preset", "smoke", "--set", "train.global_steps=4",
                     "--set", "train.checkpoint_every=2", "--out", str(out), "--resume",
                     "--no-progress")
    assert done.returncode == 2
    assert "checkpoint" in _one_error_line(done)


def test_run_key_from_an_edited_run_json_is_refused_on_resume(tmp_path):
    # run.json's run key is the run's store prefix: '../..' would reach outside the store
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"run_key": "../../etc",
                                              "store_url": (out / "store").as_uri()}))
    done = _crucible_here("run", "--preset", "smoke", "--out", str(out), "--resume", "--no-progress")
    assert done.returncode == 2
    line = _one_error_line(done)
    assert "run_key in" in line and "'../../etc' is not a valid id" in line
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("args, needle", [
    (["--work-dir", "{tmp}/a-file"], "--work-dir='{tmp}/a-file' is a file, not a folder"),
    (["--work-dir", "{tmp}/work", "--out", "{tmp}/work"], "--out='{tmp}/work' is a folder"),
    (["--work-dir", "{tmp}/work", "--out", "{tmp}/a-file/report.html"],
     "folder of --out='{tmp}/a-file' is a file"),
    (["--work-dir", "{tmp}/work", "--set", "replicas=100000", "--set", "data.allow_repeat=true"],
     "not enough memory"),
])
def test_sweep_refuses_what_cannot_run_before_starting(tmp_path, args, needle):
    (tmp_path / "a-file").write_text("not a folder")
    args = [a.format(tmp=tmp_path) for a in args]
    done = _crucible_here("sweep", "--arm", "ssn", "--strategy", "skip", "--p", "0.1", *args)
    assert done.returncode == 2
    assert needle.format(tmp=tmp_path) in _one_error_line(done)
    assert "Starting temporary server" not in done.stdout + done.stderr   # nothing started


def test_study_refuses_cells_this_machine_cannot_run_before_starting(tmp_path):
    spec = tmp_path / "studies" / "big.toml"
    spec.parent.mkdir()
    spec.write_text('name = "big"\npreset = "smoke"\nseeds = [0]\n'
                    'set = ["replicas=100000", "data.allow_repeat=true"]\n'
                    '[[grid]]\narms = ["ssn"]\nstrategies = ["skip"]\np = [0.1]\n')
    done = _crucible_here("study", "run", str(spec))
    assert done.returncode == 2
    line = _one_error_line(done)
    assert "not enough memory" in line and "replicas" in line
    assert not (tmp_path / "runs").exists()


_SHORT = ("--preset", "smoke", "--set", "train.global_steps=3", "--no-progress")


def _records(out) -> dict[str, int]:
    return {name: len((out / name).read_text().splitlines())
            for name in ("metrics.jsonl", "events.jsonl")}


def _faulty_run(out):
    """A finished run with many fault events: what a rerun must never keep."""
    done = _crucible("run", *_SHORT, "--set", "faults.p=0.5", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert _records(out)["events.jsonl"] > 0


def test_rerun_into_a_finished_run_folder_exits_2_and_leaves_it_untouched(tmp_path):
    out = tmp_path / "out"
    _faulty_run(out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    done = _crucible("run", *_SHORT, "--out", str(out))
    assert done.returncode == 2
    line = _one_error_line(done)
    for needle in (f"--out='{out}' already holds a run", "--resume", "--overwrite",
                   "another --out"):
        assert needle in line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow   # trains in new processes (10-20 s)
def test_overwrite_leaves_only_the_new_runs_records_and_unrelated_files(tmp_path):
    out, clean = tmp_path / "out", tmp_path / "clean"
    _faulty_run(out)
    old_key = json.loads((out / "run.json").read_text())["run_key"]
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "shard.bin").write_bytes(b"\x01")
    done = _crucible("run", *_SHORT, "--out", str(out), "--overwrite")
    assert done.returncode == 0, done.stderr
    assert _crucible("run", *_SHORT, "--out", str(clean)).returncode == 0
    assert _records(out) == _records(clean)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["faults"]["p"] == json.loads(
        (clean / "summary.json").read_text())["config"]["faults"]["p"]
    assert [p.name for p in (out / "store").iterdir()] == [summary["run_key"]] != [old_key]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "data" / "shard.bin").read_bytes() == b"\x01"


@pytest.mark.slow   # trains in new processes (10-20 s)
def test_default_out_is_a_new_folder_per_run(tmp_path):
    printed = ""
    for _ in range(2):
        done = _crucible("run", *_SHORT, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        printed += done.stdout
    refused = _crucible("run", *_SHORT, "--set", "faults.p=2", cwd=tmp_path)
    assert refused.returncode == 2
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2   # the refused run left no folder
    for folder in folders:
        assert re.fullmatch(r"\d{8}-\d{6}Z-smoke(-\d+)?", folder.name)
        assert f"summary: {folder.relative_to(tmp_path) / 'summary.json'}" in printed
    assert _records(folders[0]) == _records(folders[1])


@pytest.mark.slow   # trains in new processes (10-20 s)
@pytest.mark.parametrize("checkpoint", [True, False])
def test_resume_with_another_configuration_exits_2(tmp_path, checkpoint):
    out = tmp_path / "out"
    _faulty_run(out)
    if not checkpoint:   # a run of an older crucible: no config in run.json, no checkpoint
        import shutil

        shutil.rmtree(out / "store")
        ident = json.loads((out / "run.json").read_text())
        (out / "run.json").write_text(json.dumps({k: ident[k] for k in ("run_key", "store_url")}))
    before = _records(out)
    done = _crucible("run", *_SHORT, "--set", "faults.p=0.1", "--out", str(out), "--resume")
    assert done.returncode == 2
    line = _one_error_line(done)
    assert f"--out='{out}' holds a run with a different configuration" in line
    assert "--overwrite" in line
    assert _records(out) == before


@pytest.mark.parametrize("args, needle", [
    (["--resume", "--overwrite", "--out", "{tmp}"], "--resume and --overwrite exclude each other"),
    (["--resume"], "--resume needs --out"),
])
def test_resume_needs_a_folder_and_no_overwrite(tmp_path, args, needle):
    done = _crucible_here("run", *_SHORT, *[a.format(tmp=tmp_path) for a in args], cwd=tmp_path)
    assert done.returncode == 2
    assert needle in _one_error_line(done)
    assert list(tmp_path.iterdir()) == []


def _crucible_with(env_changes, *args, cwd=None):
    """`crucible ARGS` with CRUCIBLE_API_URL / _TOKEN removed from the environment, then
    `env_changes` applied."""
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("CRUCIBLE_API_URL", "CRUCIBLE_API_TOKEN")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**env, **env_changes})


def _nothing_listens() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("args, env, needle", [
    (["--api", "ftp://registry"], {}, "--api (or CRUCIBLE_API_URL)='ftp://registry' must start "
                                      "with http:// or https://"),
    (["--api", "{down}"], {}, "cannot reach the registry at {down}"),
    ([], {"CRUCIBLE_API_URL": "{down}"}, "cannot reach the registry at {down}"),
    (["--api", "{down}", "--tag", "two words"], {}, "--tag 'two words' is not a valid tag"),
    (["--tag", "fig3"], {}, "--tag and --note are recorded in the registry: give --api URL"),
    (["--no-api", "--note", "why"], {"CRUCIBLE_API_URL": "{down}"}, "--tag and --note are "
                                                                     "recorded in the registry"),
])
def test_run_refuses_a_registry_it_cannot_use_before_training(tmp_path, args, env, needle):
    down = _nothing_listens()
    out = tmp_path / "out"
    changes = {"CRUCIBLE_API_URL": None, "CRUCIBLE_API_TOKEN": None,
               **{k: v.format(down=down) for k, v in env.items()}}
    done = _crucible_here("run", *_SHORT, "--out", str(out),
                          *[a.format(down=down) for a in args], cwd=tmp_path, env=changes)
    assert done.returncode == 2
    line = _one_error_line(done)
    assert needle.format(down=down) in line
    assert not (out / "summary.json").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.slow   # trains in new processes (10-20 s)
def test_no_api_trains_without_the_registry_named_in_the_environment(tmp_path):
    out = tmp_path / "out"
    done = _crucible_with({"CRUCIBLE_API_URL": _nothing_listens()}, "run", *_SHORT, "--out",
                          str(out), "--no-api", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (out / "summary.json").exists() and "run page:" not in done.stdout


@pytest.mark.parametrize("args, needle", [
    (["--tag", "two words"], "--tag: tag 'two words' is not a valid tag"),
    (["--note", "n" * 10_001], "--note: String should have at most 10000 characters"),
])
def test_sweep_refuses_a_bad_tag_or_note_naming_the_option(tmp_path, args, needle):
    done = _crucible_here("sweep", "--arm", "ssn", "--strategy", "skip", "--p", "0.1",
                     "--work-dir", str(tmp_path / "work"), *args)
    assert done.returncode == 2
    assert needle in _one_error_line(done)
    assert not (tmp_path / "work").exists()


def test_launch_is_a_crucible_command_with_clear_errors(tmp_path):
    """`crucible launch` (the distributed mode) is wired into the CLI: its own help, and bad
    input is exit 2 naming the option, before any process starts."""
    helped = _crucible_here("launch", "--help")
    assert helped.returncode == 0 and "--kill-forever" in helped.stdout
    bad = _crucible_here("launch", "--nproc", "0", "--out", str(tmp_path / "d"))
    assert bad.returncode == 2 and "--nproc must be >= 1" in bad.stderr
    assert not (tmp_path / "d").exists()
    kill = _crucible_here("launch", "--nproc", "2", "--kill", "x@1", "--out", str(tmp_path / "d"))
    assert kill.returncode == 2 and "--kill 'x@1'" in kill.stderr
