"""The dispatch queue: earliest deadline first, bounded, late binding, cancellation-safe."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.dispatch import JOIN_LEAD_S, BatchShape, Waiter
from gateway.core.dispatch import DispatchQueue as CoreQueue
from gateway.core.dispatch import Slot as CoreSlot
from gateway.core.errors import DeadlineExpired, ResourceExhausted
from gateway.core.profile import DemandProfile
from gateway.scheduler import DeviceSet, DispatchQueue
from orchid_tools.virtual_time import now, virtual_time


@virtual_time
async def test_waiters_are_served_least_slack_first() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=10)
    t0 = now()
    holder = await queue.acquire(latest_start=t0 + 10, cost_ms=5)
    order: list[str] = []
    waiting = {
        n: queue.submit(latest_start=t0 + d, cost_ms=1) for n, d in (("late", 9), ("early", 2), ("mid", 5))
    }
    passed_on(waiting, order)
    assert queue.queued == 3
    assert queue.predicted_wait_ms(now()) > 0
    holder.release()
    await asyncio.gather(*waiting.values())
    assert order == ["early", "mid", "late"]
    assert (queue.inflight, queue.queued, queue.queued_ms) == (0, 0, 0.0)


@virtual_time
async def test_queue_is_bounded() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=1)
    t0 = now()
    held = await queue.acquire(latest_start=t0 + 5, cost_ms=1)
    waiting = queue.submit(latest_start=t0 + 5, cost_ms=1)
    with pytest.raises(ResourceExhausted) as full:
        await queue.acquire(latest_start=t0 + 5, cost_ms=1)
    assert full.value.rule == "queue.full"
    held.release()
    (await waiting).release()


@virtual_time
async def test_latest_start_bounds_the_wait_and_leaves_nothing_behind() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=4)
    t0 = now()
    held = await queue.acquire(latest_start=t0 + 5, cost_ms=1)
    with pytest.raises(DeadlineExpired):
        await queue.acquire(latest_start=t0 + 0.05, cost_ms=1)
    assert queue.queued == 0
    held.release()
    # The slot is free again for a new arrival: no stale waiter blocks it.
    again = await queue.acquire(latest_start=now() + 0.05, cost_ms=1)
    again.release()
    assert queue.inflight == 0


@virtual_time
async def test_cancelled_waiter_is_removed_and_slot_passes_on() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=4)
    t0 = now()
    held = await queue.acquire(latest_start=t0 + 5, cost_ms=1)
    cancelled = queue.submit(latest_start=t0 + 5, cost_ms=1)
    patient = queue.submit(latest_start=t0 + 5, cost_ms=1)
    cancelled.cancel()
    held.release()
    slot = await asyncio.wait_for(patient, 1)
    assert queue.queued == 0
    slot.release()
    slot.release()  # idempotent
    assert queue.inflight == 0


def passed_on(waiting: dict[str, asyncio.Future[CoreSlot]], order: list[str]) -> None:
    """Note each grant's name in ``order`` as it comes, and release the slot at once."""
    for name, future in waiting.items():

        def granted(done: asyncio.Future[CoreSlot], name: str = name) -> None:
            order.append(name)
            done.result().release(now())

        future.add_done_callback(granted)


async def _drain(waiting: dict[asyncio.Future[CoreSlot], str], grants: int) -> list[str]:
    """Run ``grants`` turns of a one-slot pool; return the tenant of each grant in order."""
    order: list[str] = []
    pending = set(waiting)
    while len(order) < grants:
        # Bounded (virtual time: a deadlock fails at once instead of hanging the run).
        done, pending = await asyncio.wait(pending, timeout=60.0, return_when=asyncio.FIRST_COMPLETED)
        assert done, f"no grant within 60 s after {order}"
        for future in done:
            order.append(waiting[future])
            future.result().release(now())
    return order


@virtual_time
async def test_tenants_share_a_pool_by_weight_not_by_request_size() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=1000)
    t0 = now()
    holder = await queue.acquire(latest_start=t0 + 60, cost_ms=1)

    def one(tenant: str, weight: float, cost: float) -> asyncio.Future[CoreSlot]:
        return queue.submit(
            latest_start=t0 + 60, cost_ms=cost, request_class="interactive", tenant=tenant, weight=weight
        )

    # "big" sends requests 4x the size of "small"'s; weights are 2 : 1.
    waiting = {one("big", 2.0, 40.0): "big" for _ in range(60)}
    waiting |= {one("small", 1.0, 10.0): "small" for _ in range(200)}
    holder.release()
    order = await _drain(waiting, 120)
    granted = {t: queue.granted_ms.get(("interactive", t), 0.0) for t in ("big", "small")}
    # Accelerator-ms, not request counts, follow the weights (2 : 1) within 10 %.
    assert granted["big"] / granted["small"] == pytest.approx(2.0, rel=0.10)
    assert order.count("small") > order.count("big")  # ... so the small-request tenant gets more turns
    for future in waiting:
        future.cancel()


@virtual_time
async def test_large_job_is_not_starved_by_a_stream_of_small_ones() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=1000)
    t0 = now()
    holder = await queue.acquire(latest_start=t0 + 60, cost_ms=1)

    def one(tenant: str, cost: float, deadline_s: float) -> asyncio.Future[CoreSlot]:
        return queue.submit(
            latest_start=t0 + deadline_s, cost_ms=cost, request_class="interactive", tenant=tenant
        )

    # The large job has the latest start and 20x the cost; the other tenant floods.
    waiting = {one("flood", 5.0, 1.0): "flood" for _ in range(300)}
    waiting[one("large", 100.0, 59.0)] = "large"
    holder.release()
    order = await _drain(waiting, 40)
    assert "large" in order  # served within 40 turns, not after all 300 small ones
    for future in waiting:
        future.cancel()


@virtual_time
async def test_control_slice_is_reserved() -> None:
    queue = DispatchQueue("q", devices=2, slots=2, max_queued=10, reserved_control=1)
    t0 = now()
    first = await queue.acquire(latest_start=t0 + 5, cost_ms=1, request_class="interactive")
    # The last slot is control's: ordinary work waits (here: until its latest start) ...
    with pytest.raises(DeadlineExpired):
        await queue.acquire(latest_start=now() + 0.05, cost_ms=1, request_class="batch")
    # ... control work gets it at once.
    control = await queue.acquire(latest_start=t0 + 5, cost_ms=1, request_class="control")
    control.release()
    first.release()
    assert queue.inflight == 0 and queue.queued == 0


# -------------------------------------------------------------- binding ahead (rule 6)


@virtual_time
async def test_work_is_bound_ahead_only_when_it_starts_in_time() -> None:
    """Two devices busy with long work and two free dispatch slots: a short request whose
    latest start comes before either device frees waits here, not in the backend's queue,
    and binds the moment a device frees."""
    queue = DispatchQueue("q", devices=2, slots=4, max_queued=10)
    t0 = now()
    longs = [await queue.acquire(latest_start=t0 + 60, cost_ms=10_000) for _ in range(2)]
    short = queue.submit(latest_start=t0 + 5, cost_ms=10)
    assert not short.done(), "bound behind 10 s of work although its latest start is 5 s away"
    assert (queue.inflight, queue.queued) == (2, 1) and queue.held_back >= 1
    longs[0].release()  # a device frees: the short one starts on it at once
    slot = await asyncio.wait_for(short, 1)
    assert slot.predicted_start <= now()
    slot.release()
    longs[1].release()


@virtual_time
async def test_binding_ahead_predicts_the_start_from_the_devices_work() -> None:
    """One device busy for ~50 ms: a request with room binds ahead into the second slot,
    predicted to start when the device frees; a new arrival's predicted wait counts both."""
    queue = DispatchQueue("q", devices=1, slots=2, max_queued=10)
    t0 = now()
    running = await queue.acquire(latest_start=t0 + 5, cost_ms=50)
    ahead = await queue.acquire(latest_start=t0 + 5, cost_ms=30)
    assert ahead.predicted_start == pytest.approx(running.predicted_start + 0.05, abs=1e-9)
    assert queue.predicted_wait_ms(now()) == pytest.approx(80)
    running.release()  # early: the bound-ahead work starts now, not at its predicted time
    assert ahead.predicted_start <= now()
    assert queue.predicted_wait_ms(now()) == pytest.approx(30)
    ahead.release()
    assert queue.predicted_wait_ms(now()) == 0.0


@virtual_time
async def test_one_request_at_a_time_waits_in_the_backends_queue() -> None:
    """Unstarted work already bound ahead: the next request is not bound behind it (Triton
    would co-batch the two when the device frees, and the first would finish with the
    whole padded batch, later than predicted)."""
    queue = DispatchQueue("q", devices=1, slots=3, max_queued=10)
    t0 = now()
    running = await queue.acquire(latest_start=t0 + 60, cost_ms=20)
    bound_ahead = await queue.acquire(latest_start=t0 + 60, cost_ms=200)
    third = queue.submit(latest_start=t0 + 60, cost_ms=20)
    assert not third.done(), "bound into the backend's queue beside unstarted work"
    running.release()  # the bound-ahead request starts on the device; the third may queue behind it
    slot = await asyncio.wait_for(third, 1)
    assert slot.predicted_start == pytest.approx(bound_ahead.predicted_start + 0.2, abs=1e-9)
    slot.release()
    bound_ahead.release()


@virtual_time
async def test_predicted_wait_counts_earlier_latest_starts_only() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=10)
    t0 = now()
    holder = await queue.acquire(latest_start=t0 + 60, cost_ms=100)
    late = queue.submit(latest_start=t0 + 30, cost_ms=500)
    t = now()
    assert queue.predicted_wait_ms(t, latest_start=t0 + 1) < 150  # goes before the 500 ms
    assert queue.predicted_wait_ms(t, latest_start=t0 + 40) > 500
    assert queue.predicted_wait_ms(t) > 500
    holder.release()
    (await late).release()


@virtual_time
async def test_pools_on_shared_devices_see_each_others_work() -> None:
    """The fallback placed on the primary's device: its queue counts the primary's work,
    holds a request that would start too late, and wakes when the primary's slot frees."""
    devices = DeviceSet(1)
    primary = DispatchQueue("full", devices=1, slots=2, max_queued=10, device_set=devices)
    fallback = DispatchQueue("compact", devices=1, slots=2, max_queued=10, device_set=devices)
    t0 = now()
    running = await primary.acquire(latest_start=t0 + 60, cost_ms=5_000)
    assert fallback.predicted_wait_ms(now()) > 4_000
    waiting = fallback.submit(latest_start=t0 + 2, cost_ms=10)
    assert not waiting.done(), "bound onto a device the other pool holds for 5 s"
    running.release()
    slot = await asyncio.wait_for(waiting, 1)
    assert slot.predicted_start <= now()
    slot.release()
    assert fallback.predicted_wait_ms(now()) == 0.0


@virtual_time
async def test_a_freed_shared_device_goes_to_the_most_urgent_pool() -> None:
    """Two pools on one shared device, each with a waiter: when the primary's slot frees,
    the fallback's waiter with the earlier latest start gets the device, not the primary's own."""
    devices = DeviceSet(1)
    primary = DispatchQueue("full", devices=1, slots=1, max_queued=10, device_set=devices)
    fallback = DispatchQueue("compact", devices=1, slots=1, max_queued=10, device_set=devices)
    t0 = now()
    running = await primary.acquire(latest_start=t0 + 60, cost_ms=5_000)
    relaxed = primary.submit(latest_start=t0 + 30, cost_ms=10)
    urgent = fallback.submit(latest_start=t0 + 2, cost_ms=10)
    t = now()
    with_urgent = primary.predicted_wait_ms(t, latest_start=t0 + 10)
    bound_only = primary.predicted_wait_ms(t, latest_start=t0 + 1)
    assert bound_only > 4_000 and fallback.queued == 1
    assert with_urgent - bound_only == pytest.approx(10)  # the other pool's urgent waiter
    running.release()
    slot = await asyncio.wait_for(urgent, 1)
    behind = await asyncio.wait_for(relaxed, 1)  # bound ahead, behind the urgent one
    assert slot.predicted_start <= now() < behind.predicted_start
    assert behind.predicted_start == pytest.approx(slot.predicted_start + 0.01, abs=1e-9)
    slot.release()
    behind.release()


@virtual_time
async def test_a_long_request_goes_before_short_ones_that_can_still_wait() -> None:
    """Least slack first: a long request near its latest start goes before short requests
    that arrived later with nearer deadlines but more slack (plain EDF would keep the long
    one waiting until its latest start had passed)."""
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=10)
    t0 = now()
    holder = await queue.acquire(latest_start=t0 + 60, cost_ms=5)
    order: list[str] = []

    def wait(deadline_s: float, cost_ms: float) -> asyncio.Future[CoreSlot]:
        return queue.submit(latest_start=t0 + deadline_s - cost_ms / 1000.0, cost_ms=cost_ms)

    # Deadline 0.5 s, 0.4 s of work: latest start 0.1 s. Shorts: deadline 0.2 s, 10 ms of work.
    waiting = {"long": wait(0.5, 400.0)} | {f"short{i}": wait(0.2, 10.0) for i in range(3)}
    passed_on(waiting, order)
    holder.release()
    await asyncio.gather(*waiting.values())
    assert order[0] == "long"


@virtual_time
async def test_long_work_never_takes_the_short_lane() -> None:
    """Rule 7: with a one-device short lane, long requests hold at most 3 of 4 devices; a
    fourth long request waits for a long one to end while a short request starts at once."""
    queue = DispatchQueue("q", devices=4, slots=8, max_queued=10)
    queue.device_set.short_lane = 1
    t0 = now()
    (await queue.acquire(latest_start=t0 + 10, cost_ms=28)).release()  # short work is about
    longs = [await queue.acquire(latest_start=t0 + 10, cost_ms=200, long=True) for _ in range(3)]
    assert queue.device_set.long_bound() == 3
    fourth = queue.submit(latest_start=t0 + 10, cost_ms=200, long=True)
    assert queue.queued == 1 and not fourth.done()
    # Its predicted start is when the first long request ends, not now (a device is free).
    assert queue.predicted_wait_ms(now(), cost_ms=200, long=True) > 150
    assert queue.predicted_wait_ms(now(), cost_ms=28) == 0.0
    short = await queue.acquire(latest_start=t0 + 10, cost_ms=28)  # the lane is free: at once
    assert queue.queued == 1 and not fourth.done()
    longs[0].release()  # a long device frees: the waiting long request takes it
    granted = await fourth
    assert queue.device_set.long_bound() == 3
    for slot in (*longs[1:], granted, short):
        slot.release()
    assert queue.inflight == 0 and queue.queued == 0


@virtual_time
async def test_without_short_work_the_lane_is_not_kept_idle() -> None:
    """The lane is kept only while short work asks for devices: long-only traffic uses all."""
    queue = DispatchQueue("q", devices=4, slots=8, max_queued=10)
    queue.device_set.short_lane = 1
    t0 = now()
    longs = [await queue.acquire(latest_start=t0 + 10, cost_ms=200, long=True) for _ in range(4)]
    assert queue.device_set.long_bound() == 4 and queue.queued == 0
    for slot in longs:
        slot.release()


@virtual_time
async def test_a_full_queue_makes_room_by_refusing_the_flooders_least_urgent_waiter() -> None:
    """Longest-queue drop: a tenant with less queued work per unit of weight is not refused
    because a flooder filled the queue; the flooder's least urgent waiter leaves instead."""
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=3)
    t0 = now()
    held = await queue.acquire(latest_start=t0 + 10, cost_ms=10)
    flood = [queue.submit(latest_start=t0 + 5 + i, cost_ms=10, tenant="lumen") for i in range(3)]
    assert queue.queued == 3
    mine = queue.submit(latest_start=t0 + 6, cost_ms=10, tenant="orchid", weight=2)
    assert queue.queued == 3 and queue.pushed_out == 1
    with pytest.raises(ResourceExhausted) as pushed:
        await flood[2]  # the flooder's latest latest-start
    assert pushed.value.rule == "queue.full" and (pushed.value.retry_after_ms or 0) > 0
    # The flooder cannot push out the tenant with less queued work.
    with pytest.raises(ResourceExhausted):
        await queue.acquire(latest_start=t0 + 5, cost_ms=10, tenant="lumen")
    held.release()
    pending: set[asyncio.Future[CoreSlot]] = {*flood[:2], mine}
    while pending:  # each granted in turn as the one before releases
        done, pending = await asyncio.wait(pending, timeout=60.0, return_when=asyncio.FIRST_COMPLETED)
        assert done, "a waiter was never granted"
        for task in done:
            task.result().release(now())
    assert queue.inflight == 0 and queue.queued == 0


# ---------------------------------------------------------------- the core, driven by hand
# ``gateway.core.dispatch`` is a state machine: no event loop, no clock. These drive it
# directly with explicit times, as the simulator's and the runtime's drivers do.


def test_core_grants_at_once_then_queues_and_grants_on_release() -> None:
    queue = CoreQueue("q", devices=1, slots=1, max_queued=10)
    first = queue.request(0.0, latest_start=1.0, cost_ms=100)
    assert isinstance(first, CoreSlot) and first.started_at == 0.0
    second = queue.request(0.01, latest_start=1.0, cost_ms=100)
    assert isinstance(second, Waiter) and second.slot is None
    assert queue.device_set.take_changes() == []
    first.release(0.1)
    assert queue.device_set.take_changes() == [second]
    assert second.slot is not None and second.slot.started_at == 0.1
    assert queue.queued == 0


def test_core_withdrawn_waiter_holds_nothing_and_a_late_grant_is_returned() -> None:
    queue = CoreQueue("q", devices=1, slots=1, max_queued=10)
    holder = queue.request(0.0, latest_start=1.0, cost_ms=100)
    assert isinstance(holder, CoreSlot)
    gone = queue.request(0.0, latest_start=0.05, cost_ms=10)
    kept = queue.request(0.0, latest_start=1.0, cost_ms=10)
    assert isinstance(gone, Waiter) and isinstance(kept, Waiter)
    assert queue.withdraw(gone, 0.05) is None  # its latest start passed: it leaves, holding nothing
    holder.release(0.1)
    assert queue.device_set.take_changes() == [kept]  # the withdrawn one is never granted
    # Granted in the same instant its driver gave up: withdraw hands the slot back to release.
    assert kept.slot is not None
    assert queue.withdraw(kept, 0.1) is kept.slot


def test_core_full_queue_refuses_the_flooders_least_urgent_waiter() -> None:
    queue = CoreQueue("q", devices=1, slots=1, max_queued=2)
    assert isinstance(queue.request(0.0, latest_start=9.0, cost_ms=10), CoreSlot)
    early = queue.request(0.0, latest_start=5.0, cost_ms=10, tenant="lumen")
    late = queue.request(0.0, latest_start=6.0, cost_ms=10, tenant="lumen")
    mine = queue.request(0.0, latest_start=5.5, cost_ms=10, tenant="orchid")
    assert isinstance(mine, Waiter) and isinstance(late, Waiter) and isinstance(early, Waiter)
    assert queue.device_set.take_changes() == [late]
    assert late.refused is not None and late.refused.rule == "queue.full"
    assert early.refused is None and mine.refused is None and queue.pushed_out == 1
    assert queue.queued == 2  # lumen's early one and orchid's: one each
    with pytest.raises(ResourceExhausted):  # lumen now holds no more than orchid: plain full
        queue.request(0.0, latest_start=7.0, cost_ms=10, tenant="lumen")


def test_predicted_wait_counts_work_other_replicas_bound() -> None:
    """In a fleet, the devices also run what the other replicas bound (``remote_ends``): a new
    arrival's predicted wait counts it, so admission here judges a deadline against the work
    really ahead on the shared backend, not this replica's half of it. Binding itself is not
    held back by it (the fleet's slot leases bound that)."""
    queue = CoreQueue("q", devices=2, slots=4, max_queued=10)
    t = 100.0
    assert queue.predicted_wait_ms(t) == 0.0
    queue.device_set.remote_ends["q"] = (t + 0.050, t + 0.080)  # both devices busy elsewhere
    assert queue.predicted_wait_ms(t) == pytest.approx(50.0)
    local = queue.request(t, latest_start=t + 1.0, cost_ms=30.0)
    assert isinstance(local, CoreSlot)  # bound at once: remote work gates no local binding
    # The local request queues behind the first remote end (50 ms), ending at 80 ms: both
    # devices then free at 80 ms.
    assert queue.predicted_wait_ms(t) == pytest.approx(80.0)
    # Another pool on the same devices (a fallback beside the primary) counts too; ends
    # already past are work that finished.
    queue.device_set.remote_ends["q"] = (t - 0.010,)
    queue.device_set.remote_ends["fallback"] = (t + 0.020,)
    # One device busy elsewhere until 20 ms, the local 30 ms request on the other: 20 ms.
    assert queue.predicted_wait_ms(t) == pytest.approx(20.0)
    queue.device_set.remote_ends["fallback"] = (t + 0.020, t + 0.040)
    assert queue.predicted_wait_ms(t) == pytest.approx(40.0)  # local 30 ms after the 20 ms remote
    queue.device_set.remote_ends.clear()
    assert queue.predicted_wait_ms(t) == 0.0  # one device idle: the local request holds the other


@pytest.mark.parametrize("seed", range(20))
def test_free_times_are_the_list_schedules_free_times(seed: int) -> None:
    """``free_times`` (floats only, on every prediction and release) is ``schedule`` reduced to
    each device's free time: the same times, and with ``replan`` the same moved starts."""

    rng = random.Random(seed)
    devices = rng.randint(1, 4)
    now = 10.0
    pair = [DeviceSet(devices), DeviceSet(devices)]
    queues = [CoreQueue("q", devices=devices, slots=8, max_queued=1, device_set=d) for d in pair]
    for _ in range(rng.randint(0, 8)):
        cost_ms = rng.choice([0.0, 1.0, 5.0, rng.uniform(0, 50)])
        start = now + rng.choice([-0.03, -0.001, 0.0, 0.002, rng.uniform(-0.05, 0.05)])
        live = rng.choice([0, 10, 20])
        for queue in queues:
            slot = CoreSlot(queue, cost_ms, now - 0.1, start, live_bytes=live)
            queue.device_set.bound[slot] = None
    ends = {"r": (now + 0.004, now - 1.0, now + 0.02)} if rng.random() < 0.5 else {}
    for device_set in pair:
        device_set.remote_ends = dict(ends)
    for fleet in (False, True):
        expected = sorted(d.free_at for d in pair[0].schedule(now, fleet=fleet))
        assert sorted(pair[1].free_times(now, fleet=fleet)) == expected
    expected = sorted(d.free_at for d in pair[0].schedule(now, replan=True))
    got = pair[1].free_times(now, replan=True)
    assert sorted(got) == expected and got[0] == min(got)  # a heap
    starts = [[slot.predicted_start for slot in d.bound] for d in pair]
    assert starts[0] == starts[1]


def test_long_work_takes_the_soft_lane_only_when_waiting_would_make_it_late() -> None:
    """Rule 7's soft lane (core queue, ``now`` passed in): with a one-device short lane and one
    soft-lane device, long requests hold two of four devices while they can wait for one of
    those two; one whose wait would start it later than a tenth of its run before its latest
    start takes the third device at once; the fourth is never theirs."""
    queue = CoreQueue("q", devices=4, slots=8, max_queued=10)
    queue.device_set.short_lane, queue.device_set.short_lane_soft = 1, 1
    t = 100.0
    short = queue.request(t, latest_start=t + 1.0, cost_ms=28)  # short work is about: lanes kept
    assert isinstance(short, CoreSlot)
    short.release(t)
    held = [queue.request(t, latest_start=t + 10.0, cost_ms=200, long=True) for _ in range(2)]
    assert all(isinstance(slot, CoreSlot) for slot in held)  # end at t + 0.2
    # Slack to wait for one of the two: it waits, two devices free or not.
    patient = queue.request(t, latest_start=t + 0.25, cost_ms=200, long=True)
    assert isinstance(patient, Waiter) and patient.slot is None
    assert queue.predicted_wait_ms(t, latest_start=t + 0.25, cost_ms=200, long=True) == pytest.approx(200)
    # Waiting for them would start it at t + 0.2, after t + 0.21 - 0.1 x 200 ms: the soft lane.
    assert queue.predicted_wait_ms(t, latest_start=t + 0.21, cost_ms=200, long=True) == 0.0
    urgent = queue.request(t, latest_start=t + 0.21, cost_ms=200, long=True)
    assert isinstance(urgent, Waiter) and urgent.slot is not None  # granted as it was queued
    assert queue.device_set.long_bound() == 3
    # The short lane's own device is never long work's, however urgent.
    too_late = queue.request(t, latest_start=t + 0.05, cost_ms=200, long=True)
    assert isinstance(too_late, Waiter) and too_late.slot is None
    second_short = queue.request(t, latest_start=t + 1.0, cost_ms=28)  # the lane: at once
    assert isinstance(second_short, Waiter) and second_short.slot is not None
    assert queue.withdraw(too_late, t + 0.05) is None  # its driver gives up at its latest start
    # A long device frees, but the urgent request holds a soft-cap place: the patient one waits
    # for the next, predicted in time for it; it takes that one.
    held[0].release(t + 0.2)
    assert patient.slot is None
    held[1].release(t + 0.2)
    assert patient.slot is not None
    assert queue.device_set.long_bound() == 2 and queue.queued == 0


def test_one_long_request_per_wake_up() -> None:
    """Two long requests sent to the backend in the same instant would be co-batched (one
    padded batch, about twice the time): a wake-up that could bind two binds one, and the
    other waits for the next device to free."""
    queue = CoreQueue("q", devices=4, slots=8, max_queued=10)
    queue.device_set.short_lane, queue.device_set.short_lane_soft = 0, 2  # soft cap 2, hard cap 4
    t = 100.0
    short = queue.request(t, latest_start=t + 1.0, cost_ms=28)
    assert isinstance(short, CoreSlot)
    short.release(t)
    held = [queue.request(t, latest_start=t + 10.0, cost_ms=200, long=True) for _ in range(2)]
    assert all(isinstance(slot, CoreSlot) for slot in held)  # predicted to end at t + 0.2
    waiting = [queue.request(t, latest_start=t + 0.3, cost_ms=200, long=True) for _ in range(2)]
    assert all(isinstance(w, Waiter) and w.slot is None for w in waiting)  # not urgent yet
    # At t + 0.29 the two held requests overran their prediction: both waiters are urgent now,
    # and two devices are free. A short arrival wakes the queue.
    arrival = queue.request(t + 0.29, latest_start=t + 0.35, cost_ms=28)
    assert [w.slot is not None for w in waiting] == [True, False]
    assert isinstance(arrival, Waiter) and arrival.slot is not None  # the other free device
    assert queue.device_set.long_bound() == 3


def test_another_replicas_long_work_counts_against_the_short_lane() -> None:
    """Rule 7 across a fleet: long work the other replicas bound (``remote_long_ends``, from the
    fleet's exchange) holds devices here too, so two replicas together keep the short lanes
    one replica would keep."""
    queue = CoreQueue("q", devices=4, slots=8, max_queued=10)
    queue.device_set.short_lane, queue.device_set.short_lane_soft = 1, 1
    t = 100.0
    short = queue.request(t, latest_start=t + 1.0, cost_ms=28)
    assert isinstance(short, CoreSlot)
    short.release(t)
    queue.device_set.remote_long_ends["q"] = (t + 0.2, t + 0.2)  # the other replica's two
    assert queue.device_set.long_bound(t) == 2 and queue.device_set.long_bound() == 0
    patient = queue.request(t, latest_start=t + 10.0, cost_ms=200, long=True)
    assert isinstance(patient, Waiter) and patient.slot is None  # the fleet's soft cap is full
    assert queue.predicted_wait_ms(t, latest_start=t + 10.0, cost_ms=200, long=True) == pytest.approx(200)
    # Their predicted ends pass: the cap is free again.
    assert queue.device_set.long_bound(t + 0.3) == 0
    queue.device_set.remote_long_ends.clear()
    assert queue.withdraw(patient, t + 0.01) is None
    assert isinstance(queue.request(t + 0.01, latest_start=t + 10.0, cost_ms=200, long=True), CoreSlot)


# ------------------------------------------------------------------ rule 6: co-batching

SEED_PROFILE = DemandProfile(fixed_ms=4.4, prefill_ms_per_token=0.1, decode_ms_per_token=0.41875)
SHORT = BatchShape(input_tokens=256, output_tokens=64)  # 56.8 ms alone; two: 4.4 + 51.2 + 26.8 = 82.4


def co_batching_queue(
    devices: int = 2, co_batch_max: int = 2, device_set: DeviceSet | None = None
) -> CoreQueue:
    queue = CoreQueue("q", devices=devices, slots=3 * devices, max_queued=10, device_set=device_set)
    queue.batch_profile, queue.co_batch_max = SEED_PROFILE, co_batch_max
    return queue


def short_request(queue: CoreQueue, t: float, *, latest_start: float = 1.0) -> CoreSlot | Waiter:
    return queue.request(t, latest_start=t + latest_start, cost_ms=56.8, batch=SHORT)


def granted(request: CoreSlot | Waiter) -> CoreSlot:
    slot = request if isinstance(request, CoreSlot) else request.slot
    assert slot is not None
    return slot


def test_compatible_short_work_joins_the_batch_waiting_in_the_backend() -> None:
    """Rule 6: with every device busy with the pool's own work, a second short request is bound
    into the one waiting in the backend's queue (the batcher takes both as one batch); the list
    schedule holds the pair as one occupant for its padded batch cost, predictions count queued
    short work in batches too, and no third joins a batch of ``co_batch_max``."""
    queue = co_batching_queue()
    devices = queue.device_set
    t = 100.0
    running = [granted(short_request(queue, t)) for _ in range(2)]  # both devices: end t + 0.0568
    first = granted(short_request(queue, t))  # bound ahead, alone
    assert first.predicted_start == pytest.approx(t + 0.0568) and first.group is None
    second = granted(short_request(queue, t + 0.01))
    assert second.group is first.group is not None
    assert second.predicted_start == first.predicted_start
    assert first.group.cost_ms == pytest.approx(82.4) and first.group.solo_ms == pytest.approx(113.6)
    assert queue.co_batched == 1 and devices.occupants() == 3 and len(devices.bound) == 4
    assert sorted(devices.free_times(t + 0.01)) == pytest.approx([t + 0.0568, t + 0.0568 + 0.0824])
    third = short_request(queue, t + 0.01)  # the batch is full: it waits here
    assert isinstance(third, Waiter) and third.slot is None
    # Two more queued short requests would run as one batch: 82.4 ms, not 2 x 56.8.
    fourth = short_request(queue, t + 0.01)
    assert isinstance(fourth, Waiter)
    assert queue.predicted_wait_ms(t + 0.01) == pytest.approx(46.8 + 82.4)
    # The devices free: the batch starts on one, the third request binds onto the other.
    for slot in running:
        slot.release(t + 0.0568)
    assert third.slot is not None and third.slot.predicted_start == pytest.approx(t + 0.0568)
    assert fourth.slot is not None and fourth.slot.group is None  # bound ahead, alone
    # One response of the batch is back: the batch is done, its other member holds nothing more.
    first.release(t + 0.0568 + 0.0824)
    assert second.run_ms == 0.0 and devices.occupants() == 3


def test_no_batch_that_would_end_past_a_members_deadline() -> None:
    """A request joins only if the padded batch still ends in time for every member: here the
    waiting request's own deadline leaves no room for a partner's prefill."""
    queue = co_batching_queue()
    t = 100.0
    for _ in range(2):
        granted(short_request(queue, t))
    # Latest start t + 0.06: it must end by t + 0.1168; the pair would end at t + 0.1392.
    first = granted(short_request(queue, t, latest_start=0.06))
    late = short_request(queue, t)
    assert isinstance(late, Waiter) and late.slot is None and first.group is None
    assert queue.co_batched == 0


def test_no_batch_while_another_pool_holds_a_device_or_the_batch_is_about_to_start() -> None:
    """The backend co-batches only what waits in its queue while every instance of the model is
    busy: not while another pool's work holds one of the shared devices (an instance of this
    model is then free and takes the waiting request alone), and not in the last moments before
    the waiting work is predicted to start (the backend may have started it already)."""
    shared = DeviceSet(2)
    queue = co_batching_queue(device_set=shared)
    other = CoreQueue("fallback", devices=2, slots=6, max_queued=10, device_set=shared)
    t = 100.0
    granted(short_request(queue, t))
    held = granted(other.request(t, latest_start=t + 1.0, cost_ms=56.8))  # the other pool's
    first = granted(short_request(queue, t))
    alone = short_request(queue, t)
    assert isinstance(alone, Waiter) and alone.slot is None and first.group is None
    assert queue.withdraw(alone, t) is None
    held.release(t + 0.0568)  # the first request starts on the freed device
    queue2 = co_batching_queue()
    for _ in range(2):
        granted(short_request(queue2, t))
    waiting = granted(short_request(queue2, t))
    too_close = short_request(queue2, t + 0.0568 - JOIN_LEAD_S / 2)
    assert isinstance(too_close, Waiter) and too_close.slot is None and waiting.group is None
    assert queue2.co_batched == 0


# ---------------------------------------------------------------- fair share without bias
# Start-time fair queueing: a flow returning from idle starts at the system's virtual time, so
# it is neither credited nor charged for capacity nobody else wanted; ties go by arrival.

TENANT_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(
    names=st.lists(TENANT_NAMES, min_size=2, max_size=2, unique=True),
    history=st.lists(st.sampled_from((0, 1)), max_size=40),
    arrivals=st.permutations([0] * 12 + [1] * 12),
)
def test_two_equal_flows_get_equal_service_whatever_their_names_and_histories(
    names: list[str], history: list[int], arrivals: list[int]
) -> None:
    """Two tenants of equal weight, equal-cost requests: whoever ran alone before (``history``:
    one request at a time, each granted at once), once both are backlogged their grants
    alternate: at no point has one had more than one grant over the other."""
    queue = CoreQueue("q", devices=1, slots=1, max_queued=100)
    t = 0.0
    for who in history:  # a tenant alone on an idle pool
        slot = queue.request(
            t, latest_start=t + 100.0, cost_ms=10, request_class="interactive", tenant=names[who]
        )
        assert isinstance(slot, CoreSlot)
        t += 0.01
        slot.release(t)
    owner: dict[int, int] = {}
    first: CoreSlot | None = None
    for who in arrivals:  # then both at once, in some order
        got = queue.request(
            t, latest_start=t + 100.0, cost_ms=10, request_class="interactive", tenant=names[who]
        )
        if isinstance(got, CoreSlot):
            first = got
        else:
            owner[id(got)] = who
    assert first is not None
    order: list[int] = []
    running = first
    while owner:
        t += 0.01
        running.release(t)
        (granted_waiter,) = queue.device_set.take_changes()
        assert granted_waiter.slot is not None
        order.append(owner.pop(id(granted_waiter)))
        running = granted_waiter.slot
    served = [arrivals[0], *order]  # the first went at once, to whoever asked first
    counts, remaining = [0, 0], [arrivals.count(0), arrivals.count(1)]
    for who in served:
        if min(remaining) == 0:
            break  # one has nothing left waiting: the other takes the rest
        counts[who] += 1
        remaining[who] -= 1
        assert abs(counts[0] - counts[1]) <= 1, (served, names)


def test_at_equal_virtual_time_the_earlier_arrival_goes_first_not_the_earlier_name() -> None:
    queue = CoreQueue("q", devices=1, slots=1, max_queued=10)
    holder = queue.request(0.0, latest_start=9.0, cost_ms=10, request_class="c", tenant="holder")
    assert isinstance(holder, CoreSlot)
    zeta = queue.request(0.001, latest_start=9.0, cost_ms=10, request_class="c", tenant="zeta")
    alpha = queue.request(0.002, latest_start=9.0, cost_ms=10, request_class="c", tenant="alpha")
    assert isinstance(zeta, Waiter) and isinstance(alpha, Waiter)
    holder.release(0.01)
    assert queue.device_set.take_changes() == [zeta]
