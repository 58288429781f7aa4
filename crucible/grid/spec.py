"""The one spec of a failure sweep or a study, `SweepSpec`, and its cells.

A spec is a grid of cells: blocks of arms x strategies x failure probabilities, each block with
an optional label and baseline-neutral overrides (settings that change nothing when no stage
fails, so the block's cells are still compared with the arm's shared p = 0 baseline) and its own
seeds, plus one p = 0 baseline per arm and seed. A plain sweep gives its one block as `arms`,
`strategies` and `failure_probabilities`; a study (`studies/*.toml`, `load_spec`) gives `grid`.

It is what the Prefect UI's "Run" form of the `failure-sweep` deployment shows, so every field
has a description and a sensible default, and the enum-like fields (`preset`, `arms`,
`strategies`) are `Literal`s so the form shows dropdowns (over 500 lines for that reason: the
descriptions and validators of some 30 fields are the form's help). Each field's schema carries
its `position`, the order the form shows it in on any Prefect backend. Validation errors name the field and
the fix. `crucible study` reads the same model from TOML (`crucible.study.spec.load_spec`),
with the places its files go (`StudyFiles`).

Its cells (`SweepSpec.cells()`: ids, labels, run order, the shared p = 0 baselines) are
`crucible.grid.cells`'s.

`tags`, `notes`, `title`, `files`, how the claims are read (margins, target, `references`,
`claims`) and `run_seeds` annotate a spec
without changing what it runs: they are left out of its `identity()`, so re-running a sweep
with other tags continues it (and adds the tags).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from crucible.grid.cells import Cell, expand_cells
from crucible.grid.names import ARMS, BASELINE_FAULTS_STRATEGY, STRATEGIES, Compression, Strategy

__all__ = ["Arm", "StrategyName", "PresetName", "SweepSpec", "GridBlock", "StudyFiles", "ARMS", "STRATEGIES", "PRESET_NAMES",
           "BASELINE_FAULTS_STRATEGY", "BASELINE_NEUTRAL_KEYS", "GRID_KEYS", "ANNOTATIONS",
           "DEMO_SPEC", "identity_of", "Reference", "ClaimTag", "CLAIM_TAGS", "References",
           "Claims", "check_references", "check_claims", "reference_values"]

Arm = Compression
StrategyName = Strategy
PresetName = Literal["smoke", "small", "study", "study-d128", "paper-178m"]

PRESET_NAMES: tuple[str, ...] = get_args(PresetName)
# set by the grid itself: no override may name them
GRID_KEYS = ("seed", "pipeline.compression", "faults.p", "faults.strategy")
# settings that change nothing when no stage fails: a block may vary them and still be compared
# with the arm's shared p = 0 baseline
# settings that change nothing when no stage fails (at p = 0 every failure process draws none)
BASELINE_NEUTRAL_KEYS = ("pipeline.bypass_decode", "faults.duration", "faults.process",
                         "faults.group", "faults.wave", "faults.notice", "faults.down_times",
                         "faults.tail", "faults.trace")
# fields that describe a spec without changing what it runs (SweepSpec.identity): how it is
# read (its claims' margins and target), where a study keeps its files and how many cells run
# at once are not what it runs
ANNOTATIONS = ("tags", "notes", "title", "files", "close_margin", "equivalence_margin",
               "target_half_width", "max_concurrent_runs", "references", "claims",
               "run_seeds", "run_cells")
# fields added after specs were first stored: left out of the identity while unset, so a sweep
# stored by an earlier release is continued by its re-run
_LATER_OPTIONAL = ("max_seeds", "grid")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9_]*$")


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


def _form_order(schema: dict[str, Any]) -> None:
    """Give each property of a model's JSON schema its `position` (0, 1, ... in field order):
    the Prefect UI's form orders its fields by `position` and the deployment's stored schema
    loses key order on a Postgres-backed server (JSONB sorts keys), so without it the form's
    fields come in JSONB's order (arms, grid, name, tags, ...)."""
    for position, prop in enumerate(schema.get("properties", {}).values()):
        prop["position"] = position


def _dedupe(values: list[Any]) -> list[Any]:
    """Drop repeats, keeping first-seen order (a repeated arm would silently double the grid)."""
    return list(dict.fromkeys(values))


def _no_repeats(values: list[Any], what: str = "a value") -> list[Any]:
    if len(set(values)) != len(values):
        raise ValueError(f"lists {what} twice: {values}; list each once")
    return values


def _check_overrides(items: list[str], *, per_block: bool) -> list[str]:
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise ValueError(f"override {item!r} must look like key.path=value, e.g. "
                             "\"pipeline.bypass_decode=sender\"")
        if key in GRID_KEYS:
            raise ValueError(f"{key} is set by the grid itself (arms, strategies, p, seeds); "
                             f"remove {item!r}")
        if per_block and key not in BASELINE_NEUTRAL_KEYS:
            raise ValueError(
                f"{key} would change training without failures too, but a block's cells are "
                "compared with the arm's shared p = 0 baseline, which does not have it; only "
                f"{', '.join(BASELINE_NEUTRAL_KEYS)} may be set per block (put {key} in the "
                "spec's overrides, a study of its own)")
    return items


def _label_from_sets(sets: Iterable[str]) -> str:
    parts = []
    for item in sets:
        key, value = item.split("=", 1)
        parts.append(f"{key.strip().rsplit('.', 1)[-1]}_{value.strip()}")
    return re.sub(r"[^a-z0-9_]+", "_", "_".join(parts).lower()).strip("_")


def _seed_values(value: list[int]) -> list[int]:
    bad = [s for s in value if s < 0]
    if bad:
        raise ValueError(f"seeds must be >= 0, got {bad}")
    return value


class GridBlock(BaseModel):
    """One block of the grid: every arm x strategy x p > 0, at the spec's seeds (or its own)."""

    model_config = ConfigDict(extra="forbid", title="Grid block", populate_by_name=True,
                              json_schema_extra=_form_order)

    arms: list[Arm] = Field(..., min_length=1,
                            description="Compression arms of this block: none, ssn, mapl.")
    strategies: list[StrategyName] = Field(
        ..., min_length=1, description="Mitigation strategies of this block.")
    p: list[float] = Field(
        ..., min_length=1,
        description="Failure probabilities, each in [0, 1]; 0 stands for the arm's shared "
                    "baseline (always run).")
    label: str = Field("", max_length=64,
                       description="Names this block's cells apart from the unlabelled ones "
                                   "(lower-case letters, digits and _); default: from `set`.")
    overrides: list[str] = Field(
        default_factory=list, validation_alias=AliasChoices("set", "overrides"),
        description="Baseline-neutral `key.path=value` settings of this block's cells only "
                    "(pipeline.bypass_decode=...); their baseline is the arm's shared one.")
    seeds: list[int] | None = Field(
        None, min_length=1, description="This block's seeds; empty = the spec's.")

    @field_validator("arms", mode="before")
    @classmethod
    def _known_arms(cls, value: Any) -> Any:
        return _check_choices(value, ARMS, "arm")

    @field_validator("strategies", mode="before")
    @classmethod
    def _known_strategies(cls, value: Any) -> Any:
        return _check_choices(value, STRATEGIES, "strategy")

    @field_validator("arms", "strategies")
    @classmethod
    def _once(cls, value: list[str]) -> list[str]:
        return _no_repeats(value)

    @field_validator("p")
    @classmethod
    def _probabilities(cls, value: list[float]) -> list[float]:
        for p in value:
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{p!r} is not a probability in [0, 1]; give e.g. 0.1")
        return _no_repeats([float(p) for p in value])

    @field_validator("overrides")
    @classmethod
    def _neutral(cls, value: list[str]) -> list[str]:
        return _check_overrides(value, per_block=True)

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else _no_repeats(_seed_values(value), "a seed")

    @field_validator("label")
    @classmethod
    def _slug(cls, value: str) -> str:
        if value and not _SLUG.match(value):
            raise ValueError(f"must be lower-case letters, digits and _ (e.g. "
                             f"\"decode_sender\"), got {value!r}")
        return value

    @model_validator(mode="after")
    def _label(self) -> GridBlock:
        if self.label and not self.overrides:
            raise ValueError(f"label {self.label!r} without `set` overrides would name the same "
                             "runs as the unlabelled cells; remove the label or add `set`")
        if not self.label and self.overrides:
            self.label = _label_from_sets(self.overrides)
        return self


class StudyFiles(BaseModel):
    """Where a study keeps its files (absolute paths; `load_spec` resolves the TOML's, which
    are relative to the spec's folder). Not part of what a spec runs."""

    model_config = ConfigDict(extra="forbid", title="Study files", frozen=True,
                              json_schema_extra=_form_order)

    spec: Path = Field(..., description="The spec file itself.")
    results_dir: Path = Field(..., description="One slim summary per finished cell.")
    runs_dir: Path = Field(..., description="The runs' own folders (checkpoints, logs).")
    document: Path = Field(..., description="The generated results document.")
    figures_dir: Path = Field(..., description="The document's figures.")
    pilots: list[Path] = Field(default_factory=list,
                               description="Candidate-preset specs whose table it shows.")
    token_check: list[Path] = Field(default_factory=list,
                                    description="(half the tokens, all of them) pilot specs.")
    scale: list[Path] = Field(default_factory=list,
                              description="Specs running some of its cells at a larger model.")
    reuse: list[Path] = Field(default_factory=list,
                              description="Specs whose identical runs count as its own cells.")
    processes: list[Path] = Field(default_factory=list,
                                  description="Specs running its strategies under other "
                                              "failure processes (one labelled block each).")
    estimand: list[Path] = Field(default_factory=list,
                                 description="Pilot specs of a second estimand (runs with "
                                             "train.tail_average) shown in the document.")


ClaimTag = Literal["a", "b", "c", "d", "e"]
CLAIM_TAGS: tuple[str, ...] = get_args(ClaimTag)


class Reference(BaseModel):
    """A published degradation that the claims hold the measured one against (the blog's Table
    1 by default): an arm's degradation under a strategy at a failure rate, in % of the loss."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_form_order)

    arm: Arm = Field(description="Compression arm: none, ssn or mapl.")
    strategy: Literal["skip", "drop"] = Field(
        "skip", description="The strategy it was measured under (the claims compare skip and "
                            "drop).")
    p: float = Field(gt=0, lt=1, description="Failure probability per replica per global step.")
    pct: float = Field(ge=-100, le=1000,
                       description="Degradation, 100 (L - L0) / L0 of the final validation loss.")


def check_references(value: list[Reference]) -> list[Reference]:
    """References as a spec takes them: at least one, each (arm, strategy, p) once."""
    if not value:
        raise ValueError("an empty list gives no reference value; leave it out for the blog's "
                         "Table 1")
    seen: set[tuple[str, str, float]] = set()
    for ref in value:
        key = (ref.arm, ref.strategy, ref.p)
        if key in seen:
            raise ValueError(f"two references for {ref.arm}/{ref.strategy} at p = {ref.p:g}; "
                             "give each (arm, strategy, p) once")
        seen.add(key)
    return value


def check_claims(value: list[str]) -> list[str]:
    """Claims as a spec takes them: at least one tag, each once."""
    if not value:
        raise ValueError("an empty list decides no claim; leave it out for all five")
    return _no_repeats(value, "a claim")


def reference_values(references: list[Reference]) -> dict[tuple[str, str, float], float]:
    """References as the claims take them (crucible.stats.References): {(arm, strategy, p):
    pct}."""
    return {(r.arm, r.strategy, r.p): r.pct for r in references}


# the field types of `references` and `claims`, also how the registry validates a stored spec
References = Annotated[list[Reference], AfterValidator(check_references)]
Claims = Annotated[list[ClaimTag], AfterValidator(check_claims)]


class SweepSpec(BaseModel):
    """A failure-rate sweep or study: every cell of its grid (each arm x strategy x failure
    probability x seed of each block), plus one p = 0 baseline per arm and seed."""

    model_config = ConfigDict(extra="forbid", title="Failure sweep", json_schema_extra=_form_order)

    name: str = Field("failure-sweep", min_length=1, max_length=200,
                      description="Name of the sweep in the registry and on the dashboard.")
    preset: PresetName = Field(
        "smoke", description="Named model/training configuration every cell starts from "
                             "(smoke: seconds on a CPU; small: minutes; study, study-d128: the "
                             "failure study's; paper-178m: a GPU).")
    arms: list[Arm] = Field(
        default_factory=lambda: ["ssn", "mapl"], min_length=1,
        description="Compression arms (pipeline.compression) to compare: none = uncompressed "
                    "boundaries, ssn = fixed subspace, mapl = learned subspace. Leave as is "
                    "when `grid` is given.")
    strategies: list[StrategyName] = Field(
        default_factory=lambda: ["skip", "drop"], min_length=1,
        description="Mitigation strategies (faults.strategy) applied when a stage is down. "
                    "Leave as is when `grid` is given.")
    failure_probabilities: list[float] = Field(
        default_factory=lambda: [0.05, 0.1], min_length=1,
        description="Failure probabilities per replica per global step (faults.p), each in "
                    "[0, 1]. The p = 0 baseline is always run once per arm and seed. Leave as "
                    "is when `grid` is given.")
    grid: list[GridBlock] | None = Field(
        None, min_length=1,
        description="A study's grid: blocks of arms x strategies x p, each with an optional "
                    "label, baseline-neutral overrides and its own seeds (a block of p = 0 "
                    "alone runs only baselines). Empty = the one block of arms, strategies "
                    "and failure_probabilities.")
    duration: int | None = Field(
        6, ge=1, le=10_000,
        description="Global steps a failed stage stays down (faults.duration); empty = the "
                    "preset's.")
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
    run_seeds: list[int] | None = Field(
        None, min_length=1,
        description="Run only these of the spec's seeds now (their cells and baselines); the "
                    "sweep stays the same sweep, and a run without it completes the grid. Empty "
                    "= every seed. No precision round runs while cells of other seeds are "
                    "still to run.")
    run_cells: list[str] | None = Field(
        None, min_length=1,
        description="Run only the cells whose id matches one of these shell patterns now (e.g. "
                    "`none-*`, `ssn-skip-p0.2-*`; a cell's id is ARM-STRATEGY-pP-sSEED, a "
                    "baseline's ARM-base-sSEED); with run_seeds, both must match. The sweep "
                    "stays the same sweep. Empty = every cell.")
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
    title: str | None = Field(None, max_length=500,
                              description="A study's title (its results document's heading).")
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
    references: References | None = Field(
        None, description="Published degradations the claims compare with, each {arm, "
                          "strategy, p, pct}. Empty = the blog's Table 1 (skip at p = 0.1 and "
                          "0.2 for the three arms).")
    claims: Claims | None = Field(
        None, description="The claims this sweep decides, of (a) skip costs less than drop, "
                          "(b) degradation grows with p, (c) SSN degrades least, (d) MAPL is "
                          "close to uncompressed, (e) at p = 0.01 the loss stays close to its "
                          "baseline. Empty = all five.")
    files: StudyFiles | None = Field(
        None, description="Where a study keeps its files (set by `crucible study`).")

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
        return _dedupe(_seed_values(value))

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, value: list[str]) -> list[str]:
        return _check_overrides(value, per_block=False)

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
        from crucible.grid.tags import check_tags  # the rule REST and the CLI apply too

        return check_tags(value, field="tag")

    @field_validator("notes")
    @classmethod
    def _notes(cls, value: str | None) -> str | None:
        from crucible.grid.tags import check_notes

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
        if self.grid is not None:
            # the flat fields stay at their defaults (a form sends them all): set, they
            # would be a second grid that nothing runs
            flat = [name for name in ("arms", "strategies", "failure_probabilities")
                    if getattr(self, name) != type(self).model_fields[name].get_default(
                        call_default_factory=True)]
            if flat:
                raise ValueError(f"give either `grid` or {', '.join(flat)}, not both (a "
                                 "spec's cells come from its grid blocks when it has some; "
                                 "leave the others at their defaults)")
            self.cells()     # raises when two blocks make one cell differently
        elif not any(p > 0 for p in self.failure_probabilities):
            raise ValueError("the grid is empty: failure_probabilities has no p > 0 "
                             "(the p = 0 baseline is always run); add e.g. 0.05")
        return self

    # -- the grid --------------------------------------------------------------------------------
    @model_validator(mode="after")
    def _run_seeds_are_the_specs(self) -> SweepSpec:
        unknown = sorted(set(self.run_seeds or ()) - set(self.all_seeds))
        if unknown:
            raise ValueError(f"run_seeds {unknown} are not among the spec's seeds "
                             f"{list(self.all_seeds)}; choose from those")
        return self

    @property
    def partial(self) -> bool:
        """True when this run of the spec runs only some of its cells (`run_seeds`,
        `run_cells`)."""
        return self.run_seeds is not None or self.run_cells is not None

    def runs_now(self) -> list[Cell]:
        """The cells this run of the spec runs: every cell, or only `run_seeds`' and those
        `run_cells` matches."""
        from fnmatch import fnmatchcase

        cells = self.cells(self.run_seeds)
        if self.run_cells is None:
            return cells
        return [c for c in cells if any(fnmatchcase(c.id, pattern) for pattern in self.run_cells)]

    def reference_values(self) -> dict[tuple[str, str, float], float] | None:
        """The references as the claims take them, {(arm, strategy, p): pct}; None: the
        blog's."""
        return None if self.references is None else reference_values(self.references)

    @property
    def blocks(self) -> list[GridBlock]:
        """The grid's blocks: `grid`, or the one block of arms, strategies and
        failure_probabilities."""
        if self.grid is not None:
            return list(self.grid)
        return [GridBlock(arms=self.arms, strategies=self.strategies,
                          p=self.failure_probabilities)]

    @property
    def all_seeds(self) -> tuple[int, ...]:
        """The spec's seeds, then any more that a block asks for, in that order."""
        extra = sorted({s for b in self.blocks for s in (b.seeds or ()) if s not in self.seeds})
        return tuple(self.seeds) + tuple(extra)

    def common_overrides(self) -> tuple[str, ...]:
        """The settings every cell shares: `overrides`, then `global_steps` and `duration`
        where set (a study's preset line and its parameter count read this)."""
        items = list(self.overrides)
        if self.global_steps is not None:
            items.append(f"train.global_steps={self.global_steps}")
        if self.duration is not None:
            items.append(f"faults.duration={self.duration}")
        return tuple(items)

    def cells(self, seeds: Iterable[int] | None = None) -> list[Cell]:
        """The grid's cells in run order (`expand_cells`)."""
        return expand_cells(self, seeds)

    def refuse_duplicates(self, keyed: Iterable[tuple[Cell, str]]) -> None:
        """Two cells with one resolved configuration would be one run under two names (a
        block whose `set` is the preset's own value): raise ValueError naming both. `keyed`
        pairs each cell with its resolved configuration's key (its canonical JSON, or its
        fingerprint); the study's loader and the flow's plan both call this."""
        seen: dict[str, Cell] = {}
        for cell, key in keyed:
            other = seen.setdefault(key, cell)
            if other is not cell:
                raise ValueError(f"grid[{cell.block}]: cell {cell.id} runs the same configuration "
                                 f"as {other.id} (its `set` changes nothing under preset "
                                 f"{self.preset!r}); remove the block or set another value")

    def identity(self) -> dict[str, Any]:
        """The spec as JSON without its annotations (`ANNOTATIONS`): what makes two sweeps the
        same sweep, so a re-run with other tags or notes continues the one it re-runs."""
        return identity_of(self.model_dump(mode="json"))

    # -- a study's files -------------------------------------------------------------------------
    def _files(self) -> StudyFiles:
        if self.files is None:
            raise ValueError(f"spec {self.name!r} has no study files; load it from its TOML "
                             "file (crucible.study.load_spec)")
        return self.files

    @property
    def path(self) -> Path:
        return self._files().spec

    @property
    def results_dir(self) -> Path:
        return self._files().results_dir

    @property
    def runs_dir(self) -> Path:
        return self._files().runs_dir

    @property
    def document(self) -> Path:
        return self._files().document

    @property
    def figures_dir(self) -> Path:
        return self._files().figures_dir

    @property
    def root(self) -> Path:
        """The folder that printed paths are relative to (the repository root for
        `studies/NAME.toml`)."""
        return self.path.parent.parent

    def shown(self, path: Path) -> str:
        """`path` as a study document prints it: relative to `root`, forward slashes."""
        import os

        return Path(os.path.relpath(path, self.root)).as_posix()

    @property
    def command(self) -> str:
        return f"crucible study render {self.shown(self.path)}"


def identity_of(stored: dict[str, Any]) -> dict[str, Any]:
    """The identity of a spec as stored with its sweep (`SweepSpec.model_dump(mode="json")`,
    of this release or an earlier one): without its annotations, and without the fields added
    later while they are unset (`max_seeds`, `grid`: a sweep stored before they existed keeps
    its identity). With `max_seeds` set, `target_half_width` decides which seeds run, so it is
    part of the identity then."""
    rounds = stored.get("max_seeds") is not None
    return {k: v for k, v in stored.items()
            if (k not in ANNOTATIONS or (rounds and k == "target_half_width"))
            and not (k in _LATER_OPTIONAL and v is None)}


# `make demo` (`crucible sweep --demo`) and the Prefect form's defaults: the first study's
# preset (`study`, d_model 64) at half its replicas, the uncompressed arm, skip and drop at
# p = 0.2 over 3 seeds: 9 runs of about 30 s on one core. The pilot of this setting (3 seeds,
# docs/OPERATIONS.md "The demo") measured skip - drop at -10.8 points [-19.5, -2.0]: dropping
# the tokens costs clearly more than skipping the stage, and 3 seeds resolve it (2 do not:
# their t-interval is 3x as wide).
DEMO_SPEC: dict[str, Any] = {
    "name": "demo",
    "preset": "study",
    "arms": ["none"],
    "strategies": ["skip", "drop"],
    "failure_probabilities": [0.2],
    "seeds": [0, 1, 2],
    "overrides": ["replicas=4"],
    "duration": None,
    "max_concurrent_runs": 2,
}
