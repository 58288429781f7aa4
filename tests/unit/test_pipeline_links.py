"""The pipeline mode's links: tensors between processes over ZeroMQ, every message checked before
use. Real sockets on loopback (two ends in this process); a malformed or hostile message is
refused and counted, and the link goes on to deliver the valid one behind it."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zmq

from crucible.config import ConfigError, apply_overrides
from crucible.distributed.pipeline.launch import free_ports, stage_command
from crucible.distributed.pipeline.links import (
    Expect,
    Inbox,
    LinkCounters,
    LinkTimeout,
    Outbox,
    dense,
    ids_dtype,
)
from crucible.distributed.pipeline.stage_model import check_pipeline
from crucible.presets import get_preset

SHAPE = (1, 2, 4, 8)


@pytest.fixture()
def ends():
    context = zmq.Context()
    (port,) = free_ports(1)
    address = f"tcp://127.0.0.1:{port}"
    inbox_counters, outbox_counters = LinkCounters(), LinkCounters()
    inbox = Inbox(context, address, inbox_counters, max_bytes=4 * 64 + 64)
    outbox = Outbox(context, (0, 1), outbox_counters)
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    yield inbox, outbox, raw, address, inbox_counters, outbox_counters
    raw.close()
    outbox.close()
    inbox.close()
    context.term()


EXPECT = {"message": Expect(torch.float32, SHAPE)}


def _raw(raw, header: dict, *frames: bytes) -> None:
    raw.send_multipart([json.dumps(header).encode(), *frames])


def _header(**changes):
    header = {"kind": "act", "src": [0, 1], "g": 0, "h": 0, "m": 0, "owner": 0, "v": 0,
              "tensors": [{"name": "message", "dtype": "float32", "shape": list(SHAPE),
                           "stride": [64, 32, 8, 1]}]}
    header.update(changes)
    return header


def test_a_tensor_crosses_with_its_values_and_layout(ends) -> None:
    inbox, outbox, _raw_sock, address, counters, sent = ends
    value = torch.randn(1, 2, 8, 4).transpose(2, 3)            # a non-contiguous layout
    assert value.shape == SHAPE and not value.is_contiguous()
    size = outbox.send(address, "act", g=3, h=1, m=0, owner=0, tensors={"message": value})
    got = inbox.receive("act", (0, 1), g=3, h=1, m=0, owner=0, expect=EXPECT, timeout_s=5)
    assert torch.equal(got.tensors["message"], value)
    assert got.tensors["message"].stride() == value.stride()   # the layout travels too
    assert sent.sent_bytes["act"] == size and size > value.numel() * 4
    assert counters.received_bytes["act"] > 0 and not counters.refused


def test_messages_arrive_in_any_order_and_are_matched_by_key(ends) -> None:
    inbox, outbox, _raw_sock, address, _counters, _sent = ends
    for m in (1, 0):
        outbox.send(address, "act", g=0, h=0, m=m, owner=0,
                    tensors={"message": torch.full(SHAPE, float(m))})
    first = inbox.receive("act", (0, 1), g=0, h=0, m=0, owner=0, expect=EXPECT, timeout_s=5)
    second = inbox.receive("act", (0, 1), g=0, h=0, m=1, owner=0, expect=EXPECT, timeout_s=5)
    assert float(first.tensors["message"][0, 0, 0, 0]) == 0.0
    assert float(second.tensors["message"][0, 0, 0, 0]) == 1.0


@pytest.mark.parametrize("bad, reason", [
    ((b"not json",), "unknown"),
    ((json.dumps({"kind": "evil", "src": [0, 1], "g": 0, "h": 0, "m": 0, "owner": 0, "v": 0,
                  "tensors": []}).encode(),), "unknown"),
])
def test_a_header_that_does_not_parse_is_refused(ends, bad, reason) -> None:
    inbox, outbox, raw, address, counters, _sent = ends
    raw.send_multipart(list(bad))
    with pytest.raises(LinkTimeout):      # read, refused, and nothing valid behind it yet
        inbox.receive("act", (0, 1), g=0, h=0, m=0, owner=0, expect=EXPECT, timeout_s=0.5)
    outbox.send(address, "act", g=0, h=0, m=0, owner=0, tensors={"message": torch.ones(SHAPE)})
    got = inbox.receive("act", (0, 1), g=0, h=0, m=0, owner=0, expect=EXPECT, timeout_s=5)
    assert torch.equal(got.tensors["message"], torch.ones(SHAPE))
    assert counters.refused[reason] == 1


@pytest.mark.parametrize("case", ["shape", "dtype", "bytes", "nan", "stride", "oversize", "name"])
def test_a_malformed_tensor_is_refused_and_the_valid_one_behind_it_is_used(ends, case) -> None:
    inbox, outbox, raw, address, counters, _sent = ends
    good = np.ones(SHAPE, dtype=np.float32)
    header, frame = _header(), good.tobytes()
    if case == "shape":
        header["tensors"][0]["shape"] = [1, 2, 4, 9]
    elif case == "dtype":
        header["tensors"][0]["dtype"] = "int64"
    elif case == "bytes":
        frame = frame[:-4]
    elif case == "nan":
        bad = good.copy()
        bad[0, 0, 0, 0] = np.nan
        frame = bad.tobytes()
    elif case == "stride":
        header["tensors"][0]["stride"] = [0, 0, 0, 0]        # overlapping: not a dense layout
    elif case == "oversize":
        frame = frame * 2
        header["tensors"][0]["shape"] = [1, 2, 8, 8]
    elif case == "name":
        header["tensors"][0]["name"] = "other"
    _raw(raw, header, frame)
    with pytest.raises(LinkTimeout):
        inbox.receive("act", (0, 1), g=0, h=0, m=0, owner=0, expect=EXPECT, timeout_s=0.5)
    assert counters.refused["act"] == 1
    outbox.send(address, "act", g=0, h=0, m=0, owner=0, tensors={"message": torch.ones(SHAPE)})
    got = inbox.receive("act", (0, 1), g=0, h=0, m=0, owner=0, expect=EXPECT, timeout_s=5)
    assert torch.equal(got.tensors["message"], torch.ones(SHAPE))


def test_token_ids_outside_the_vocabulary_are_refused(ends) -> None:
    inbox, outbox, _raw_sock, address, counters, _sent = ends
    expect = {"ids": Expect(torch.int16, (1, 2, 4), below=300)}
    outbox.send(address, "act", g=0, h=0, m=0, owner=0,
                tensors={"ids": torch.full((1, 2, 4), 300, dtype=torch.int16)})
    with pytest.raises(LinkTimeout):
        inbox.receive("act", (0, 1), g=0, h=0, m=0, owner=0, expect=expect, timeout_s=0.5)
    assert counters.refused["act"] == 1


def test_dense_layouts() -> None:
    assert dense((2, 3), (3, 1)) and dense((2, 3), (1, 2)) and dense((1, 4, 8), (512, 1, 4))
    assert not dense((2, 3), (0, 1)) and not dense((2, 3), (4, 1)) and not dense((2,), (-1,))
    assert ids_dtype(256) == torch.uint8 and ids_dtype(20000) == torch.int16
    assert ids_dtype(50257) == torch.int32


def test_an_operator_tells_the_stage_processes_apart() -> None:
    command = stage_command(__import__("pathlib").Path("/runs/x"), 1, 2)
    assert command[-4:] == ["--replica", "1", "--stage", "2"]
    assert "crucible.distributed.pipeline.stage" in command


@pytest.mark.parametrize("overrides, micro, key", [
    (["faults.p=0.1", "faults.strategy=drop_extend"], 1, "drop_extend"),
    (["sparseloco.method=diloco"], 1, "sparseloco.method"),
    (["pipeline.compression=mapl", "faults.p=0.1", "faults.strategy=skip",
      "pipeline.bypass_decode=identity"], 1, "bypass_decode"),
    (["store.keep_rounds=2"], 1, "store.keep_rounds"),
    ([], 3, "--micro-batches"),
    (["train.device=cuda"], 1, "train.device"),
])
def test_what_the_pipeline_mode_cannot_run_is_refused_by_name(overrides, micro, key) -> None:
    config = apply_overrides(get_preset("smoke"), overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_pipeline(config, micro_batches=micro)


def test_a_shaped_link_holds_each_message_for_its_latency_and_bytes(ends) -> None:
    from crucible.distributed.pipeline.links import Shaping

    shaping = Shaping(mbps=8.0, latency_ms=20.0)          # 1 byte per microsecond
    assert shaping.seconds(1000) == pytest.approx(0.020 + 0.001)
    assert Shaping().seconds(10**9) == 0.0 and not Shaping().active
    assert shaping.to_dict() == {"method": "sender rate limiter", "mbps": 8.0,
                                 "latency_ms": 20.0}
    inbox, _outbox, _raw, address, _counters, _sent = ends
    counters = LinkCounters()
    outbox = Outbox(zmq.Context.instance(), (0, 1), counters, shaping)
    size = outbox.send(address, "act", g=0, h=0, m=0, owner=0,
                       tensors={"message": torch.ones(SHAPE)})
    outbox.close()
    assert counters.shaped_s >= shaping.seconds(size) * 0.99
    assert inbox.receive("act", (0, 1), g=0, h=0, m=0, owner=0, expect=EXPECT, timeout_s=5)


@pytest.mark.parametrize("argv, needle", [
    (["--pipeline", "--link-mbps", "-3"], "--link-mbps"),
    (["--pipeline", "--link-latency-ms", "-1"], "--link-latency-ms"),
    (["--link-mbps", "5"], "add --pipeline"),
    (["--pipeline", "--kill", "0@1"], "--kill"),
])
def test_bad_pipeline_options_exit_2_naming_the_option(argv, needle, tmp_path, capsys) -> None:
    from cli.launch import launch_main

    code = launch_main(["--nproc", "2", "--out", str(tmp_path / "run"), *argv])
    assert code == 2
    assert needle in capsys.readouterr().err
