"""The fleet's dispatch slot leases in a real Redis (``gateway.state.device_leases``): a long
request's lease says so, for the other replicas' short lane, and a lingering lease bound again
carries its new predicted end; a degraded spell (``fail_mode: local``) never lets a replica
bind more than its share, counting what it bound before and during the spell."""

from __future__ import annotations

import random

import pytest

from gateway import clock
from gateway.config import StateConfig
from gateway.core.errors import DeadlineExpired
from gateway.state.device_leases import LONG_LEASE, FleetSlots, slot_keys
from gateway.state.redis_store import RedisFleet
from tests.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]


async def _ends(fleet: RedisFleet, pool: str) -> dict[str, float]:
    raw = await fleet.client.hgetall(slot_keys(fleet.config.key_prefix, pool)[1])
    return {bytes(k).decode(): float(v) for k, v in raw.items()}


async def test_long_leases_are_marked_and_a_reused_lease_keeps_its_kind(redis_server: RedisServer) -> None:
    prefix = f"slots{random.randrange(1 << 30)}:"
    fleet = RedisFleet(
        StateConfig(backend="redis", url=redis_server.url, key_prefix=prefix, call_timeout_ms=200),
        replica_id=f"{prefix}a",
    )
    assert await fleet.beat()
    slots = FleetSlots(fleet)
    latest = clock.now() + 5.0
    long_lease = (await slots.bind("p", limit=4, predicted_ms=200.0, latest_start=latest, long=True)).id
    short_lease = (await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=latest)).id
    assert long_lease is not None and long_lease.endswith(LONG_LEASE)
    assert short_lease is not None and not short_lease.endswith(LONG_LEASE)
    first = await _ends(fleet, "p")
    assert set(first) == {long_lease, short_lease}
    # The long lease lingers after its release: a short request does not take it over (the
    # others would count short work as long), a long one does, with its new predicted end.
    slots.release("p", long_lease)
    other_short = (await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=latest)).id
    assert other_short not in (long_lease, short_lease)
    assert other_short is not None and not other_short.endswith(LONG_LEASE)
    again = (await slots.bind("p", limit=4, predicted_ms=400.0, latest_start=latest, long=True)).id
    assert again == long_lease
    await fleet.drain()
    assert (await _ends(fleet, "p"))[long_lease] > first[long_lease] + 0.1  # now + 400 ms
    for lease in (again, short_lease, other_short):
        slots.release("p", lease)
    await fleet.client.aclose()


async def _fleet(redis_server: RedisServer, prefix: str, name: str) -> RedisFleet:
    fleet = RedisFleet(
        StateConfig(backend="redis", url=redis_server.url, key_prefix=prefix, call_timeout_ms=200),
        replica_id=f"{prefix}{name}",
    )
    assert await fleet.beat()
    return fleet


async def test_a_degraded_replica_binds_its_share_counting_the_work_it_bound_before(
    redis_server: RedisServer,
) -> None:
    """Two replicas, a pool of 4 slots: replica a holds two leases when Redis stops answering
    it. Its degraded share is 4 / 2 = 2, and the two requests still in flight on leases fill
    it: a third waits (here until its latest start). Back in the fleet, the request it bound
    locally meanwhile still counts against the pool's 4."""
    prefix = f"degraded{random.randrange(1 << 30)}:"
    other = await _fleet(redis_server, prefix, "b")
    fleet = await _fleet(redis_server, prefix, "a")
    assert fleet.size == 2
    slots = FleetSlots(fleet)

    def soon() -> float:
        return clock.now() + 0.05

    first = (await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=soon())).id
    second = (await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=soon())).id
    assert first is not None and second is not None
    fleet.failed(TimeoutError("Redis stopped answering"))  # what a failed call does
    assert fleet.degraded
    with pytest.raises(DeadlineExpired):  # its share (2) is taken by the two in flight
        await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=soon())
    slots.release("p", first)  # degraded: the lease expires in Redis
    assert (await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=soon())).id is None  # local
    with pytest.raises(DeadlineExpired):
        await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=soon())
    assert slots.in_flight("p") == 2

    # Back in the fleet. Redis counts `second` (in flight) and `first` (until it expires); the
    # local one holds no lease, so replica a may take one more of the 4, not two.
    assert await fleet.beat()
    assert not fleet.degraded
    third = (await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=soon())).id
    assert third is not None
    with pytest.raises(DeadlineExpired):
        await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=soon())
    assert slots.in_flight("p") == 3
    for lease in (second, None, third):
        slots.release("p", lease)
    assert slots.in_flight("p") == 0
    for each in (fleet, other):
        await each.stop()


async def test_a_grant_answers_its_wait_behind_the_fleets_bound_work(redis_server: RedisServer) -> None:
    """On 2 devices, two replicas bind 100 ms and 200 ms of work: a third and a fourth request
    wait in the backend's queue until the first device frees (the soonest end, 100 ms), and go
    together (its dynamic batcher); neither waits for the second's 200 ms. What the replica's own
    view missed, the grant answers: settlement charges that wait as no device time. A lease
    bound again while it lingers answers no wait (this replica's prediction stands)."""
    prefix = f"waits{random.randrange(1 << 30)}:"
    a, b = await _fleet(redis_server, prefix, "a"), await _fleet(redis_server, prefix, "b")
    on_a, on_b = FleetSlots(a), FleetSlots(b)
    latest = clock.now() + 5.0
    t0 = clock.now()
    first = await on_a.bind("p", limit=4, predicted_ms=100.0, cost_ms=100.0, devices=2, latest_start=latest)
    second = await on_b.bind("p", limit=4, predicted_ms=200.0, cost_ms=200.0, devices=2, latest_start=latest)
    third = await on_b.bind("p", limit=4, predicted_ms=50.0, cost_ms=50.0, devices=2, latest_start=latest)
    fourth = await on_a.bind("p", limit=4, predicted_ms=50.0, cost_ms=50.0, devices=2, latest_start=latest)
    elapsed = clock.now() - t0
    assert first.wait_s == second.wait_s == 0.0
    assert third.wait_s is not None and 0.100 - elapsed <= third.wait_s <= 0.100
    assert fourth.wait_s is not None and 0.100 - elapsed <= fourth.wait_s <= third.wait_s
    on_a.release("p", first.id)
    again = await on_a.bind("p", limit=4, predicted_ms=20.0, cost_ms=20.0, devices=2, latest_start=latest)
    assert again.id == first.id and again.wait_s is None
    for slots, lease in ((on_a, again), (on_b, second), (on_b, third), (on_a, fourth)):
        slots.release("p", lease.id)
    for each in (a, b):
        await each.stop()
