"""The failure sweep's one typed parameter model, `SweepSpec`, and its grid expansion.

`SweepSpec` is what a user fills in on the Prefect UI's "Run" form for the `failure-sweep`
deployment, so every field has a description and a sensible default, and the enum-like fields
(`preset`, `arms`, `strategies`) are `Literal`s so the form shows dropdowns. Validation errors name
the field and the fix.

Grid expansion (`expand_grid`) yields one `Cell` per run to train. The p = 0 baseline does not
depend on the mitigation strategy (nothing fails, so nothing is mitigated), so it is one cell per
(arm, seed), shared by every strategy of that arm; its strategy is pinned to `BASELINE_STRATEGY`
so that its resolved config, and therefore its fingerprint, is the same however the sweep lists
its strategies.

`tags` and `notes` annotate a sweep without changing what it runs: they are left out of its
`identity()`, so re-running a sweep with other tags continues it (and adds the tags).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from crucible.names import ARMS, BASELINE_STRATEGY, STRATEGIES, Compression, Strategy

__all__ = ["Arm", "StrategyName", "PresetName", "SweepSpec", "Cell", "expand_grid",
           "ARMS", "STRATEGIES", "PRESET_NAMES", "BASELINE_STRATEGY", "ANNOTATIONS", "DEMO_SPEC",
           "identity_of"]

Arm = Compression
StrategyName = Strategy
PresetName = Literal["smoke", "small", "study", "study-d128", "paper-178m"]

PRESET_NAMES: tuple[str, ...] = get_args(PresetName)
# fields that describe a sweep without changing what it runs (SweepSpec.identity): how it is
# read (its claims' margins and target) is not what it runs either
ANNOTATIONS = ("tags", "notes", "close_margin", "equivalence_margin", "target_half_width")


def _check_choices(values: Any, allowed: tuple[str, ...], what: str) -> Any:
    """Reject unknown names up front with a message listing the allowed ones (pydantic's own
    Literal error is correct but does not say which list the value belongs to)."""
    if isinstance(values, str):
        values = [values]
    if isinstance(values, list | tuple):
        for value in values:
            if isinstance(value, str) and value not in allowed:
                raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")
    return values


def _dedupe(values: list[Any]) -> list[Any]:
    """Drop repeats, keeping first-seen order (a repeated arm would silently double the grid)."""
    return list(dict.fromkeys(values))


class SweepSpec(BaseModel):
    """A failure-rate sweep: every compression arm x strategy x failure probability x seed, plus
    one p = 0 baseline per arm and seed."""

    model_config = ConfigDict(extra="forbid", title="Failure sweep")

    name: str = Field("failure-sweep", min_length=1, max_length=200,
                      description="Name of the sweep in the registry and on the dashboard.")
    preset: PresetName = Field(
        "smoke", description="Named model/training configuration every cell starts from "
                             "(smoke: seconds on a CPU; small: minutes; paper-178m: a GPU).")
    arms: list[Arm] = Field(
        default_factory=lambda: ["ssn", "mapl"], min_length=1,
        description="Compression arms (pipeline.compression) to compare: none = uncompressed "
                    "boundaries, ssn = fixed subspace, mapl = learned subspace.")
    strategies: list[StrategyName] = Field(
        default_factory=lambda: ["skip", "drop"], min_length=1,
        description="Mitigation strategies (faults.strategy) applied when a stage is down.")
    failure_probabilities: list[float] = Field(
        default_factory=lambda: [0.05, 0.1], min_length=1,
        description="Failure probabilities per replica per global step (faults.p), each in "
                    "[0, 1]. The p = 0 baseline is always run once per arm and seed.")
    duration: int = Field(6, ge=1, le=10_000,
                          description="Global steps a failed stage stays down (faults.duration).")
    global_steps: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Training length in global steps (train.global_steps); empty = the preset's.")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1,
                             description="Seeds; every cell is run once per seed.")
    overrides: list[str] = Field(
        default_factory=list,
        description="Extra `key.path=value` settings applied to every cell, e.g. replicas=4.")
    store_url: str | None = Field(
        None, description="Object store for checkpoints and contributions: file:///path or "
                          "s3://bucket/prefix. Empty = the worker's CRUCIBLE_STORE_URL, else a "
                          "local folder beside each run.")
    max_seeds: int | None = Field(
        None, ge=2, le=1000,
        description="Seeds by precision: after the listed seeds, add seeds (and their "
                    "baselines) to every cell whose paired 95% half-width is above "
                    "target_half_width, widest first, up to this many seeds a cell. Empty = "
                    "run the listed seeds only. It stops on an interval's width, never on the "
                    "size or sign of an effect.")
    max_concurrent_runs: int = Field(
        2, ge=1, le=1024,
        description="Most cells in flight at once (each also waits for a GPU slot on its host).")
    use_deployment: bool = Field(
        False, description="Start each cell as a run of the `train-run` deployment (spreads the "
                           "sweep over every worker of its pool) instead of inside this flow run.")
    tags: list[str] = Field(
        default_factory=list,
        description="Tags of the sweep and its runs in the registry (filter with ?tag=), also "
                    "set as Prefect tags `tag:<t>` of its flow runs; each 1-64 characters from "
                    "A-Za-z0-9._:/+=-, e.g. baseline or paper/fig3.")
    notes: str | None = Field(
        None, max_length=10_000,
        description="Free-text notes on the sweep, shown on its dashboard page.")
    close_margin: float = Field(
        0.5, gt=0, le=100,
        description="Claim (d), \"MAPL is close to uncompressed\": the band, in points of "
                    "the baseline's loss, that the paired interval must lie inside.")
    equivalence_margin: float = Field(
        0.5, gt=0, le=100,
        description="Claim (e), \"at p = 0.01 the loss stays close to its baseline\": the "
                    "equivalence band in points.")
    target_half_width: float = Field(
        0.5, gt=0, le=100,
        description="The 95% half-width, in points, a cell's interval should reach; the "
                    "Claims panel shows each comparison's width against it and the seeds "
                    "its measured sd says it needs.")

    @field_validator("arms", mode="before")
    @classmethod
    def _known_arms(cls, value: Any) -> Any:
        return _check_choices(value, ARMS, "arm")

    @field_validator("strategies", mode="before")
    @classmethod
    def _known_strategies(cls, value: Any) -> Any:
        return _check_choices(value, STRATEGIES, "strategy")

    @field_validator("preset", mode="before")
    @classmethod
    def _known_preset(cls, value: Any) -> Any:
        _check_choices(value, PRESET_NAMES, "preset")
        return value

    @field_validator("failure_probabilities")
    @classmethod
    def _probabilities(cls, value: list[float]) -> list[float]:
        for p in value:
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"failure probability {p!r} is outside [0, 1]; "
                                 "give probabilities such as 0.05 (5% per step)")
        return sorted(set(value))

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int]) -> list[int]:
        bad = [s for s in value if s < 0]
        if bad:
            raise ValueError(f"seeds must be >= 0, got {bad}")
        return _dedupe(value)

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, value: list[str]) -> list[str]:
        for item in value:
            if "=" not in item:
                raise ValueError(f"override {item!r} must look like key.path=value")
        return value

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        from crucible.store import parse_store_url  # the one check `store.url` gets too

        parse_store_url(value, field="store_url")
        return value.rstrip("/")

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        from crucible.tags import check_tags  # the rule REST and the CLI apply too

        return check_tags(value, field="tag")

    @field_validator("notes")
    @classmethod
    def _notes(cls, value: str | None) -> str | None:
        from crucible.tags import check_notes

        return check_notes(value, field="notes")

    @model_validator(mode="after")
    def _seed_budget(self) -> SweepSpec:
        if self.max_seeds is not None and self.max_seeds < len(self.seeds):
            raise ValueError(f"max_seeds ({self.max_seeds}) is below the {len(self.seeds)} "
                             "seeds listed; raise max_seeds or list fewer seeds")
        return self

    @model_validator(mode="after")
    def _non_empty_grid(self) -> SweepSpec:
        self.arms = _dedupe(self.arms)
        self.strategies = _dedupe(self.strategies)
        if not any(p > 0 for p in self.failure_probabilities):
            raise ValueError("the grid is empty: failure_probabilities has no p > 0 "
                             "(the p = 0 baseline is always run); add e.g. 0.05")
        return self

    def cells(self) -> list[Cell]:
        """The grid, baselines first (see `expand_grid`)."""
        return expand_grid(self)

    def identity(self) -> dict[str, Any]:
        """The spec as JSON without its annotations (`ANNOTATIONS`): what makes two sweeps the
        same sweep, so a re-run with other tags or notes continues the one it re-runs."""
        return identity_of(self.model_dump(mode="json"))


def identity_of(stored: dict[str, Any]) -> dict[str, Any]:
    """The identity of a spec as stored with its sweep (`SweepSpec.model_dump(mode="json")`,
    of this release or an earlier one): without its annotations, and without `max_seeds` when
    it is unset (a sweep without precision rounds keeps the identity it had before they
    existed). With `max_seeds` set, `target_half_width` decides which seeds run, so it is part
    of the identity then."""
    rounds = stored.get("max_seeds") is not None
    return {k: v for k, v in stored.items()
            if (k not in ANNOTATIONS or (rounds and k == "target_half_width"))
            and not (k == "max_seeds" and v is None)}


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: the overrides that turn the preset into this cell's config.

    `strategy` is None for a p = 0 baseline (it serves every strategy of its arm).
    """

    arm: str
    strategy: str | None
    p: float
    seed: int

    @property
    def is_baseline(self) -> bool:
        return self.p == 0.0

    @property
    def baseline(self) -> Cell:
        """The p = 0 cell this cell is compared against (itself for a baseline)."""
        return Cell(arm=self.arm, strategy=None, p=0.0, seed=self.seed)

    @property
    def label(self) -> str:
        strategy = "baseline" if self.strategy is None else self.strategy
        return f"{self.arm}/{strategy}/p={self.p:g}/seed={self.seed}"

    def overrides(self, spec: SweepSpec) -> list[str]:
        """`key.path=value` settings for this cell: the spec's extras first, the cell's last
        (so a stray `faults.p=` in the extras cannot change which cell this is)."""
        items = list(spec.overrides)
        if spec.global_steps is not None:
            items.append(f"train.global_steps={spec.global_steps}")
        items += [
            f"pipeline.compression={self.arm}",
            f"faults.p={self.p!r}",
            f"faults.strategy={self.strategy or BASELINE_STRATEGY}",
            f"faults.duration={spec.duration}",
            f"seed={self.seed}",
        ]
        return items


def expand_grid(spec: SweepSpec) -> list[Cell]:
    """Every cell of `spec`: one p = 0 baseline per (arm, seed), then arm x strategy x p x seed for
    each p > 0. No cell appears twice."""
    baselines = [Cell(arm=arm, strategy=None, p=0.0, seed=seed)
                 for arm in spec.arms for seed in spec.seeds]
    faulty = [Cell(arm=arm, strategy=strategy, p=p, seed=seed)
              for arm in spec.arms for strategy in spec.strategies
              for p in spec.failure_probabilities if p > 0 for seed in spec.seeds]
    return baselines + faulty


# `make demo`: 2 codecs x 2 strategies x 2 failure rates + 2 baselines x 1 seed = 10 runs.
DEMO_SPEC: dict[str, Any] = {
    "name": "demo",
    "preset": "smoke",
    "arms": ["ssn", "mapl"],
    "strategies": ["skip", "drop"],
    "failure_probabilities": [0.1, 0.3],
    "seeds": [0],
    "max_concurrent_runs": 1,
}
