"""Gateway-side queues with late binding.

One ``DispatchQueue`` per (backend, backend model) pool. A request waits here,
ordered by deadline (earliest first, FIFO among equals), and binds to the
backend only when one of the pool's in-flight slots frees. Slots are
``devices x max_inflight_per_device``: enough to keep every device busy,
few enough that Triton's own queue stays short and the gateway keeps control
of order. Queues are bounded in count; a request that cannot start before its
latest feasible start time leaves the queue with ``DeadlineExpired`` instead
of running late. Cancellation removes a waiter at once.

The queue also answers the admission question "how long would this wait?"
from the predicted work queued and still executing ahead of it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field

from gateway.errors import DeadlineExpired, ResourceExhausted


@dataclass(order=True)
class _Waiter:
    deadline_at: float
    seq: int
    cost_ms: float = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


@dataclass(eq=False)
class Slot:
    queue: DispatchQueue
    cost_ms: float
    started_at: float
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.queue._release(self)


class DispatchQueue:
    def __init__(self, name: str, *, devices: int, slots: int, max_queued: int) -> None:
        self.name = name
        self.devices = max(1, devices)
        self.slots = max(1, slots)
        self.max_queued = max_queued
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._inflight: set[Slot] = set()
        self.queued_ms = 0.0
        self.queued = 0
        self._reserved = 0  # woken waiters that have not taken their slot yet

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def inflight_remaining_ms(self, now: float) -> float:
        """Predicted work still executing in the pool's slots."""
        return sum(max(0.0, s.cost_ms - (now - s.started_at) * 1000.0) for s in self._inflight)

    def predicted_wait_ms(self, now: float | None = None) -> float:
        """Work ahead of a new arrival, spread over the pool's devices."""
        now = time.monotonic() if now is None else now
        remaining_inflight = self.inflight_remaining_ms(now)
        if self._free() > 0 and self.queued == 0:
            return 0.0
        return (self.queued_ms + remaining_inflight) / self.devices

    async def acquire(self, *, deadline_at: float, latest_start: float, cost_ms: float) -> Slot:
        """Wait for a slot. ``deadline_at`` orders the queue; ``latest_start`` bounds the wait
        (both ``time.monotonic()`` seconds)."""
        if self._free() > 0 and self.queued == 0:
            return self._grant(cost_ms)
        if self.queued >= self.max_queued:
            raise ResourceExhausted(
                "the model's queue is full", rule="queue.full", retry_after_ms=int(self.predicted_wait_ms())
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(deadline_at, next(self._seq), cost_ms, loop.create_future())
        heapq.heappush(self._heap, waiter)
        self.queued += 1
        self.queued_ms += cost_ms
        self._wake_next()  # a slot may be free with only stale waiters ahead
        try:
            timeout = latest_start - time.monotonic()
            if timeout <= 0:
                raise TimeoutError
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Woken in the same instant we gave up: pass the slot on.
                self._reserved -= 1
                self._wake_next()
            waiter.future.cancel()
            self._forget(waiter)
            if isinstance(exc, TimeoutError):
                raise DeadlineExpired(
                    "the request could not start before its deadline", rule="queue.latest_start"
                ) from None
            raise
        self._forget(waiter)
        self._reserved -= 1
        return self._grant(cost_ms)

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.cost_ms >= 0:
            self.queued -= 1
            self.queued_ms = max(0.0, self.queued_ms - waiter.cost_ms)
            waiter.cost_ms = -1.0  # accounted once

    def _grant(self, cost_ms: float) -> Slot:
        slot = Slot(self, cost_ms, time.monotonic())
        self._inflight.add(slot)
        return slot

    def _release(self, slot: Slot) -> None:
        self._inflight.discard(slot)
        self._wake_next()

    def _free(self) -> int:
        return self.slots - len(self._inflight) - self._reserved

    def _wake_next(self) -> None:
        # Wake the earliest-deadline live waiter; its acquire() takes the reserved slot.
        while self._heap and self._free() > 0:
            waiter = heapq.heappop(self._heap)
            if waiter.future.done():
                continue
            self._reserved += 1
            waiter.future.set_result(None)
