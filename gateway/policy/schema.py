"""The policy input schema: everything a CEL rule can read, declared once.

This module owns the names, CEL types, origins and meanings of the variables
policy authors write (``request.privacy_cell``, ``budget.slack_ms``,
``tenant.available_accelerator_ms`` ...), the ``PolicyContext`` that carries
the non-record inputs (tenant, route, load, backends), and the functions that
turn a ``RequestRecord`` plus a ``PolicyContext`` into CEL input. The same
declarations type-check expressions at load (both engines), build the
activation at evaluation, validate test-case inputs, and render the author
docs table (``render_schema_markdown``). Nothing else declares a variable.

Names are dotted CEL identifiers (``request.class``). They are declared to the
engine as qualified variables, not as message fields, so an unknown field is an
"undeclared reference" at load, never a silent ``null`` at runtime.

Typing is strict, like CEL itself: ``int`` fields are Python ``int`` and
``double`` fields Python ``float`` - always, whatever the record holds. CEL
has no implicit int/double conversion: ``budget.slack_ms < 0`` does not type
check (write ``0.0``), ``shape.input_tokens > 2048.0`` neither (write
``2048``); convert explicitly with ``double(x)`` / ``int(x)``.

Backend fields (``backend.*``) exist only for routing-stage rules, which are
evaluated once per candidate backend. Nothing here performs I/O.

A request-scoped field's value is declared as a Python expression over the
record ``r`` and the context ``c`` (``Field.source``, ``"float(r.budget.slack_ms)"``):
compiled alone it is the field's ``read``; ``reader``, ``dict_reader`` and
``key_reader`` inline several into one function, which the policy snapshot
calls once per plan and request instead of once per field. Either way the
values are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, cast

import msgspec

from gateway.core.entitlement import may_call
from gateway.core.record import RequestRecord


class Origin(StrEnum):
    """Who controls a value: the trust level authors must keep in mind."""

    CALLER = "caller"  # request parameters or tensors: attacker-controlled
    CREDENTIAL = "credential"  # derived from the authenticated credential
    GATEWAY = "gateway"  # classification, estimates, live load: computed by the gateway
    CONFIG = "config"  # tenant / route / backend configuration shipped as data


# CEL types in the notation the checker prints (``list(string)``).
BOOL = "bool"
INT = "int"
DOUBLE = "double"
STRING = "string"
LIST_STRING = "list(string)"
MAP_STRING_STRING = "map(string, string)"
DYN = "dyn"


# ---------------------------------------------------------------------------
# Non-record inputs
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QualityEvidence:
    """Validated quality of the route's models on a named evaluation population.

    The seed's fixture: full 0.92, compact 0.86, floor 0.84. Without evidence
    (the defaults) a fallback cannot clear a floor of 1.0.
    """

    score: float = 0.0
    fallback_score: float = 0.0
    floor: float = 1.0
    population: str = ""
    reduced_output_score: float = 0.0  # quality of the primary with output capped (0: no evidence)
    # The verdict on the evidence each degradation rests on (``gateway.core.evidence``):
    # valid, missing, expired or below_floor. Only "valid" may degrade.
    fallback_evidence: str = "missing"
    reduced_output_evidence: str = "missing"


class TenantFacts(msgspec.Struct, frozen=True, gc=False):
    """The tenant's entitlements and quota state, as of this decision."""

    name: str
    allowed_cells: tuple[str, ...] = ()
    allowed_classes: tuple[str, ...] = ()
    # The configured ``models``: the whole entitlement, empty = none (``gateway.core.entitlement``).
    allowed_models: tuple[str, ...] = ()
    dedicated: bool = False  # never shares a batch or instance with other tenants
    weight: float = 1.0  # fair-share weight
    allow_fallback: bool = True  # tenant-level opt-out of approximate answers
    accelerator_ms_per_s: float = 0.0  # quota refill rate
    # What the quota ledger would grant now: its balance plus what it may borrow from the class's
    # idle share (negative while in debt); inf: no quota configured.
    available_accelerator_ms: float = math.inf
    max_output_tokens: int = 0  # 0: no tenant cap


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """The route the request resolved to, with its fallback and quality evidence."""

    model: str
    fallback_model: str = ""  # "" : no fallback declared
    fallback_classes: tuple[str, ...] = ()  # request classes that may be served by the fallback
    fallback_warm: bool = False  # warm, validated capacity proven (never cold-load during overload)
    fallback_cell: str = ""
    quality: QualityEvidence = QualityEvidence()
    reduced_output_tokens: int = 0  # output cap the route has quality evidence for (0: none)


class LoadFacts(msgspec.Struct, frozen=True, gc=False):
    """Live load evidence (the ladder step itself is on the record)."""

    utilization: float = 0.0  # offered demand / protected capacity
    drain_ms: float = 0.0  # predicted time until queued work drains; basis for retry-after
    shed: bool = False  # the pool's shedder picked this request as part of the excess
    reduce_output: bool = False  # part of the share whose output the ladder caps (step 2+)


@dataclass(frozen=True, slots=True)
class BackendFacts:
    """One candidate backend for routing-stage rules."""

    name: str
    model: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


class PolicyContext(msgspec.Struct, frozen=True):
    """Everything policy reads that is not on the ``RequestRecord``."""

    tenant: TenantFacts
    route: RouteFacts
    load: LoadFacts = LoadFacts()
    backends: tuple[BackendFacts, ...] = ()


# ---------------------------------------------------------------------------
# The declarations
# ---------------------------------------------------------------------------

RequestReader = Callable[[RequestRecord, PolicyContext], Any]
BackendReader = Callable[[BackendFacts], Any]


@dataclass(frozen=True, slots=True)
class Field:
    """One CEL variable: its dotted name, CEL type, origin and meaning."""

    path: str
    cel_type: str
    origin: Origin
    doc: str
    read: RequestReader | None = None  # request-scoped fields
    read_backend: BackendReader | None = None  # backend-scoped fields (routing stage only)
    # A request-scoped field's value as a Python expression over ``r`` (the record) and ``c``
    # (the context): ``read`` is that expression, and ``reader`` inlines several into one.
    source: str = ""

    @property
    def namespace(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def per_backend(self) -> bool:
        return self.read_backend is not None


# What a field's ``source`` may call besides the builtins. A ``list(string)`` field's source is
# ``list(...)`` of the configured tuple: CEL wants a list.
_SOURCE_GLOBALS: dict[str, Any] = {"may_call": may_call}


def _function(body: str) -> Any:
    """``lambda r, c: <body>``, compiled; ``body`` is this module's own text (``Field.source``)."""
    return eval(f"lambda r, c: {body}", dict(_SOURCE_GLOBALS))


def _req(path: str, cel_type: str, origin: Origin, doc: str, source: str) -> Field:
    read: RequestReader = _function(source)
    return Field(path, cel_type, origin, doc, read=read, source=source)


_C, _K, _G, _F = Origin.CALLER, Origin.CREDENTIAL, Origin.GATEWAY, Origin.CONFIG

FIELDS: tuple[Field, ...] = (
    # request: identity and class
    _req("request.request_id", STRING, _G, "gateway-assigned request id", "r.identity.request_id"),
    _req("request.tenant", STRING, _K, "tenant from the credential", "r.identity.tenant"),
    _req(
        "request.class",
        STRING,
        _C,
        "request class (hint `orchid.class`)",
        "r.identity.request_class",
    ),
    _req("request.model", STRING, _C, "logical model the caller named", "r.identity.model"),
    _req(
        "request.model_version",
        STRING,
        _C,
        'requested version, "" for the route default',
        "r.identity.model_version",
    ),
    _req(
        "request.operation",
        STRING,
        _C,
        "`ModelInfer` or `ModelStreamInfer`",
        "r.identity.operation",
    ),
    _req(
        "request.mode",
        STRING,
        _C,
        "`online`, `streaming`, `async` or `batch`",
        "str(r.identity.mode)",
    ),
    _req(
        "request.privacy_cell",
        STRING,
        _G,
        "privacy cell the request must stay in",
        "r.identity.privacy_cell",
    ),
    _req(
        "request.risk_class",
        STRING,
        _G,
        "a configured `risk_classes` entry: the tenant's or route's minimum, or higher (`orchid.risk_class`)",
        "r.identity.risk_class",
    ),
    _req(
        "request.allow_fallback",
        BOOL,
        _C,
        "caller accepts an approximate answer (hint `orchid.allow_fallback`)",
        "bool(r.identity.allow_fallback)",
    ),
    # shape
    _req("shape.items", INT, _C, "items / samples in the request", "int(r.shape.items)"),
    _req("shape.input_tokens", INT, _C, "input tokens", "int(r.shape.input_tokens)"),
    _req(
        "shape.max_output_tokens",
        INT,
        _C,
        "requested output limit",
        "int(r.shape.max_output_tokens)",
    ),
    _req("shape.modality", STRING, _C, "`text`, `image` ...", "r.shape.modality"),
    _req("shape.streaming", BOOL, _C, "streaming response", "bool(r.shape.streaming)"),
    _req("shape.bucket", STRING, _G, "shape bucket (batching compatibility)", "r.shape.bucket"),
    _req("shape.input_bytes", INT, _C, "input tensor bytes", "int(r.shape.input_bytes)"),
    # demand
    _req(
        "demand.prefill_ms",
        DOUBLE,
        _G,
        "predicted prefill accelerator-ms",
        "float(r.demand.prefill_ms)",
    ),
    _req(
        "demand.decode_ms",
        DOUBLE,
        _G,
        "predicted decode accelerator-ms",
        "float(r.demand.decode_ms)",
    ),
    _req(
        "demand.accelerator_ms",
        DOUBLE,
        _G,
        "prefill_ms + decode_ms",
        "float(r.demand.prefill_ms + r.demand.decode_ms)",
    ),
    _req("demand.host_cpu_ms", DOUBLE, _G, "predicted host CPU ms", "float(r.demand.host_cpu_ms)"),
    _req(
        "demand.peak_memory_bytes",
        INT,
        _G,
        "predicted peak request state",
        "int(r.demand.peak_memory_bytes)",
    ),
    _req(
        "demand.live_token_ms",
        DOUBLE,
        _G,
        "predicted live-token-ms (sequence memory lifetime)",
        "float(r.demand.live_token_ms)",
    ),
    # budget
    _req("budget.deadline_ms", DOUBLE, _C, "D: end-to-end deadline", "float(r.budget.deadline_ms)"),
    _req("budget.elapsed_ms", DOUBLE, _G, "E: already spent", "float(r.budget.elapsed_ms)"),
    _req(
        "budget.reserve_upstream_ms",
        DOUBLE,
        _G,
        "R_up: unfinished upstream work",
        "float(r.budget.reserve_upstream_ms)",
    ),
    _req(
        "budget.reserve_exec_ms",
        DOUBLE,
        _G,
        "R_exec: predicted execution and response",
        "float(r.budget.reserve_exec_ms)",
    ),
    _req(
        "budget.reserve_fail_ms",
        DOUBLE,
        _G,
        "R_fail: variance or one bounded recovery",
        "float(r.budget.reserve_fail_ms)",
    ),
    _req(
        "budget.queue_wait_ms",
        DOUBLE,
        _G,
        "predicted wait behind queued work",
        "float(r.budget.queue_wait_ms)",
    ),
    _req(
        "budget.slack_ms",
        DOUBLE,
        _G,
        "S = D - E - R_up - R_exec - R_fail - queue_wait",
        "float(r.budget.slack_ms)",
    ),
    _req("budget.remaining_ms", DOUBLE, _G, "D - E", "float(r.budget.remaining_ms)"),
    # tenant
    _req("tenant.name", STRING, _F, "tenant name", "c.tenant.name"),
    _req(
        "tenant.allowed_cells",
        LIST_STRING,
        _F,
        "privacy cells the tenant may use",
        "list(c.tenant.allowed_cells)",
    ),
    _req(
        "tenant.allowed_classes",
        LIST_STRING,
        _F,
        "request classes enabled for the tenant",
        "list(c.tenant.allowed_classes)",
    ),
    _req(
        "tenant.allowed_models",
        LIST_STRING,
        _F,
        "the tenant's configured `models`: exactly the models it may call (empty: none)",
        "list(c.tenant.allowed_models)",
    ),
    _req(
        "tenant.entitled",
        BOOL,
        _G,
        "the tenant may call request.model: the gateway's own answer (`gateway.core.entitlement`)",
        "may_call(c.tenant.allowed_models, r.identity.model)",
    ),
    _req(
        "tenant.dedicated",
        BOOL,
        _F,
        "never shares a batch or instance with other tenants",
        "bool(c.tenant.dedicated)",
    ),
    _req("tenant.weight", DOUBLE, _F, "fair-share weight", "float(c.tenant.weight)"),
    _req(
        "tenant.allow_fallback",
        BOOL,
        _F,
        "tenant accepts approximate answers",
        "bool(c.tenant.allow_fallback)",
    ),
    _req(
        "tenant.accelerator_ms_per_s",
        DOUBLE,
        _F,
        "quota refill rate",
        "float(c.tenant.accelerator_ms_per_s)",
    ),
    _req(
        "tenant.available_accelerator_ms",
        DOUBLE,
        _G,
        "accelerator-ms the quota ledger would grant now: balance plus borrowable idle share (inf: no quota)",
        "float(c.tenant.available_accelerator_ms)",
    ),
    _req(
        "tenant.max_output_tokens",
        INT,
        _F,
        "tenant output cap, 0 for none",
        "int(c.tenant.max_output_tokens)",
    ),
    # route
    _req("route.model", STRING, _F, "primary model of the route", "c.route.model"),
    _req(
        "route.fallback_model",
        STRING,
        _F,
        'declared fallback, "" for none',
        "c.route.fallback_model",
    ),
    _req(
        "route.fallback_classes",
        LIST_STRING,
        _F,
        "request classes the fallback may serve",
        "list(c.route.fallback_classes)",
    ),
    _req(
        "route.fallback_warm",
        BOOL,
        _G,
        "fallback has warm validated capacity",
        "bool(c.route.fallback_warm)",
    ),
    _req("route.fallback_cell", STRING, _F, "privacy cell of the fallback", "c.route.fallback_cell"),
    _req(
        "route.quality.score",
        DOUBLE,
        _F,
        "validated quality of the primary model",
        "float(c.route.quality.score)",
    ),
    _req(
        "route.quality.fallback_score",
        DOUBLE,
        _F,
        "the fallback's latest evidence score (0.0 when missing or expired)",
        "float(c.route.quality.fallback_score)",
    ),
    _req(
        "route.quality.reduced_output_score",
        DOUBLE,
        _F,
        "latest evidence score of the primary with its output capped at route.reduced_output_tokens "
        "(0.0 when missing or expired)",
        "float(c.route.quality.reduced_output_score)",
    ),
    _req(
        "route.reduced_output_tokens",
        INT,
        _F,
        "output cap the route declares quality evidence for (0: none); used from ladder step 2",
        "int(c.route.reduced_output_tokens)",
    ),
    _req(
        "route.quality.floor",
        DOUBLE,
        _F,
        "minimum acceptable quality: the route's `quality_floor`, else its fallback's, else 1.0",
        "float(c.route.quality.floor)",
    ),
    _req(
        "route.quality.fallback_evidence",
        STRING,
        _F,
        "verdict on the fallback's latest evidence: valid, missing, expired (past review-by or "
        "max age) or below_floor; only valid evidence may serve a fallback answer",
        "c.route.quality.fallback_evidence",
    ),
    _req(
        "route.quality.reduced_output_evidence",
        STRING,
        _F,
        "verdict on the latest evidence for the capped output: valid, missing, expired or "
        "below_floor; only valid evidence may cap the output",
        "c.route.quality.reduced_output_evidence",
    ),
    _req(
        "route.quality.population",
        STRING,
        _F,
        "evaluation population the scores hold for",
        "c.route.quality.population",
    ),
    # load
    _req("load.ladder_step", INT, _G, "overload ladder step 0-6", "int(r.ladder_step)"),
    _req(
        "load.utilization",
        DOUBLE,
        _G,
        "offered demand / protected capacity",
        "float(c.load.utilization)",
    ),
    _req(
        "load.drain_ms",
        DOUBLE,
        _G,
        "predicted time for queued work to drain",
        "float(c.load.drain_ms)",
    ),
    _req(
        "load.shed",
        BOOL,
        _G,
        "the pool's shedder picked this request as part of the excess over protected capacity",
        "bool(c.load.shed)",
    ),
    _req(
        "load.reduce_output",
        BOOL,
        _G,
        "at ladder step 2+, the pool picked this request as part of the share whose output is "
        "capped (just enough to bring demand back inside the envelope)",
        "bool(c.load.reduce_output)",
    ),
    # backend (routing stage only)
    Field("backend.name", STRING, _F, "backend name (routing stage only)", read_backend=lambda b: b.name),
    Field(
        "backend.model",
        STRING,
        _F,
        "model the backend serves (routing stage only)",
        read_backend=lambda b: b.model,
    ),
    Field(
        "backend.labels",
        MAP_STRING_STRING,
        _F,
        "backend labels such as `cell` (routing stage only)",
        read_backend=lambda b: {str(k): str(v) for k, v in b.labels.items()},
    ),
)

FIELDS_BY_PATH: Mapping[str, Field] = {f.path: f for f in FIELDS}

# What changes from one request to the next for the same tenant, route, class and configuration:
# the request's id, shape, demand and budget, the pool's load, the tenant's live balance. A
# condition that reads none of these (nor a variable that does) decides alike for every such
# request, so evaluation memoises it on the values it reads (``snapshot.Plan.cached``); the
# memo is exact whatever this set says, which only decides what is worth memoising.
VOLATILE_NAMESPACES: frozenset[str] = frozenset({"shape", "demand", "budget", "load"})
VOLATILE_FIELDS: frozenset[str] = frozenset({"request.request_id", "tenant.available_accelerator_ms"})


def volatile(path: str) -> bool:
    """Whether ``path`` usually differs between two requests of one tenant, route and class."""
    return path in VOLATILE_FIELDS or path.split(".", 1)[0] in VOLATILE_NAMESPACES


# Top-level names authors may start a reference with. ``variables`` holds the
# named expressions declared in policy files.
NAMESPACES: tuple[str, ...] = ("request", "shape", "demand", "budget", "tenant", "route", "load", "backend")
VARIABLES_NAMESPACE = "variables"

NAMESPACE_DOCS: Mapping[str, str] = {
    "request": "who asks for what (from the credential, the request and its classification)",
    "shape": "the request's shape, extracted from tensors and parameters",
    "demand": "predicted demand of one execution on the route's model",
    "budget": "the deadline and the reserves that spend it (ms)",
    "tenant": "the tenant's entitlements and quota state",
    "route": "the resolved route, its fallback and quality evidence",
    "load": "overload ladder and load evidence",
    "backend": "one candidate backend; routing-stage rules are evaluated once per backend",
}


# ---------------------------------------------------------------------------
# Activation
# ---------------------------------------------------------------------------


def flat_inputs(
    record: RequestRecord,
    context: PolicyContext,
    backend: BackendFacts | None = None,
) -> dict[str, Any]:
    """Every declared field as ``{dotted name: value}`` (backend fields only with ``backend``)."""
    inputs: dict[str, Any] = {}
    for f in FIELDS:
        if f.read is not None:
            inputs[f.path] = f.read(record, context)
        elif backend is not None and f.read_backend is not None:
            inputs[f.path] = f.read_backend(backend)
    return inputs


def reader(paths: Sequence[str]) -> Callable[[RequestRecord, PolicyContext], list[Any]]:
    """One function reading the request-scoped fields ``paths`` as a list, in that order.

    It is the fields' own ``source`` expressions inlined into one ``lambda r, c: [...]``, so
    each value is exactly what that field's ``read`` answers, for one call instead of one per
    field (the policy snapshot reads a plan's inputs for every request this way)."""
    body = ", ".join(_sources(paths))
    return cast(Callable[[RequestRecord, PolicyContext], list[Any]], _function(f"[{body}]"))


def dict_reader(paths: Sequence[str]) -> Callable[[RequestRecord, PolicyContext], dict[str, Any]]:
    """``reader`` answering ``{path: value}``."""
    body = ", ".join(f"{path!r}: {source}" for path, source in zip(paths, _sources(paths), strict=True))
    return cast(Callable[[RequestRecord, PolicyContext], dict[str, Any]], _function(f"{{{body}}}"))


def key_reader(paths: Sequence[str]) -> Callable[[RequestRecord, PolicyContext], tuple[Any, ...]]:
    """``reader`` answering a hashable tuple, to key a memo by: a ``list(string)`` field's value
    as its tuple (the same strings in the same order), any other field's as ``read`` answers it.
    ``ValueError`` for other containers (none is request-scoped today)."""
    parts: list[str] = []
    for path, source in zip(paths, _sources(paths), strict=True):
        cel_type = FIELDS_BY_PATH[path].cel_type
        if cel_type == LIST_STRING:
            parts.append(f"tuple{source}")
        elif cel_type.startswith(("list(", "map(")):
            raise ValueError(f"{path} ({cel_type}) has no plain hashable form")
        else:
            parts.append(source)
    body = f"({', '.join(parts)},)" if parts else "()"
    return cast(Callable[[RequestRecord, PolicyContext], tuple[Any, ...]], _function(body))


def _sources(paths: Sequence[str]) -> list[str]:
    sources: list[str] = []
    for path in paths:
        source = FIELDS_BY_PATH[path].source
        if not source:
            raise ValueError(f"{path} is not a request-scoped field")
        sources.append(f"({source})")
    return sources


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": v}`` -> ``{"a": {"b": {"c": v}}}``."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        parts = path.split(".")
        cursor = nested
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = value
    return nested


def activation(
    record: RequestRecord,
    context: PolicyContext,
    backend: BackendFacts | None = None,
) -> dict[str, Any]:
    """The CEL input for one record as nested plain values (``{"request": {"tenant": ...}}``).

    Ints stay ``int`` and doubles ``float`` as declared. ``backend`` adds the
    ``backend`` namespace the routing stage sees for that candidate.
    """
    return nest(flat_inputs(record, context, backend))


# ---------------------------------------------------------------------------
# Author documentation
# ---------------------------------------------------------------------------


def render_schema_markdown() -> str:
    """The variable table of ``docs/policy-authors.md``, generated from ``FIELDS``."""
    lines = ["| Variable | CEL type | Origin | Meaning |", "|---|---|---|---|"]
    for namespace in NAMESPACES:
        lines.append(f"| **`{namespace}`** | | | {NAMESPACE_DOCS[namespace]} |")
        for f in FIELDS:
            if f.namespace == namespace:
                lines.append(f"| `{f.path}` | `{f.cel_type}` | {f.origin} | {f.doc} |")
    return "\n".join(lines) + "\n"
