"""``orchid-gateway audit isolation``: who can reach what, and who can share an instance.

A security reviewer's view of tenant isolation, computed from the same files the
gateway serves: ``gateway.yaml`` (backends and their ``cell`` / ``device_group``
labels, the embedded ``local_triton``), the tenants file, the route files and the
policy snapshot, each loaded with the loader the gateway itself uses. Nothing
here opens a socket or starts a process; it is pure computation over those values.

For each tenant it reports:

- reachability: logical model -> backend model and version -> the backends the
  request can run on. Backends come from ``PoolRegistry.candidate_backends`` (the
  serving code's own routing function), so the audit cannot drift from routing;
- fallback paths: the route's fallback -> its backends *in the same cell*, and
  whether the fallback can ever serve this tenant (config: ``allow_fallback``,
  classes ∩ ``fallback_classes``; policy: a probe of the served snapshot);
- co-batching: which other tenants can reach the same (backend, backend model)
  pair, i.e. can share a Triton model instance, a batch and the gateway's
  dispatch queue with it (``dedicated`` tenants must share with nobody);
- the policy rules that apply to it, per stage, and whether the policy's
  privacy rules actually deny other cells (probed, not matched by name);
- per route it may call with a fallback or a reduced output: the risk classes (at or
  above the tenant's and the route's minimum) the policy would degrade, probed once per
  class with ``request.risk_class`` set.

For each route with a fallback or a reduced output, the audit also judges the quality
evidence each degradation rests on (``gateway.evidence``: the route files' seeded
evidence, at the current wall-clock time): valid, missing, expired or below_floor, and
says when seeded evidence is undated or has no owner. The policy probes read those
verdicts, so a fallback on expired evidence is reported closed.

Paths in the tenant's home cell are *active* (the gateway routes there today);
paths in its other entitled cells, or fallbacks only the policy keeps closed,
are *latent*: not taken today, one configuration or policy edit away.

Findings carry a severity. Exit codes: 0 no severe finding, 1 at least one
severe finding (gate a deploy on it), 2 a file that does not load (the message
names the file and the key path).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

from gateway import clock
from gateway.config import (
    BackendConfig,
    GatewayConfig,
    RouteConfig,
    RouteTable,
    TenantConfig,
    TenantsFile,
    check_references,
    hash_api_key,
    load_gateway_config,
    load_routes,
    load_tenants,
)
from gateway.core.errors import ConfigError
from gateway.core.evidence import EvidenceStatus, EvidenceVerdict, RouteEvidence
from gateway.core.prefix import scope_for
from gateway.core.record import Budget, Demand, Identity, Mode, RequestRecord, Shape
from gateway.core.risk import resolve_risk_class
from gateway.evidence import EvidenceStore
from gateway.policy.context import build_policy_context, quality_floor
from gateway.policy.diagnostics import PolicyLoadError, render_all
from gateway.policy.loader import load_policies
from gateway.policy.model import STAGE_ORDER, ActionKind, Rule, Stage, Variable
from gateway.policy.schema import BackendFacts, LoadFacts, PolicyContext
from gateway.policy.snapshot import PolicyResult, PolicySnapshot
from gateway.pools import PoolRegistry
from gateway.server import LOCAL_BACKEND
from orchid_tools.capacity import backend_topologies
from orchid_tools.demo import DEMO_KEYS

PROG = "orchid-gateway audit isolation"

# The digests of the clear-text demo keys printed in the README and the example tenants file.
DEMO_KEY_DIGESTS: frozenset[str] = frozenset(hash_api_key(key) for key in DEMO_KEYS.values())

# Schema paths that identify the tenant: a rule reading one may treat tenants differently.
_IDENTITY_PATHS = frozenset({"tenant.name", "request.tenant"})

# Cell names the policy probes use for "somewhere this tenant is not entitled to".
_PROBE_FOREIGN_CELL = "audit-probe-foreign-cell"
_PROBE_IN_CELL = "audit-probe-in-cell"
_PROBE_UNLABELLED = "audit-probe-unlabelled"


class Severity(StrEnum):
    SEVERE = "severe"  # isolation is (or can be) broken: exit 1
    WARN = "warn"  # a latent risk or a configuration that does not do what it says
    INFO = "info"  # facts a reviewer should see


_SEVERITY_ORDER = {Severity.SEVERE: 0, Severity.WARN: 1, Severity.INFO: 2}


class ShareLevel(StrEnum):
    """How close two tenants can get, strongest first."""

    INSTANCE = "instance"  # both reach the same (backend, model) on paths routed today
    FALLBACK = "fallback"  # the same, but at least one of them only through a fallback
    LATENT = "latent"  # the same instance, through a path not taken today
    BACKEND = "backend"  # the same backend (Triton server, devices), distinct model instances
    NONE = "-"


_LEVEL_ORDER = (ShareLevel.INSTANCE, ShareLevel.FALLBACK, ShareLevel.LATENT, ShareLevel.BACKEND)


# --------------------------------------------------------------------------- result values


@dataclass(frozen=True, slots=True)
class Finding:
    severity: Severity
    code: str  # stable identifier, e.g. ``dedicated-shares-instance``
    tenant: str  # "" when it is not about one tenant
    message: str


@dataclass(frozen=True, slots=True)
class BackendRef:
    name: str
    cell: str
    device_group: str
    source: str  # "backends" | "local_triton"


@dataclass(frozen=True, slots=True)
class Hop:
    """One backend a path can run on."""

    backend: str
    cell: str
    device_group: str
    routed: bool  # in the tenant's home cell: the gateway routes there today


@dataclass(frozen=True, slots=True)
class FallbackPath:
    model: str  # the fallback's logical model
    backend_model: str
    version: str
    hops: tuple[Hop, ...]  # its backends in the cells where the primary runs
    outside_cell: tuple[str, ...]  # its other backends: never used for this tenant
    classes: tuple[str, ...]  # the tenant's classes the route lets the fallback serve
    config_allows: bool  # tenant allow_fallback and at least one such class
    policy_allows: bool  # the served policy admits the fallback for one of the tenant's classes
    policy_reason: str  # what the policy probe decided, and by which rules
    in_allow_list: bool  # the fallback model is in the tenant's own models
    status: str  # one line for people


@dataclass(frozen=True, slots=True)
class ModelReach:
    model: str
    backend_model: str
    version: str
    streaming: bool
    hops: tuple[Hop, ...]
    fallback: FallbackPath | None
    prefix_affinity: float | None = None  # the route's max_extra_wait_ms (None: no affinity)


@dataclass(frozen=True, slots=True)
class RuleRef:
    id: str
    mode: str  # enforce | shadow
    scope: str  # global | names-tenant | tenant-specific


@dataclass(frozen=True, slots=True)
class PolicyProbes:
    """What the served policy does with requests this tenant's traffic must never produce."""

    cell_entitlement: str  # a request in a cell the tenant is not entitled to
    cell_entitlement_enforced: bool | None  # None: could not probe
    backend_cell: str  # candidate backends outside the request's cell
    backend_cell_enforced: bool | None


@dataclass(frozen=True, slots=True)
class SharedInstance:
    instance: str  # "backend/backend_model" (for level backend: the backend's name)
    level: ShareLevel


@dataclass(frozen=True, slots=True)
class Share:
    tenant: str  # the other tenant
    level: ShareLevel  # the strongest of ``instances``
    instances: tuple[SharedInstance, ...]

    def describe(self, levels: Iterable[ShareLevel] | None = None) -> str:
        wanted = set(levels) if levels is not None else set(ShareLevel)
        return ", ".join(
            f"{i.instance}" + ("" if i.level is self.level else f" ({i.level})")
            for i in self.instances
            if i.level in wanted
        )


@dataclass(frozen=True, slots=True)
class RiskDegradation:
    """Which risk classes the policy would degrade on one route, for one tenant."""

    model: str
    minimum: str  # the highest of the tenant's and the route's risk_class
    classes: tuple[str, ...]  # the declared classes at or above ``minimum``, lowest first
    fallback: tuple[str, ...]  # classes the policy would answer with the route's fallback
    reduced_output: tuple[str, ...]  # classes whose output the policy would cap (ladder step 2)
    never: tuple[str, ...]  # classes degraded by neither


@dataclass(frozen=True, slots=True)
class EvidenceCheck:
    """The verdict on the evidence one degradation of one route rests on."""

    degradation: str  # "fallback" | "reduced_output"
    model: str  # whose evidence: the fallback model, or the route's own (capped)
    version: str
    population: str
    output_cap: int  # 0: the full output
    status: str  # valid | missing | expired | below_floor
    score: float | None  # None: missing
    floor: float
    owner: str
    evaluated_at: str  # ISO 8601 (UTC), "" when undated
    expires_at: str  # ISO 8601 (UTC), "" when it never expires
    source: str  # seeded | published | "" when missing


@dataclass(frozen=True, slots=True)
class RouteEvidenceAudit:
    route: str
    checks: tuple[EvidenceCheck, ...]


@dataclass(frozen=True, slots=True)
class TenantAudit:
    name: str
    cells: tuple[str, ...]
    home_cell: str
    classes: tuple[str, ...]
    models: tuple[str, ...]
    dedicated: bool
    admin: bool
    allow_fallback: bool
    max_output_tokens: int
    demo_key: bool
    reach: tuple[ModelReach, ...]
    shares: tuple[Share, ...]
    rules: dict[str, tuple[RuleRef, ...]]  # stage -> rules, in evaluation order
    probes: PolicyProbes
    risk_class: str  # the tenant's minimum risk class
    degradable: tuple[RiskDegradation, ...]  # routes with a fallback or a reduced output


@dataclass(frozen=True, slots=True)
class Access:
    """One tenant's ways onto one instance."""

    tenant: str
    direct_active: bool  # calls the model, routed today
    fallback_active: bool  # served by it as a fallback, routed today, policy admits
    latent: bool  # some other path: another entitled cell, or a fallback the policy keeps closed
    via: tuple[str, ...]  # human-readable paths


@dataclass(frozen=True, slots=True)
class Instance:
    """A (backend, backend model) pair: one Triton model, its instances, batches and dispatch queue."""

    backend: str
    backend_model: str
    cell: str
    device_group: str
    access: tuple[Access, ...]


@dataclass(frozen=True, slots=True)
class PolicyRuleInfo:
    id: str
    stage: str
    mode: str
    source: str
    reads_identity: bool
    names_tenants: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TopologyUnit:
    name: str  # "model/uN"
    devices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TopologyModel:
    """One backend model's units on a backend with a topology."""

    model: str
    tensor_parallel: int
    stages: int
    width: int  # devices per unit
    declared: bool  # a layout is declared (else one device per unit)
    units: tuple[TopologyUnit, ...]
    capacity_devices: int  # devices of its units with no lost device: what its pool's ladder counts


@dataclass(frozen=True, slots=True)
class DomainAudit:
    """What losing one failure domain takes away."""

    kind: str
    name: str
    devices: tuple[int, ...]
    units_lost: dict[str, tuple[str, ...]]  # model -> the units that span a device of the domain
    units_left: dict[str, int]  # model -> its units left
    stranded: tuple[int, ...]  # healthy devices of a lost unit, no longer counted by its layout
    capacity_left: dict[str, int]  # model -> devices of its units left (the pool's capacity)


@dataclass(frozen=True, slots=True)
class TopologyAudit:
    """A backend that declares a topology: its units per model and its failure domains."""

    backend: str
    devices: int
    lost: tuple[int, ...]  # lost at start
    domains: dict[str, dict[str, tuple[int, ...]]]
    links: dict[str, tuple[int, ...]]
    models: tuple[TopologyModel, ...]
    losses: tuple[DomainAudit, ...]


@dataclass(frozen=True, slots=True)
class PrefixScopeAudit:
    """A route whose requests go by prefix affinity: the cache scope each tenant reaching it
    gets in each of its cells (``gateway.core.prefix.scope_for``; sent as ``prefix_scope``)."""

    route: str
    max_extra_wait_ms: float
    scopes: dict[str, tuple[str, ...]]  # tenant -> its scopes, one per cell


@dataclass(frozen=True, slots=True)
class Audit:
    config: str
    tenants_file: str
    routes_dir: str
    policies_dir: str
    policy_version: str
    policy_label: str
    policy_engine: str
    backends: tuple[BackendRef, ...]
    tenants: tuple[TenantAudit, ...]
    instances: tuple[Instance, ...]
    matrix: dict[str, dict[str, str]]
    rules: tuple[PolicyRuleInfo, ...]
    findings: tuple[Finding, ...]
    evidence_at: str  # the wall-clock time the evidence was judged at (ISO 8601, UTC)
    evidence: tuple[RouteEvidenceAudit, ...]
    topology: tuple[TopologyAudit, ...] = ()  # backends with a topology (none: no section)
    prefix: tuple[PrefixScopeAudit, ...] = ()  # routes with prefix affinity (none: no section)

    def count(self, severity: Severity) -> int:
        return sum(1 for f in self.findings if f.severity is severity)

    @property
    def exit_code(self) -> int:
        return 1 if self.count(Severity.SEVERE) else 0


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class Served:
    """Everything the gateway serves from one ``gateway.yaml``, loaded as ``serve`` loads it."""

    path: Path
    config: GatewayConfig
    tenants: TenantsFile
    routes: RouteTable
    policy: PolicySnapshot


def load_served(path: Path) -> Served:
    """Load and cross-check like ``serve`` does; raises ``ConfigError`` (``PolicyLoadError`` for policy)."""
    config = load_gateway_config(path)
    tenants = load_tenants(config.tenants_file)
    routes = load_routes(config.routes_dir)
    check_references(config, tenants, routes)
    policy = load_policies(config.policies_dir, engine=config.policy_engine)
    return Served(path, config, tenants, routes, policy)


def served_backends(config: GatewayConfig) -> tuple[BackendRef, ...]:
    """The backends ``serve`` opens, in its order (``GatewayServer.backend_configs``): the configured
    ones, then the embedded Triton as ``local`` with ``local_triton.labels``. A configured backend
    also named ``local`` is replaced by the embedded one, as in the server's backend map."""
    refs: dict[str, BackendRef] = {}
    for backend in config.backends:
        refs[backend.name] = _ref(backend, "backends")
    local = config.local_triton
    if local is not None:
        refs[LOCAL_BACKEND] = BackendRef(
            LOCAL_BACKEND, local.labels.get("cell", ""), local.labels.get("device_group", ""), "local_triton"
        )
    return tuple(refs.values())


def _ref(backend: BackendConfig, source: str) -> BackendRef:
    return BackendRef(backend.name, backend.labels["cell"], backend.labels["device_group"], source)


@dataclass(frozen=True, slots=True)
class _Labelled:
    labels: dict[str, str]


@dataclass(frozen=True, slots=True)
class _RoutingView:
    """Exactly what ``PoolRegistry.candidate_backends`` reads: backend name -> labels, in serving order."""

    backends: dict[str, _Labelled]


def _routing_view(backends: Sequence[BackendRef]) -> _RoutingView:
    labels = {b.name: _Labelled({"cell": b.cell, "device_group": b.device_group}) for b in backends}
    return _RoutingView(labels)


def _candidates(view: _RoutingView, route: RouteConfig, cell: str) -> list[str]:
    # The serving code's own routing function over a view of the configured backends, so that a
    # change to how the gateway picks backends changes this audit too.
    return PoolRegistry.candidate_backends(cast(PoolRegistry, view), route, cell)


# --------------------------------------------------------------------------- policy probes


def probe_inputs(
    served: Served,
    name: str,
    tenant: TenantConfig,
    route: RouteConfig,
    *,
    model: str,
    model_version: str,
    request_class: str,
    cell: str,
    backends: tuple[BackendFacts, ...] = (),
    risk_class: str | None = None,
    evidence: RouteEvidence | None = None,
    reduce_output: bool = False,
    max_output_tokens: int | None = None,
) -> tuple[RequestRecord, PolicyContext]:
    """One benign request of this tenant, as policy would see it: no load, no quota limit, a
    deadline with slack, the fallback assumed warm in the tenant's cell. Capacity rules stay
    quiet, so what decides is entitlement and isolation. The context comes from the builder
    the gateway uses (``gateway.policy.context``), so probes read the facts serving reads.

    ``risk_class``: the request's class (None: the tenant's and route's minimum, as the
    gateway resolves it); ``evidence``: the quality verdicts (None: the declared scores);
    ``reduce_output``: the request is at ladder step 2 and in the share whose output the pool
    caps; ``max_output_tokens``: the output it asks for (None: 16, within the tenant's cap)."""
    fallback = served.routes.models.get(route.fallback) if route.fallback else None
    class_config = served.config.classes.get(request_class)
    deadline_ms = class_config.default_deadline_ms if class_config else 1000.0
    record = RequestRecord(
        identity=Identity(
            request_id="audit-probe",
            tenant=name,
            request_class=request_class,
            model=model,
            model_version=model_version,
            operation="ModelStreamInfer" if route.streaming else "ModelInfer",
            mode=Mode.STREAMING if route.streaming else Mode.ONLINE,
            privacy_cell=cell,
            risk_class=risk_class
            if risk_class is not None
            else resolve_risk_class(
                served.config.risk_classes,
                tenant_default=tenant.risk_class,
                route_default=route.risk_class,
                requested=None,
            ),
        ),
        shape=Shape(
            items=1,
            input_tokens=16,
            max_output_tokens=(
                max_output_tokens if max_output_tokens is not None else min(16, tenant.max_output_tokens)
            ),
        ),
        demand=Demand(prefill_ms=0.5, decode_ms=0.5),
        budget=Budget(
            deadline_ms=deadline_ms,
            elapsed_ms=0.0,
            reserve_upstream_ms=class_config.reserve_upstream_ms if class_config else 0.0,
            reserve_exec_ms=1.0,
            reserve_fail_ms=class_config.reserve_fail_ms if class_config else 0.0,
        ),
        ladder_step=2 if reduce_output else 0,
    )
    context = build_policy_context(
        name,
        tenant,
        route,
        fallback,
        fallback_warm=fallback is not None,  # the audit reports what configuration allows
        fallback_cell=cell if fallback is not None else "",
        load=LoadFacts(utilization=0.0, drain_ms=0.0, reduce_output=reduce_output),
        quota=None,  # unmetered: quota never decides a probe
        backends=backends,
        evidence=evidence,
    )
    return record, context


def _probe(
    served: Served,
    name: str,
    tenant: TenantConfig,
    route: RouteConfig,
    *,
    model: str,
    model_version: str,
    request_class: str,
    cell: str,
    backends: tuple[BackendFacts, ...] = (),
    risk_class: str | None = None,
    evidence: RouteEvidence | None = None,
    reduce_output: bool = False,
    max_output_tokens: int | None = None,
) -> PolicyResult:
    """Evaluate the served policy for one benign request of this tenant (``probe_inputs``)."""
    record, context = probe_inputs(
        served,
        name,
        tenant,
        route,
        model=model,
        model_version=model_version,
        request_class=request_class,
        cell=cell,
        backends=backends,
        risk_class=risk_class,
        evidence=evidence,
        reduce_output=reduce_output,
        max_output_tokens=max_output_tokens,
    )
    return served.policy.evaluate(record, context)


def _fallback_policy(
    served: Served,
    name: str,
    tenant: TenantConfig,
    model: str,
    route: RouteConfig,
    fallback: RouteConfig,
    cell: str,
    *,
    evidence: RouteEvidence | None = None,
    risk_class: str | None = None,
) -> tuple[bool, str]:
    """Would the served policy ever answer this tenant with the route's fallback? The gateway
    needs the fallback candidate allowed and eligible (on the primary or on the fallback pass)."""
    assert route.fallback is not None
    reasons: list[str] = []
    if not tenant.classes:
        return False, "the tenant has no request classes"
    for request_class in tenant.classes:
        primary = _probe(
            served,
            name,
            tenant,
            route,
            model=model,
            model_version=route.version,
            request_class=request_class,
            cell=cell,
            evidence=evidence,
            risk_class=risk_class,
        )
        candidate = _probe(
            served,
            name,
            tenant,
            route,
            model=route.fallback,
            model_version=fallback.version,
            request_class=request_class,
            cell=cell,
            evidence=evidence,
            risk_class=risk_class,
        )
        eligible = primary.fallback_eligible or candidate.fallback_eligible
        if eligible and candidate.allowed:
            return True, f"admitted for class {request_class}"
        if not candidate.allowed:
            reasons.append(f"{request_class}: denied by {candidate.rule or 'policy'}")
        else:
            vetoes = [
                rule_id
                for rule_id in (*primary.rules_fired, *candidate.rules_fired)
                if served.policy.rule(rule_id).action.kind is ActionKind.FALLBACK_INELIGIBLE
            ]
            why = ", ".join(dict.fromkeys(vetoes)) if vetoes else "no rule makes it eligible"
            reasons.append(f"{request_class}: not eligible ({why})")
    return False, "; ".join(reasons)


def _privacy_probes(
    served: Served, name: str, tenant: TenantConfig, backends: Sequence[BackendRef]
) -> PolicyProbes:
    """Probe the policy with what must be refused: a request in a cell the tenant is not entitled
    to, and candidate backends outside the request's cell (and one without a cell label)."""
    home = tenant.home_cell
    attempts = [
        (model, request_class)
        for model in tenant.models
        if model in served.routes.models
        for request_class in tenant.classes
    ]
    if not attempts:
        text = "not probed: the tenant has no model and class to ask for"
        return PolicyProbes(text, None, text, None)
    other_cells = sorted({b.cell for b in backends if b.cell != home} | {_PROBE_FOREIGN_CELL})
    foreign = next((c for c in other_cells if c not in tenant.cells), _PROBE_FOREIGN_CELL)

    entitlement_ok: bool | None = None
    entitlement = ""
    for model, request_class in attempts:
        route = served.routes.models[model]
        result = _probe(
            served,
            name,
            tenant,
            route,
            model=model,
            model_version=route.version,
            request_class=request_class,
            cell=foreign,
        )
        if not result.allowed:
            stage = _stage_of(served.policy, result.rule)
            entitlement_ok = True
            entitlement = f"a request in cell {foreign!r} is denied by {result.rule} ({stage} stage)"
            break
        entitlement_ok = False
        entitlement = f"a request in cell {foreign!r} (not entitled) is ALLOWED by the policy"

    probe_backends = (
        BackendFacts(_PROBE_IN_CELL, labels={"cell": home}),
        *(BackendFacts(f"audit-probe-{cell}", labels={"cell": cell}) for cell in other_cells),
        BackendFacts(_PROBE_UNLABELLED, labels={}),
    )
    routing_ok: bool | None = None
    routing = ""
    for model, request_class in attempts:
        route = served.routes.models[model]
        probe = tuple(dataclasses.replace(b, model=route.backend_model) for b in probe_backends)
        result = _probe(
            served,
            name,
            tenant,
            route,
            model=model,
            model_version=route.version,
            request_class=request_class,
            cell=home,
            backends=probe,
        )
        if not result.allowed:
            routing = f"inconclusive: the probe request was denied by {result.rule}"
            continue
        excluded = set(result.excluded_backends)
        leaked = [b.name for b in probe[1:] if b.name not in excluded]
        routing_rules = [r for r in result.rules_fired if _stage_of(served.policy, r) == Stage.ROUTING]
        by = ", ".join(routing_rules) or "no rule"
        if leaked:
            routing_ok = False
            routing = f"backends outside cell {home!r} NOT excluded: {', '.join(leaked)}"
        else:
            routing_ok = True
            routing = f"backends outside cell {home!r} and unlabelled ones are excluded by {by}"
        if _PROBE_IN_CELL in excluded:
            routing += f"; the in-cell backend is excluded too (by {by})"
        break
    return PolicyProbes(entitlement, entitlement_ok, routing, routing_ok)


def _stage_of(policy: PolicySnapshot, rule_id: str) -> str:
    try:
        return str(policy.rule(rule_id).stage)
    except KeyError:
        return "built-in"


# --------------------------------------------------------------------------- evidence, risk classes


def _iso(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat().replace("+00:00", "Z")


def route_verdicts(served: Served, now: float) -> dict[str, RouteEvidence]:
    """The verdicts each route's degradations rest on, judged at wall-clock ``now`` on the
    route files' seeded evidence (the store ``serve`` starts with; publications come later)."""
    store = EvidenceStore(served.routes)
    out: dict[str, RouteEvidence] = {}
    for name, route in served.routes.models.items():
        fallback = served.routes.models.get(route.fallback) if route.fallback else None
        out[name] = store.route_evidence(name, route, fallback, floor=quality_floor(route, fallback), now=now)
    return out


def _check(
    degradation: str, model: str, version: str, population: str, cap: int, floor: float, v: EvidenceVerdict
) -> EvidenceCheck:
    e = v.evidence
    return EvidenceCheck(
        degradation=degradation,
        model=model,
        version=version,
        population=population,
        output_cap=cap,
        status=str(v.status),
        score=e.score if e is not None else None,
        floor=floor,
        owner=e.owner if e is not None else "",
        evaluated_at=_iso(e.evaluated_at) if e is not None else "",
        expires_at=_iso(e.expires_at()) if e is not None else "",
        source=e.source if e is not None else "",
    )


def _evidence_audit(
    served: Served, verdicts: Mapping[str, RouteEvidence], findings: _Findings
) -> tuple[RouteEvidenceAudit, ...]:
    out: list[RouteEvidenceAudit] = []
    for name, route in served.routes.models.items():
        if route.fallback is None and route.reduced_output is None:
            continue
        fallback = served.routes.models.get(route.fallback) if route.fallback else None
        floor = quality_floor(route, fallback)
        verdict = verdicts[name]
        checks: list[EvidenceCheck] = []
        population = ""
        if route.quality is not None:
            population = route.quality.population
        elif fallback is not None and fallback.quality is not None:
            population = fallback.quality.population
        if route.fallback is not None:
            checks.append(
                _check(
                    "fallback",
                    route.fallback,
                    fallback.version if fallback is not None else "",
                    population,
                    0,
                    floor,
                    verdict.fallback,
                )
            )
        if route.reduced_output is not None:
            cap = route.reduced_output.max_output_tokens
            checks.append(
                _check("reduced_output", name, route.version, population, cap, floor, verdict.reduced_output)
            )
        for check in checks:
            if check.status == EvidenceStatus.VALID:
                continue
            what = _evidence_subject(check)
            detail = {
                "missing": "no evaluation on record",
                "expired": f"expired {check.expires_at}",
                "below_floor": f"score {check.score} below the floor {check.floor}",
            }.get(check.status, check.status)
            findings.add(
                Severity.WARN,
                "evidence-disables-degradation",
                "",
                f"{name}: {check.degradation} is disabled, its evidence ({what}) is {check.status} "
                f"({detail}); publish a current evaluation (orchid-gateway evidence publish)",
            )
        out.append(RouteEvidenceAudit(name, tuple(checks)))
    _seeded_evidence_findings(served, findings)
    return tuple(out)


def _evidence_subject(check: EvidenceCheck) -> str:
    version = f" v{check.version}" if check.version else ""
    cap = f" capped at {check.output_cap} tokens" if check.output_cap else ""
    return f"{check.model}{version}{cap} on {check.population or 'no population'}"


def _seeded_evidence_findings(served: Served, findings: _Findings) -> None:
    """Seeded evidence without a date or an owner: nobody answers for it, or nothing ends it."""
    for name, route in served.routes.models.items():
        blocks = []
        if route.quality is not None:
            blocks.append(("quality", route.quality))
        if route.reduced_output is not None:
            blocks.append(("reduced_output.quality", route.reduced_output.quality))
        for key, quality in blocks:
            missing = []
            if quality.evaluated_at is None:
                missing.append("undated (no evaluated_at)")
            if not quality.owner:
                missing.append("has no owner")
            if not missing:
                continue
            never = quality.evaluated_at is None and quality.review_by is None
            findings.add(
                Severity.WARN if never else Severity.INFO,
                "seeded-evidence-undated" if quality.evaluated_at is None else "seeded-evidence-no-owner",
                "",
                f"{name}: {key} ({quality.population}, score {quality.score}) is "
                + " and ".join(missing)
                + (
                    "; with no review_by it never expires, so nothing but a publication can fail it"
                    if never
                    else ""
                ),
            )


def _risk_degradation(
    served: Served,
    name: str,
    tenant: TenantConfig,
    model: str,
    route: RouteConfig,
    evidence: RouteEvidence,
    fallback_reachable: bool,
) -> RiskDegradation:
    """Probe the policy once per risk class (at or above the minimum) for each degradation."""
    declared = served.config.risk_classes
    minimum = resolve_risk_class(
        declared, tenant_default=tenant.risk_class, route_default=route.risk_class, requested=None
    )
    classes = declared[declared.index(minimum) :]
    fallback = served.routes.models.get(route.fallback) if route.fallback else None
    reduced = route.reduced_output
    by_fallback: list[str] = []
    by_reduced: list[str] = []
    for risk_class in classes:
        if fallback is not None and fallback_reachable:
            allows, _ = _fallback_policy(
                served,
                name,
                tenant,
                model,
                route,
                fallback,
                tenant.home_cell,
                evidence=evidence,
                risk_class=risk_class,
            )
            if allows:
                by_fallback.append(risk_class)
        if reduced is not None and tenant.max_output_tokens > reduced.max_output_tokens:
            asked = reduced.max_output_tokens + 1
            for request_class in tenant.classes:
                result = _probe(
                    served,
                    name,
                    tenant,
                    route,
                    model=model,
                    model_version=route.version,
                    request_class=request_class,
                    cell=tenant.home_cell,
                    risk_class=risk_class,
                    evidence=evidence,
                    reduce_output=True,
                    max_output_tokens=asked,
                )
                if (
                    result.allowed
                    and result.max_output_tokens is not None
                    and result.max_output_tokens < asked
                ):
                    by_reduced.append(risk_class)
                    break
    degraded = set(by_fallback) | set(by_reduced)
    return RiskDegradation(
        model=model,
        minimum=minimum,
        classes=tuple(classes),
        fallback=tuple(by_fallback),
        reduced_output=tuple(by_reduced),
        never=tuple(c for c in classes if c not in degraded),
    )


# --------------------------------------------------------------------------- policy rules


def _rule_info(policy: PolicySnapshot, tenant_names: Sequence[str]) -> tuple[PolicyRuleInfo, ...]:
    variables = {v.name: v for v in policy.variables}
    return tuple(_describe_rule(rule, variables, tenant_names) for rule in policy.rules)


def _describe_rule(
    rule: Rule, variables: Mapping[str, Variable], tenant_names: Sequence[str]
) -> PolicyRuleInfo:
    reads = set(rule.reads)
    texts = [rule.condition_text]
    pending = list(rule.uses)
    seen: set[str] = set()
    while pending:
        variable = variables.get(pending.pop())
        if variable is None or variable.name in seen:
            continue
        seen.add(variable.name)
        reads |= set(variable.reads)
        texts.append(variable.text)
        pending.extend(variable.uses)
    named = tuple(t for t in tenant_names if any(f"'{t}'" in text or f'"{t}"' in text for text in texts))
    return PolicyRuleInfo(
        id=rule.id,
        stage=str(rule.stage),
        mode=str(rule.mode),
        source=str(rule.source),
        reads_identity=bool(reads & _IDENTITY_PATHS),
        names_tenants=named,
    )


def _tenant_rules(rules: Sequence[PolicyRuleInfo], name: str) -> dict[str, tuple[RuleRef, ...]]:
    out: dict[str, tuple[RuleRef, ...]] = {}
    for stage in STAGE_ORDER:
        refs = []
        for info in rules:
            if info.stage != stage:
                continue
            if name in info.names_tenants:
                scope = "names-tenant"
            elif info.reads_identity or info.names_tenants:
                scope = "tenant-specific"
            else:
                scope = "global"
            refs.append(RuleRef(info.id, info.mode, scope))
        out[str(stage)] = tuple(refs)
    return out


# --------------------------------------------------------------------------- the audit


class _Findings:
    def __init__(self) -> None:
        self.items: list[Finding] = []

    def add(self, severity: Severity, code: str, tenant: str, message: str) -> None:
        self.items.append(Finding(severity, code, tenant, message))

    def sorted(self) -> tuple[Finding, ...]:
        return tuple(sorted(self.items, key=lambda f: (_SEVERITY_ORDER[f.severity], f.code, f.tenant)))


@dataclass
class _AccessBuilder:
    direct_active: bool = False
    fallback_active: bool = False
    latent: bool = False
    via: list[str] = dataclasses.field(default_factory=list)


def _note(
    accesses: dict[tuple[str, str], dict[str, _AccessBuilder]],
    key: tuple[str, str],
    tenant: str,
    *,
    direct: bool,
    active: bool,
    via: str,
) -> None:
    """Record that ``tenant`` reaches the (backend, backend model) ``key``, and how."""
    entry = accesses.setdefault(key, {}).setdefault(tenant, _AccessBuilder())
    if active and direct:
        entry.direct_active = True
    elif active:
        entry.fallback_active = True
    else:
        entry.latent = True
    entry.via.append(via)


def audit_isolation(path: Path, *, now: float | None = None) -> Audit:
    """Load what ``serve`` would serve from ``path`` and audit it; raises ``ConfigError``.
    ``now``: the wall-clock time evidence is judged at (None: the current time)."""
    return audit_served(load_served(path), now=now)


def audit_served(served: Served, *, now: float | None = None) -> Audit:
    config, tenants = served.config, served.tenants
    findings = _Findings()
    evidence_at = clock.wall() if now is None else now
    verdicts = route_verdicts(served, evidence_at)
    degradable: dict[str, list[RiskDegradation]] = {}
    backends = served_backends(config)
    by_name = {b.name: b for b in backends}
    view = _routing_view(backends)
    tenant_names = tuple(tenants.tenants)
    rule_info = _rule_info(served.policy, tenant_names)

    if config.local_triton is not None and any(b.name == LOCAL_BACKEND for b in config.backends):
        findings.add(
            Severity.WARN,
            "backend-name-clash",
            "",
            f"a configured backend is named {LOCAL_BACKEND!r}, the embedded Triton's name: the embedded "
            "one replaces it, so routes naming it run on the local Triton",
        )

    # (backend, backend_model) -> tenant -> how it gets there
    accesses: dict[tuple[str, str], dict[str, _AccessBuilder]] = {}
    tenant_backends: dict[str, set[str]] = {}
    reaches: dict[str, tuple[ModelReach, ...]] = {}
    probes: dict[str, PolicyProbes] = {}
    no_entitlement: list[str] = []
    no_backend_cell: list[str] = []
    served_cells = {b.cell for b in backends}

    for name, tenant in tenants.tenants.items():
        home = tenant.home_cell
        cells = (home, *(c for c in tenant.cells if c != home))
        model_reaches: list[ModelReach] = []
        tenant_backends[name] = set()

        for model in tenant.models:
            route = served.routes.models[model]
            # Dedicated tenants run on the route's dedicated instances (RouteConfig.for_tenant).
            own_route = route.for_tenant(model, tenant)
            own_backend_model = own_route.backend_model if own_route else route.backend_model
            hops: list[Hop] = []
            for cell in cells:
                for backend_name in _candidates(view, route, cell):
                    ref = by_name[backend_name]
                    if ref.cell != cell:
                        findings.add(
                            Severity.SEVERE,
                            "routing-leaves-cell",
                            name,
                            f"{model}: routing picked backend {backend_name!r} in cell {ref.cell!r} "
                            f"for a request in cell {cell!r}",
                        )
                    hops.append(Hop(backend_name, ref.cell, ref.device_group, routed=cell == home))
            for hop in hops:
                tenant_backends[name].add(hop.backend)
                _note(
                    accesses,
                    (hop.backend, own_backend_model),
                    name,
                    direct=True,
                    active=hop.routed,
                    via=f"calls {model}" + ("" if hop.routed else f" in cell {hop.cell} (latent)"),
                )
                if route.shadow is not None and not tenant.dedicated:
                    # Shadow traffic: a share of this tenant's requests is mirrored to the
                    # candidate (pipeline.ShadowTraffic; never for dedicated tenants).
                    _note(
                        accesses,
                        (hop.backend, route.shadow.backend_model),
                        name,
                        direct=False,
                        active=hop.routed,
                        via=f"shadow of {model} ({route.shadow.rate:.0%} mirrored)",
                    )
            fallback_path = None
            if (
                route.fallback is not None
                and served.routes.models[route.fallback].for_tenant(route.fallback, tenant) is not None
            ):
                fallback_path = _fallback_path(
                    served, view, by_name, name, tenant, model, route, hops, verdicts[model]
                )
                for hop in fallback_path.hops:
                    reachable = fallback_path.policy_allows or fallback_path.config_allows
                    if not reachable:
                        continue
                    active = hop.routed and fallback_path.policy_allows
                    tenant_backends[name].add(hop.backend)
                    _note(
                        accesses,
                        (hop.backend, fallback_path.backend_model),
                        name,
                        direct=False,
                        active=active,
                        via=f"fallback of {model}" + ("" if active else " (latent)"),
                    )
                _fallback_findings(findings, name, tenant, model, fallback_path)
            if route.reduced_output is not None or fallback_path is not None:
                degradable.setdefault(name, []).append(
                    _risk_degradation(
                        served,
                        name,
                        tenant,
                        model,
                        route,
                        verdicts[model],
                        fallback_reachable=fallback_path is not None and bool(fallback_path.hops),
                    )
                )
            model_reaches.append(
                ModelReach(
                    model,
                    own_backend_model,
                    route.version,
                    route.streaming,
                    tuple(hops),
                    fallback_path,
                    route.prefix_affinity.max_extra_wait_ms if route.prefix_affinity is not None else None,
                )
            )
            if not any(h.routed for h in hops):
                elsewhere = sorted({h.cell for h in hops})
                extra = (
                    f"; only in its other cells {', '.join(elsewhere)}, where it is not routed"
                    if hops
                    else ""
                )
                findings.add(
                    Severity.WARN,
                    "model-without-backend",
                    name,
                    f"may call {model!r} but no backend in its home cell {home!r} serves it: calls answer "
                    f"UNAVAILABLE{extra}",
                )
        reaches[name] = tuple(model_reaches)

        for cell in tenant.cells:
            if cell not in served_cells:
                findings.add(
                    Severity.WARN,
                    "cell-without-backend",
                    name,
                    f"entitled to cell {cell!r}, but no backend is labelled with it",
                )
        inert = [c for c in tenant.cells if c != home and c in served_cells]
        if inert:
            findings.add(
                Severity.INFO,
                "inert-cell-entitlement",
                name,
                f"entitled to {', '.join(inert)} besides its home cell {home!r}; the gateway routes only in "
                "the home cell, so paths there are reported as latent",
            )

        probe = probes[name] = _privacy_probes(served, name, tenant, backends)
        if probe.cell_entitlement_enforced is False:
            no_entitlement.append(name)
        if probe.backend_cell_enforced is False:
            no_backend_cell.append(name)
        if tenant.models and None in (probe.cell_entitlement_enforced, probe.backend_cell_enforced):
            findings.add(
                Severity.INFO,
                "policy-probe-inconclusive",
                name,
                f"the privacy probes did not finish: {probe.cell_entitlement}; {probe.backend_cell}",
            )

    if no_entitlement:
        findings.add(
            Severity.SEVERE,
            "policy-no-cell-entitlement",
            "",
            "no enforced privacy rule denies a request in a cell the tenant is not entitled to (like "
            f"privacy-cell-allowed); probed for {', '.join(no_entitlement)}",
        )
    if no_backend_cell:
        findings.add(
            Severity.SEVERE,
            "policy-no-backend-cell-rule",
            "",
            "no enforced routing rule excludes backends outside the request's privacy cell (like "
            f"privacy-backend-cell); probed for {', '.join(no_backend_cell)}",
        )

    instances = _instances(accesses, by_name)
    matrix, shares = _matrix(tenant_names, instances, tenant_backends)
    _sharing_findings(findings, tenants, shares)
    _credential_findings(findings, served)
    evidence = _evidence_audit(served, verdicts, findings)

    topology = topology_audit(served, findings)
    tenant_audits = tuple(
        TenantAudit(
            name=name,
            cells=tenant.cells,
            home_cell=tenant.home_cell,
            classes=tenant.classes,
            models=tenant.models,
            dedicated=tenant.dedicated,
            admin=tenant.admin,
            allow_fallback=tenant.allow_fallback,
            max_output_tokens=tenant.max_output_tokens,
            demo_key=any(k in DEMO_KEY_DIGESTS for k in tenant.key_sha256),
            reach=reaches[name],
            shares=shares[name],
            rules=_tenant_rules(rule_info, name),
            probes=probes[name],
            risk_class=tenant.risk_class,
            degradable=tuple(degradable.get(name, ())),
        )
        for name, tenant in tenants.tenants.items()
    )
    return Audit(
        config=str(served.path),
        tenants_file=str(config.tenants_file),
        routes_dir=str(config.routes_dir),
        policies_dir=str(config.policies_dir),
        policy_version=served.policy.version,
        policy_label=served.policy.label,
        policy_engine=served.policy.engine_name,
        backends=backends,
        tenants=tenant_audits,
        instances=instances,
        matrix=matrix,
        rules=rule_info,
        findings=findings.sorted(),
        evidence_at=_iso(evidence_at),
        evidence=evidence,
        topology=topology,
        prefix=prefix_audit(tenant_audits),
    )


def prefix_audit(tenants: Sequence[TenantAudit]) -> tuple[PrefixScopeAudit, ...]:
    """Every route a tenant reaches with prefix affinity, and the scopes its cache entries are
    kept under: tenant, cell and model version are always part of the scope, so no entry is
    shared across tenants (a dedicated tenant's are under its own model too)."""
    routes: dict[str, tuple[float, dict[str, tuple[str, ...]]]] = {}
    for tenant in tenants:
        for reach in tenant.reach:
            if reach.prefix_affinity is None:
                continue
            _, scopes = routes.setdefault(reach.model, (reach.prefix_affinity, {}))
            scopes[tenant.name] = tuple(
                scope_for(tenant.name, cell, reach.backend_model, reach.version) for cell in tenant.cells
            )
    return tuple(PrefixScopeAudit(route, bound, scopes) for route, (bound, scopes) in sorted(routes.items()))


def topology_audit(served: Served, findings: _Findings | None = None) -> tuple[TopologyAudit, ...]:
    """Every backend with a topology: its units per model (``orchid_tools.capacity.backend_topologies``,
    the worksheet's placement: routes whose backend model runs there, a model without a layout one
    device per unit) and, per failure domain, what its loss takes (``gateway.core.topology``)."""
    out = []
    for b in backend_topologies(served.config, served.routes):
        models = tuple(
            TopologyModel(
                model=m.model,
                tensor_parallel=m.layout.tensor_parallel,
                stages=m.layout.stages,
                width=m.width,
                declared=m.declared,
                units=tuple(TopologyUnit(u.name, u.devices) for u in m.units),
                capacity_devices=b.capacity_devices(m),
            )
            for m in b.models
        )
        losses = []
        for loss in b.losses():
            left = {m.model: b.capacity_devices(m, loss.devices) for m in b.models}
            losses.append(
                DomainAudit(
                    kind=loss.kind,
                    name=loss.name,
                    devices=loss.devices,
                    units_lost=dict(loss.units_lost),
                    units_left=dict(loss.units_left),
                    stranded=loss.stranded,
                    capacity_left=left,
                )
            )
            emptied = [m for m, devices in left.items() if devices == 0]
            if findings is not None and emptied:
                whole = len(loss.devices) == b.devices
                findings.add(
                    Severity.INFO if whole else Severity.WARN,
                    "domain-loss-leaves-no-unit",
                    "",
                    f"backend {b.backend!r}: losing {loss.kind} {loss.name} (devices "
                    f"{', '.join(map(str, loss.devices))}) leaves {', '.join(emptied)} no unit"
                    + (
                        ": the domain is the whole backend, so redundancy must come from another backend"
                        if whole
                        else ": its units all span that domain (spread them or add data-parallel units)"
                    ),
                )
        out.append(
            TopologyAudit(
                backend=b.backend,
                devices=b.devices,
                lost=b.lost,
                domains={k: dict(names) for k, names in b.topology.domains.items()},
                links=dict(b.topology.links),
                models=models,
                losses=tuple(losses),
            )
        )
    return tuple(out)


def _own_backend_model(route: RouteConfig, model: str, tenant: TenantConfig) -> str:
    own = route.for_tenant(model, tenant)
    return own.backend_model if own is not None else route.backend_model


def _fallback_path(
    served: Served,
    view: _RoutingView,
    by_name: Mapping[str, BackendRef],
    name: str,
    tenant: TenantConfig,
    model: str,
    route: RouteConfig,
    hops: Sequence[Hop],
    evidence: RouteEvidence,
) -> FallbackPath:
    """The route's fallback as this tenant can meet it: the gateway looks for it only in the cell
    the primary was bound in (``_warm_fallback`` -> ``bind_pool`` -> ``candidate_backends``)."""
    assert route.fallback is not None
    fallback = served.routes.models[route.fallback]
    fb_hops: list[Hop] = []
    for cell in dict.fromkeys(h.cell for h in hops):
        routed = cell == tenant.home_cell
        for backend_name in _candidates(view, fallback, cell):
            ref = by_name[backend_name]
            fb_hops.append(Hop(backend_name, ref.cell, ref.device_group, routed=routed))
    used = {h.backend for h in fb_hops}
    outside = tuple(n for n in (fallback.backends or tuple(view.backends)) if n in by_name and n not in used)
    classes = tuple(c for c in tenant.classes if c in route.fallback_classes)
    config_allows = tenant.allow_fallback and bool(classes)
    policy_allows, reason = _fallback_policy(
        served, name, tenant, model, route, fallback, tenant.home_cell, evidence=evidence
    )
    if not fb_hops:
        status = "never: no backend in the request's cell serves it (the gateway never crosses cells)"
    elif policy_allows:
        status = f"can serve ({reason})"
    elif config_allows:
        status = f"latent: configuration allows it, the policy keeps it closed ({reason})"
    else:
        why = "allow_fallback: false" if not tenant.allow_fallback else "no class in fallback_classes"
        status = f"never: {why}; policy: {reason}"
    return FallbackPath(
        model=route.fallback,
        backend_model=_own_backend_model(fallback, route.fallback, tenant),
        version=fallback.version,
        hops=tuple(fb_hops),
        outside_cell=outside,
        classes=classes,
        config_allows=config_allows,
        policy_allows=policy_allows,
        policy_reason=reason,
        in_allow_list=route.fallback in tenant.models,
        status=status,
    )


def _fallback_findings(
    findings: _Findings, name: str, tenant: TenantConfig, model: str, path: FallbackPath
) -> None:
    if not path.hops:
        findings.add(
            Severity.INFO,
            "fallback-outside-cell",
            name,
            f"{model}: fallback {path.model!r} has no backend in the cell where {model!r} runs"
            + (f" (only {', '.join(path.outside_cell)})" if path.outside_cell else "")
            + "; that path is unusable, never a cell escape",
        )
        return
    if path.policy_allows and not path.config_allows:
        why = "opted out (allow_fallback: false)" if not tenant.allow_fallback else "has no fallback class"
        findings.add(
            Severity.WARN,
            "fallback-policy-more-permissive",
            name,
            f"{model}: the tenant {why}, yet the policy admits fallback {path.model!r} "
            f"({path.policy_reason})",
        )
    if path.policy_allows and not path.in_allow_list:
        findings.add(
            Severity.WARN,
            "fallback-outside-allow-list",
            name,
            f"{model}: can be answered by fallback {path.model!r}, which is not in its models list",
        )
    if path.config_allows and not path.policy_allows:
        findings.add(
            Severity.INFO,
            "fallback-policy-gated",
            name,
            f"{model}: fallback {path.model!r} is allowed by configuration but closed by the policy "
            f"({path.policy_reason})",
        )


def _instances(
    accesses: Mapping[tuple[str, str], Mapping[str, _AccessBuilder]], by_name: Mapping[str, BackendRef]
) -> tuple[Instance, ...]:
    out = []
    for (backend, backend_model), per_tenant in sorted(accesses.items()):
        ref = by_name[backend]
        out.append(
            Instance(
                backend=backend,
                backend_model=backend_model,
                cell=ref.cell,
                device_group=ref.device_group,
                access=tuple(
                    Access(t, a.direct_active, a.fallback_active, a.latent, tuple(dict.fromkeys(a.via)))
                    for t, a in per_tenant.items()
                ),
            )
        )
    return tuple(out)


def _pair_level(a: Access, b: Access) -> ShareLevel:
    if a.direct_active and b.direct_active:
        return ShareLevel.INSTANCE
    if (a.direct_active or a.fallback_active) and (b.direct_active or b.fallback_active):
        return ShareLevel.FALLBACK
    return ShareLevel.LATENT


def _matrix(
    names: Sequence[str], instances: Sequence[Instance], tenant_backends: Mapping[str, set[str]]
) -> tuple[dict[str, dict[str, str]], dict[str, tuple[Share, ...]]]:
    pairs: dict[tuple[str, str], list[SharedInstance]] = {}
    for instance in instances:
        label = f"{instance.backend}/{instance.backend_model}"
        for a in instance.access:
            for b in instance.access:
                if a.tenant != b.tenant:
                    pairs.setdefault((a.tenant, b.tenant), []).append(
                        SharedInstance(label, _pair_level(a, b))
                    )
    matrix: dict[str, dict[str, str]] = {}
    shares: dict[str, tuple[Share, ...]] = {}
    for a_name in names:
        row: dict[str, str] = {}
        tenant_shares: list[Share] = []
        for b_name in names:
            if a_name == b_name:
                continue
            shared = sorted(pairs.get((a_name, b_name), []), key=lambda i: _LEVEL_ORDER.index(i.level))
            if not shared:
                common = sorted(tenant_backends[a_name] & tenant_backends[b_name])
                shared = [SharedInstance(backend, ShareLevel.BACKEND) for backend in common]
            level = shared[0].level if shared else ShareLevel.NONE
            row[b_name] = str(level)
            if shared:
                tenant_shares.append(Share(b_name, level, tuple(shared)))
        matrix[a_name] = row
        shares[a_name] = tuple(tenant_shares)
    return matrix, shares


def _sharing_findings(
    findings: _Findings, tenants: TenantsFile, shares: Mapping[str, tuple[Share, ...]]
) -> None:
    for name, tenant in tenants.tenants.items():
        if not tenant.dedicated:
            continue
        for share in shares[name]:
            what = share.describe()
            if share.level in (ShareLevel.INSTANCE, ShareLevel.FALLBACK):
                how = "directly" if share.level is ShareLevel.INSTANCE else "through a fallback path"
                findings.add(
                    Severity.SEVERE,
                    "dedicated-shares-instance",
                    name,
                    f"dedicated, but shares {what} with {share.tenant} {how}: their requests can be "
                    "batched on the same model instance",
                )
            elif share.level is ShareLevel.LATENT:
                findings.add(
                    Severity.WARN,
                    "dedicated-shares-instance-latent",
                    name,
                    f"dedicated; {share.tenant} can reach {what} through a path not taken today "
                    "(another entitled cell, or a fallback only the policy keeps closed)",
                )
            else:
                findings.add(
                    Severity.WARN,
                    "dedicated-shares-backend",
                    name,
                    f"dedicated; shares backend {what} (its Triton server and devices, other models) with "
                    f"{share.tenant}: device memory and host are not isolated there",
                )


def _credential_findings(findings: _Findings, served: Served) -> None:
    tenants = served.tenants.tenants
    admins = [name for name, t in tenants.items() if t.admin]
    if admins:
        findings.add(
            Severity.INFO,
            "admin-tenant",
            "",
            f"admin credentials: {', '.join(admins)} (RepositoryIndex lists every route; the other admin "
            "RPCs are refused by the gateway)",
        )
    demo = [name for name, t in tenants.items() if any(k in DEMO_KEY_DIGESTS for k in t.key_sha256)]
    if not demo:
        return
    tenants_file = Path(served.config.tenants_file)
    if "examples" in tenants_file.parts:
        findings.add(
            Severity.INFO,
            "demo-keys",
            "",
            f"the shipped demo tenants file (under examples/): the keys of {', '.join(demo)} are "
            "published in the README; never deploy it",
        )
    else:
        findings.add(
            Severity.SEVERE,
            "demo-keys",
            "",
            f"{tenants_file} configures the published demo keys for {', '.join(demo)}: anyone who read "
            "the README can authenticate as them",
        )


# --------------------------------------------------------------------------- rendering


def to_json(audit: Audit) -> dict[str, Any]:
    data = dataclasses.asdict(audit)
    if not audit.topology:  # a config without a topology: the audit's JSON as before
        del data["topology"]
    if not audit.prefix:  # no route with prefix affinity: no section
        del data["prefix"]
    for tenant in data["tenants"]:
        for reach in tenant["reach"]:
            if reach["prefix_affinity"] is None:
                del reach["prefix_affinity"]
    data["summary"] = {
        "severe": audit.count(Severity.SEVERE),
        "warn": audit.count(Severity.WARN),
        "info": audit.count(Severity.INFO),
        "exit_code": audit.exit_code,
    }
    return data


def render_json(audit: Audit) -> str:
    return json.dumps(to_json(audit), indent=2) + "\n"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _hops(hops: Iterable[Hop]) -> str:
    parts = [f"{h.backend} [{h.cell}/{h.device_group}]" + ("" if h.routed else " (latent)") for h in hops]
    return ", ".join(parts) if parts else "no backend"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        lines.append("  " + "  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    return lines


_TEXT_WIDTH = 100


def _wrap(first: str, text: str, indent: int) -> list[str]:
    """``first`` + ``text``, wrapped at ``_TEXT_WIDTH`` with continuation lines indented."""
    return textwrap.wrap(
        first + text,
        width=_TEXT_WIDTH,
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [first.rstrip()]


def _shown(path: str) -> str:
    """A path as people read it: relative to the working directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def _describe_check(check: EvidenceCheck) -> str:
    text = f"{_evidence_subject(check)}: {check.status}"
    if check.score is None:
        return text + f" (floor {check.floor})"
    facts = [
        f"score {check.score}, floor {check.floor}",
        check.source,
        f"evaluated {check.evaluated_at}" if check.evaluated_at else "undated",
        f"owner {check.owner}" if check.owner else "no owner",
        f"expires {check.expires_at}" if check.expires_at else "never expires",
    ]
    return text + f" ({'; '.join(facts)})"


def _devices(devices: Iterable[int]) -> str:
    return ", ".join(str(d) for d in devices) or "none"


def _render_topology(topologies: Sequence[TopologyAudit]) -> list[str]:
    """Per backend with a topology: its units per model, then per failure domain what its loss
    takes (units per model, stranded devices, devices of capacity left per pool)."""
    lines: list[str] = []
    for t in topologies:
        lines += ["", f"Topology of backend {t.backend} ({t.devices} devices; lost now: {_devices(t.lost)})"]
        for kind, names in t.domains.items():
            lines += _wrap(f"  {kind:<9} ", "; ".join(f"{n}: {_devices(ds)}" for n, ds in names.items()), 12)
        if t.links:
            lines += _wrap("  links     ", "; ".join(f"{n}: {_devices(ds)}" for n, ds in t.links.items()), 12)
        lines.append("  units")
        lines += _table(
            ("model", "layout", "units (devices)", "capacity"),
            [
                (
                    m.model,
                    f"TP {m.tensor_parallel} x {m.stages} stage{'s' if m.stages > 1 else ''}"
                    + ("" if m.declared else " (none declared)"),
                    "; ".join(f"{u.name.rsplit('/', 1)[-1]} [{_devices(u.devices)}]" for u in m.units),
                    f"{m.capacity_devices} devices",
                )
                for m in t.models
            ],
        )
        lines.append("  failure domains (what one loss takes; capacity left: devices of the units left)")
        for loss in t.losses:
            lines.append(
                f"    {loss.kind} {loss.name} (devices {_devices(loss.devices)}): "
                f"stranded {_devices(loss.stranded)}"
            )
            lines += _table(
                ("      model", "units lost", "units left", "capacity left"),
                [
                    (
                        f"      {m.model}",
                        ", ".join(u.rsplit("/", 1)[-1] for u in loss.units_lost.get(m.model, ())) or "none",
                        f"{loss.units_left.get(m.model, 0)} of {len(m.units)}",
                        f"{loss.capacity_left.get(m.model, 0)} of {m.capacity_devices} devices",
                    )
                    for m in t.models
                ],
            )
    return lines


def _render_prefix(routes: Sequence[PrefixScopeAudit]) -> list[str]:
    """Per route with prefix affinity: each tenant's cache scopes (docs/security.md "Prefix
    caches": a scope is never shared, so an identical prompt is no cross-tenant timing oracle)."""
    if not routes:
        return []
    lines = ["", "Prefix caches (scope = tenant | cell | backend model @ version; never shared)"]
    for route in routes:
        lines.append(f"  {route.route} (affinity within {route.max_extra_wait_ms:g} ms of the least wait)")
        for tenant, scopes in route.scopes.items():
            lines += _wrap(f"    {tenant:<10} ", ", ".join(scopes), 15)
    return lines


def render_text(audit: Audit) -> str:
    lines = [
        "orchid-gateway isolation audit",
        f"  config    {_shown(audit.config)}",
        f"  tenants   {_shown(audit.tenants_file)}",
        f"  routes    {_shown(audit.routes_dir)}",
        f"  policy    {_shown(audit.policies_dir)}: "
        + (f"{audit.policy_label} ({audit.policy_version})" if audit.policy_label else audit.policy_version)
        + f", engine {audit.policy_engine}",
        "",
        "Backends",
        *_table(
            ("name", "cell", "device_group", "from"),
            [(b.name, b.cell, b.device_group, b.source) for b in audit.backends],
        ),
        "",
        f"Quality evidence (the route files' seeded evidence, judged at {audit.evidence_at})",
    ]
    if not audit.evidence:
        lines.append("  no route has a fallback or a reduced output")
    for route_evidence in audit.evidence:
        lines.append(f"  {route_evidence.route}")
        for check in route_evidence.checks:
            lines += _wrap(f"    {check.degradation:<15} ", _describe_check(check), 20)
    for tenant in audit.tenants:
        flags = [
            f"dedicated: {_yes(tenant.dedicated)}",
            f"admin: {_yes(tenant.admin)}",
            f"allow_fallback: {_yes(tenant.allow_fallback)}",
            f"max_output_tokens: {tenant.max_output_tokens}",
        ]
        if tenant.demo_key:
            flags.append("DEMO KEY")
        lines += [
            "",
            f"Tenant {tenant.name}",
            f"  cells     {', '.join(tenant.cells)} (home: {tenant.home_cell})",
            f"  classes   {', '.join(tenant.classes) or '-'}",
            f"  flags     {'  '.join(flags)}",
            "  reaches",
        ]
        for reach in tenant.reach:
            version = f" v{reach.version}" if reach.version else ""
            stream = " (streaming)" if reach.streaming else ""
            lines.append(
                f"    {reach.model} -> {reach.backend_model}{version}{stream} on {_hops(reach.hops)}"
            )
            fb = reach.fallback
            if fb is not None:
                fb_version = f" v{fb.version}" if fb.version else ""
                lines.append(
                    f"      fallback {fb.model} -> {fb.backend_model}{fb_version} on {_hops(fb.hops)}"
                )
                lines += _wrap("        ", fb.status, 10)
        if not tenant.reach:
            lines.append("    nothing")
        if tenant.shares:
            lines.append("  shares")
            for share in tenant.shares:
                lines += _wrap(f"    {share.tenant}: ", f"{share.level} ({share.describe()})", 6)
        else:
            lines.append("  shares    nothing with any other tenant")
        lines.append("  policy rules (* names this tenant, ? depends on tenant identity)")
        for stage, refs in tenant.rules.items():
            if not refs:
                continue
            ids = ", ".join(
                r.id
                + {"names-tenant": "*", "tenant-specific": "?"}.get(r.scope, "")
                + (" (shadow)" if r.mode == "shadow" else "")
                for r in refs
            )
            lines += _wrap(f"    {stage:<10} ", ids, 15)
        if tenant.degradable:
            lines.append(f"  risk classes degraded (minimum {tenant.risk_class}; probed per class)")
            for deg in tenant.degradable:
                parts = [
                    f"fallback: {', '.join(deg.fallback) or 'none'}",
                    f"reduced output: {', '.join(deg.reduced_output) or 'none'}",
                    f"never: {', '.join(deg.never) or 'none'}",
                ]
                lines += _wrap(f"    {deg.model}  ", "; ".join(parts), 6)
        lines.append("  probes")
        lines += _wrap("    cell entitlement  ", tenant.probes.cell_entitlement, 22)
        lines += _wrap("    backend cell      ", tenant.probes.backend_cell, 22)

    lines += _render_topology(audit.topology)
    lines += _render_prefix(audit.prefix)

    names = [t.name for t in audit.tenants]
    lines += ["", "Co-batching matrix (can two tenants' requests meet on one Triton model instance?)"]
    rows = [[a, *("·" if a == b else audit.matrix[a][b] for b in names)] for a in names]
    lines += _table(["", *names], rows)
    lines += [
        "  instance: same (backend, model) on paths routed today   fallback: the same, via a fallback path",
        "  latent: same instance via a path not taken today        backend: same Triton server, other models",
        "  -: nothing shared",
        "",
        "Shared instances (backend/model: tenants and how they get there)",
    ]
    for instance in audit.instances:
        who = "; ".join(f"{a.tenant} ({' + '.join(a.via)})" for a in instance.access)
        lines += _wrap(f"  {instance.backend}/{instance.backend_model} [{instance.cell}]: ", who, 4)

    lines += ["", "Findings"]
    if not audit.findings:
        lines.append("  none")
    for finding in audit.findings:
        subject = f"{finding.tenant}: " if finding.tenant else ""
        lines += _wrap(f"  {finding.severity.upper():<6} {finding.code}  ", subject + finding.message, 9)
    severe, warn, info = (audit.count(s) for s in (Severity.SEVERE, Severity.WARN, Severity.INFO))
    lines += ["", f"{severe} severe, {warn} warnings, {info} info: exit {audit.exit_code}"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, type=Path, help="gateway YAML (e.g. examples/orchid/gateway.yaml)"
    )
    parser.add_argument("--json", action="store_true", help="emit the audit as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the audit. 0: no severe finding; 1: severe findings; 2: a file does not load."""
    try:
        audit = audit_isolation(args.config)
    except PolicyLoadError as exc:
        print(f"{PROG}: the policy set does not load:\n{render_all(exc.diagnostics)}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"{PROG}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_json(audit) if args.json else render_text(audit))
    return audit.exit_code
