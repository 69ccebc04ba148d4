"""The one builder of ``PolicyContext``: configuration and live facts in, policy's view out.

Policy reads tenant, route, load and backend facts that are not on the request record
(``gateway.policy.schema``). Three callers need them: the request path
(``gateway.chain.judge.Judge.context``), the isolation audit's probes (``orchid_tools.audit``) and
the policy test suites and request files (``gateway.policy.suites``). All three call
``build_policy_context``, so what a fact means is derived here once:

* **entitlement**: ``tenant.allowed_models`` is the tenant's configured ``models``, the
  whole entitlement (``gateway.core.entitlement``; policy reads the answer as
  ``tenant.entitled``);
* **quality floor**: the route's own ``quality_floor``; a route without one takes its
  fallback's (the floor the population's answers must meet); neither: 1.0, which no
  evidence clears, so an unproven fallback or output cap is never taken;
* **quality evidence**: the verdicts (``gateway.core.evidence``) on the fallback's and the
  capped output's latest evidence, from the live store (``gateway.evidence``) when the
  caller passes them, else judged on the scores the route files declare (no dates: the
  suites and the audit's probes have no clock). ``route.quality.fallback_score`` and
  ``reduced_output_score`` are that evidence's scores, 0.0 when missing or expired;
  ``*_evidence`` the verdict (valid, missing, expired, below_floor); the reduced-output
  length from the route's ``reduced_output`` (0: none);
* **quota**: what the ledger would grant now, borrowing included (its balance plus what it
  may borrow from idle share); no quota view means unmetered (infinite, rate 0), the
  ledger's own answer for an account without a bucket.

Facts the caller observes (warmth and cell of the fallback, load, candidate backends) come
in as arguments: this module reads no clock, network or backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.config import QualityEvidence as QualityConfig
from gateway.config import RouteConfig, TenantConfig
from gateway.core.evidence import Evidence, EvidenceKey, RouteEvidence, judge
from gateway.core.quota import QuotaView
from gateway.policy.schema import (
    BackendFacts,
    LoadFacts,
    PolicyContext,
    QualityEvidence,
    RouteFacts,
    TenantFacts,
)

NO_EVIDENCE_FLOOR = 1.0  # no floor declared: nothing short of perfect evidence clears it


def quality_floor(route: RouteConfig, fallback: RouteConfig | None) -> float:
    """The floor quality evidence must meet on ``route`` (see the module docstring)."""
    if route.quality_floor is not None:
        return route.quality_floor
    if fallback is not None and fallback.quality_floor is not None:
        return fallback.quality_floor
    return NO_EVIDENCE_FLOOR


def declared_evidence(route: RouteConfig, fallback: RouteConfig | None) -> RouteEvidence:
    """The verdicts on the scores the route files declare, dates aside (no clock here): the
    view of a caller without the live store (the policy suites, the audit's probes)."""
    floor = quality_floor(route, fallback)

    def verdict(quality: QualityConfig | None, cap: int) -> Evidence | None:
        if quality is None:
            return None
        key = EvidenceKey(route.backend_model, route.version, quality.population, cap)
        return Evidence(key=key, score=quality.score, sample_size=0, owner="", source="seeded")

    reduced = route.reduced_output
    return RouteEvidence(
        fallback=judge(verdict(fallback.quality, 0) if fallback else None, floor=floor, now=0.0),
        reduced_output=judge(
            verdict(reduced.quality, reduced.max_output_tokens) if reduced else None, floor=floor, now=0.0
        ),
    )


def build_route_facts(
    route: RouteConfig,
    fallback: RouteConfig | None,
    *,
    fallback_warm: bool,
    fallback_cell: str,
    evidence: RouteEvidence | None = None,
) -> RouteFacts:
    """The route's part of the policy context: configuration, the fallback's observed warmth
    and cell, and the quality evidence. It reads nothing of one request, so a caller may
    derive it once per generation (``gateway.chain.judge``)."""
    reduced = route.reduced_output
    verdicts = evidence if evidence is not None else declared_evidence(route, fallback)
    return RouteFacts(
        model=route.backend_model,
        fallback_model=route.fallback or "",
        fallback_classes=route.fallback_classes,
        fallback_warm=fallback_warm,
        fallback_cell=fallback_cell,
        quality=QualityEvidence(
            score=route.quality.score if route.quality else 0.0,
            fallback_score=verdicts.fallback.score if fallback is not None else 0.0,
            floor=quality_floor(route, fallback),
            population=route.quality.population if route.quality else "",
            reduced_output_score=verdicts.reduced_output.score if reduced else 0.0,
            fallback_evidence=str(verdicts.fallback.status),
            reduced_output_evidence=str(verdicts.reduced_output.status),
        ),
        reduced_output_tokens=reduced.max_output_tokens if reduced else 0,
    )


def build_policy_context(
    tenant_name: str,
    tenant: TenantConfig,
    route: RouteConfig,
    fallback: RouteConfig | None,
    *,
    fallback_warm: bool,
    fallback_cell: str,
    load: LoadFacts,
    quota: QuotaView | None,
    backends: Sequence[BackendFacts] = (),
    evidence: RouteEvidence | None = None,
    route_facts: RouteFacts | None = None,
) -> PolicyContext:
    """Policy's view of one request's tenant, route, load and candidate backends.

    ``route`` is the route as this tenant runs it (a dedicated tenant's copy), ``fallback``
    the route its ``fallback`` names (``None``: none); ``fallback_warm``/``fallback_cell``
    what the caller observed of the fallback's pool; ``quota`` the ledger's view of the
    tenant's account for the request's class (``None``: unmetered); ``evidence`` the live
    store's verdicts (``None``: ``declared_evidence``). ``route_facts``: what
    ``build_route_facts`` answered for the same route, fallback, observations and evidence
    (a caller's plan, derived once per generation); ``None``: derived here."""
    return PolicyContext(
        tenant=TenantFacts(
            name=tenant_name,
            allowed_cells=tenant.cells,
            allowed_classes=tenant.classes,
            allowed_models=tenant.models,
            dedicated=tenant.dedicated,
            weight=tenant.weight,
            allow_fallback=tenant.allow_fallback,
            max_output_tokens=tenant.max_output_tokens,
            accelerator_ms_per_s=quota.refill_ms_per_s if quota is not None else 0.0,
            # The ledger's own answer, borrowing included: policy must not refuse what the
            # ledger would lend (a tenant over its own rate borrows its idle neighbours'
            # share, within the borrowing bound).
            available_accelerator_ms=(
                quota.available_accelerator_ms + quota.borrowable_ms if quota is not None else math.inf
            ),
        ),
        route=route_facts
        if route_facts is not None
        else build_route_facts(
            route, fallback, fallback_warm=fallback_warm, fallback_cell=fallback_cell, evidence=evidence
        ),
        load=load,
        backends=tuple(backends),
    )


__all__ = [
    "NO_EVIDENCE_FLOOR",
    "build_policy_context",
    "build_route_facts",
    "declared_evidence",
    "quality_floor",
]
