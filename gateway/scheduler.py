"""Waiting for a dispatch slot on the event loop: the driver of ``gateway.core.dispatch``.

The core's ``DispatchQueue`` decides who gets a device and when; this module does the
waiting. ``DispatchQueue.acquire`` asks the core for a slot at ``clock.now()``; when it
must wait, it parks an asyncio future on the core's ``Waiter`` and sleeps until the core
grants it a slot or refuses it, or until its latest start passes (then it withdraws the
waiter and raises the core's ``refusal``: DEADLINE_EXCEEDED, rule ``queue.latest_start``, or
for work held for live memory RESOURCE_EXHAUSTED, rule ``memory.live_tokens``). After every
call into the core it resolves the futures of the waiters the core changed. Releasing a slot is a
call into the core at ``clock.now()`` too. Live this is the monotonic clock; in the
simulator and the core's tests it is a virtual one.
"""

from __future__ import annotations

import asyncio

from gateway import clock
from gateway.core import dispatch
from gateway.core.dispatch import CONTROL_CLASS, DeviceSet, Waiter

__all__ = ["CONTROL_CLASS", "DeviceSet", "DispatchQueue", "Slot"]


class Slot(dispatch.Slot):
    """A core slot released on the event loop's clock."""

    def release(self, now: float | None = None) -> None:
        super().release(clock.now() if now is None else now)
        _settle(self.queue.device_set)


def _settle(devices: DeviceSet) -> None:
    """Resolve the futures of the waiters the core granted or refused."""
    for waiter in devices.take_changes():
        future: asyncio.Future[dispatch.Slot] | None = waiter.token
        if future is None or future.done():
            continue
        if waiter.slot is not None:
            future.set_result(waiter.slot)
        elif waiter.refused is not None:
            future.set_exception(waiter.refused)


class DispatchQueue(dispatch.DispatchQueue):
    """The core queue, with an awaitable ``acquire``."""

    def _make_slot(
        self, cost_ms: float, now: float, start: float, *, long: bool, live_bytes: int = 0
    ) -> dispatch.Slot:
        return Slot(self, cost_ms, now, start, long=long, live_bytes=live_bytes)

    async def acquire(
        self,
        *,
        latest_start: float,
        cost_ms: float,
        request_class: str = "",
        tenant: str = "",
        weight: float = 1.0,
        class_weight: float = 1.0,
        long: bool = False,
        live_bytes: int = 0,
    ) -> Slot:
        """Wait for a slot; ``latest_start`` is in event-loop seconds; ``live_bytes`` the live
        sequence state the request will hold on its device."""
        try:
            granted = self.request(
                clock.now(),
                latest_start=latest_start,
                cost_ms=cost_ms,
                request_class=request_class,
                tenant=tenant,
                weight=weight,
                class_weight=class_weight,
                long=long,
                live_bytes=live_bytes,
            )
        finally:
            _settle(self.device_set)  # waiters pushed out to make room
        if isinstance(granted, Slot):
            return granted
        assert isinstance(granted, Waiter)
        waiter = granted
        future: asyncio.Future[dispatch.Slot] = asyncio.get_running_loop().create_future()
        waiter.token = future
        if waiter.slot is not None:  # granted within the request call itself
            future.set_result(waiter.slot)
        try:
            timeout = latest_start - clock.now()
            if timeout <= 0 and not future.done():
                raise TimeoutError
            slot = await asyncio.wait_for(asyncio.shield(future), max(timeout, 0.0))
            assert isinstance(slot, Slot)
            return slot
        except (TimeoutError, asyncio.CancelledError) as exc:
            refusal = self.refusal(waiter, clock.now()) if isinstance(exc, TimeoutError) else None
            late = self.withdraw(waiter, clock.now())
            if late is not None:
                late.release(clock.now())  # granted in the same instant we gave up: pass it on
            _settle(self.device_set)
            future.cancel()
            if refusal is not None:
                raise refusal from None
            raise
