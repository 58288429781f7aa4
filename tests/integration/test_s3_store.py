"""S3Store against moto's standalone server over real HTTP: the same contract as LocalStore,
identical bytes, transient errors classified and retried, and the same agreed set and aggregate
through either store."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import boto3
import pytest
import torch

from crucible.gather import agree, load_agreed, upload_contribution
from crucible.sparseloco import (
    aggregate,
    contribution_bytes,
    decode_contribution,
    encode_contribution,
    run_tag,
)
from crucible.store import (
    LocalStore,
    S3Store,
    StoreError,
    TransientStoreError,
    open_store,
)
from tests.unit.test_store import (
    EXPECTED_TRACE,
    SIZE_TRACE,
    refused_read_peak,
    size_limit_trace,
    store_contract_trace,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("prefix", ["", "team/crucible"])
def test_s3_store_follows_the_same_contract(s3_endpoint: str, s3_bucket: str,
                                            prefix: str) -> None:
    store = S3Store(s3_bucket, prefix, endpoint_url=s3_endpoint, region="us-east-1")
    assert store_contract_trace(store) == EXPECTED_TRACE


def test_s3_store_sizes_and_bounded_reads(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, "p", endpoint_url=s3_endpoint, region="us-east-1")
    assert size_limit_trace(store) == SIZE_TRACE


def test_a_bounded_s3_read_refuses_a_huge_object_from_its_headers(s3_endpoint: str,
                                                                  s3_bucket: str) -> None:
    """The GET's Content-Length says 32 MiB: refused before the body is read."""
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint, region="us-east-1")
    store.put("big", bytes(32 << 20))
    assert store.exists("big")  # the client's lazy set-up happens before the measurement
    assert refused_read_peak(store, "big", 32 << 20) < 4 << 20


def test_gather_refuses_an_oversized_s3_object_without_reading_it(s3_endpoint: str,
                                                                  s3_bucket: str) -> None:
    class Reads(S3Store):
        read: list[str] = []

        def get(self, key: str, **kwargs: object) -> bytes:
            self.read.append(key)
            return super().get(key, **kwargs)

    shapes = {"w": (128, 64), "b": (64,)}
    store = Reads(s3_bucket, "runs", endpoint_url=s3_endpoint, region="us-east-1")
    blob = encode_contribution({n: torch.ones(s) for n, s in shapes.items()}, {}, beta=0.95,
                               stage=1, replica=0, global_step=3, run_tag=run_tag("exp"))[0]
    upload_contribution(store, "exp", 3, 1, 0, blob)
    upload_contribution(store, "exp", 3, 1, 1, bytes(8 << 20))    # junk, 8 MiB
    manifest = agree(store, "exp", 3, 1, expected_replicas=2, max_blob_bytes=len(blob),
                     decode=lambda b: decode_contribution(b, shapes, stage=1))
    assert manifest.included == [0] and "not read" in manifest.rejected[0].reason
    assert "exp/00000003/stage-1/replica-1" not in store.read
    assert len(blob) == contribution_bytes(shapes)


def test_prefix_keeps_keys_under_it(s3_endpoint: str, s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/exp/one", endpoint_url=s3_endpoint)
    store.put("k/v", b"data")
    raw = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=s3_bucket)
    assert [o["Key"] for o in raw["Contents"]] == ["exp/one/k/v"]
    assert store.list() == ["k/v"]


def test_local_and_s3_hold_identical_bytes(s3_endpoint: str, s3_bucket: str,
                                           tmp_path: Path) -> None:
    stores = [LocalStore(tmp_path), S3Store(s3_bucket, "p", endpoint_url=s3_endpoint)]
    blob, _ = encode_contribution({"w": torch.randn(192, 64)}, {}, beta=0.95, stage=0,
                                  replica=0, global_step=0)
    for store in stores:
        upload_contribution(store, "run", 0, 0, 0, blob)
    local, remote = (s.get("run/00000000/stage-0/replica-0") for s in stores)
    assert local == remote == blob


def test_unreachable_endpoint_is_transient_after_retries() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: connection refused
    store = S3Store("bucket", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1",
                    attempts=2, backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(TransientStoreError, match="get 'k'"):
        store.get("k")
    assert time.monotonic() - start < 60


def test_one_retry_layer_an_outage_costs_exactly_the_stores_attempts() -> None:
    """A server that answers every request 503 SlowDown: the store's own loop is the only
    retry layer, so `attempts` = 3 means 3 requests (botocore's retries on top would make 9)."""
    import http.server
    import threading

    hits: list[str] = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            hits.append(self.command)
            body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    b"<Message>busy</Message></Error>")
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = S3Store("bucket", endpoint_url=f"http://127.0.0.1:{server.server_port}",
                        region="us-east-1", attempts=3, backoff_s=0.01)
        with pytest.raises(TransientStoreError, match="SlowDown"):
            store.get("k")
    finally:
        server.shutdown()
        server.server_close()
    assert hits == ["GET"] * 3


def test_missing_bucket_is_a_permanent_store_error(s3_endpoint: str) -> None:
    store = S3Store("no-such-bucket-here", endpoint_url=s3_endpoint, attempts=3, backoff_s=0.01)
    with pytest.raises(StoreError) as info:
        store.put("k", b"v")
    assert not isinstance(info.value, TransientStoreError)
    assert "NoSuchBucket" in str(info.value)


def test_gather_through_s3_matches_gather_through_a_directory(s3_endpoint: str, s3_bucket: str,
                                                              tmp_path: Path) -> None:
    shapes = {"w": (128, 64), "b": (64,)}
    gen = torch.Generator().manual_seed(2)
    blobs = [encode_contribution({n: torch.randn(s, generator=gen) for n, s in shapes.items()},
                                 {}, beta=0.95, stage=1, replica=r, global_step=3,
                                 run_tag=run_tag("exp"))[0]
             for r in range(4)]
    blobs[2] = blobs[2][:-9]  # one truncated upload

    def decode(blob: bytes):
        return decode_contribution(blob, shapes, stage=1)

    results = []
    for store in (LocalStore(tmp_path), S3Store(s3_bucket, "runs", endpoint_url=s3_endpoint)):
        for replica in (0, 1, 2, 3):
            upload_contribution(store, "exp", 3, 1, replica, blobs[replica])
        manifest = agree(store, "exp", 3, 1, expected_replicas=5, decode=decode,
                         max_blob_bytes=contribution_bytes(shapes))
        agg = aggregate(load_agreed(store, manifest, decode), shapes)
        results.append((manifest.to_json(), agg,
                        store.get("exp/00000003/stage-1/manifest.json")))
    (local_json, local_agg, local_obj), (s3_json, s3_agg, s3_obj) = results
    assert local_json == s3_json == local_obj == s3_obj
    for n in shapes:
        assert torch.equal(local_agg[n], s3_agg[n])
