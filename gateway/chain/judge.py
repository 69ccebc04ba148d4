"""Stage 5, judge: policy's verdict on each candidate, all from one policy snapshot.

Owns the policy context a request is judged in (what this gateway observes: fallback
warmth, the pool's live load, quota, configured backends, quality evidence, put into
policy's terms by the one builder, ``gateway.policy.context``) and the evaluation of
every candidate a request has (its primary, a shed re-evaluation, its fallback) against
the one ``PolicySnapshot`` the request took when it started: a reload in between never
judges two candidates of one request by different policy versions.

It may read pools' load, quota views, evidence and configuration; it may not reserve,
place or decide.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec

from gateway.auth import Tenant
from gateway.config import RouteConfig, RouteTable
from gateway.core.admission import Candidate
from gateway.core.evidence import RouteEvidence
from gateway.core.load import PoolLoad
from gateway.core.quota import QuotaView
from gateway.core.record import RequestRecord
from gateway.exchange import BackendHandle
from gateway.policy.context import build_policy_context, build_route_facts
from gateway.policy.schema import BackendFacts, LoadFacts, PolicyContext, RouteFacts
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.store import PolicyStore
from gateway.pools import PoolRegistry


@dataclass(frozen=True, slots=True)
class ConfiguredRoute:
    """A route's policy facts that depend on configuration alone (``Judge.route_facts``)."""

    route: RouteConfig  # held, so the id keying it cannot be reused while the entry lives
    fallback: RouteConfig | None
    fallback_handles: tuple[BackendHandle, ...]  # the fallback's backends in the cell, in order
    backends: tuple[BackendFacts, ...]
    generation: int = 0  # the pool registry's generation it was derived in
    # The policy context's route part by (fallback warm, its cell, id of the evidence verdicts):
    # the verdicts held beside it (the store hands out one object until a publication or expiry).
    plans: dict[tuple[bool, str, int], tuple[RouteEvidence | None, RouteFacts]] = dataclasses.field(
        default_factory=dict
    )


MAX_ROUTE_FACTS = 1024
MAX_ROUTE_PLANS = 16  # per route and cell: warm or not, times the verdicts in force


class Judge:
    """Policy contexts and verdicts for one request's candidates."""

    def __init__(self, policy: PolicyStore, routes: RouteTable, pools: PoolRegistry) -> None:
        self.policy = policy
        self.routes = routes
        self.pools = pools
        self._route_facts: dict[tuple[int, str], ConfiguredRoute] = {}

    def snapshot(self) -> PolicySnapshot:
        """The policy version a request is judged by, taken once per request."""
        return self.policy.current()

    def judge(self, record: RequestRecord, context: PolicyContext, snapshot: PolicySnapshot) -> Candidate:
        return Candidate(record, self.policy.evaluate(record, context, snapshot))

    def context(
        self,
        tenant: Tenant,
        route: RouteConfig,
        cell: str,
        load: PoolLoad,
        quota: QuotaView,
        *,
        shed: bool = False,
        reduce_output: bool = False,
        evidence: RouteEvidence | None = None,
    ) -> PolicyContext:
        """What this gateway observes, in policy's terms (the one builder)."""
        facts = self.route_facts(route, cell)
        fallback = facts.fallback
        fallback_warm = False
        fallback_cell = ""
        if fallback is not None:
            for handle in facts.fallback_handles:
                if handle.client.is_warm(fallback.backend_model):
                    fallback_warm, fallback_cell = True, handle.labels.get("cell", "")
                    break
        plan_key = (fallback_warm, fallback_cell, id(evidence))
        planned = facts.plans.get(plan_key)
        if planned is None or planned[0] is not evidence:
            if len(facts.plans) >= MAX_ROUTE_PLANS:
                facts.plans.clear()
            planned = (
                evidence,
                build_route_facts(
                    route,
                    fallback,
                    fallback_warm=fallback_warm,
                    fallback_cell=fallback_cell,
                    evidence=evidence,
                ),
            )
            facts.plans[plan_key] = planned
        return build_policy_context(
            tenant.name,
            tenant.config,
            route,
            fallback,
            fallback_warm=fallback_warm,
            fallback_cell=fallback_cell,
            load=load_facts(load, shed=shed, reduce_output=reduce_output),
            quota=quota,
            backends=facts.backends,
            evidence=evidence,
            route_facts=planned[1],
        )

    @staticmethod
    def shed(context: PolicyContext) -> PolicyContext:
        """The same context with the request marked as part of its flow's shed excess."""
        return msgspec.structs.replace(context, load=msgspec.structs.replace(context.load, shed=True))

    @staticmethod
    def on_pool(context: PolicyContext, load: PoolLoad, *, shed: bool) -> PolicyContext:
        """The same context judged on another pool's load (the fallback's own)."""
        return msgspec.structs.replace(context, load=load_facts(load, shed=shed, reduce_output=False))

    def route_facts(self, route: RouteConfig, cell: str) -> ConfiguredRoute:
        """What ``context`` reads from configuration alone for ``route`` in ``cell``, derived
        once per generation (``PoolRegistry.generation``: a policy reload, an evidence
        publication, a health flip or a rollout step starts a new one; a rollout's or a
        dedicated tenant's route is another ``RouteConfig`` object, with its own entry)."""
        key = (id(route), cell)
        facts = self._route_facts.get(key)
        generation = self.pools.generation.value
        if facts is None or facts.route is not route or facts.generation != generation:
            fallback = self.routes.models.get(route.fallback) if route.fallback else None
            backends = self.pools.backends
            facts = ConfiguredRoute(
                route=route,
                fallback=fallback,
                fallback_handles=tuple(
                    backends[name] for name in self.pools.candidate_backends(fallback, cell)
                )
                if fallback is not None
                else (),
                # Routing-stage rules judge every backend configured for the route, in any cell.
                backends=tuple(
                    BackendFacts(name=name, model=route.backend_model, labels=backends[name].labels)
                    for name in (route.backends or tuple(backends))
                    if name in backends
                ),
                generation=generation,
            )
            if len(self._route_facts) >= MAX_ROUTE_FACTS:
                self._route_facts.clear()  # bounded: rollouts' candidate routes come and go
            self._route_facts[key] = facts
        return facts

    def cached_route_facts(self) -> int:
        return len(self._route_facts)


def load_facts(load: PoolLoad, *, shed: bool, reduce_output: bool) -> LoadFacts:
    return LoadFacts(
        utilization=load.utilization(), drain_ms=load.drain_ms(), shed=shed, reduce_output=reduce_output
    )
