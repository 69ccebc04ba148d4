"""A device set that schedules the units of a topology: dispatch rule 10.

``gateway.core.dispatch.DeviceSet`` treats a backend's devices as interchangeable: each
request holds one, whichever frees first. On a backend that declares a topology
(``gateway.core.topology``) this subclass owns the devices instead, one by one:

* every pool attached to it (``attach``) has a layout and its units (a tensor-parallel
  group, a pipeline); a pool whose model declares none has one device per unit;
* **a request binds a whole unit that is free now, or waits** in the dispatch queue: never
  bound ahead into the backend's queue (there it would hold half a group while the rest is
  busy), never onto a unit with a device held by other work or lost. A pool's units share
  devices with other pools' units: a device a TP-1 request holds takes every TP-2 unit that
  spans it, and a bound TP-2 unit takes both of its devices from the TP-1 pool;
* **no starvation of wide units** (``claim``): when the device set's most urgent waiter (the
  earliest latest start of every pool's next waiter) finds none of its units free, the unit
  predicted to be whole first is claimed for it: other pools' work takes a device of it only if
  it ends before the unit is predicted to be whole (backfill), so freed devices accumulate into
  the pair instead of going to a stream of narrow work;
* **which free unit** (``assign``): the one that breaks the fewest whole units of the other
  pools that are free now (best fit: a TP-1 request takes a device whose pair is already
  broken before one of a whole free pair), then the lowest-numbered; the slot carries it
  (``Slot.unit``) and the gateway names it to the backend (the request's ``devices``
  parameter: the capacity emulator holds exactly those devices);
* **lost devices** (``mark_lost``): a unit spanning one takes no work; the pool's capacity
  (``DispatchQueue.capacity_devices``, the ladder's protected capacity) drops by every device
  of the units lost, so the healthy half of a broken group is neither counted nor lent to
  work of that layout (a TP-1 pool's own units on the healthy devices still count);
* **predictions** list-schedule the asking pool's own units over the devices' predicted
  free times (the work bound to each device, from its predicted start for its occupancy;
  work that overran its prediction ends now, corrected at release); queued work of other
  pools ahead of it takes one of its units each (an approximation: another layout's work may
  take fewer or more of its devices);
* **memory** per device: the queue divides a unit's live bytes by its width (each device
  holds its share of the shards and of the live state), and a unit free now holds no other
  work, so work fits when its share fits an idle device (``device_limit`` refuses more).

Short lanes (rule 7) and co-batching (rule 6) are not applied on a topology: work binds
only onto free units, so nothing waits in the backend's queue for either to shape. A fleet
of replicas does not schedule a topology (the config refuses it): units are this process's.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

from gateway.core.dispatch import DeviceSet, DispatchQueue, Slot
from gateway.core.memory import DeviceMemory
from gateway.core.topology import Layout, Topology, Unit, available


class UnitDeviceSet(DeviceSet):
    """The devices of a backend with a topology, scheduled by units (rule 10)."""

    def __init__(
        self, topology: Topology, memory: DeviceMemory | None = None, lost: Iterable[int] = ()
    ) -> None:
        super().__init__(topology.devices, memory=memory)
        self.topology = topology
        self.lost: frozenset[int] = frozenset(lost)
        self.units: dict[DispatchQueue, tuple[Unit, ...]] = {}  # every unit of each pool's model
        self.lost_at: dict[int, float] = {}

    @property
    def units_mode(self) -> bool:
        return True

    # ------------------------------------------------------------------ pools

    def attach(self, queue: DispatchQueue, layout: Layout, units: tuple[Unit, ...]) -> None:
        """``queue``'s model runs on ``units`` with ``layout`` (its queue holds unit costs)."""
        queue.layout = layout
        queue.co_batch_max = 1  # nothing waits in the backend's queue to join (rule 6 off)
        self.units[queue] = units
        self._recount(queue)

    def available_units(self, queue: DispatchQueue) -> tuple[Unit, ...]:
        """``queue``'s units with no lost device."""
        return available(self.units.get(queue, ()), self.lost)

    def mark_lost(self, devices: Iterable[int], *, lost: bool = True, now: float = 0.0) -> None:
        """Devices lost (or back: ``lost=False``): units spanning a lost one take no work, and
        every pool's counted capacity follows the units left. Work bound to them is not
        touched here (its backend fails or finishes it; its release frees the slot)."""
        changed = set(devices)
        for d in changed:
            if not 0 <= d < self.devices:
                raise ValueError(f"device {d} is out of range (0..{self.devices - 1})")
        if lost:
            self.lost = self.lost | changed
            for d in changed:
                self.lost_at.setdefault(d, now)
        else:
            self.lost = self.lost - changed
            for d in changed:
                self.lost_at.pop(d, None)
        for queue in self.units:
            self._recount(queue)
        for queue in self.queues:  # a unit back may start waiting work
            queue.wake_next(now)

    def _recount(self, queue: DispatchQueue) -> None:
        left = len(self.available_units(queue))
        queue.capacity_devices = left * queue.layout.width
        queue.devices = max(1, left)
        # Free units gate binding (``bind_start``); the slot count only has to stay out of its way
        # (work still running on a unit lost meanwhile holds a slot until it ends), with the
        # control class's reserve beyond every unit (rule 4: it never holds a unit back).
        queue.slots = max(1, len(self.units.get(queue, ()))) + queue.reserved_control
        queue.decode.streams = max(1, left)

    # ------------------------------------------------------------------ devices

    def held(self) -> set[int]:
        """Devices held by bound work (whatever its prediction says)."""
        return {d for slot in self.bound if slot.unit is not None for d in slot.unit.devices}

    def free_units(self, queue: DispatchQueue) -> list[Unit]:
        """``queue``'s units whose every device is free now and not lost."""
        busy = self.held() | self.lost
        return [u for u in self.units.get(queue, ()) if not u.spans(busy)]

    def device_free_times(self, now: float) -> list[float]:
        """When each device is predicted to free: the latest predicted end of the work bound to
        it (work that overran ends now); a lost device never."""
        free = [now] * self.devices
        for slot in self.bound:
            if slot.unit is None:
                continue
            done_ms = max(0.0, now - slot.predicted_start) * 1000.0
            end = now + max(0.0, slot.run_ms - done_ms) / 1000.0
            for d in slot.unit.devices:
                free[d] = max(free[d], end)
        for d in self.lost:
            free[d] = math.inf
        return free

    def free_times(
        self, now: float, *, replan: bool = False, fleet: bool = False, queue: DispatchQueue | None = None
    ) -> list[float]:
        """A heap of when each of ``queue``'s available units frees (the latest of its devices);
        without a queue, each device's. No units left: one that never frees."""
        device_free = self.device_free_times(now)
        if queue is None or queue not in self.units:
            times = [t for t in device_free if t < math.inf] or [math.inf]
        else:
            times = [max(device_free[d] for d in u.devices) for u in self.available_units(queue)] or [
                math.inf
            ]
        heapq.heapify(times)
        return times

    def occupants(self) -> int:
        return sum(1 for slot in self.bound if slot.unit is not None)

    def bind_start(
        self,
        now: float,
        latest_start: float,
        *,
        long: bool = False,
        cost_ms: float = 0.0,
        stream: bool = False,
        queue: DispatchQueue | None = None,
    ) -> float | None:
        """Now, if one of ``queue``'s units is wholly free now and not claimed for more
        urgent work (or backfills it: ``allowed_units``); else None (it waits)."""
        if queue is None:
            return None
        return now if self.allowed_units(now, queue, cost_ms) else None

    def claim(self, now: float) -> tuple[DispatchQueue, Unit, float] | None:
        """The unit held for the most urgent waiter of the device set (the earliest latest
        start of every pool's next waiter) when none of its pool's units is free now: the one
        predicted to be whole first, and when. Without it a wide unit would starve: a device
        freed by narrow work is taken again by narrow work before its partner frees, and the
        pair is never whole (gang scheduling's reservation, as in backfilling schedulers)."""
        urgent: tuple[float, DispatchQueue] | None = None
        for queue in self.units:
            if queue.queued:
                head = queue.head_latest_start()
                if head < math.inf and (urgent is None or head < urgent[0]):
                    urgent = (head, queue)
        if urgent is None or self.free_units(urgent[1]):
            return None
        queue = urgent[1]
        free = self.device_free_times(now)
        best: tuple[float, Unit] | None = None
        for unit in self.available_units(queue):
            whole_at = max(free[d] for d in unit.devices)
            if best is None or whole_at < best[0]:
                best = (whole_at, unit)
        return None if best is None else (queue, best[1], best[0])

    def allowed_units(self, now: float, queue: DispatchQueue, cost_ms: float) -> list[Unit]:
        """``queue``'s free units that work of ``cost_ms`` (occupancy) may take now: not one
        spanning a device claimed for another pool's more urgent waiter (``claim``), unless it
        ends before that unit is predicted to be whole (backfill: it delays nobody)."""
        free = self.free_units(queue)
        if not free:
            return free
        held = self.claim(now)
        if held is None or held[0] is queue:
            return free
        _, claimed, whole_at = held
        fits_before = now + cost_ms / 1000.0 <= whole_at
        return [u for u in free if fits_before or not u.spans(claimed.devices)]

    def free_unit_among(self, now: float, units: Iterable[Unit]) -> Unit | None:
        """The first of ``units`` (another model's, e.g. a shadow candidate's) wholly free now,
        not lost and not claimed for a waiter: work that takes only an idle unit."""
        busy = self.held() | self.lost
        held = self.claim(now)
        if held is not None:
            busy |= set(held[1].devices)
        return next((u for u in units if not u.spans(busy)), None)

    def assign(self, queue: DispatchQueue, slot: Slot) -> None:
        """Give the granted slot the free unit, of those it may take (``allowed_units``), that
        breaks the fewest free units of the other pools (then the lowest-numbered)."""
        free = self.allowed_units(slot.predicted_start, queue, slot.cost_ms) or self.free_units(queue)
        if not free:  # bind_start said one was free: a caller granting without asking is a bug
            raise RuntimeError(f"{queue.name}: a slot was granted with no free unit")
        others = [u for q in self.units if q is not queue for u in self.free_units(q)]

        def broken(unit: Unit) -> int:
            return sum(1 for other in others if other.spans(unit.devices))

        slot.unit = min(free, key=lambda u: (broken(u), u.devices))

    def join(self, now: float, queue: DispatchQueue, batch: object, end_by: float) -> None:
        return None  # rule 6 is off on a topology: nothing waits in the backend's queue

    def fits(self, now: float, live_bytes: int) -> bool:
        """A free unit holds no other work: a device's share fits if an idle device holds it."""
        return live_bytes <= self.live_room_bytes

    def room_for(self, now: float, slot: Slot, live_bytes: int) -> bool:
        """May ``slot`` (bound: its unit's devices are its own) hold ``live_bytes`` more per device?"""
        if slot.unit is None or slot not in self.bound:
            return False
        return slot.live_bytes + live_bytes <= self.live_room_bytes

    def memory_free_at(self, now: float, live_bytes: int) -> float:
        return now

    def long_may_bind(self, now: float, latest_start: float, cost_ms: float) -> bool:
        return True  # no short lane on a topology: bind_start decides by free units

    def long_start(self, now: float, ahead_ms: object = (), *, cap: int | None = None) -> float:
        return now


__all__ = ["UnitDeviceSet"]
