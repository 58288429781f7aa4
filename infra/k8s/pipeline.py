"""The pipeline mode on Kubernetes, one pod per stage-replica (`python -m infra.k8s.render
--pipeline`; NOT RUN here: no cluster. The rendering is checked structurally in
tests/unit/test_k8s_pipeline.py, and the pods' commands are run as local processes in
tests/integration/test_pipeline_pods.py).

    python -m infra.k8s.render --pipeline --replicas 2 --image registry.example.com/crucible \\
        --store s3://crucible/pipe --endpoint-url http://minio.crucible:9000 \\
        [--preset smoke] [--set key=value ...] [--restarts N] [--micro-batches M] \\
        [--link-timeout S] [--link-mbps MBIT_S] [--link-latency-ms MS] [--link-port PORT] \\
        [--stage-cpu CPU] [--stage-memory BYTES] [--name NAME] > run.yaml

What it renders (the layout `crucible launch --pipeline` makes on one host, one host per stage):

- ConfigMap `NAME-run`: `run.json`, as the launcher writes it (`launch.run_identity`: config, run
  key, store, fault plan, lives), with every stage-replica's link address its pod's DNS name,
  `tcp://NAME-rR-sS.NAME-links:PORT`, and its bind `tcp://0.0.0.0:PORT` (a pod binds every
  interface of its own network namespace; its DNS name need not resolve yet when it starts).
- PersistentVolumeClaim `NAME-run` (ReadWriteMany) unless `--claim`: the run folder, shared by
  every pod (`run.json`, `stages/rR-sS/`, `notices.jsonl`), which the merge reads whole.
- Service `NAME-links`, headless: every stage pod sets `hostname: NAME-rR-sS` and `subdomain:
  NAME-links`, so each has a stable DNS name that follows its pod when it is replaced (ZeroMQ
  resolves a name again on every reconnect). `publishNotReadyAddresses`: a stage is reachable
  while its readiness probe (its link port open) has not passed yet.
- NetworkPolicy `NAME-links`: only the run's stage pods reach the link port (the links are not
  authenticated; on one host they bind loopback for that reason). Enforced only by a network
  plugin that implements NetworkPolicy.
- One Job per stage-replica, `NAME-rR-sS` (CPU only: the pipeline mode runs its stages on the
  CPU; `--stage-cpu`, `--stage-memory`), running the launcher's watch over that one process
  (`crucible.distributed.pipeline.pods supervise`): it restarts the stage process after a death
  by a signal while it has lives (one per planned failure of it, plus `--restarts`) and tells
  every other stage of an unplanned one over its link, as the launcher does. `restartPolicy:
  Never`; `backoffLimit`: its lives (a pod lost as a whole is replaced, and the new supervisor
  goes on counting lives in the shared folder, first telling the peers of the life that died
  with the old pod: one pod more than lives can report the last lost). `podFailurePolicy`
  fails the Job at once when the stage failed with an error (exit 1: a restart would repeat
  it); `podReplacementPolicy: Failed` starts no replacement while the old pod still runs.
  `shareProcessNamespace`: the supervisor is not PID 1 (a stage process whose parent is PID 1
  takes its launcher for dead and stops). One Job per stage-replica because lives differ.
- Job `NAME-merge`: `pods merge` waits for every supervisor's outcome (once one is in, at most
  `--merge-grace-s` for the others), then merges as the launcher does (`launch.merge_pipeline`).
"""
from __future__ import annotations

import argparse
import re
from typing import Any

from crucible.config import Config, ConfigError
from crucible.distributed.pipeline.launch import run_identity
from crucible.distributed.pipeline.links import Shaping
from crucible.faults import FaultPlan, plan_for
from infra.k8s.render import (
    RUN_DIR,
    merge_job,
    mounts,
    run_config,
    run_labels,
    run_objects,
    run_spec_copy,
    store_env,
    volumes,
)

__all__ = ["render_pipeline", "stage_name", "links_service"]

_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_MODULE = "crucible.distributed.pipeline.pods"


def stage_name(name: str, *, replica: int, stage: int) -> str:
    """The Job and pod hostname of stage `stage` of replica `replica`."""
    return f"{name}-r{replica}-s{stage}"


def links_service(name: str) -> str:
    return f"{name}-links"


def _defaults(args: argparse.Namespace) -> None:
    for key, value in (("micro_batches", 1), ("link_timeout", 120.0), ("link_mbps", 0.0),
                       ("link_latency_ms", 0.0), ("link_port", 5555), ("stage_cpu", "1"),
                       ("stage_memory", "2Gi")):
        if getattr(args, key) is None:
            setattr(args, key, value)


def _check(args: argparse.Namespace) -> tuple[Config, FaultPlan, Shaping]:
    """The run's config, fault plan and link shaping; ConfigError naming the option (or the
    config key) and the fix for bad input."""
    from crucible.distributed.launch import check_recovery
    from crucible.distributed.pipeline.stage_model import check_pipeline

    _defaults(args)
    if args.kill or args.kill_forever:
        raise ConfigError("--kill and --kill-forever kill whole replicas; with --pipeline the "
                          "fault plan's stage failures are the kills (set faults.p and "
                          "faults.strategy)")
    if args.gpus:
        raise ConfigError(f"--gpus {args.gpus}: the pipeline mode runs its stages on the CPU; "
                          "drop --gpus (size the pods with --stage-cpu and --stage-memory)")
    config = run_config(args, pods="R x S pods, one per stage of every replica")
    if not args.store:
        raise ConfigError("--store is required with --pipeline: every stage-replica runs in a "
                          "pod of its own, so pass an S3 URL every pod reaches, e.g. --store "
                          "s3://crucible/pipe (--endpoint-url for MinIO)")
    if not 1 <= args.link_port <= 65535:
        raise ConfigError(f"--link-port must be a TCP port in 1..65535, got {args.link_port}")
    for flag, value in (("--stage-cpu", args.stage_cpu), ("--stage-memory", args.stage_memory)):
        if not _QUANTITY.fullmatch(value):
            raise ConfigError(f"{flag} {value!r}: pass a Kubernetes quantity, e.g. 500m or 2 "
                              "(CPU), 2Gi or 1500Mi (memory)")
    if not args.link_timeout > 0:
        raise ConfigError(f"--link-timeout must be > 0 seconds, got {args.link_timeout}")
    check_recovery(restarts=args.restarts, lease_s=args.lease_s)
    shaping = Shaping(args.link_mbps, args.link_latency_ms)
    check_pipeline(config, micro_batches=args.micro_batches)
    R, S = config.replicas, config.pipeline.stages
    plan = plan_for(config.faults, seed=config.seed, replicas=R, stages=S,
                    horizon=config.train.global_steps)
    plan.validate(replicas=R, stages=S)
    return config, plan, shaping


def render_pipeline(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The Kubernetes objects of the pipeline run `args` describes (ConfigError for bad
    input)."""
    config, plan, shaping = _check(args)
    R, S = config.replicas, config.pipeline.stages
    port = args.link_port
    keys = [(r, s) for r in range(R) for s in range(S)]
    service = links_service(args.name)
    addresses = {f"{r},{s}": f"tcp://{stage_name(args.name, replica=r, stage=s)}.{service}:"
                             f"{port}" for r, s in keys}
    ident = run_identity(config, plan=plan, addresses=addresses, store_url=config.store.url,
                         micro_batches=args.micro_batches, link_timeout_s=args.link_timeout,
                         restarts=args.restarts, shaping=shaping, run_key=args.run_key,
                         binds={f"{r},{s}": f"tcp://0.0.0.0:{port}" for r, s in keys})
    labels = run_labels(args)
    stages = labels | {"crucible.io/role": "stage"}
    claim = args.claim or f"{args.name}-run"
    objects = run_objects(args, ident, labels)
    objects.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service, "labels": labels},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": stages,
                 "ports": [{"name": "link", "port": port, "targetPort": "link",
                            "protocol": "TCP"}]}})
    objects.append({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": service, "labels": labels},
        "spec": {"podSelector": {"matchLabels": stages}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": stages}}],
                              "ports": [{"protocol": "TCP", "port": port}]}]}})
    for r, s in keys:
        objects.append(_stage_job(args, stages, claim, replica=r, stage=s,
                                  lives=ident["lives"][f"{r},{s}"]))
    objects.append(_merge_job(args, labels, claim))
    return objects


def _stage_job(args: argparse.Namespace, stages: dict[str, str], claim: str, *, replica: int,
               stage: int, lives: int) -> dict[str, Any]:
    name = stage_name(args.name, replica=replica, stage=stage)
    mine = stages | {"crucible.io/replica": str(replica), "crucible.io/stage": str(stage)}
    container: dict[str, Any] = {
        "name": "stage", "image": args.image,
        "command": ["python", "-m", _MODULE, "supervise", "--run-dir", RUN_DIR,
                    "--replica", str(replica), "--stage", str(stage)],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, *store_env(args)],
        "ports": [{"name": "link", "containerPort": args.link_port, "protocol": "TCP"}],
        # ready: the stage process's inbox is bound (an operator's signal; DNS does not wait
        # for it). No liveness probe: a stage waiting on a peer or the store is not dead, the
        # link timeout is the pipeline's own deadline, and a probe's restart would end the
        # supervisor too, outside the lives' count
        "readinessProbe": {"tcpSocket": {"port": "link"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": args.stage_cpu, "memory": args.stage_memory},
                      "limits": {"memory": args.stage_memory}},
        "volumeMounts": mounts()}
    pod: dict[str, Any] = {
        "hostname": name, "subdomain": links_service(args.name),
        "restartPolicy": "Never",
        # the supervisor must not be PID 1: its stage process stops when its parent is PID 1
        "shareProcessNamespace": True,
        "initContainers": [run_spec_copy(args, container["volumeMounts"], name)],
        "containers": [container],
        "volumes": volumes(args, claim),
        # stages on different hosts where the cluster can
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": stages}}}]}}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": mine},
            # a pod per life, and one more to report the last life lost with its pod
            "spec": {"backoffLimit": lives, "podReplacementPolicy": "Failed",
                     "podFailurePolicy": {"rules": [{
                         "action": "FailJob",
                         "onExitCodes": {"containerName": "stage", "operator": "In",
                                         "values": [1]}}]},
                     "template": {"metadata": {"labels": mine}, "spec": pod}}}


def _merge_job(args: argparse.Namespace, labels: dict[str, str], claim: str) -> dict[str, Any]:
    return merge_job(args, labels, claim, {
        "name": "merge", "image": args.image,
        "command": ["python", "-m", _MODULE, "merge", "--run-dir", RUN_DIR, "--grace-s",
                    f"{args.merge_grace_s:g}"],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, *store_env(args)],
        "volumeMounts": mounts()})
