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

import asyncio
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from gateway import clock
from gateway.config import StateConfig
from gateway.core.errors import PermissionDenied, ResourceExhausted
from gateway.core.quota import AccountTerms, QuotaLedger, QuotaSettings, Reservation, Settlement
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
    return None if settlement is None else msgspec.structs.replace(settlement, reservation_id=0)


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


# Live-token-limited accounts on slices: a slice carries a share of both buckets. No class
# share, so nothing is borrowed and each bucket alone bounds what its account is admitted.
LIVE_SLICED = QuotaSettingsSchema.model_validate(
    {
        "tenants": {
            "m": {
                "interactive": {
                    "accelerator_ms_per_s": 100.0,
                    "burst_ms": 200.0,
                    "live_token_ms_per_s": 1000.0,
                    "live_token_burst_ms": 2000.0,
                    "max_concurrent": 16,
                }
            },
            "n": {
                "interactive": {
                    "accelerator_ms_per_s": 50.0,
                    "live_token_ms_per_s": 400.0,
                    "max_concurrent": 12,
                }
            },
            "w": {
                "interactive": {
                    "accelerator_ms_per_s": 100.0,
                    "burst_ms": 200.0,
                    "live_token_ms_per_s": 1000.0,
                }
            },
        },
    }
).value()
LIVE_ACCOUNTS = ("m", "n")


async def _redis_levels(
    store: RedisQuotaStore, tenant: str, request_class: str, now: float
) -> tuple[float, float]:
    """The account's accelerator-ms and live-token-ms levels in Redis at ``now`` (the script clock)."""
    terms = store.terms(tenant, request_class)
    assert terms.live_token_rate_ms_per_s is not None and terms.live_token_capacity_ms is not None
    acct = store.keys(terms)[0]
    live, updated = await store.fleet.client.hmget(acct, "llvl", "lupd")
    if live is None:
        live_level = terms.live_token_capacity_ms
    else:
        refill = terms.live_token_rate_ms_per_s * max(0.0, now - float(updated))
        live_level = min(terms.live_token_capacity_ms, float(live) + refill)
    return await _redis_level(store, tenant, request_class, now), live_level


def _held(stores: list[RedisQuotaStore], tenant: str) -> tuple[float, float]:
    """What the replicas' slices of the account hold unspent (taken from Redis, not yet
    admitted on nor returned): accelerator-ms and live-token-ms."""
    pieces = [p for s in stores for p in s._slices.get((tenant, "interactive"), ()) if not p.closed]
    return sum(p.left_ms for p in pieces), sum(p.live_left_ms for p in pieces)


def _exact_refusal(
    error: ResourceExhausted,
    levels: tuple[float, float],
    units: int,
    demand: tuple[float, float],
    terms: AccountTerms,
) -> bool:
    """The refusal an exact reservation in Redis gives: the binding bucket's level in Redis
    (what the slices hold apart) does not cover the request, or the concurrency is held."""
    (level, live_level), (demand_ms, live_ms) = levels, demand
    assert terms.live_token_capacity_ms is not None and terms.max_concurrent is not None
    if error.rule == "quota.accelerator_ms":
        return level < min(demand_ms, terms.capacity_ms) - 1e-6
    if error.rule == "quota.live_token_ms":
        return live_level < min(live_ms, terms.live_token_capacity_ms) - 1e-6
    return error.rule == "quota.concurrency" and units + 1 > terms.max_concurrent


async def _fleet(
    redis_server: RedisServer, prefix: str, replicas: int = 2
) -> tuple[list[RedisQuotaStore], list[list[float]]]:
    stores = [
        await _store(redis_server, prefix, quota_slice=0.25, settings=LIVE_SLICED, replica=f"r{i}")
        for i in range(replicas)
    ]
    return stores, [script_clock(s) for s in stores]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_slices_with_a_live_token_bucket_keep_the_core_ledgers_books(
    redis_server: RedisServer, seed: int
) -> None:
    """Two replicas on slices against the core ledger, at instants (no refill between two
    operations, so the books must balance exactly): every request the fleet admits, the
    ledger admits too; after every operation each bucket's level in the ledger equals its
    level in Redis plus what the replicas' slices hold unspent; and every refusal is the one
    an exact reservation in Redis gives (the fleet refuses only what its slices hold apart).
    Between instants everything settles and the slices return: the buckets refill in full."""
    rng = random.Random(seed)
    stores, clocks = await _fleet(redis_server, f"lsd{seed}x{random.randrange(1 << 30)}:")
    ledger = QuotaLedger(LIVE_SLICED)
    admitted = on_slice = refused = 0
    rules: set[str] = set()
    for round_ in range(8):
        now = 10.0 * (round_ + 1)  # the buckets refill in 2 s: full at every round's start
        for at in clocks:
            at[0] = now
        open_pairs: list[tuple[Reservation, Reservation, RedisQuotaStore]] = []
        for _ in range(60):
            op = rng.random()
            if op < 0.6 or not open_pairs:
                store = rng.choice(stores)
                tenant = rng.choice(LIVE_ACCOUNTS)
                demand = rng.choice([1.0, 2.0, 4.0, 9.0, 20.0, 30.0, 60.0])  # slices: m 50 ms, n 25 ms
                live = rng.choice([0.0, 20.0, 40.0, 80.0, 120.0, 180.0, 450.0, 700.0])  # m 500, n 200
                try:
                    theirs = await store.reserve(
                        tenant, "interactive", demand_ms=demand, live_token_ms=live, now=now, redis_now=now
                    )
                except ResourceExhausted as error:
                    await asyncio.gather(*(s.fleet.drain() for s in stores))
                    levels = await _redis_levels(store, tenant, "interactive", now)
                    units = (await _open_units(store, tenant, "interactive"))[1]
                    terms = store.terms(tenant, "interactive")
                    assert _exact_refusal(error, levels, units, (demand, live), terms), (error, levels, units)
                    refused += 1
                    rules.add(error.rule or "")
                    continue
                mine = ledger.reserve(tenant, "interactive", demand_ms=demand, live_token_ms=live, now=now)
                open_pairs.append((mine, theirs, store))
                admitted += 1
                on_slice += theirs.id < 0  # the store numbers the requests on slices below zero
            elif op < 0.95:
                mine, theirs, store = open_pairs.pop(rng.randrange(len(open_pairs)))
                if rng.random() < 0.3:
                    expected, got = ledger.release(mine, now=now), store.release(theirs, now=now)
                else:
                    charged, charged_live = (
                        mine.demand_ms * rng.choice([0.0, 0.5, 1.0]),
                        mine.live_token_ms * rng.choice([0.0, 0.5, 1.0]),
                    )
                    expected = ledger.settle(
                        mine, charged_ms=charged, charged_live_token_ms=charged_live, now=now
                    )
                    got = store.settle(
                        theirs, charged_ms=charged, charged_live_token_ms=charged_live, now=now
                    )
                assert expected is not None and _comparable(got) == _comparable(expected)
            else:
                rng.choice(stores).retire_slices(older_than_s=0.0)  # a heartbeat retires them
            await asyncio.gather(*(s.fleet.drain() for s in stores))
            for tenant in LIVE_ACCOUNTS:
                view = ledger.available(tenant, "interactive", now=now)
                level, live_level = await _redis_levels(stores[0], tenant, "interactive", now)
                held, live_held = _held(stores, tenant)
                assert level + held == pytest.approx(view.available_accelerator_ms, abs=1e-6)
                assert live_level + live_held == pytest.approx(view.available_live_token_ms, abs=1e-6)
        for mine, theirs, store in open_pairs:
            assert ledger.settle(mine, charged_ms=mine.demand_ms, now=now) is not None
            assert store.settle(theirs, charged_ms=theirs.demand_ms, now=now) is not None
        for store in stores:
            await store.drain()  # returns every slice
        assert (await stores[0].fleet_outstanding(redis_now=now)).count == 0
        for tenant in LIVE_ACCOUNTS:
            view = ledger.available(tenant, "interactive", now=now)
            assert _held(stores, tenant) == (0.0, 0.0)
            level, live_level = await _redis_levels(stores[0], tenant, "interactive", now)
            assert level == pytest.approx(view.available_accelerator_ms, abs=1e-6)
            assert live_level == pytest.approx(view.available_live_token_ms, abs=1e-6)
    claimed = sum(s.slices_claimed for s in stores)
    print(
        f"seed {seed}: {admitted} admitted ({on_slice} on slices, {claimed} slices), "
        f"{refused} refused {sorted(rules)}"
    )
    assert on_slice > admitted / 3 and claimed > 10  # many requests were admitted on slices
    assert {"quota.accelerator_ms", "quota.live_token_ms"} <= rules  # both buckets bound
    for store in stores:
        await store.fleet.client.aclose()


@pytest.mark.parametrize("seed", [4, 5, 6])
async def test_slices_keep_a_fleet_within_both_buckets_over_time(
    redis_server: RedisServer, seed: int
) -> None:
    """Two replicas on slices, time running, requests charged up to 1.7x their prediction
    in either bucket: for each account and each bucket, what the fleet has admitted since
    the start (charged when closed, predicted while open) never exceeds the burst plus the
    refill since the start plus the observed excess over predictions -- the bound of
    ``QuotaLedger``'s buckets, for live-token-ms exactly as for accelerator-ms -- and what
    Redis, the slices and the admitted work hold together is what the bucket can have given."""
    rng = random.Random(seed)
    stores, clocks = await _fleet(redis_server, f"lst{seed}x{random.randrange(1 << 30)}:")
    start = now = 50.0
    admitted = {t: [0.0, 0.0] for t in LIVE_ACCOUNTS}  # closed: charged; open: predicted
    excess = {t: [0.0, 0.0] for t in LIVE_ACCOUNTS}
    open_: list[tuple[Reservation, RedisQuotaStore]] = []
    grants = on_slice = refusals = 0

    async def check() -> None:
        await asyncio.gather(*(s.fleet.drain() for s in stores))
        for tenant in LIVE_ACCOUNTS:
            terms = stores[0].terms(tenant, "interactive")
            assert terms.live_token_rate_ms_per_s is not None and terms.live_token_capacity_ms is not None
            given = (
                terms.capacity_ms + terms.rate_ms_per_s * (now - start),
                terms.live_token_capacity_ms + terms.live_token_rate_ms_per_s * (now - start),
            )
            levels = await _redis_levels(stores[0], tenant, "interactive", now)
            held = _held(stores, tenant)
            for b in (0, 1):
                assert admitted[tenant][b] <= given[b] + excess[tenant][b] + 1e-6, (tenant, b)
                assert admitted[tenant][b] + levels[b] + held[b] <= given[b] + 1e-6, (tenant, b)

    for _ in range(400):
        now += rng.choice([0.0, 0.001, 0.01, 0.02, 0.05, 0.1])
        for at in clocks:
            at[0] = now
        op = rng.random()
        if op < 0.6 or not open_:
            store, tenant = rng.choice(stores), rng.choice(LIVE_ACCOUNTS)
            demand = rng.choice([1.0, 4.0, 9.0, 20.0, 60.0])
            live = rng.choice([0.0, 40.0, 120.0, 180.0, 450.0, 700.0])
            try:
                reservation = await store.reserve(
                    tenant, "interactive", demand_ms=demand, live_token_ms=live, now=now, redis_now=now
                )
            except ResourceExhausted:
                refusals += 1
            else:
                admitted[tenant][0] += demand
                admitted[tenant][1] += live
                open_.append((reservation, store))
                grants += 1
                on_slice += reservation.id < 0
        elif op < 0.95:
            reservation, store = open_.pop(rng.randrange(len(open_)))
            tenant = reservation.tenant
            if rng.random() < 0.2:
                charged = charged_live = 0.0
                assert store.release(reservation, now=now) is not None
            else:
                charged = reservation.demand_ms * rng.choice([0.5, 1.0, 1.7])
                charged_live = reservation.live_token_ms * rng.choice([0.5, 1.0, 1.7])
                settled = store.settle(
                    reservation, charged_ms=charged, charged_live_token_ms=charged_live, now=now
                )
                assert settled is not None
            for b, (got, predicted) in enumerate(
                ((charged, reservation.demand_ms), (charged_live, reservation.live_token_ms))
            ):
                admitted[tenant][b] += got - predicted
                excess[tenant][b] += max(0.0, got - predicted)
        else:
            rng.choice(stores).retire_slices(older_than_s=0.0)
        await check()
    for reservation, store in open_:
        assert store.release(reservation, now=now) is not None
        admitted[reservation.tenant][0] -= reservation.demand_ms
        admitted[reservation.tenant][1] -= reservation.live_token_ms
    for store in stores:
        await store.drain()
    await check()
    assert (await stores[0].fleet_outstanding(redis_now=now)).count == 0
    assert all(_held(stores, t) == (0.0, 0.0) for t in LIVE_ACCOUNTS)
    print(f"seed {seed}: {grants} admitted ({on_slice} on slices), {refusals} refused")
    assert on_slice > 30 and grants > 80 and refusals > 30
    for store in stores:
        await store.fleet.client.aclose()


async def test_a_live_token_limited_account_is_admitted_on_a_slice_without_a_round_trip(
    redis_server: RedisServer,
) -> None:
    """Tenant w meters live-token-ms (1,000/s, burst 2,000) and accelerator-ms (100 ms/s,
    burst 200): slices of 50 ms and 500 live-token-ms, taken from both buckets in one script
    call. Requests of 5 ms and 100 live-token-ms: five on a slice (its live-token share binds)
    for one reserve script call; the unused rest of both shares returns when it closes."""
    store = await _store(
        redis_server, f"lrt{random.randrange(1 << 30)}:", quota_slice=0.25, settings=LIVE_SLICED
    )
    script_clock(store)[0] = 10.0
    calls: list[str] = []
    run_script = store.fleet.run_script

    def counted(script: Any, keys: list[str], args: list[str]) -> Any:
        calls.append(script.sha)
        return run_script(script, keys, args)

    store.fleet.run_script = counted  # type: ignore[method-assign]

    async def reserve(live: float = 100.0) -> Reservation:
        return await store.reserve(
            "w", "interactive", demand_ms=5.0, live_token_ms=live, now=0.0, redis_now=10.0
        )

    first = [await reserve() for _ in range(5)]
    assert len(calls) == 1 and (store.remote_reservations, store.slices_claimed) == (1, 1)
    # Both shares were debited in Redis in full by that one call.
    assert await _redis_levels(store, "w", "interactive", 10.0) == (
        pytest.approx(150.0),
        pytest.approx(1500.0),
    )
    view = store.available("w", "interactive", now=clock.now())
    assert 1500.0 - 1e-6 <= view.available_live_token_ms <= 1500.0 + 10.0  # the slice's rest (0) counted
    # The slice's live-token share is spent (5 x 100 of 500): the sixth takes a second slice.
    sixth = await reserve()
    assert len(calls) == 2 and store.slices_claimed == 2
    view = store.available("w", "interactive", now=clock.now())
    assert 1400.0 - 1e-6 <= view.available_live_token_ms <= 1400.0 + 10.0  # 1,000 in Redis + 400 held
    # More live-token-ms than a slice holds: reserved alone, one round trip.
    alone = await reserve(live=600.0)
    assert len(calls) == 3 and (store.remote_reservations, store.slices_claimed) == (3, 2)
    for reservation in first:  # charged 3 ms and 60 live-token-ms each: the first slice closes
        assert store.settle(reservation, charged_ms=3.0, charged_live_token_ms=60.0, now=0.0) is not None
    assert store.release(sixth, now=0.0) is not None
    assert store.settle(alone, charged_ms=5.0, charged_live_token_ms=600.0, now=0.0) is not None
    await store.drain()  # the second slice returns, charged nothing
    assert len(calls) == 3  # closing is sent in the background, nobody waits on it
    assert (await store.fleet_outstanding(redis_now=10.0)).count == 0
    assert await _redis_levels(store, "w", "interactive", 10.0) == (
        pytest.approx(200.0 - 5 * 3.0 - 5.0),
        pytest.approx(2000.0 - 5 * 60.0 - 600.0),
    )
    await store.fleet.client.aclose()


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
