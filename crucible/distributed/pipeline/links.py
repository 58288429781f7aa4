"""The links of a pipeline run: tensors between stage processes over ZeroMQ, checked on arrival.

Every stage process binds one PULL socket (its inbox, `tcp://127.0.0.1:PORT` unless the run
binds elsewhere) and connects a PUSH socket to each peer it sends to, when it first sends
(ZeroMQ queues what is sent to a peer that is not up yet and reconnects to one that comes
back). A message is a multipart ZeroMQ message: one JSON header frame, then one frame per tensor
(its raw bytes):

    {"kind": "act", "src": [r, s], "g": 3, "h": 0, "m": 1, "owner": r,
     "tensors": [{"name": "message", "dtype": "float32", "shape": [1, 4, 32, 64]}, ...]}

`kind` is `act` (forward: the boundary message, the token ids for a compressed arm, MAPL's
sender basis), `grad` (backward: the gradients of what `act` carried), `norms` (the per-tensor
gradient norms a replica's stages send its first stage for global-norm clipping), `clip` (the
first stage's verdict on an inner step: the clipping factor, or run it again; a sibling's
report of it when the first stage died) or `ctl` (the launcher's notices). Nothing a peer sends is
trusted: `Inbox.receive` refuses (and counts, in `refused`) a message whose header does not
parse, names an unknown kind, carries more bytes than `max_bytes`, or whose tensors differ from
what the receiver expects (name, dtype, shape) or hold a non-finite value; a refused message is
logged and dropped, never raised into the stage.
"""
from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

__all__ = ["KINDS", "LAUNCHER", "dense", "Expect", "Inbox", "Interrupted", "LinkError",
           "LinkTimeout", "Outbox", "Received", "Shaping",
           "ids_dtype", "MAX_HEADER_BYTES"]

log = logging.getLogger(__name__)

KINDS = ("act", "grad", "norms", "clip", "ctl")
LAUNCHER = (-1, -1)   # the `src` of the launcher's control messages
MAX_HEADER_BYTES = 4096
_DTYPES = {"float32": (torch.float32, np.float32), "bfloat16": (torch.bfloat16, None),
           "uint8": (torch.uint8, np.uint8), "int16": (torch.int16, np.int16),
           "int32": (torch.int32, np.int32), "int64": (torch.int64, np.int64)}
_NAMES = {v[0]: k for k, v in _DTYPES.items()}


class LinkError(RuntimeError):
    """A link could not be used (a socket error)."""


class LinkTimeout(LinkError):
    """An awaited message did not arrive before its deadline."""


class Interrupted(LinkError):
    """A control message changed what the awaited message would be (a stage died): the wait
    is abandoned, and the step that waited runs again under the new membership."""


def ids_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer type the link sends token ids in (what `boundary.wire_bytes`
    counts: 1 byte up to 256 tokens, 2 up to 32768 here (torch has no uint16), else 4)."""
    if vocab_size <= 256:
        return torch.uint8
    if vocab_size <= 32768:
        return torch.int16
    return torch.int32


def _small_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and -2**31 <= x < 2**31


def _tensor_meta(meta: object) -> bool:
    """A header's description of one tensor: a name, a dtype name, and a shape and stride as
    short lists of small ints."""
    return (isinstance(meta, dict) and isinstance(meta.get("name"), str)
            and isinstance(meta.get("dtype"), str)
            and all(isinstance(meta.get(k), list) and len(meta[k]) <= 8
                    and all(_small_int(x) for x in meta[k]) for k in ("shape", "stride")))


def dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether `stride` lays `shape` out densely with no overlap (some order of the dims)."""
    if any(x < 0 for x in stride) or len(shape) != len(stride):
        return False
    expected = 1
    for size, step in sorted(((n, st) for n, st in zip(shape, stride, strict=True) if n != 1),
                             key=lambda pair: pair[1]):
        if step != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class Expect:
    """What one tensor of a message must be: its dtype and shape (and, for ids, a bound)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    below: int | None = None      # every value in [0, below) (token ids)


@dataclass
class Received:
    kind: str
    src: tuple[int, int]
    g: int
    h: int
    m: int
    tensors: dict[str, torch.Tensor]
    nbytes: int


@dataclass
class LinkCounters:
    sent_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_payload: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    send_s: float = 0.0
    shaped_s: float = 0.0     # of send_s: the time the link's shaping held messages back
    wait_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"sent_bytes": dict(self.sent_bytes), "sent_payload": dict(self.sent_payload),
                "received_bytes": dict(self.received_bytes),
                "sent": dict(self.sent), "refused": dict(self.refused),
                "send_s": self.send_s, "shaped_s": self.shaped_s, "wait_s": self.wait_s}


@dataclass(frozen=True)
class Shaping:
    """A badly connected link, as a setting: every message between stage processes takes
    `latency_ms` plus its bytes at `mbps` megabits per second before it is handed to the
    socket (the sender waits: with one message in flight per link, as fill-drain with one
    micro-batch has, that is the message's time on the link). `mbps` 0: no limit."""
    mbps: float = 0.0
    latency_ms: float = 0.0
    method: str = "sender rate limiter"

    def __post_init__(self) -> None:
        from crucible.config import ConfigError

        if not (self.mbps >= 0 and self.mbps == self.mbps):
            raise ConfigError(f"--link-mbps must be a number of megabits per second >= 0 (0: "
                              f"no limit), got {self.mbps}")
        if not (self.latency_ms >= 0 and self.latency_ms == self.latency_ms):
            raise ConfigError(f"--link-latency-ms must be >= 0, got {self.latency_ms}")

    @property
    def active(self) -> bool:
        return self.mbps > 0 or self.latency_ms > 0

    def seconds(self, nbytes: int) -> float:
        transfer = nbytes * 8 / (self.mbps * 1e6) if self.mbps > 0 else 0.0
        return self.latency_ms / 1000.0 + transfer

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method if self.active else "none", "mbps": self.mbps,
                "latency_ms": self.latency_ms}


class Outbox:
    """PUSH sockets to the peers, one per address, connected on first use."""

    def __init__(self, context: zmq.Context, me: tuple[int, int],
                 counters: LinkCounters, shaping: Shaping | None = None) -> None:
        self.context, self.me, self.counters = context, me, counters
        self.shaping = shaping or Shaping()
        self.sockets: dict[str, zmq.Socket] = {}
        self.kept: list[tuple[str, list[bytes]]] = []   # this step's messages (`resend`)

    def begin(self) -> None:
        """A new step (or attempt): forget the messages kept for `resend`."""
        self.kept.clear()

    def resend(self, address: str) -> int:
        """Send again what this step sent to `address` (a peer that died after its last
        round and came back: what it had received died with it); returns how many."""
        frames = [f for a, f in self.kept if a == address]
        for message in frames:
            self.sockets[address].send_multipart(message, copy=True)
        return len(frames)

    def send(self, address: str, kind: str, *, g: int, h: int, m: int,
             tensors: Mapping[str, torch.Tensor], owner: int = -1, v: int = 0,
             control: Mapping[str, Any] | None = None) -> int:
        """Send one message; returns its bytes (header and tensor frames). `owner`: the
        replica whose micro-batch it belongs to (rerouted ones cross other replicas' stages;
        -1 for `norms`); `v`: the owner's membership view the message was made under (a
        message of an older view is never used); `control`: a `ctl` message's fields."""
        assert kind in KINDS
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            self.sockets[address] = sock
        frames = []
        meta = []
        for name, t in tensors.items():
            t = t.detach().cpu()
            if not dense(tuple(t.shape), tuple(t.stride())):
                t = t.contiguous()
            meta.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape),
                         "stride": list(t.stride())})
            # the bytes in memory order, and the layout with them: a kernel rounds
            # differently on another layout of the same values (a MAPL basis is column-major)
            flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
            frames.append(memoryview(flat.view(torch.uint8).numpy()) if t.numel() else b"")
        header = json.dumps({"kind": kind, "src": list(self.me), "g": g, "h": h, "m": m,
                             "owner": owner, "v": v, "tensors": meta,
                             **({"control": dict(control)} if control else {})}).encode()
        payload = sum(memoryview(f).nbytes for f in frames)
        started = time.perf_counter()
        if self.shaping.active and kind != "ctl":
            time.sleep(self.shaping.seconds(len(header) + payload))
            self.counters.shaped_s += time.perf_counter() - started
        sock.send_multipart([header, *frames], copy=True)
        self.counters.send_s += time.perf_counter() - started
        if kind != "ctl":
            self.kept.append((address, [header, *(bytes(f) for f in frames)]))
        size = len(header) + payload
        self.counters.sent_bytes[kind] += size
        self.counters.sent_payload[kind] += payload
        self.counters.sent[kind] += 1
        return size

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()


class Inbox:
    """This process's PULL socket and the messages that arrived before they were asked for."""

    def __init__(self, context: zmq.Context, address: str, counters: LinkCounters, *,
                 max_bytes: int,
                 on_control: Callable[[dict[str, Any]], None] | None = None,
                 expect_for: Callable[[dict[str, Any]], Mapping[str, Expect] | None] | None = None,
                 max_waiting: int = 4096, on_poll: Callable[[], None] | None = None) -> None:
        """`on_control`: called with a `ctl` message's `control` fields as it arrives (only
        the launcher's are taken). `expect_for`: what a message with this header must hold
        (None: nothing from that sender of that kind is expected), so that every message is
        checked as it arrives, not only when asked for; at most `max_waiting` checked
        messages wait to be asked for (a peer that floods the link is refused)."""
        self.counters, self.max_bytes, self.on_control = counters, max_bytes, on_control
        self.expect_for, self.max_waiting, self.on_poll = expect_for, max_waiting, on_poll
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_bytes + MAX_HEADER_BYTES)
        self.socket.setsockopt(zmq.RCVHWM, 64)    # per peer: what may queue unread
        self.socket.bind(address)
        self.waiting: dict[tuple[str, tuple[int, int], int, int, int, int, int], list[Any]] = {}

    def close(self) -> None:
        self.socket.close()

    def drain(self, timeout_s: float = 0.0) -> None:
        """Read what has arrived (control messages take effect), waiting up to `timeout_s`
        for a first message."""
        if timeout_s > 0:
            self.socket.poll(int(timeout_s * 1000))
        while self.socket.poll(0):
            self._take(self.socket.recv_multipart(copy=True))

    def receive(self, kind: str, src: tuple[int, int], *, g: int, h: int, m: int,
                expect: Mapping[str, Expect], timeout_s: float, owner: int = -1, v: int = 0,
                valid: Callable[[], bool] | None = None) -> Received:
        """The message `kind` from `src` for (g, h, m) of replica `owner`'s micro-batch under
        view `v`, checked against `expect`; raises LinkTimeout when it has not arrived (valid)
        within `timeout_s`, and Interrupted as soon as `valid()` turns False (a control message
        changed the membership)."""
        key = (kind, tuple(src), g, h, m, owner, v)
        deadline = time.monotonic() + timeout_s
        started = time.perf_counter()
        try:
            while True:
                if self.on_poll is not None:
                    self.on_poll()
                if valid is not None and not valid():
                    raise Interrupted(f"{kind} from {src} for step {g}.{h} no longer awaited")
                frames = self.waiting.pop(key, None)
                if frames is not None:
                    checked = frames[1] if frames[0] is None else self._check(frames, expect)
                    if checked is not None:
                        return checked
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LinkTimeout(f"no valid {kind} message from stage-replica {src} for "
                                      f"global step {g}, inner step {h}, micro-batch {m} "
                                      f"within {timeout_s:.1f} s")
                if not self.socket.poll(int(min(left, 0.5) * 1000) + 1):
                    continue
                self._take(self.socket.recv_multipart(copy=True))
        finally:
            self.counters.wait_s += time.perf_counter() - started

    def _take(self, frames: list[bytes]) -> None:
        header = self._header(frames)
        if header is None:
            return
        if header["kind"] == "ctl":
            if tuple(header["src"]) != LAUNCHER or not isinstance(header.get("control"), dict):
                self._refuse("ctl", "a control message without the launcher's source")
                return
            if self.on_control is not None:
                try:
                    self.on_control(header["control"])
                except (KeyError, TypeError, ValueError, OverflowError) as exc:
                    self._refuse("ctl", f"a control message that does not parse: {exc}")
            return
        got = (header["kind"], (int(header["src"][0]), int(header["src"][1])),
               int(header["g"]), int(header["h"]), int(header["m"]), int(header["owner"]),
               int(header["v"]))
        if got in self.waiting:
            self._refuse(header["kind"], f"a second message for {got}")
            return
        if len(self.waiting) >= self.max_waiting:
            self._refuse(header["kind"], f"{len(self.waiting)} messages wait already")
            return
        if self.expect_for is None:
            self.waiting[got] = [header, frames[1:]]
            return
        expect = self.expect_for(header)
        if expect is None:
            self._refuse(header["kind"], f"nothing of this kind is expected from {got[1]}")
            return
        checked = self._check([header, frames[1:]], expect)
        if checked is not None:
            self.waiting[got] = [None, checked]

    def take(self, kind: str, src: tuple[int, int], *, g: int, h: int, m: int, owner: int,
             v: int, expect: Mapping[str, Expect]) -> Received | None:
        """The message if it has arrived (and is valid), without waiting."""
        self.drain()
        frames = self.waiting.pop((kind, tuple(src), g, h, m, owner, v), None)
        if frames is None:
            return None
        return frames[1] if frames[0] is None else self._check(frames, expect)

    def prune(self, g: int) -> int:
        """Drop the stored messages of rounds before `g` (never asked for now)."""
        stale = [k for k in self.waiting if k[2] < g]
        for key in stale:
            del self.waiting[key]
        return len(stale)

    def forget(self, owner: int, *, g: int, h: int, below: int) -> int:
        """Drop the stored messages of `owner`'s inner step (g, h) made in an attempt before
        `below` (they will never be asked for); returns how many."""
        stale = [k for k in self.waiting
                 if k[5] == owner and k[2] == g and k[3] == h and k[6] < below]
        for key in stale:
            del self.waiting[key]
        return len(stale)

    def _refuse(self, kind: str, why: str) -> None:
        self.counters.refused[kind if kind in KINDS else "unknown"] += 1
        log.warning("refused a link message (%s): %s", kind, why)

    def _header(self, frames: list[bytes]) -> dict[str, Any] | None:
        if not frames or len(frames[0]) > MAX_HEADER_BYTES:
            self._refuse("unknown", "no header, or a header over the size limit")
            return None
        try:
            header = json.loads(frames[0])
            if (not isinstance(header, dict) or header.get("kind") not in KINDS
                    or not isinstance(header.get("tensors"), list)
                    or len(header["tensors"]) != len(frames) - 1
                    or not all(_small_int(header.get(k)) for k in ("g", "h", "m", "owner", "v"))
                    or not isinstance(header.get("src"), list) or len(header["src"]) != 2
                    or not all(_small_int(x) for x in header["src"])
                    or not all(_tensor_meta(t) for t in header["tensors"])
                    or ("control" in header and not isinstance(header["control"], dict))):
                raise ValueError("fields missing or of the wrong type")
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            self._refuse("unknown", f"bad header: {type(exc).__name__}: {exc}"[:200])
            return None
        return header

    def _check(self, stored: list[Any], expect: Mapping[str, Expect]) -> Received | None:
        header, frames = stored
        kind = header["kind"]
        total = sum(len(f) for f in frames)
        if total > self.max_bytes:
            self._refuse(kind, f"{total} bytes, over the link's limit of {self.max_bytes}")
            return None
        tensors: dict[str, torch.Tensor] = {}
        if [t.get("name") for t in header["tensors"]] != list(expect):
            self._refuse(kind, f"tensors {[t.get('name') for t in header['tensors']]}, "
                               f"expected {list(expect)}")
            return None
        for meta, frame in zip(header["tensors"], frames, strict=True):
            want = expect[meta["name"]]
            if meta.get("dtype") not in _DTYPES:
                self._refuse(kind, f"{meta['name']}: unknown dtype {meta.get('dtype')!r}"[:200])
                return None
            if meta.get("dtype") != _NAMES[want.dtype] or tuple(meta.get("shape", ())) != want.shape:
                self._refuse(kind, f"{meta['name']}: {meta.get('dtype')} {meta.get('shape')}, "
                                   f"expected {_NAMES[want.dtype]} {list(want.shape)}")
                return None
            size = int(np.prod(want.shape)) * torch.empty(0, dtype=want.dtype).element_size()
            if len(frame) != size:
                self._refuse(kind, f"{meta['name']}: {len(frame)} bytes for {size}")
                return None
            # into a tensor of torch's own (aligned) allocation: the CPU kernels round
            # differently on a buffer at another alignment, and the arithmetic must be the
            # simulator's
            stride = tuple(meta.get("stride") or ())
            if len(stride) != len(want.shape) or not dense(want.shape, stride):
                self._refuse(kind, f"{meta['name']}: stride {list(stride)} is not a dense "
                                   f"layout of shape {list(want.shape)}")
                return None
            t = torch.empty_strided(want.shape, stride, dtype=want.dtype)
            if size:
                flat = torch.as_strided(t, (t.numel(),), (1,))
                flat.view(torch.uint8).numpy()[:] = np.frombuffer(frame, dtype=np.uint8)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                self._refuse(kind, f"{meta['name']}: non-finite values")
                return None
            if want.below is not None and t.numel() and (int(t.min()) < 0
                                                         or int(t.max()) >= want.below):
                self._refuse(kind, f"{meta['name']}: values outside [0, {want.below})")
                return None
            tensors[meta["name"]] = t
        self.counters.received_bytes[kind] += total + len(json.dumps(header))
        return Received(kind, (header["src"][0], header["src"][1]), header["g"], header["h"],
                        header["m"], tensors, total)
