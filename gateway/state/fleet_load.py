"""The fleet-wide overload ladder's evidence: offered demand exchanged through Redis.

Owns the exchange that lets every replica's ladder decide on the *fleet's* offered demand.
Every ``interval_s`` (a quarter of the ladder's update interval) each replica, in one round trip,
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

Admitted work (priced as offered and as it runs) and what capping it saved travel in the same
entries: the relief the ladder judges steps 4-6 by, the backend-saturation test and the
relief each flow's plan subtracts from the fleet's excess are then the fleet's, in the units
of its demand. With each replica's own relief against the fleet's demand, a replica read half
the fleet's savings as all of them (and degraded more of a surge than one replica would), and
replicas with different local ratios sat on different steps for seconds.

Every entry also carries each pool's step on the sending replica's own ladder (``s``), and
the request path of every replica acts on the highest step published in the last
``STEP_MEMORY`` intervals (``PoolLoad.fleet_step``): replicas' evidence can still differ by an
exchange's delay and their own queue dwell, and near a threshold, with the descent's hold
period, that kept two replicas a step apart for over a second; now the fleet climbs with its
first replica and descends with its last, within an exchange or two.

What is not exchanged: queue dwell stays each replica's own evidence (its queue).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Final

from gateway import clock
from gateway.core.dispatch import DispatchQueue
from gateway.core.load import FlowLoad, PoolLoad
from gateway.state.device_leases import LONG_LEASE, slot_keys
from gateway.state.redis_store import REDIS_FAILURES, RedisFleet

if TYPE_CHECKING:
    from gateway.pipeline import Gateway

__all__ = ["FleetLoad"]

log = logging.getLogger("orchid.state")

# Another replica's published step counts for this many exchange intervals after it was read.
STEP_MEMORY: Final = 3
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
        self.interval_s = 0.1  # set by ``run``
        # pool -> sender -> (its ladder's step, when read on this replica's clock)
        self.steps: dict[str, dict[str, tuple[int, float]]] = {}

    @property
    def stale(self) -> bool:
        return self.fresh_at is None or clock.now() - self.fresh_at > self.stale_after_s

    def _attach(self) -> dict[str, PoolLoad]:
        loads = dict(self.gateway.loads)
        for load in loads.values():
            if load.offers is None:
                load.offers = []
            if load.admits is None:
                load.admits = []
            if load.reductions is None:
                load.reductions = []
        return loads

    def _collect(self, load: PoolLoad) -> dict[str, list[list[Any]]]:
        """The pool's samples since the last exchange, on Redis's clock: offered (``o``),
        admitted (``a``: priced as offered, as it runs) and saved by capping (``r``)."""
        offers, load.offers = load.offers or [], []
        admits, load.admits = load.admits or [], []
        reductions, load.reductions = load.reductions or [], []
        if self.offset_s is None:
            return {}
        at = self.offset_s
        samples = {
            "o": [[t + at, key[0], key[1], ms] for t, key, ms in offers],
            "a": [[t + at, key[0], key[1], offered, running] for t, key, offered, running in admits],
            "r": [[t + at, key[0], key[1], saved] for t, key, saved in reductions],
        }
        published: dict[str, list[list[Any]]] = {kind: rows for kind, rows in samples.items() if rows}
        if published or load.ladder.step > 0:
            published["s"] = [[int(load.ladder.step)]]  # this replica's own step (not the fleet's)
        return published

    async def exchange(self) -> bool:
        """One exchange; False when Redis did not answer (the pools then plan for 1/N)."""
        loads = self._attach()
        pools = self._pools()
        batch: dict[str, dict[str, list[list[Any]]]] = {}
        for name, load in loads.items():
            samples = self._collect(load)
            if samples:
                batch[name] = samples
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
        self._set_fleet_steps(loads, stale)
        if stale:
            for queue in pools.values():
                queue.device_set.remote_ends.pop(queue.name, None)
                queue.device_set.remote_long_ends.pop(queue.name, None)
        return ok

    def _set_fleet_steps(self, loads: dict[str, PoolLoad], stale: bool) -> None:
        """Each pool's highest step another replica published within STEP_MEMORY exchanges
        (a replica publishes its step with every entry while it is above 0 or has samples;
        one that stopped publishing is back at 0 or gone). Stale: this replica's own only."""
        now = clock.now()
        horizon = STEP_MEMORY * self.interval_s
        for name, load in loads.items():
            senders = self.steps.get(name, {})
            for sender in [k for k, (_, at) in senders.items() if now - at > horizon]:
                del senders[sender]
            load.fleet_step = 0 if stale else max((step for step, _ in senders.values()), default=0)

    def _pools(self) -> dict[str, DispatchQueue]:
        """This replica's dispatch queues by pool name (the pools it has served)."""
        names = {name: self.gateway.queue_named(name) for name in self.gateway.loads}
        return {name: queue for name, queue in names.items() if queue is not None}

    def _ends_key(self, pool: str) -> str:
        return slot_keys(self.fleet.config.key_prefix, pool)[1]

    def _set_remote_bound(self, pools: dict[str, DispatchQueue], answers: list[Any]) -> None:
        """The other replicas' leases' predicted ends, per pool, onto the pool's devices."""
        offset = self.offset_s or 0.0
        mine = f"{self.fleet.replica_id}:".encode()
        long_suffix = LONG_LEASE.encode()
        for (name, queue), ends in zip(pools.items(), answers, strict=True):
            theirs = [(bytes(lease), end) for lease, end in (ends or {}).items()]
            theirs = [(lease, end) for lease, end in theirs if not lease.startswith(mine)]
            devices = queue.device_set
            devices.remote_ends[name] = tuple(float(end) - offset for _, end in theirs)
            devices.remote_long_ends[name] = tuple(
                float(end) - offset for lease, end in theirs if lease.endswith(long_suffix)
            )

    async def run(self, interval_s: float) -> None:
        """Exchange every ``interval_s`` until cancelled."""
        self.interval_s = interval_s
        while True:
            await asyncio.sleep(interval_s)
            await self.exchange()

    def _add_remote(self, streams: Any, loads: dict[str, PoolLoad]) -> None:
        if not streams:
            return
        offset = self.offset_s or 0.0
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
                    for kind in ("o", "a", "r"):
                        for t, request_class, tenant_name, *values in samples.get(kind, ()):
                            flow = self._flow(load, request_class, tenant_name)
                            if kind == "o":
                                load.add_remote_offer(t - offset, flow, float(values[0]))
                            elif kind == "a":
                                load.add_admitted(t - offset, flow, float(values[0]), float(values[1]))
                            elif kind == "r":
                                load.add_reduction(t - offset, flow, float(values[0]))
                            self.received += 1
                    if "s" in samples:
                        self.steps.setdefault(pool, {})[sender] = (int(samples["s"][0][0]), clock.now())

    def _flow(self, load: PoolLoad, request_class: str, tenant_name: str) -> FlowLoad:
        tenant = self.gateway.tenants.tenants.get(tenant_name)
        request_class_config = self.gateway.config.classes.get(request_class)
        return load.flow(
            request_class,
            tenant_name,
            weight=tenant.config.weight if tenant is not None else 1.0,
            class_weight=request_class_config.weight if request_class_config else 1.0,
        )
