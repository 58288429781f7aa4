"""Which failures are worth retrying.

Transient: the network (httpx transport errors, 5xx answers, connection resets, the registry
client's `ApiUnavailable` after its own retries), the object store
(`crucible.store.TransientStoreError`), a database that is briefly away, memory that other runs
hold for now (`crucible.memory.MemoryBusy`: the run would fit the machine alone), and a
simulated worker crash. Deterministic: a bad config (`ConfigError`), a diverged run
(`TrainingDiverged`), and anything else we do not recognise - retrying an unknown error would
only repeat it, so the default is "do not retry".
"""
from __future__ import annotations

from typing import Any

import httpx

__all__ = ["SimulatedCrash", "is_transient", "retry_only_transient"]


class SimulatedCrash(RuntimeError):
    """Raised on purpose to exercise retry-and-resume, as if the worker had died mid-run."""


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [SimulatedCrash, httpx.TransportError, ConnectionError,
                                        TimeoutError]
    try:
        from crucible.store import TransientStoreError
        types.append(TransientStoreError)
    except ImportError:  # the store module is optional until the trainer lands
        pass
    try:
        from crucible.registry.reporting import ApiUnavailable
        types.append(ApiUnavailable)
    except ImportError:
        pass
    from crucible.memory import MemoryBusy  # no torch: importable wherever flows run
    types.append(MemoryBusy)
    try:
        from sqlalchemy.exc import OperationalError
        types.append(OperationalError)
    except ImportError:
        pass
    return tuple(types)


def _deterministic_types() -> tuple[type[BaseException], ...]:
    from crucible.config import ConfigError
    types: list[type[BaseException]] = [ConfigError]
    try:
        from crucible.train import TrainingDiverged
        types.append(TrainingDiverged)
    except ImportError:
        pass
    return tuple(types)


def is_transient(exc: BaseException) -> bool:
    """True when `exc` (or the error it was raised from) is worth retrying; a deterministic
    error is never retried, whatever it was raised from."""
    if isinstance(exc, _deterministic_types()):
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _transient_types()):
            return True
        if isinstance(current, httpx.HTTPStatusError):
            return current.response.status_code >= 500 or current.response.status_code == 429
        current = current.__cause__ or current.__context__
    return False


def retry_only_transient(task: Any, task_run: Any, state: Any) -> bool:
    """A Prefect `retry_condition_fn`: retry the failed task run only for a transient error."""
    try:
        state.result()
    except Exception as exc:  # the state re-raises the task's own exception here
        return is_transient(exc)
    return False
