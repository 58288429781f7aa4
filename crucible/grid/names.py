"""The names the whole project shares, defined once: compression arms, mitigation strategies,
MAPL's bypass decodes, run and sweep statuses. Stdlib only (the API, the dashboards and the flows import it).

The `Literal` types drive validation (config, REST schemas, the Prefect form's dropdowns); the
tuples beside them are the same names in their canonical order (the blog's arms: uncompressed,
then the two compressed ones).
"""
from __future__ import annotations

from typing import Literal, get_args

__all__ = ["Compression", "BypassDecode", "BYPASS_DECODES", "Strategy", "RunStatus", "SweepStatus", "ARMS", "STRATEGIES",
           "ARM_LABEL", "ARM_COLOR", "STRATEGY_DASH", "BASELINE_FAULTS_STRATEGY", "RUN_STATUSES", "SWEEP_STATUSES",
           "UNFINISHED_STATUSES", "FINAL_STATUSES", "COMPLETED", "FAILED", "CANCELLED",
           "PENDING", "QUEUED", "RUNNING"]

Compression = Literal["none", "ssn", "mapl"]
# how a bypassed boundary message is decoded (pipeline.bypass_decode; MAPL only)
BypassDecode = Literal["identity", "sender", "receiver"]
Strategy = Literal["skip", "drop", "drop_extend", "reroute"]
RunStatus = Literal["pending", "queued", "running", "completed", "failed", "cancelled"]
SweepStatus = Literal["pending", "running", "completed", "failed", "cancelled"]

ARMS: tuple[str, ...] = get_args(Compression)
BYPASS_DECODES: tuple[str, ...] = get_args(BypassDecode)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
ARM_LABEL: dict[str, str] = {"none": "uncompressed", "ssn": "SSN", "mapl": "MAPL"}
# how every figure draws them (the dashboards and the study document): an Okabe-Ito colour per
# arm, a dash style per strategy, so a curve stays identifiable in greyscale too
ARM_COLOR: dict[str, str] = {"none": "#0072B2", "ssn": "#D55E00", "mapl": "#009E73"}
STRATEGY_DASH: dict[str, str] = {"skip": "solid", "drop": "dash", "drop_extend": "dot",
                                 "reroute": "dashdot"}
# the `faults.strategy` a p = 0 baseline's *config* is run with: irrelevant (nothing fails),
# pinned so that its resolved config, and so its fingerprint, is one whatever a sweep lists.
# Not how a key names the baseline: that is strategy None (crucible.grid.key.CellKey).
BASELINE_FAULTS_STRATEGY = "skip"

RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
SWEEP_STATUSES: tuple[str, ...] = get_args(SweepStatus)
PENDING, QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = RUN_STATUSES
UNFINISHED_STATUSES: frozenset[str] = frozenset({PENDING, QUEUED, RUNNING})
FINAL_STATUSES: frozenset[str] = frozenset({COMPLETED, FAILED, CANCELLED})
