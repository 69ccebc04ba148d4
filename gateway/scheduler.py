"""Gateway-side queues with late binding and hierarchical fair shares.

One ``DispatchQueue`` per (backend, backend model) pool. A request waits here
and binds to the backend only when one of the pool's in-flight slots frees.
Slots are ``devices x max_inflight_per_device``: enough to keep every device
busy, few enough that Triton's own queue stays short and the gateway keeps
control of order.

Rules (everything that decides who goes next lives here):

1. **Hierarchical shares.** Waiting work is grouped into flows: request class,
   then tenant within class. When a slot frees, the class with the least
   virtual time goes first, then, inside it, the tenant with the least virtual
   time; each grant advances the chosen class's and tenant's virtual time by
   ``cost_ms / weight`` (start-time fair queuing). Under contention each
   tenant receives accelerator-ms in proportion to its weight, whatever the
   size of its requests; a flow that wakes up starts at the current virtual
   time, so idleness banks no credit.
2. **Deadline order inside a flow**: earliest deadline first, FIFO among equals.
3. **No starvation.** A large job's flow is charged by its cost, so it waits
   while its virtual time is ahead, but every other flow's time advances with
   each grant: its turn comes after a bounded amount of others' work (aging
   by virtual time). ``max_consecutive`` additionally caps how many grants in
   a row one tenant may take while others wait.
4. **A reserved slice for control traffic.** With ``reserved_control`` > 0 the
   last free slot(s) go only to the ``control`` class (recovery and health
   work must not queue behind a flood).
5. **Bounded.** At most ``max_queued`` waiters; more is RESOURCE_EXHAUSTED
   with a retry-after from the predicted wait. A waiter that cannot start
   before its latest feasible start leaves with ``DeadlineExpired`` instead of
   running late; a cancelled waiter leaves at once and holds nothing.

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

CONTROL_CLASS = "control"


@dataclass(order=True)
class _Waiter:
    deadline_at: float
    seq: int
    cost_ms: float = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    flow: tuple[str, str] = field(compare=False, default=("", ""))
    live: bool = field(compare=False, default=True)


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


@dataclass
class _Flow:
    heap: list[_Waiter] = field(default_factory=list)
    vtime: float = 0.0
    weight: float = 1.0
    live: int = 0


class DispatchQueue:
    def __init__(
        self,
        name: str,
        *,
        devices: int,
        slots: int,
        max_queued: int,
        reserved_control: int = 0,
        max_consecutive: int = 8,
    ) -> None:
        self.name = name
        self.devices = max(1, devices)
        self.slots = max(1, slots)
        self.max_queued = max_queued
        # Never reserve every slot: ordinary work must always be able to run.
        self.reserved_control = min(max(0, reserved_control), self.slots - 1)
        self.max_consecutive = max(1, max_consecutive)
        self._seq = itertools.count()
        self._inflight: set[Slot] = set()
        self._classes: dict[str, _Flow] = {}  # class -> its virtual time and weight (heap unused)
        self._flows: dict[tuple[str, str], _Flow] = {}
        self._last_tenant: tuple[str, str] | None = None
        self._consecutive = 0
        self.granted_ms: dict[tuple[str, str], float] = {}  # accelerator-ms granted per flow
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
        if self._free(CONTROL_CLASS) > 0 and self.queued == 0:
            return 0.0
        return (self.queued_ms + self.inflight_remaining_ms(now)) / self.devices

    async def acquire(
        self,
        *,
        deadline_at: float,
        latest_start: float,
        cost_ms: float,
        request_class: str = "",
        tenant: str = "",
        weight: float = 1.0,
        class_weight: float = 1.0,
    ) -> Slot:
        """Wait for a slot. ``deadline_at`` orders the flow; ``latest_start`` bounds the wait
        (both ``time.monotonic()`` seconds); weights set the class's and tenant's shares."""
        flow_key = (request_class, tenant)
        if self._free(request_class) > 0 and self.queued == 0:
            self._charge(flow_key, cost_ms, weight, class_weight)
            return self._grant(cost_ms)
        if self.queued >= self.max_queued:
            raise ResourceExhausted(
                "the model's queue is full",
                rule="queue.full",
                retry_after_ms=max(1, int(self.predicted_wait_ms())),
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(deadline_at, next(self._seq), cost_ms, loop.create_future(), flow_key)
        self._enqueue(waiter, weight, class_weight)
        self._wake_next()  # a slot may be free with only ineligible waiters ahead
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
        self._reserved -= 1
        return self._grant(cost_ms)

    # ------------------------------------------------------------------ flows

    def _active_vtime(self, table: dict[str, _Flow] | dict[tuple[str, str], _Flow]) -> float:
        active = [f.vtime for f in table.values() if f.live > 0]
        return min(active) if active else 0.0

    def _enqueue(self, waiter: _Waiter, weight: float, class_weight: float) -> None:
        request_class, _ = waiter.flow
        cls = self._classes.get(request_class)
        if cls is None:
            cls = self._classes[request_class] = _Flow()
        if cls.live == 0:  # waking up: start at the current virtual time, bank no credit
            cls.vtime = max(cls.vtime, self._active_vtime(self._classes))
        cls.weight = class_weight
        cls.live += 1
        flow = self._flows.get(waiter.flow)
        if flow is None:
            flow = self._flows[waiter.flow] = _Flow()
        if flow.live == 0:
            siblings = {k: f for k, f in self._flows.items() if k[0] == request_class}
            flow.vtime = max(flow.vtime, self._active_vtime(siblings))
        flow.weight = weight
        flow.live += 1
        heapq.heappush(flow.heap, waiter)
        self.queued += 1
        self.queued_ms += waiter.cost_ms

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.live:
            waiter.live = False
            self.queued -= 1
            self.queued_ms = max(0.0, self.queued_ms - waiter.cost_ms)
            self._flows[waiter.flow].live -= 1
            self._classes[waiter.flow[0]].live -= 1

    def _charge(self, flow_key: tuple[str, str], cost_ms: float, weight: float, class_weight: float) -> None:
        cls = self._classes.setdefault(flow_key[0], _Flow())
        flow = self._flows.setdefault(flow_key, _Flow())
        cls.vtime += cost_ms / max(class_weight, 1e-9)
        flow.vtime += cost_ms / max(weight, 1e-9)
        self.granted_ms[flow_key] = self.granted_ms.get(flow_key, 0.0) + cost_ms
        if flow_key == self._last_tenant:
            self._consecutive += 1
        else:
            self._last_tenant, self._consecutive = flow_key, 1

    def _next_waiter(self) -> _Waiter | None:
        """The waiter to wake: least-virtual-time class, then tenant, then earliest deadline."""
        free_for_ordinary = self._free("") > 0
        classes = sorted(
            (f.vtime, name)
            for name, f in self._classes.items()
            if f.live > 0 and (free_for_ordinary or name == CONTROL_CLASS)
        )
        for _, name in classes:
            flows = sorted((f.vtime, key) for key, f in self._flows.items() if key[0] == name and f.live > 0)
            if (
                len(flows) > 1
                and flows[0][1] == self._last_tenant
                and self._consecutive >= self.max_consecutive
            ):
                flows = flows[1:] + flows[:1]  # turn cap: someone else goes first
            for _, key in flows:
                heap = self._flows[key].heap
                while heap and not heap[0].live:
                    heapq.heappop(heap)
                if heap:
                    return heap[0]
        return None

    # ------------------------------------------------------------------ slots

    def _grant(self, cost_ms: float) -> Slot:
        slot = Slot(self, cost_ms, time.monotonic())
        self._inflight.add(slot)
        return slot

    def _release(self, slot: Slot) -> None:
        self._inflight.discard(slot)
        self._wake_next()

    def _free(self, request_class: str) -> int:
        free = self.slots - len(self._inflight) - self._reserved
        return free if request_class == CONTROL_CLASS else free - self.reserved_control

    def _wake_next(self) -> None:
        while self._free(CONTROL_CLASS) > 0:
            waiter = self._next_waiter()
            if waiter is None:
                return
            heapq.heappop(self._flows[waiter.flow].heap)
            self._forget(waiter)
            flow = self._flows[waiter.flow]
            self._charge(waiter.flow, waiter.cost_ms, flow.weight, self._classes[waiter.flow[0]].weight)
            self._reserved += 1
            waiter.future.set_result(None)
