"""A run outside any flow, reported to the registry: what `crucible run --api URL` does.

It takes the flows' path to the registry (`crucible.registry.connect`, `ReporterSettings`): the
run is registered with its config, fingerprint, code version, name, tags and notes, marked
`running`; the trainer's metrics and events go through `crucible.registry.reporting.ApiCallback`
(a background sender; spooled under `ReporterSettings.spool_root` while the API is unreachable,
replayed by any later reporter, flow or `crucible api replay`); and its final state goes through
the run's spool folder (`record_finish`), so it is called completed only once every record has
arrived.

The registry id is kept in `OUT/registry.json` with the API's URL, so `crucible run --resume
--out OUT` against the same API continues the same record.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from crucible.config import Config
from crucible.registry.connect import make_callback, make_client, run_page
from crucible.registry.identity import code_version, config_fingerprint
from crucible.registry.reporting import (
    ApiCallback,
    ApiError,
    ApiUnavailable,
    final_changes,
    record_finish,
)
from crucible.registry.settings import ReporterSettings
from crucible.runfiles import write_json_atomic

__all__ = ["REGISTRY_FILE", "StandaloneRun", "start_run"]

_log = logging.getLogger(__name__)

REGISTRY_FILE = "registry.json"


@dataclass
class StandaloneRun:
    """A registered run in progress: `callback` goes to the trainer, then `finish` or `end`."""

    settings: ReporterSettings
    run_id: str
    page: str
    callback: ApiCallback

    def finish(self, summary: dict[str, Any]) -> int | None:
        """Record the run completed with `summary` once its records have arrived. Returns None
        when it is recorded, else how many records it still owes (possibly 0: the registry
        could not be reached for the final state itself), which then waits in its spool for the
        next replay while the registry shows the run running ("owes N records")."""
        return self._record(final_changes(summary=summary))

    def end(self, status: str, reason: str) -> int | None:
        """Record the run `status` (failed, cancelled) with `reason`, on the way out of an
        error: returns what `finish` does, and logs (never raises) a refusal, so the error that
        ended the run is the one the caller sees."""
        try:
            return self._record({"status": status, "status_reason": reason[:4000]})
        except ApiError as exc:
            _log.warning("run %s: the registry refused its final state %s: %s", self.run_id,
                         status, exc)
            return None

    def _record(self, changes: dict[str, Any]) -> int | None:
        """Record `changes` through the run's spool; raises `ApiError` when the API refuses
        them (an unreachable one is not an error: see `finish`)."""
        self._close_callback()
        with make_client(self.settings) as client:
            try:
                record_finish(client, self.settings.spool_root, self.run_id, changes,
                              timeout_s=self.settings.replay_timeout_s)
            except ApiUnavailable as exc:    # RecordsOwed too: it waits in the spool
                return int(getattr(exc, "owed", 0) or 0)
        return None

    def _close_callback(self) -> None:
        try:
            self.callback.close()           # idempotent: train() closes it on success
        finally:
            self.callback.client.close()


def start_run(settings: ReporterSettings, config: Config, out_dir: Path, *, name: str | None,
              tags: list[str], notes: str | None, resume: bool) -> StandaloneRun:
    """Register the run training into `out_dir` (with `resume`, the record `out_dir` names, if
    it is on this API and still there) and mark it running. Raises `ApiUnavailable` when the
    registry cannot be reached and `ApiError` when it refuses (a bad token: 401/403)."""
    with make_client(settings) as client:
        run_id = _recorded_run(client, settings, out_dir) if resume else None
        if run_id is None:
            run = client.create_run(config=config.to_dict(), name=name,
                                    config_hash=config_fingerprint(config),
                                    code_version=code_version(), tags=tags or None, notes=notes)
            run_id = str(run["id"])
            write_json_atomic(out_dir / REGISTRY_FILE,
                              {"api_url": settings.api_url, "run_id": run_id})
        # a new attempt: the final state an earlier one left in the spools no longer applies
        callback = cast(ApiCallback, make_callback(settings, run_id))
        try:
            client.update_run(run_id, status="running", status_reason=None)
        except BaseException:
            callback.close()
            callback.client.close()
            raise
    return StandaloneRun(settings, run_id, run_page(settings, run_id), callback)


def _recorded_run(client: Any, settings: ReporterSettings, out_dir: Path) -> str | None:
    """The registry id `out_dir/registry.json` names, when it is a run of this API."""
    try:
        record = json.loads((out_dir / REGISTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("api_url") != settings.api_url:
        return None
    try:
        return str(client.get_run(str(record.get("run_id")))["id"])
    except ApiUnavailable:
        raise
    except ApiError:        # gone (404), or not an id (422): register a new run
        return None
