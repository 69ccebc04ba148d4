"""The fleet's dispatch slot leases in a real Redis (``gateway.state.device_leases``): a long
request's lease says so, for the other replicas' short lane, and a lingering lease bound again
carries its new predicted end."""

from __future__ import annotations

import random

from gateway import clock
from gateway.config import StateConfig
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
    long_lease = await slots.bind("p", limit=4, predicted_ms=200.0, latest_start=latest, long=True)
    short_lease = await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=latest)
    assert long_lease is not None and long_lease.endswith(LONG_LEASE)
    assert short_lease is not None and not short_lease.endswith(LONG_LEASE)
    first = await _ends(fleet, "p")
    assert set(first) == {long_lease, short_lease}
    # The long lease lingers after its release: a short request does not take it over (the
    # others would count short work as long), a long one does, with its new predicted end.
    slots.release("p", long_lease)
    other_short = await slots.bind("p", limit=4, predicted_ms=20.0, latest_start=latest)
    assert other_short not in (long_lease, short_lease)
    assert other_short is not None and not other_short.endswith(LONG_LEASE)
    again = await slots.bind("p", limit=4, predicted_ms=400.0, latest_start=latest, long=True)
    assert again == long_lease
    await fleet.drain()
    assert (await _ends(fleet, "p"))[long_lease] > first[long_lease] + 0.1  # now + 400 ms
    for lease in (again, short_lease, other_short):
        slots.release("p", lease)
    await fleet.client.aclose()
