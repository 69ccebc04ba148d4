"""The fleet-wide overload ladder's evidence: offered demand exchanged through Redis.

Owns the exchange that lets every replica's ladder decide on the *fleet's* offered demand.
Every ``interval_s`` (the ladder's update interval) each replica, in one round trip,
publishes the admissible samples its pools were offered since the last exchange
(``PoolLoad.offers``: time, flow, accelerator-ms) to one Redis stream and reads the other
replicas' samples, which it adds to the same pools' and flows' windows
(``PoolLoad.add_remote_offer``). Each replica's ladder and per-flow plan then read the
fleet's sum, against the pool's whole capacity (the replicas share the backends), with at
most about two intervals of delay; the same evidence gives the same step.

Times travel on Redis's clock: each exchange reads ``TIME`` and keeps this replica's offset
to it, so replicas' clocks need not agree. Staleness bound: when no exchange has succeeded
for ``stale_after_s`` (the lease TTL) — Redis unreachable, or the replica degraded — each
pool plans for ``1/N`` of its capacity (``PoolLoad.capacity_share``, N from the last
membership) against its own demand only, which is each replica's fair part of the fleet's
envelope; the first successful exchange restores the fleet view.

The same round trip reads the fleet's bound work: the predicted end of every dispatch slot
lease the other replicas hold on each pool (``gateway.state.device_leases``), handed to the
pool's devices (``DeviceSet.remote_ends``, on this replica's clock). Admission's predicted
wait then counts the work really ahead on the shared backend, as one replica's would: without
it, a replica predicts from its own share of the bound work, admits to the primary requests
that then wait for a fleet slot past their latest start, and ends up degrading far more of a
surge than a single replica does (``tests/test_replicas_surge.py``). The view is at most one
interval old; a lease whose predicted end has passed counts as finished. Stale (no exchange
for ``stale_after_s``), the remote work is forgotten with the rest of the fleet view.

What is not exchanged: queue dwell, admitted work (relief) and backend saturation stay
each replica's own evidence (its queue, its requests); a flow's relief, which the plan
subtracts from the fleet's excess, is scaled to the fleet by the flow's offered demand over
this replica's (``FlowLoad.relief``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Final

from gateway import clock
from gateway.core.dispatch import DispatchQueue
from gateway.core.load import PoolLoad
from gateway.state.redis_store import REDIS_FAILURES, RedisFleet

if TYPE_CHECKING:
    from gateway.pipeline import Gateway

__all__ = ["FleetLoad"]

log = logging.getLogger("orchid.state")

_STREAM_MAXLEN: Final = 5000  # entries kept (approximate trim): many seconds of a fleet's exchanges


class FleetLoad:
    """Publishes this replica's offered demand and adds the others' to its pools."""

    def __init__(self, gateway: Gateway, fleet: RedisFleet) -> None:
        self.gateway = gateway
        self.fleet = fleet
        self.stream = f"{fleet.config.key_prefix}load"
        self.stale_after_s = fleet.ttl_s
        self.offset_s: float | None = None  # Redis clock minus this replica's clock
        self.last_id: str | None = None
        self.fresh_at: float | None = None
        self.received = 0  # remote samples added (for tests and the status of the exchange)

    @property
    def stale(self) -> bool:
        return self.fresh_at is None or clock.now() - self.fresh_at > self.stale_after_s

    def _attach(self) -> dict[str, PoolLoad]:
        loads = dict(self.gateway.loads)
        for load in loads.values():
            if load.offers is None:
                load.offers = []
        return loads

    async def exchange(self) -> bool:
        """One exchange; False when Redis did not answer (the pools then plan for 1/N)."""
        loads = self._attach()
        batch: dict[str, list[list[Any]]] = {}
        for name, load in loads.items():
            offers, load.offers = load.offers or [], []
            if offers and self.offset_s is not None:
                batch[name] = [[t + self.offset_s, key[0], key[1], ms] for t, key, ms in offers]
        ok = False
        if not self.fleet.degraded:
            before = clock.now()
            pipe = self.fleet.client.pipeline(transaction=False)
            pipe.time()
            if batch:
                pipe.xadd(
                    self.stream,
                    {"r": self.fleet.replica_id, "d": json.dumps(batch, separators=(",", ":"))},
                    maxlen=_STREAM_MAXLEN,
                    approximate=True,
                )
            if self.last_id is not None:
                pipe.xread({self.stream: self.last_id}, count=10000)
            pools = self._pools()
            for name in pools:
                pipe.hgetall(self._ends_key(name))
            try:
                answers = await self.fleet.call(pipe.execute())
            except REDIS_FAILURES:  # the fleet marked itself degraded; these samples are lost to the others
                answers = None
            if answers is not None:
                after = clock.now()
                seconds, micros = answers[0]
                redis_now = seconds + micros / 1e6
                self.offset_s = redis_now - (before + after) / 2.0
                bound = answers[len(answers) - len(pools) :]
                if self.last_id is None:
                    self.last_id = f"{int(redis_now * 1000)}-0"
                else:
                    self._add_remote(answers[-1 - len(pools)], loads)
                self._set_remote_bound(pools, bound)
                self.fresh_at = after
                ok = True
        stale = self.stale
        share = 1.0 / self.fleet.size if stale else 1.0
        for load in loads.values():
            load.capacity_share = share
        if stale:
            for queue in self._pools().values():
                queue.device_set.remote_ends.pop(queue.name, None)
        return ok

    def _pools(self) -> dict[str, DispatchQueue]:
        """This replica's dispatch queues by pool name (the pools it has served)."""
        names = {name: self.gateway.queue_named(name) for name in self.gateway.loads}
        return {name: queue for name, queue in names.items() if queue is not None}

    def _ends_key(self, pool: str) -> str:
        # The hash of predicted ends kept beside the slot leases (``device_leases.FleetSlots``).
        return f"{self.fleet.config.key_prefix}{{slots:{pool}}}:ends"

    def _set_remote_bound(self, pools: dict[str, DispatchQueue], answers: list[Any]) -> None:
        """The other replicas' leases' predicted ends, per pool, onto the pool's devices."""
        offset = self.offset_s or 0.0
        mine = f"{self.fleet.replica_id}:".encode()
        for (name, queue), ends in zip(pools.items(), answers, strict=True):
            theirs = [end for lease, end in (ends or {}).items() if not bytes(lease).startswith(mine)]
            queue.device_set.remote_ends[name] = tuple(float(end) - offset for end in theirs)

    async def run(self, interval_s: float) -> None:
        """Exchange every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.exchange()

    def _add_remote(self, streams: Any, loads: dict[str, PoolLoad]) -> None:
        if not streams:
            return
        offset = self.offset_s or 0.0
        tenants = self.gateway.tenants.tenants
        classes = self.gateway.config.classes
        me = self.fleet.replica_id
        for _stream, entries in streams:
            for entry_id, fields in entries:
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                sender = fields.get(b"r", b"").decode()
                if sender == me:
                    continue
                for pool, samples in json.loads(fields.get(b"d", b"{}")).items():
                    load = loads.get(pool)
                    if load is None:
                        continue  # a pool this replica has not served yet: its ladder starts later
                    for t, request_class, tenant_name, ms in samples:
                        tenant = tenants.get(tenant_name)
                        request_class_config = classes.get(request_class)
                        flow = load.flow(
                            request_class,
                            tenant_name,
                            weight=tenant.config.weight if tenant is not None else 1.0,
                            class_weight=request_class_config.weight if request_class_config else 1.0,
                        )
                        load.add_remote_offer(t - offset, flow, float(ms))
                        self.received += 1
