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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.core.errors import ConfigError
from gateway.core.memory import DeviceMemory, live_tokens
from gateway.core.profile import GIB, batch_accelerator_ms, padding
from gateway.core.record import Budget
from gateway.settings import DemandProfileSchema
from gateway.yaml_source import YamlDocument, YamlError, read_yaml

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


# --------------------------------------------------------------------------- rendering


def render_text(worksheet: Worksheet) -> str:
    """An aligned table: section headings, then label | value unit | meaning."""
    figures = worksheet.figures
    label_width = max(len(f.label) for f in figures)
    value_width = max(len(f.display) for f in figures)
    lines = [f"Capacity worksheet: {worksheet.source}" if worksheet.source else "Capacity worksheet"]
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
    parser.add_argument("file", help="workload description (YAML), e.g. examples/orchid/workload.yaml")
    parser.add_argument("--json", action="store_true", help="emit the figures as JSON instead of a table")
    parser.add_argument(
        "--gateway",
        type=Path,
        metavar="CONFIG",
        help="a gateway config: add the Upstream/downstream section from its feature sources and routes",
    )


def run(args: argparse.Namespace) -> int:
    """Print the worksheet; 2 (with ``FILE: key.path: problem`` on stderr) for a bad file."""
    try:
        workload = load_workload(args.file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    worksheet = compute_worksheet(workload, source=str(args.file))
    gateway = getattr(args, "gateway", None)
    if gateway is not None:
        try:
            worksheet = with_upstream(worksheet, workload, gateway)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
    sys.stdout.write(render_json(worksheet) if args.json else render_text(worksheet))
    return 0
