"""Fleet-wide dispatch slots: a lease per request bound to a backend, counted in Redis.

Owns the bound on binding across replicas. A replica's dispatch queue
(``gateway.scheduler``) grants a request one of the pool's ``devices x
max_inflight_per_device`` slots; with a fleet, binding to the backend then also needs one
of the *fleet's* slots of that pool: a lease in Redis (one round trip), taken before the
request goes to Triton and returned when it is done. So N replicas never bind more than
the pool's slots at once.

A request that finds the fleet's slots taken waits, holding its local slot (it is next on
this replica, in the local fair order), until the soonest predicted end of the fleet's bound
work (the script answers it) or until this replica returns a lease of that pool, whichever
is first, then asks again; past its latest start it leaves with the queue's late refusal
(``DEADLINE_EXCEEDED``, ``queue.latest_start``: the pipeline may still rescue it on the
fallback). Leases are renewed with the heartbeat and expire ``lease_ttl_ms`` after a dead
replica's last renewal. A returned lease lingers ``LINGER_S`` (3 ms) on its replica: the
pool's next request there binds on it without a round trip; otherwise it goes back.

Redis unreachable: ``fail_mode: local`` binds at most ``slots / N`` (at least 1) of a pool
from this replica (N from the last membership), counting the requests it still has in flight
on leases taken before; ``closed`` refuses with ``UNAVAILABLE``. Back in the fleet, a
replica asks Redis for ``slots`` less its requests still in flight on the local share (they
hold no lease). The fleet's bound holds across a degraded spell when every replica loses
Redis together (Redis down); when only some do (a partition), the others still bind up to
the slots Redis counts, and the fleet may exceed the bound by the degraded replicas' shares
until their leases expire: ``fail_mode: closed`` is the choice that never exceeds it.

A grant answers the request's predicted wait in the backend's queue behind the fleet's bound
work, from the leases' predicted ends as Redis holds them at that moment (``Lease.wait_s``):
settlement subtracts it from the backend time it charges. This replica's own view (its bound
work, the others' as of the last load exchange) would miss the others' work bound since, and
charge the time a request waited behind it in Triton's queue as its device time (1.5 % more per
request in ``tests/test_replicas_surge.py``, which the fleet's ladder read as demand). A lease
bound again while it lingers, or a degraded spell's local share, answers no wait (``None``:
this replica's own prediction stands).
"""

from __future__ import annotations

import asyncio
import math
from itertools import count
from typing import NamedTuple

from gateway import clock
from gateway.core.dispatch import LATE_RULE
from gateway.core.errors import DeadlineExpired, Unavailable
from gateway.state import lua
from gateway.state.redis_store import REDIS_FAILURES, RULE_STATE_UNAVAILABLE, RedisFleet, still_cancelled

__all__ = ["LINGER_S", "LONG_LEASE", "FleetSlots", "Lease", "slot_keys"]

# A returned lease stays with its replica this long for the pool's next request (which then
# binds without a round trip) before it goes back to the fleet. Back-to-back requests on a
# busy replica reuse it; the fleet loses at most this much of a device's time per release.
LINGER_S = 0.003


# The suffix of a lease held by long-bucket work: the other replicas count it against the short
# lane (``DeviceSet.remote_long_ends``).
LONG_LEASE = ":L"


class Lease(NamedTuple):
    """One of the fleet's slots, bound: its lease id (``None`` on the degraded local share) and
    its predicted wait in the backend's queue behind the fleet's bound work, when Redis
    answered one (``None``: a lingering lease bound again, or the local share)."""

    id: str | None
    wait_s: float | None = None


def slot_keys(key_prefix: str, pool: str) -> list[str]:
    """A pool's slot leases (lease id -> expiry) and their predicted ends (lease id -> time),
    in one hash slot; the fleet's load exchange reads the ends too."""
    tag = f"{key_prefix}{{slots:{pool}}}"
    return [f"{tag}:leases", f"{tag}:ends"]


class FleetSlots:
    """This replica's leases on the fleet's dispatch slots, per pool."""

    def __init__(self, fleet: RedisFleet) -> None:
        self.fleet = fleet
        self._acquire = fleet.script(lua.SLOT_ACQUIRE)
        self._release = fleet.script(lua.SLOT_RELEASE)
        self._reend = fleet.script(lua.SLOT_REEND)
        self._renew = fleet.script(lua.RENEW)
        self._ids = count(1)
        self._held: dict[str, set[str]] = {}  # pool -> lease ids this replica holds in Redis
        self._local: dict[str, int] = {}  # pool -> bound while degraded (no lease in Redis)
        self._freed: dict[str, asyncio.Event] = {}
        self._spare: dict[str, dict[str, asyncio.TimerHandle]] = {}  # returned, lingering leases
        self.waits = 0  # times a bind found the fleet's slots taken (tests, status)
        fleet.on_beat(self.renew)

    def keys(self, pool: str) -> list[str]:
        return slot_keys(self.fleet.config.key_prefix, pool)

    def in_flight(self, pool: str) -> int:
        """This replica's requests of ``pool`` bound now: on leases (lingering spares are
        bound to nothing) and on the degraded local share."""
        leased = len(self._held.get(pool, ())) - len(self._spare.get(pool, {}))
        return leased + self._local.get(pool, 0)

    async def bind(
        self,
        pool: str,
        *,
        limit: int,
        predicted_ms: float,
        latest_start: float,
        long: bool = False,
        cost_ms: float | None = None,
        devices: int = 0,
    ) -> Lease:
        """Take one of the fleet's ``limit`` slots of ``pool`` on its ``devices``; the lease to
        ``release`` later and the request's predicted wait behind the fleet's bound work (see
        the module docstring). ``predicted_ms``: this replica's prediction of the request's
        end from now (its wait and ``cost_ms``, its device time; the cost is the prediction
        when not given), kept as a reused lease's end. ``long``: long-bucket work, marked in
        the lease id (``LONG_LEASE``) so every replica counts it against the short lane."""
        cost = predicted_ms if cost_ms is None else cost_ms
        while True:
            if self.fleet.degraded:
                if self.fleet.config.fail_mode == "closed":
                    raise Unavailable(
                        "the fleet's shared dispatch slots are unreachable (fail_mode closed)",
                        rule=RULE_STATE_UNAVAILABLE,
                    )
                # The share counts the requests still in flight on leases taken before Redis
                # went away: they are bound at Triton as much as the local ones.
                if self.in_flight(pool) < max(1, limit // self.fleet.size):
                    self._local[pool] = self._local.get(pool, 0) + 1
                    return Lease(None)
                wait_s = math.inf  # until this replica frees one of its share
            else:
                spare = self._spare.get(pool, {})
                reuse = next((held for held in spare if held.endswith(LONG_LEASE) == long), None)
                if reuse is not None:  # a lease of the kind this replica just returned: bound
                    spare.pop(reuse).cancel()  # again without waiting for a round trip
                    if long:  # its new predicted end, in the background (a short request's
                        # stale end costs the others' predictions one short request at most)
                        self.fleet.send_script(
                            self._reend, self.keys(pool), [reuse, repr(max(0.0, predicted_ms))]
                        )
                    return Lease(reuse)
                lease = f"{self.fleet.replica_id}:{next(self._ids)}{LONG_LEASE if long else ''}"
                # Requests still in flight on the degraded local share hold no lease in Redis:
                # back in the fleet, this replica leaves their slots free until they end.
                fleet_limit = limit - self._local.get(pool, 0)
                ttl, cost_arg = repr(self.fleet.ttl_s), repr(max(0.0, cost))
                args = ["", ttl, str(fleet_limit), lease, cost_arg, str(devices)]
                try:
                    answer = await self.fleet.run_script(self._acquire, self.keys(pool), args)
                except REDIS_FAILURES as failure:  # degraded now: decided again on the local share
                    still_cancelled(failure)
                    continue
                if int(answer[0]) == 1:
                    self._held.setdefault(pool, set()).add(lease)
                    return Lease(lease, float(answer[2]) if devices > 0 else None)
                wait_s = float(answer[1])
            self.waits += 1
            now = clock.now()
            if now >= latest_start:
                raise DeadlineExpired("the request could not start before its deadline", rule=LATE_RULE)
            freed = self._freed.setdefault(pool, asyncio.Event())
            # Wait for a release here, or the fleet's soonest predicted end: whichever is first.
            timeout = min(wait_s, latest_start - now)
            try:
                await asyncio.wait_for(freed.wait(), timeout=timeout)
            except TimeoutError as timed_out:
                still_cancelled(timed_out)  # a cancellation 3.11's wait_for reported as a timeout

    def release(self, pool: str, lease: str | None) -> None:
        """Return a slot (in the background: a lost release expires with its lease)."""
        if lease is None:
            self._local[pool] = max(0, self._local.get(pool, 0) - 1)
        elif self.fleet.degraded:
            self._held.get(pool, set()).discard(lease)  # it expires with its lease
        else:
            # Kept for LINGER_S for this replica's next request of the pool (still held in
            # Redis, so the fleet's bound holds), then returned.
            timer = asyncio.get_running_loop().call_later(LINGER_S, self._return, pool, lease)
            self._spare.setdefault(pool, {})[lease] = timer
        freed = self._freed.pop(pool, None)
        if freed is not None:
            freed.set()

    def _return(self, pool: str, lease: str) -> None:
        if self._spare.get(pool, {}).pop(lease, None) is None:
            return  # bound again meanwhile
        self._held.get(pool, set()).discard(lease)
        if not self.fleet.degraded:  # a lost release expires with its lease
            self.fleet.send_script(self._release, self.keys(pool), [lease])

    async def renew(self) -> None:
        """Push back the leases this replica holds (with the heartbeat)."""
        calls = [
            self._renew(keys=self.keys(pool)[:1], args=["", repr(self.fleet.ttl_s), *ids])
            for pool, ids in self._held.items()
            if ids
        ]
        if calls:
            await self.fleet.call(asyncio.gather(*calls))
