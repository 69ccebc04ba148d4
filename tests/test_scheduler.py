"""The dispatch queue: earliest deadline first, bounded, late binding, cancellation-safe."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.errors import DeadlineExpired, ResourceExhausted
from gateway.scheduler import DispatchQueue


async def test_waiters_are_served_earliest_deadline_first() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=10)
    now = time.monotonic()
    holder = await queue.acquire(deadline_at=now + 10, latest_start=now + 10, cost_ms=5)
    order: list[str] = []

    async def wait(name: str, deadline: float) -> None:
        slot = await queue.acquire(deadline_at=now + deadline, latest_start=now + 10, cost_ms=1)
        order.append(name)
        slot.release()

    tasks = [asyncio.create_task(wait(n, d)) for n, d in (("late", 9), ("early", 2), ("mid", 5))]
    await asyncio.sleep(0.01)
    assert queue.queued == 3
    assert queue.predicted_wait_ms(time.monotonic()) > 0
    holder.release()
    await asyncio.gather(*tasks)
    assert order == ["early", "mid", "late"]
    assert (queue.inflight, queue.queued, queue.queued_ms) == (0, 0, 0.0)


async def test_queue_is_bounded() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=1)
    now = time.monotonic()
    held = await queue.acquire(deadline_at=now + 5, latest_start=now + 5, cost_ms=1)
    waiting = asyncio.create_task(queue.acquire(deadline_at=now + 5, latest_start=now + 5, cost_ms=1))
    await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted) as full:
        await queue.acquire(deadline_at=now + 5, latest_start=now + 5, cost_ms=1)
    assert full.value.rule == "queue.full"
    held.release()
    (await waiting).release()


async def test_latest_start_bounds_the_wait_and_leaves_nothing_behind() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=4)
    now = time.monotonic()
    held = await queue.acquire(deadline_at=now + 5, latest_start=now + 5, cost_ms=1)
    with pytest.raises(DeadlineExpired):
        await queue.acquire(deadline_at=now + 0.05, latest_start=now + 0.05, cost_ms=1)
    assert queue.queued == 0
    held.release()
    # The slot is free again for a new arrival: no stale waiter blocks it.
    again = await queue.acquire(deadline_at=now + 5, latest_start=time.monotonic() + 0.05, cost_ms=1)
    again.release()
    assert queue.inflight == 0


async def test_cancelled_waiter_is_removed_and_slot_passes_on() -> None:
    queue = DispatchQueue("q", devices=1, slots=1, max_queued=4)
    now = time.monotonic()
    held = await queue.acquire(deadline_at=now + 5, latest_start=now + 5, cost_ms=1)
    cancelled = asyncio.create_task(queue.acquire(deadline_at=now + 1, latest_start=now + 5, cost_ms=1))
    patient = asyncio.create_task(queue.acquire(deadline_at=now + 2, latest_start=now + 5, cost_ms=1))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.sleep(0)
    held.release()
    slot = await asyncio.wait_for(patient, 1)
    assert queue.queued == 0
    slot.release()
    slot.release()  # idempotent
    assert queue.inflight == 0
