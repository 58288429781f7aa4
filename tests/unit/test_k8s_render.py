"""infra/k8s/render.py: the Kubernetes template of a distributed run on N GPU hosts (issue 16
item 5). Rendered and checked here; NOT RUN on a cluster (none here, no GPUs)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.k8s.render import MERGE_SCRIPT, RUN_DIR, main

REPO = Path(__file__).resolve().parents[2]
STORE = ["--store", "s3://crucible/dist", "--endpoint-url", "http://minio:9000"]


def _render(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.k8s.render", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _replica_jobs(objects: list[dict]) -> dict[int, dict]:
    return {int(o["metadata"]["labels"]["crucible.io/replica"]): o for o in objects
            if o["kind"] == "Job" and o["metadata"]["labels"]["crucible.io/role"] == "replica"}


def test_four_replicas_render_one_gpu_job_each_with_the_store_and_worker_command() -> None:
    done = _render(["--replicas", "4", "--image", "registry.example.com/crucible:gpu", *STORE,
                    "--kill", "2@3", "--kill-forever", "3@5", "--set", "train.global_steps=8",
                    "--run-key", "run-k8stest"])
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"]
    ident = json.loads(config_map["data"]["run.json"])
    assert ident["run_key"] == "run-k8stest" and ident["store_url"] == "s3://crucible/dist"
    assert ident["config"]["replicas"] == 4
    # every replica's restart budget (default 3) plus one per planned kill, and the lease
    assert (ident["lives"], ident["lease_s"]) == ([4, 4, 5, 5], 5.0)
    assert ident["config"]["store"]["endpoint_url"] == "http://minio:9000"
    assert ident["kills"] == [{"replica": 2, "global_step": 3, "rejoin": True},
                              {"replica": 3, "global_step": 5, "rejoin": False}]
    [claim] = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]

    jobs = _replica_jobs(objects)
    assert sorted(jobs) == [0, 1, 2, 3]
    for r, job in jobs.items():
        # a pod lost as a whole is replaced, up to the replica's budget
        assert job["spec"]["backoffLimit"] == 3 + (1 if r in (2, 3) else 0)
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"      # restarts are the elastic agent's
        [container] = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        script = container["command"][-1]
        # the default budget of 3 for every replica, and one more per planned kill
        restarts = 3 + (1 if r in (2, 3) else 0)
        assert (f"python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 "
                f"--max-restarts {restarts} --monitor-interval 0.1 -m crucible.distributed.run_worker "
                f"--run-dir {RUN_DIR} --replica {r}\n") in script
        assert f"> {RUN_DIR}/replicas/replica-{r}/exit-code" in script
        env = {e["name"]: e for e in container["env"]}
        assert env["CRUCIBLE_REPLICA"]["value"] == str(r)
        assert env["CRUCIBLE_STORE_URL"]["value"] == "s3://crucible/dist"
        assert env["CRUCIBLE_S3_ENDPOINT_URL"]["value"] == "http://minio:9000"
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "crucible-s3", "key": key}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["run"] == RUN_DIR
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["run"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert volumes["spec"]["configMap"]["name"] == config_map["metadata"]["name"]

    [merge] = [o for o in objects if o["metadata"]["labels"].get("crucible.io/role") == "merge"]
    [container] = merge["spec"]["template"]["spec"]["containers"]
    assert "seq 0 3" in container["command"][-1]
    # the wait is valid shell, and it gives up on lost replicas after --merge-grace-s
    assert subprocess.run(["bash", "-n", "-c", container["command"][-1]]).returncode == 0
    assert "-ge 1800 ]" in container["command"][-1]
    assert {e["name"]: e.get("value") for e in container["env"]}["MERGE_SCRIPT"] == MERGE_SCRIPT


def test_cpu_pods_and_one_replica_without_a_store() -> None:
    done = _render(["--replicas", "1", "--image", "img", "--gpus", "0", "--claim", "shared"])
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    [job] = _replica_jobs(objects).values()
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert "resources" not in container
    ident = json.loads(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["run.json"])
    assert ident["store_url"] == f"file://{RUN_DIR}/store"


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "0", *STORE], "--replicas must be >= 1"),
    (["--replicas", "4"], "--store is required for --replicas 4"),
    (["--replicas", "2", "--store", "file:///data"], "--store 'file:///data': pass s3://"),
    (["--replicas", "2", *STORE, "--kill", "5@1"], "--kill 5@1: replica must be in 0..1"),
    (["--replicas", "2", *STORE, "--kill", "x"], "--kill 'x': expected REPLICA@GLOBAL_STEP"),
    (["--replicas", "2", *STORE, "--name", "Bad_Name"], "--name 'Bad_Name'"),
    (["--replicas", "2", *STORE, "--preset", "nope"], "--preset: unknown preset 'nope'"),
    (["--replicas", "2", *STORE, "--set", "sparseloco.method=diloco"],
     "sparseloco.method=diloco is not supported in distributed mode"),
])
def test_bad_input_exits_2_naming_the_option(argv: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--image", "img", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and not captured.out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_merge_step_merges_a_real_run_like_launch(tmp_path: Path) -> None:
    """The merge Job's script on the folders of a real two-process run (launch's layout) gives
    launch's own merged numbers."""
    from crucible.config import apply_overrides
    from crucible.distributed.launch import launch
    from crucible.presets import get_preset

    config = apply_overrides(get_preset("smoke"), [
        "replicas=2", "train.global_steps=2", "train.eval_every=2", "train.eval_tokens=8192",
        "sparseloco.round_timeout_s=120"])
    summary = launch(config, out_dir=tmp_path / "run")
    pods = tmp_path / "pods"           # what the shared volume holds when the replicas are done
    pods.mkdir()
    shutil.copy(tmp_path / "run" / "run.json", pods / "run.json")
    for r in range(2):
        folder = shutil.copytree(tmp_path / "run" / "replicas" / f"replica-{r}",
                                 pods / "replicas" / f"replica-{r}")
        (folder / "exit-code").write_text("0\n")
    done = subprocess.run([sys.executable, "-c", MERGE_SCRIPT, str(pods)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    merged = json.loads((pods / "summary.json").read_text())
    assert printed["lost"] == []
    for key in ("final_val_loss", "tokens_processed", "contributions", "inner_steps", "bytes"):
        assert merged[key] == summary[key], key
    assert (pods / "model.pt").exists() and (pods / "events.jsonl").exists()
