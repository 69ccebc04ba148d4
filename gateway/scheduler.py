"""Waiting for a dispatch slot on the event loop: the driver of ``gateway.core.dispatch``.

The core's ``DispatchQueue`` decides who gets a device and when; this module does the
waiting. ``DispatchQueue.submit`` asks the core for a slot at ``clock.now()``, at once
(synchronously: the request is in the queue when it returns), and returns a future: already
resolved when a slot was free; otherwise parked on the core's ``Waiter`` and resolved when
the core grants it a slot or refuses it, or by a timer at its latest start with the core's
``refusal`` (DEADLINE_EXCEEDED, rule ``queue.latest_start``, or for work held for live memory
RESOURCE_EXHAUSTED, rule ``memory.live_tokens``, and for a stream its tenant's decode share held
RESOURCE_EXHAUSTED, rule ``queue.stream_share``). A future that ends without a slot
(refused, late, cancelled by its caller) withdraws its waiter. ``acquire`` is submit-and-await.
After every call into the core the driver resolves the futures of the waiters it changed.
Releasing a slot is a call into the core at ``clock.now()`` too. Live this is the monotonic clock; in the
simulator and the core's tests it is a virtual one.

With a fleet of replicas (``fleet``: ``gateway.state.device_leases.FleetSlots``), a granted
slot binds only once it also holds one of the fleet's slots of the pool; the lease goes back
when the slot is released.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from gateway import clock
from gateway.config import LimitsConfig
from gateway.core import dispatch
from gateway.core.dispatch import CONTROL_CLASS, DeviceSet, Waiter

if TYPE_CHECKING:
    from gateway.state.device_leases import Lease

__all__ = ["CONTROL_CLASS", "DeviceSet", "DispatchQueue", "Slot"]


class FleetBinding(Protocol):
    """The fleet's dispatch slots (``gateway.state.device_leases.FleetSlots``)."""

    async def bind(
        self,
        pool: str,
        *,
        limit: int,
        predicted_ms: float,
        latest_start: float,
        long: bool = False,
        cost_ms: float | None = None,
        devices: int = 0,
    ) -> Lease: ...

    def release(self, pool: str, lease: str | None) -> None: ...


class Slot(dispatch.Slot):
    """A core slot released on the event loop's clock."""

    fleet: tuple[FleetBinding, str | None] | None = None  # the fleet's slot it binds on, if any
    fleet_start: float | None = None  # its predicted start behind the fleet's bound work

    def backend_wait_s(self, sent: float) -> float:
        """In a fleet, the wait Redis predicted behind the fleet's bound work when its lease was
        granted (``gateway.state.device_leases``); otherwise this replica's prediction."""
        if self.fleet_start is not None:
            return max(0.0, self.fleet_start - sent)
        return super().backend_wait_s(sent)

    def grow_live(self, live_bytes: int, now: float | None = None) -> bool:
        """A stream's live state grows by its new tokens' ``live_bytes`` (core rule 9): True when
        charged, False (``live_exhausted`` set, nothing charged) when its device has no live
        room left for it; the caller then ends the stream."""
        return super().grow_live(live_bytes, clock.now() if now is None else now)

    def release(self, now: float | None = None) -> None:
        if not self.released and self.fleet is not None:
            binding, lease = self.fleet
            binding.release(self.queue.name, lease)
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

    fleet: FleetBinding | None = None  # set by the gateway when replicas share the backends

    def apply_limits(self, limits: LimitsConfig) -> None:
        """The config's turn cap and stream share (core rules 3 and 9): ``max_consecutive_grants``,
        ``stream_share`` and ``max_decoding_streams_per_tenant``."""
        self.max_consecutive = limits.max_consecutive_grants
        self.decode.enabled = limits.stream_share
        self.decode.max_per_tenant = limits.max_decoding_streams_per_tenant

    def _make_slot(
        self, cost_ms: float, now: float, start: float, *, long: bool, live_bytes: int = 0
    ) -> dispatch.Slot:
        return Slot(self, cost_ms, now, start, long=long, live_bytes=live_bytes)

    def submit(
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
        batch: dispatch.BatchShape | None = None,
        stream: bool = False,
    ) -> asyncio.Future[dispatch.Slot]:
        """Ask for a slot now; the future resolves to it (see the module docstring).
        ``latest_start`` is in event-loop seconds; ``live_bytes`` the live sequence state the
        request will hold on its device; ``batch`` its shape when it may be co-batched with
        compatible work (core rule 6). ``stream``: a decoding stream (core rule 9): granted
        within its tenant's decode share only onto a device free now, ``live_bytes`` its
        prompt's live state, grown as tokens come with ``Slot.grow_live``. A full queue raises
        ResourceExhausted here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dispatch.Slot] = loop.create_future()
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
                batch=batch,
                stream=stream,
            )
        finally:
            _settle(self.device_set)  # waiters pushed out to make room
        if isinstance(granted, dispatch.Slot):
            future.set_result(granted)
            return future
        waiter = granted
        waiter.token = future
        if waiter.slot is not None:  # granted within the request call itself
            future.set_result(waiter.slot)
            return future
        late = loop.call_at(latest_start, self._late, waiter)
        future.add_done_callback(lambda done: self._ended(waiter, late, done))
        return future

    def _late(self, waiter: Waiter) -> None:
        future: asyncio.Future[dispatch.Slot] = waiter.token
        if not future.done():
            future.set_exception(self.refusal(waiter, clock.now()))

    def _ended(
        self, waiter: Waiter, late: asyncio.TimerHandle, future: asyncio.Future[dispatch.Slot]
    ) -> None:
        late.cancel()
        if not future.cancelled() and future.exception() is None:
            return  # granted
        slot = self.withdraw(waiter, clock.now())
        if slot is not None:
            slot.release(clock.now())  # granted in the same instant it was given up: pass it on
        _settle(self.device_set)

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
        batch: dispatch.BatchShape | None = None,
        stream: bool = False,
    ) -> Slot:
        """``submit``, then wait for the slot (a caller cancelled while waiting holds nothing)."""
        future = self.submit(
            latest_start=latest_start,
            cost_ms=cost_ms,
            request_class=request_class,
            tenant=tenant,
            weight=weight,
            class_weight=class_weight,
            long=long,
            live_bytes=live_bytes,
            batch=batch,
            stream=stream,
        )
        try:
            slot = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release(clock.now())  # granted as the caller left: pass it on
                _settle(self.device_set)
            raise
        assert isinstance(slot, Slot)
        if self.fleet is not None:
            now = clock.now()
            predicted_ms = slot.cost_ms + max(0.0, slot.predicted_start - now) * 1000.0
            try:
                lease = await self.fleet.bind(
                    self.name,
                    limit=self.slots,
                    predicted_ms=predicted_ms,
                    latest_start=latest_start,
                    long=slot.long,
                    cost_ms=slot.cost_ms,
                    devices=self.device_set.devices,
                )
            except BaseException:
                slot.release(clock.now())  # never bound: the local slot goes to the next waiter
                raise
            slot.fleet = (self.fleet, lease.id)
            if lease.wait_s is not None:
                slot.fleet_start = clock.now() + lease.wait_s
        return slot
