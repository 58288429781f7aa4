"""The terminal progress bar of `crucible run`: global steps done, the latest train loss (mean over
replicas), tokens per second and stages down.

With the bar off nothing is attached and nothing runs per step; with it on, a small callback
keeps the latest loss and the bar reads the trainer's counters and fault plan once per global
step, never inside the inner loop.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from crucible.events import Metric, NullCallback

__all__ = ["RunProgress"]

StepDone = Callable[[int, int], None]


class _LiveLoss(NullCallback):
    """A callback keeping the mean train loss over replicas of the latest global step."""

    def __init__(self) -> None:
        self.step, self.total, self.count = -1, 0.0, 0

    def metric(self, item: Metric) -> None:
        if item.name != "train_loss":
            return
        if item.global_step != self.step:
            self.step, self.total, self.count = item.global_step, 0.0, 0
        self.total += item.value
        self.count += 1

    def text(self) -> str:
        return f"{self.total / self.count:.4f}" if self.count else "-"


class RunProgress:
    """`callback` (None when off) goes to the trainer's callbacks; `show(trainer)` draws the bar
    for the block and yields the function to call after each global step (done, total)."""

    def __init__(self, *, enabled: bool) -> None:
        self.callback = _LiveLoss() if enabled else None

    @contextmanager
    def show(self, trainer: Any, *, total: int) -> Iterator[StepDone]:
        live = self.callback
        if live is None:
            yield lambda done, total: None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("global steps"), TextColumn("loss {task.fields[loss]}"),
                   TextColumn("{task.fields[tokens_s]} tok/s"),
                   TextColumn("{task.fields[down]} stages down"), TimeRemainingColumn())
        with Progress(*columns) as bar:
            task = bar.add_task("training", total=total, completed=trainer.next_step, loss="-",
                                tokens_s="-", down=0)
            started, tokens_before = time.perf_counter(), trainer.counters.tokens_processed

            def step_done(done: int, total: int) -> None:
                rate = (trainer.counters.tokens_processed - tokens_before) / max(
                    time.perf_counter() - started, 1e-9)
                down = sum(f.covers(done - 1) for f in trainer.plan.failures)
                bar.update(task, completed=done, total=total, loss=live.text(),
                           tokens_s=f"{rate:,.0f}", down=down)

            yield step_done
