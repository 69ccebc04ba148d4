"""Streams in the dispatch queue (core rule 9) and the turn cap (rule 3), in virtual time:
each tenant's decoding streams bounded by weighted share, work-conserving, never bound ahead,
live state growing with tokens and released whole; ``max_consecutive`` grants in a row."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import LimitsConfig
from gateway.core.decode import DecodeShare
from gateway.core.dispatch import STREAM_SHARE_RULE, DeviceSet, Slot, Waiter
from gateway.core.dispatch import DispatchQueue as CoreQueue
from gateway.core.errors import DeadlineExpired, ResourceExhausted
from gateway.core.memory import DeviceMemory
from gateway.scheduler import DispatchQueue
from orchid_tools.virtual_time import now, virtual_time

TENANT_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8)
CLASS = "interactive"


def stream(
    queue: CoreQueue, t: float, tenant: str, *, weight: float = 1.0, live: int = 0, cost_ms: float = 10.0
) -> Slot | Waiter:
    return queue.request(
        t,
        latest_start=t + 1000.0,
        cost_ms=cost_ms,
        request_class=CLASS,
        tenant=tenant,
        weight=weight,
        live_bytes=live,
        stream=True,
    )


def decoding(queue: CoreQueue, tenant: str) -> int:
    return queue.decode.decoding(tenant).streams


def share_bound(slots: int, weight: float, others: float) -> int:
    return max(1, math.floor(slots * weight / (weight + others) + 1e-9))


# ---------------------------------------------------------------- the pure share


def test_the_bound_is_the_weighted_share_never_below_one_stream() -> None:
    share = DecodeShare(8, live_bytes=800.0)
    assert share.bound("a", 1.0).streams == 8  # alone: everything
    share.start("b", 3.0, 10)
    bound = share.bound("a", 1.0)
    assert (bound.streams, bound.live_bytes) == (2, 200.0)
    assert share.bound("a", 1.0, {"c": 28.0}).streams == 1  # never below one
    share.enabled = False
    assert share.bound("a", 1.0).streams == 8
    share.end("b", 10)
    assert share.tenants == {}


def test_the_override_caps_a_tenant_even_alone() -> None:
    share = DecodeShare(8, max_per_tenant=2)
    for _ in range(2):
        assert share.may_start("a", 1.0, 0, {})
        share.start("a", 1.0, 0)
    assert not share.may_start("a", 1.0, 0, {})


def test_an_over_share_tenant_waits_only_for_an_in_share_one() -> None:
    share = DecodeShare(4)
    for _ in range(3):
        share.start("a", 1.0, 0)
    assert share.may_start("a", 1.0, 0, {})  # nobody else waits: work-conserving
    assert not share.may_start("a", 1.0, 0, {"b": (1.0, 0)})  # b is within its share
    for _ in range(2):
        share.start("b", 1.0, 0)
    # Both over their share (a 3, b 2 of 2 each): neither is kept from a free slot.
    assert share.may_start("a", 1.0, 0, {"a": (1.0, 0), "b": (1.0, 0)})


def test_live_state_beyond_the_share_holds_new_streams_but_never_the_first() -> None:
    share = DecodeShare(8, live_bytes=1000.0)
    share.start("a", 1.0, 600)
    assert not share.in_share("a", 1.0, 10, {"b": 1.0})  # 610 > 500
    assert share.in_share("b", 1.0, 900, {"a": 1.0})  # b has none decoding: one always fits
    assert share.in_share("a", 1.0, 10)  # alone, 610 <= 1000


# ---------------------------------------------------------------- the queue


def test_a_lone_tenant_uses_the_whole_pool() -> None:
    queue = CoreQueue("q", devices=4, slots=4, max_queued=10)
    slots = [stream(queue, 0.0, "a") for _ in range(4)]
    assert all(isinstance(s, Slot) for s in slots)
    assert decoding(queue, "a") == 4
    waiter = stream(queue, 0.0, "a")
    assert isinstance(waiter, Waiter)  # no slot left, whoever asks
    first = slots[0]
    assert isinstance(first, Slot)
    first.release(0.01)
    assert queue.device_set.take_changes() == [waiter] and waiter.slot is not None


def test_an_in_share_tenant_gets_the_next_free_slot() -> None:
    queue = CoreQueue("q", devices=4, slots=4, max_queued=10)
    held = [stream(queue, 0.0, "a") for _ in range(4)]
    more_a = stream(queue, 0.001, "a")
    b = stream(queue, 0.002, "b")
    assert isinstance(more_a, Waiter) and isinstance(b, Waiter)
    slot = held[0]
    assert isinstance(slot, Slot)
    slot.release(0.01)
    assert queue.device_set.take_changes() == [b]
    # a holds 3 of 4, b 1: a is over its share (2) while b is within it, yet nothing of b's
    # waits now: the next free slot goes to a (work-conserving).
    slot = held[1]
    assert isinstance(slot, Slot)
    slot.release(0.02)
    assert queue.device_set.take_changes() == [more_a]


def test_the_turn_cap_and_the_share_come_from_the_config() -> None:
    queue = DispatchQueue("q", devices=2, slots=2, max_queued=10)
    assert queue.max_consecutive == 8 and queue.decode.enabled and queue.decode.max_per_tenant is None
    queue.apply_limits(
        LimitsConfig(max_consecutive_grants=3, stream_share=False, max_decoding_streams_per_tenant=5)
    )
    assert queue.max_consecutive == 3 and not queue.decode.enabled and queue.decode.max_per_tenant == 5


@settings(max_examples=150, deadline=None)
@given(
    slots=st.integers(min_value=2, max_value=6),
    names=st.lists(TENANT_NAMES, min_size=2, max_size=2, unique=True),
    weights=st.lists(st.sampled_from((1.0, 2.0, 3.0)), min_size=2, max_size=2),
    history=st.lists(st.sampled_from((0, 1)), max_size=12),
    arrivals=st.lists(st.sampled_from((0, 1)), min_size=4, max_size=40),
    ends=st.lists(st.integers(min_value=0, max_value=1000), min_size=80, max_size=80),
)
def test_under_a_flood_no_tenant_starts_a_stream_beyond_its_share_while_another_waits_within_its_own(
    slots: int,
    names: list[str],
    weights: list[float],
    history: list[int],
    arrivals: list[int],
    ends: list[int],
) -> None:
    """Streams of two tenants flood a pool; they end in an arbitrary order. Whenever a stream
    is granted while the other tenant has one waiting, either the granted tenant stays within
    its weighted share, or the waiting tenant is itself at or over its own (work-conserving)."""
    queue = CoreQueue("q", devices=slots, slots=slots, max_queued=1000)
    t = 0.0
    running: list[Slot] = []
    waiting: dict[int, list[Waiter]] = {0: [], 1: []}
    owner: dict[int, int] = {}
    # First the streams one tenant ran alone (some still decode, some wait), then the flood.
    for who in [*history, *arrivals]:
        got = stream(queue, t, names[who], weight=weights[who])
        if isinstance(got, Slot):
            running.append(got)
        else:
            waiting[who].append(got)
            owner[id(got)] = who
        t += 0.001
    for end in ends:
        if not running:
            break
        t += 0.01
        running.pop(end % len(running)).release(t)
        for granted in queue.device_set.take_changes():
            who = owner[id(granted)]
            other = 1 - who
            waiting[who].remove(granted)
            assert granted.slot is not None
            running.append(granted.slot)
            if not waiting[other]:
                continue
            mine = decoding(queue, names[who])
            theirs = decoding(queue, names[other])
            their_bound = share_bound(slots, weights[other], weights[who])
            if theirs + 1 <= their_bound:  # the other waits within its share
                assert mine <= share_bound(slots, weights[who], weights[other]), (mine, theirs)
        assert len(running) <= slots
        assert queue.inflight == len(running)
    for slot in running:
        slot.release(t)
    assert queue.decode.tenants == {}


@settings(max_examples=150, deadline=None)
@given(
    slots=st.integers(min_value=2, max_value=6),
    names=st.lists(TENANT_NAMES, min_size=2, max_size=2, unique=True),
    history=st.lists(st.sampled_from((0, 1)), max_size=12),
    arrivals=st.permutations([0] * 15 + [1] * 15),
    ends=st.lists(st.integers(min_value=0, max_value=1000), min_size=60, max_size=60),
)
def test_two_equal_tenants_get_equal_decoding_streams_under_a_flood(
    slots: int, names: list[str], history: list[int], arrivals: list[int], ends: list[int]
) -> None:
    """Two tenants of equal weight flood a pool with streams, after whatever either ran alone.
    Once every stream granted before both were waiting has ended, and while both still have
    streams waiting, their decoding streams differ by at most one (none with even slots)."""
    queue = CoreQueue("q", devices=slots, slots=slots, max_queued=1000)
    t = 0.0
    running: list[Slot] = []
    waiting: dict[int, list[Waiter]] = {0: [], 1: []}
    owner: dict[int, int] = {}
    for who in [*history, *arrivals]:
        got = stream(queue, t, names[who])
        if isinstance(got, Slot):
            running.append(got)
        else:
            waiting[who].append(got)
            owner[id(got)] = who
        t += 0.001
    before = set(running)  # granted before both were waiting
    for end in ends:
        if not running or not (waiting[0] and waiting[1]):
            break
        t += 0.01
        released = running.pop(end % len(running))
        released.release(t)
        before.discard(released)
        for granted in queue.device_set.take_changes():
            waiting[owner[id(granted)]].remove(granted)
            assert granted.slot is not None
            running.append(granted.slot)
        if not before and waiting[0] and waiting[1]:
            counts = decoding(queue, names[0]), decoding(queue, names[1])
            assert abs(counts[0] - counts[1]) <= slots % 2, (counts, names)


@settings(max_examples=100, deadline=None)
@given(
    devices=st.integers(min_value=1, max_value=3),
    ops=st.lists(
        st.tuples(st.sampled_from(("unary", "stream", "release")), st.integers(0, 100)), max_size=40
    ),
)
def test_a_stream_never_binds_ahead_into_the_backends_queue(devices: int, ops: list[tuple[str, int]]) -> None:
    """Unary work binds ahead of a free device when it would start in time (rule 6); a stream
    binds only onto a device free now: every stream's slot starts when it is granted."""
    queue = CoreQueue("q", devices=devices, slots=2 * devices, max_queued=1000)
    t = 0.0
    bound: list[Slot] = []
    streams: list[Slot] = []

    def take(got: Slot | Waiter) -> None:
        if isinstance(got, Slot):
            bound.append(got)
            if got.stream:
                streams.append(got)

    for op, n in ops:
        t += 0.002
        if op == "release":
            if bound:
                bound.pop(n % len(bound)).release(t)
        elif op == "unary":
            take(queue.request(t, latest_start=t + 10.0, cost_ms=5.0, request_class=CLASS, tenant="u"))
        else:
            take(stream(queue, t, f"s{n % 3}"))
        for granted in queue.device_set.take_changes():
            assert granted.slot is not None
            take(granted.slot)
        for slot in streams:
            assert slot.predicted_start == slot.started_at  # onto a device free when granted


def test_with_its_device_busy_unary_work_binds_ahead_and_a_stream_waits_here() -> None:
    queue = CoreQueue("q", devices=1, slots=2, max_queued=10)
    held = queue.request(0.0, latest_start=10.0, cost_ms=5.0)
    assert isinstance(held, Slot)
    ahead = queue.request(0.0, latest_start=10.0, cost_ms=5.0)
    assert isinstance(ahead, Slot) and ahead.predicted_start == pytest.approx(0.005)
    ahead.release(0.001)
    waiting = stream(queue, 0.001, "s")
    assert isinstance(waiting, Waiter)  # a slot is free, the device is not
    held.release(0.005)
    assert queue.device_set.take_changes() == [waiting]
    assert waiting.slot is not None and waiting.slot.predicted_start == 0.005


# ---------------------------------------------------------------- live state grows with tokens

ROOM = 1000


def memory_queue() -> CoreQueue:
    devices = DeviceSet(1, memory=DeviceMemory(device_bytes=ROOM))
    return CoreQueue("q", devices=1, slots=2, max_queued=10, device_set=devices)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.integers(min_value=1, max_value=400),
    tokens=st.lists(st.integers(min_value=1, max_value=120), max_size=30),
)
def test_live_bytes_grow_with_tokens_and_are_released_whole(prompt: int, tokens: list[int]) -> None:
    queue = memory_queue()
    slot = stream(queue, 0.0, "a", live=prompt)
    assert isinstance(slot, Slot) and slot.live_bytes == prompt  # the prompt, not the peak
    held = prompt
    t = 0.0
    for grow in tokens:
        t += 0.001
        fits = held + grow <= ROOM
        assert slot.grow_live(grow, t) is fits
        if fits:
            held += grow
        else:
            assert slot.live_exhausted
        assert slot.live_bytes == held == queue.decode.decoding("a").live_bytes
        (device,) = queue.device_set.schedule(t)
        assert device.live_bytes == held
    slot.release(t + 0.001)
    assert not slot.grow_live(1, t + 0.002)  # released: nothing more
    assert queue.decode.tenants == {} and not queue.device_set.bound
    (device,) = queue.device_set.schedule(t + 0.002)
    assert device.live_bytes == 0
    assert queue.device_set.fits(t + 0.002, ROOM)


def test_the_memory_a_stream_grew_into_holds_the_next_work_back() -> None:
    queue = memory_queue()
    first = stream(queue, 0.0, "a", live=100)
    assert isinstance(first, Slot) and first.grow_live(800, 0.001)
    # the device has 100 bytes of room left: unary work needing 200 waits for it
    unary = queue.request(0.002, latest_start=5.0, cost_ms=1.0, tenant="b", live_bytes=200)
    assert isinstance(unary, Waiter) and unary.memory_held
    first.release(0.003)
    assert queue.device_set.take_changes() == [unary]


# ---------------------------------------------------------------- the turn cap (rule 3)


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(min_value=1, max_value=6),
    heavy=st.sampled_from((1.0, 5.0, 50.0)),
    names=st.lists(TENANT_NAMES, min_size=2, max_size=2, unique=True),
    arrivals=st.lists(st.sampled_from((0, 1)), min_size=2, max_size=40),
    costs=st.lists(st.sampled_from((1.0, 10.0, 100.0)), min_size=40, max_size=40),
)
def test_no_flow_takes_more_than_max_consecutive_grants_while_another_waits(
    cap: int, heavy: float, names: list[str], arrivals: list[int], costs: list[float]
) -> None:
    """Whatever the weights (a flow of weight ``heavy`` against one of weight 1) and costs, no
    flow is granted more than ``max_consecutive`` times in a row while the other has a waiter."""
    queue = CoreQueue("q", devices=1, slots=1, max_queued=1000, max_consecutive=cap)
    weights = (heavy, 1.0)
    t = 0.0
    waiting = [0, 0]
    owner: dict[int, int] = {}
    running: Slot | None = None
    last, run = -1, 0
    for who, cost in zip(arrivals, costs, strict=False):
        got = queue.request(
            t,
            latest_start=t + 1000.0,
            cost_ms=cost,
            request_class=CLASS,
            tenant=names[who],
            weight=weights[who],
        )
        if isinstance(got, Slot):
            running, last, run = got, who, (run + 1 if who == last else 1)
        else:
            owner[id(got)] = who
            waiting[who] += 1
        t += 0.0001
    while running is not None:
        t += 0.01
        running.release(t)
        running = None
        for granted in queue.device_set.take_changes():
            who = owner[id(granted)]
            waiting[who] -= 1
            run = run + 1 if who == last else 1
            last = who
            if waiting[1 - who]:
                assert run <= cap, (run, cap, heavy)
            running = granted.slot


@virtual_time
async def test_the_driver_streams_and_grows_on_the_event_loops_clock() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=10)
    first = await queue.acquire(latest_start=now() + 5, cost_ms=1, tenant="a", live_bytes=10, stream=True)
    assert first.stream and first.grow_live(5) and first.live_bytes == 15
    second = queue.submit(latest_start=now() + 5, cost_ms=1, tenant="b", stream=True)
    first.release()
    slot = await second
    assert slot.stream and queue.decode.decoding("b").streams == 1
    slot.release(now())
    assert queue.decode.tenants == {}


def test_a_stream_its_tenants_share_held_is_refused_at_its_latest_start_with_a_retry_after() -> None:
    queue = CoreQueue("q", devices=4, slots=4, max_queued=10)
    a_slots = [stream(queue, 0.0, "a", cost_ms=100.0) for _ in range(3)]  # a alone first
    b_slot = stream(queue, 0.0, "b", cost_ms=1000.0)
    assert all(isinstance(s, Slot) for s in a_slots) and isinstance(b_slot, Slot)
    b_next = stream(queue, 0.001, "b")
    a_next = stream(queue, 0.002, "a")
    assert isinstance(b_next, Waiter) and isinstance(a_next, Waiter)
    assert not a_next.share_held
    assert isinstance(queue.refusal(a_next, 0.005), DeadlineExpired)  # it waited for a slot
    b_slot.release(0.01)
    # a's flow is first by virtual time, but a holds 3 of its 2 while b waits within its share.
    assert queue.device_set.take_changes() == [b_next]
    assert a_next.share_held
    refused = queue.refusal(a_next, 0.05)
    assert isinstance(refused, ResourceExhausted) and refused.rule == STREAM_SHARE_RULE
    assert refused.retry_after_ms == 50  # a's first stream is predicted to end at 0.1


def test_a_streams_live_byte_ms_grow_with_its_tokens_and_stop_at_release() -> None:
    queue = memory_queue()
    slot = stream(queue, 0.0, "a", live=100)
    assert isinstance(slot, Slot)
    assert slot.live_byte_ms(0.5) == pytest.approx(100 * 500)  # the prompt alone, half a second
    assert slot.grow_live(50, 1.0)  # a token's worth at 1 s
    assert slot.live_byte_ms(2.0) == pytest.approx(100 * 1000 + 150 * 1000)
    assert not slot.grow_live(10_000, 2.0)  # refused: nothing charged
    slot.release(3.0)
    assert slot.live_byte_ms(9.0) == pytest.approx(100 * 1000 + 150 * 2000)
