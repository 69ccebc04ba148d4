"""Stage 2, place: which pool a request runs in (filter, score, pick).

Owns choosing the pool: the route's healthy backends in the request's privacy cell,
less any a policy routing rule excluded (a filter, so an allowed backend in the same
cell is tried rather than the request refused), ranked by ``gateway.core.placement``
through the pool registry, or by the prompt's expected prefix-cache hit inside the
route's load bound (``gateway.core.prefix``: scoped by tenant, cell and model
version); a rollout's candidate pool when the rollout diverts the request; and the
route's warm fallback pool (never one that must cold-load).

It may read pools and the rollout controller; it may not reserve anything, judge
policy or touch quota.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from gateway.backends.base import ModelSpec
from gateway.chain.resolve import Resolved
from gateway.config import RouteConfig
from gateway.core.prefix import PrefixMatch
from gateway.core.record import RequestRecord, Shape
from gateway.exchange import BackendHandle
from gateway.pools import Pool, PoolRegistry
from gateway.rollouts import Diverted, RolloutController
from gateway.scheduler import DispatchQueue


class Placement(msgspec.Struct, frozen=True):
    """A route bound to one pool."""

    route: RouteConfig
    handle: BackendHandle
    spec: ModelSpec
    queue: DispatchQueue
    # The request's prompt on this pool's prefix cache (None: the model declares no cache, or
    # this is not the request's primary placement): pricing takes its hit off the prefill.
    prefix: PrefixMatch | None = None


class Place:
    """Pools for a resolved request: its primary, a rollout's candidate, its warm fallback."""

    def __init__(self, pools: PoolRegistry, rollouts: RolloutController) -> None:
        self.pools = pools
        self.rollouts = rollouts

    async def primary(self, resolved: Resolved, *, exclude: Iterable[str] = ()) -> Placement:
        """The request's primary pool: by load, or by its prompt's expected prefix-cache hit
        within the route's load bound (``PoolRegistry.place_prompt``)."""
        return await self._prompt(resolved.route, resolved, exclude)

    async def again(self, placement: Placement, resolved: Resolved, exclude: Iterable[str]) -> Placement:
        """``placement``'s route placed again without the excluded backends (the filter)."""
        return await self._prompt(placement.route, resolved, exclude)

    async def _prompt(self, route: RouteConfig, resolved: Resolved, exclude: Iterable[str]) -> Placement:
        (handle, spec, queue), prefix = await self.pools.place_prompt(
            route,
            resolved.cell,
            resolved.logical,
            resolved.request,
            resolved.identity.tenant,
            exclude=exclude,
        )
        return Placement(route, handle, spec, queue, prefix)

    async def rollout(
        self,
        resolved: Resolved,
        current: Placement,
        shape: Shape,
        price: Callable[[RouteConfig, BackendHandle, DispatchQueue], RequestRecord],
    ) -> tuple[Placement, Diverted] | None:
        """The candidate's pool when a rollout serves this request from it (a canary, or
        promoted); ``price`` prices the request on a pool for the canary's hedge budget."""
        diverted = await self.rollouts.divert(
            resolved.logical,
            resolved.route,
            resolved.tenant,
            request_class=resolved.identity.request_class,
            shape=shape,
            risk_class=resolved.identity.risk_class,
            cell=resolved.cell,
            mode=resolved.mode,
            canary=resolved.canary and resolved.late is None,
            current_pool=(current.handle, current.queue),
            price=price,
        )
        if diverted is None:
            return None
        return Placement(diverted.route, diverted.handle, current.spec, diverted.queue), diverted

    async def fallback_pools(
        self, route: RouteConfig, resolved: Resolved, *, exclude: Iterable[str] = ()
    ) -> list[Pool] | None:
        """The fallback route's healthy pools in the request's cell (None: none): ranked and
        picked by ``fallback`` only for a request that takes the fallback pass (the ranking
        predicts every candidate pool's wait: on a large fleet the costliest part of it)."""
        return await self.pools.healthy(route, resolved.cell, resolved.logical, exclude=exclude)

    def fallback(self, route: RouteConfig, pools: list[Pool]) -> Placement | None:
        """The fallback route's pool among ``fallback_pools``', only if warm right now."""
        pool = self.pools.warm_pick(route, pools)
        if pool is None:
            return None
        handle, spec, queue = pool
        return Placement(route, handle, spec, queue)
