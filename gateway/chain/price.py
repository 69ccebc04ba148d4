"""Stage 4, price: a request's record as it would run in one pool.

Owns turning (identity, route, shape, pool) into a ``RequestRecord``: predicted
accelerator-ms by phase, memory, the budget and its slack, through the pure
``gateway.core.pricing`` with the estimator's correction and the pool's predicted wait.
A request may be priced on several pools (its primary, a canary's candidate, its
fallback, its reduced output); each price is a value, nothing is reserved.

It may read the estimator, the route profiles and a queue's predicted wait; it may not
reserve, judge or decide.
"""

from __future__ import annotations

import msgspec

from gateway.auth import TenantDirectory
from gateway.chain.place import Placement
from gateway.chain.resolve import Resolved
from gateway.config import RouteTable
from gateway.core import pricing
from gateway.core.estimate import CorrectionKey, Estimator
from gateway.core.record import Identity, RequestRecord, Shape


class Priced(msgspec.Struct, frozen=True):
    """A request's record on one placement, with the estimator key its work teaches."""

    record: RequestRecord
    placement: Placement
    correction_key: CorrectionKey


class Price:
    """Prices a resolved request on a placement."""

    def __init__(self, routes: RouteTable, tenants: TenantDirectory, estimator: Estimator) -> None:
        self.routes = routes
        self.tenants = tenants
        self.estimator = estimator

    def run(
        self,
        resolved: Resolved,
        placement: Placement,
        shape: Shape,
        *,
        ladder_step: int,
        now: float,
        identity: Identity | None = None,
    ) -> Priced:
        route = placement.route
        tenant = self.tenants.tenants.get(resolved.identity.tenant)
        request_class = resolved.request_class
        objectives = resolved.objectives  # a stream is judged by its first result
        record, correction_key = pricing.price(
            identity or resolved.identity,
            shape,
            profile=self.routes.profiles[route.profile],
            backend_model=route.backend_model,
            version=route.version,
            time_scale=placement.handle.time_scale,
            estimator=self.estimator,
            queue=placement.queue,
            reserves=pricing.Reserves(
                deadline_ms=resolved.deadline_ms,
                upstream_ms=request_class.reserve_upstream_ms
                if resolved.upstream_reserve_ms is None
                else resolved.upstream_reserve_ms,
                fail_ms=request_class.reserve_fail_ms,
                first_result_ms=objectives.first_result_ms if objectives is not None else None,
                gap_ms=objectives.gap_ms if objectives is not None else None,
            ),
            weight=tenant.config.weight if tenant is not None else 1.0,
            received_at=resolved.call.received_at,
            ladder_step=ladder_step,
            now=now,
            cached_tokens=_cached_tokens(placement, shape),
        )
        return Priced(record, placement, correction_key)


def _cached_tokens(placement: Placement, shape: Shape) -> int:
    """The prompt tokens the placement's prefix cache is expected to serve (only the primary
    placement has a match; a request of several items is priced without: the match is its
    first row's)."""
    prefix = placement.prefix
    if prefix is None or shape.items != 1:
        return 0
    return min(prefix.priced_tokens, max(0, shape.input_tokens - 1))
