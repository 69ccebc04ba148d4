"""``orchid-gateway simulate SCENARIO.yaml``: the production runtime, in virtual time.

This module owns the *scenario* schema (a fleet of emulated backends, arrival
classes, phases, faults; tenants, classes and settings by reference to or on top
of a gateway config), its loading with ``file:line:col: key.path: problem``
errors (exit 2), the arrival schedule, the run, and the report (text, ``--json``,
``--plot``, ``--compare-policies``).

How a scenario maps onto the runtime (nothing below is re-implemented here):

* The gateway config (``--config`` or the scenario's ``gateway:``) is loaded with
  ``gateway.config.load_gateway_config``; the scenario's ``settings`` are merged
  into it and validated by the same schema; its backends are replaced by the
  scenario's ``fleet``. Tenants and routes load through ``gateway.server``'s
  ``load_configuration`` (or, for inline ``tenants:``, the same schema and
  cross-checks), policies through ``load_policies`` (``--policies`` overrides the
  directory), and the ``Gateway`` is assembled by ``gateway.server.assemble_gateway``
  over one ``gateway.backends.memory.MemoryBackend`` per fleet entry.
* Tenants' stored key digests are replaced by digests of keys minted here (the
  tenants file holds only digests): every arrival still authenticates through the
  real tenant directory with ``authorization: Bearer <key>`` metadata.
* Everything runs on ``orchid_tools.virtual_time.VirtualTimeLoop``: the ladder and
  statistics loops of ``gateway.server`` (``update_ladders_forever``,
  ``sample_statistics_forever``) at their production intervals, faults as timers,
  and each arrival as ``Gateway.infer(raw, CallContext)`` with a serialized
  ``ModelInferRequest`` built as ``tritonclient`` sends it (token tensor, request
  ``id``, ``orchid.*`` parameters). The caller's gRPC deadline is a timer that
  cancels the call, as grpc.aio cancels a handler whose deadline passed.
* Outcomes come from what the caller sees: the response's provenance
  (``orchid.approximation``) or the error's status and ``orchid-rule``; device
  time from the backends' execution records.
* Faults and changes drive the runtime's own paths: a device group lost (and restored
  warm or *cold*: the backend's models not ready for their ``load_s``, which the gateway
  sees through its readiness checks), slower long requests, a slow upstream stage (the
  caller's deadline partly spent before the gateway), and rollouts started as
  ``orchid-gateway rollout start`` starts them (``gateway.rollouts`` over the emulated
  repository API), with published quality evidence.
* A fleet backend may declare a ``topology`` (the gateway config's schema): its models then
  share its devices as units (dispatch rule 10; the ``MemoryBackend`` holds exactly the unit
  a request names). A ``devices_lost`` fault (``devices`` or a topology ``domain``) loses
  them in the backend at ``at_s`` and tells the gateway (``pools.set_devices_lost``, as the
  admin RPC ``SetDevicesLost`` does) ``detect_after_s`` later; its report entry lists the
  units taken per pool, and each phase reports the pools' available units at its end.
* ``expect:`` bounds a phase's figures; ``check_expectations`` judges them against the
  report (``--check`` exits 1 when one fails). The seed's combined bottlenecks are shipped
  as ``examples/orchid/simulate/combined-*.yaml`` with expectations.

Determinism: arrivals come from ``numpy.random.default_rng([seed, class index])``
(or deterministic spacing), the clock is virtual, and the report carries no
wall-clock value and no request id, with sorted keys and rounded figures: the
same scenario and seed give a byte-identical ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.memory import Execution, MemoryBackend, MemoryModel
from gateway.config import (
    BackendConfig,
    GatewayConfig,
    RouteConfig,
    RouteTable,
    TenantsFile,
    TopologyConfig,
    check_dedicated,
    check_memory,
    check_references,
    hash_api_key,
    load_gateway_config,
    load_routes,
)
from gateway.core.errors import ConfigError, DeadlineExpired, GatewayError, Unavailable, error_for_status
from gateway.core.evidence import Evidence, EvidenceKey
from gateway.core.prefix import (
    SCOPE_PARAMETER,
    TOKEN_BYTES,
    PrefixCacheSpec,
    PrefixMatch,
    block_keys,
    cached_tokens,
)
from gateway.core.rollout import CANARY_REASON, RolloutSpec
from gateway.core.streaming import GapTracker, StreamObjectives, StreamSummary
from gateway.core.topology import TopologyError, parse_devices
from gateway.core.upstream import RULE_BACKPRESSURE
from gateway.evidence import population
from gateway.exchange import BackendHandle, CallContext, GatewayListener
from gateway.messages import flag_response
from gateway.pipeline import Gateway
from gateway.prefix_affinity import reported_tokens
from gateway.rollouts import parse_rollout
from gateway.server import (
    assemble_gateway,
    load_configuration,
    load_policies,
    sample_statistics_forever,
    update_ladders_forever,
)
from gateway.settings import DemandProfileValue
from gateway.shape import prompt_bytes
from gateway.yaml_source import KeyPath, YamlDocument, YamlError, key_path, parse_yaml, read_yaml
from orchid_tools.simulate_features import (
    Entities,
    FeatureLog,
    SourceModel,
    _Keyed,
    entity_bytes,
    install,
    last_refusal_after,
    run_label,
    with_backpressure,
)
from orchid_tools.virtual_time import VirtualTimeLoop

MS_PER_S = 1000.0
TOKEN_VOCAB = 32_000
UNITS_SAMPLE_EARLY_S = 1e-6  # a phase's units are sampled this long before its end
# Gateway rules that refuse a request after it waited in the dispatch queue (bench/surge.py's).
LATE_RULES = frozenset({"queue.latest_start"})
OUTCOMES = ("on_time", "late", "rejected_early", "rejected_late", "missed", "failed")
DEGRADED = ("fallback", "reduced_output")


def degradation(approximation: str) -> str:
    """The report's column for an answer's ``orchid.approximation`` (which may list several,
    e.g. ``fallback,reduced_output``): ``fallback`` if the fallback answered, else
    ``reduced_output`` if its output was capped, else ``none``."""
    parts = approximation.split(",") if approximation else []
    return next((kind for kind in DEGRADED if kind in parts), "none")


# --------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PrefixCacheModel(_Strict):
    """A backend model's prefix cache (``gateway.core.prefix.PrefixCacheSpec``; the capacity
    emulator's ``prefix_block_tokens`` and ``prefix_cache_blocks``)."""

    block_tokens: int = Field(ge=1, description="tokens per cache block")
    capacity_blocks: int = Field(ge=1, description="blocks the cache holds (least recently used evicted)")

    def spec(self) -> PrefixCacheSpec:
        return PrefixCacheSpec(self.block_tokens, self.capacity_blocks)


class FleetModel(_Strict):
    """A backend model the emulated backend serves (what its Triton config would declare)."""

    instances: int | None = Field(default=None, ge=1, description="default: the backend's devices")
    max_batch_size: int | None = Field(default=None, ge=0, description="default 8 (0 for streaming models)")
    profile: str | None = Field(default=None, description="routes profile of its real cost")
    cost: DemandProfileValue | None = Field(
        default=None, description="its real cost, when not a routes profile"
    )
    decoupled: bool | None = Field(default=None, description="streams one response per token")
    load_s: float = Field(
        default=0.0, ge=0, description="load + warm-up before it is ready (a cold restore, a rollout's load)"
    )
    loaded: bool = Field(default=True, description="false: in the repository, loaded only by a rollout")
    prefix_cache: PrefixCacheModel | None = Field(
        default=None, description="the model keeps a prefix cache (the emulator's prefix_block_tokens, ...)"
    )


class FleetBackend(_Strict):
    """One emulated Triton endpoint: a device group in a privacy cell."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    cell: str
    device_group: str | None = Field(default=None, description="default: the backend's name")
    labels: dict[str, str] = {}
    devices: int = Field(ge=1)
    shared_devices: bool = False
    max_inflight_per_device: int = Field(default=2, ge=1)
    time_factor: float = Field(default=1.0, gt=0)
    call_overhead_ms: float = Field(
        default=0.0,
        ge=0,
        description="wall ms per execution beyond the profile (a measured server's or emulator's "
        "own per-call cost), unscaled",
    )
    device_memory_gib: float | None = Field(default=None, gt=0, description="default: the gateway's (80)")
    runtime_reserve_gib: float | None = Field(default=None, ge=0, description="default: the gateway's (6)")
    models: dict[str, FleetModel] = Field(min_length=1)
    topology: TopologyConfig | None = Field(
        default=None,
        description="parallel layouts and failure domains, as the gateway config's (its models then "
        "share its devices: units, gateway.core.topology)",
    )

    @model_validator(mode="after")
    def _topology_fits(self) -> FleetBackend:
        if self.topology is None:
            return self
        for name, layout in self.topology.models.items():
            if name not in self.models:
                raise _Keyed(
                    f"topology.models.{name}", f"not a model of this backend (models: {_known(self.models)})"
                )
            # The emulated backend holds a unit for an execution's wall time, its profile's ms.
            if len(layout.pipeline_stages) > 1 or layout.measured_as != "wall_ms":
                raise _Keyed(
                    f"topology.models.{name}",
                    "the simulator emulates tensor-parallel layouts measured as wall_ms only "
                    "(no pipeline stages, no unit_device_ms)",
                )
        try:
            self.topology.check(self.devices)
        except ValueError as exc:
            raise _Keyed("topology", str(exc)) from None
        return self

    @property
    def shares_devices(self) -> bool:
        """Its models run on the same devices (declared, or implied by a topology)."""
        return self.shared_devices or self.topology is not None

    def units_of(self, model: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(name, devices) of each unit of ``model`` on its topology (one device each without one)."""
        if self.topology is None:
            return tuple((f"{model}/u{d}", (d,)) for d in range(self.devices))
        return tuple((u.name, u.devices) for u in self.topology.units_of(self.devices, model))

    def backend_config(self) -> BackendConfig:
        memory: dict[str, float] = {}
        if self.device_memory_gib is not None:
            memory["device_memory_gib"] = self.device_memory_gib
        if self.runtime_reserve_gib is not None:
            memory["runtime_reserve_gib"] = self.runtime_reserve_gib
        config = BackendConfig(
            name=self.name,
            address=f"memory:{self.name}",
            labels={**self.labels, "cell": self.cell, "device_group": self.device_group or self.name},
            devices=self.devices,
            max_inflight_per_device=self.max_inflight_per_device,
            shared_devices=self.shares_devices,
            time_scale=self.time_factor,
            topology=self.topology,
        )
        return config.model_copy(update=memory) if memory else config


def _range_of(key: str, pair: tuple[float, float]) -> None:
    if pair[0] > pair[1]:
        raise _Keyed(key, f"a range [low, high] with low <= high, got [{pair[0]:g}, {pair[1]:g}]")


class ChatArrivals(_Strict):
    """A tenant's multi-turn chat (``arrivals.NAME.chat``): conversations start as a Poisson
    process; each turn's prompt is the system prompt, every earlier user message and answer,
    and the new user message (the actual tokens: prefix caches see the shared prefix). Turns
    follow each other by a think time from the turn before (open loop: the answer's latency is
    not waited for). Lengths are drawn uniformly from the ``[low, high]`` ranges."""

    system_prompt_tokens: int = Field(default=512, ge=0, description="the tenant's system prompt")
    system_prompt_seed: int | None = Field(
        default=None,
        description="the system prompt's tokens come from this seed alone (two classes giving the "
        "same seed send the same system prompt); default: the scenario's seed and this class",
    )
    turns: tuple[int, int] = Field(description="turns per conversation [low, high]")
    user_tokens: tuple[int, int] = Field(description="tokens of each user message [low, high]")
    answer_tokens: tuple[int, int] = Field(
        description="tokens of each answer [low, high] (orchid.max_output_tokens; the next turns resend it)"
    )
    think_time_s: tuple[float, float] = Field(description="seconds from one turn to the next [low, high]")

    @model_validator(mode="after")
    def _ranges(self) -> ChatArrivals:
        for key in ("turns", "user_tokens", "answer_tokens"):
            pair = getattr(self, key)
            if pair[0] < 1:
                raise _Keyed(key, f"at least 1, got {pair[0]}")
            _range_of(key, pair)
        if self.think_time_s[0] < 0:
            raise _Keyed("think_time_s", f"at least 0, got {self.think_time_s[0]:g}")
        _range_of("think_time_s", self.think_time_s)
        return self

    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2.0

    def mean_input_tokens(self) -> float:
        """A turn's prompt tokens on average over requests (a long conversation sends more)."""
        lengths = range(self.turns[0], self.turns[1] + 1)
        earlier = sum(t * (t - 1) / 2.0 for t in lengths) / sum(lengths)  # E[turn index - 1]
        user = sum(self.user_tokens) / 2.0
        answer = sum(self.answer_tokens) / 2.0
        return self.system_prompt_tokens + earlier * (user + answer) + user

    def mean_output_tokens(self) -> float:
        return sum(self.answer_tokens) / 2.0


class ArrivalClass(_Strict):
    """A stream of identical requests from one tenant (or, with ``chat``, its conversations)."""

    tenant: str
    model: str = Field(description="the logical model called")
    request_class: str | None = Field(default=None, alias="class", description="orchid.class")
    rate_per_s: float | None = Field(default=None, ge=0)
    raw_capacity_share: float | None = Field(
        default=None, gt=0, description="rate as a share of the raw device time of the model's pools"
    )
    input_tokens: int | None = Field(default=None, ge=1, description="required, except for chat")
    output_tokens: int | None = Field(default=None, ge=1, description="orchid.max_output_tokens")
    items: int = Field(default=1, ge=1)
    deadline_ms: float | None = Field(default=None, gt=0, description="the gRPC deadline; none: the class's")
    allow_fallback: bool | None = None
    arrivals: Literal["poisson", "deterministic"] = "poisson"
    upstream_ms: float = Field(
        default=0.0, ge=0, description="spent upstream (features, preprocessing) before the gateway"
    )
    mode: Literal["online", "streaming"] = Field(
        default="online", description="online: ModelInfer; streaming: ModelStreamInfer, one request a stream"
    )
    first_result_ms: float | None = Field(
        default=None, gt=0, description="orchid.first_result_ms (streaming)"
    )
    gap_ms: float | None = Field(default=None, gt=0, description="orchid.gap_ms (streaming)")
    entities: Entities | None = Field(
        default=None, description="a route with a features contract: the entities its requests read"
    )
    chat: ChatArrivals | None = Field(
        default=None,
        description="multi-turn conversations (rate_per_s, raw_capacity_share: of their turns)",
    )

    @model_validator(mode="after")
    def _one_rate(self) -> ArrivalClass:
        if (self.rate_per_s is None) == (self.raw_capacity_share is None):
            raise _Keyed("rate_per_s", "give exactly one of rate_per_s and raw_capacity_share")
        if self.chat is not None:
            for name in ("input_tokens", "output_tokens"):
                if getattr(self, name) is not None:
                    raise _Keyed(
                        name, f"a chat's {name} are its turns' (chat.user_tokens, chat.answer_tokens)"
                    )
            if self.arrivals != "poisson":
                raise _Keyed("arrivals", "a chat's conversations start as a Poisson process")
            if self.mode != "online" or self.items != 1:
                raise _Keyed(
                    "chat", "a chat's turns are online requests of one sequence (mode online, items 1)"
                )
        elif self.input_tokens is None:
            raise _Keyed("input_tokens", "required field is missing (except for chat arrivals)")
        for name in ("first_result_ms", "gap_ms"):
            if getattr(self, name) is not None and self.mode != "streaming":
                raise _Keyed(name, "a stream objective: set mode: streaming too")
        if self.mode == "streaming" and self.items != 1:
            raise _Keyed("items", "a stream carries one sequence: items 1")
        if self.upstream_ms > 0 and self.deadline_ms is None:
            raise _Keyed("upstream_ms", "upstream time eats the caller's deadline: set deadline_ms too")
        return self


class Phase(_Strict):
    name: str
    duration_s: float = Field(gt=0)
    multiplier: float = Field(default=1.0, ge=0, description="of every arrival class's rate")
    arrivals: dict[str, float] = Field(default={}, description="per arrival class: its multiplier instead")


class FaultDomain(_Strict):
    """A failure domain of a backend's topology (``topology.domains``)."""

    kind: str = Field(description="e.g. host, rack")
    name: str


class Fault(_Strict):
    at_s: float = Field(ge=0)
    until_s: float | None = Field(default=None, gt=0)
    kind: Literal["device_group_lost", "underprediction", "slow_upstream", "devices_lost"]
    backend: str | None = Field(
        default=None, description="device_group_lost: the backend lost; devices_lost: whose devices"
    )
    devices: str | int | tuple[int, ...] | None = Field(
        default=None, description='devices_lost: the devices ([4, 5] or "4-7")'
    )
    domain: FaultDomain | None = Field(
        default=None, description="devices_lost: a failure domain of the backend's topology instead"
    )
    detect_after_s: float = Field(
        default=0.0,
        ge=0,
        description="devices_lost: the gateway learns of the loss (and the return) this much later",
    )
    cold: bool = Field(
        default=False, description="device_group_lost: it comes back cold (each model loads its load_s)"
    )
    extra_ms: float | None = Field(default=None, gt=0, description="slow_upstream: added upstream time")
    arrivals: list[str] | None = Field(default=None, description="slow_upstream: the classes (default all)")
    model: str | None = Field(default=None, description="underprediction: the backend model")
    factor: float = Field(default=2.0, gt=0, description="underprediction: time x this")
    longer_than_tokens: int | None = Field(
        default=None, ge=0, description="underprediction: inputs longer than this (default: the long bucket)"
    )

    @model_validator(mode="after")
    def _target(self) -> Fault:
        if self.kind == "device_group_lost" and self.backend is None:
            raise _Keyed("backend", "device_group_lost needs the backend (device group) lost")
        if self.kind == "devices_lost":
            if self.backend is None:
                raise _Keyed("backend", "devices_lost needs the backend whose devices are lost")
            if (self.devices is None) == (self.domain is None):
                raise _Keyed("devices", "devices_lost needs exactly one of devices and domain")
        else:
            for key in ("devices", "domain"):
                if getattr(self, key) is not None:
                    raise _Keyed(key, f"{key} applies to devices_lost faults only")
            if self.detect_after_s:
                raise _Keyed("detect_after_s", "detect_after_s applies to devices_lost faults only")
        if self.kind == "underprediction" and self.model is None:
            raise _Keyed("model", "underprediction needs the backend model that runs slower")
        if self.kind == "slow_upstream" and self.extra_ms is None:
            raise _Keyed("extra_ms", "slow_upstream needs extra_ms, the upstream time it adds")
        if self.cold and (self.kind != "device_group_lost" or self.until_s is None):
            raise _Keyed("cold", "cold applies to a device_group_lost fault that ends (until_s)")
        for key in ("extra_ms", "arrivals"):
            if getattr(self, key) is not None and self.kind != "slow_upstream":
                raise _Keyed(key, f"{key} applies to slow_upstream faults only")
        if self.until_s is not None and self.until_s <= self.at_s:
            raise _Keyed("until_s", "until_s must be after at_s")
        return self

    def lost_devices(self, backend: FleetBackend, key: str = "") -> tuple[int, ...]:
        """devices_lost: the devices of ``backend`` it takes (``_Keyed`` at ``key`` when its
        devices or domain are not the backend's)."""
        at = f"{key}." if key else ""
        topology = backend.topology
        if topology is None:
            raise _Keyed(
                f"{at}backend",
                f"backend {backend.name!r} declares no topology (devices_lost needs its units and domains)",
            )
        if self.domain is not None:
            kinds = topology.domains
            if self.domain.kind not in kinds:
                raise _Keyed(
                    f"{at}domain.kind",
                    f"backend {backend.name!r} has no {self.domain.kind!r} domains (kinds: {_known(kinds)})",
                )
            named = kinds[self.domain.kind]
            if self.domain.name not in named:
                raise _Keyed(
                    f"{at}domain.name",
                    f"backend {backend.name!r} has no {self.domain.kind} {self.domain.name!r} "
                    f"(its {self.domain.kind}s: {_known(named)})",
                )
            return tuple(sorted(set(parse_devices(named[self.domain.name]))))
        assert self.devices is not None
        try:
            devices = tuple(sorted(set(parse_devices(self.devices))))
        except (TopologyError, ValueError) as exc:
            raise _Keyed(f"{at}devices", f"not a device list: {exc}") from None
        for d in devices:
            if not 0 <= d < backend.devices:
                raise _Keyed(
                    f"{at}devices",
                    f"device {d} is out of range (backend {backend.name!r}: 0..{backend.devices - 1})",
                )
        if not devices:
            raise _Keyed(f"{at}devices", "names no device")
        return devices


class ReportSpec(_Strict):
    interval_s: float = Field(default=1.0, gt=0, description="bins of the timeline and the plot")


class PublishedEvidence(_Strict):
    """A quality evaluation published before the run (as ``orchid-gateway evidence publish``),
    e.g. a rollout candidate's, which its ``quality_score_drop`` guardrail compares."""

    model: str = Field(description="the logical model (route)")
    version: str = Field(description="the version label evaluated (a rollout's candidate label)")
    score: float = Field(ge=0, le=1)
    sample_size: int = Field(default=1000, ge=1)
    population: str | None = Field(default=None, description="default: the route's population")
    owner: str = "simulation"


class RolloutStart(_Strict):
    """A version change started at ``at_s`` (as ``orchid-gateway rollout start FILE`` would)."""

    file: Path = Field(description="a rollout file (relative to the scenario)")
    at_s: float = Field(ge=0)


# Figures an expectation may bound: a phase's totals, class or tenant block, plus these.
EXPECTED_FIGURES = (
    "on_time_pct",
    "degraded_pct",
    "rejected_early_pct",
    "rejected_late_pct",
    "missed_pct",
    "failed_pct",
    "late_pct",
    "missed_late_pct",  # rejected late + missed + late: refusals that came too late
    "on_time_of_admitted_pct",  # on time / (offered - rejected early): admitted work stays on time
    "wasted_device_ms_per_s",
    "fallback_saving_ms_per_s",
    "shadow_device_ms_per_s",  # totals only
    "canary_pct",  # answers by a rollout's candidate, % of offered
    "max_step",  # the highest ladder step of any pool (or ``pool``) in the phase
    "first_result_on_time_pct",  # a streaming class: first result by its objective, % of offered
    "gap_objective_met_pct",  # a streaming class: no gap over its objective, % of admitted streams
    # With feature_sources (orchid_tools.simulate_features):
    "feature_reads",  # reads of the source (answered or not)
    "feature_cache_hits",  # answered by the runtime's feature cache
    "feature_cache_hit_pct",  # of reads + hits
    "feature_read_failures",  # reads that failed or timed out
    "backpressure_refusals",  # refused early with features.upstream_backpressure
    "backpressure_refusals_pct",  # of offered
    "backpressure_last_refusal_s",  # seconds from the phase's start to its last such refusal (0: none)
    "expired_device_ms",  # device time of requests answered late or whose deadline passed as they ran
    "expired_device_ms_per_s",
    # With a backend model that keeps a prefix cache (totals, or scope `route NAME`):
    "prefix_requests",  # answered requests to a prefix-cache model
    "prefix_hit_pct",  # of them, those whose backend reported cached tokens
    "prefix_cached_tokens",  # the prompt tokens the backends reported their caches served
    "prefix_cached_token_pct",  # of the answered requests' prompt tokens
    "prefix_saved_device_ms",  # the prefill those tokens did not cost (the backend model's profile)
    "prefix_device_ms_per_answered",  # device-ms on the caller's path per answered request
    "prefix_spills",  # the gateway's count: sent elsewhere, the best saving was outside the bound
    "prefix_extra_wait_ms_max",  # the largest predicted wait affinity chose above the least
    "prefix_cross_tenant_hits",  # hits its own tenant's earlier prompts cannot explain (must be 0)
)
FEATURE_FIGURES = EXPECTED_FIGURES[
    EXPECTED_FIGURES.index("feature_reads") : EXPECTED_FIGURES.index("prefix_requests")
]


class Expectation(_Strict):
    """Bounds the fleet must hold in a phase; the report says whether each held."""

    phase: str
    scope: str = Field(default="totals", description="totals, class NAME or tenant NAME")
    pool: str | None = Field(default=None, description="max_step: this pool (backend/model) only")
    min: dict[str, float] = {}
    max: dict[str, float] = {}
    versus: str | None = Field(default=None, description="another phase, for max_above")
    max_above: dict[str, float] = Field(
        default={},
        description="figure <= the versus phase's + this (recovery: back to pre-fault); with versus_run "
        "(and no versus), the same phase's in that run",
    )
    because: str = ""
    run: str | None = Field(
        default=None, description="with compare: the run judged (e.g. backpressure=false); default the first"
    )
    versus_run: str | None = Field(
        default=None, description="with compare: the run max_ratio (or max_above) compares with"
    )
    max_ratio: dict[str, float] = Field(
        default={}, description="figure <= this x the same figure in versus_run (which must be > 0)"
    )

    @model_validator(mode="after")
    def _figures(self) -> Expectation:
        if self.max_ratio and self.versus_run is None:
            raise _Keyed(
                "versus_run", "max_ratio needs versus_run (the run compared with), and versus_run max_ratio"
            )
        if self.versus_run is not None and not (self.max_ratio or (self.max_above and self.versus is None)):
            raise _Keyed(
                "versus_run", "max_ratio needs versus_run (the run compared with), and versus_run max_ratio"
            )
        for part in ("min", "max", "max_above", "max_ratio"):
            for name in getattr(self, part):
                if name not in EXPECTED_FIGURES:
                    raise _Keyed(f"{part}.{name}", f"unknown figure (known: {', '.join(EXPECTED_FIGURES)})")
        if self.versus is not None and not self.max_above:
            raise _Keyed("versus", "max_above needs versus (the phase compared with), and versus max_above")
        if self.max_above and self.versus is None and self.versus_run is None:
            raise _Keyed("versus", "max_above needs versus (the phase compared with), and versus max_above")
        if not (self.min or self.max or self.max_above or self.max_ratio):
            raise _Keyed("max", "an expectation bounds at least one figure")
        if self.pool is not None and not any("max_step" in b for b in (self.min, self.max, self.max_above)):
            raise _Keyed("pool", "pool applies to max_step only: bound max_step too")
        kind, _, name = self.scope.partition(" ")
        if self.scope != "totals" and (kind not in ("class", "tenant", "route") or not name):
            raise _Keyed("scope", "totals, `class NAME`, `tenant NAME` or `route NAME`")
        return self


class Compare(_Strict):
    """Run the same arrivals once per value of one feature: ``backpressure: [true, false]``
    (the feature sources', ``orchid_tools.simulate_features``) or ``prefix_affinity: [true,
    false]`` (false: every route's ``prefix_affinity`` removed, least-wait routing). The
    report is the first value's; every run's is under ``runs`` (``prefix_affinity=false``)
    for ``expect:``."""

    backpressure: list[bool] | None = Field(default=None, min_length=2, max_length=2)
    prefix_affinity: list[bool] | None = Field(default=None, min_length=2, max_length=2)

    @model_validator(mode="after")
    def _one(self) -> Compare:
        given = [k for k in ("backpressure", "prefix_affinity") if getattr(self, k) is not None]
        if len(given) != 1:
            raise _Keyed("backpressure", "compare one feature: backpressure or prefix_affinity")
        values = getattr(self, given[0])
        if len(set(values)) != len(values):
            raise _Keyed(given[0], "two different values: [true, false]")
        return self

    @property
    def feature(self) -> str:
        return "backpressure" if self.backpressure is not None else "prefix_affinity"

    def values(self) -> list[bool]:
        values = self.backpressure if self.backpressure is not None else self.prefix_affinity
        assert values is not None
        return values

    def label(self, value: bool) -> str:
        return run_label(value) if self.feature == "backpressure" else f"{self.feature}={str(value).lower()}"

    def labels(self) -> list[str]:
        return [self.label(v) for v in self.values()]


class Scenario(_Strict):
    description: str = ""
    gateway: Path | None = Field(default=None, description="gateway config (relative to this file)")
    tenants_file: Path | None = None
    tenants: dict[str, Any] | None = Field(default=None, description="inline tenants file (keys optional)")
    routes_dir: Path | None = None
    policies_dir: Path | None = None
    settings: dict[str, Any] = Field(default={}, description="merged into the gateway config")
    seed: int = 0
    fleet: list[FleetBackend] = Field(min_length=1)
    arrivals: dict[str, ArrivalClass] = Field(min_length=1)
    phases: list[Phase] = Field(min_length=1)
    faults: list[Fault] = []
    rollouts: list[RolloutStart] = []
    evidence: list[PublishedEvidence] = []
    expect: list[Expectation] = []
    report: ReportSpec = ReportSpec()
    feature_sources: dict[str, SourceModel] = Field(
        default={}, description="the gateway config's feature sources, simulated (simulate_features)"
    )
    compare: Compare | None = Field(default=None, description="run the same arrivals once per value")

    @model_validator(mode="after")
    def _references(self) -> Scenario:
        if self.tenants is not None and self.tenants_file is not None:
            raise _Keyed("tenants", "give tenants or tenants_file, not both")
        names = [b.name for b in self.fleet]
        for index, name in enumerate(names):
            if names.index(name) != index:
                raise _Keyed(f"fleet[{index}].name", f"backend {name!r} is declared twice")
        for p, phase in enumerate(self.phases):
            for name in phase.arrivals:
                if name not in self.arrivals:
                    raise _Keyed(f"phases[{p}].arrivals.{name}", f"unknown arrival class {name!r}")
        for f, fault in enumerate(self.faults):
            if fault.backend is not None and fault.backend not in names:
                raise _Keyed(f"faults[{f}].backend", f"unknown backend {fault.backend!r}")
            if fault.kind == "devices_lost":
                assert fault.backend is not None
                fault.lost_devices(self.fleet[names.index(fault.backend)], f"faults[{f}]")
            if fault.model is not None and not any(fault.model in b.models for b in self.fleet):
                raise _Keyed(f"faults[{f}].model", f"no backend of the fleet serves {fault.model!r}")
            for a, name in enumerate(fault.arrivals or ()):
                if name not in self.arrivals:
                    raise _Keyed(f"faults[{f}].arrivals[{a}]", f"unknown arrival class {name!r}")
                if self.arrivals[name].deadline_ms is None:
                    raise _Keyed(
                        f"faults[{f}].arrivals[{a}]",
                        f"class {name!r} sets no deadline_ms for upstream time to eat",
                    )
            if fault.kind == "slow_upstream" and fault.arrivals is None:
                for name, spec in self.arrivals.items():
                    if spec.deadline_ms is None:
                        raise _Keyed(
                            f"faults[{f}].arrivals", f"class {name!r} sets no deadline_ms: list the classes"
                        )
        for r, start in enumerate(self.rollouts):
            if start.at_s >= self.duration_s:
                raise _Keyed(f"rollouts[{r}].at_s", f"after the last phase ends ({self.duration_s:g} s)")
        phases = [p.name for p in self.phases]
        for e, expectation in enumerate(self.expect):
            for key, named in (("phase", expectation.phase), ("versus", expectation.versus)):
                if named is not None and named not in phases:
                    raise _Keyed(
                        f"expect[{e}].{key}", f"unknown phase {named!r} (phases: {', '.join(phases)})"
                    )
            kind, _, name = expectation.scope.partition(" ")
            if kind == "class" and name not in self.arrivals:
                raise _Keyed(f"expect[{e}].scope", f"unknown arrival class {name!r}")
            runs = self.compare.labels() if self.compare is not None else []
            for key, named in (("run", expectation.run), ("versus_run", expectation.versus_run)):
                if named is not None and named not in runs:
                    raise _Keyed(
                        f"expect[{e}].{key}",
                        f"unknown run {named!r} (runs: {', '.join(runs) or 'none: set compare'})",
                    )
        if self.compare is not None and self.compare.feature == "backpressure" and not self.feature_sources:
            raise _Keyed("compare", "compare: backpressure needs feature_sources")
        return self

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)


# --------------------------------------------------------------------------- loading


def _split(key: str) -> list[str | int]:
    """``fleet[0].name`` or ``fleet.0.name`` -> ``["fleet", 0, "name"]``."""
    parts: list[str | int] = []
    for piece in key.replace("[", ".").replace("]", "").split("."):
        if piece:
            parts.append(int(piece) if piece.isdigit() else piece)
    return parts


@dataclass(frozen=True)
class _Source:
    """A scenario file, parsed with positions, for locating keys in errors."""

    path: Path
    document: YamlDocument

    def error(self, loc: KeyPath | str, problem: str) -> ConfigError:
        parts = _split(loc) if isinstance(loc, str) else list(loc)
        return ConfigError(self.document.location(parts), key_path(parts), problem)


def _problem(error: Mapping[str, Any]) -> tuple[list[str | int], str]:
    loc: list[str | int] = [p for p in error["loc"] if isinstance(p, str | int)]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Keyed):
        return loc + _split(cause.key), cause.problem
    kind = error["type"]
    if kind == "missing":
        return loc, "required field is missing"
    if kind == "extra_forbidden":
        return loc, "unknown field (not part of the scenario schema)"
    message = str(error["msg"])
    if "input" in error and not isinstance(error["input"], dict | list):
        message += f" (got {error['input']!r})"
    return loc, message


def _validated(source: _Source, model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # An unknown field first: a misspelt key also makes the key it meant "missing".
        errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        loc, problem = _problem(errors[0])
        if len(errors) > 1:
            problem += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise source.error([*_split(prefix), *loc], problem) from None


def load_scenario(path: Path) -> tuple[Scenario, _Source]:
    """Read and validate a scenario file; every failure is a ``ConfigError`` naming the file
    (``file:line:col`` of the offending key)."""
    try:
        document = read_yaml(path)
    except YamlError as exc:
        raise ConfigError(exc.location, "", exc.problem) from None
    source = _Source(path, document)
    data = document.value()
    if not isinstance(data, dict):
        got = "an empty document" if data is None else type(data).__name__
        raise ConfigError(str(path), "", f"expected a mapping of scenario sections, got {got}")
    return _validated(source, Scenario, data), source


def _merge(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def minted_key(tenant: str) -> str:
    """The key this simulator authenticates ``tenant`` with (its digest replaces the file's)."""
    return f"simulated-key-{tenant}"


@dataclass(frozen=True)
class Prepared:
    """A scenario resolved against its gateway config: everything one run needs."""

    scenario: Scenario
    source: _Source
    config: GatewayConfig
    tenants: TenantsFile
    routes: RouteTable
    models: dict[str, dict[str, MemoryModel]]  # backend -> backend model -> emulation
    classes: dict[str, ClassFacts]
    rollouts: tuple[tuple[float, RolloutSpec], ...] = ()  # (at_s, the version change started then)


@dataclass(frozen=True)
class ClassFacts:
    """An arrival class priced on its route: the arithmetic the report divides by."""

    name: str
    tenant: str
    request_class: str
    model: str
    fallback: str | None
    input_tokens: int
    output_tokens: int
    deadline_ms: float  # what the caller waits (the class's default when it sets no deadline)
    sets_deadline: bool
    rate_per_s: float
    primary_ms: float  # profile price on the model asked for, batch of one, time factor 1
    fallback_ms: float | None  # the same on the route's fallback (its output cap applied)
    upstream_ms: float = 0.0  # spent before the gateway (features, preprocessing): E of the slack
    streaming: bool = False  # ModelStreamInfer (mode: streaming)
    first_result_ms: float | None = None  # a stream's first-result objective (the class's, or its own)
    gap_ms: float | None = None  # a stream's gap objective (None: none)
    features_source: str | None = None  # the feature source its route's contract reads


def _resolve(base: Path, value: Path) -> Path:
    return value if value.is_absolute() else (base / value).resolve()


def prepare(
    scenario: Scenario,
    source: _Source,
    *,
    config_path: Path | None = None,
    policies_dir: Path | None = None,
) -> Prepared:
    here = source.path.resolve().parent
    path = config_path or (_resolve(here, scenario.gateway) if scenario.gateway else None)
    if path is None:
        raise source.error([], "no gateway config: set `gateway:` in the scenario or pass --config FILE")
    base = load_gateway_config(path)
    backends = [
        _validated(source, BackendConfig, b.backend_config().model_dump(), f"fleet[{i}]")
        for i, b in enumerate(scenario.fleet)
    ]
    data = base.model_dump()
    data.update(local_triton=None, backends=backends)
    data = _merge(data, scenario.settings)
    config: GatewayConfig = _validated(source, GatewayConfig, data, "settings")
    update: dict[str, Any] = {}
    if scenario.tenants_file is not None:
        update["tenants_file"] = _resolve(here, scenario.tenants_file)
    if scenario.routes_dir is not None:
        update["routes_dir"] = _resolve(here, scenario.routes_dir)
    if scenario.policies_dir is not None:
        update["policies_dir"] = _resolve(here, scenario.policies_dir)
    if policies_dir is not None:
        update["policies_dir"] = policies_dir.resolve()
    if scenario.tenants is not None:
        update["tenants_file"] = source.path
    for name in scenario.feature_sources:
        if name not in config.feature_sources:
            raise source.error(
                f"feature_sources.{name}",
                f"unknown feature source {name!r} (the gateway config's: {_known(config.feature_sources)})",
            )
    if scenario.feature_sources:
        # The simulated sources read no registry: definition versions are not what is simulated.
        update["feature_sources"] = {
            n: s.model_copy(update={"registry": None}) for n, s in config.feature_sources.items()
        }
    config = config.model_copy(update=update)
    if scenario.tenants is not None:
        inline = dict(scenario.tenants)
        people = inline.get("tenants")
        if isinstance(people, dict):  # inline tenants need no key: the simulator mints one
            inline["tenants"] = {
                name: {"key_sha256": [hash_api_key(minted_key(str(name)))], **t} if isinstance(t, dict) else t
                for name, t in people.items()
            }
        tenants: TenantsFile = _validated(source, TenantsFile, inline, "tenants")
        routes = load_routes(config.routes_dir)
        check_references(config, tenants, routes)
        check_memory(config, routes)
        check_dedicated(config, tenants, routes)
    else:
        tenants, routes = load_configuration(config)
    tenants = tenants.model_copy(
        update={
            "tenants": {
                name: t.model_copy(update={"key_sha256": (hash_api_key(minted_key(name)),)})
                for name, t in tenants.tenants.items()
            }
        }
    )
    models = {b.name: _fleet_models(source, i, b, tenants, routes) for i, b in enumerate(scenario.fleet)}
    classes = {
        name: _class_facts(source, name, spec, scenario, config, tenants, routes)
        for name, spec in scenario.arrivals.items()
    }
    for e, published in enumerate(scenario.evidence):
        if published.model not in routes.models:
            raise source.error(
                f"evidence[{e}].model", f"unknown model {published.model!r} (routes: {_known(routes.models)})"
            )
    for e, expectation in enumerate(scenario.expect):
        kind, _, who = expectation.scope.partition(" ")
        if kind == "tenant" and who not in {f.tenant for f in classes.values()}:
            raise source.error(f"expect[{e}].scope", f"no arrival class of tenant {who!r}")
    rollouts = []
    for r, start in enumerate(scenario.rollouts):
        file = _resolve(here, start.file)
        try:
            document = parse_yaml(str(file), file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise source.error(f"rollouts[{r}].file", f"cannot read {file}: {exc}") from None
        except YamlError as exc:
            raise ConfigError(exc.location, "", exc.problem) from None
        rollouts.append((start.at_s, parse_rollout(document, config, tenants, routes)))
    return Prepared(scenario, source, config, tenants, routes, models, classes, tuple(rollouts))


def _route_of(backend_model: str, tenants: TenantsFile, routes: RouteTable) -> RouteConfig | None:
    """The route whose requests this backend model runs: shared, dedicated or shadow."""
    for route in routes.models.values():
        if route.backend_model == backend_model:
            return route
    for tenant in tenants.tenants.values():
        for logical, own in tenant.dedicated_models.items():
            if own == backend_model and logical in routes.models:
                return routes.models[logical]
    for route in routes.models.values():
        if route.shadow is not None and route.shadow.backend_model == backend_model:
            return route
    return None


def _fleet_models(
    source: _Source, index: int, backend: FleetBackend, tenants: TenantsFile, routes: RouteTable
) -> dict[str, MemoryModel]:
    out: dict[str, MemoryModel] = {}
    for name, spec in backend.models.items():
        key = f"fleet[{index}].models.{name}"
        route = _route_of(name, tenants, routes)
        if spec.cost is not None:
            profile = spec.cost
        elif spec.profile is not None:
            if spec.profile not in routes.profiles:
                raise source.error(
                    f"{key}.profile", f"unknown profile {spec.profile!r} (routes: {_known(routes.profiles)})"
                )
            profile = routes.profiles[spec.profile]
        elif route is not None:
            profile = routes.profiles[route.profile]
        else:
            raise source.error(
                key, "no route serves this backend model: name its cost with `profile:` or `cost:`"
            )
        decoupled = spec.decoupled if spec.decoupled is not None else bool(route and route.streaming)
        out[name] = MemoryModel(
            name=name,
            profile=profile,
            instances=spec.instances or backend.devices,
            max_batch_size=spec.max_batch_size
            if spec.max_batch_size is not None
            else (0 if decoupled else 8),
            default_max_output_tokens=route.shape.default_max_output_tokens if route else 64,
            output_limit_parameter=(route.shape.output_limit_parameter or "")
            if route
            else "max_output_tokens",
            decoupled=decoupled,
            version=(route.version or "1") if route else "1",
            input_name=route.shape.tokens_input if route else "INPUT_IDS",
            load_s=spec.load_s,
            loaded=spec.loaded,
            prefix_cache=spec.prefix_cache.spec() if spec.prefix_cache is not None else None,
        )
    return out


def _known(names: Mapping[str, Any] | Sequence[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def _class_facts(
    source: _Source,
    name: str,
    spec: ArrivalClass,
    scenario: Scenario,
    config: GatewayConfig,
    tenants: TenantsFile,
    routes: RouteTable,
) -> ClassFacts:
    key = f"arrivals.{name}"
    tenant = tenants.tenants.get(spec.tenant)
    if tenant is None:
        raise source.error(
            f"{key}.tenant", f"unknown tenant {spec.tenant!r} (known: {_known(tenants.tenants)})"
        )
    route = routes.models.get(spec.model)
    if route is None:
        raise source.error(f"{key}.model", f"unknown model {spec.model!r} (routes: {_known(routes.models)})")
    streaming = spec.mode == "streaming"
    if route.streaming != streaming:
        problem = (
            "streams: set mode: streaming" if route.streaming else "does not stream: drop mode: streaming"
        )
        raise source.error(f"{key}.model", f"model {spec.model!r} {problem}")
    request_class = spec.request_class or config.default_class
    if request_class not in config.classes:
        raise source.error(
            f"{key}.class", f"unknown class {request_class!r} (known: {_known(config.classes)})"
        )
    output_tokens = spec.output_tokens or route.shape.default_max_output_tokens
    input_tokens = spec.input_tokens or 0
    chat = spec.chat
    if chat is not None:  # priced at its turns' mean shape (a price is linear in tokens)
        input_tokens = round(chat.mean_input_tokens())
        output_tokens = round(chat.mean_output_tokens())
        if chat.turns[1] > 1 and chat.think_time_s[1] <= 0:
            raise source.error(f"{key}.chat.think_time_s", "turns after the first need a think time > 0")
        longest = (
            chat.system_prompt_tokens
            + chat.turns[1] * chat.user_tokens[1]
            + (chat.turns[1] - 1) * chat.answer_tokens[1]
        )
        if route.shape.max_input_tokens and longest > route.shape.max_input_tokens:
            raise source.error(
                f"{key}.chat.turns",
                f"a last turn may send {longest} tokens, over model {spec.model!r}'s max_input_tokens "
                f"{route.shape.max_input_tokens}",
            )
    profile = routes.profiles[route.profile]
    primary_ms = (
        profile.accelerator_ms(input_tokens, output_tokens)
        * spec.items
        * _profile_scale(scenario, route.backend_model)
    )
    fallback = routes.models.get(route.fallback) if route.fallback else None
    fallback_ms = None
    if fallback is not None:
        capped = min(output_tokens, fallback.shape.max_output_tokens)
        fallback_ms = (
            routes.profiles[fallback.profile].accelerator_ms(input_tokens, capped)
            * spec.items
            * _profile_scale(scenario, fallback.backend_model)
        )
    rate = spec.rate_per_s
    if rate is None:
        assert spec.raw_capacity_share is not None
        raw = _raw_rate(scenario, route, tenant.home_cell, primary_ms)
        if raw <= 0:
            raise source.error(
                f"{key}.raw_capacity_share", f"no backend in cell {tenant.home_cell!r} serves {spec.model!r}"
            )
        rate = spec.raw_capacity_share * raw
    deadline_ms = spec.deadline_ms or config.classes[request_class].default_deadline_ms
    klass = config.classes[request_class]
    features_source = route.features.source if route.features is not None else None
    if features_source is not None and features_source not in scenario.feature_sources:
        raise source.error(
            f"{key}.model",
            f"model {spec.model!r} reads features from {features_source!r}: "
            f"declare it under feature_sources (its latency)",
        )
    if spec.entities is not None and features_source is None:
        raise source.error(f"{key}.entities", f"model {spec.model!r} reads no features")
    first_result_ms = spec.first_result_ms or klass.first_result_ms
    return ClassFacts(
        name=name,
        tenant=spec.tenant,
        request_class=request_class,
        model=spec.model,
        fallback=route.fallback,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        deadline_ms=deadline_ms,
        sets_deadline=spec.deadline_ms is not None,
        rate_per_s=rate,
        primary_ms=primary_ms,
        fallback_ms=fallback_ms,
        upstream_ms=spec.upstream_ms,
        streaming=streaming,
        first_result_ms=min(first_result_ms or deadline_ms, deadline_ms) if streaming else None,
        gap_ms=(spec.gap_ms or klass.gap_ms) if streaming else None,
        features_source=features_source,
    )


def _profile_scale(scenario: Scenario, backend_model: str) -> float:
    """Accelerator-ms per profile ms of ``backend_model``: its layout's (device-ms of its whole
    unit, ``Layout.profile_scale``) on the first backend of the fleet whose topology lays it
    out; 1 without one."""
    for backend in scenario.fleet:
        if backend.topology is not None and backend_model in backend.topology.models:
            return backend.topology.layout_of(backend_model).profile_scale()
    return 1.0


def _raw_rate(scenario: Scenario, route: RouteConfig, cell: str, price_ms: float) -> float:
    """Requests/s of ``price_ms`` the devices of the route's pools in ``cell`` run at all."""
    rate = 0.0
    for backend in scenario.fleet:
        if backend.cell != cell or route.backend_model not in backend.models:
            continue
        if route.backends and backend.name not in route.backends:
            continue
        model = backend.models[route.backend_model]
        devices = backend.devices if backend.shared_devices else (model.instances or backend.devices)
        if backend.topology is not None:  # the devices its units span
            devices = sum(len(unit) for _name, unit in backend.units_of(route.backend_model))
        rate += devices * MS_PER_S / (price_ms * backend.time_factor)
    return rate


# --------------------------------------------------------------------------- arrivals


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    klass: int  # index into the class list
    phase: int
    # A chat turn: its prompt (INT32 little-endian bytes) and its answer's tokens (the class's
    # template carries neither); b"" for every other class.
    prompt: bytes = b""
    output_tokens: int = 0


@dataclass(frozen=True)
class PhaseWindow:
    name: str
    start_s: float
    end_s: float
    multiplier: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def phase_windows(scenario: Scenario) -> list[PhaseWindow]:
    windows, t = [], 0.0
    for phase in scenario.phases:
        windows.append(PhaseWindow(phase.name, t, t + phase.duration_s, phase.multiplier))
        t += phase.duration_s
    return windows


def schedule(prepared: Prepared, seed: int) -> list[Arrival]:
    """Every arrival of the run, in time order: per class, deterministic spacing (``k / rate``
    from each phase's start) or Poisson gaps from ``default_rng([seed, class index])``."""
    scenario = prepared.scenario
    windows = phase_windows(scenario)
    arrivals: list[Arrival] = []
    for index, (name, spec) in enumerate(scenario.arrivals.items()):
        facts = prepared.classes[name]
        rng = np.random.default_rng([seed, index])
        if spec.chat is not None:
            arrivals.extend(_chat_arrivals(spec.chat, facts.rate_per_s, scenario, windows, seed, index, rng))
            continue
        for p, (phase, window) in enumerate(zip(scenario.phases, windows, strict=True)):
            rate = facts.rate_per_s * phase.arrivals.get(name, phase.multiplier)
            if rate <= 0:
                continue
            if spec.arrivals == "deterministic":
                count = math.floor(rate * window.duration_s + 1e-9)
                arrivals.extend(Arrival(window.start_s + k / rate, index, p) for k in range(count))
            else:
                t = window.start_s
                while True:
                    t += float(rng.exponential(1.0 / rate))
                    if t >= window.end_s:
                        break
                    arrivals.append(Arrival(t, index, p))
    arrivals.sort(key=lambda a: (a.at_s, a.klass))
    return arrivals


def system_prompt(chat: ChatArrivals, seed: int, index: int) -> npt.NDArray[np.int32]:
    """A chat class's system prompt: from ``system_prompt_seed`` alone when given (classes that
    give the same seed send the same prompt), else from the scenario's seed and the class."""
    rng = np.random.default_rng(
        [chat.system_prompt_seed] if chat.system_prompt_seed is not None else [seed, 3000 + index]
    )
    tokens: npt.NDArray[np.int32] = rng.integers(1, TOKEN_VOCAB, chat.system_prompt_tokens).astype(np.int32)
    return tokens


def _chat_arrivals(
    chat: ChatArrivals,
    rate_per_s: float,
    scenario: Scenario,
    windows: Sequence[PhaseWindow],
    seed: int,
    index: int,
    rng: np.random.Generator,
) -> list[Arrival]:
    """A chat class's turns: conversations start as a Poisson process (``rate_per_s`` turns/s
    over the mean turns per conversation, times each phase's multiplier); each conversation's
    lengths and tokens come from its own draws (``default_rng([seed, 4000 + class, k])``), so
    its turns do not depend on the other conversations. A turn past the last phase is not sent."""
    system = system_prompt(chat, seed, index)
    end_s = windows[-1].end_s if windows else 0.0
    starts: list[float] = []
    name = list(scenario.arrivals)[index]
    for phase, window in zip(scenario.phases, windows, strict=True):
        rate = rate_per_s / chat.mean_turns() * phase.arrivals.get(name, phase.multiplier)
        if rate <= 0:
            continue
        t = window.start_s
        while True:
            t += float(rng.exponential(1.0 / rate))
            if t >= window.end_s:
                break
            starts.append(t)
    out: list[Arrival] = []
    for k, start in enumerate(starts):
        draw = np.random.default_rng([seed, 4000 + index, k])
        turns = int(draw.integers(chat.turns[0], chat.turns[1] + 1))
        history = system.tobytes()
        at = start
        for turn in range(turns):
            if turn:
                at += float(draw.uniform(chat.think_time_s[0], chat.think_time_s[1]))
            user = draw.integers(
                1, TOKEN_VOCAB, int(draw.integers(chat.user_tokens[0], chat.user_tokens[1] + 1))
            )
            answer_n = int(draw.integers(chat.answer_tokens[0], chat.answer_tokens[1] + 1))
            answer = draw.integers(1, TOKEN_VOCAB, answer_n)
            prompt = history + user.astype("<i4").tobytes()
            if at >= end_s:
                break
            phase_index = next(p for p, w in enumerate(windows) if w.start_s <= at < w.end_s)
            out.append(Arrival(at, index, phase_index, prompt, answer_n))
            history = prompt + answer.astype("<i4").tobytes()
    return out


def chat_turn_bytes(arrival: Arrival, route: RouteConfig) -> bytes:
    """A chat turn's part of its request (after its class's template): its token tensor and its
    answer's length (protobuf merges the concatenated messages)."""
    request = service_pb2.ModelInferRequest()
    tensor = request.inputs.add(name=route.shape.tokens_input, datatype="INT32")
    tensor.shape.extend([1, len(arrival.prompt) // 4])
    request.raw_input_contents.append(arrival.prompt)
    request.parameters["orchid.max_output_tokens"].int64_param = arrival.output_tokens
    raw: bytes = request.SerializeToString()
    return raw


def request_template(facts: ClassFacts, spec: ArrivalClass, route: RouteConfig) -> bytes:
    """A ``ModelInferRequest`` as tritonclient would serialize it (without its id): the
    token tensor, and the ``orchid.*`` hints the class sets."""
    request = service_pb2.ModelInferRequest(model_name=facts.model)
    if spec.input_tokens is not None:  # a chat's turns carry their own (chat_turn_bytes)
        tensor = request.inputs.add(name=route.shape.tokens_input, datatype="INT32")
        # A streaming (decoupled) model batches nothing: one sequence, a rank-1 token tensor.
        tensor.shape.extend([spec.input_tokens] if facts.streaming else [spec.items, spec.input_tokens])
        tokens = np.arange(spec.input_tokens * spec.items, dtype=np.int32) % TOKEN_VOCAB
        request.raw_input_contents.append(tokens.astype(np.int32).tobytes())
    if spec.request_class is not None:
        request.parameters["orchid.class"].string_param = spec.request_class
    if spec.output_tokens is not None:
        request.parameters["orchid.max_output_tokens"].int64_param = spec.output_tokens
    if spec.allow_fallback is not None:
        request.parameters["orchid.allow_fallback"].bool_param = spec.allow_fallback
    if spec.first_result_ms is not None:
        request.parameters["orchid.first_result_ms"].double_param = spec.first_result_ms
    if spec.gap_ms is not None:
        request.parameters["orchid.gap_ms"].double_param = spec.gap_ms
    if facts.streaming:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    raw: bytes = request.SerializeToString()
    return raw


# --------------------------------------------------------------------------- the run


def stream_objectives_of(facts: ClassFacts) -> StreamObjectives:
    """What a streaming arrival class's caller was promised (its report's yardstick)."""
    return StreamObjectives(
        first_result_ms=facts.first_result_ms if facts.first_result_ms is not None else facts.deadline_ms,
        completion_ms=facts.deadline_ms,
        gap_ms=facts.gap_ms,
    )


async def _stream_call(
    gateway: Gateway,
    raw: bytes,
    call: CallContext,
    tracker: GapTracker,
    index: int,
    record: RunRecord,
    submitted: set[str],
) -> service_pb2.ModelInferResponse:
    """One request on its own ModelStreamInfer stream, read as its caller reads it: every
    result's arrival feeds ``tracker``; the final response is the answer (its provenance), an
    error reply raises its error as the unary path would (a stream that had sent results had
    reached its backend)."""

    async def requests() -> AsyncIterator[bytes]:
        yield raw

    loop = asyncio.get_running_loop()
    final: service_pb2.ModelInferResponse | None = None
    try:
        async for reply in gateway.stream(requests(), call):
            response = reply.infer_response
            if reply.error_message:
                if tracker.results:
                    submitted.add(str(index))
                status, _, message = reply.error_message.partition(": ")
                rule = (
                    response.parameters["orchid-rule"].string_param
                    if "orchid-rule" in response.parameters
                    else ""
                )
                raise error_for_status(status)(message, rule=rule or None)
            if len(response.outputs) > 0:
                tracker.result(loop.time())
            if flag_response(response, "triton_final_response"):
                final = response
    finally:
        record.streams[index] = tracker.finish(loop.time())
    if final is None:
        raise Unavailable("the stream ended without its final response")
    return final


@dataclass
class PrefixLog:
    """What the prefix caches did for each arrival on its caller's path: the cached tokens its
    backend reported, the tokens its own tenant's earlier prompts to that backend could have
    served (unscoped: a report above it is a hit another tenant's entries gave, a
    cross-tenant hit), and affinity's placement (spilled, predicted extra wait)."""

    tenants: list[str]  # per arrival class
    arrivals: list[Arrival]
    cached: dict[int, int] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)
    placed: dict[int, tuple[bool, float, int]] = field(default_factory=dict)  # spilled, extra ms, expected
    scopes: dict[str, set[str]] = field(default_factory=dict)  # scope sent -> the tenants that sent it
    seen: dict[tuple[str, str], set[bytes]] = field(default_factory=dict)  # (backend, tenant) -> blocks
    backends: list[dict[str, Any]] = field(default_factory=list)  # per phase end: prefix_stats
    counters: dict[str, Any] = field(default_factory=dict)  # the gateway's per-route counters at the end

    def sent(
        self, backend: str, index: int, request: service_pb2.ModelInferRequest, spec: PrefixCacheSpec
    ) -> None:
        tenant = self.tenants[self.arrivals[index].klass]
        param = request.parameters.get(SCOPE_PARAMETER)
        scope = param.string_param if param is not None else ""
        self.scopes.setdefault(scope, set()).add(tenant)
        prompt = prompt_bytes(request, request.inputs[0].name if request.inputs else "")
        keys = block_keys("", prompt, spec.block_tokens)
        held = self.seen.setdefault((backend, tenant), set())
        matched = 0
        for key in keys:
            if key not in held:
                break
            matched += 1
        n = len(prompt) // TOKEN_BYTES
        self.own[index] = max(self.own.get(index, 0), cached_tokens(matched, spec.block_tokens, n))
        self.prompt_tokens[index] = n
        held.update(keys)

    def answered(self, index: int, response: service_pb2.ModelInferResponse) -> None:
        self.cached[index] = reported_tokens(response)


class _SimBackend(MemoryBackend):
    """A ``MemoryBackend`` that notes which requests reached it (a failure after that is the
    backend's, not a refusal) and, for a prefix-cache model, what its cache served."""

    def __init__(
        self,
        *args: Any,
        submitted: set[str],
        callers: dict[asyncio.Task[Any], int],
        served: list[str],
        prefix: PrefixLog | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._submitted = submitted
        self._callers = callers
        self._served = served
        self._prefix = prefix
        models = args[1] if len(args) > 1 else kwargs.get("models", {})
        listed = list(models.values()) if isinstance(models, Mapping) else list(models)
        self.caches = {m.name: m.prefix_cache for m in listed if m.prefix_cache is not None}

    async def infer(
        self, request: service_pb2.ModelInferRequest, *, timeout_s: float, logical: str
    ) -> service_pb2.ModelInferResponse:
        self._submitted.add(request.id)
        # On the caller's path (its own task), not a mirror (route shadow, a rollout's shadow
        # step), which runs in a task of its own: the model that does the caller's work.
        index = self._callers.get(asyncio.current_task())  # type: ignore[arg-type]
        if index is not None:
            self._served[index] = request.model_name
        cache = self.caches.get(request.model_name) if self._prefix is not None else None
        if cache is None or index is None or self._prefix is None:
            return await super().infer(request, timeout_s=timeout_s, logical=logical)
        self._prefix.sent(self.name, index, request, cache)
        response = await super().infer(request, timeout_s=timeout_s, logical=logical)
        self._prefix.answered(index, response)
        return response


class _LadderRecorder(GatewayListener):
    """The ladder step of every pool at every update (the gateway's ``ladder`` event)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, t0: float) -> None:
        self.loop = loop
        self.t0 = t0
        self.samples: dict[str, list[tuple[float, int]]] = defaultdict(list)

    def ladder(self, pool: str, step: int) -> None:
        # Rounded to the microsecond: the ladder loop's sleeps accumulate float error (its
        # 200th update runs at 19.99999999999996 s, in the same loop turn as a timer at 20 s).
        self.samples[pool].append((round(self.loop.time() - self.t0, 6), step))


@dataclass
class RunRecord:
    """What one run produced, per arrival (index-aligned with the schedule)."""

    arrivals: list[Arrival]
    outcome: list[str]
    approximation: list[str]
    rule: list[str]  # the deciding rule of a refusal; the rules of a degraded answer
    finished_s: list[float]
    canary: list[bool]  # answered by a rollout's candidate (orchid.route_reason canary)
    served: list[str]  # the backend model called on the caller's path ("" none); others: mirrors
    executions: list[tuple[int, Execution]]  # (arrival index, execution); -1: not an arrival's
    ladder: dict[str, list[tuple[float, int]]]
    policy_version: str
    policy_label: str
    faults: list[dict[str, Any]] = field(default_factory=list)
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    # A streaming arrival's results against its objectives (measured where its caller reads them).
    streams: dict[int, StreamSummary] = field(default_factory=dict)
    # With feature_sources: per arrival, read / read_failed / cache_hit.
    features: FeatureLog = field(default_factory=FeatureLog)
    # With a topology: per phase, at its end, each such backend's lost devices and its pools'
    # available units (the gateway's view: UnitDeviceSet).
    units: list[dict[str, Any]] = field(default_factory=list)
    # With a backend model that keeps a prefix cache: what the caches did (PrefixLog).
    prefix: PrefixLog | None = None


def run_once(
    prepared: Prepared, arrivals: list[Arrival], *, policies_dir: Path | None = None, seed: int | None = None
) -> RunRecord:
    """Run the production runtime over ``arrivals`` on a fresh virtual-time loop (``seed``: of the
    simulated feature sources and entity draws; default the scenario's)."""
    config = prepared.config
    if policies_dir is not None:
        config = config.model_copy(update={"policies_dir": policies_dir.resolve()})
    policy = load_policies(config)
    loop = VirtualTimeLoop()
    try:
        used = prepared.scenario.seed if seed is None else seed
        return loop.run_until_complete(_run(prepared, config, policy, arrivals, used))
    finally:
        loop.close()


async def _run(
    prepared: Prepared, config: GatewayConfig, policy: Any, arrivals: list[Arrival], seed: int
) -> RunRecord:
    loop = asyncio.get_running_loop()
    scenario = prepared.scenario
    names = list(scenario.arrivals)
    count = len(arrivals)
    record = RunRecord(
        arrivals=arrivals,
        outcome=[""] * count,
        approximation=[""] * count,
        rule=[""] * count,
        finished_s=[0.0] * count,
        canary=[False] * count,
        served=[""] * count,
        executions=[],
        ladder={},
        policy_version=policy.version,
        policy_label=policy.current().label,
    )
    submitted: set[str] = set()
    callers: dict[asyncio.Task[Any], int] = {}
    if prefix_backends(prepared):
        record.prefix = PrefixLog([prepared.classes[n].tenant for n in names], arrivals)

    def executed(execution: Execution) -> None:
        index = int(execution.request_id) if execution.request_id.isdigit() else -1
        record.executions.append((index, execution))

    backends: dict[str, _SimBackend] = {}
    handles: dict[str, BackendHandle] = {}
    for spec in scenario.fleet:
        topology = spec.topology
        # A topology's models run on units of its devices: each layout's (one device otherwise).
        units = (
            None
            if topology is None
            else {
                name: [devices for _unit, devices in spec.units_of(name)]
                for name in spec.models
                if not topology.layout_of(name).trivial
            }
        )
        client = _SimBackend(
            spec.name,
            prepared.models[spec.name],
            devices=spec.devices if spec.shares_devices else None,
            time_factor=spec.time_factor,
            call_overhead_ms=spec.call_overhead_ms,
            on_execution=executed,
            submitted=submitted,
            callers=callers,
            served=record.served,
            units=units,
            prefix=record.prefix,
        )
        if topology is not None and topology.lost_devices():
            client.set_devices_lost(topology.lost_devices())
        backends[spec.name] = client
        cfg = spec.backend_config()
        handles[spec.name] = BackendHandle(
            client,
            cfg.labels,
            cfg.devices,
            cfg.max_inflight_per_device,
            cfg.time_scale,
            cfg.shared_devices,
            cfg.memory,  # the live-memory bound, as `serve` applies it
            cfg.topology,  # units and failure domains (dispatch rule 10)
        )
    t0 = loop.time()
    recorder = _LadderRecorder(loop, t0)
    gateway = await assemble_gateway(
        config, prepared.tenants, prepared.routes, handles, policy, listener=recorder
    )
    if scenario.feature_sources:

        def caller() -> int | None:
            task = asyncio.current_task()
            return callers.get(task) if task is not None else None

        install(
            gateway.features,
            dict(scenario.feature_sources),
            seed=seed,
            t0=t0,
            caller=caller,
            log=record.features,
        )
    if record.prefix is not None:
        _watch_prefix(gateway, record.prefix, callers, backends, phase_windows(scenario), t0)
    background = [
        loop.create_task(update_ladders_forever(gateway), name="ladders"),
        loop.create_task(sample_statistics_forever(gateway), name="stats"),
    ]
    upstream = [f.upstream_ms for f in (prepared.classes[n] for n in names)]
    slow_upstream: list[tuple[float, float, frozenset[int], float]] = []  # (from, until, classes, ms)
    for fault in scenario.faults:
        if fault.kind == "slow_upstream":
            assert fault.extra_ms is not None
            chosen = fault.arrivals if fault.arrivals is not None else names
            slow_upstream.append(
                (
                    fault.at_s,
                    fault.until_s if fault.until_s is not None else math.inf,
                    frozenset(names.index(n) for n in chosen),
                    fault.extra_ms,
                )
            )
            record.faults.append(
                {
                    "kind": fault.kind,
                    "at_s": fault.at_s,
                    "until_s": fault.until_s,
                    "extra_ms": fault.extra_ms,
                    "arrivals": sorted(chosen),
                }
            )
            continue
        record.faults.append(_arm_fault(loop, t0, fault, backends, prepared, gateway))
    windows = phase_windows(scenario)
    if any(b.topology is not None for b in scenario.fleet):
        record.units = [{} for _ in windows]

        def sample_units(phase: int) -> None:
            record.units[phase] = {
                backend: {
                    "lost_devices": sorted(unit_set.lost),
                    "available_units": {
                        queue.name: len(unit_set.available_units(queue))
                        for queue in sorted(unit_set.units, key=lambda q: q.name)
                    },
                }
                for backend, unit_set in gateway.pools.topologies()
            }

        # A microsecond before the phase's end: before a change timed at its boundary.
        for p, window in enumerate(windows):
            loop.call_at(t0 + window.end_s - UNITS_SAMPLE_EARLY_S, sample_units, p)
    started_rollouts: list[tuple[float, RolloutSpec, str]] = []  # (at_s, spec, refusal or "")

    def start_rollout(at_s: float, spec: RolloutSpec) -> None:
        try:
            gateway.rollouts.start(spec)
        except GatewayError as error:  # refused (two versions do not fit, ...), as the admin RPC says
            started_rollouts.append((at_s, spec, error.message))
            return
        started_rollouts.append((at_s, spec, ""))

    for at_s, rollout_spec in prepared.rollouts:
        loop.call_at(t0 + at_s, start_rollout, at_s, rollout_spec)
    for published in scenario.evidence:
        route = prepared.routes.models[published.model]
        fallback = prepared.routes.models.get(route.fallback) if route.fallback else None
        gateway.evidence.publish(
            Evidence(
                key=EvidenceKey(
                    published.model, published.version, published.population or population(route, fallback)
                ),
                score=published.score,
                sample_size=published.sample_size,
                owner=published.owner,
                evaluated_at=clock.wall(),
                max_age_s=86_400.0,
            )
        )

    templates: list[bytes] = []
    metadata: list[tuple[tuple[str, str | bytes], ...]] = []
    facts = [prepared.classes[n] for n in names]
    routes_of = [prepared.routes.models[f.model] for f in facts]
    for name, f in zip(names, facts, strict=True):
        templates.append(request_template(f, scenario.arrivals[name], prepared.routes.models[f.model]))
        metadata.append((("authorization", f"Bearer {minted_key(f.tenant)}"),))
    # A class whose route reads features: each request names its entities (drawn per class).
    entity_draws = {
        k: (
            gateway.features.contract(prepared.routes.models[f.model]),
            scenario.arrivals[n].entities or Entities(),
            np.random.default_rng([seed, 2000 + k]),
        )
        for k, (n, f) in enumerate(zip(names, facts, strict=True))
        if f.features_source is not None
    }
    done = loop.create_future()
    remaining = [count]

    def finish(index: int, outcome: str, approximation: str = "", rule: str = "") -> None:
        record.outcome[index] = outcome
        record.approximation[index] = approximation
        record.rule[index] = rule
        record.finished_s[index] = loop.time() - t0
        remaining[0] -= 1
        if remaining[0] == 0 and not done.done():
            done.set_result(None)

    def start(index: int) -> None:
        # Each arrival arms the next: the loop's timer heap stays small (10,000 timers armed
        # up front make every timer operation of the run ~14 comparisons deep).
        if index + 1 < count:
            loop.call_at(t0 + arrivals[index + 1].at_s, start, index + 1)
        arrival = arrivals[index]
        f = facts[arrival.klass]
        # The id first, then the template: protobuf merges concatenated messages. Field 3 (id),
        # length-delimited, as ModelInferRequest(id=...).SerializeToString() writes it.
        ident = str(index).encode()
        raw = b"\x1a" + bytes((len(ident),)) + ident + templates[arrival.klass]
        if arrival.prompt:
            raw += chat_turn_bytes(arrival, routes_of[arrival.klass])
        draw = entity_draws.get(arrival.klass)
        if draw is not None and draw[0] is not None:
            raw += entity_bytes(draw[0], draw[1], draw[2])
        # Upstream work (features, preprocessing) already spent part of the caller's deadline.
        elapsed_ms = upstream[arrival.klass]
        if slow_upstream:
            elapsed_ms += sum(
                ms for a, u, chosen, ms in slow_upstream if arrival.klass in chosen and a <= arrival.at_s < u
            )
        deadline_s = (f.deadline_ms - elapsed_ms) / MS_PER_S
        call = CallContext(
            metadata=metadata[arrival.klass],
            time_remaining_s=deadline_s if f.sets_deadline else None,
            received_at=loop.time(),
        )
        if f.streaming:
            tracker = GapTracker(call.received_at, stream_objectives_of(f))
            record.streams[index] = tracker.summary(call.received_at)
            task = loop.create_task(_stream_call(gateway, raw, call, tracker, index, record, submitted))
        else:
            task = loop.create_task(gateway.infer(raw, call))
        callers[task] = index
        caller_gives_up = (
            loop.call_at(loop.time() + deadline_s, task.cancel)
            if f.sets_deadline and deadline_s > 0
            else None
        )

        def settled(task: asyncio.Task[service_pb2.ModelInferResponse]) -> None:
            callers.pop(task, None)
            if caller_gives_up is not None:
                caller_gives_up.cancel()
            if task.cancelled():
                finish(index, "missed", rule="caller.deadline")
                return
            error = task.exception()
            if error is None:
                response = task.result()
                params = response.parameters
                approximation = degradation(params["orchid.approximation"].string_param)
                # A degraded answer keeps why (provenance: orchid.route_reason, orchid.rules).
                why = ""
                if approximation in DEGRADED:
                    reason, rules = params["orchid.route_reason"], params["orchid.rules"]
                    why = f"{reason.string_param} [{rules.string_param}]"
                late = loop.time() - t0 - arrival.at_s > deadline_s + 1e-9
                record.canary[index] = params["orchid.route_reason"].string_param == CANARY_REASON
                finish(index, "late" if late else "on_time", approximation, why)
                return
            if not isinstance(error, GatewayError):
                finish(index, "failed", rule=type(error).__name__)
                return
            rule = error.rule or ""
            if rule in LATE_RULES:
                finish(index, "rejected_late", rule=rule)
            elif str(index) in submitted:
                # It reached a backend: a deadline there is a miss, anything else a failure.
                outcome = "missed" if isinstance(error, DeadlineExpired) else "failed"
                finish(index, outcome, rule=rule or error.status)
            elif isinstance(error, DeadlineExpired):
                finish(index, "rejected_late", rule=rule or error.status)
            else:
                finish(index, "rejected_early", rule=rule or error.status)

        task.add_done_callback(settled)

    if count:
        loop.call_at(t0 + arrivals[0].at_s, start, 0)
        await done
    if record.units and loop.time() < t0 + windows[-1].end_s:  # the last phase's units sample
        await asyncio.sleep(t0 + windows[-1].end_s - loop.time())
    for at_s, rollout_spec, refused in started_rollouts:
        entry: dict[str, Any] = {"name": rollout_spec.name, "at_s": at_s}
        if refused:
            entry["refused"] = refused
        else:
            entry.update(gateway.rollouts.report(rollout_spec.name))
        record.rollouts.append(entry)
    await gateway.rollouts.close()
    if record.prefix is not None:
        record.prefix.backends.append(_prefix_stats(backends))  # the last phase: at the run's end
        record.prefix.counters = {
            route: dataclasses.asdict(c) for route, c in sorted(gateway.pools.prefix.counters.items())
        }
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    for client in backends.values():
        await client.close()
    record.ladder = dict(recorder.samples)
    return record


def prefix_backends(prepared: Prepared) -> dict[str, dict[str, PrefixCacheSpec]]:
    """Per backend of the fleet, its models that keep a prefix cache (none: no prefix report)."""
    out: dict[str, dict[str, PrefixCacheSpec]] = {}
    for backend, models in prepared.models.items():
        caches = {name: m.prefix_cache for name, m in models.items() if m.prefix_cache is not None}
        if caches:
            out[backend] = caches
    return out


def _prefix_stats(backends: Mapping[str, _SimBackend]) -> dict[str, Any]:
    """Each prefix cache's counters now, by ``backend/model``."""
    out: dict[str, Any] = {}
    for name, backend in sorted(backends.items()):
        for model in sorted(backend.caches):
            out[f"{name}/{model}"] = backend.prefix_stats(model)
    return out


def _watch_prefix(
    gateway: Gateway,
    log: PrefixLog,
    callers: Mapping[asyncio.Task[Any], int],
    backends: Mapping[str, _SimBackend],
    windows: Sequence[PhaseWindow],
    t0: float,
) -> None:
    """Note affinity's placement of each arrival as the gateway observes its answer (its
    ``PrefixAffinity.observe``, on the caller's task), and the backends' cache counters a
    microsecond before each phase's end (the last phase's at the run's end)."""

    def observed(match: PrefixMatch, reported: int) -> None:
        task = asyncio.current_task()
        index = callers.get(task) if task is not None else None
        if index is not None:
            log.placed[index] = (match.spilled, match.extra_wait_ms, match.index_tokens)

    gateway.pools.prefix.on_observed = observed
    loop = asyncio.get_running_loop()
    for window in windows[:-1]:
        loop.call_at(
            t0 + window.end_s - UNITS_SAMPLE_EARLY_S, lambda: log.backends.append(_prefix_stats(backends))
        )


def _arm_fault(
    loop: asyncio.AbstractEventLoop,
    t0: float,
    fault: Fault,
    backends: Mapping[str, MemoryBackend],
    prepared: Prepared,
    gateway: Gateway | None = None,
) -> dict[str, Any]:
    applied: dict[str, Any] = {"kind": fault.kind, "at_s": fault.at_s, "until_s": fault.until_s}
    actions: list[tuple[float, Callable[[], None]]] = []
    if fault.kind == "devices_lost":
        assert fault.backend is not None and gateway is not None
        spec = next(b for b in prepared.scenario.fleet if b.name == fault.backend)
        devices = fault.lost_devices(spec)
        applied.update(_devices_lost_entry(fault, spec, devices))
        backend = backends[fault.backend]
        pools = gateway.pools
        name = fault.backend

        def lose(lost: bool) -> Callable[[], None]:
            return lambda: backend.set_devices_lost(devices, lost)

        def tell(lost: bool) -> Callable[[], None]:  # as an operator or agent: SetDevicesLost
            return lambda: pools.set_devices_lost(name, devices, lost=lost, now=clock.now())

        actions.append((fault.at_s, lose(True)))
        actions.append((fault.at_s + fault.detect_after_s, tell(True)))
        if fault.until_s is not None:
            actions.append((fault.until_s, lose(False)))
            actions.append((fault.until_s + fault.detect_after_s, tell(False)))
    elif fault.kind == "device_group_lost":
        assert fault.backend is not None
        backend = backends[fault.backend]
        applied["backend"] = fault.backend
        actions.append((fault.at_s, lambda: backend.set_healthy(False)))
        if fault.until_s is not None:
            cold = fault.cold
            actions.append((fault.until_s, lambda: backend.set_healthy(True, cold=cold)))
        if fault.cold:
            assert fault.until_s is not None
            back_at = fault.until_s
            models = prepared.models[fault.backend]
            applied["cold"] = True
            applied["ready_at_s"] = {
                name: _r(back_at + m.load_s) for name, m in sorted(models.items()) if m.loaded
            }
    else:
        assert fault.model is not None
        model = fault.model
        route = _route_of(model, prepared.tenants, prepared.routes)
        longer_than = fault.longer_than_tokens
        if longer_than is None:
            longer_than = route.shape.long_input_tokens if route is not None else 0
        serving = [b for b in backends.values() if b.is_warm(model)]
        applied.update(model=model, factor=fault.factor, longer_than_tokens=longer_than)

        def slow(factor: float) -> Callable[[], None]:
            def apply() -> None:
                for backend in serving:
                    backend.slow_down(model, factor, longer_than=longer_than)

            return apply

        actions.append((fault.at_s, slow(fault.factor)))
        if fault.until_s is not None:
            actions.append((fault.until_s, slow(1.0)))
    for at_s, action in actions:
        loop.call_at(t0 + at_s, action)
    return applied


def _devices_lost_entry(fault: Fault, backend: FleetBackend, devices: tuple[int, ...]) -> dict[str, Any]:
    """A devices_lost fault's report entry: its devices and, per pool of the backend
    (``backend/model``), the units it takes and the units left (``domain_losses``' count)."""
    entry: dict[str, Any] = {
        "backend": backend.name,
        "devices": list(devices),
        "detect_after_s": fault.detect_after_s,
    }
    if fault.domain is not None:
        entry["domain"] = {"kind": fault.domain.kind, "name": fault.domain.name}
    units: dict[str, Any] = {}
    for model in sorted(backend.models):
        planned = backend.units_of(model)
        lost = [name for name, unit in planned if not set(unit).isdisjoint(devices)]
        units[f"{backend.name}/{model}"] = {
            "units": len(planned),
            "units_lost": lost,
            "units_left": len(planned) - len(lost),
        }
    entry["units"] = units
    return entry


# --------------------------------------------------------------------------- the report


def _r(value: float, digits: int = 3) -> float:
    rounded = round(value, digits)
    return 0.0 if rounded == 0 else rounded  # no "-0.0"


def _pct(part: float, whole: float) -> float | None:
    return _r(100.0 * part / whole, 2) if whole > 0 else None


def report(prepared: Prepared, record: RunRecord, *, seed: int) -> dict[str, Any]:
    """The run as a JSON-ready document (sorted keys at dump; rounded figures), with the
    scenario's expectations checked against it."""
    scenario = prepared.scenario
    config = prepared.config
    names = list(scenario.arrivals)
    facts = [prepared.classes[n] for n in names]
    windows = phase_windows(scenario)
    protected = config.protected_utilization
    envelope_ms = sum(b.devices * protected * MS_PER_S / b.time_factor for b in scenario.fleet)
    devices = sum(b.devices for b in scenario.fleet)

    # Device time per arrival: useful (its caller got an answer in time) or wasted.
    wasted: dict[tuple[int, int], float] = defaultdict(float)
    useful: dict[tuple[int, int], float] = defaultdict(float)
    shadow_ms: dict[int, float] = defaultdict(float)
    expired: dict[tuple[int, int], float] = defaultdict(float)  # the caller's deadline passed as it ran
    for index, execution in record.executions:
        if index < 0 or index >= len(record.arrivals):
            continue
        arrival = record.arrivals[index]
        key = (arrival.phase, arrival.klass)
        if execution.model != record.served[index]:
            # Off the caller's path: a mirror (the route's shadow, a rollout's shadow step).
            shadow_ms[arrival.phase] += execution.device_ms
        elif execution.answered and record.outcome[index] == "on_time":
            useful[key] += execution.device_ms
        else:
            wasted[key] += execution.device_ms
            if record.outcome[index] in ("missed", "late"):
                expired[key] += execution.device_ms

    per: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    rules: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    degradations: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    saving: dict[tuple[int, int], float] = defaultdict(float)
    offered_ms: dict[tuple[int, int], float] = defaultdict(float)
    backpressured: dict[tuple[int, int], list[float]] = defaultdict(list)  # arrival times
    feature_counts: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    for index, arrival in enumerate(record.arrivals):
        key = (arrival.phase, arrival.klass)
        f = facts[arrival.klass]
        counts = per[key]
        counts["offered"] += 1
        offered_ms[key] += f.primary_ms
        outcome = record.outcome[index]
        counts[outcome] += 1
        if outcome == "on_time" and record.canary[index]:
            counts["canary"] += 1
        if outcome == "on_time":
            approximation = record.approximation[index] or "none"
            counts[approximation] += 1
            if approximation == "fallback" and f.fallback_ms is not None:
                saving[key] += f.primary_ms - f.fallback_ms
            if approximation in DEGRADED:
                degradations[key][f"{approximation}: {record.rule[index]}"] += 1
        elif record.rule[index]:
            rules[key][f"{outcome}:{record.rule[index]}"] += 1
        if outcome == "rejected_early" and record.rule[index] == RULE_BACKPRESSURE:
            backpressured[key].append(arrival.at_s)
        read = record.features.outcome.get(index)
        if read is not None:
            feature_counts[key][read] += 1

    features_on = bool(scenario.feature_sources)

    def feature_figures(keys: Sequence[tuple[int, int]], duration: float, start_s: float) -> dict[str, Any]:
        counts = Counter[str]()
        times: list[float] = []
        for key in keys:
            counts.update(feature_counts.get(key, Counter()))
            times += backpressured.get(key, [])
        reads = counts["read"] + counts["read_failed"]
        offered_n = sum(per[key]["offered"] for key in keys if key in per)
        waste = sum(expired[key] for key in keys)
        return {
            "feature_reads": reads,
            "feature_read_failures": counts["read_failed"],
            "feature_cache_hits": counts["cache_hit"],
            "feature_cache_hit_pct": _pct(counts["cache_hit"], reads + counts["cache_hit"]),
            "backpressure_refusals": len(times),
            "backpressure_refusals_pct": _pct(len(times), offered_n),
            "backpressure_last_refusal_s": _r(last_refusal_after(times, start_s)),
            "expired_device_ms": _r(waste),
            "expired_device_ms_per_s": _r(waste / duration),
        }

    def block(
        counts: Counter[str], duration: float, offered: float, waste: float, served: float
    ) -> dict[str, Any]:
        offered_n = counts["offered"]
        out: dict[str, Any] = {
            "offered": offered_n,
            "offered_per_s": _r(offered_n / duration),
            "offered_ms_per_s": _r(offered / duration),
            "full": counts["none"],
            "fallback": counts["fallback"],
            "reduced_output": counts["reduced_output"],
            "degraded": counts["fallback"] + counts["reduced_output"],
            "wasted_device_ms": _r(waste),
            "wasted_device_ms_per_s": _r(waste / duration),
            "served_device_ms_per_s": _r(served / duration),
        }
        for outcome in OUTCOMES:
            out[outcome] = counts[outcome]
            out[f"{outcome}_pct"] = _pct(counts[outcome], offered_n)
        out["degraded_pct"] = _pct(out["degraded"], offered_n)
        out["degraded_pct_of_on_time"] = _pct(out["degraded"], counts["on_time"])
        out["missed_late_pct"] = _pct(counts["rejected_late"] + counts["missed"] + counts["late"], offered_n)
        out["on_time_of_admitted_pct"] = _pct(counts["on_time"], offered_n - counts["rejected_early"])
        out["canary"] = counts["canary"]
        out["canary_pct"] = _pct(counts["canary"], offered_n)
        return out

    phases_out: list[dict[str, Any]] = []
    for p, window in enumerate(windows):
        duration = window.duration_s
        classes_out: dict[str, Any] = {}
        total = Counter[str]()
        total_offered = total_waste = total_served = total_saving = 0.0
        for k, name in enumerate(names):
            key = (p, k)
            counts = per.get(key, Counter())
            total.update(counts)
            total_offered += offered_ms[key]
            total_waste += wasted[key]
            total_served += useful[key]
            total_saving += saving[key]
            entry = block(counts, duration, offered_ms[key], wasted[key], useful[key])
            entry["fallback_saving_ms_per_s"] = _r(saving[key] / duration)
            entry["refusals"] = dict(sorted(rules.get(key, Counter()).items()))
            entry["degradations"] = dict(sorted(degradations.get(key, Counter()).items()))
            if facts[k].streaming:
                entry.update(_stream_figures(record, p, k, counts["offered"]))
            if features_on:
                entry.update(feature_figures([key], duration, window.start_s))
            classes_out[name] = entry
        tenants_out: dict[str, Any] = {}
        for tenant in sorted({f.tenant for f in facts}):
            members = [k for k, f in enumerate(facts) if f.tenant == tenant]
            t_counts = Counter[str]()
            for k in members:
                t_counts.update(per.get((p, k), Counter()))
            t_offered = sum(offered_ms[(p, k)] for k in members)
            t_served = sum(useful[(p, k)] for k in members)
            t_waste = sum(wasted[(p, k)] for k in members)
            entry = block(t_counts, duration, t_offered, t_waste, t_served)
            entry["fallback_saving_ms_per_s"] = _r(sum(saving[(p, k)] for k in members) / duration)
            entry["weight"] = prepared.tenants.tenants[tenant].weight
            entry["share_of_served_pct"] = _pct(t_served, total_served)
            entry["share_of_offered_pct"] = _pct(t_offered, total_offered)
            if features_on:
                entry.update(feature_figures([(p, k) for k in members], duration, window.start_s))
            tenants_out[tenant] = entry
        totals = block(total, duration, total_offered, total_waste, total_served)
        totals["fallback_saving_ms_per_s"] = _r(total_saving / duration)
        totals["shadow_device_ms"] = _r(shadow_ms[p])
        totals["shadow_device_ms_per_s"] = _r(shadow_ms[p] / duration)
        if features_on:
            totals.update(feature_figures([(p, k) for k in range(len(names))], duration, window.start_s))
        phases_out.append(
            {
                "name": window.name,
                "start_s": _r(window.start_s),
                "end_s": _r(window.end_s),
                "duration_s": _r(duration),
                "multiplier": window.multiplier,
                "offered_pct_of_protected": _pct(total_offered / duration, envelope_ms),
                "classes": classes_out,
                "tenants": tenants_out,
                "totals": totals,
                "ladder": _ladder_phase(record.ladder, window),
                **({"units": record.units[p]} if record.units else {}),
            }
        )
    document: dict[str, Any] = {
        "scenario": prepared.source.path.name,
        "description": scenario.description.strip(),
        "seed": seed,
        "policy": {"label": record.policy_label, "version": record.policy_version},
        "envelope": {
            "devices": devices,
            "protected_utilization": protected,
            "protected_ms_per_s": _r(envelope_ms),
            "raw_ms_per_s": _r(sum(b.devices * MS_PER_S / b.time_factor for b in scenario.fleet)),
        },
        "classes": {
            f.name: {
                "tenant": f.tenant,
                "class": f.request_class,
                "model": f.model,
                "fallback": f.fallback,
                "input_tokens": f.input_tokens,
                "output_tokens": f.output_tokens,
                "deadline_ms": _r(f.deadline_ms),
                "rate_per_s": _r(f.rate_per_s, 4),
                "primary_ms": _r(f.primary_ms, 4),
                "fallback_ms": _r(f.fallback_ms, 4) if f.fallback_ms is not None else None,
                **(
                    {
                        "mode": "streaming",
                        "first_result_ms": _r(f.first_result_ms) if f.first_result_ms is not None else None,
                        "gap_ms": _r(f.gap_ms) if f.gap_ms is not None else None,
                    }
                    if f.streaming
                    else {}
                ),
            }
            for f in facts
        },
        "faults": record.faults,
        **({"feature_sources": _feature_sources(prepared)} if scenario.feature_sources else {}),
        "rollouts": record.rollouts,
        "phases": phases_out,
        "timeline": _timeline(prepared, record, windows),
    }
    if record.prefix is not None:
        for phase_out, prefix in zip(phases_out, _prefix_phases(prepared, record, windows), strict=True):
            phase_out["prefix"] = prefix
        document["prefix"] = _prefix_run(prepared, record)
    document["expectations"] = check_expectations(scenario, document)
    document["expectations_held"] = all(e["held"] for e in document["expectations"])
    return document


def _prefix_figures(
    record: RunRecord, indices: Sequence[int], device_ms: Mapping[int, float], ms_per_token: Sequence[float]
) -> dict[str, Any]:
    """The prefix-cache figures of these arrivals (one phase's, of one route or all)."""
    log = record.prefix
    assert log is not None
    offered = len(indices)
    answered = [i for i in indices if record.outcome[i] in ("on_time", "late")]
    on_time = sum(record.outcome[i] == "on_time" for i in indices)
    reported = [i for i in answered if i in log.cached]
    hits = [i for i in reported if log.cached[i] > 0]
    cached = sum(log.cached[i] for i in reported)
    prompt = sum(log.prompt_tokens.get(i, 0) for i in reported)
    saved = sum(log.cached[i] * ms_per_token[record.arrivals[i].klass] for i in reported)
    placed = [log.placed[i] for i in answered if i in log.placed]
    spent = sum(device_ms.get(i, 0.0) for i in indices)
    return {
        "offered": offered,
        "answered": len(answered),
        "on_time": on_time,
        "on_time_pct": _pct(on_time, offered),
        "prefix_requests": len(reported),
        "prefix_hits": len(hits),
        "prefix_hit_pct": _pct(len(hits), len(reported)),
        "prefix_cached_tokens": cached,
        "prefix_prompt_tokens": prompt,
        "prefix_cached_token_pct": _pct(cached, prompt),
        "prefix_saved_device_ms": _r(saved),
        "prefix_device_ms": _r(spent),
        "prefix_device_ms_per_answered": _r(spent / len(answered)) if answered else None,
        "prefix_expected_hits": sum(1 for p in placed if p[2] > 0),
        "prefix_spills": sum(1 for p in placed if p[0]),
        "prefix_extra_wait_ms_max": _r(max((p[1] for p in placed), default=0.0)),
        "prefix_cross_tenant_hits": sum(1 for i in hits if log.cached[i] > log.own.get(i, 0)),
    }


def _prefix_phases(
    prepared: Prepared, record: RunRecord, windows: Sequence[PhaseWindow]
) -> list[dict[str, Any]]:
    """Per phase: the prefix-cache figures of the arrivals to each route whose backend model
    keeps a cache (``routes``) and of all of them (``totals``), and each cache's counters over
    the phase (``backends``: lookups, hits, hit_blocks, miss_blocks, inserted, evictions; the
    blocks it held at the phase's end)."""
    log = record.prefix
    assert log is not None
    cached_models = {m for caches in prefix_backends(prepared).values() for m in caches}
    names = list(prepared.scenario.arrivals)
    facts = [prepared.classes[n] for n in names]
    routes = prepared.routes.models
    on_cache = [routes[f.model].backend_model in cached_models for f in facts]
    ms_per_token = [  # what one cached prompt token saves: the route's profile price
        prepared.routes.profiles[routes[f.model].profile].prefill_ms_per_token
        * _profile_scale(prepared.scenario, routes[f.model].backend_model)
        for f in facts
    ]
    device_ms: dict[int, float] = defaultdict(float)
    for index, execution in record.executions:
        if 0 <= index < len(record.arrivals) and execution.model == record.served[index]:
            device_ms[index] += execution.device_ms
    out: list[dict[str, Any]] = []
    for p, _window in enumerate(windows):
        chosen = [i for i, a in enumerate(record.arrivals) if a.phase == p and on_cache[a.klass]]
        by_route: dict[str, list[int]] = defaultdict(list)
        for i in chosen:
            by_route[facts[record.arrivals[i].klass].model].append(i)
        before = log.backends[p - 1] if p > 0 and p - 1 < len(log.backends) else {}
        after = log.backends[p] if p < len(log.backends) else {}
        backends: dict[str, Any] = {}
        for key, stats in after.items():
            base = before.get(key, {})
            backends[key] = {
                name: value if name == "held_blocks" else value - base.get(name, 0)
                for name, value in stats.items()
            }
        out.append(
            {
                "routes": {
                    route: _prefix_figures(record, indices, device_ms, ms_per_token)
                    for route, indices in sorted(by_route.items())
                },
                "totals": _prefix_figures(record, chosen, device_ms, ms_per_token),
                "backends": backends,
            }
        )
    return out


def _prefix_run(prepared: Prepared, record: RunRecord) -> dict[str, Any]:
    """The run's prefix-cache summary: each cache's counters at the end, the gateway's
    per-route counters (``PrefixAffinity.counters``), and the scopes more than one tenant sent
    (must be none: a scope holds its tenant)."""
    log = record.prefix
    assert log is not None
    return {
        "caches": {
            f"{backend}/{model}": {"block_tokens": spec.block_tokens, "capacity_blocks": spec.capacity_blocks}
            for backend, caches in sorted(prefix_backends(prepared).items())
            for model, spec in sorted(caches.items())
        },
        "backends": log.backends[-1] if log.backends else {},
        "gateway_counters": {
            route: {k: _r(v) if isinstance(v, float) else v for k, v in counters.items()}
            for route, counters in log.counters.items()
        },
        "scopes_sent": len(log.scopes),
        "scopes_shared_by_tenants": sorted(scope for scope, who in log.scopes.items() if len(who) > 1),
    }


def _feature_sources(prepared: Prepared) -> dict[str, Any]:
    """Each simulated source: the gateway config's settings the runtime judges it by, and the
    scenario's latency model."""
    out: dict[str, Any] = {}
    for name, model in sorted(prepared.scenario.feature_sources.items()):
        config = prepared.config.feature_sources[name]
        out[name] = {
            "backpressure": config.backpressure,
            "budget_ms": config.budget_ms,
            "timeout_ms": config.timeout_ms,
            "latency_quantile": config.latency_quantile,
            "window_s": config.window_s,
            "min_samples": config.min_samples,
            "probe_interval_s": config.probe_interval_s,
            "max_concurrency": config.max_concurrency,
            "cache_ttl_ms": config.cache_ttl_ms,
            "median_ms": model.median_ms,
            "p95_ms": model.p95_ms,
            "failure_rate": model.failure_rate,
            "value_age_s": model.value_age_s,
            "incidents": [i.model_dump() for i in model.incidents],
        }
    return out


def _quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (None: no value)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _stream_figures(record: RunRecord, phase: int, klass: int, offered: int) -> dict[str, Any]:
    """A streaming class's streams in a phase against their objectives: the first result in
    time (% of offered: a refused stream's first result never came), the gap objective met
    (% of admitted streams: those that sent a result), first-result p50/p95 and the largest
    gap's p95 (ms, admitted streams)."""
    summaries = [
        record.streams[i]
        for i, a in enumerate(record.arrivals)
        if a.phase == phase and a.klass == klass and i in record.streams
    ]
    started = [s for s in summaries if s.results]
    firsts = [s.first_result_ms for s in started if s.first_result_ms is not None]
    on_time = sum(s.first_result_met for s in summaries)
    gap_met = sum(s.gap_objective_met for s in started)
    p50, p95, gap_p95 = (
        _quantile(firsts, 0.5),
        _quantile(firsts, 0.95),
        _quantile([s.max_gap_ms for s in started], 0.95),
    )
    return {
        "streams_started": len(started),
        "first_result_on_time": on_time,
        "first_result_on_time_pct": _pct(on_time, offered),
        "gap_objective_met": gap_met,
        "gap_objective_met_pct": _pct(gap_met, len(started)),
        "gaps_over_objective": sum(s.gaps_over_objective for s in started),
        "first_result_p50_ms": _r(p50) if p50 is not None else None,
        "first_result_p95_ms": _r(p95) if p95 is not None else None,
        "max_gap_p95_ms": _r(gap_p95) if gap_p95 is not None else None,
    }


def _figure(phase: Mapping[str, Any], expectation: Expectation, name: str) -> float | None:
    """One figure of a phase in the expectation's scope (None: the phase has no such figure,
    e.g. a share of nothing offered)."""
    if name == "max_step":
        pools = phase["ladder"]
        steps = [v["max_step"] for k, v in pools.items() if expectation.pool in (None, k)]
        return float(max(steps, default=0))
    kind, _, who = expectation.scope.partition(" ")
    if kind == "route" or (name.startswith("prefix_") and kind == "totals"):
        prefix = phase.get("prefix", {})
        block = prefix.get("totals") if kind == "totals" else prefix.get("routes", {}).get(who)
    else:
        block = (
            phase["totals"]
            if kind == "totals"
            else phase[{"class": "classes", "tenant": "tenants"}[kind]].get(who)
        )
    if block is None:
        return None
    value = block.get(name)
    return None if value is None else float(value)


def check_expectations(
    scenario: Scenario, document: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Every bound of the scenario's ``expect:`` against the report's figures: what it asked,
    what the run had, whether it held. A figure the phase does not have (nothing offered in
    its scope) does not hold: an expectation must not pass by having nothing to judge.
    ``runs`` (with ``compare:``): each run's report by label, for ``run`` and ``versus_run``."""
    out: list[dict[str, Any]] = []
    for expectation in scenario.expect:
        judged = document
        if expectation.run is not None:
            found = (runs or {}).get(expectation.run)
            if found is None:  # the runs are not there yet (report() before compare): not held
                out.append(
                    {
                        "phase": expectation.phase,
                        "scope": expectation.scope,
                        "run": expectation.run,
                        "figure": "",
                        "bound": "max",
                        "limit": None,
                        "value": None,
                        "held": False,
                    }
                )
                continue
            judged = found
        phases = {p["name"]: p for p in judged["phases"]}
        phase = phases[expectation.phase]
        scope = expectation.scope + (f" {expectation.pool}" if expectation.pool else "")
        bounds: list[tuple[str, str, float]] = [("min", n, v) for n, v in expectation.min.items()]
        bounds += [("max", n, v) for n, v in expectation.max.items()]
        above_base: dict[str, float | None] = {}
        for name, margin in expectation.max_above.items():
            if expectation.versus is not None:
                base = _figure(phases[expectation.versus], expectation, name)
            else:  # the same phase in versus_run
                other = (runs or {}).get(expectation.versus_run or "")
                base = (
                    None
                    if other is None
                    else _figure(
                        {p["name"]: p for p in other["phases"]}[expectation.phase], expectation, name
                    )
                )
                above_base[name] = base
            bounds.append(("max", name, math.nan if base is None else base + margin))
        ratio_base: dict[str, float | None] = {}
        for name, ratio in expectation.max_ratio.items():
            assert expectation.versus_run is not None
            other = (runs or {}).get(expectation.versus_run)
            base = (
                None
                if other is None
                else _figure({p["name"]: p for p in other["phases"]}[expectation.phase], expectation, name)
            )
            ratio_base[name] = base
            # The compared run must have some of it: a ratio of nothing proves nothing.
            bounds.append(("max", name, math.nan if base is None or base <= 0 else ratio * base))
        for kind, name, limit in bounds:
            value = _figure(phase, expectation, name)
            held = value is not None and not math.isnan(limit)
            if held and value is not None:
                held = value >= limit - 1e-9 if kind == "min" else value <= limit + 1e-9
            entry: dict[str, Any] = {
                "phase": expectation.phase,
                "scope": scope,
                "figure": name,
                "bound": kind,
                "limit": None if math.isnan(limit) else _r(limit),
                "value": value,
                "held": held,
            }
            if expectation.versus is not None and name in expectation.max_above:
                entry["versus"] = expectation.versus
                entry["margin"] = expectation.max_above[name]
            if expectation.run is not None:
                entry["run"] = expectation.run
            if name in expectation.max_ratio:
                entry["versus_run"] = expectation.versus_run
                entry["ratio"] = expectation.max_ratio[name]
                entry["versus_value"] = ratio_base[name]
            elif name in above_base:
                entry["versus_run"] = expectation.versus_run
                entry["margin"] = expectation.max_above[name]
                entry["versus_value"] = above_base[name]
            if expectation.because:
                entry["because"] = expectation.because.strip()
            out.append(entry)
    return out


def _ladder_phase(ladder: Mapping[str, list[tuple[float, int]]], window: PhaseWindow) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool in sorted(ladder):
        steps = [s for t, s in ladder[pool] if window.start_s <= t < window.end_s]
        if not steps:
            continue
        counts = Counter(steps)
        out[pool] = {
            "max_step": max(steps),
            "time_at_step_pct": {str(s): _pct(counts[s], len(steps)) for s in sorted(counts)},
        }
    return out


def _timeline(prepared: Prepared, record: RunRecord, windows: list[PhaseWindow]) -> dict[str, Any]:
    interval = prepared.scenario.report.interval_s
    end = windows[-1].end_s
    bins = max(1, math.ceil(end / interval - 1e-9))
    facts = [prepared.classes[n] for n in prepared.scenario.arrivals]
    tenants = sorted({f.tenant for f in facts})
    offered = {t: [0] * bins for t in tenants}
    on_time = {t: [0] * bins for t in tenants}
    degraded = {t: [0] * bins for t in tenants}
    for index, arrival in enumerate(record.arrivals):
        b = min(bins - 1, int(arrival.at_s / interval))
        tenant = facts[arrival.klass].tenant
        offered[tenant][b] += 1
        if record.outcome[index] == "on_time":
            on_time[tenant][b] += 1
            if record.approximation[index] in DEGRADED:
                degraded[tenant][b] += 1
    ladder: dict[str, list[int]] = {}
    for pool in sorted(record.ladder):
        steps = [0] * bins
        for t, step in record.ladder[pool]:
            b = min(bins - 1, int(t / interval))
            steps[b] = max(steps[b], step)
        ladder[pool] = steps
    return {
        "interval_s": interval,
        "start_s": [_r(i * interval) for i in range(bins)],
        "tenants": {
            t: {"offered": offered[t], "on_time": on_time[t], "degraded": degraded[t]} for t in tenants
        },
        "ladder_max_step": ladder,
    }


# --------------------------------------------------------------------------- comparing


COMPARED = (
    "on_time_pct",
    "degraded_pct",
    "rejected_early_pct",
    "rejected_late_pct",
    "missed_pct",
    "failed_pct",
    "wasted_device_ms_per_s",
    "fallback_saving_ms_per_s",
)


def differences(baseline: Mapping[str, Any], candidate: Mapping[str, Any]) -> dict[str, Any]:
    """Per phase and class (and totals, tenants): candidate - baseline, for the figures that
    differ; max ladder step per pool too."""
    out: dict[str, Any] = {}
    for before, after in zip(baseline["phases"], candidate["phases"], strict=True):
        phase: dict[str, Any] = {}
        groups = [("totals", before["totals"], after["totals"])]
        groups += [(f"class {n}", before["classes"][n], after["classes"][n]) for n in before["classes"]]
        groups += [(f"tenant {n}", before["tenants"][n], after["tenants"][n]) for n in before["tenants"]]
        for label, b, a in groups:
            delta = {}
            for metric in COMPARED:
                x, y = b.get(metric), a.get(metric)
                if x is None or y is None or x == y:
                    continue
                delta[metric] = _r(y - x, 3)
            if delta:
                phase[label] = delta
        for pool in sorted(set(before["ladder"]) | set(after["ladder"])):
            x = before["ladder"].get(pool, {}).get("max_step", 0)
            y = after["ladder"].get(pool, {}).get("max_step", 0)
            if x != y:
                phase[f"ladder {pool}"] = {"max_step": y - x}
        if phase:
            out[before["name"]] = phase
    return out


# --------------------------------------------------------------------------- text


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.1f}{suffix}"
    return f"{value:,}{suffix}"


def _span(phase: Mapping[str, Any]) -> str:
    return f"{phase['start_s']:g}-{phase['end_s']:g}"


def _pct2(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} %"


def render_text(document: Mapping[str, Any]) -> str:
    pw = max(10, *(len(p["name"]) for p in document["phases"]))  # the phase column's width
    env = document["envelope"]
    policy = document["policy"]
    lines = [
        f"Simulation: {document['scenario']} (seed {document['seed']}; policy "
        f"{policy['label'] or '-'} {policy['version']})",
        f"Fleet: {env['devices']} devices; protected envelope {_fmt(env['protected_ms_per_s'])} "
        f"accelerator-ms/s ({env['protected_utilization']:.0%} of {_fmt(env['raw_ms_per_s'])})",
    ]
    for fault in document["faults"]:
        if fault["kind"] == "slow_upstream":
            target = f"+{fault['extra_ms']:g} ms upstream for {', '.join(fault['arrivals'])}"
        elif fault["kind"] == "devices_lost":
            domain = fault.get("domain")
            target = f"{fault['backend']} devices {_device_span(fault['devices'])}" + (
                f" ({domain['kind']} {domain['name']})" if domain else ""
            )
        else:
            slowed = f"{fault.get('model')} x{fault.get('factor')}"
            target = fault.get("backend") or f"{slowed} over {fault.get('longer_than_tokens')} tokens"
        until = f" until {fault['until_s']} s" if fault.get("until_s") is not None else ""
        if fault.get("cold"):
            ready = ", ".join(f"{m} at {t:g} s" for m, t in fault["ready_at_s"].items())
            until += f", back cold (ready: {ready})"
        lines.append(f"Fault: {fault['kind']} {target} at {fault['at_s']} s{until}")
        if fault["kind"] == "devices_lost":
            if fault["detect_after_s"]:
                lines[-1] += f"; the gateway learns {fault['detect_after_s']:g} s later"
            taken = [
                f"{pool} {len(u['units_lost'])} of {u['units']}"
                for pool, u in fault["units"].items()
                if u["units_lost"]
            ]
            lines.append(f"  units taken: {', '.join(taken) or 'none'}")
    for rollout in document.get("rollouts", []):
        if "refused" in rollout:
            lines.append(f"Rollout: {rollout['name']} at {rollout['at_s']:g} s refused: {rollout['refused']}")
            continue
        lines.append(
            f"Rollout: {rollout['name']} ({rollout['current']} -> {rollout['candidate']}) started at "
            f"{rollout['at_s']:g} s: {rollout['phase']}, step {rollout['step']} of {rollout['steps']}"
            + (f" ({rollout['reason']})" if rollout.get("reason") else "")
        )
    lines.append("")
    header = (
        f"{'phase':<{pw}} {'time s':>9} {'mult':>5} {'offered ms/s':>13} {'% protected':>11} {'step':>4}"
        f" {'on time':>8} {'degraded':>8} {'rej early':>9} {'rej late':>8} {'missed':>7} {'failed':>7}"
        f" {'wasted ms/s':>11} {'fb saving ms/s':>14}"
    )
    lines.append(header)
    for phase in document["phases"]:
        t = phase["totals"]
        step = max((v["max_step"] for v in phase["ladder"].values()), default=0)
        lines.append(
            f"{phase['name']:<{pw}} {_span(phase):>9} {phase['multiplier']:>5.2f}"
            f" {_fmt(t['offered_ms_per_s']):>13} {_pct2(phase['offered_pct_of_protected']):>11} {step:>4}"
            f" {_fmt(t['on_time_pct'], '%'):>8} {_fmt(t['degraded_pct'], '%'):>8}"
            f" {_fmt(t['rejected_early_pct'], '%'):>9} {_fmt(t['rejected_late_pct'], '%'):>8}"
            f" {_fmt(t['missed_pct'], '%'):>7} {_fmt(t['failed_pct'], '%'):>7}"
            f" {_fmt(t['wasted_device_ms_per_s']):>11} {_fmt(t['fallback_saving_ms_per_s']):>14}"
        )
    lines.append("")
    lines.append(
        f"{'phase':<{pw}} {'class':<12} {'offered':>8} {'on time':>8} {'full':>7} {'fallback':>8}"
        f" {'reduced':>8}"
        f" {'rej early':>9} {'rej late':>8} {'missed':>7} {'failed':>7} {'wasted dev-ms':>13}"
    )
    for phase in document["phases"]:
        for name, c in phase["classes"].items():
            if not c["offered"]:
                continue
            lines.append(
                f"{phase['name']:<{pw}} {name:<12} {c['offered']:>8,} {_fmt(c['on_time_pct'], '%'):>8}"
                f" {_fmt(_pct(c['full'], c['offered']), '%'):>7}"
                f" {_fmt(_pct(c['fallback'], c['offered']), '%'):>8}"
                f" {_fmt(_pct(c['reduced_output'], c['offered']), '%'):>8}"
                f" {_fmt(c['rejected_early_pct'], '%'):>9} {_fmt(c['rejected_late_pct'], '%'):>8}"
                f" {_fmt(c['missed_pct'], '%'):>7} {_fmt(c['failed_pct'], '%'):>7}"
                f" {_fmt(c['wasted_device_ms']):>13}"
            )
    streaming = [
        (phase, name, c)
        for phase in document["phases"]
        for name, c in phase["classes"].items()
        if "first_result_on_time_pct" in c and c["offered"]
    ]
    if streaming:
        lines.append("")
        lines.append(
            f"{'phase':<{pw}} {'stream class':<12} {'offered':>8} {'started':>8} {'1st on time':>11}"
            f" {'gap met':>8} {'1st p50 ms':>10} {'1st p95 ms':>10} {'max gap p95':>11}"
        )
        for phase, name, c in streaming:
            lines.append(
                f"{phase['name']:<{pw}} {name:<12} {c['offered']:>8,} {c['streams_started']:>8,}"
                f" {_fmt(c['first_result_on_time_pct'], '%'):>11} {_fmt(c['gap_objective_met_pct'], '%'):>8}"
                f" {_fmt(c['first_result_p50_ms']):>10} {_fmt(c['first_result_p95_ms']):>10}"
                f" {_fmt(c['max_gap_p95_ms']):>11}"
            )
    lines.append("")
    lines.append(
        f"{'phase':<{pw}} {'tenant':<12} {'weight':>6} {'offered ms/s':>13} {'served ms/s':>12}"
        f" {'% of served':>11} {'on time':>8} {'degraded':>8}"
    )
    for phase in document["phases"]:
        for name, t in phase["tenants"].items():
            if not t["offered"]:
                continue
            lines.append(
                f"{phase['name']:<{pw}} {name:<12} {t['weight']:>6.1f} {_fmt(t['offered_ms_per_s']):>13}"
                f" {_fmt(t['served_device_ms_per_s']):>12} {_fmt(t['share_of_served_pct'], '%'):>11}"
                f" {_fmt(t['on_time_pct'], '%'):>8} {_fmt(t['degraded_pct'], '%'):>8}"
            )
    if "feature_sources" in document:
        lines += _render_features(document, pw)
    if "prefix" in document:
        lines += _render_prefix(document, pw)
    unit_rows: dict[str, list[str]] = {}
    for phase in document["phases"]:
        for backend in phase.get("units", {}).values():
            for pool, count in backend["available_units"].items():
                unit_rows.setdefault(pool, []).append(str(count))
    if unit_rows:
        lines.append("")
        lines.append(
            f"Units available at each phase's end ({', '.join(p['name'] for p in document['phases'])}):"
        )
        for pool, counts in unit_rows.items():
            lines.append(f"  {pool:<28} {' '.join(counts)}")
    timeline = document["timeline"]
    lines.append("")
    lines.append(f"Ladder step, max per {timeline['interval_s']:g} s:")
    for pool, steps in timeline["ladder_max_step"].items():
        lines.append(f"  {pool:<28} {''.join(str(s) for s in steps)}")
    expectations = document.get("expectations", [])
    if expectations:
        held = sum(e["held"] for e in expectations)
        lines.append("")
        lines.append(f"Expectations: {held} of {len(expectations)} held")
        for e in expectations:
            sign = ">=" if e["bound"] == "min" else "<="
            limit = "n/a" if e["limit"] is None else f"{e['limit']:g}"
            if "versus" in e:
                limit += f" ({e['versus']} + {e['margin']:g})"
            if "ratio" in e:
                versus = "n/a" if e["versus_value"] is None else f"{e['versus_value']:g}"
                limit += f" ({e['ratio']:g} x {versus} in {e['versus_run']})"
            elif "versus_run" in e:
                versus = "n/a" if e["versus_value"] is None else f"{e['versus_value']:g}"
                limit += f" ({versus} in {e['versus_run']} + {e['margin']:g})"
            value = "n/a" if e["value"] is None else f"{e['value']:g}"
            run = f" [{e['run']}]" if "run" in e else ""
            lines.append(
                f"  {'held  ' if e['held'] else 'FAILED'} {e['phase']:<{pw}} {e['scope']:<16} "
                f"{e['figure']}{run} {value} {sign} {limit}"
            )
    return "\n".join(lines) + "\n"


def _device_span(devices: Sequence[int]) -> str:
    """``[4, 5, 6, 7, 9]`` as ``4-7,9``."""
    runs: list[list[int]] = []
    for d in sorted(devices):
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _render_features(document: Mapping[str, Any], pw: int) -> list[str]:
    """The feature sources (settings, latency model), per phase their reads, cache hits,
    refusals by backpressure and expired device time; with ``compare:``, each run's."""
    lines = [""]
    for name, f in document["feature_sources"].items():
        lines.append(
            f"Feature source {name}: budget {f['budget_ms']:g} ms (p{f['latency_quantile'] * 100:g} of "
            f"{f['window_s']:g} s, {f['min_samples']} reads min), timeout {f['timeout_ms']:g} ms, "
            f"probe every {f['probe_interval_s']:g} s, cache TTL {f['cache_ttl_ms']:g} ms, "
            f"backpressure {'on' if f['backpressure'] else 'off'}"
        )
        model = (
            f"  reads: median {f['median_ms']:g} ms, p95 {f['p95_ms']:g} ms, failures {f['failure_rate']:.0%}"
        )
        for i in f["incidents"]:
            model += (
                f"; {i['at_s']:g}-{i['until_s']:g} s: median {i['median_ms']:g} ms, p95 {i['p95_ms']:g} ms,"
                f" failures {i['failure_rate']:.0%}"
            )
        lines.append(model)
    runs = document.get("runs") or {"": document}
    lines.append("")
    lines.append(
        f"{'phase':<{pw}} {'run':<20} {'reads':>6} {'hits':>6} {'hit %':>6} {'failed':>6}"
        f" {'bp refused':>10} {'bp %':>6} {'last bp s':>9} {'on time':>8} {'rej early':>9}"
        f" {'expired dev-ms':>14} {'expired ms/s':>12}"
    )
    for p, phase in enumerate(document["phases"]):
        for label, run in runs.items():
            t = run["phases"][p]["totals"]
            lines.append(
                f"{phase['name']:<{pw}} {label or '-':<20} {t['feature_reads']:>6,}"
                f" {t['feature_cache_hits']:>6,}"
                f" {_fmt(t['feature_cache_hit_pct']):>6} {t['feature_read_failures']:>6,}"
                f" {t['backpressure_refusals']:>10,} {_fmt(t['backpressure_refusals_pct']):>6}"
                f" {t['backpressure_last_refusal_s']:>9.2f} {_fmt(t['on_time_pct'], '%'):>8}"
                f" {_fmt(t['rejected_early_pct'], '%'):>9} {_fmt(t['expired_device_ms']):>14}"
                f" {_fmt(t['expired_device_ms_per_s']):>12}"
            )
    return lines


PREFIX_COLUMNS = (
    ("prefix_requests", "requests", "{:,}"),
    ("prefix_hit_pct", "hit %", "{:.2f}"),
    ("prefix_cached_token_pct", "cached tok %", "{:.2f}"),
    ("prefix_cached_tokens", "cached tokens", "{:,}"),
    ("prefix_saved_device_ms", "saved dev-ms", "{:,.0f}"),
    ("prefix_spills", "spills", "{:,}"),
    ("prefix_device_ms_per_answered", "dev-ms/answer", "{:.2f}"),
    ("on_time_pct", "on time %", "{:.2f}"),
    ("prefix_extra_wait_ms_max", "max extra ms", "{:.2f}"),
    ("prefix_cross_tenant_hits", "x-tenant", "{:,}"),
)


def _render_prefix(document: Mapping[str, Any], pw: int) -> list[str]:
    """Per phase and route, the prefix caches' figures (each run's with ``compare:``, and the
    first run's over the second's); each cache's lookups, hits and evictions per phase."""
    runs = document.get("runs") or {"": document}
    labels = list(runs)
    caches = ", ".join(
        f"{k} ({c['block_tokens']} tokens x {c['capacity_blocks']:,} blocks)"
        for k, c in document["prefix"]["caches"].items()
    )
    lines = ["", f"Prefix caches: {caches}"]
    width = max(12, *(len(label) for label in labels))
    head = "".join(f" {title:>{max(9, len(title))}}" for _k, title, _f in PREFIX_COLUMNS)
    lines.append(f"{'phase':<{pw}} {'route':<10} {'run':<{width}}{head}")

    def cells(block: Mapping[str, Any]) -> str:
        out = ""
        for key, title, form in PREFIX_COLUMNS:
            value = block.get(key)
            text = "n/a" if value is None else form.format(value)
            out += f" {text:>{max(9, len(title))}}"
        return out

    for p, phase in enumerate(document["phases"]):
        for route in phase["prefix"]["routes"]:
            blocks = [run["phases"][p]["prefix"]["routes"].get(route, {}) for run in runs.values()]
            for label, block in zip(labels, blocks, strict=True):
                lines.append(f"{phase['name']:<{pw}} {route:<10} {label or '-':<{width}}{cells(block)}")
            if len(blocks) == 2:
                ratio = ""
                for key, title, _form in PREFIX_COLUMNS:
                    a, b = blocks[0].get(key), blocks[1].get(key)
                    text = (
                        f"{a / b:.3f}"
                        if isinstance(a, int | float) and isinstance(b, int | float) and b
                        else "-"
                    )
                    ratio += f" {text:>{max(9, len(title))}}"
                lines.append(f"{phase['name']:<{pw}} {route:<10} {'ratio':<{width}}{ratio}")
    lines.append("")
    lines.append(
        f"{'phase':<{pw}} {'cache':<18} {'run':<{width}} {'lookups':>8} {'hits':>8}"
        f" {'hit blocks':>10} {'miss blocks':>11} {'evictions':>9}"
    )
    for p, phase in enumerate(document["phases"]):
        for label, run in runs.items():
            for cache, c in run["phases"][p]["prefix"]["backends"].items():
                lines.append(
                    f"{phase['name']:<{pw}} {cache:<18} {label or '-':<{width}}"
                    f" {c['lookups']:>8,} {c['hits']:>8,}"
                    f" {c['hit_blocks']:>10,} {c['miss_blocks']:>11,} {c['evictions']:>9,}"
                )
    shared = document["prefix"]["scopes_shared_by_tenants"]
    lines.append(
        f"Scopes sent: {document['prefix']['scopes_sent']}; shared by tenants: {', '.join(shared) or 'none'}"
    )
    return lines


_LABELS = {
    "on_time_pct": ("on time", "%"),
    "degraded_pct": ("degraded", "%"),
    "rejected_early_pct": ("rejected early", "%"),
    "rejected_late_pct": ("rejected late", "%"),
    "missed_pct": ("missed", "%"),
    "failed_pct": ("failed", "%"),
    "wasted_device_ms_per_s": ("wasted", " device-ms/s"),
    "fallback_saving_ms_per_s": ("fallback saving", " ms/s"),
}


def _groups(phase: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    groups: list[tuple[str, Mapping[str, Any]]] = [("totals", phase["totals"])]
    groups += [(f"class {n}", c) for n, c in phase["classes"].items()]
    groups += [(f"tenant {n}", t) for n, t in phase["tenants"].items()]
    return groups


def render_comparison(
    baseline: Mapping[str, Any], candidate: Mapping[str, Any], diff: Mapping[str, Any]
) -> str:
    """Both runs side by side: on time always, every other figure where the two differ."""
    b_policy, c_policy = baseline["policy"], candidate["policy"]
    lines = [
        f"Policy comparison: {baseline['scenario']} (seed {baseline['seed']}): same arrivals, two policies",
        f"  baseline:  {b_policy['label'] or '-'} {b_policy['version']}",
        f"  candidate: {c_policy['label'] or '-'} {c_policy['version']}",
        "",
        f"{'phase':<10} {'group':<16} {'on time %':>17}  other figures (baseline -> candidate)",
    ]
    for before, after in zip(baseline["phases"], candidate["phases"], strict=True):
        for (label, b), (_, a) in zip(_groups(before), _groups(after), strict=True):
            if not b["offered"]:
                continue
            on_time = f"{_fmt(b['on_time_pct'])} -> {_fmt(a['on_time_pct'])}"
            changed = []
            for metric in COMPARED[1:]:
                x, y = b.get(metric), a.get(metric)
                if x != y:
                    name, unit = _LABELS[metric]
                    changed.append(f"{name} {_fmt(x)} -> {_fmt(y)}{unit}")
            lines.append(f"{before['name']:<10} {label:<16} {on_time:>17}  {'; '.join(changed) or '='}")
        b_steps = {k: v["max_step"] for k, v in before["ladder"].items()}
        a_steps = {k: v["max_step"] for k, v in after["ladder"].items()}
        for pool in sorted(set(b_steps) | set(a_steps)):
            if b_steps.get(pool, 0) != a_steps.get(pool, 0):
                lines.append(
                    f"{before['name']:<10} {'ladder':<16} {pool}: max step "
                    f"{b_steps.get(pool, 0)} -> {a_steps.get(pool, 0)}"
                )
    lines.append("")
    if diff:
        lines.append(
            f"The candidate differs in {sum(len(g) for g in diff.values())} groups' figures "
            "(--json: `differences`)."
        )
    else:
        lines.append("No difference: the candidate policy decides this scenario exactly as the baseline.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plot


def plot(documents: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> None:
    """Per tenant on-time share, degraded share, and the ladder step, over time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    styles = ("-", "--")
    for (label, document), style in zip(documents, styles, strict=False):
        timeline = document["timeline"]
        t = timeline["start_s"]
        suffix = f" ({label})" if len(documents) > 1 else ""
        for tenant, series in timeline["tenants"].items():
            offered = series["offered"]
            on_time = [
                100.0 * o / n if n else float("nan") for o, n in zip(series["on_time"], offered, strict=True)
            ]
            degraded = [
                100.0 * d / o if o else float("nan")
                for d, o in zip(series["degraded"], series["on_time"], strict=True)
            ]
            axes[0].plot(t, on_time, style, label=f"{tenant}{suffix}")
            axes[1].plot(t, degraded, style, label=f"{tenant}{suffix}")
        for pool, steps in timeline["ladder_max_step"].items():
            axes[2].step(t, steps, style, where="post", label=f"{pool}{suffix}")
    for window in documents[0][1]["phases"]:
        for ax in axes:
            ax.axvline(window["start_s"], color="grey", linewidth=0.5)
    axes[0].set_ylabel("on time, % of offered")
    axes[0].set_ylim(-2, 102)
    axes[1].set_ylabel("degraded, % of on time")
    axes[1].set_ylim(-2, 102)
    axes[2].set_ylabel("ladder step (max)")
    axes[2].set_ylim(-0.2, 6.2)
    axes[2].set_xlabel("virtual time, s")
    for ax in axes:
        ax.legend(fontsize="small", loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(f"orchid-gateway simulate: {documents[0][1]['scenario']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario", type=Path, help="scenario YAML, e.g. examples/orchid/simulate/seed-surge.yaml"
    )
    parser.add_argument("--config", type=Path, help="gateway config (default: the scenario's `gateway:`)")
    parser.add_argument("--policies", type=Path, help="policy directory (default: the config's)")
    parser.add_argument(
        "--compare-policies",
        type=Path,
        metavar="DIR2",
        help="run the same arrivals against this policy directory too",
    )
    parser.add_argument("--json", action="store_true", help="print the report as deterministic JSON")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw on-time, degraded share and ladder step"
    )
    parser.add_argument("--seed", type=int, help="seed of the Poisson arrivals (default: the scenario's)")
    parser.add_argument(
        "--log-level", default="ERROR", help="the runtime's log level (ladder steps log at WARNING)"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when an expectation of the scenario (expect:) failed"
    )


def simulate(
    scenario_path: Path,
    *,
    config_path: Path | None = None,
    policies: Path | None = None,
    compare_policies: Path | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Load, run and report; with ``compare_policies``: baseline, candidate and differences."""
    scenario, source = load_scenario(scenario_path)
    prepared = prepare(scenario, source, config_path=config_path, policies_dir=policies)
    if compare_policies is not None and not compare_policies.is_dir():
        raise ConfigError(str(compare_policies), "", "policy directory does not exist")
    used_seed = scenario.seed if seed is None else seed
    arrivals = schedule(prepared, used_seed)
    baseline = _report_runs(prepared, arrivals, used_seed, None)
    if compare_policies is None:
        return baseline
    candidate = _report_runs(prepared, arrivals, used_seed, compare_policies)
    return {
        "baseline": baseline,
        "candidate": candidate,
        "differences": differences(baseline, candidate),
    }


def _report_runs(
    prepared: Prepared, arrivals: list[Arrival], seed: int, policies_dir: Path | None
) -> dict[str, Any]:
    """One run's report; with the scenario's ``compare:``, one run per value over the same
    arrivals: the first value's report, with every run's (timeline left out) under ``runs``."""
    scenario = prepared.scenario
    if scenario.compare is None:
        return report(prepared, run_once(prepared, arrivals, policies_dir=policies_dir, seed=seed), seed=seed)
    compare = scenario.compare
    runs: dict[str, dict[str, Any]] = {}
    for value in compare.values():
        variant = _variant(prepared, compare.feature, value)
        runs[compare.label(value)] = report(
            variant, run_once(variant, arrivals, policies_dir=policies_dir, seed=seed), seed=seed
        )
    first = runs[compare.labels()[0]]
    document = dict(first)
    document["runs"] = {
        label: {
            k: v for k, v in run.items() if k in ("phases", "feature_sources", "prefix", "expectations_held")
        }
        for label, run in runs.items()
    }
    document["expectations"] = check_expectations(scenario, first, runs)
    document["expectations_held"] = all(e["held"] for e in document["expectations"])
    for run in document["runs"].values():  # each run's own expectations are the document's
        run.pop("expectations_held", None)
    return document


def _variant(prepared: Prepared, feature: str, value: bool) -> Prepared:
    """The scenario with ``feature`` set to ``value``: the feature sources' backpressure, or
    (``prefix_affinity`` false) every route without its ``prefix_affinity``: least-wait routing."""
    if feature == "backpressure":
        config = prepared.config.model_copy(
            update={"feature_sources": with_backpressure(prepared.config.feature_sources, value)}
        )
        return dataclasses.replace(prepared, config=config)
    if value:
        return prepared
    routes = prepared.routes
    models = {name: r.model_copy(update={"prefix_affinity": None}) for name, r in routes.models.items()}
    return dataclasses.replace(prepared, routes=routes.model_copy(update={"models": models}))


def render_json(document: Mapping[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def run(args: argparse.Namespace) -> int:
    """Print the report; 2 (with ``FILE[:line:col]: key.path: problem`` on stderr) for a bad
    scenario, config, tenants, routes or policy file."""
    logging.basicConfig(level=str(args.log_level).upper(), format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        document = simulate(
            args.scenario,
            config_path=args.config,
            policies=args.policies,
            compare_policies=args.compare_policies,
            seed=args.seed,
        )
    except ConfigError as exc:
        print(f"orchid-gateway simulate: {exc}", file=sys.stderr)
        return 2
    wall_s = time.perf_counter() - started
    if args.json:
        sys.stdout.write(render_json(document))
    elif "baseline" in document:
        sys.stdout.write(render_text(document["baseline"]))
        sys.stdout.write("\n")
        sys.stdout.write(
            render_comparison(document["baseline"], document["candidate"], document["differences"])
        )
    else:
        sys.stdout.write(render_text(document))
    if args.plot is not None:
        documents = (
            [("baseline", document["baseline"]), ("candidate", document["candidate"])]
            if "baseline" in document
            else [("", document)]
        )
        plot(documents, args.plot)
    # The wall time is not part of the report (whose bytes are deterministic): it goes to stderr
    # only, as one JSON object, so `--json > file` stays comparable with `cmp`.
    print(json.dumps({"wall_s": round(wall_s, 3)}), file=sys.stderr)
    if getattr(args, "check", False):
        reports = [document["baseline"], document["candidate"]] if "baseline" in document else [document]
        if not all(r["expectations_held"] for r in reports):
            return 1
    return 0
