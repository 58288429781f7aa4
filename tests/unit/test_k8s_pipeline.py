"""The pipeline mode's pod-per-stage layout for Kubernetes (issue 36, item 6): `python -m
infra.k8s.render --pipeline`. Rendered and checked structurally here; NOT RUN on a cluster (none
here). What the pods run is run for real in tests/integration/test_pipeline_pods.py."""
from __future__ import annotations

import json
from pathlib import Path

import zmq

from crucible.config import apply_overrides
from crucible.distributed.pipeline.launch import free_ports
from crucible.presets import get_preset


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
        assert worker.inbox.socket.getsockopt(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}".encode()
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
