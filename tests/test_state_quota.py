"""One quota semantics, two ledgers: the core's ``QuotaLedger`` and the Redis scripts.

The same operations, at the same explicit times, go to the in-memory ledger and to the
fleet's ledger in a real ``redis-server`` (``RedisQuotaStore`` with the script clock set
by the test); every answer (grant and borrowed part, or refusal rule, retry-after and
message), every close and the bucket levels must agree. Then the part only the shared
ledger has: leases that expire when a replica stops renewing them.

Both ledgers are driven through the methods the request path calls (``reserve``, ``start``,
``settle``, ``release``). The store sends starts and settlements in the background, on
Redis's own clock; ``script_clock`` hands those scripts the test's time instead (as
``redis_now`` does for the calls awaited), and ``drain`` waits until they have run.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway import clock
from gateway.config import StateConfig
from gateway.core.errors import PermissionDenied, ResourceExhausted
from gateway.core.quota import QuotaLedger, QuotaSettings, Reservation, Settlement
from gateway.settings import QuotaSettingsSchema
from gateway.state.redis_store import RedisFleet, RedisQuotaStore
from tests.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

SETTINGS = QuotaSettingsSchema.model_validate(
    {
        "classes": {
            "interactive": {"accelerator_ms_per_s": 100.0, "default": {"weight": 1, "max_concurrent": 2}},
        },
        "tenants": {
            "a": {
                "interactive": {
                    "accelerator_ms_per_s": 40.0,
                    "max_concurrent": 3,
                    "max_queued_ms": 150.0,
                    "live_token_ms_per_s": 1000.0,
                    "max_input_tokens": 4096,
                },
                "batch": {"accelerator_ms_per_s": 10.0, "burst_ms": 30.0},
            },
            "b": {"interactive": {"weight": 1, "borrow_fraction": 1.0}},
        },
    }
).value()


async def _store(
    server: RedisServer,
    prefix: str,
    *,
    ttl_ms: int = 60000,
    quota_slice: float = 0.0,
    settings: QuotaSettings = SETTINGS,
    replica: str = "replica",
) -> RedisQuotaStore:
    """A replica's store; ``quota_slice`` 0 (here the default): every reservation is its own
    script call, so its answers can be compared one for one with the core ledger's."""
    fleet = RedisFleet(
        StateConfig(
            backend="redis",
            url=server.url,
            key_prefix=prefix,
            lease_ttl_ms=ttl_ms,
            call_timeout_ms=200,
            quota_slice=quota_slice,
        ),
        replica_id=f"{prefix}{replica}",
    )
    assert await fleet.beat()  # membership read: not degraded
    return RedisQuotaStore(settings, fleet)


@pytest.fixture
async def store(redis_server: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[RedisQuotaStore]:
    shared = await _store(redis_server, f"t{random.randrange(1 << 30)}:")
    yield shared
    await shared.fleet.client.aclose()


async def _redis_level(store: RedisQuotaStore, tenant: str, request_class: str, now: float) -> float:
    terms = store.terms(tenant, request_class)
    level, updated = await store.fleet.client.hmget(store.keys(terms)[0], "alvl", "aupd")
    if level is None:
        return terms.capacity_ms
    return min(terms.capacity_ms, float(level) + terms.rate_ms_per_s * max(0.0, now - float(updated)))


def script_clock(store: RedisQuotaStore) -> list[float]:
    """Run the scripts ``store`` sends in the background (start, settle, release: their first
    argument, the script's clock, is '' for Redis's own ``TIME``) at the test's time instead:
    the returned list's one element, which the test sets."""
    at = [0.0]
    send = store.fleet.send_script

    def send_at(script: Any, keys: list[str], args: list[str]) -> None:
        send(script, keys, [args[0] or repr(at[0]), *args[1:]])

    store.fleet.send_script = send_at  # type: ignore[method-assign]
    return at


def _comparable(settlement: Settlement | None) -> Settlement | None:
    """A settlement without its reservation id (each ledger numbers its own)."""
    return None if settlement is None else dataclasses.replace(settlement, reservation_id=0)


_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _outcome(error: Exception) -> tuple[str, str | None, int | None, str, list[float]]:
    """Status, rule, retry-after and wording; the message's numbers apart, compared to their
    printed precision (the two ledgers' floats may differ in the last bits, which can flip
    the rounding of a printed ``.x5``)."""
    assert isinstance(error, ResourceExhausted | PermissionDenied)
    numbers = [float(n) for n in _NUMBER.findall(error.message)]
    return type(error).__name__, error.rule, error.retry_after_ms, _NUMBER.sub("#", error.message), numbers


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_same_answers_as_the_core_ledger(store: RedisQuotaStore, seed: int) -> None:
    rng = random.Random(seed)
    ledger = QuotaLedger(SETTINGS)
    clock_at = script_clock(store)
    now = 0.0
    open_pairs: list[tuple[Reservation, Reservation]] = []
    accounts = [("a", "interactive"), ("a", "batch"), ("b", "interactive"), ("zed", "interactive")]
    grants = refusals = closes = 0
    for _ in range(250):
        now += rng.choice([0.0, 0.001, 0.01, 0.05, 0.2, 0.5])  # < 60 s in all: no lease expires
        clock_at[0] = now
        op = rng.random()
        if op < 0.55 or not open_pairs:
            tenant, request_class = rng.choice(accounts)
            demand = rng.choice([2.8, 14.0, 56.8, 120.0, 467.6])
            live = rng.choice([0.0, 100.0, 900.0])
            tokens = rng.choice([256, 4096, 5000])
            kwargs = {"demand_ms": demand, "live_token_ms": live, "input_tokens": tokens, "output_tokens": 64}
            try:
                mine = ledger.reserve(tenant, request_class, now=now, **kwargs)  # type: ignore[arg-type]
            except (ResourceExhausted, PermissionDenied) as error:
                with pytest.raises(type(error)) as shared_error:
                    await store.reserve(tenant, request_class, now=now, redis_now=now, **kwargs)  # type: ignore[arg-type]
                *theirs_outcome, theirs_numbers = _outcome(shared_error.value)
                *mine_outcome, mine_numbers = _outcome(error)
                if (
                    error.rule == "quota.concurrency"
                    and store.terms(tenant, request_class).max_queued_ms is None
                ):
                    # The store sends a start only where a queued-work limit reads it (a round
                    # trip saved): Redis counts a started request as not yet started, so its
                    # retry hint is the request's whole prediction, an upper bound on the
                    # ledger's remaining time (redis_store.RedisQuotaStore.start).
                    assert theirs_outcome[2] >= mine_outcome[2], (theirs_outcome, mine_outcome)
                    theirs_outcome[2] = mine_outcome[2]
                assert theirs_outcome == mine_outcome
                assert theirs_numbers == pytest.approx(mine_numbers, abs=0.11)
                refusals += 1
                continue
            theirs = await store.reserve(tenant, request_class, now=now, redis_now=now, **kwargs)  # type: ignore[arg-type]
            assert theirs.borrowed_ms == pytest.approx(mine.borrowed_ms, abs=1e-9)
            assert (theirs.metered, theirs.pooled) == (mine.metered, mine.pooled)
            open_pairs.append((mine, theirs))
            grants += 1
        elif op < 0.7:
            mine, theirs = rng.choice(open_pairs)
            ledger.start(mine, now=now)
            assert store.start(theirs, now=now)
        else:
            mine, theirs = open_pairs.pop(rng.randrange(len(open_pairs)))
            if rng.random() < 0.3:
                expected, got = ledger.release(mine, now=now), store.release(theirs, now=now)
            else:
                charged = mine.demand_ms * rng.choice([0.5, 1.0, 1.7])
                expected = ledger.settle(mine, charged_ms=charged, now=now)
                got = store.settle(theirs, charged_ms=charged, now=now)
            assert expected is not None and _comparable(got) == _comparable(expected)
            closes += 1
        await store.drain()  # a start, settlement or release sent in the background has run
        for tenant, request_class in (("a", "interactive"), ("b", "interactive"), ("a", "batch")):
            expected = ledger.available(tenant, request_class, now=now).available_accelerator_ms
            assert await _redis_level(store, tenant, request_class, now) == pytest.approx(expected, abs=1e-6)
        # The open reservations, and the queued work the queued-work limit reads (tenant a's).
        assert (await store.fleet_outstanding(redis_now=now)).count == ledger.outstanding().count
        queued = await store.fleet.client.hget(store.keys(store.terms("a", "interactive"))[0], "queued")
        assert float(queued or 0.0) == pytest.approx(
            ledger.available("a", "interactive", now=now).queued_ms, abs=1e-6
        )
    shared_open = await store.fleet_outstanding(redis_now=now)
    assert shared_open.count == ledger.outstanding().count
    assert shared_open.accelerator_ms == pytest.approx(ledger.outstanding().accelerator_ms)
    print(f"seed {seed}: {grants} grants, {refusals} refusals, {closes} closes, all equal")
    assert grants > 30 and refusals > 30 and closes > 30  # the sequence exercised both answers


async def test_closing_twice_is_a_no_op(store: RedisQuotaStore) -> None:
    clock_at = script_clock(store)
    reservation = await store.reserve("a", "interactive", demand_ms=10.0, now=0.0, redis_now=0.0)
    clock_at[0] = 0.1
    settled = store.settle(reservation, charged_ms=25.0, now=0.1)
    assert settled is not None and settled.extra_ms == pytest.approx(15.0)
    await store.drain()
    assert (await store.fleet_outstanding(redis_now=0.1)).count == 0
    level = await _redis_level(store, "a", "interactive", 0.2)
    assert level == pytest.approx(80.0 - 25.0 + 40.0 * 0.2)  # charged once, refilled since
    clock_at[0] = 0.2
    assert store.settle(reservation, charged_ms=25.0, now=0.2) is None
    assert store.release(reservation, now=0.2) is None
    await store.drain()
    assert await _redis_level(store, "a", "interactive", 0.2) == pytest.approx(level)


async def test_a_settlement_after_the_lease_expired_charges_nothing_more(redis_server: RedisServer) -> None:
    """A replica too slow to renew: its reservation's lease expired and closed it in Redis at its
    prediction; the replica's settlement, sent when the request ends, finds it closed."""
    store = await _store(redis_server, f"late{random.randrange(1 << 30)}:", ttl_ms=1000)
    clock_at = script_clock(store)
    reservation = await store.reserve("a", "interactive", demand_ms=70.0, now=0.0, redis_now=100.0)
    assert (await store.fleet_outstanding(redis_now=101.0)).count == 0  # expired, closed at 70
    clock_at[0] = 101.0
    assert store.settle(reservation, charged_ms=90.0, now=101.0) is not None  # its own view
    await store.drain()
    # 80 - 70 + 40 ms/s x 1 s: the 20 ms observed beyond the prediction are not charged again.
    assert await _redis_level(store, "a", "interactive", 101.0) == pytest.approx(50.0)
    await store.fleet.client.aclose()


async def test_a_dead_replicas_reservations_return_when_their_leases_expire(
    redis_server: RedisServer,
) -> None:
    prefix = f"lease{random.randrange(1 << 30)}:"
    dead = await _store(redis_server, prefix, ttl_ms=1000)
    alive = await _store(redis_server, prefix, ttl_ms=1000)
    alive.fleet.replica_id = "alive"
    for _ in range(3):  # max_concurrent 3: the dead replica holds all of tenant a's slots
        await dead.reserve("a", "interactive", demand_ms=5.0, now=0.0, redis_now=100.0)
    with pytest.raises(ResourceExhausted) as refused:
        await alive.reserve("a", "interactive", demand_ms=5.0, now=0.0, redis_now=100.5)
    assert refused.value.rule == "quota.concurrency"
    assert (await alive.fleet_outstanding(redis_now=100.5)).by_owner == {f"{prefix}replica": 3}
    # The dead replica never renews: one TTL later its leases have expired and closed.
    after = await alive.fleet_outstanding(redis_now=101.0)
    assert after.count == 0
    granted = await alive.reserve("a", "interactive", demand_ms=5.0, now=0.0, redis_now=101.0)
    # Closed at their prediction: the bucket kept the 3 x 5 ms it was debited (refilled since).
    level = await _redis_level(alive, "a", "interactive", 101.0)
    assert level == pytest.approx(min(80.0, 80.0 - 15.0 + 40.0 * 1.0) - 5.0)
    # A renewed lease does not expire.
    await alive.renew()  # Redis's own clock: far beyond the test clock's 101 s
    assert (await alive.fleet_outstanding(redis_now=102.0)).by_owner == {"alive": 1}
    script_clock(alive)[0] = 102.0
    assert alive.settle(granted, charged_ms=5.0, now=102.0) is not None
    await alive.drain()
    assert (await alive.fleet_outstanding(redis_now=102.0)).count == 0
    await dead.fleet.client.aclose()
    await alive.fleet.client.aclose()


SLICED = QuotaSettingsSchema.model_validate(
    {
        "classes": {"interactive": {"accelerator_ms_per_s": 1000.0}},
        "tenants": {
            "s": {
                "interactive": {"accelerator_ms_per_s": 100.0, "burst_ms": 200.0, "max_concurrent": 8},
                "batch": {"accelerator_ms_per_s": 10.0, "burst_ms": 30.0},
            },
        },
    }
).value()


async def _open_units(store: RedisQuotaStore, tenant: str, request_class: str) -> tuple[int, int]:
    """Open reservations of the account in Redis, and the concurrency they hold."""
    acct, open_key = store.keys(store.terms(tenant, request_class))[:2]
    count = int(await store.fleet.client.hlen(open_key))
    extra = await store.fleet.client.hget(acct, "xu")
    return count, count + int(extra or 0)


async def test_requests_are_admitted_on_a_slice_and_its_unused_rest_returns(
    redis_server: RedisServer,
) -> None:
    store = await _store(
        redis_server, f"slice{random.randrange(1 << 30)}:", quota_slice=0.25, settings=SLICED
    )
    terms = store.terms("s", "batch")  # 10 ms/s, burst 30: slices of 7.5 ms, no concurrency limit
    seconds, micros = await store.fleet.client.time()
    began = float(seconds) + float(micros) / 1e6
    first = [await store.reserve("s", "batch", demand_ms=2.0, now=0.0, redis_now=began) for _ in range(3)]
    # Three requests, one reservation in Redis: the slice, debited in full.
    assert store.remote_reservations == store.slices_claimed == 1
    shared = await store.fleet_outstanding(redis_now=began)
    assert (shared.count, shared.accelerator_ms) == (1, pytest.approx(7.5))
    assert store.outstanding().count == 3
    # The fourth does not fit what is left (1.5 ms): a second slice.
    fourth = await store.reserve("s", "batch", demand_ms=2.0, now=0.0, redis_now=began)
    assert store.slices_claimed == 2
    assert (await store.fleet_outstanding(redis_now=began)).count == 2
    view = store.available("s", "batch", now=clock.now())
    assert view.available_accelerator_ms >= 30.0 - 15.0 + 5.5 - 1e-9  # the live slice's rest is ours
    for reservation in first:  # observed 1 ms each: the spent slice closes at 3 ms
        settled = store.settle(reservation, charged_ms=1.0, now=0.0)
        assert settled is not None and settled.refunded_ms == pytest.approx(1.0)
    assert store.release(fourth, now=0.0) is not None
    assert store.settle(first[0], charged_ms=1.0, now=0.0) is None  # closed once
    await store.drain()  # returns the slice not in use
    assert (await store.fleet_outstanding()).count == 0
    assert store.outstanding().count == 0
    level = await store.level("s", "batch")  # refilled to Redis's clock, read before ours
    seconds, micros = await store.fleet.client.time()
    elapsed = float(seconds) + float(micros) / 1e6 - began
    # The bucket paid what the requests were charged (3 ms), nothing for the unused rest.
    assert 27.0 - 1e-6 <= level <= min(terms.capacity_ms, 27.0 + terms.rate_ms_per_s * elapsed) + 1e-6
    await store.fleet.client.aclose()


async def test_a_slices_concurrency_counts_against_the_fleets_limit(redis_server: RedisServer) -> None:
    prefix = f"units{random.randrange(1 << 30)}:"
    sliced = await _store(redis_server, prefix, quota_slice=0.25, settings=SLICED)  # 2 of 8 per slice
    single = await _store(redis_server, prefix, settings=SLICED, replica="single")
    script_clock(sliced)[0] = script_clock(single)[0] = 10.0  # as every reserve's redis_now below
    on_slice = [await sliced.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0)]
    on_slice.append(await sliced.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0))
    assert sliced.slices_claimed == 1
    assert await _open_units(sliced, "s", "interactive") == (1, 2)
    alone = [
        await single.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0) for _ in range(6)
    ]
    assert await _open_units(sliced, "s", "interactive") == (7, 8)
    with pytest.raises(ResourceExhausted) as refused:  # 8 in flight across the fleet
        await single.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0)
    assert refused.value.rule == "quota.concurrency"
    # The slice's two are busy; a second slice (two more) does not fit, nor one more request.
    with pytest.raises(ResourceExhausted) as refused:
        await sliced.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0)
    assert refused.value.rule == "quota.concurrency"
    assert sliced.slices_claimed == 1
    assert single.settle(alone.pop(), charged_ms=1.0, now=0.0) is not None
    await single.drain()
    # One free: the sliced replica reserves this request alone (a slice of two would not fit).
    extra = await sliced.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0)
    assert sliced.slices_claimed == 1 and sliced.remote_reservations == 2
    assert await _open_units(sliced, "s", "interactive") == (7, 8)  # the slice, 5 alone, this one
    # A unit of the slice comes back when one of its requests settles: reused locally.
    assert sliced.settle(on_slice.pop(), charged_ms=1.0, now=0.0) is not None
    on_slice.append(await sliced.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0))
    assert sliced.remote_reservations == 2
    for reservation in on_slice:
        sliced.settle(reservation, charged_ms=1.0, now=0.0)
    assert sliced.settle(extra, charged_ms=1.0, now=0.0) is not None
    for reservation in alone:
        assert single.settle(reservation, charged_ms=1.0, now=0.0) is not None
    await single.drain()
    await sliced.drain()
    assert await _open_units(sliced, "s", "interactive") == (0, 0)
    await sliced.fleet.client.aclose()
    await single.fleet.client.aclose()


async def test_a_dead_replicas_slice_returns_when_its_lease_expires(redis_server: RedisServer) -> None:
    prefix = f"slicelease{random.randrange(1 << 30)}:"
    dead = await _store(redis_server, prefix, ttl_ms=1000, quota_slice=0.25, settings=SLICED)
    alive = await _store(redis_server, prefix, ttl_ms=1000, settings=SLICED, replica="alive")
    await dead.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=100.0)  # a slice: 50 ms, 2 units
    assert await _open_units(alive, "s", "interactive") == (1, 2)
    after = await alive.fleet_outstanding(redis_now=101.0)  # one TTL later, never renewed
    assert after.count == 0
    assert await _open_units(alive, "s", "interactive") == (0, 0)
    # Closed at its whole size (its requests may have run): 200 - 50, refilled 100 ms/s x 1 s.
    granted = await alive.reserve("s", "interactive", demand_ms=5.0, now=0.0, redis_now=101.0)
    level = await _redis_level(alive, "s", "interactive", 101.0)
    assert level == pytest.approx(min(200.0, 150.0 + 100.0) - 5.0)
    script_clock(alive)[0] = 101.0
    assert alive.settle(granted, charged_ms=5.0, now=0.0) is not None
    await alive.drain()
    assert (await alive.fleet_outstanding(redis_now=101.0)).count == 0
    await dead.fleet.client.aclose()
    await alive.fleet.client.aclose()


def test_scaled_settings_are_one_replicas_share() -> None:
    half = SETTINGS.scaled(0.5)
    full_rates = SETTINGS.resolved_rates()
    for key, rate in half.resolved_rates().items():
        assert rate == pytest.approx(full_rates[key] / 2)
    ledger = QuotaLedger(half)
    assert ledger.terms("a", "interactive").capacity_ms == pytest.approx(40.0)  # 2 s of 20 ms/s
    assert ledger.terms("a", "interactive").max_concurrent == 1
    assert ledger.terms("a", "interactive").max_queued_ms == pytest.approx(75.0)
    with pytest.raises(ValueError, match="fraction"):
        SETTINGS.scaled(0.0)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"backend": "redis"}, "backend redis needs url"),
        ({"backend": "memory", "url": "redis://127.0.0.1:6379/0"}, "url is only read with backend: redis"),
        ({"backend": "redis", "url": "http://127.0.0.1:6379"}, "should match pattern"),
        (
            {"backend": "redis", "url": "redis://h:1/0", "lease_ttl_ms": 300, "call_timeout_ms": 200},
            "a third",
        ),
        ({"backend": "etcd"}, "'memory' or 'redis'"),
        ({"fail_mode": "open"}, "'local' or 'closed'"),
    ],
)
def test_bad_state_configuration_says_what_is_wrong(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        StateConfig.model_validate(fields)


def test_the_default_is_one_process() -> None:
    from gateway.config import load_gateway_config
    from tests.conftest import EXAMPLE_CONFIG

    assert load_gateway_config(EXAMPLE_CONFIG).state.backend == "memory"


@pytest.mark.parametrize("quota_slice", [0.0, 0.25], ids=["alone", "on-slices"])
async def test_a_degraded_share_counts_the_requests_still_open_in_redis(
    redis_server: RedisServer, quota_slice: float
) -> None:
    """Tenant s may have 8 requests open. A replica (the fleet's only one: its degraded share
    is all 8) holds 5 on reservations in Redis, alone or on slices, when Redis stops
    answering: on its local share it admits 3 more, not 8, and one more when one of the
    5 closes."""
    store = await _store(
        redis_server, f"deg{random.randrange(1 << 30)}:", quota_slice=quota_slice, settings=SLICED
    )
    in_redis = [
        await store.reserve("s", "interactive", demand_ms=1.0, now=0.0, redis_now=10.0) for _ in range(5)
    ]
    assert (store.remote_reservations, store.slices_claimed) == ((5, 0) if quota_slice == 0.0 else (3, 3))
    store.fleet.failed(TimeoutError("Redis stopped answering"))  # what a failed call does
    assert store.degraded
    local = [await store.reserve("s", "interactive", demand_ms=1.0, now=0.0) for _ in range(3)]
    with pytest.raises(ResourceExhausted) as refused:
        await store.reserve("s", "interactive", demand_ms=1.0, now=0.0)
    assert refused.value.rule == "quota.concurrency"
    assert "8 requests of class 'interactive' are open (limit 8)" in str(refused.value)
    assert store.settle(in_redis.pop(), charged_ms=1.0, now=0.0) is not None
    local.append(await store.reserve("s", "interactive", demand_ms=1.0, now=0.0))
    with pytest.raises(ResourceExhausted):
        await store.reserve("s", "interactive", demand_ms=1.0, now=0.0)
    for reservation in in_redis + local:
        assert store.settle(reservation, charged_ms=1.0, now=0.0) is not None
    await store.fleet.client.aclose()
