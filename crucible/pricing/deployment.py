"""A deployment as data: the machines a run would occupy, read from a TOML file
(infra/deployments/*.toml) and checked field by field, for the cost model (crucible.pricing.cost).

A deployment says how fast each pipeline stage computes (seconds per inner step per stage, or
sustained FLOP/s per stage from which the run's own model size gives the step time), the
boundary links between stages (bandwidth, latency), the link to the object store, how long a
killed process takes to come back and to rejoin, the price of an accelerator-hour on demand and
on spot, and which of the two prices applies. Every bad value raises `DeploymentError` naming
the field and the fix; the file is refused before it is read when it is larger than
`MAX_BYTES`. No torch: the API and the study read it.

    name = "cloud-8x4-spot"
    description = "..."
    pricing = "spot"                         # on_demand | spot
    layout = "per_stage"                     # per_stage | one_device (every stage on one)
    [compute]
    flops_per_s = 2.0e14                     # per stage (or step_s = [..] per stage, seconds)
    [network]
    boundary_bandwidth_mbps = 500.0          # megabits per second, each boundary link
    boundary_latency_ms = 40.0
    store_bandwidth_mbps = 1000.0
    store_latency_ms = 30.0
    [recovery]
    restart_s = 90.0                         # a killed process until it runs again
    rejoin_s = 30.0                          # until it has the global weights and data position
    [workload]
    preset = "paper-178m"                    # optional: price each inner step as this preset's
    [price]
    accelerators_per_stage = 1
    on_demand_per_hour = 2.5                 # per accelerator, in `currency`
    spot_discount = 0.6                      # spot = on demand x (1 - discount) unless spot_per_hour
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Deployment", "DeploymentError", "LAYOUTS", "MAX_BYTES", "PRICINGS", "load_deployment",
           "parse_deployment"]

MAX_BYTES = 64 * 1024
PRICINGS = ("on_demand", "spot")
LAYOUTS = ("per_stage", "one_device")

_SECTIONS: dict[str, dict[str, str]] = {
    "compute": {"step_s": "seconds per inner step of each stage (a number or one per stage)",
                "flops_per_s": "sustained FLOP/s of one stage's accelerators",
                "eval_fraction": "an evaluation token's cost as a share of a training token's "
                                 "(forward only: about 1/3)",
                "sync_compute_s": "seconds of encode, decode and outer step per round",
                "startup_s": "seconds from the start command to the first step"},
    "network": {"boundary_bandwidth_mbps": "megabits per second of each boundary link",
                "boundary_latency_ms": "one-way latency of a boundary link in ms",
                "store_bandwidth_mbps": "megabits per second between a replica and the store",
                "store_latency_ms": "latency of one store request in ms"},
    "recovery": {"restart_s": "seconds until a killed process runs again",
                 "rejoin_s": "seconds from restart until it holds the global weights",
                 "round_timeout_s": "seconds a replica waits for a round's contributions "
                                    "(default: the run's sparseloco.round_timeout_s)",
                 "spot_notice_s": "seconds of notice before a spot reclaim"},
    "workload": {"preset": "a preset whose model and batch the deployment trains: a run of "
                           "another size is priced as if each inner step were that preset's"},
    "price": {"accelerators_per_stage": "accelerators holding one stage of one replica (layout "
                                        "one_device: the accelerators of the whole run)",
              "on_demand_per_hour": "price of one accelerator-hour on demand",
              "spot_per_hour": "price of one accelerator-hour on spot",
              "spot_discount": "spot's discount from on demand, 0 to 0.9",
              "currency": "the unit of the prices, e.g. USD"},
}
_TOP = {"name", "description", "pricing", "layout", "compute", "network", "recovery", "price",
        "workload"}


class DeploymentError(ValueError):
    """A deployment file that cannot be used: the message names the field and the fix."""


@dataclass(frozen=True)
class Deployment:
    name: str
    description: str
    pricing: str                              # on_demand | spot: the price `cost` reports
    layout: str                               # per_stage | one_device
    step_s: tuple[float, ...] | None          # per stage, seconds per inner step
    flops_per_s: float | None                 # per stage, when step_s is not given
    eval_fraction: float
    sync_compute_s: float
    startup_s: float
    boundary_bandwidth_mbps: float
    boundary_latency_ms: float
    store_bandwidth_mbps: float
    store_latency_ms: float
    restart_s: float
    rejoin_s: float
    round_timeout_s: float | None
    spot_notice_s: float
    accelerators_per_stage: int
    on_demand_per_hour: float
    spot_per_hour: float
    spot_discount: float
    currency: str
    workload_preset: str | None = None        # price each inner step as this preset's
    source: str = ""

    @property
    def price_per_hour(self) -> float:
        """The price of one accelerator-hour under this deployment's pricing."""
        return self.spot_per_hour if self.pricing == "spot" else self.on_demand_per_hour

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["step_s"] = None if self.step_s is None else list(self.step_s)
        return out


def _number(where: str, value: Any, *, low: float = 0.0, high: float = math.inf,
            strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DeploymentError(f"{where} must be a number, got {value!r}")
    if value < low or (strict and value == low) or value > high:
        bound = f"> {low:g}" if strict else f">= {low:g}"
        top = "" if high == math.inf else f" and <= {high:g}"
        raise DeploymentError(f"{where} must be {bound}{top}, got {value!r}")
    return float(value)


def _section(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise DeploymentError(f"{source}: [{name}] must be a table of keys, got {section!r}")
    unknown = sorted(set(section) - set(_SECTIONS[name]))
    if unknown:
        allowed = ", ".join(sorted(_SECTIONS[name]))
        raise DeploymentError(f"{source}: unknown key {name}.{unknown[0]}; [{name}] takes "
                              f"{allowed}")
    return section


def _required(section: dict[str, Any], name: str, key: str, source: str) -> Any:
    if key not in section:
        raise DeploymentError(f"{source}: {name}.{key} is missing: set it to the "
                              f"{_SECTIONS[name][key]}")
    return section[key]


def _step_s(value: Any, where: str) -> tuple[float, ...]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise DeploymentError(f"{where} must be a number or a non-empty list, got []")
    return tuple(_number(f"{where}[{i}]" if isinstance(value, list) else where, v, strict=True)
                 for i, v in enumerate(values))


def parse_deployment(data: dict[str, Any], *, source: str = "deployment") -> Deployment:
    """A `Deployment` from a parsed TOML table; raises DeploymentError naming the field."""
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise DeploymentError(f"{source}: unknown key {unknown[0]!r}; a deployment takes "
                              f"{', '.join(sorted(_TOP))}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise DeploymentError(f"{source}: name is missing: set name = \"my-deployment\"")
    pricing = data.get("pricing", "on_demand")
    if pricing not in PRICINGS:
        raise DeploymentError(f"{source}: pricing must be one of {', '.join(PRICINGS)}, got "
                              f"{pricing!r}")
    layout = data.get("layout", "per_stage")
    if layout not in LAYOUTS:
        raise DeploymentError(f"{source}: layout must be one of {', '.join(LAYOUTS)}, got "
                              f"{layout!r}")
    compute = _section(data, "compute", source)
    network = _section(data, "network", source)
    recovery = _section(data, "recovery", source)
    price = _section(data, "price", source)
    workload = _section(data, "workload", source).get("preset")
    if workload is not None:
        from crucible.presets import PRESETS

        if workload not in PRESETS:
            raise DeploymentError(f"{source}: workload.preset {workload!r} is not a preset; "
                                  f"choose from {', '.join(PRESETS)}")
    w = f"{source}: "
    if ("step_s" in compute) == ("flops_per_s" in compute):
        raise DeploymentError(f"{w}[compute] needs exactly one of step_s (seconds per inner "
                              "step, per stage) and flops_per_s (sustained FLOP/s per stage)")
    step_s = _step_s(compute["step_s"], f"{w}compute.step_s") if "step_s" in compute else None
    flops = (_number(f"{w}compute.flops_per_s", compute["flops_per_s"], strict=True)
             if "flops_per_s" in compute else None)
    net = {key: _number(f"{w}network.{key}", _required(network, "network", key, source),
                        strict=key.endswith("mbps"))
           for key in _SECTIONS["network"]}
    rec = {key: _number(f"{w}recovery.{key}", _required(recovery, "recovery", key, source))
           for key in ("restart_s", "rejoin_s")}
    timeout = recovery.get("round_timeout_s")
    on_demand = _number(f"{w}price.on_demand_per_hour",
                        _required(price, "price", "on_demand_per_hour", source))
    discount = _number(f"{w}price.spot_discount", price.get("spot_discount", 0.0), high=0.9)
    spot = (_number(f"{w}price.spot_per_hour", price["spot_per_hour"])
            if "spot_per_hour" in price else on_demand * (1.0 - discount))
    if "spot_per_hour" in price and on_demand > 0:
        discount = 1.0 - spot / on_demand
        if not 0.0 <= discount <= 0.9:
            raise DeploymentError(f"{w}price.spot_per_hour {spot:g} is {100 * discount:.0f}% "
                                  "off on demand; spot is 0-90% off: fix either price")
    per_stage = price.get("accelerators_per_stage", 1)
    if isinstance(per_stage, bool) or not isinstance(per_stage, int) or per_stage < 1:
        raise DeploymentError(f"{w}price.accelerators_per_stage must be an integer >= 1, got "
                              f"{per_stage!r}")
    currency = price.get("currency", "USD")
    description = data.get("description", "")
    if not isinstance(currency, str) or not isinstance(description, str):
        raise DeploymentError(f"{w}price.currency and description must be strings")
    return Deployment(
        name=name.strip(), description=description.strip(), pricing=pricing, layout=layout,
        step_s=step_s,
        flops_per_s=flops,
        eval_fraction=_number(f"{w}compute.eval_fraction", compute.get("eval_fraction", 1 / 3),
                              high=1.0),
        sync_compute_s=_number(f"{w}compute.sync_compute_s", compute.get("sync_compute_s", 0.0)),
        startup_s=_number(f"{w}compute.startup_s", compute.get("startup_s", 0.0)),
        **net, **rec,
        round_timeout_s=None if timeout is None else _number(f"{w}recovery.round_timeout_s",
                                                             timeout, strict=True),
        spot_notice_s=_number(f"{w}recovery.spot_notice_s", recovery.get("spot_notice_s", 0.0)),
        accelerators_per_stage=per_stage, on_demand_per_hour=on_demand, spot_per_hour=spot,
        spot_discount=discount, currency=currency, workload_preset=workload, source=source)


def load_deployment(path: str | Path) -> Deployment:
    """Read and check a deployment TOML file (at most MAX_BYTES); raises DeploymentError."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DeploymentError(f"{path}: cannot read the deployment file ({exc.strerror}); pass "
                              "a file such as infra/deployments/this-machine.toml") from None
    if not path.is_file():
        raise DeploymentError(f"{path}: not a file; pass a deployment .toml file")
    if size > MAX_BYTES:
        raise DeploymentError(f"{path}: {size} bytes, larger than the {MAX_BYTES} a deployment "
                              "file may have")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DeploymentError(f"{path}: not valid TOML ({exc}); fix the line it names") from None
    return parse_deployment(data, source=str(path))
