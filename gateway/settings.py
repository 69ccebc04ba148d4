"""The file schemas of the decision core's configuration values.

This module owns the pydantic models that validate what the configuration files declare
for the decision core (``gateway.core``) and build its plain frozen values once, when
configuration loads:

    OutputCheckSchema    -> gateway.core.outputs.OutputCheck      (routes, rollouts: outputs)
    DemandProfileSchema  -> gateway.core.profile.DemandProfile    (routes: profiles)
    LadderSchema         -> gateway.core.overload.LadderConfig    (gateway.yaml: ladder)
    QuotaSettingsSchema  -> gateway.core.quota.QuotaSettings      (tenants file: quotas)
    RolloutSchema        -> gateway.core.rollout.RolloutSpec      (rollouts/*.yaml)

Every bound, unknown-key refusal and consistency check of those files lives here, with its
message (``gateway.config`` and ``gateway.rollouts`` locate a failure at ``file:line:col``).
The core takes the values as given and never imports pydantic.

A configuration model holds a core value through the ``*Value`` field types (e.g.
``RouteTable.profiles: dict[str, DemandProfileValue]``): input is validated by the schema
(same errors, same locations) and stored as the core value; a core value passes as is.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    model_validator,
)
from pydantic_core import core_schema

from gateway.core.outputs import OutputCheck, ShapeSymbol
from gateway.core.overload import DEFAULT_LADDER, LadderConfig, LadderStep
from gateway.core.profile import DemandProfile
from gateway.core.quota import DEFAULT_BORROW_FRACTION, ClassShareConfig, QuotaConfig, QuotaSettings
from gateway.core.record import LONG_BUCKET, SHORT_BUCKET
from gateway.core.rollout import (
    Analysis,
    Bucket,
    Cohort,
    Drain,
    Guardrail,
    Hedge,
    MemoryCheck,
    Metric,
    RolloutSpec,
    Step,
    VersionRef,
    Warmup,
    WarmupShape,
)

_T_co = TypeVar("_T_co", covariant=True)
_T = TypeVar("_T")


class _Builds(Protocol[_T_co]):
    def value(self) -> _T_co: ...


def core_value(schema: type[_Builds[_T]], core: type[_T]) -> GetPydanticSchema:
    """Field metadata: validate with ``schema`` (its errors and locations unchanged), hold the
    core value it builds; a ``core`` instance passes as is. Dumps as the value's fields."""

    def build(_source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def convert(value: Any, validate: Callable[[Any], Any]) -> Any:
            if isinstance(value, core):
                return value
            validated: _Builds[_T] = validate(value)
            return validated.value()

        return core_schema.no_info_wrap_validator_function(
            convert,
            handler.generate_schema(schema),
            serialization=core_schema.plain_serializer_function_ser_schema(_fields),
        )

    return GetPydanticSchema(build)


def _fields(value: Any) -> Any:
    return dataclasses.asdict(value)


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- outputs


class OutputCheckSchema(_Strict):
    """What a valid output looks like: datatype, shape (ints, or ``items``/``output_tokens``/
    ``input_tokens`` of the request) and optionally the range of its values."""

    datatype: str = Field(min_length=1)
    shape: tuple[int | ShapeSymbol, ...]
    min_value: float | None = None
    max_value: float | None = None

    @model_validator(mode="after")
    def _range(self) -> OutputCheckSchema:
        if self.min_value is not None and self.max_value is not None and self.min_value > self.max_value:
            raise ValueError("min_value must not exceed max_value")
        return self

    def value(self) -> OutputCheck:
        return OutputCheck(
            datatype=self.datatype, shape=self.shape, min_value=self.min_value, max_value=self.max_value
        )


OutputCheckValue = Annotated[OutputCheck, core_value(OutputCheckSchema, OutputCheck)]


# --------------------------------------------------------------------------- demand profiles


class DemandProfileSchema(_Strict):
    """Per model version cost and memory profile (validated data)."""

    fixed_ms: float = Field(ge=0, description="launch and fixed host work per batch")
    prefill_ms_per_token: float = Field(ge=0, description="main/prefill work per (padded) input token")
    decode_ms_per_token: float = Field(ge=0, description="one decode step for the batch")
    weights_bytes: int = Field(default=0, ge=0, description="resident weights")
    workspace_reserve_bytes: int = Field(default=0, ge=0, description="runtime/workspace reserve per replica")
    live_cache_bytes_per_token: int = Field(default=0, ge=0, description="sequence state per live token")
    host_cpu_ms: float = Field(default=0.0, ge=0, description="gateway/host CPU per request")

    def value(self) -> DemandProfile:
        return DemandProfile(
            fixed_ms=self.fixed_ms,
            prefill_ms_per_token=self.prefill_ms_per_token,
            decode_ms_per_token=self.decode_ms_per_token,
            weights_bytes=self.weights_bytes,
            workspace_reserve_bytes=self.workspace_reserve_bytes,
            live_cache_bytes_per_token=self.live_cache_bytes_per_token,
            host_cpu_ms=self.host_cpu_ms,
        )


DemandProfileValue = Annotated[DemandProfile, core_value(DemandProfileSchema, DemandProfile)]


# --------------------------------------------------------------------------- the overload ladder

_L = DEFAULT_LADDER  # the defaults are the core's (gateway.core.overload explains each)


class LadderSchema(BaseModel):
    """Thresholds (fractions of protected capacity) and the timing of the ladder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shed_optional_at: float = Field(default=_L.shed_optional_at, gt=0)
    reduce_output_at: float = Field(default=_L.reduce_output_at, gt=0)
    fallback_at: float = Field(default=_L.fallback_at, gt=0)
    defer_batch_at: float = Field(default=_L.defer_batch_at, gt=0)
    reject_interactive_at: float = Field(default=_L.reject_interactive_at, gt=0)
    protect_admitted_at: float = Field(default=_L.protect_admitted_at, gt=0)
    plan_utilization: float = Field(default=_L.plan_utilization, gt=0, le=1)
    confidence_z: float = Field(default=_L.confidence_z, ge=0)
    hysteresis: float = Field(default=_L.hysteresis, ge=0)
    hold_s: float = Field(default=_L.hold_s, ge=0)
    dwell_min_samples: int = Field(default=_L.dwell_min_samples, ge=1)
    stale_after_s: float = Field(default=_L.stale_after_s, gt=0)
    stale_step: LadderStep = _L.stale_step
    dwell_step: LadderStep = _L.dwell_step
    retry_after_min_ms: int = Field(default=_L.retry_after_min_ms, ge=0)
    retry_after_max_ms: int = Field(default=_L.retry_after_max_ms, ge=1)
    retry_after_no_capacity_ms: int = Field(default=_L.retry_after_no_capacity_ms, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        enters = self.value().thresholds
        for lower, upper in itertools.pairwise(enters):
            if not lower < upper:
                raise ValueError(f"step thresholds must increase strictly (got {list(enters[1:])})")
        if not self.hysteresis < self.shed_optional_at:
            raise ValueError(
                f"hysteresis ({self.hysteresis}) must be below the step 1 threshold "
                f"({self.shed_optional_at}), or step 0 could never be reached again"
            )
        if self.retry_after_min_ms > self.retry_after_max_ms:
            raise ValueError(
                f"retry_after_min_ms ({self.retry_after_min_ms}) exceeds "
                f"retry_after_max_ms ({self.retry_after_max_ms})"
            )
        return self

    def value(self) -> LadderConfig:
        return LadderConfig(**{name: getattr(self, name) for name in type(self).model_fields})


LadderValue = Annotated[LadderConfig, core_value(LadderSchema, LadderConfig)]


# --------------------------------------------------------------------------- quotas


class _StrictFinite(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class QuotaConfigSchema(_StrictFinite):
    """One tenant's quota in one request class (or the class's shared ``default`` pool)."""

    accelerator_ms_per_s: float | None = Field(
        default=None, gt=0, description="own refill rate; unset: `weight` of the class share"
    )
    weight: float = Field(default=1.0, gt=0, description="share of the class rate when no rate is set")
    burst_ms: float | None = Field(default=None, gt=0, description="bucket capacity; unset: 2 s of refill")
    live_token_ms_per_s: float | None = Field(
        default=None, gt=0, description="live-token-ms refill; unset: none"
    )
    live_token_burst_ms: float | None = Field(default=None, gt=0, description="unset: 2 s of refill")
    max_concurrent: int | None = Field(default=None, ge=1, description="open requests: in flight + queued")
    max_queued_ms: float | None = Field(default=None, gt=0, description="predicted accelerator-ms waiting")
    max_input_tokens: int | None = Field(default=None, ge=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    borrow_fraction: float = Field(
        default=DEFAULT_BORROW_FRACTION, ge=0, le=1, description="borrowable share of burst_ms"
    )

    @model_validator(mode="after")
    def _live_burst_needs_rate(self) -> QuotaConfigSchema:
        if self.live_token_burst_ms is not None and self.live_token_ms_per_s is None:
            raise ValueError("live_token_burst_ms needs live_token_ms_per_s")
        return self

    def value(self) -> QuotaConfig:
        return QuotaConfig(**{name: getattr(self, name) for name in type(self).model_fields})


class ClassShareSchema(_StrictFinite):
    """A request class's whole share: the parent bucket of its tenants."""

    accelerator_ms_per_s: float = Field(gt=0)
    burst_ms: float | None = Field(default=None, gt=0, description="unset: 2 s of refill")
    default: QuotaConfigSchema | None = Field(default=None, description="shared pool of unconfigured tenants")

    def value(self) -> ClassShareConfig:
        return ClassShareConfig(
            accelerator_ms_per_s=self.accelerator_ms_per_s,
            burst_ms=self.burst_ms,
            default=None if self.default is None else self.default.value(),
        )


class QuotaSettingsSchema(_StrictFinite):
    """All quota configuration: class shares and tenant -> request class -> quota."""

    classes: dict[str, ClassShareSchema] = Field(default_factory=dict)
    tenants: dict[str, dict[str, QuotaConfigSchema]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _rates_resolve(self) -> QuotaSettingsSchema:
        self.value().check()  # ValueError: the reserved pool name, or an underivable weighted rate
        return self

    def value(self) -> QuotaSettings:
        return QuotaSettings(
            classes={name: share.value() for name, share in self.classes.items()},
            tenants={
                tenant: {request_class: c.value() for request_class, c in per_class.items()}
                for tenant, per_class in self.tenants.items()
            },
        )


QuotaSettingsValue = Annotated[QuotaSettings, core_value(QuotaSettingsSchema, QuotaSettings)]


# --------------------------------------------------------------------------- rollouts


class VersionRefSchema(_Strict):
    """One version of the route's model: the backend model, the version Triton reports for it
    (its manifest identity: the repository index must list this version READY), and the
    label provenance stamps (``orchid.model_version``)."""

    backend_model: str = Field(min_length=1)
    version: str = Field(min_length=1, pattern=r"^[0-9]+$", description="Triton's model version")
    label: str = Field(default="", description="provenance version label; empty: the version")
    profile: str = Field(default="", description="demand profile (routes); empty: the route's")

    def value(self) -> VersionRef:
        return VersionRef(
            backend_model=self.backend_model, version=self.version, label=self.label, profile=self.profile
        )


class WarmupShapeSchema(_Strict):
    """One shape a candidate must serve, outputs valid, before it takes any traffic."""

    bucket: Bucket
    input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    items: int = Field(default=1, ge=1)
    repeat: int = Field(default=1, ge=1, description="how many times it is sent")

    def value(self) -> WarmupShape:
        return WarmupShape(
            bucket=self.bucket,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            items=self.items,
            repeat=self.repeat,
        )


class WarmupSchema(_Strict):
    shapes: tuple[WarmupShapeSchema, ...] = Field(min_length=1)
    # Checked with the route's own ``outputs`` contract (these add to it, or override an
    # output it names): a rollout of a route that declares none must declare some.
    outputs: dict[str, OutputCheckSchema] = Field(
        default_factory=dict, description="output name -> its checks"
    )
    timeout_s: float = Field(default=30.0, gt=0, description="bound of each warm-up request")

    @model_validator(mode="after")
    def _both_buckets(self) -> WarmupSchema:
        buckets = {s.bucket for s in self.shapes}
        if buckets != {SHORT_BUCKET, LONG_BUCKET}:
            missing = ", ".join(sorted({SHORT_BUCKET, LONG_BUCKET} - buckets))
            raise ValueError(f"warm-up must cover the route's short and long buckets (missing {missing})")
        return self

    def value(self) -> Warmup:
        return Warmup(
            shapes=tuple(s.value() for s in self.shapes),
            outputs={name: check.value() for name, check in self.outputs.items()},
            timeout_s=self.timeout_s,
        )


class CohortSchema(_Strict):
    """Requests a step may divert: every listed field must match (an empty list: any)."""

    classes: tuple[str, ...] = ()
    buckets: tuple[Bucket, ...] = ()
    tenants: tuple[str, ...] = ()
    risk_classes: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _not_everything(self) -> CohortSchema:
        if not (self.classes or self.buckets or self.tenants or self.risk_classes):
            raise ValueError("a cohort names at least one of classes, buckets, tenants, risk_classes")
        return self

    def value(self) -> Cohort:
        return Cohort(
            classes=self.classes, buckets=self.buckets, tenants=self.tenants, risk_classes=self.risk_classes
        )


class StepSchema(_Strict):
    """``shadow``: mirror ``weight`` of the matching requests to the candidate (answers
    discarded); ``canary``: serve ``weight`` of them from it; ``promote``: the candidate
    serves the route. A step holds for ``intervals`` passing analysis intervals."""

    kind: Literal["shadow", "canary", "promote"]
    cohorts: tuple[CohortSchema, ...] = ()
    weight: float = Field(default=1.0, gt=0, le=1)
    intervals: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _cohorts(self) -> StepSchema:
        if self.kind == "promote" and self.cohorts:
            raise ValueError("a promote step has no cohorts (it serves the whole route)")
        if self.kind != "promote" and not self.cohorts:
            raise ValueError(f"a {self.kind} step needs cohorts")
        return self

    def value(self) -> Step:
        return Step(
            kind=self.kind,
            cohorts=tuple(c.value() for c in self.cohorts),
            weight=self.weight,
            intervals=self.intervals,
        )


class AnalysisSchema(_Strict):
    interval_s: float = Field(gt=0, description="length of one analysis interval")
    min_samples: int = Field(default=5, ge=1, description="per version; fewer: inconclusive")

    def value(self) -> Analysis:
        return Analysis(interval_s=self.interval_s, min_samples=self.min_samples)


class GuardrailSchema(_Strict):
    """Roll back when ``metric`` exceeds ``max`` in ``failures`` consecutive conclusive intervals."""

    metric: Metric
    max: float = Field(ge=0)
    failures: int = Field(default=1, ge=1)

    def value(self) -> Guardrail:
        return Guardrail(metric=self.metric, max=self.max, failures=self.failures)


class DrainSchema(_Strict):
    max_wait_s: float = Field(
        default=60.0, gt=0, description="the retired version is left loaded if still busy after this"
    )

    def value(self) -> Drain:
        return Drain(max_wait_s=self.max_wait_s)


class MemoryCheckSchema(_Strict):
    """Both versions resident on each device must leave room for ``min_live_tokens`` of the
    current version's live state; otherwise the rollout is refused before anything loads."""

    min_live_tokens: int = Field(default=0, ge=0)

    def value(self) -> MemoryCheck:
        return MemoryCheck(min_live_tokens=self.min_live_tokens)


class HedgeSchema(_Strict):
    """A canary's budget leaves the current version time to answer (``hedge_budget_ms``):
    the candidate gets the time by which the current version, re-admitted, would still meet
    the caller's deadline with its own reserves, less ``reserve_ms``."""

    reserve_ms: float = Field(default=25.0, ge=0, description="margin left beside the current version")

    def value(self) -> Hedge:
        return Hedge(reserve_ms=self.reserve_ms)


class RolloutSchema(_Strict):
    """A rollout file (``rollouts/*.yaml``); ``value()`` is the core's ``RolloutSpec``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    route: str = Field(description="the logical model whose version changes")
    current: VersionRefSchema
    candidate: VersionRefSchema
    warmup: WarmupSchema
    steps: tuple[StepSchema, ...] = Field(min_length=1)
    analysis: AnalysisSchema
    guardrails: tuple[GuardrailSchema, ...] = Field(min_length=1)
    drain: DrainSchema = DrainSchema()
    memory: MemoryCheckSchema = MemoryCheckSchema()
    hedge: HedgeSchema = HedgeSchema()

    @model_validator(mode="after")
    def _consistent(self) -> RolloutSchema:
        if self.current.backend_model == self.candidate.backend_model:
            raise ValueError("candidate.backend_model must differ from current.backend_model")
        if self.current.value().name == self.candidate.value().name:
            raise ValueError("candidate's label must differ from the current version's")
        for index, step in enumerate(self.steps):
            if step.kind == "promote" and index != len(self.steps) - 1:
                raise ValueError("promote must be the last step")
        if self.steps[0].kind == "promote":
            raise ValueError("a rollout needs a shadow or canary step before promote")
        return self

    def value(self) -> RolloutSpec:
        return RolloutSpec(
            name=self.name,
            route=self.route,
            current=self.current.value(),
            candidate=self.candidate.value(),
            warmup=self.warmup.value(),
            steps=tuple(s.value() for s in self.steps),
            analysis=self.analysis.value(),
            guardrails=tuple(g.value() for g in self.guardrails),
            drain=self.drain.value(),
            memory=self.memory.value(),
            hedge=self.hedge.value(),
        )


def rollout_spec(data: Any) -> RolloutSpec:
    """A rollout file's (or a saved run's) data, validated: ``pydantic.ValidationError`` with
    the offending key's location, as the schema says."""
    return RolloutSchema.model_validate(data).value()


def rollout_data(spec: RolloutSpec) -> dict[str, Any]:
    """A rollout as plain JSON-ready data, which ``rollout_spec`` reads back (saved runs)."""
    data: dict[str, Any] = dataclasses.asdict(spec)
    return data
