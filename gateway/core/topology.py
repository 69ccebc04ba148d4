"""Parallel topology: the schedulable units a backend's devices form, and its failure domains.

Capacity belongs to a topology, not a count of devices (the seed's "Parallelism moves the
bottleneck"). This module owns the definitions every other part reads (pricing, the dispatch
queue's device set, the ladder's capacity, the audit, the capacity worksheet, the simulator):

* **A layout** (``Layout``): a model's parallel layout on a backend: its tensor-parallel
  degree, its pipeline stages with their shares of the work and the bubble fraction, the
  data-parallel replicas (how many units), optionally the units' devices spelled out, and
  how its profile's milliseconds are measured (``measured_as``):

  - ``wall_ms``: the profile gives the wall time of one execution on its unit (the latency;
    for a pipeline the sum of its stages); its accelerator-ms are that x the unit's devices
    (x the pipeline's cadence factor, below);
  - ``unit_device_ms``: the profile gives device-ms of the whole unit already.

  A request's **accelerator-ms** (what pricing predicts, the quota charges and the ladder
  counts) are device-ms of the whole unit: ``occupancy_ms x width``. **Occupancy** is how long
  the unit is held before it can take the next request: the wall time for a tensor-parallel
  unit, the **cadence** for a pipeline (its slowest stage x (1 + bubble fraction): a pipeline
  takes a new request each cadence while earlier ones are still in later stages). **Latency**
  is the wall time, the sum of the stages: what a deadline must leave room for.
* **A unit** (``Unit``): the devices one replica of a model spans (``tensor_parallel x
  stages`` of them), stage by stage. A request binds a whole unit or waits; a unit with one
  device lost is unavailable as a whole and its healthy devices are not lent to other work
  of the same layout. Units are planned packed (``plan_units``): inside one link group
  (``links``: devices joined by a fast interconnect, e.g. an NVLink island), else inside one
  host, consecutive devices first (Ray's STRICT_PACK: a unit never spans a slower path than
  it must). Explicit ``units`` are checked to be the layout's width, in range and disjoint.
* **Failure domains** (``Topology.domains``): kind (``host``, ``rack``, any name the operator
  uses) -> name -> the devices in it. Losing a domain takes every device in it and so every
  unit that spans one of them (``domain_losses``).

Pure: no clock, no I/O. Config validation (``gateway.config``) calls ``plan_units`` so a
layout that cannot be placed is an error at ``file:line:col``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

MeasuredAs = Literal["wall_ms", "unit_device_ms"]


class TopologyError(ValueError):
    """A layout or topology that cannot be placed (the message says why)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A model's parallel layout (see the module docstring)."""

    tensor_parallel: int = 1
    stage_shares: tuple[float, ...] = (1.0,)  # each pipeline stage's share of the work
    bubble_fraction: float = 0.0  # idle share of a pipeline's cadence (fill, drain, imbalance)
    data_parallel: int | None = None  # how many units (None: as many as the devices hold)
    units: tuple[tuple[int, ...], ...] | None = None  # each unit's devices, spelled out
    measured_as: MeasuredAs = "wall_ms"
    # Accelerator-ms (device-ms of the whole unit) per ms of an execution's wall time:
    # ``width x cadence_factor``, derived once (settlement reads it for every request).
    device_ms_per_ms: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise TopologyError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if not self.stage_shares or any(s <= 0 for s in self.stage_shares):
            raise TopologyError("pipeline stage shares must be positive")
        if abs(sum(self.stage_shares) - 1.0) > 1e-6:
            raise TopologyError(f"pipeline stage shares must sum to 1, got {sum(self.stage_shares):g}")
        if not 0.0 <= self.bubble_fraction < 1.0:
            raise TopologyError(f"bubble_fraction must be in [0, 1), got {self.bubble_fraction}")
        object.__setattr__(self, "device_ms_per_ms", self.width * self.cadence_factor)

    @property
    def stages(self) -> int:
        return len(self.stage_shares)

    @property
    def width(self) -> int:
        """Devices per unit: tensor-parallel degree x pipeline stages."""
        return self.tensor_parallel * self.stages

    @property
    def cadence_factor(self) -> float:
        """Occupancy over latency: the slowest stage's share x (1 + bubble) for a pipeline; 1
        for a single stage (the unit is held for the whole execution)."""
        if self.stages == 1:
            return 1.0
        return max(self.stage_shares) * (1.0 + self.bubble_fraction)

    @property
    def trivial(self) -> bool:
        """One device, one stage: a unit is a device (the layout changes nothing)."""
        return self.width == 1

    def profile_scale(self) -> float:
        """The factor from the profile's milliseconds to accelerator-ms (``measured_as``)."""
        return self.device_ms_per_ms if self.measured_as == "wall_ms" else 1.0

    def occupancy_ms(self, accelerator_ms: float) -> float:
        """How long a unit is held by work of ``accelerator_ms``: the cadence for a pipeline."""
        return accelerator_ms / self.width

    def latency_ms(self, accelerator_ms: float) -> float:
        """The wall time of work of ``accelerator_ms`` on its unit (the sum of its stages)."""
        return self.occupancy_ms(accelerator_ms) / self.cadence_factor

    def stage_ms(self, accelerator_ms: float) -> tuple[float, ...]:
        """Each stage's wall time for work of ``accelerator_ms``."""
        latency = self.latency_ms(accelerator_ms)
        return tuple(share * latency for share in self.stage_shares)


TRIVIAL = Layout()


@dataclass(frozen=True, slots=True)
class Unit:
    """One schedulable unit: the devices a replica spans, stage by stage."""

    name: str
    devices: tuple[int, ...]
    stages: tuple[tuple[int, ...], ...]

    def spans(self, devices: Iterable[int]) -> bool:
        """Does it use any of ``devices``?"""
        return not set(self.devices).isdisjoint(devices)


@dataclass(frozen=True)
class Topology:
    """A backend's devices, their link groups and failure domains."""

    devices: int
    domains: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict)
    links: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, names in self.domains.items():
            seen: dict[int, str] = {}
            for name, devices in names.items():
                for d in devices:
                    self.check_device(d, f"domain {kind} {name}")
                    if d in seen:
                        raise TopologyError(f"device {d} is in two {kind} domains: {seen[d]} and {name}")
                    seen[d] = name
        seen_link: dict[int, str] = {}
        for name, devices in self.links.items():
            for d in devices:
                self.check_device(d, f"link group {name}")
                if d in seen_link:
                    raise TopologyError(f"device {d} is in two link groups: {seen_link[d]} and {name}")
                seen_link[d] = name

    def check_device(self, device: int, where: str) -> None:
        """TopologyError naming ``where`` unless ``device`` is one of the topology's."""
        if not 0 <= device < self.devices:
            raise TopologyError(f"{where}: device {device} is out of range (0..{self.devices - 1})")

    def domains_of(self, device: int) -> tuple[tuple[str, str], ...]:
        """(kind, name) of every domain ``device`` is in."""
        return tuple(
            (kind, name) for kind, names in self.domains.items() for name, ds in names.items() if device in ds
        )

    def groups(self) -> list[tuple[int, ...]]:
        """The device groups a unit is packed into: the link groups (and every device in none
        as its own group); without links, the hosts; without hosts, all devices."""
        if self.links:
            grouped = [tuple(sorted(ds)) for ds in self.links.values()]
        elif "host" in self.domains:
            grouped = [tuple(sorted(ds)) for ds in self.domains["host"].values()]
        else:
            return [tuple(range(self.devices))]
        covered = {d for group in grouped for d in group}
        return sorted(grouped) + [(d,) for d in range(self.devices) if d not in covered]


def plan_units(topology: Topology, layout: Layout, model: str) -> tuple[Unit, ...]:
    """The units of ``layout`` on ``topology``: the explicit ones checked, else packed inside
    link groups (or hosts), consecutive devices first, at most ``data_parallel`` of them."""
    width = layout.width
    if layout.units is not None:
        used: dict[int, int] = {}
        units = []
        for index, devices in enumerate(layout.units):
            if len(devices) != width:
                raise TopologyError(
                    f"{model}: unit {index} has {len(devices)} devices; the layout needs {width} "
                    f"(tensor_parallel {layout.tensor_parallel} x {layout.stages} stages)"
                )
            for d in devices:
                topology.check_device(d, f"{model} unit {index}")
                if d in used:
                    raise TopologyError(f"{model}: device {d} is in units {used[d]} and {index}")
                used[d] = index
            units.append(_unit(model, index, tuple(devices), layout))
    else:
        units = []
        for group in topology.groups():
            for start in range(0, len(group) - width + 1, width):
                units.append(_unit(model, len(units), group[start : start + width], layout))
        if not units:
            raise TopologyError(
                f"{model}: no unit of {width} devices fits inside one "
                f"{'link group' if topology.links else 'host' if 'host' in topology.domains else 'backend'}"
            )
    if layout.data_parallel is not None:
        if layout.data_parallel > len(units):
            raise TopologyError(
                f"{model}: data_parallel {layout.data_parallel} needs {layout.data_parallel} units of "
                f"{width} devices; the topology holds {len(units)}"
            )
        units = units[: layout.data_parallel]
    return tuple(units)


def _unit(model: str, index: int, devices: tuple[int, ...], layout: Layout) -> Unit:
    tp = layout.tensor_parallel
    stages = tuple(devices[s * tp : (s + 1) * tp] for s in range(layout.stages))
    return Unit(f"{model}/u{index}", devices, stages)


def available(units: Iterable[Unit], lost: Iterable[int]) -> tuple[Unit, ...]:
    """The units with no lost device (a unit with one device lost is unavailable whole)."""
    gone = frozenset(lost)
    return tuple(unit for unit in units if not unit.spans(gone))


@dataclass(frozen=True, slots=True)
class DomainLoss:
    """What losing one failure domain takes away: its devices, and per model the units that
    span one of them and the units left."""

    kind: str
    name: str
    devices: tuple[int, ...]
    units_lost: Mapping[str, tuple[str, ...]]
    units_left: Mapping[str, int]
    # Devices outside the domain that stop counting with it: healthy devices of a lost unit.
    stranded: tuple[int, ...]


def domain_losses(topology: Topology, placements: Mapping[str, tuple[Unit, ...]]) -> list[DomainLoss]:
    """For every failure domain, what its loss takes away from each model's units."""
    losses = []
    for kind, names in topology.domains.items():
        for name, devices in names.items():
            gone = frozenset(devices)
            lost = {
                model: tuple(u.name for u in units if u.spans(gone)) for model, units in placements.items()
            }
            left = {model: len(units) - len(lost[model]) for model, units in placements.items()}
            stranded = sorted(
                {
                    d
                    for units in placements.values()
                    for u in units
                    if u.spans(gone)
                    for d in u.devices
                    if d not in gone
                }
            )
            losses.append(DomainLoss(kind, name, tuple(sorted(gone)), lost, left, tuple(stranded)))
    return losses


def parse_devices(spec: str | int | Iterable[int]) -> tuple[int, ...]:
    """Devices written as ``3``, ``[0, 1]`` or a range string ``"0-3"`` / ``"0-3,6"``."""
    if isinstance(spec, int):
        return (spec,)
    if isinstance(spec, str):
        out: list[int] = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if high < low:
                    raise TopologyError(f"device range {part!r} runs backwards")
                out.extend(range(low, high + 1))
            else:
                out.append(int(part))
        return tuple(out)
    return tuple(int(d) for d in spec)


__all__ = [
    "TRIVIAL",
    "DomainLoss",
    "Layout",
    "MeasuredAs",
    "Topology",
    "TopologyError",
    "Unit",
    "available",
    "domain_losses",
    "parse_devices",
    "plan_units",
]
