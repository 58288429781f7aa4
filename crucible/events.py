"""Metrics and events: what a training run reports, and the one callback interface it reports through.

The trainer never talks to files, HTTP or SQL itself; it calls a `Callback`. `JsonlCallback`
writes `metrics.jsonl` / `events.jsonl`; the registry client (`crucible.registry.reporting`) batches the
same records to the API. Event ids are deterministic (kind, global step, replica, stage, ordinal),
so a resumed run that re-emits the events of replayed steps produces the same ids, and an
idempotent sink stores each event exactly once. Metrics are keyed by (name, global_step, replica).

Event kinds: failure_start, then one per down stage-replica and global step saying what was done
about it (bypass: the stage was skipped; drop: the replica's tokens were dropped; reroute: its
micro-batches went through `detail.donor`'s stage), rejoin, contribution_missing,
contribution_rejected, manifest_rejected (an invalid manifest passed over: detail.key,
detail.reason), checkpoint_rejected (a corrupt checkpoint skipped on resume: detail.key,
detail.reason, detail.resumed_from).
Metric names: train_loss (per replica), val_loss (global model, replica None), tokens (cumulative).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from crucible.runfiles import JsonlAppender, read_jsonl, repair_torn_tail

__all__ = ["EVENT_KINDS", "METRIC_NAMES", "Metric", "Event", "Callback", "JsonlCallback",
           "MultiCallback", "NullCallback", "event_id", "detail_text", "MAX_DETAIL_TEXT"]

EVENT_KINDS = ("failure_start", "bypass", "drop", "rejoin", "contribution_missing",
               "contribution_rejected", "reroute", "manifest_rejected", "checkpoint_rejected",
               "process_killed", "process_restarted", "process_rejoined", "process_lost")
METRIC_NAMES = ("train_loss", "val_loss", "tokens")
MAX_DETAIL_TEXT = 200   # characters of a free-text detail (a rejection reason)


def detail_text(text: str) -> str:
    """`text` as an event detail: ASCII (anything else backslash-escaped, so JSON adds at
    most one escape per character) and at most MAX_DETAIL_TEXT characters. A reason built
    from what a peer wrote (a parameter name, an exception) stays small however it was made."""
    return text.encode("ascii", "backslashreplace").decode("ascii")[:MAX_DETAIL_TEXT]


@dataclass(frozen=True)
class Metric:
    name: str
    global_step: int
    value: float
    tokens: int | None = None
    replica: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def event_id(kind: str, global_step: int, replica: int | None, stage: int | None,
             ordinal: int = 0) -> str:
    """Deterministic id of an event, unique within a run."""
    r = "-" if replica is None else str(replica)
    s = "-" if stage is None else str(stage)
    return f"{kind}:{global_step}:{r}:{s}:{ordinal}"


@dataclass(frozen=True)
class Event:
    kind: str
    global_step: int
    replica: int | None = None
    stage: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event kind {self.kind!r} unknown; allowed: {', '.join(EVENT_KINDS)}")
        if not self.id:
            object.__setattr__(self, "id", event_id(self.kind, self.global_step,
                                                    self.replica, self.stage))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Callback(Protocol):
    """Receives a run's metrics and events. `flush` is called after every global step and must
    make everything received so far durable; `close` ends the run's reporting."""

    def metric(self, item: Metric) -> None: ...
    def event(self, item: Event) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class NullCallback:
    def metric(self, item: Metric) -> None:
        pass

    def event(self, item: Event) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MultiCallback:
    """Fans every call out to several callbacks, in order."""

    def __init__(self, *callbacks: Callback) -> None:
        self.callbacks = list(callbacks)

    def metric(self, item: Metric) -> None:
        for cb in self.callbacks:
            cb.metric(item)

    def event(self, item: Event) -> None:
        for cb in self.callbacks:
            cb.event(item)

    def flush(self) -> None:
        for cb in self.callbacks:
            cb.flush()

    def close(self) -> None:
        for cb in self.callbacks:
            cb.close()


class JsonlCallback:
    """Appends metrics and events to `metrics.jsonl` / `events.jsonl` in `out_dir`.

    Records are de-duplicated by key, so a resumed run that replays steps leaves each record once:
    on open, a torn tail is cut (`crucible.runfiles`: a killed run's half-written last line) and
    the files' keys are remembered. Appends are buffered and durable at every `flush`.
    """

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.events_path = self.out_dir / "events.jsonl"
        for path in (self.metrics_path, self.events_path):
            repair_torn_tail(path)
        self._metric_keys = {self._metric_key(r) for r in read_jsonl(self.metrics_path)}
        self._event_ids = {r["id"] for r in read_jsonl(self.events_path)}
        self._metrics = JsonlAppender(self.metrics_path)
        self._events = JsonlAppender(self.events_path)

    @staticmethod
    def _metric_key(record: dict[str, Any]) -> tuple[Any, ...]:
        return (record["name"], record["global_step"], record.get("replica"))

    def metric(self, item: Metric) -> None:
        record = item.to_dict()
        key = self._metric_key(record)
        if key in self._metric_keys:
            return
        self._metric_keys.add(key)
        self._metrics.append(record)

    def event(self, item: Event) -> None:
        if item.id in self._event_ids:
            return
        self._event_ids.add(item.id)
        self._events.append(item.to_dict())

    def flush(self) -> None:
        self._metrics.sync()
        self._events.sync()

    def close(self) -> None:
        self._metrics.close()
        self._events.close()

    def resend(self, callback: Callback) -> int:
        """Send every record already in the files to `callback`; returns how many.

        A resumed run calls it before training on: a reporter killed with the run may have held
        records in memory that never reached the registry, and the files (fsync'd every global
        step) hold all of them. Receivers ignore records they already have (metrics are keyed by
        (name, step, replica), events by id), so re-sending is harmless."""
        self.flush()
        metrics = read_jsonl(self.metrics_path)
        events = read_jsonl(self.events_path)
        for record in metrics:
            callback.metric(Metric(**record))
        for record in events:
            callback.event(Event(**record))
        return len(metrics) + len(events)

