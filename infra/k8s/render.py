"""Render a distributed run on N GPU hosts as Kubernetes objects (NOT RUN here: no cluster, no
GPUs; only the rendering is tested, tests/unit/test_k8s_render.py). With `--pipeline`, the
pipeline mode's pod-per-stage layout instead: infra/k8s/pipeline.py says what it renders.

    python -m infra.k8s.render --replicas 4 --image registry.example.com/crucible:gpu \\
        --store s3://crucible/dist --endpoint-url http://minio.crucible:9000 \\
        [--preset smoke] [--set key=value ...] [--kill R@STEP ...] [--kill-forever R@STEP ...] \\
        [--restarts N] [--lease-s S] [--name NAME] [--storage-class CLASS] > run.yaml
    kubectl apply -f run.yaml

What it renders, and why (the same layout `crucible.distributed.launch.launch` makes on one host):

- ConfigMap `NAME-run`: `run.json` (config, run key, store URL, kill plan, lives per replica,
  heartbeat lease), the file every worker
  reads from its run folder. Rendered here, once, so every pod sees the same run key.
- PersistentVolumeClaim `NAME-run` (ReadWriteMany): the run folder shared by every pod. The worker
  writes `replicas/replica-r/` there and `launch.merge` reads all replica folders from one
  filesystem, so the pods need a shared volume (NFS, EFS, Filestore, CephFS); `--claim` reuses one.
- One Job per replica, `NAME-replica-r` (one pod, one GPU: `nvidia.com/gpu`), running the
  replica's elastic agent exactly as `launch.agent_command` builds it (`python -m
  torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 --max-restarts K ... -m
  crucible.distributed.worker --run-dir /crucible/run --replica r`), K = the replica's restart
  budget (`--restarts`, default 3, for unplanned deaths) plus its planned `--kill`s, as `launch`
  gives it. A dead worker is restarted by the agent inside the pod (`restartPolicy: Never`); a
  pod lost as a whole (its node, an eviction) is replaced by the Job (`backoffLimit: K`): the
  worker counts its lives in the shared folder, so the new pod's worker rejoins, and one past
  the budget exits without training. One Job per replica (not one indexed Job) because K
  differs per replica, and a replica that never comes back must not fail the others. A
  wrapper writes the agent's exit code to `replicas/replica-r/exit-code`.
- Job `NAME-merge`: waits for every replica's `exit-code` (once one replica is done, at most
  `--merge-grace-s` for the others: a replica whose pods were all lost is merged as lost), then
  runs `launch.merge` on the shared
  folder (`summary.json`, `events.jsonl`, `metrics.jsonl`, `process.jsonl`, `model.pt`); prints
  the replicas that never came back (`lost`) and exits 1 only when no replica finished (as
  `launch`).

The store: `--store s3://bucket/prefix` (+ `--endpoint-url` for MinIO) goes into the config as
`store.url` / `store.endpoint_url`; credentials come from the Secret `--s3-secret` (keys
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) as environment variables. Required for more than one
replica (one host each). Exit 2 with a message naming the option for bad input.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from crucible.config import Config, ConfigError, apply_overrides
from crucible.distributed.liveness import add_recovery_arguments

__all__ = ["MERGE_SCRIPT", "PIPELINE_OPTIONS", "RUN_DIR", "render", "main", "merge_job",
           "mounts", "run_config", "run_labels", "run_objects", "run_spec_copy", "store_env",
           "volumes"]

RUN_DIR = "/crucible/run"
_SPEC_DIR = "/crucible/spec"
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")

# the pipeline layout's own options (infra/k8s/pipeline.py; refused without --pipeline)
PIPELINE_OPTIONS = (
    ("--micro-batches", int, "M", "micro-batches per inner step, fill-drain (default 1)"),
    ("--link-timeout", float, "SECONDS",
     "how long a stage waits for a message before it fails (default 120)"),
    ("--link-mbps", float, "MBIT_S", "every link's bandwidth, shaped in the sender (default 0: "
                                     "no limit)"),
    ("--link-latency-ms", float, "MS", "every link's latency, in the sender (default 0)"),
    ("--link-port", int, "PORT", "the port every stage pod's link binds and is reached on "
                                 "(default 5555)"),
    ("--stage-cpu", str, "CPU", "CPU request of each stage pod (default 1: a stage process "
                                "runs one torch thread)"),
    ("--stage-memory", str, "BYTES", "memory request and limit of each stage pod (default "
                                     "2Gi)"),
)

# The merge step (argv[1]: the run folder): `launch.merge` with the agents' recorded exit codes.
MERGE_SCRIPT = """\
import json, sys, time
from pathlib import Path
from crucible.config import Config
from crucible.distributed.launch import merge
out = Path(sys.argv[1])
ident = json.loads((out / "run.json").read_text())
config = Config.from_dict(ident["config"])
codes = [int((out / "replicas" / f"replica-{r}" / "exit-code").read_text())
         for r in range(config.replicas)]
summary = merge(out, config, kills=ident["kills"], exit_codes=codes,
                wall_s=time.time() - (out / "run.json").stat().st_mtime)
lost = summary["distributed"]["lost"]
keys = ("final_val_loss", "global_steps", "tokens_processed", "contributions")
print(json.dumps({k: summary[k] for k in keys} | {"lost": lost}))
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the scripts) as YAML block literals, no anchors: readable run.yaml."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infra.k8s.render",
                                description="Render a distributed run as Kubernetes objects.")
    p.add_argument("--replicas", type=int, required=True, help="replicas: one pod (host) each")
    p.add_argument("--image", required=True, help="the Crucible image (infra/Dockerfile, CUDA)")
    p.add_argument("--store", help="s3://bucket/prefix the replicas exchange contributions "
                                   "through (required for --replicas > 1)")
    p.add_argument("--endpoint-url", help="S3 endpoint, e.g. http://minio:9000 (MinIO)")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--s3-secret", default="crucible-s3",
                   help="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    p.add_argument("--preset", default="smoke", help="a preset name (`crucible presets`)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable)")
    p.add_argument("--kill", action="append", default=[], metavar="R@STEP",
                   help="SIGKILL replica R at global step STEP; its agent restarts it")
    p.add_argument("--kill-forever", action="append", default=[], metavar="R@STEP",
                   help="as --kill, without a restart")
    p.add_argument("--name", default="crucible-dist",
                   help="prefix of the objects' names (lowercase letters, digits, '-')")
    p.add_argument("--run-key", help="the run's key in the store (default: a new one)")
    p.add_argument("--gpus", type=int, help="GPUs per replica pod (default 1; 0: CPU nodes)")
    p.add_argument("--claim", help="an existing ReadWriteMany claim for the run folder "
                                   "(default: render one)")
    p.add_argument("--storage-class", help="storage class of the rendered ReadWriteMany claim")
    p.add_argument("--volume-size", default="20Gi", help="size of the rendered claim")
    add_recovery_arguments(p)
    p.add_argument("--merge-grace-s", type=float, default=1800.0,
                   help="once one replica is done, how long the merge waits for the others "
                        "before it merges the missing ones as lost")
    p.add_argument("--start-timeout-s", type=float, default=900.0,
                   help="how long replicas wait for each other at the start (image pulls)")
    pipe = p.add_argument_group("pipeline mode (--pipeline: one pod per stage-replica)")
    pipe.add_argument("--pipeline", action="store_true",
                      help="render the pipeline mode: R x S stage pods (infra/k8s/pipeline.py)")
    for flag, kind, metavar, text in PIPELINE_OPTIONS:
        pipe.add_argument(flag, type=kind, metavar=metavar, help=text)
    return p


def _kills(texts: list[str], *, rejoin: bool) -> list[dict[str, Any]]:
    option = "--kill" if rejoin else "--kill-forever"
    out = []
    for text in texts:
        replica, sep, step = text.partition("@")
        if not sep or not replica.isdigit() or not step.isdigit():
            raise ConfigError(f"{option} {text!r}: expected REPLICA@GLOBAL_STEP, e.g. 1@3")
        out.append({"replica": int(replica), "global_step": int(step), "rejoin": rejoin})
    return out


def run_config(args: argparse.Namespace, *, pods: str) -> Config:
    """The run's config from the preset, the overrides and the store options, once the
    options every layout shares are checked (`pods`: what one pod is, for the messages)."""
    from crucible.presets import get_preset

    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1 ({pods}), got {args.replicas}")
    if args.store and not args.store.startswith("s3://"):
        raise ConfigError(f"--store {args.store!r}: pass s3://bucket/prefix (a file:// store "
                          "is one host's disk)")
    if not _NAME.fullmatch(args.name):
        raise ConfigError(f"--name {args.name!r}: use 1-40 lowercase letters, digits and '-', "
                          "starting with a letter")
    extra = [f"replicas={args.replicas}"]
    extra += [f"store.url={args.store}"] if args.store else []
    extra += [f"store.endpoint_url={args.endpoint_url}"] if args.endpoint_url else []
    extra += [f"store.region={args.region}"] if args.region else []
    try:
        preset = get_preset(args.preset)
    except ConfigError as exc:
        raise ConfigError(f"--preset: {exc}") from exc
    return apply_overrides(preset, [*args.overrides, *extra])


def _check(args: argparse.Namespace) -> tuple[Config, list[dict[str, Any]]]:
    """The run's config and kills; ConfigError naming the option for bad input."""
    from crucible.distributed.launch import check_kills
    from crucible.distributed.worker import check_distributed

    given = [flag for flag, *_ in PIPELINE_OPTIONS
             if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: the pipeline mode's options; add --pipeline")
    if args.replicas > 1 and not args.store:
        raise ConfigError(f"--store is required for --replicas {args.replicas}: each replica "
                          "runs on its own host, so pass an S3 URL every pod reaches, e.g. "
                          "--store s3://crucible/dist (--endpoint-url for MinIO)")
    if args.gpus is None:
        args.gpus = 1
    if args.gpus < 0:
        raise ConfigError(f"--gpus must be >= 0, got {args.gpus}")
    config = run_config(args, pods="one pod per replica")
    check_distributed(config)
    kills = _kills(args.kill, rejoin=True) + _kills(args.kill_forever, rejoin=False)
    check_kills(kills, config)
    return config, kills


def render(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The Kubernetes objects of the run `args` describes (raises ConfigError for bad input)."""
    from crucible.distributed.launch import check_recovery, lives_of

    if args.pipeline:
        from infra.k8s.pipeline import render_pipeline
        return render_pipeline(args)
    config, kills = _check(args)
    check_recovery(restarts=args.restarts, lease_s=args.lease_s)
    lives = lives_of(config, kills, restarts=args.restarts)
    run_key = args.run_key or f"run-{uuid.uuid4().hex[:12]}"
    ident = {"run_key": run_key, "store_url": config.store.url or f"file://{RUN_DIR}/store",
             "config": config.to_dict(), "plan": None, "kills": kills,
             "start_timeout_s": args.start_timeout_s, "lives": lives,
             "lease_s": float(args.lease_s)}
    labels = run_labels(args)
    claim = args.claim or f"{args.name}-run"
    objects = run_objects(args, ident, labels)
    for r in range(config.replicas):
        objects.append(_replica_job(args, labels, claim, r, lives[r] - 1, config))
    objects.append(_merge_job(args, labels, claim, config.replicas))
    return objects


def run_labels(args: argparse.Namespace) -> dict[str, str]:
    return {"app.kubernetes.io/name": "crucible", "crucible.io/run": args.name}


def run_objects(args: argparse.Namespace, ident: dict[str, Any],
                labels: dict[str, str]) -> list[dict[str, Any]]:
    """The ConfigMap holding `run.json` and, unless `--claim` names one, the ReadWriteMany
    claim of the run folder."""
    objects: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{args.name}-run", "labels": labels},
        "data": {"run.json": json.dumps(ident, indent=2, sort_keys=True)}}]
    if not args.claim:
        spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"],
                                "resources": {"requests": {"storage": args.volume_size}}}
        if args.storage_class:
            spec["storageClassName"] = args.storage_class
        objects.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                        "metadata": {"name": f"{args.name}-run", "labels": labels},
                        "spec": spec})
    return objects


def run_spec_copy(args: argparse.Namespace, mounts: list[dict[str, Any]],
                  tag: str) -> dict[str, Any]:
    """The init container that copies `run.json` from the ConfigMap into the shared run
    folder (every pod copies the same file, atomically; `tag` keeps the temporaries apart)."""
    return {"name": "run-spec", "image": args.image,
            "command": ["sh", "-c", f"cp {_SPEC_DIR}/run.json {RUN_DIR}/.run.json.{tag} && "
                                    f"mv {RUN_DIR}/.run.json.{tag} {RUN_DIR}/run.json"],
            "volumeMounts": mounts}


def volumes(args: argparse.Namespace, claim: str) -> list[dict[str, Any]]:
    return [{"name": "run", "persistentVolumeClaim": {"claimName": claim}},
            {"name": "spec", "configMap": {"name": f"{args.name}-run"}}]


def mounts() -> list[dict[str, Any]]:
    """The run folder (the shared claim) and the ConfigMap's `run.json`, in every container."""
    return [{"name": "run", "mountPath": RUN_DIR},
            {"name": "spec", "mountPath": _SPEC_DIR, "readOnly": True}]


def store_env(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not args.store:
        return []
    env = [{"name": key, "valueFrom": {"secretKeyRef": {"name": args.s3_secret, "key": key}}}
           for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    env += [{"name": "CRUCIBLE_STORE_URL", "value": args.store}]
    if args.endpoint_url:
        env.append({"name": "CRUCIBLE_S3_ENDPOINT_URL", "value": args.endpoint_url})
    if args.region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": args.region})
    return env


def _replica_job(args: argparse.Namespace, labels: dict[str, str], claim: str, replica: int,
                 restarts: int, config: Config) -> dict[str, Any]:
    from crucible.distributed.launch import agent_command

    command = ["python", *agent_command(Path(RUN_DIR), replica, max_restarts=restarts)[1:]]
    folder = f"{RUN_DIR}/replicas/replica-{replica}"
    script = (f"mkdir -p {folder}\n"
              f"{' '.join(command)}\n"
              "code=$?\n"
              f"echo $code > {folder}/exit-code\n"
              "exit $code\n")
    mine = labels | {"crucible.io/role": "replica", "crucible.io/replica": str(replica)}
    container: dict[str, Any] = {
        "name": "replica", "image": args.image, "command": ["bash", "-c", script],
        "env": [{"name": "CRUCIBLE_REPLICA", "value": str(replica)},
                {"name": "PYTHONUNBUFFERED", "value": "1"}, *store_env(args)],
        "volumeMounts": mounts()}
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        # every replica copies the same run.json into the shared folder (atomically)
        "initContainers": [run_spec_copy(args, container["volumeMounts"], str(replica))],
        "containers": [container],
        "volumes": volumes(args, claim),
        # one replica per host where the cluster can
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"crucible.io/run": args.name,
                                                  "crucible.io/role": "replica"}}}}]}}}
    if args.gpus:
        gpus = {"nvidia.com/gpu": args.gpus}
        container["resources"] = {"requests": dict(gpus), "limits": dict(gpus)}
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                               "effect": "NoSchedule"}]
    # a pod lost as a whole (its node, an eviction) is replaced by the Job: its worker counts
    # its lives in the shared folder, so it rejoins, and refuses to start past the budget
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{args.name}-replica-{replica}", "labels": mine},
            "spec": {"backoffLimit": restarts, "template": {"metadata": {"labels": mine},
                                                            "spec": pod}}}


def _merge_job(args: argparse.Namespace, labels: dict[str, str], claim: str,
               replicas: int) -> dict[str, Any]:
    # every replica's exit code, or, once one replica is done, at most --merge-grace-s for the
    # others (a replica whose pods were all lost writes none: it is merged as lost, code 137)
    codes = f"{RUN_DIR}/replicas/replica-$r/exit-code"
    wait = (f"first=\n"
            f"while :; do\n"
            f"  missing=0; done_any=0\n"
            f"  for r in $(seq 0 {replicas - 1}); do\n"
            f"    if [ -f {codes} ]; then done_any=1; else missing=1; fi\n"
            f"  done\n"
            f"  [ $missing = 0 ] && break\n"
            f"  [ $done_any = 1 ] && [ -z \"$first\" ] && first=$(date +%s)\n"
            f"  if [ -n \"$first\" ] && [ $(( $(date +%s) - first )) -ge {args.merge_grace_s:.0f} ]; then\n"
            f"    for r in $(seq 0 {replicas - 1}); do\n"
            f"      [ -f {codes} ] || echo 137 > {codes}\n"
            f"    done\n"
            f"    break\n"
            f"  fi\n"
            f"  sleep 10\n"
            f"done\n")
    return merge_job(args, labels, claim, {
        "name": "merge", "image": args.image,
        "command": ["bash", "-c", wait + f'exec python -c "$MERGE_SCRIPT" {RUN_DIR}\n'],
        "env": [{"name": "MERGE_SCRIPT", "value": MERGE_SCRIPT}, *store_env(args)],
        "volumeMounts": mounts()})


def merge_job(args: argparse.Namespace, labels: dict[str, str], claim: str,
              container: dict[str, Any]) -> dict[str, Any]:
    """The Job `NAME-merge` running `container` once, never retried, on the run folder."""
    mine = labels | {"crucible.io/role": "merge"}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{args.name}-merge", "labels": mine},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": mine}, "spec": {
                "restartPolicy": "Never", "containers": [container],
                "volumes": volumes(args, claim)}}}}


def main(argv: list[str] | None = None) -> int:
    """Print the run's objects as one YAML stream; exit 2 naming the option for bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        objects = render(args)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"# a {'pipeline' if args.pipeline else 'distributed'} run, rendered by `python -m "
          "infra.k8s.render` (NOT RUN in CI: no cluster)")
    print(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=100), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
