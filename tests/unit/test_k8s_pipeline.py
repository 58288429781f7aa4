"""The pipeline mode's pod-per-stage layout for Kubernetes (issue 36, item 6): `python -m
infra.k8s.render --pipeline`. Rendered and checked structurally here; NOT RUN on a cluster (none
here). What the pods run is run for real in tests/integration/test_pipeline_pods.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import zmq

from crucible.config import apply_overrides
from crucible.distributed.pipeline.launch import free_ports
from crucible.presets import get_preset
from infra.k8s.render import RUN_DIR, main


def test_a_stage_binds_where_the_run_says_and_is_reached_by_a_name(tmp_path: Path) -> None:
    """In a pod the stage's peers reach it by a DNS name (which need not resolve yet where it
    starts) while it binds an interface address (`binds`): the old code bound the name."""
    from crucible.distributed.pipeline.stage import StageWorker

    config = apply_overrides(get_preset("smoke"), ["replicas=1"])
    (port,) = free_ports(1)
    (tmp_path / "run.json").write_text(json.dumps({
        "run_key": "run-bind", "store_url": (tmp_path / "store").as_uri(),
        "config": config.to_dict(), "plan": [], "micro_batches": 1, "link_timeout_s": 5.0,
        "addresses": {f"0,{s}": f"tcp://crucible-r0-s{s}.crucible-links:{port}"
                      for s in range(4)},
        "binds": {"0,1": f"tcp://127.0.0.1:{port}"}}))
    worker = StageWorker(tmp_path, 0, 1)
    try:
        bound = worker.inbox.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert bound == f"tcp://127.0.0.1:{port}"
        # a peer reaching it by another name of the bound address gets through (and a
        # malformed message is refused, not raised)
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"tcp://localhost:{port}")
        sock.send_multipart([b"{not json"])
        sock.close()
        context.term()
        for _ in range(100):
            worker.inbox.socket.poll(50)
            worker.inbox.drain()
            if worker.counters.refused:
                break
        assert dict(worker.counters.refused) == {"unknown": 1}
    finally:
        worker.close()


# -- the rendered manifests ------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
STORE = ["--store", "s3://crucible/pipe", "--endpoint-url", "http://minio:9000"]
API = {"ConfigMap": "v1", "PersistentVolumeClaim": "v1", "Service": "v1",
       "NetworkPolicy": "networking.k8s.io/v1", "Job": "batch/v1"}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _render(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.k8s.render", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pods(objects: list[dict]) -> list[tuple[dict, dict]]:
    """Every Job's pod template: (its Job, its template)."""
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] == "Job"]


def test_the_pipeline_renders_a_pod_per_stage_replica_whose_links_all_resolve() -> None:
    done = _render(["--pipeline", "--replicas", "2", "--image", "img", *STORE, "--name", "pipe",
                    "--set", "faults.p=0.1", "--set", "train.global_steps=8", "--restarts", "2",
                    "--link-port", "6000", "--stage-cpu", "2", "--stage-memory", "3Gi",
                    "--run-key", "run-k8spipe"])
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    # every document: a known kind at its API version, a DNS-label name unique within its kind
    for o in objects:
        assert o["apiVersion"] == API[o["kind"]], o["kind"]
        assert DNS_LABEL.fullmatch(o["metadata"]["name"]), o["metadata"]["name"]
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))
    by_kind = {kind: [o for o in objects if o["kind"] == kind] for kind in API}
    (config_map,), (claim,) = by_kind["ConfigMap"], by_kind["PersistentVolumeClaim"]
    (service,), (policy,) = by_kind["Service"], by_kind["NetworkPolicy"]
    ident = json.loads(config_map["data"]["run.json"])
    assert (ident["mode"], ident["run_key"], ident["store_url"]) == (
        "pipeline", "run-k8spipe", "s3://crucible/pipe")
    assert ident["config"]["store"]["endpoint_url"] == "http://minio:9000"
    R, S = ident["config"]["replicas"], ident["config"]["pipeline"]["stages"]
    assert (R, S) == (2, 4)

    stage_pods = {(int(t["metadata"]["labels"]["crucible.io/replica"]),
                   int(t["metadata"]["labels"]["crucible.io/stage"])): (job, t)
                  for job, t in _pods(objects)
                  if t["metadata"]["labels"].get("crucible.io/role") == "stage"}
    assert sorted(stage_pods) == [(r, s) for r in range(R) for s in range(S)]   # R x S pods
    others = [t for _, t in _pods(objects) if t["metadata"]["labels"]["crucible.io/role"]
              != "stage"]
    assert [t["metadata"]["labels"]["crucible.io/role"] for t in others] == ["merge"]

    # the headless Service selects exactly the stage pods and publishes them before they
    # are ready; the NetworkPolicy lets only them reach the link port
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    for selector in (service["spec"]["selector"], policy["spec"]["podSelector"]["matchLabels"],
                     policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]):
        assert all(_selects(selector, t["metadata"]["labels"]) for _, t in stage_pods.values())
        assert not any(_selects(selector, t["metadata"]["labels"]) for t in others)
    (service_port,) = service["spec"]["ports"]
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 6000}]

    # every stage-replica's address is the DNS name of the pod that runs it, on the port its
    # container binds (`binds`) and the Service and NetworkPolicy name: every neighbour a
    # stage sends to (next, previous, past a skipped one, another replica's on a reroute)
    hosts = {t["spec"]["hostname"]: key for key, (_, t) in stage_pods.items()}
    for key, address in ident["addresses"].items():
        r, s = (int(x) for x in key.split(","))
        match = re.fullmatch(r"tcp://([^.]+)\.([^.:]+):(\d+)", address)
        assert match, address
        host, subdomain, port = match.group(1), match.group(2), int(match.group(3))
        assert hosts[host] == (r, s)
        job, template = stage_pods[(r, s)]
        pod = template["spec"]
        assert subdomain == pod["subdomain"] == service["metadata"]["name"]
        (container,) = pod["containers"]
        (link,) = container["ports"]
        assert port == link["containerPort"] == service_port["port"] == 6000
        assert service_port["targetPort"] == link["name"]
        assert container["readinessProbe"]["tcpSocket"]["port"] == link["name"]
        assert ident["binds"][key] == f"tcp://0.0.0.0:{port}"
    assert len(ident["addresses"]) == R * S

    # each pod: its stage-replica's supervisor, its lives (one per planned failure before
    # the end, plus --restarts) as the Job's budget, CPU only, the store's credentials
    planned = {}
    for f in ident["plan"]:
        if f["start"] < 8:
            planned[(f["replica"], f["stage"])] = planned.get((f["replica"], f["stage"]), 0) + 1
    assert planned, "the plan should hold a failure for this test to mean something"
    for (r, s), (job, template) in stage_pods.items():
        pod = template["spec"]
        (container,) = pod["containers"]
        assert container["command"] == [
            "python", "-m", "crucible.distributed.pipeline.pods", "supervise", "--run-dir",
            RUN_DIR, "--replica", str(r), "--stage", str(s)]
        assert job["metadata"]["name"] == pod["hostname"]
        lives = ident["lives"][f"{r},{s}"]
        assert lives == 1 + planned.get((r, s), 0) + 2
        assert job["spec"]["backoffLimit"] == lives     # and a pod to report the last lost
        assert pod["restartPolicy"] == "Never" and pod["shareProcessNamespace"] is True
        assert job["spec"]["podReplacementPolicy"] == "Failed"
        (rule,) = job["spec"]["podFailurePolicy"]["rules"]
        assert rule == {"action": "FailJob", "onExitCodes": {
            "containerName": container["name"], "operator": "In", "values": [1]}}
        assert container["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"},
                                          "limits": {"memory": "3Gi"}}
        assert job["metadata"]["labels"] == template["metadata"]["labels"]
        env = {e["name"]: e for e in container["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "crucible-s3", "key": key}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["run"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert volumes["spec"]["configMap"]["name"] == config_map["metadata"]["name"]
        assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["run"] == RUN_DIR
        (init,) = pod["initContainers"]
        assert subprocess.run(["sh", "-n", "-c", init["command"][-1]]).returncode == 0
    (merge,) = others
    assert merge["spec"]["containers"][0]["command"] == [
        "python", "-m", "crucible.distributed.pipeline.pods", "merge", "--run-dir", RUN_DIR,
        "--grace-s", "1800"]


def test_the_pipeline_layout_runs_reroute_which_the_replica_layout_refuses() -> None:
    reroute = ["--set", "faults.p=0.1", "--set", "faults.strategy=reroute"]
    assert main(["--image", "img", "--replicas", "2", *STORE, "--pipeline", *reroute]) == 0
    assert main(["--image", "img", "--replicas", "2", *STORE, *reroute]) == 2


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "0", *STORE], "--replicas must be >= 1 (R x S pods"),
    (["--replicas", "2"], "--store is required with --pipeline"),
    (["--replicas", "2", "--store", "file:///data"], "--store 'file:///data': pass s3://"),
    (["--replicas", "2", *STORE, "--set", "pipeline.stages=2", "--set", "faults.p=0.1",
      "--set", "faults.strategy=skip"], "pipeline.stages=2; use pipeline.stages >= 3"),
    (["--replicas", "2", *STORE, "--set", "pipeline.stages=1"], "use pipeline.stages >= 2"),
    (["--replicas", "2", *STORE, "--kill", "1@3"], "--kill and --kill-forever kill whole"),
    (["--replicas", "2", *STORE, "--gpus", "1"], "--gpus 1: the pipeline mode runs its stages "
                                                  "on the CPU"),
    (["--replicas", "2", *STORE, "--link-port", "0"], "--link-port must be a TCP port"),
    (["--replicas", "2", *STORE, "--stage-memory", "lots"], "--stage-memory 'lots': pass a "
                                                            "Kubernetes quantity"),
    (["--replicas", "2", *STORE, "--micro-batches", "3"], "--micro-batches=3 must be >= 1 and "
                                                          "divide train.batch_size=4"),
    (["--replicas", "2", *STORE, "--link-timeout", "0"], "--link-timeout must be > 0"),
    (["--replicas", "2", *STORE, "--link-mbps", "-1"], "--link-mbps must be"),
    (["--replicas", "2", *STORE, "--restarts", "-1"], "restarts (--restarts) must be"),
    (["--replicas", "2", *STORE, "--name", "Pipe"], "--name 'Pipe': use 1-40 lowercase"),
    (["--replicas", "2", *STORE, "--set", "faults.p=0.1", "--set", "faults.strategy=drop_extend"],
     "faults.strategy=drop_extend extends the run"),
])
def test_bad_pipeline_input_exits_2_naming_the_option(argv: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--image", "img", "--pipeline", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and not captured.out


def test_the_pipeline_options_without_pipeline_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--image", "img", "--replicas", "2", *STORE, "--link-port", "6000"]) == 2
    assert "--link-port: the pipeline mode's options; add --pipeline" in capsys.readouterr().err


# -- what a stage pod runs: the launcher's watch over its one process ----------------------------

def _run_folder(tmp_path: Path, *, lives: int, store_url: str | None = None) -> Path:
    from crucible.distributed.pipeline.launch import run_identity
    from crucible.faults import FaultPlan

    config = apply_overrides(get_preset("smoke"), ["replicas=1", "train.device=cpu"])
    ports = free_ports(4)
    ident = run_identity(config, plan=FaultPlan(), store_url=store_url or (
        tmp_path / "store").as_uri(), micro_batches=1, link_timeout_s=5.0, restarts=lives - 1,
        addresses={f"0,{s}": f"tcp://127.0.0.1:{ports[s]}" for s in range(4)})
    (tmp_path / "run.json").write_text(json.dumps(ident))
    return tmp_path


def test_a_pods_supervisor_announces_the_life_that_died_with_the_pod_before_it(
        tmp_path: Path) -> None:
    """A stage pod replaced after it was lost as a whole: the stage's last life died with it,
    unseen; the new supervisor tells the stage's peers (as the lost one would have) and, with
    no life left, reports the stage lost, once."""
    from crucible.distributed.pipeline.pods import STATE_FILE, supervise

    run = _run_folder(tmp_path, lives=1)
    ident = json.loads((run / "run.json").read_text())
    folder = run / "stages" / "r0-s1"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"lives_used": 1, "started": 1.0}))
    (folder / "process.jsonl").write_text(json.dumps(
        {"kind": "start", "global_step": 0, "replica": 0, "life": 0, "wall": 1.0}) + "\n")
    (folder / "rounds.jsonl").write_text(json.dumps(
        {"global_step": 0, "replica": 0, "stage": 1}) + "\n")
    context = zmq.Context()
    peer = context.socket(zmq.PULL)
    peer.bind(ident["addresses"]["0,2"])
    try:
        outcome = supervise(run, replica=0, stage=1)
        assert peer.poll(5000)
        header = json.loads(peer.recv_multipart()[0])
        assert (header["kind"], header["src"]) == ("ctl", [-1, -1])
        assert header["control"] == {"event": "dead", "replica": 0, "stage": 1, "round": 1,
                                     "gone": True}
        assert supervise(run, replica=0, stage=1) == outcome        # reported once
        assert not peer.poll(500)
    finally:
        peer.close(linger=0)
        context.term()
    assert (outcome["exit"], outcome["lives"], outcome["lost"]) == (None, 1, True)
    notices = [json.loads(line) for line in (run / "notices.jsonl").read_text().splitlines()]
    assert [(n["replica"], n["stage"], n["round"], n["gone"]) for n in notices] == [
        (0, 1, 1, True)]


def test_a_stage_that_finished_before_its_pod_went_is_done_without_a_notice(
        tmp_path: Path) -> None:
    from crucible.distributed.pipeline.pods import STATE_FILE, supervise

    run = _run_folder(tmp_path, lives=1)
    folder = run / "stages" / "r0-s1"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"lives_used": 1, "started": 1.0}))
    (folder / "summary.json").write_text("{}")
    outcome = supervise(run, replica=0, stage=1)
    assert (outcome["exit"], outcome["lives"], outcome["lost"]) == (0, 1, False)
    assert not (run / "notices.jsonl").exists()


@pytest.mark.slow
def test_a_stage_that_fails_with_an_error_is_not_restarted_and_fails_the_merge(
        tmp_path: Path) -> None:
    from crucible.distributed.pipeline.pods import merge_pods, supervise

    run = _run_folder(tmp_path, lives=3, store_url="nope://bucket")   # the stage cannot start
    outcome = supervise(run, replica=0, stage=1)
    assert (outcome["exit"], outcome["lives"], outcome["lost"]) == (1, 1, False)
    assert "nope://bucket" in (run / "stages" / "r0-s1" / "stage.log").read_text()
    with pytest.raises(RuntimeError, match=r"stage 1 of replica 0 failed \(exit 1\); its log: "
                                           r".*r0-s1/stage.log"):
        merge_pods(run, grace_s=0.0, poll_s=0.01)
