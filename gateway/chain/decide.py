"""Stage 6, decide: admit, fall back, or refuse, by the pure ``gateway.core.admission``.

Owns assembling what the pure decision reads (the ladder's effects for the pool, its
retry-after, the batch classes, whether this request is part of the share the ladder
diverts, the fallback's limits and why it cannot take the request) and applying what
the core says around the decision: the reduced output is priced as what will run, and
``isolation: dedicated`` is enforced (``admission.isolation_refusal``). A refusal leaves
as the ``GatewayError`` the decision's status maps to, with its rule and retry-after.

It may read configuration; it may not reserve, place or evaluate policy itself.
"""

from __future__ import annotations

from gateway.config import GatewayConfig, RouteConfig
from gateway.core import admission
from gateway.core.errors import PermissionDenied, error_for_status
from gateway.core.load import PoolLoad
from gateway.core.overload import LadderEffects
from gateway.core.record import Decision, Verdict
from gateway.policy.snapshot import PolicyResult

MAX_FALLBACK_LIMITS = 256  # cached fallback limits (route x fallback name); cleared when full


class Decide:
    """Decisions of the pure core, applied."""

    def __init__(self, config: GatewayConfig) -> None:
        self.batch_classes = frozenset(config.batch_classes)
        # A fallback route's limits depend on its configuration alone: built once per route
        # object (held, so its id cannot be reused while the entry lives).
        self._fallback_limits: dict[tuple[int, str], tuple[RouteConfig, admission.FallbackLimits]] = {}

    def fallback_limits(self, route: RouteConfig, name: str) -> admission.FallbackLimits:
        """The limits the fallback ``name`` (its route ``route``) takes a request within."""
        key = (id(route), name)
        held = self._fallback_limits.get(key)
        if held is not None and held[0] is route:
            return held[1]
        limits = admission.FallbackLimits(
            model=name,
            max_input_tokens=route.shape.max_input_tokens,
            max_output_tokens=route.shape.max_output_tokens,
            max_items=route.shape.max_items,
        )
        if len(self._fallback_limits) >= MAX_FALLBACK_LIMITS:
            self._fallback_limits.clear()
        self._fallback_limits[key] = (route, limits)
        return limits

    def run(
        self,
        primary: admission.Candidate,
        fallback: admission.Candidate | None,
        *,
        load: PoolLoad,
        effects: LadderEffects,
        divert: bool,
        fallback_route: RouteConfig | None,
        fallback_name: str | None,
        fallback_refused: str,
    ) -> Decision:
        return admission.decide(
            primary,
            fallback,
            admission.AdmissionContext(
                effects=effects,
                retry_after_ms=load.retry_after_ms(),
                batch_classes=self.batch_classes,
                divert=divert,
                fallback_limits=self.fallback_limits(fallback_route, fallback_name)
                if fallback_route is not None and fallback_name
                else None,
                fallback_refused=fallback_refused,
            ),
        )

    @staticmethod
    def refuse(decision: Decision) -> None:
        """Raise the refusal a REJECT decision is (nothing for any other verdict)."""
        if decision.verdict is not Verdict.REJECT:
            return
        error_type = error_for_status(decision.status)
        rule = decision.rules[0] if decision.rules else None
        raise error_type(decision.message, rule=rule, retry_after_ms=decision.retry_after_ms)

    @staticmethod
    def isolate(chosen: PolicyResult, backend_model: str, dedicated: frozenset[str], logical: str) -> None:
        """``isolation: dedicated``: the chosen candidate runs on a model reserved for its tenant."""
        why = admission.isolation_refusal(chosen, backend_model, dedicated)
        if why:
            raise PermissionDenied(why.format(model=logical), rule=admission.ISOLATION_RULE)
