"""The dispatch queue's kept schedule equals the re-simulated one (issue 31: the incremental
free times and the fast path when nothing waits).

``DeviceSet`` keeps the list schedule's inputs per version of its bound work
(``_occupancy``) and ``DispatchQueue.predicted_wait_ms`` answers without a schedule when a
device is free and nothing waits. ``DeviceSet.incremental = False`` re-simulates everything
from the bound slots on every call: on random traces of requests, grants, releases (early, on
time and overrunning their prediction), withdrawals and other replicas' work, over random
device counts, co-batching on and off, long and short work and live memory, every answer is
the same both ways at every step. (Dropping a ``touch`` of the bound work, e.g. the one in
``_replan``, fails this.)
"""

from __future__ import annotations

import math
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.dispatch import BatchShape, DeviceSet, DispatchQueue, Slot, Waiter
from gateway.core.errors import GatewayError
from gateway.core.memory import DeviceMemory
from gateway.core.profile import DemandProfile

PROFILE = DemandProfile(fixed_ms=4.4, prefill_ms_per_token=0.1, decode_ms_per_token=0.41875)
SHAPES = (BatchShape(256, 64), BatchShape(128, 32), BatchShape(256, 64, scale=1.5))
TENANTS = (("", "a"), ("", "b"), ("control", "ops"))


def answers(device_set: DeviceSet, queues: list[DispatchQueue], now: float) -> list[object]:
    """Everything the kept schedule answers, at ``now``."""
    out: list[object] = [
        sorted(device_set.free_times(now)),
        sorted(device_set.free_times(now, fleet=True)),
        device_set.occupants(),
        device_set.waiting_after(now),
    ]
    for queue in queues:
        out.append(sorted(device_set.free_times(now, fleet=True, queue=queue)))
        for latest in (None, now, now + 0.05, now + 1.0):
            for long in (False, True):
                out.append(queue.predicted_wait_ms(now, latest_start=latest, long=long, cost_ms=30.0))
                out.append(
                    queue.predicted_wait_ms(
                        now, latest_start=latest, flow=TENANTS[0], cost_ms=30.0, long=long
                    )
                )
        for latest in (now, now + 0.01, now + 0.2, math.inf):
            for long in (False, True):
                out.append(device_set.bind_start(now, latest, long=long, cost_ms=30.0, queue=queue))
            out.append(device_set.bind_start(now, latest, stream=True, queue=queue))
            out.append(device_set.join(now, queue, SHAPES[0], latest + 0.06))
        out.append(device_set.fits(now, 3))
    return out


def reference(device_set: DeviceSet, queues: list[DispatchQueue], now: float) -> list[object]:
    device_set.incremental = False  # re-simulated from the bound slots, every call
    try:
        return answers(device_set, queues, now)
    finally:
        del device_set.incremental


def simulated(device_set: DeviceSet, now: float) -> list[float]:
    return sorted(device_set._simulated_free_times(now))


request = st.tuples(
    st.just("request"),
    st.integers(0, len(TENANTS) - 1),  # flow
    st.sampled_from([0.0, 1.0, 10.0, 28.4, 56.8, 470.0]),  # cost ms
    st.sampled_from([0.0, 0.01, 0.06, 0.3, 2.0, 2.0]),  # latest start after now
    st.sampled_from([False, False, False, True]),  # long
    st.integers(-1, len(SHAPES) - 1),  # batch shape (-1: none)
    st.integers(0, 1),  # pool
    st.sampled_from([0, 1, 4]),  # live bytes
)
# Requests are the most frequent step, so that work is bound ahead and co-batched often.
step = st.one_of(
    request,
    request,
    request,
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.001, 0.003, 0.01, 0.03, 0.06, 0.5])),
    st.tuples(st.just("release"), st.integers(0, 50), st.sampled_from([-1.0, 0.0, 1.0, 2.0])),
    st.tuples(st.just("withdraw"), st.integers(0, 50)),
    st.tuples(
        st.just("expire"),
    ),
    st.tuples(st.just("remote"), st.sampled_from([(), (0.004,), (-0.01, 0.02), (0.05, 0.01, 0.3)])),
)


def pools_on(
    devices: int, per_device: int, co_batch: int, pools: int, short_lane: int, memory: bool, reserved: int = 0
) -> tuple[DeviceSet, list[DispatchQueue]]:
    """``pools`` pools sharing one device set (the first with ``reserved`` control slots)."""
    device_set = DeviceSet(
        devices, short_lane=short_lane, memory=DeviceMemory(device_bytes=10) if memory else None
    )
    queues = [
        DispatchQueue(
            f"p{i}",
            devices=devices,
            slots=devices * per_device,
            max_queued=8,
            reserved_control=reserved if i == 0 else 0,
            device_set=device_set,
        )
        for i in range(pools)
    ]
    for queue in queues:
        queue.batch_profile, queue.co_batch_max = PROFILE, co_batch
    return device_set, queues


class Trace:
    """A random trace run on pools sharing one device set (``step``'s actions: ``request``,
    ``advance``, ``release`` at a slot's predicted end times ``1 + overrun`` or, overrun None,
    now, ``withdraw``, ``expire``, ``shadow`` (a slot bound straight into the set, as a shadow
    candidate's is) and ``remote`` (other replicas' work on the devices)), with the slots and
    waiters so far; tests/test_perf_dispatch.py drives it too."""

    def __init__(self, device_set: DeviceSet, queues: list[DispatchQueue]) -> None:
        self.device_set = device_set
        self.queues = queues
        self.now = 100.0
        self.slots: list[Slot] = []
        self.waiters: list[tuple[Waiter, DispatchQueue]] = []

    def collect(self) -> None:
        for changed in self.device_set.take_changes():
            if changed.slot is not None:
                self.slots.append(changed.slot)

    def step(self, action: tuple[object, ...]) -> None:
        kind: Any = action[0]
        now = self.now
        if kind == "request":
            _, flow, cost_ms, lead, long, shape, pool, live = cast(tuple[Any, ...], action)
            queue = self.queues[pool % len(self.queues)]
            request_class, tenant = TENANTS[flow]
            try:
                got = queue.request(
                    now,
                    latest_start=now + lead,
                    cost_ms=cost_ms,
                    request_class=request_class,
                    tenant=tenant,
                    weight=1.0 + flow,
                    long=long,
                    batch=SHAPES[shape] if shape >= 0 else None,
                    live_bytes=live,
                )
            except GatewayError:
                got = None
            if isinstance(got, Slot):
                self.slots.append(got)
            elif isinstance(got, Waiter):
                self.waiters.append((got, queue))
            self.collect()
        elif kind == "advance":
            self.now = now + cast(float, action[1])
        elif kind == "release":
            live_slots = [s for s in self.slots if not s.released]
            if live_slots:
                slot = live_slots[cast(int, action[1]) % len(live_slots)]
                overrun = action[2]
                if overrun is not None:
                    # Released early (-1), as predicted (0) or overrunning its prediction (1, 2
                    # more runs): the clock moves on to then if that is later.
                    end = slot.predicted_start + slot.run_ms / 1000.0 * (1.0 + cast(float, overrun))
                    self.now = now = max(now, end)
                slot.release(now)
                self.collect()
        elif kind == "withdraw":
            live_waiters = [(w, q) for w, q in self.waiters if w.live]
            if live_waiters:
                waiter, queue = live_waiters[cast(int, action[1]) % len(live_waiters)]
                granted = queue.withdraw(waiter, now)
                if granted is not None:
                    granted.release(now)
                self.collect()
        elif kind == "expire":  # the driver withdraws every waiter whose latest start passed
            for waiter, queue in self.waiters:
                if waiter.live and waiter.latest_start < now:
                    queue.withdraw(waiter, now)
            self.collect()
        elif kind == "shadow":  # a shadow candidate's slot, bound straight into the set
            bound = self.device_set.bound
            if len(bound) < self.device_set.devices:
                shadow = Slot(self.queues[0], cast(float, action[1]), now, now)
                bound[shadow] = None
                self.slots.append(shadow)
        else:  # other replicas' work on the devices (a fleet's exchange)
            offsets = cast(tuple[float, ...], action[1])
            self.device_set.remote_ends = {"other": tuple(now + o for o in offsets)} if offsets else {}


@settings(max_examples=300, deadline=None)
@given(
    devices=st.integers(1, 4),
    per_device=st.integers(1, 4),
    reserved=st.integers(0, 1),
    co_batch=st.sampled_from([1, 2, 3]),
    pools=st.integers(1, 2),
    short_lane=st.integers(0, 2),
    memory=st.booleans(),
    steps=st.lists(step, min_size=10, max_size=80),
)
def test_kept_schedule_equals_the_resimulated_one(
    devices: int,
    per_device: int,
    reserved: int,
    co_batch: int,
    pools: int,
    short_lane: int,
    memory: bool,
    steps: list[tuple[object, ...]],
) -> None:
    device_set, queues = pools_on(devices, per_device, co_batch, pools, short_lane, memory, reserved)
    trace = Trace(device_set, queues)
    for action in steps:
        trace.step(action)
        now = trace.now
        # At every step: the kept schedule's free times are the re-simulated ones, and every
        # answer built on them is the same as with everything re-simulated.
        assert sorted(device_set.free_times(now)) == simulated(device_set, now)
        assert answers(device_set, queues, now) == reference(device_set, queues, now)
