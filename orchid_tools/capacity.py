"""The capacity worksheet: ``orchid-gateway capacity FILE [--json]``.

This module owns the *workload description* schema (request classes with arrival
rates and shapes, model demand profiles, the device, the overload policy, a
deadline budget and a padding example), its loading with ``file:line:col`` and
key-path errors (through the gateway's one located-YAML reader, ``gateway.yaml_source``),
and the pure arithmetic that turns it into the seed's model-serving capacity
worksheet: memory, execution demand, scheduling and batching, quality and
overload. Each figure carries its value, unit and a one-line meaning; the text
table and the ``--json`` output render the same figures.

The cost arithmetic is not here: per-request and per-batch accelerator-ms come
from ``gateway.core.profile`` (``DemandProfile``, ``padding``, ``batch_accelerator_ms``;
a model's fields are ``gateway.settings.DemandProfileSchema``'s)
and the batch-wait limit from ``gateway.core.record.Budget.slack_ms``, so the
worksheet prices work exactly as admission does. Everything is computed from the
file; no figure is a printed constant. Nothing divides by zero: a figure that
cannot be computed has value ``None`` (``n/a``) and says why.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.core.errors import ConfigError
from gateway.core.memory import DeviceMemory, live_tokens, resident_bytes
from gateway.core.overload import protected_capacity_ms_per_s
from gateway.core.profile import GIB, DemandProfile, batch_accelerator_ms, padding
from gateway.core.record import Budget
from gateway.core.topology import DomainLoss, Layout, Topology, Unit, available, domain_losses
from gateway.settings import DemandProfileSchema
from gateway.yaml_source import YamlDocument, YamlError, read_yaml

if TYPE_CHECKING:
    from gateway.config import GatewayConfig, RouteTable, TopologyConfig

MS_PER_S = 1000.0
_EPS = 1e-9  # float noise allowance when rounding device counts up

# --------------------------------------------------------------------------- schema


class _KeyedProblem(ValueError):
    """A cross-field problem that knows the key (relative to the validated object) it is about."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key
        self.problem = problem


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceSpec(_Strict):
    """One accelerator of the serving pool and how much of it admission may plan to use."""

    memory_gib: float = Field(gt=0, description="device memory, GiB")
    runtime_reserve_gib: float = Field(default=0.0, ge=0, description="runtime/workspace/allocator reserve")
    protected_utilization: float = Field(
        gt=0, le=1, description="share of each device-second admission plans"
    )
    devices: int | None = Field(default=None, gt=0, description="fleet to evaluate; default the minimum")


class ModelSpec(DemandProfileSchema):
    """A model version's ``DemandProfile`` fields, plus its parameter count as a weights shorthand."""

    params: float | None = Field(default=None, gt=0, description="parameter count")
    bytes_per_param: float | None = Field(default=None, gt=0, description="bytes per parameter")
    quality_score: float | None = Field(default=None, ge=0, le=1, description="validated quality score")
    quality_floor: float | None = Field(default=None, ge=0, le=1, description="minimum score as a fallback")

    @model_validator(mode="after")
    def _weights_once(self) -> Self:
        if (self.params is None) != (self.bytes_per_param is None):
            missing = "bytes_per_param" if self.bytes_per_param is None else "params"
            raise _KeyedProblem(missing, "params and bytes_per_param go together: give both or neither")
        if self.params is not None and self.weights_bytes:
            raise _KeyedProblem("weights_bytes", "give params + bytes_per_param or weights_bytes, not both")
        return self

    def phases(self, input_tokens: int, output_tokens: int, batch: int = 1) -> tuple[float, float]:
        """(prefill_ms, decode_ms): its ``DemandProfile``'s."""
        return self.value().phases(input_tokens, output_tokens, batch)

    def accelerator_ms(self, input_tokens: int, output_tokens: int) -> float:
        return self.value().accelerator_ms(input_tokens, output_tokens)

    @property
    def resident_weights_bytes(self) -> int:
        if self.params is not None and self.bytes_per_param is not None:
            return round(self.params * self.bytes_per_param)
        return self.weights_bytes

    @property
    def declares_memory(self) -> bool:
        return self.resident_weights_bytes > 0 or self.live_cache_bytes_per_token > 0


class RequestClass(_Strict):
    """A class of requests: how often it arrives, its shape, and where it runs."""

    rate_per_s: float = Field(ge=0, description="arrival rate, requests per second")
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0, description="maximum output tokens")
    model: str = Field(min_length=1, description="model that serves the class")
    fallback: str | None = Field(default=None, min_length=1, description="warm smaller model under overload")
    # For a route whose model keeps a prefix cache (the Prefix cache section, with --gateway):
    unique_input_tokens: int | None = Field(
        default=None, ge=0, description="prompt tokens per request not already cached (default: input_tokens)"
    )
    think_time_s: float | None = Field(
        default=None, ge=0, description="a conversation's seconds from one turn to the next"
    )


class OverloadSpec(_Strict):
    surge_factor: float = Field(default=1.0, gt=0, description="multiplier on every arrival rate")
    fallback_share: dict[str, float] = Field(
        default_factory=dict, description="per class: share of eligible arrivals routed to its fallback"
    )

    @model_validator(mode="after")
    def _shares_in_range(self) -> Self:
        for name, share in self.fallback_share.items():
            if not 0.0 <= share <= 1.0:
                raise _KeyedProblem(f"fallback_share.{name}", f"must be between 0 and 1 (got {share})")
        return self


class DeadlineSpec(_Strict):
    """The seed's teaching request: S = D - E - R_up - R_exec - R_fail (- queue wait)."""

    deadline_ms: float = Field(ge=0)
    elapsed_ms: float = Field(default=0.0, ge=0)
    reserve_upstream_ms: float = Field(default=0.0, ge=0)
    reserve_exec_ms: float = Field(default=0.0, ge=0)
    reserve_fail_ms: float = Field(default=0.0, ge=0)
    queue_wait_ms: float = Field(default=0.0, ge=0)

    def budget(self) -> Budget:
        return Budget(
            deadline_ms=self.deadline_ms,
            elapsed_ms=self.elapsed_ms,
            reserve_upstream_ms=self.reserve_upstream_ms,
            reserve_exec_ms=self.reserve_exec_ms,
            reserve_fail_ms=self.reserve_fail_ms,
            queue_wait_ms=self.queue_wait_ms,
        )


class PaddingExample(_Strict):
    """One would-be batch: member i has ``input_tokens[i]`` in and ``output_tokens[i]`` out."""

    model: str = Field(min_length=1)
    input_tokens: list[int] = Field(min_length=1)
    output_tokens: list[int] = Field(min_length=1)

    @model_validator(mode="after")
    def _members(self) -> Self:
        for i, n in enumerate(self.input_tokens):
            if n < 1:
                raise _KeyedProblem(f"input_tokens[{i}]", f"must be at least 1 (got {n})")
        for i, n in enumerate(self.output_tokens):
            if n < 0:
                raise _KeyedProblem(f"output_tokens[{i}]", f"must be at least 0 (got {n})")
        if len(self.output_tokens) != len(self.input_tokens):
            raise _KeyedProblem(
                "output_tokens",
                f"needs one entry per input_tokens entry ({len(self.input_tokens)}), "
                f"got {len(self.output_tokens)}",
            )
        return self

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return list(zip(self.input_tokens, self.output_tokens, strict=True))


class ShadowCombination(_Strict):
    """Normal traffic plus shadow: ``share`` of every class's requests mirrored to a candidate
    priced as ``model``."""

    model: str = Field(min_length=1, description="the model the candidate is priced as")
    share: float = Field(gt=0, le=1, description="share of requests mirrored (a route's shadow rate)")


class OverlapCombination(_Strict):
    """Version overlap plus long sequences: ``candidate`` resident beside every class's model
    and fallback on each device; ``long_class``'s sequences in the live room left."""

    candidate: str = Field(min_length=1, description="the candidate version's model (its weights)")
    long_class: str = Field(min_length=1, description="the class of long sequences")


class WarmupShape(_Strict):
    input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=0)
    repeat: int = Field(default=1, ge=1)


class GroupLossCombination(_Strict):
    """One device-group loss plus cold load: ``groups`` equal failure domains; a lost group's
    models load their weights at ``load_gib_per_s`` and run ``warmup`` before serving."""

    groups: int = Field(ge=2, description="equal device groups (failure domains) of the fleet")
    load_gib_per_s: float = Field(gt=0, description="weights load bandwidth (storage to device)")
    warmup: list[WarmupShape] = Field(default_factory=list, description="shapes run before ready")


class UpstreamCombination(_Strict):
    """Feature latency plus batch dwell: the teaching request (``deadline``) with upstream
    work slower by each of ``extra_ms``, against a batch-dwell cap of ``dwell_cap_ms``."""

    request_class: str = Field(min_length=1, alias="class", description="the class of the teaching request")
    dwell_cap_ms: float = Field(ge=0, description="the class's batch-dwell cap (max_dwell_ms)")
    extra_ms: list[float] = Field(min_length=1, description="upstream slowdowns to evaluate")


class Combinations(_Strict):
    """The seed's combined bottlenecks; surge plus fallback is ``overload`` (always computed)."""

    shadow: ShadowCombination | None = None
    version_overlap: OverlapCombination | None = None
    device_group_loss: GroupLossCombination | None = None
    upstream_dwell: UpstreamCombination | None = None


class Workload(_Strict):
    """A workload description file, validated. Cross-references are checked here too."""

    device: DeviceSpec
    models: dict[str, ModelSpec] = Field(min_length=1)
    classes: dict[str, RequestClass] = Field(min_length=1)
    overload: OverloadSpec = Field(default_factory=OverloadSpec)
    deadline: DeadlineSpec | None = None
    padding_example: PaddingExample | None = None
    combinations: Combinations | None = None

    @model_validator(mode="after")
    def _references(self) -> Self:
        known = ", ".join(sorted(self.models))
        combined = self.combinations
        if combined is not None:
            classes = ", ".join(sorted(self.classes))
            for key, model in (
                ("shadow.model", combined.shadow.model if combined.shadow else None),
                (
                    "version_overlap.candidate",
                    combined.version_overlap.candidate if combined.version_overlap else None,
                ),
            ):
                if model is not None and model not in self.models:
                    raise _KeyedProblem(f"combinations.{key}", f"unknown model {model!r} (known: {known})")
            for key, name in (
                (
                    "version_overlap.long_class",
                    combined.version_overlap.long_class if combined.version_overlap else None,
                ),
                (
                    "upstream_dwell.class",
                    combined.upstream_dwell.request_class if combined.upstream_dwell else None,
                ),
            ):
                if name is not None and name not in self.classes:
                    raise _KeyedProblem(f"combinations.{key}", f"unknown class {name!r} (known: {classes})")
            if combined.upstream_dwell is not None and self.deadline is None:
                raise _KeyedProblem(
                    "combinations.upstream_dwell", "needs the deadline section (the teaching request)"
                )
        for name, cls in self.classes.items():
            if cls.model not in self.models:
                raise _KeyedProblem(f"classes.{name}.model", f"unknown model {cls.model!r} (known: {known})")
            if cls.unique_input_tokens is not None and cls.unique_input_tokens > cls.input_tokens:
                raise _KeyedProblem(
                    f"classes.{name}.unique_input_tokens",
                    f"at most input_tokens ({cls.input_tokens}), got {cls.unique_input_tokens}",
                )
            if cls.fallback is not None and cls.fallback not in self.models:
                raise _KeyedProblem(
                    f"classes.{name}.fallback", f"unknown model {cls.fallback!r} (known: {known})"
                )
        for name in self.overload.fallback_share:
            if name not in self.classes:
                raise _KeyedProblem(
                    f"overload.fallback_share.{name}",
                    f"unknown class {name!r} (known: {', '.join(sorted(self.classes))})",
                )
            if self.classes[name].fallback is None:
                raise _KeyedProblem(
                    f"overload.fallback_share.{name}", f"class {name!r} declares no fallback model"
                )
        if self.padding_example is not None and self.padding_example.model not in self.models:
            raise _KeyedProblem(
                "padding_example.model", f"unknown model {self.padding_example.model!r} (known: {known})"
            )
        return self


# --------------------------------------------------------------------------- loading


def _dotted(parts: Sequence[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out:
            out += f".{part}"
        else:
            out = str(part)
    return out


def _split_key(key: str) -> list[str | int]:
    """Inverse of ``_dotted`` (model and class names containing dots are ambiguous; best effort)."""
    parts: list[str | int] = []
    for piece in key.split("."):
        name, _, rest = piece.partition("[")
        if name:
            parts.append(name)
        while rest:
            index, _, rest = rest.partition("]")
            if index.isdigit():
                parts.append(int(index))
            rest = rest.removeprefix("[")
    return parts


def _problem(error: Mapping[str, Any]) -> tuple[list[str | int], str]:
    """(key path, operator-facing problem) of one pydantic error."""
    loc: list[str | int] = [p for p in error["loc"] if isinstance(p, str | int)]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _KeyedProblem):
        return loc + _split_key(cause.key), cause.problem
    kind = error["type"]
    if kind == "missing":
        return loc, "required field is missing"
    if kind == "extra_forbidden":
        return loc, "unknown field (not part of the workload schema)"
    message = str(error["msg"])
    if "input" in error and not isinstance(error["input"], dict | list):
        message += f" (got {error['input']!r})"
    return loc, message


def workload_from_data(
    data: Any, source: str = "<workload>", document: YamlDocument | None = None
) -> Workload:
    """Validate parsed YAML; raise ``ConfigError(source[:line:col], key.path, problem)``
    (``line:col`` of the offending key when the ``document`` it was read from is given)."""
    if not isinstance(data, dict):
        got = "an empty document" if data is None else type(data).__name__
        raise ConfigError(source, "", f"expected a mapping of workload sections at the top level, got {got}")
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        parts, problem = _problem(errors[0])
        if len(errors) > 1:
            problem += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        location = document.location(parts) if document is not None else source
        raise ConfigError(location, _dotted(parts), problem) from None


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file (``gateway.yaml_source``, the gateway's located-YAML
    reader). Every failure is a ``ConfigError`` naming the file."""
    try:
        document = read_yaml(path)
    except YamlError as exc:
        raise ConfigError(exc.location, "", exc.problem) from None
    return workload_from_data(document.value(), str(path), document)


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True, slots=True)
class Figure:
    """One named worksheet figure. ``value`` is ``None`` when it cannot be computed (``n/a``)."""

    key: str
    label: str
    value: float | None
    unit: str
    explanation: str
    decimals: int = 0

    def __post_init__(self) -> None:
        if self.value is not None and not math.isfinite(self.value):
            raise ValueError(f"figure {self.key} is not finite: {self.value}")

    @property
    def display(self) -> str:
        if self.value is None:
            return "n/a"
        value = self.value
        if self.decimals == 0:
            # counts are floored or ceiled before they get here; round only float noise
            value = round(value)
        number = f"{value:,.{self.decimals}f}"
        if number.startswith("-") and float(number.replace(",", "")) == 0:
            number = number[1:]
        if not self.unit:
            return number
        return f"{number}{self.unit}" if self.unit == "×" else f"{number} {self.unit}"

    def as_json(self) -> dict[str, Any]:
        value: float | int | None
        if self.value is None:
            value = None
        elif self.decimals == 0:
            value = round(self.value)
        else:
            value = round(self.value, 6)
        return {
            "key": self.key,
            "label": self.label,
            "value": value,
            "unit": self.unit,
            "display": self.display,
            "explanation": self.explanation,
        }


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    figures: tuple[Figure, ...]


@dataclass(frozen=True, slots=True)
class Worksheet:
    """The computed worksheet: sections of figures, in the seed's worksheet order."""

    sections: tuple[Section, ...]
    source: str = ""

    @property
    def figures(self) -> tuple[Figure, ...]:
        return tuple(f for s in self.sections for f in s.figures)

    def figure(self, key: str) -> Figure:
        for f in self.figures:
            if f.key == key:
                return f
        raise KeyError(key)

    def value(self, key: str) -> float:
        """The value of ``key``; ``ValueError`` if that figure is ``n/a``."""
        value = self.figure(key).value
        if value is None:
            raise ValueError(f"figure {key} is n/a: {self.figure(key).explanation}")
        return value

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "sections": [
                {"title": s.title, "figures": [f.as_json() for f in s.figures]} for s in self.sections
            ],
        }


# --------------------------------------------------------------------------- arithmetic


def _n(value: float, decimals: int = 1) -> str:
    """Compact number for explanations: thousands separators, no trailing zeros."""
    text = f"{value:,.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _ms(value: float) -> str:
    """Milliseconds for explanations, one decimal as the seed prints them."""
    return f"{value:,.1f}"


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - _EPS))


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _workload_section(w: Workload) -> Section:
    figures = []
    for name, cls in w.classes.items():
        fallback = f", fallback {cls.fallback}" if cls.fallback else ", no fallback"
        figures.append(
            Figure(
                f"workload.{name}.rate",
                f"arrivals: {name}",
                cls.rate_per_s,
                "req/s",
                f"{cls.input_tokens:,} input / ≤{cls.output_tokens:,} output tokens on {cls.model}{fallback}",
                decimals=1,
            )
        )
    figures.append(
        Figure(
            "workload.surge_factor",
            "surge factor",
            w.overload.surge_factor,
            "×",
            "every arrival rate is multiplied by this in the overload figures",
            decimals=2,
        )
    )
    return Section("Outcome and workload", tuple(figures))


@dataclass(frozen=True, slots=True)
class _Demand:
    offered: float  # accelerator-ms/s
    per_device: float  # schedulable ms/s of one device
    fleet: int  # devices the percentages are taken against


def _execution_section(w: Workload) -> tuple[Section, _Demand]:
    figures: list[Figure] = []
    for name, cls in w.classes.items():
        for model_name in dict.fromkeys(m for m in (cls.model, cls.fallback) if m is not None):
            profile = w.models[model_name]
            prefill, decode = profile.phases(cls.input_tokens, cls.output_tokens)
            role = "serves" if model_name == cls.model else "fallback for"
            figures.append(
                Figure(
                    f"execution.cost.{name}.{model_name}",
                    f"cost/request: {name} on {model_name}",
                    profile.accelerator_ms(cls.input_tokens, cls.output_tokens),
                    "accelerator-ms",
                    f"{role} {name}, batch of one: fixed {_ms(profile.fixed_ms)} + prefill "
                    f"{_ms(prefill - profile.fixed_ms)} + decode {_ms(decode)}",
                    decimals=1,
                )
            )
    offered = 0.0
    for name, cls in w.classes.items():
        cost = w.models[cls.model].accelerator_ms(cls.input_tokens, cls.output_tokens)
        demand = cls.rate_per_s * cost
        offered += demand
        figures.append(
            Figure(
                f"execution.demand.{name}",
                f"demand: {name}",
                demand,
                "accelerator-ms/s",
                f"{_n(cls.rate_per_s)} req/s × {_ms(cost)} accelerator-ms on {cls.model}",
                decimals=1,
            )
        )
    figures.append(
        Figure(
            "execution.offered_demand",
            "offered demand",
            offered,
            "accelerator-ms/s",
            "sum over classes at normal arrivals: device-ms of work arriving each second",
            decimals=1,
        )
    )
    per_device = w.device.protected_utilization * MS_PER_S
    figures.append(
        Figure(
            "execution.per_device",
            "schedulable per device",
            per_device,
            "ms/s",
            f"{_n(w.device.protected_utilization * 100)} % of 1,000 device-ms/s; the rest is margin for "
            "variance, recovery and control",
            decimals=0 if per_device.is_integer() else 1,
        )
    )
    minimum = _ceil(offered / per_device)
    figures.append(
        Figure(
            "execution.min_devices",
            "devices, arithmetic minimum",
            minimum,
            "devices",
            f"ceil({_n(offered)} / {_n(per_device)}): arithmetic floor, no queue/failure/overlap reserve",
        )
    )
    if w.device.devices is not None:
        fleet = w.device.devices
        why = "declared in device.devices"
    else:
        fleet = max(1, minimum)
        why = "the arithmetic minimum (device.devices not declared)" + (
            "; at least one device is assumed" if minimum == 0 else ""
        )
    figures.append(
        Figure("execution.fleet", "fleet evaluated", fleet, "devices", f"{why}; percentages use it")
    )
    utilization = _ratio(offered, fleet * per_device)
    assert utilization is not None  # fleet >= 1 and per_device > 0
    headroom = "within" if utilization <= 1 else "OVER"
    figures.append(
        Figure(
            "execution.protected_pct",
            "share of protected envelope",
            utilization * 100,
            "%",
            f"normal demand / ({fleet} × {_n(per_device)} ms/s): {headroom} the protected envelope; "
            "little room left for uncertainty",
            decimals=2,
        )
    )
    return Section("Execution", tuple(figures)), _Demand(offered, per_device, fleet)


def _memory_section(w: Workload) -> Section:
    figures: list[Figure] = []
    # The live-memory bound's own arithmetic (gateway.core.memory): the worksheet and the
    # dispatch queue's bound cannot disagree.
    device = DeviceMemory.from_gib(w.device.memory_gib, w.device.runtime_reserve_gib)
    for name, model in w.models.items():
        if not model.declares_memory:
            figures.append(
                Figure(
                    f"memory.{name}",
                    f"{name}: memory",
                    None,
                    "",
                    "not declared: give params + bytes_per_param (or weights_bytes) and "
                    "live_cache_bytes_per_token; a warm fallback needs its own reserved memory",
                )
            )
            continue
        weights = model.resident_weights_bytes
        if model.params is not None and model.bytes_per_param is not None:
            source = f"{model.params:,.0f} params × {_n(model.bytes_per_param)} B = {weights:,} B"
        else:
            source = f"weights_bytes {weights:,} B"
        figures.append(
            Figure(
                f"memory.{name}.weights_gib",
                f"{name}: weights",
                weights / GIB,
                "GiB",
                f"{source}; before runtime state, activations and cache",
                decimals=2,
            )
        )
        workspace = model.workspace_reserve_bytes
        left = device.live_room_bytes(weights + workspace)
        workspace_text = f" - {_n(workspace / GIB, 2)} workspace" if workspace else ""
        fits = "left for live sequence state" if left >= 0 else "DOES NOT FIT: weights and reserves exceed it"
        figures.append(
            Figure(
                f"memory.{name}.live_state_gib",
                f"{name}: left for live state",
                left / GIB,
                "GiB",
                f"{_n(w.device.memory_gib, 2)} device - {_n(w.device.runtime_reserve_gib, 2)} runtime reserve"
                f"{workspace_text} - weights: {fits}",
                decimals=2,
            )
        )
        per_token = model.live_cache_bytes_per_token
        if per_token == 0:
            figures.append(
                Figure(
                    f"memory.{name}.live_tokens",
                    f"{name}: live tokens",
                    None,
                    "tokens",
                    "n/a: live_cache_bytes_per_token is not declared (0), so memory does not bound tokens",
                )
            )
        else:
            tokens = live_tokens(left, per_token)
            figures.append(
                Figure(
                    f"memory.{name}.live_tokens",
                    f"{name}: live tokens, ceiling",
                    tokens,
                    "tokens",
                    f"floor(left / {per_token:,} B per token); fragmentation, blocks, peaks lower it",
                )
            )
    return Section("Memory (one replica per device)", tuple(figures))


def _scheduling_section(w: Workload) -> Section | None:
    figures: list[Figure] = []
    if w.deadline is not None:
        d = w.deadline
        slack = d.budget().slack_ms
        queue = f" - {_n(d.queue_wait_ms)} queued" if d.queue_wait_ms else ""
        formula = (
            f"{_n(d.deadline_ms)} deadline - {_n(d.elapsed_ms)} elapsed"
            f" - {_n(d.reserve_upstream_ms)} upstream - {_n(d.reserve_exec_ms)} exec"
            f" - {_n(d.reserve_fail_ms)} failure{queue}"
        )
        meaning = (
            "a limit, not a target: dispatch earlier"
            if slack >= 0
            else "NEGATIVE: completion is predicted to miss the deadline; admission rejects it"
        )
        figures.append(
            Figure(
                "scheduling.max_batch_wait_ms",
                "max batch wait (slack)",
                slack,
                "ms",
                f"{formula}; {meaning}",
                decimals=0 if float(slack).is_integer() else 1,
            )
        )
    example = w.padding_example
    if example is not None:
        report = padding(example.input_tokens)
        members = len(example.input_tokens)
        longest = max(example.input_tokens)
        figures.append(
            Figure(
                "batching.useful_tokens",
                "useful input tokens",
                report.useful_tokens,
                "tokens",
                f"sum of the {members} members' input tokens in the padding example",
            )
        )
        figures.append(
            Figure(
                "batching.padded_tokens",
                "padded token positions",
                report.padded_tokens,
                "tokens",
                f"{members} members × longest input {longest:,}: what one padded batch executes over",
            )
        )
        figures.append(
            Figure(
                "batching.amplification",
                "padding amplification",
                report.amplification,
                "×",
                "padded / useful: executed positions per useful input token at the padding boundary",
                decimals=3,
            )
        )
        profile = w.models[example.model]
        mixed = batch_accelerator_ms(profile.value(), example.shapes)
        buckets: dict[int, list[tuple[int, int]]] = {}
        for shape in example.shapes:
            buckets.setdefault(shape[0], []).append(shape)
        bucketed = sum(batch_accelerator_ms(profile.value(), group) for group in buckets.values())
        plan = " + ".join(
            f"{len(group)} × {size:,}" + (" together" if len(group) > 1 else " alone")
            for size, group in buckets.items()
        )
        figures.append(
            Figure(
                "batching.padded_batch_ms",
                f"padded mixed batch on {example.model}",
                mixed,
                "accelerator-ms",
                f"all {members} as one batch padded to {longest:,} input tokens: prefill pays n × longest",
                decimals=1,
            )
        )
        figures.append(
            Figure(
                "batching.bucketed_ms",
                f"bucketed dispatch on {example.model}",
                bucketed,
                "accelerator-ms",
                f"one batch per input length: {plan}",
                decimals=1,
            )
        )
        ratio = _ratio(mixed, bucketed)
        figures.append(
            Figure(
                "batching.padding_cost_ratio",
                "padded / bucketed cost",
                ratio,
                "×",
                "what mixing the shapes costs over bucketing them"
                if ratio is not None
                else "n/a: the bucketed dispatch costs 0 accelerator-ms (profile declares no cost)",
                decimals=3,
            )
        )
    if not figures:
        return None
    return Section("Scheduling and batching", tuple(figures))


def _quality_section(w: Workload, demand: _Demand) -> Section:
    figures: list[Figure] = []
    surge = w.overload.surge_factor
    surge_demand = 0.0
    for cls in w.classes.values():
        surge_demand += (
            cls.rate_per_s * surge * w.models[cls.model].accelerator_ms(cls.input_tokens, cls.output_tokens)
        )
    capacity = demand.fleet * demand.per_device
    figures.append(
        Figure(
            "overload.surge_demand",
            "surge demand",
            surge_demand,
            "accelerator-ms/s",
            f"offered demand at {_n(surge, 2)}× arrivals, everything on its primary model",
            decimals=1,
        )
    )
    surge_pct = surge_demand / capacity * 100
    figures.append(
        Figure(
            "overload.surge_pct",
            "surge, share of protected",
            surge_pct,
            "%",
            f"of {demand.fleet} devices' protected envelope: "
            + ("the same fleet cannot preserve all work" if surge_pct > 100 else "fits without degradation"),
            decimals=2,
        )
    )
    figures.append(
        Figure(
            "overload.surge_min_devices",
            "devices at surge, no fallback",
            _ceil(surge_demand / demand.per_device),
            "devices",
            f"ceil({_n(surge_demand)} / {_n(demand.per_device)}): the fleet surge needs without degrading",
        )
    )
    saving = 0.0
    for name, share in w.overload.fallback_share.items():
        cls = w.classes[name]
        assert cls.fallback is not None  # checked at load
        primary = w.models[cls.model]
        fallback = w.models[cls.fallback]
        primary_ms = primary.accelerator_ms(cls.input_tokens, cls.output_tokens)
        fallback_ms = fallback.accelerator_ms(cls.input_tokens, cls.output_tokens)
        routed = cls.rate_per_s * surge * share
        quality = ""
        eligible = True
        if fallback.quality_score is not None and fallback.quality_floor is not None:
            eligible = fallback.quality_score >= fallback.quality_floor
            quality = (
                f"; quality {_n(fallback.quality_score, 3)} ≥ floor {_n(fallback.quality_floor, 3)}"
                if eligible
                else f"; quality {_n(fallback.quality_score, 3)} BELOW floor "
                f"{_n(fallback.quality_floor, 3)}: route unavailable, not counted"
            )
        else:
            quality = "; no quality floor declared: eligibility unproven"
        class_saving = routed * (primary_ms - fallback_ms) if eligible else 0.0
        saving += class_saving
        figures.append(
            Figure(
                f"overload.saving.{name}",
                f"fallback saving: {name}",
                class_saving,
                "accelerator-ms/s",
                f"{_n(share * 100)} % of {_n(cls.rate_per_s * surge)} req/s to "
                f"{cls.fallback} × ({_ms(primary_ms)} - {_ms(fallback_ms)}) ms{quality}",
                decimals=1,
            )
        )
    routed_note = (
        "eligible requests only; the fallback must already be warm"
        if w.overload.fallback_share
        else "no fallback_share declared"
    )
    figures.append(
        Figure(
            "overload.fallback_saving",
            "modeled fallback saving",
            saving,
            "accelerator-ms/s",
            f"sum of per-class savings at surge ({routed_note})",
            decimals=1,
        )
    )
    remaining = surge_demand - saving
    figures.append(
        Figure(
            "overload.remaining_demand",
            "surge demand after fallback",
            remaining,
            "accelerator-ms/s",
            "surge demand - modeled saving",
            decimals=1,
        )
    )
    remaining_pct = remaining / capacity * 100
    verdict = (
        "fits, but queue and failure evidence is still needed"
        if remaining_pct <= 100
        else "still OVER: defer async/batch work, then reject new interactive work early"
    )
    figures.append(
        Figure(
            "overload.remaining_pct",
            "after fallback, share of protected",
            remaining_pct,
            "%",
            f"of {demand.fleet} devices' protected envelope: {verdict}",
            decimals=3,
        )
    )
    figures.append(
        Figure(
            "overload.remaining_min_devices",
            "devices at surge with fallback",
            _ceil(remaining / demand.per_device),
            "devices",
            f"ceil({_n(remaining)} / {_n(demand.per_device)}); void if fallback quality fails its floor",
        )
    )
    return Section("Quality and overload", tuple(figures))


def _cost(w: Workload, model: str, cls: RequestClass) -> float:
    return w.models[model].accelerator_ms(cls.input_tokens, cls.output_tokens)


def _combination_sections(w: Workload, demand: _Demand) -> list[Section]:
    """The seed's combined bottlenecks, one section each (surge plus fallback from the
    overload figures). Each figure is the combination's arithmetic on the fixture; the
    simulator's scenarios (examples/orchid/simulate/combined-*.yaml) say whether a fleet held it."""
    sections: list[Section] = []
    combined = w.combinations or Combinations()
    protected = demand.fleet * demand.per_device
    raw = demand.fleet * MS_PER_S
    gib = 1024**3
    if combined.shadow is not None:
        shadow = combined.shadow
        mirrored = sum(
            cls.rate_per_s
            * shadow.share
            * w.models[shadow.model].accelerator_ms(cls.input_tokens, cls.output_tokens)
            for cls in w.classes.values()
        )
        total = demand.offered + mirrored
        sections.append(
            Section(
                "Combination: normal traffic plus shadow",
                (
                    Figure(
                        "combination.shadow.demand",
                        "shadow demand",
                        mirrored,
                        "accelerator-ms/s",
                        f"{_n(shadow.share * 100)} % of every class's requests mirrored, priced on "
                        f"{shadow.model}",
                        decimals=1,
                    ),
                    Figure(
                        "combination.shadow.total_demand",
                        "normal plus shadow",
                        total,
                        "accelerator-ms/s",
                        f"{_n(demand.offered)} + {_n(mirrored)}",
                        decimals=1,
                    ),
                    Figure(
                        "combination.shadow.protected_pct",
                        "normal plus shadow, share of protected",
                        total / protected * 100,
                        "%",
                        f"of {demand.fleet} devices' protected envelope: "
                        + (
                            "over it: shadow may run only on idle devices and stops at ladder step 1"
                            if total > protected
                            else "fits"
                        ),
                        decimals=2,
                    ),
                    Figure(
                        "combination.shadow.raw_pct",
                        "normal plus shadow, share of raw",
                        total / raw * 100,
                        "%",
                        f"of {demand.fleet} devices' raw time: what is left idle for the mirror",
                        decimals=2,
                    ),
                ),
            )
        )
    if combined.version_overlap is not None:
        overlap = combined.version_overlap
        cls = w.classes[overlap.long_class]
        device = DeviceMemory.from_gib(w.device.memory_gib, w.device.runtime_reserve_gib)
        resident_models = dict.fromkeys(
            m for c in w.classes.values() for m in (c.model, c.fallback) if m is not None
        )
        resident = sum(w.models[m].resident_weights_bytes for m in resident_models)
        resident += w.models[overlap.candidate].resident_weights_bytes
        left = device.live_room_bytes(resident)
        per_token = w.models[cls.model].live_cache_bytes_per_token
        tokens = math.floor(left / per_token) if per_token > 0 and left > 0 else 0
        sequence = cls.input_tokens + cls.output_tokens
        live = cls.rate_per_s * _cost(w, cls.model, cls) / MS_PER_S / demand.fleet
        sections.append(
            Section(
                "Combination: version overlap plus long sequences",
                (
                    Figure(
                        "combination.version_overlap.resident_gib",
                        "resident weights, both versions",
                        resident / gib,
                        "GiB",
                        f"{' + '.join(resident_models)} + candidate (as {overlap.candidate}) on each device",
                        decimals=2,
                    ),
                    Figure(
                        "combination.version_overlap.live_state_gib",
                        "left for live state",
                        left / gib,
                        "GiB",
                        f"{_n(w.device.memory_gib)} device - {_n(w.device.runtime_reserve_gib)} reserve - "
                        "resident weights",
                        decimals=2,
                    ),
                    Figure(
                        "combination.version_overlap.live_tokens",
                        "live tokens, ceiling",
                        tokens,
                        "tokens",
                        f"floor(left / {per_token:,} B per token of {cls.model})",
                    ),
                    Figure(
                        "combination.version_overlap.long_sequences",
                        f"{overlap.long_class} sequences per device",
                        math.floor(tokens / sequence) if sequence else 0,
                        "sequences",
                        f"floor(live tokens / {sequence:,} tokens ({cls.input_tokens:,} in + "
                        f"{cls.output_tokens:,} out))",
                    ),
                    Figure(
                        "combination.version_overlap.long_live",
                        f"{overlap.long_class} sequences live per device",
                        live,
                        "sequences",
                        f"{_n(cls.rate_per_s)} req/s × {_ms(_cost(w, cls.model, cls))} ms / "
                        f"{demand.fleet} devices (Little's law, execution only)",
                        decimals=3,
                    ),
                ),
            )
        )
    if combined.device_group_loss is not None:
        loss = combined.device_group_loss
        surviving = demand.fleet * (loss.groups - 1) / loss.groups
        saving = 0.0
        for name, share in w.overload.fallback_share.items():
            cls = w.classes[name]
            assert cls.fallback is not None
            saving += cls.rate_per_s * share * (_cost(w, cls.model, cls) - _cost(w, cls.fallback, cls))
        figures = [
            Figure(
                "combination.device_group_loss.surviving_devices",
                "devices after one group is lost",
                surviving,
                "devices",
                f"{demand.fleet} devices in {loss.groups} groups, one lost",
                decimals=0 if surviving.is_integer() else 1,
            ),
            Figure(
                "combination.device_group_loss.protected_pct",
                "normal demand, share of surviving protected",
                demand.offered / (surviving * demand.per_device) * 100,
                "%",
                f"{_n(demand.offered)} / ({_n(surviving)} × {_n(demand.per_device)} ms/s)",
                decimals=2,
            ),
            Figure(
                "combination.device_group_loss.raw_pct",
                "normal demand, share of surviving raw",
                demand.offered / (surviving * MS_PER_S) * 100,
                "%",
                f"{_n(demand.offered)} / ({_n(surviving)} × 1,000 ms/s): over 100 % it cannot all run at all",
                decimals=2,
            ),
            Figure(
                "combination.device_group_loss.fallback_pct",
                "with the fallback shares, of surviving protected",
                (demand.offered - saving) / (surviving * demand.per_device) * 100,
                "%",
                f"normal demand - {_n(saving)} ms/s saved by the overload fallback shares at 1×",
                decimals=2,
            ),
        ]
        loaded = dict.fromkeys(m for c in w.classes.values() for m in (c.model, c.fallback) if m is not None)
        for model in loaded:
            profile = w.models[model]
            weights_s = profile.resident_weights_bytes / gib / loss.load_gib_per_s
            warm_ms = sum(
                profile.accelerator_ms(s.input_tokens, s.output_tokens) * s.repeat for s in loss.warmup
            )
            figures.append(
                Figure(
                    f"combination.cold_load.{model}",
                    f"cold load: {model}",
                    weights_s + warm_ms / MS_PER_S,
                    "s",
                    f"{_n(profile.resident_weights_bytes / gib, 2)} GiB / {_n(loss.load_gib_per_s)} GiB/s + "
                    f"warm-up {_ms(warm_ms)} ms ({sum(s.repeat for s in loss.warmup)} requests): "
                    "not ready before",
                    decimals=3,
                )
            )
        sections.append(Section("Combination: one device-group loss plus cold load", tuple(figures)))
    if w.overload.fallback_share:
        surge = w.overload.surge_factor
        arriving = sum(c.rate_per_s for c in w.classes.values()) * surge
        routed = sum(
            w.classes[n].rate_per_s * surge * share for n, share in w.overload.fallback_share.items()
        )
        surge_demand = sum(c.rate_per_s * surge * _cost(w, c.model, c) for c in w.classes.values())
        sections.append(
            Section(
                "Combination: surge plus fallback",
                (
                    Figure(
                        "combination.surge_fallback.raw_pct",
                        "surge, share of raw",
                        surge_demand / raw * 100,
                        "%",
                        f"{_n(surge_demand)} / ({demand.fleet} × 1,000 ms/s); the rest of the figures: "
                        "Quality and overload",
                        decimals=2,
                    ),
                    Figure(
                        "combination.surge_fallback.fallback_request_pct",
                        "surge requests on the fallback",
                        routed / arriving * 100 if arriving else 0.0,
                        "%",
                        f"{_n(routed)} of {_n(arriving)} req/s by the fallback shares: the most the plan "
                        "degrades",
                        decimals=2,
                    ),
                ),
            )
        )
    if combined.upstream_dwell is not None and w.deadline is not None:
        upstream = combined.upstream_dwell
        cls = w.classes[upstream.request_class]
        slack = w.deadline.budget().slack_ms
        figures = [
            Figure(
                "combination.upstream_dwell.slack_ms",
                "slack of the teaching request",
                slack,
                "ms",
                f"the scheduling section's max batch wait; dwell cap {_n(upstream.dwell_cap_ms)} ms",
                decimals=1,
            )
        ]
        gain: float = _cost(w, cls.model, cls) - _cost(w, cls.fallback, cls) if cls.fallback else 0.0
        for extra in upstream.extra_ms:
            remaining_ms = slack - extra
            if remaining_ms >= upstream.dwell_cap_ms:
                verdict = "the dwell cap still fits: serve as usual"
            elif remaining_ms >= 0:
                verdict = "under the dwell cap: dispatch at once, no batch wait"
            elif cls.fallback and remaining_ms + gain >= 0:
                verdict = f"negative on {cls.model}: only {cls.fallback} can finish in time"
            else:
                verdict = "negative: admission must refuse early"
            key = f"{_n(extra)}ms"
            figures.append(
                Figure(
                    f"combination.upstream_dwell.slack_ms.{key}",
                    f"slack, upstream +{_n(extra)} ms",
                    remaining_ms,
                    "ms",
                    f"{_n(slack)} - {_n(extra)}: {verdict}",
                    decimals=1,
                )
            )
            if cls.fallback:
                figures.append(
                    Figure(
                        f"combination.upstream_dwell.fallback_slack_ms.{key}",
                        f"slack on {cls.fallback}, +{_n(extra)} ms",
                        remaining_ms + gain,
                        "ms",
                        f"+ ({_ms(_cost(w, cls.model, cls))} - {_ms(_cost(w, cls.fallback, cls))}) ms of "
                        "execution saved",
                        decimals=1,
                    )
                )
        sections.append(Section("Combination: feature latency plus batch dwell", tuple(figures)))
    return sections


def compute_worksheet(workload: Workload, *, source: str = "") -> Worksheet:
    """Pure arithmetic: the worksheet figures of ``workload``."""
    execution, demand = _execution_section(workload)
    sections = [_workload_section(workload), execution, _memory_section(workload)]
    scheduling = _scheduling_section(workload)
    if scheduling is not None:
        sections.append(scheduling)
    sections.append(_quality_section(workload, demand))
    sections.extend(_combination_sections(workload, demand))
    return Worksheet(tuple(sections), source)


def with_upstream(worksheet: Worksheet, workload: Workload, gateway: Path) -> Worksheet:
    """``worksheet`` and the Upstream/downstream section of the gateway config ``gateway``
    (``orchid_tools.capacity_features``): its routes' feature contracts and sources, at the
    workload's rates for classes calling those routes."""
    from gateway.config import load_gateway_config, load_routes
    from orchid_tools.capacity_features import route_rates, upstream_section

    config = load_gateway_config(gateway)
    routes = load_routes(config.routes_dir)
    rates = route_rates({name: (c.model, c.rate_per_s) for name, c in workload.classes.items()})
    section = upstream_section(config, routes, rates)
    if section is None:
        return worksheet
    return Worksheet((*worksheet.sections, section), worksheet.source)


# --------------------------------------------------------------------------- parallel topology

TOPOLOGY_TITLE = "Parallel topology"


@dataclass(frozen=True, slots=True)
class PlacedModel:
    """One backend model on a backend with a topology: its route profile, layout and units."""

    model: str  # the backend model
    routes: tuple[str, ...]  # the routes that run it there
    profile_name: str
    profile: DemandProfile
    layout: Layout
    declared: bool  # its layout is declared (else one device per unit)
    units: tuple[Unit, ...]

    @property
    def width(self) -> int:
        return self.layout.width

    @property
    def resident_per_device(self) -> int:
        """What each device of a unit keeps of it: 1/width of its weights and workspace,
        rounded up (as ``PoolRegistry.queue_for`` places it)."""
        return -(-resident_bytes(self.profile) // self.width)


@dataclass(frozen=True, slots=True)
class BackendTopology:
    """A backend that declares a topology, with every model placed on its devices."""

    backend: str
    source: str  # "backends" | "local_triton"
    topology: Topology
    memory_gib: float
    reserve_gib: float
    time_scale: float
    protected_utilization: float
    lost: tuple[int, ...]  # lost at start (``topology.lost``)
    models: tuple[PlacedModel, ...]

    @property
    def devices(self) -> int:
        return self.topology.devices

    @property
    def memory(self) -> DeviceMemory:
        return DeviceMemory.from_gib(self.memory_gib, self.reserve_gib)

    @property
    def resident_per_device(self) -> int:
        """Bytes resident on each device: every model's share (the devices are shared)."""
        return sum(m.resident_per_device for m in self.models)

    @property
    def live_room_per_device(self) -> int:
        return self.memory.live_room_bytes(self.resident_per_device)

    def capacity_devices(self, model: PlacedModel, lost: Iterable[int] = ()) -> int:
        """The devices of ``model``'s units with no lost device (what the ladder counts)."""
        gone = {*self.lost, *lost}
        return sum(len(u.devices) for u in available(model.units, gone))

    def envelope_ms_per_s(self, model: PlacedModel, lost: Iterable[int] = ()) -> float:
        return protected_capacity_ms_per_s(self.capacity_devices(model, lost), self.protected_utilization)

    def losses(self) -> list[DomainLoss]:
        return domain_losses(self.topology, {m.model: m.units for m in self.models})


def _models_on(
    name: str, repository: Path | None, routes: RouteTable, loaded: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """backend model -> the routes that run it on backend ``name`` (a route with no
    ``backends`` runs on every backend; the embedded Triton serves what its repository has,
    or only ``loaded``: its ``load_models`` under ``model_control: explicit``)."""
    placed: dict[str, list[str]] = {}
    for route_name, route in routes.models.items():
        if route.backends and name not in route.backends:
            continue
        if repository is not None and repository.is_dir() and not (repository / route.backend_model).is_dir():
            continue
        if loaded and route.backend_model not in loaded:
            continue
        placed.setdefault(route.backend_model, []).append(route_name)
    return placed


def backend_topologies(config: GatewayConfig, routes: RouteTable) -> tuple[BackendTopology, ...]:
    """Every served backend that declares a topology (the embedded Triton as ``local``, which
    replaces a configured backend of that name, as ``serve`` does), with its models placed."""
    from gateway.server import LOCAL_BACKEND

    found: dict[str, BackendTopology] = {}
    entries: list[tuple[str, str, TopologyConfig | None, int, float, float, float, Path | None]] = [
        (
            b.name,
            "backends",
            b.topology,
            b.devices,
            b.device_memory_gib,
            b.runtime_reserve_gib,
            b.time_scale,
            None,
        )
        for b in config.backends
    ]
    local = config.local_triton
    if local is not None:
        entries = [e for e in entries if e[0] != LOCAL_BACKEND]
        entries.append(
            (
                LOCAL_BACKEND,
                "local_triton",
                local.topology,
                local.devices,
                local.device_memory_gib,
                local.runtime_reserve_gib,
                local.time_factor if local.time_factor > 0 else 1e-3,  # as serve prices it
                local.model_repository,
            )
        )
    explicit = local.load_models if local is not None and local.model_control == "explicit" else ()
    for name, source, declared, devices, memory_gib, reserve_gib, time_scale, repository in entries:
        if declared is None:
            continue
        models = []
        loaded = explicit if source == "local_triton" else ()
        for model, route_names in _models_on(name, repository, routes, loaded).items():
            profile_name = routes.models[route_names[0]].profile
            models.append(
                PlacedModel(
                    model=model,
                    routes=tuple(route_names),
                    profile_name=profile_name,
                    profile=routes.profiles[profile_name],
                    layout=declared.layout_of(model),
                    declared=model in declared.models,
                    units=declared.units_of(devices, model),
                )
            )
        found[name] = BackendTopology(
            backend=name,
            source=source,
            topology=declared.topology(devices),
            memory_gib=memory_gib,
            reserve_gib=reserve_gib,
            time_scale=time_scale,
            protected_utilization=config.protected_utilization,
            lost=declared.lost_devices(),
            models=tuple(models),
        )
    return tuple(found.values())


def _devices(devices: Iterable[int]) -> str:
    listed = ", ".join(str(d) for d in devices)
    return listed or "none"


def _where(topology: Topology, unit: Unit) -> str:
    """The link group and domains a unit lies in (``spans`` when it crosses several)."""
    parts = []
    links = sorted({n for d in unit.devices for n, ds in topology.links.items() if d in ds})
    if links:
        parts.append(f"link group {' + '.join(links)}")
    for kind, names in topology.domains.items():
        inside = sorted({n for d in unit.devices for n, ds in names.items() if d in ds})
        if inside:
            parts.append(f"{kind} {' + '.join(inside)}")
    return "; ".join(parts)


def _shapes(workload: Workload | None) -> dict[str, tuple[int, int]]:
    """The workload's request shapes, by class (the first class of each shape)."""
    shapes: dict[str, tuple[int, int]] = {}
    if workload is not None:
        for name, cls in workload.classes.items():
            shape = (cls.input_tokens, cls.output_tokens)
            if shape not in shapes.values():
                shapes[name] = shape
    return shapes


def _cold_load(workload: Workload | None) -> GroupLossCombination | None:
    combined = workload.combinations if workload is not None else None
    return combined.device_group_loss if combined is not None else None


def _warmup_ms(b: BackendTopology, m: PlacedModel, loss: GroupLossCombination) -> float:
    """Wall ms of the warm-up shapes run one after another on a unit of ``m``."""
    return sum(
        m.layout.latency_ms(
            m.profile.accelerator_ms(s.input_tokens, s.output_tokens)
            * b.time_scale
            * m.layout.profile_scale()
        )
        * s.repeat
        for s in loss.warmup
    )


def _topology_figures(b: BackendTopology, workload: Workload | None) -> list[Figure]:
    key = f"topology.{b.backend}"
    pu = b.protected_utilization
    figures = [
        Figure(
            f"{key}.devices",
            f"{b.backend}: devices",
            b.devices,
            "devices",
            f"{b.source}: {_n(b.memory_gib, 2)} GiB each, {_n(b.reserve_gib, 2)} GiB runtime reserve; "
            f"lost at start: {_devices(b.lost)}; every model below runs on these same devices",
        )
    ]
    for kind, names in b.topology.domains.items():
        figures.append(
            Figure(
                f"{key}.domains.{kind}",
                f"{b.backend}: {kind} domains",
                len(names),
                "",
                "; ".join(f"{n}: devices {_devices(ds)}" for n, ds in names.items())
                + " (failure domains: losing one takes all its devices)",
            )
        )
    if not b.topology.domains:
        figures.append(Figure(f"{key}.domains", f"{b.backend}: failure domains", 0, "", "none declared"))
    groups = (
        "; ".join(f"{n}: devices {_devices(ds)}" for n, ds in b.topology.links.items())
        + " (a unit is packed inside one)"
        if b.topology.links
        else "none declared: units are packed inside one host"
        if "host" in b.topology.domains
        else "none declared and no hosts: units are packed over all devices"
    )
    figures.append(Figure(f"{key}.links", f"{b.backend}: link groups", len(b.topology.links), "", groups))
    # Memory: every model is resident on every device (shared devices), each as its unit's share.
    shares = " + ".join(f"{m.model} {_n(m.resident_per_device / GIB, 2)}" for m in b.models)
    figures.append(
        Figure(
            f"{key}.resident_per_device",
            f"{b.backend}: resident per device",
            b.resident_per_device,
            "B",
            f"{_n(b.resident_per_device / GIB, 2)} GiB = {shares or 'nothing'} GiB: every model on the "
            "backend holds its share (weights and workspace / width) on every device",
        )
    )
    room = b.live_room_per_device
    fits = "for live sequence state" if room >= 0 else "DOES NOT FIT: the resident shares exceed the device"
    figures.append(
        Figure(
            f"{key}.live_room_per_device",
            f"{b.backend}: live room per device",
            room,
            "B",
            f"{_n(room / GIB, 2)} GiB = {_n(b.memory_gib, 2)} device - {_n(b.reserve_gib, 2)} reserve - "
            f"{_n(b.resident_per_device / GIB, 2)} resident GiB: {fits}",
        )
    )
    shapes = _shapes(workload)
    scale = f" × time scale {_n(b.time_scale, 3)}" if b.time_scale != 1.0 else ""
    for m in b.models:
        mk = f"{key}.{m.model}"
        layout = m.layout
        how = (
            f"data_parallel {layout.data_parallel}"
            if layout.data_parallel is not None
            else "all that fit"
            if layout.units is None
            else "spelled out"
        )
        stage_text = f"{layout.stages} stage" + ("s" if layout.stages > 1 else "")
        declared = "declared" if m.declared else "no layout declared: one device per unit"
        figures.append(
            Figure(
                f"{mk}.width",
                f"{m.model}: devices per unit",
                m.width,
                "devices",
                f"tensor_parallel {layout.tensor_parallel} × {stage_text} ({declared}); routes "
                f"{', '.join(m.routes)}, profile {m.profile_name}",
            )
        )
        figures.append(
            Figure(
                f"{mk}.units",
                f"{m.model}: units (data-parallel)",
                len(m.units),
                "units",
                f"{how}: "
                + "; ".join(f"{u.name.rsplit('/', 1)[-1]} [{_devices(u.devices)}]" for u in m.units),
            )
        )
        for u in m.units:
            stages = (
                " | ".join(f"stage {i + 1}: {_devices(s)}" for i, s in enumerate(u.stages))
                if len(u.stages) > 1
                else ""
            )
            where = "; ".join(x for x in (stages, _where(b.topology, u)) if x)
            figures.append(
                Figure(
                    f"{mk}.{u.name.rsplit('/', 1)[-1]}",
                    f"{u.name}: devices",
                    len(u.devices),
                    "devices",
                    f"devices {_devices(u.devices)}" + (f"; {where}" if where else ""),
                )
            )
        resident = resident_bytes(m.profile)
        figures.append(
            Figure(
                f"{mk}.resident_per_device",
                f"{m.model}: resident per device",
                m.resident_per_device,
                "B",
                f"{resident:,} B (weights + workspace of {m.profile_name}) / {m.width} devices per unit = "
                f"{_n(m.resident_per_device / GIB, 2)} GiB on each device",
            )
        )
        per_token = m.profile.live_cache_bytes_per_token
        tokens = live_tokens(max(room, 0) * m.width, per_token)
        figures.append(
            Figure(
                f"{mk}.live_tokens_per_unit",
                f"{m.model}: live tokens per unit",
                tokens,
                "tokens",
                f"floor({_n(room / GIB, 2)} GiB live room × {m.width} devices / {per_token:,} B per token): "
                "each device holds 1/width of a token's state; shared with the other models' work"
                if tokens is not None
                else "n/a: live_cache_bytes_per_token is not declared (0), so memory does not bound tokens",
            )
        )
        devices_counted = b.capacity_devices(m)
        envelope = b.envelope_ms_per_s(m)
        figures.append(
            Figure(
                f"{mk}.envelope",
                f"{m.model}: protected envelope",
                envelope,
                "accelerator-ms/s",
                f"{devices_counted} devices of its available units × 1,000 × {_n(pu, 2)} protected "
                "utilization: the pool's ladder capacity",
                decimals=0 if envelope.is_integer() else 1,
            )
        )
        if not shapes:
            figures.append(
                Figure(
                    f"{mk}.execution",
                    f"{m.model}: execution",
                    None,
                    "",
                    "n/a: no request shape: give a workload file (its classes' shapes)",
                )
            )
        units_up = len(available(m.units, b.lost))
        for cls_name, (tokens_in, tokens_out) in shapes.items():
            ck = f"{mk}.{cls_name}"
            profile_ms = m.profile.accelerator_ms(tokens_in, tokens_out) * b.time_scale
            accel = profile_ms * layout.profile_scale()
            wall = layout.latency_ms(accel)
            occupancy = layout.occupancy_ms(accel)
            shape = f"{cls_name} ({tokens_in:,} in / {tokens_out:,} out)"
            figures.append(
                Figure(
                    f"{ck}.wall_ms",
                    f"{m.model}, {cls_name}: wall time",
                    wall,
                    "ms",
                    f"{shape} on one unit: the latency a deadline must leave room for"
                    + (
                        f" ({' + '.join(_ms(x) for x in layout.stage_ms(accel))} over its stages)"
                        if layout.stages > 1
                        else ""
                    ),
                    decimals=2,
                )
            )
            measured = (
                f"{_ms(profile_ms)} profile ms{scale} × {_n(layout.profile_scale(), 3)} "
                f"(= {m.width} devices × cadence factor {_n(layout.cadence_factor, 3)})"
                if layout.measured_as == "wall_ms"
                else f"{_ms(profile_ms)} profile ms{scale}, measured as unit device-ms"
            )
            figures.append(
                Figure(
                    f"{ck}.accelerator_ms",
                    f"{m.model}, {cls_name}: accelerator-ms",
                    accel,
                    "accelerator-ms",
                    f"{measured}: device-ms of the whole unit, what pricing and the quota charge",
                    decimals=2,
                )
            )
            if layout.stages > 1:
                figures.append(
                    Figure(
                        f"{ck}.cadence_ms",
                        f"{m.model}, {cls_name}: pipeline cadence",
                        occupancy,
                        "ms",
                        f"slowest stage share {_n(max(layout.stage_shares), 3)} × (1 + bubble "
                        f"{_n(layout.bubble_fraction, 3)}) × {_ms(wall)} ms: a new request each cadence",
                        decimals=2,
                    )
                )
            unit_rps = _ratio(MS_PER_S, occupancy)
            figures.append(
                Figure(
                    f"{ck}.unit_rps",
                    f"{m.model}, {cls_name}: per unit",
                    unit_rps,
                    "req/s",
                    f"1,000 / {_ms(occupancy)} ms {'cadence' if layout.stages > 1 else 'held'}: one request "
                    "binds a whole unit, batch of one, at full use"
                    if unit_rps is not None
                    else "n/a: the profile costs 0 ms",
                    decimals=1,
                )
            )
            figures.append(
                Figure(
                    f"{ck}.pool_rps",
                    f"{m.model}, {cls_name}: per pool",
                    None if unit_rps is None else unit_rps * units_up,
                    "req/s",
                    f"{units_up} available units × per unit (raw: no protected margin)",
                    decimals=1,
                )
            )
            protected_rps = _ratio(envelope, accel)
            figures.append(
                Figure(
                    f"{ck}.envelope_rps",
                    f"{m.model}, {cls_name}: protected",
                    protected_rps,
                    "req/s",
                    f"{_n(envelope)} accelerator-ms/s envelope / {_ms(accel)} accelerator-ms"
                    if protected_rps is not None
                    else "n/a: the profile costs 0 ms",
                    decimals=1,
                )
            )
    load = _cold_load(workload)
    for loss in b.losses():
        lk = f"{key}.loss.{loss.kind}.{loss.name}"
        figures.append(
            Figure(
                f"{lk}.devices",
                f"lose {loss.kind} {loss.name}: devices",
                len(loss.devices),
                "devices",
                f"one domain loss (plus cold load): devices {_devices(loss.devices)} of {b.devices} go",
            )
        )
        figures.append(
            Figure(
                f"{lk}.stranded",
                f"lose {loss.kind} {loss.name}: stranded",
                len(loss.stranded),
                "devices",
                f"healthy devices of a lost unit, counted by none of its layout: {_devices(loss.stranded)}",
            )
        )
        for m in b.models:
            lost_units = loss.units_lost.get(m.model, ())
            taken = ", ".join(u.rsplit("/", 1)[-1] for u in lost_units) or "none"
            figures.append(
                Figure(
                    f"{lk}.{m.model}.units_lost",
                    f"lose {loss.name}: {m.model} units lost",
                    len(lost_units),
                    "units",
                    f"{taken}; {loss.units_left.get(m.model, len(m.units))} of {len(m.units)} left",
                )
            )
            left_devices = b.capacity_devices(m, loss.devices)
            left = b.envelope_ms_per_s(m, loss.devices)
            figures.append(
                Figure(
                    f"{lk}.{m.model}.envelope",
                    f"lose {loss.name}: {m.model} envelope left",
                    left,
                    "accelerator-ms/s",
                    f"{left_devices} devices of its units left × 1,000 × {_n(pu, 2)}"
                    + (": NO UNIT LEFT, the pool refuses its work" if left_devices == 0 else ""),
                    decimals=0 if left.is_integer() else 1,
                )
            )
        lost_models = [m for m in b.models if loss.units_lost.get(m.model)]
        if load is None:
            figures.append(
                Figure(
                    f"{lk}.cold_load_s",
                    f"lose {loss.name}: cold load",
                    None,
                    "s",
                    "not declared: the workload's combinations.device_group_loss gives the load "
                    "bandwidth (load_gib_per_s) and warm-up shapes",
                )
            )
            continue
        total_bytes = b.resident_per_device
        load_s = total_bytes / GIB / load.load_gib_per_s
        warm_ms = sum(_warmup_ms(b, m, load) for m in lost_models)
        reloaded = ", ".join(m.model for m in lost_models) or "none"
        figures.append(
            Figure(
                f"{lk}.cold_load_s",
                f"lose {loss.name}: cold load",
                load_s + warm_ms / MS_PER_S,
                "s",
                f"each returning device reloads every model's share, {_n(total_bytes / GIB, 2)} GiB / "
                f"{_n(load.load_gib_per_s)} GiB/s (per device, in parallel), + warm-up "
                f"{_ms(warm_ms)} ms on the lost units of {reloaded}: "
                "the units are not back before",
                decimals=3,
            )
        )
    return figures


def topology_section(
    config: GatewayConfig, routes: RouteTable, workload: Workload | None = None
) -> Section | None:
    """The "Parallel topology" section of every backend with a topology; None when none has one."""
    figures: list[Figure] = []
    for backend in backend_topologies(config, routes):
        figures.extend(_topology_figures(backend, workload))
    return Section(TOPOLOGY_TITLE, tuple(figures)) if figures else None


def _insert_topology(
    worksheet: Worksheet,
    section: Section,
    after: Sequence[str] = ("Scheduling and batching", "Memory (one replica per device)"),
) -> Worksheet:
    """After Scheduling and batching (else after Memory), where the seed's worksheet puts it
    (or after the first of ``after`` present; else last)."""
    titles = [s.title for s in worksheet.sections]
    index = len(titles)
    for title in after:
        if title in titles:
            index = titles.index(title) + 1
            break
    sections = list(worksheet.sections)
    sections.insert(index, section)
    return Worksheet(tuple(sections), worksheet.source)


def with_gateway(worksheet: Worksheet, workload: Workload | None, gateway: Path) -> Worksheet:
    """``worksheet`` with the gateway config's sections: Parallel topology (after Scheduling
    and batching), Prefix cache (after it) and Upstream/downstream (last)."""
    from gateway.config import load_gateway_config, load_routes, route_error
    from orchid_tools.capacity_features import route_rates, upstream_section
    from orchid_tools.capacity_prefix import prefix_section

    config = load_gateway_config(gateway)
    routes = load_routes(config.routes_dir)
    for name, route in routes.models.items():  # as serve refuses it (gateway.config.check_references)
        if route.features is not None and route.features.source not in config.feature_sources:
            raise route_error(
                config.routes_dir,
                ("models", name, "features", "source"),
                f"unknown feature source {route.features.source!r} "
                f"(declared in {gateway}: {', '.join(config.feature_sources) or 'none'})",
            )
    topology = topology_section(config, routes, workload)
    if topology is not None:
        worksheet = _insert_topology(worksheet, topology)
    prefix = prefix_section(config, routes, workload)
    if prefix is not None:
        worksheet = _insert_topology(
            worksheet, prefix, (TOPOLOGY_TITLE, "Scheduling and batching", "Memory (one replica per device)")
        )
    classes = workload.classes if workload is not None else {}
    rates = route_rates({name: (c.model, c.rate_per_s) for name, c in classes.items()})
    upstream = upstream_section(config, routes, rates)
    if upstream is not None:
        worksheet = Worksheet((*worksheet.sections, upstream), worksheet.source)
    return worksheet


# --------------------------------------------------------------------------- rendering


def render_text(worksheet: Worksheet) -> str:
    """An aligned table: section headings, then label | value unit | meaning."""
    figures = worksheet.figures
    lines = [f"Capacity worksheet: {worksheet.source}" if worksheet.source else "Capacity worksheet"]
    if not figures:
        return (
            "\n".join(
                [*lines, "", "no section: the gateway config declares no topology, prefix cache or features"]
            )
            + "\n"
        )
    label_width = max(len(f.label) for f in figures)
    value_width = max(len(f.display) for f in figures)
    for section in worksheet.sections:
        lines.append("")
        lines.append(section.title)
        for f in section.figures:
            lines.append(f"  {f.label:<{label_width}}  {f.display:>{value_width}}  {f.explanation}".rstrip())
    return "\n".join(lines) + "\n"


def render_json(worksheet: Worksheet) -> str:
    return json.dumps(worksheet.as_json(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        help="workload description (YAML), e.g. examples/orchid/workload.yaml (optional with --gateway)",
    )
    parser.add_argument("--json", action="store_true", help="emit the figures as JSON instead of a table")
    parser.add_argument(
        "--gateway",
        type=Path,
        metavar="CONFIG",
        help="a gateway config: add the Parallel topology section (backends with a topology), the Prefix "
        "cache section (routes whose model declares one) and the Upstream/downstream section (feature "
        "sources and routes)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the worksheet; 2 (with ``FILE: key.path: problem`` on stderr) for a bad file."""
    gateway = getattr(args, "gateway", None)
    workload: Workload | None = None
    if args.file is None:
        if gateway is None:
            print(
                "orchid-gateway capacity: give a workload file, a --gateway config, or both", file=sys.stderr
            )
            return 2
        worksheet = Worksheet((), str(gateway))
    else:
        try:
            workload = load_workload(args.file)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
        worksheet = compute_worksheet(workload, source=str(args.file))
    if gateway is not None:
        try:
            worksheet = with_gateway(worksheet, workload, gateway)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
    sys.stdout.write(render_json(worksheet) if args.json else render_text(worksheet))
    return 0
