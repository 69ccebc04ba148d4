"""Gateway-side queues with late binding and hierarchical fair shares: the state machine.

This module decides; it does not wait. Every method takes ``now``; a request that
cannot start at once becomes a ``Waiter``, and whenever a waiter is granted a slot
or refused (pushed out of a full queue) the change is recorded on its
``DeviceSet`` (``take_changes``) for the driver to act on: ``gateway.scheduler``
resolves asyncio futures on the event loop (live, and in the simulator's virtual
time); a test can drive it by hand. A waiter that gives up (its latest start
passed, or its caller went away) is ``withdraw``-n by the driver.

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
   size of its requests. A flow that wakes up starts at the system's virtual
   time: the start tag of the latest grant while the pool is busy, the largest
   finish tag granted once it is idle. So idleness banks no credit, and a flow
   that ran alone on capacity nobody else wanted is not charged for it when
   others arrive (with each flow's own clock it was: a newcomer took nearly
   every grant until it caught up). Ties of virtual time go to the flow whose
   waiting work arrived first, never by tenant name.
2. **Least slack first inside a flow**: earliest latest-start (deadline minus
   predicted execution) first, FIFO among equals. Plain earliest-deadline-first
   would keep a long request behind every short one that arrives with a nearer
   deadline until its own latest start had passed; ordering by latest start
   gives it its turn while it can still finish.
3. **No starvation.** A large job's flow is charged by its cost, so it waits
   while its virtual time is ahead, but every other flow's time advances with
   each grant: its turn comes after a bounded amount of others' work (aging
   by virtual time). ``max_consecutive`` (``limits.max_consecutive_grants``)
   additionally caps how many grants in a row one flow may take while another
   flow of its class waits.
4. **A reserved slice for control traffic.** With ``reserved_control`` > 0 the
   last free slot(s) go only to the ``control`` class (recovery and health
   work must not queue behind a flood).
5. **Bounded.** At most ``max_queued`` waiters; more is RESOURCE_EXHAUSTED
   with a retry-after from the predicted wait. A waiter that cannot start
   before its latest feasible start leaves with ``DeadlineExpired`` instead of
   running late; a cancelled waiter leaves at once and holds nothing.
6. **Bind ahead one request at a time, and only when it starts in time.** The
   slots beyond one per device bind work into the backend's own queue (Triton
   runs it FIFO on the first instance to free), which hides the round trip
   between two requests. The queue list-schedules the work it has bound over
   the pool's devices to predict when a device frees. Work is bound ahead
   only if that predicted start is before its latest start, and only when
   nothing bound earlier is still waiting in the backend's queue: two waiting
   there would be co-batched when an instance frees, the first one then
   finishing with the whole (padded) batch, later than predicted. Otherwise
   the waiter stays here, where a deadline can still reorder it, until a
   device frees: a short request is never stuck in Triton's queue behind a
   long one.

   **Compatible co-batching.** The one exception to "one waiting in the
   backend's queue": short work of the same pool and profile (``BatchShape``)
   may *join* the work waiting there, up to ``co_batch_max`` requests, when the
   backend's batcher will take them as one batch (the pool's own work holds
   every device, so every instance of the model is busy and the next one to
   free takes the whole queue) and the batch, padded to its longest member
   (``profile.batch_accelerator_ms``), still ends within every member's
   deadline. Prefill is per row but launch and decode steps are shared, so a
   batch of two seed-shaped short requests costs 41.2 device-ms instead of
   2 x 28.4 at time factor 0.5: the seed's "batch only compatible work inside
   explicit latency and fairness bounds". The list schedule holds a batch as
   one occupant of one device for its batch cost. Fair order is unchanged:
   the queue still decides who goes next (rule 1); joining only decides
   whether that waiter may bind now. Long work never co-batches (it never
   binds ahead).

7. **A short lane.** Long-bucket work (inputs over the route's ``long_input_tokens``) holds
   at most ``devices - short_lane`` devices of a device set at once (at least one), and is
   bound only onto a device free now, never ahead into the backend's queue (there it would
   take whichever device frees first). Short work may use every device. A burst of long
   requests therefore never leaves a short one behind them all: the seed's "dispatch the
   long input separately". A long request's predicted start counts the lane too. The lane
   is kept only while short work has asked for a device in the last SHORT_LANE_IDLE_S:
   long-only traffic uses every device.

   A **soft lane** (``short_lane_soft`` further devices) is short work's too, except for a
   long request that could not otherwise start in time: one whose wait for a device within
   the soft cap would start it later than LONG_URGENT_LEAD of its own run before its latest
   start takes a soft-lane device at once. Long work therefore holds the soft lane only when
   it needs it. The shipped limits (``limits.short_lane_devices`` 2, soft 0) keep half of the
   example's four devices for short work outright (the seed mix puts about as much short work
   as long on a pool): a device a long request takes in a burst leaves several short ones to
   the fallback, while one long request refused or diverted frees eight short ones' time, so
   a hard half degrades the fewest answers. **One long request per wake-up**:
   two bound in the same instant would be co-batched by the backend's batcher (one padded
   batch, about twice the time, both late), so the second waits for the next device to free.

8. **Live memory** (``gateway.core.memory``). With a declared device memory
   (``DeviceSet.memory``: the device less the runtime reserve and the replicas of the models
   placed on it), work binds only if its live state (the record's ``peak_memory_bytes``) fits
   on the device it would run on beside the live state of the work bound there. Bound work
   counts from binding to release: a server may admit a request it holds into its running
   batch at once, and a request that runs past its prediction still holds its state. Work
   that cannot fit even on an idle device is refused at once (INVALID_ARGUMENT,
   ``memory.device_limit``). Work that does not fit yet waits here, not bound, until a
   release frees enough; if its latest start passes while it waits for memory it leaves with
   RESOURCE_EXHAUSTED (``memory.live_tokens``) and a retry-after from when the bound work is
   predicted to free it (``refusal``). As a device runs one bound request at a time (rule 6),
   this keeps a request from being bound ahead beside work it would not fit with, and holds
   work whose memory a request running past its prediction still holds. The memory wait is
   not added to predicted waits: it ends when the device it waits for frees.

9. **Streams: decode turns by weighted share, no binding ahead, memory by tokens.** A
   stream (``stream=True``: a decoupled model's request, decoding token by token until it
   ends) holds its slot for as long as it decodes. Per pool, each tenant's concurrently
   decoding streams and their live state are bounded by its weighted share of the pool's
   slots and live room (``gateway.core.decode.DecodeShare``, ``limits.stream_share``,
   ``limits.max_decoding_streams_per_tenant``): a tenant alone may use them all; under
   contention an over-share tenant's new streams wait while an in-share tenant's start.

   A stream **never binds ahead** into the backend's queue: it binds only onto a device free
   now (``bind_start(stream=True)``). Bound ahead, its first result would wait in Triton's
   FIFO for the whole remaining run of the work on the device it lands on (for another
   stream: until that stream ends, which no prediction bounds), and every stream that
   arrives after it, an in-share tenant's included, would wait behind it there where no
   share can reorder them. Waiting here instead costs one round trip when a device frees,
   and the fair order (rule 1 and the decode share) still decides who takes it. Binding
   ahead would pay off only when the bound stream's predicted first result meets its own
   first-result deadline and no other flow's waiting stream is delayed by it; with streams'
   unbounded run lengths the gateway cannot predict the first and the second fails whenever
   another tenant waits, so the simplest correct rule is the one kept.

   A stream's **memory charge grows with its tokens** (live-token-ms): it binds holding its
   prompt's live state (``live_bytes``: input tokens, not the peak) and each generated
   token's state is added as it is produced (``Slot.grow_live``), while the device it runs
   on has live room beside the work bound there; ``grow_live`` refuses (returns False and
   flags ``Slot.live_exhausted``) once it has not. ``Slot.release`` frees it all.

10. **Units of a topology** (``gateway.core.units.UnitDeviceSet``; ``gateway.core.topology``).
   On a backend that declares a topology, a pool's model has a parallel layout and the
   device set schedules its *units* (a tensor-parallel group, a pipeline): work binds a whole
   unit that is free now or waits here (never bound ahead, so never half a group), the
   devices it holds are taken from every other pool's units that span them, and a unit with
   a lost device takes no work. Costs and live bytes enter as accelerator-ms and bytes of
   the whole unit (``_per_unit``): the unit is held for the occupancy (the execution, or a
   pipeline's cadence) and each device holds its share of the live state. Predicted waits
   list-schedule the pool's own units; the ladder counts the devices of the units left
   (``capacity_devices``).

Several pools can run on the same devices (a fallback model placed beside the
primary on each accelerator): their queues then share one ``DeviceSet``, which
list-schedules the work of all of them, so one pool's prediction counts the
other's work and a device freed by either wakes both.

The queue also answers the admission question "when would this start?" by the
same list scheduling: the work bound to the backend, then the queued work with
an earlier deadline, over the pool's devices.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.core import memory as device_memory
from gateway.core.decode import DecodeShare
from gateway.core.errors import DeadlineExpired, GatewayError, ResourceExhausted
from gateway.core.memory import DeviceMemory
from gateway.core.profile import DemandProfile, batch_accelerator_ms
from gateway.core.topology import TRIVIAL, Layout, Unit

CONTROL_CLASS = "control"
# The refusal of a request whose latest start passed while it waited (the driver raises it).
LATE_RULE = "queue.latest_start"
# The refusal of a stream whose latest start passed while its tenant's decoding streams held
# their share of the pool (rule 9).
STREAM_SHARE_RULE = "queue.stream_share"


# The short lane is kept only while short work has asked for a device this recently: a few
# short requests' worth of time at the seed's rates (140 short/s), so a lull between two short
# arrivals does not hand the lane to a long request that would then hold it for ~470 ms.
SHORT_LANE_IDLE_S = 1.0
# Long work takes a soft-lane device once waiting for one of its own would start it later than
# this share of its own run time before its latest start (rule 7): it binds only onto a device
# free now, and must still catch one when a device it counted on goes to more urgent work.
LONG_URGENT_LEAD = 0.1
# Work joins a batch waiting in the backend's queue only while that batch is predicted to wait
# at least this long more (rule 6): a device that frees has the backend start the waiting work
# at once, before the response that tells the gateway so has arrived; joining in that window
# would send a request the batcher no longer sees, to run alone later than predicted.
JOIN_LEAD_S = 0.003


# Versions of the bound work (``_Bound``): unique across device sets, so a cached schedule never
# matches another set's work.
_VERSIONS = itertools.count(1)


def _too_late(start: float, latest_start: float, cost_ms: float) -> bool:
    """Would long work starting at ``start`` be urgent (rule 7's soft lane)?"""
    return start > latest_start - LONG_URGENT_LEAD * cost_ms / 1000.0


class BatchShape(msgspec.Struct, frozen=True, gc=False):
    """What a short request brings to a batch: its shape and how its price scales the pool's
    profile (time scale and estimator correction: its ``cost_ms`` over the profile's price).
    Work co-batches only within one pool (one model, one profile): rule 6."""

    input_tokens: int
    output_tokens: int
    scale: float = 1.0


class CoBatch:
    """Work bound together into the backend's queue, which its batcher runs as one batch on
    one device (rule 6): the list schedule holds it as one occupant for ``cost_ms``.
    ``members`` are the slots still bound; ``solo_ms`` is what all that joined would have cost
    one by one (settlement splits the batch's device time by it)."""

    __slots__ = ("cost_ms", "finished", "members", "solo_ms")

    def __init__(self, members: list[Slot], cost_ms: float) -> None:
        self.members = members
        self.cost_ms = cost_ms
        self.solo_ms = sum(member.cost_ms for member in members)
        # A member was released: the batch is done (its responses leave together), whatever
        # the list schedule still holds for the members whose release is still on its way.
        self.finished = False


@dataclass(order=True)
class Waiter:
    """A request waiting for a slot. Ends granted (``slot``), refused (``refused``) or
    withdrawn by its driver; ``token`` is the driver's own (e.g. a future)."""

    latest_start: float  # deadline minus predicted execution: the order inside a flow
    seq: int
    cost_ms: float = field(compare=False)
    flow: tuple[str, str] = field(compare=False, default=("", ""))
    live: bool = field(compare=False, default=True)
    long: bool = field(compare=False, default=False)
    live_bytes: int = field(compare=False, default=0)  # live sequence state it will hold
    memory_held: bool = field(compare=False, default=False)  # last kept here for want of memory
    share_held: bool = field(compare=False, default=False)  # last kept: its tenant's decode share
    batch: BatchShape | None = field(compare=False, default=None)  # may co-batch (rule 6)
    stream: bool = field(compare=False, default=False)  # a decoding stream (rule 9)
    slot: Slot | None = field(compare=False, default=None)
    refused: GatewayError | None = field(compare=False, default=None)
    token: Any = field(compare=False, default=None)


@dataclass(eq=False)
class Slot:
    """Permission to run one request on the pool: held from binding to the backend until done."""

    queue: DispatchQueue
    cost_ms: float
    started_at: float  # bound to the backend
    predicted_start: float  # when a device is predicted to start it (later if bound ahead)
    released: bool = False
    long: bool = False  # long-bucket work: never on the short lane
    live_bytes: int = 0  # live sequence state it holds on its device until released
    batch: BatchShape | None = None  # its shape, if it may co-batch (rule 6)
    end_by: float = math.inf  # when its execution must have ended (latest start + cost)
    group: CoBatch | None = None  # the batch it was bound into with other work, if any
    stream: bool = False  # a decoding stream (rule 9): its live state grows with its tokens
    tenant: str = ""  # whose stream (the decode share counts it)
    live_exhausted: bool = False  # a ``grow_live`` was refused: its device has no live room left
    held_byte_ms: float = 0.0  # live bytes x ms held from binding to ``held_since``
    held_since: float | None = None  # when ``live_bytes`` last changed (None: at ``started_at``)
    unit: Unit | None = None  # the unit it holds, on a device set with a topology (rule 10)

    @property
    def occupant(self) -> bool:
        """Does it hold a device of its own in the list schedule (not a later member of a
        batch, whose device time its batch's first member holds)?"""
        return self.group is None or self.group.members[0] is self

    @property
    def run_ms(self) -> float:
        """Device-ms it holds its device for: its batch's cost (none once the batch is done), or
        its own."""
        if self.group is None:
            return self.cost_ms
        return 0.0 if self.group.finished else self.group.cost_ms

    def backend_wait_s(self, sent: float) -> float:
        """Its predicted wait in the backend's queue, sent to the backend at ``sent``: from its
        binding to its predicted start (a request bound ahead waits for the device before it).
        Settlement subtracts it from the backend time it charges."""
        return max(0.0, self.predicted_start - self.started_at)

    def grow_live(self, live_bytes: int, now: float) -> bool:
        """Its live state grows by ``live_bytes`` (a stream's new tokens: rule 9). True when
        charged (or nothing to grow); False when the device it runs on has no live room left
        for it beside the work bound there: nothing is charged, ``live_exhausted`` is set, and
        the caller ends the stream (or stops generating). A released slot grows no more."""
        if self.released:
            return False
        if live_bytes <= 0:
            return True
        _, live_bytes = self.queue._per_unit(0.0, live_bytes)  # each device's share (rule 10)
        if not self.queue.device_set.room_for(now, self, live_bytes):
            self.live_exhausted = True
            return False
        self.held_byte_ms, self.held_since = self.live_byte_ms(now), now
        self.live_bytes += live_bytes
        if self.stream:
            self.queue.decode.grow(self.tenant, live_bytes)
        return True

    def live_byte_ms(self, now: float) -> float:
        """Live bytes x milliseconds it has held from binding to ``now`` (to its release, once
        released): over its ``live_cache_bytes_per_token``, a stream's observed live-token-ms,
        growing with its tokens (rule 9)."""
        since = self.started_at if self.held_since is None else self.held_since
        if self.released:
            return self.held_byte_ms
        return self.held_byte_ms + self.live_bytes * max(0.0, now - since) * 1000.0

    def release(self, now: float) -> None:
        """The request is done with its device (idempotent): its slot and all its live state
        are freed; waiters may be granted."""
        if not self.released:
            self.held_byte_ms, self.held_since = self.live_byte_ms(now), now
            self.released = True
            self.queue._release(self, now)


class _Device:
    """One device in the list schedule: when it frees, and the live state of the work on it."""

    __slots__ = ("ends", "free_at", "live_bytes", "work")

    def __init__(self, free_at: float) -> None:
        self.free_at = free_at
        self.live_bytes = 0
        self.ends: list[tuple[float, int]] = []  # (predicted end, live bytes)
        self.work: list[Slot] = []  # the slots the list schedule puts on it

    def live_at(self, t: float) -> int:
        """Live bytes still held at ``t`` (work predicted to end by then has freed its state)."""
        return sum(held for end, held in self.ends if end > t)


class _Bound(dict["Slot", None]):
    """The work bound to a device set, in binding order: a dict whose every change takes a new
    ``version`` (the schedule caches are keyed by it), and which keeps what the list schedule
    and the binding rules read of the bound work incrementally (issue 31):

    * ``occupancy()``: each occupant's (predicted start, run ms), in binding order: the list
      schedule's inputs;
    * ``latest()``: the latest predicted start of any bound slot (is work waiting in the
      backend's queue?);
    * ``longs()``: how many bound slots are long work (rule 7).

    Binding a slot (a new key: the last in binding order, so it goes last) and releasing one
    that is no batch's member update them in O(1). A change to the bound slots themselves (a
    replanned start, a batch joined or left: ``touch``), the release of a batch member (its
    batch's next member may become the occupant) or any other change to the dict drops what
    it may have changed, and it is read again from the slots on the next use: always what a
    re-read of the slots gives (tests/test_dispatch_incremental.py)."""

    __slots__ = ("_latest", "_longs", "_occ", "version")

    def __init__(self) -> None:
        super().__init__()
        self.version = next(_VERSIONS)
        self._occ: dict[Slot, tuple[float, float]] | None = {}
        self._latest: float | None = -math.inf
        self._longs: int | None = 0

    def _forget_kept(self) -> None:
        self._occ = self._latest = self._longs = None

    def touch(self) -> None:
        self.version = next(_VERSIONS)
        self._occ = self._latest = None  # a start, a batch's run or its occupant changed

    def occupancy(self) -> dict[Slot, tuple[float, float]]:
        """Each occupant's (predicted start, run ms) in binding order (``Slot.occupant``)."""
        occ = self._occ
        if occ is None:
            occ = self._occ = {slot: (slot.predicted_start, slot.run_ms) for slot in self if slot.occupant}
        return occ

    def latest(self) -> float:
        """The latest predicted start of any bound slot (-inf: none bound)."""
        latest = self._latest
        if latest is None:
            latest = self._latest = max((slot.predicted_start for slot in self), default=-math.inf)
        return latest

    def longs(self) -> int:
        """How many bound slots are long work."""
        longs = self._longs
        if longs is None:
            longs = self._longs = sum(1 for slot in self if slot.long)
        return longs

    def __setitem__(self, key: Slot, value: None) -> None:
        new = key not in self
        super().__setitem__(key, value)
        self.version = next(_VERSIONS)
        if not new:
            self.touch()  # the same slot again: its order is unchanged, re-read it
            return
        if self._longs is not None:
            self._longs += key.long
        if self._latest is not None and key.predicted_start > self._latest:
            self._latest = key.predicted_start
        # A new key is the last in binding order, so the last occupant. (A slot joining a batch
        # is no occupant, and the join's replan ``touch``-ed its batch's head before.)
        if self._occ is not None and key.occupant:
            self._occ[key] = (key.predicted_start, key.run_ms)

    def _removing(self, key: Slot) -> None:
        if key not in self:
            return
        if self._longs is not None:
            self._longs -= key.long
        if self._latest is not None and key.predicted_start >= self._latest:
            self._latest = None  # it may have been the latest: read again
        if key.group is not None:
            self._occ = None  # its batch's next member may hold the device now
        elif self._occ is not None:
            self._occ.pop(key, None)

    def __delitem__(self, key: Slot) -> None:
        self._removing(key)
        super().__delitem__(key)
        self.version = next(_VERSIONS)

    def pop(self, key: Slot, *default: Any) -> Any:
        self._removing(key)
        self.version = next(_VERSIONS)
        return super().pop(key, *default)

    def popitem(self) -> tuple[Slot, None]:
        self.version = next(_VERSIONS)
        self._forget_kept()
        return super().popitem()

    def setdefault(self, key: Slot, default: None = None) -> None:
        self.version = next(_VERSIONS)
        self._forget_kept()
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self.version = next(_VERSIONS)
        self._forget_kept()

    def clear(self) -> None:
        super().clear()
        self.version = next(_VERSIONS)
        self._forget_kept()

    def __ior__(self, other: Any) -> _Bound:  # type: ignore[override,misc]
        self.update(other)
        return self


class DeviceSet:
    """The devices one or more pools run on, and the work bound to them (in binding order).

    The list schedule's inputs (each occupant's predicted start and run, in binding order), the
    latest predicted start and the count of long work are kept incrementally by the bound work
    itself (``_Bound``: O(1) per binding and release), so the schedule is re-run from plain
    floats, and not at all for a set with a device free and nothing waiting
    (``DispatchQueue.predicted_wait_ms``). ``incremental = False`` re-simulates from the slots
    on every call (the reference the property tests compare against)."""

    incremental = True

    def __init__(self, devices: int, short_lane: int = 0, memory: DeviceMemory | None = None) -> None:
        self.devices = max(1, devices)
        self.bound: dict[Slot, None] = _Bound()
        # ``free_times``' last heap and the (bound work's version, now, devices) it is for.
        self._free_at: tuple[int, float, int] | None = None
        self._free_kept: list[float] = []
        self.queues: list[DispatchQueue] = []
        self.short_lane = short_lane  # devices long work never occupies (rule 7)
        # Further devices long work takes only when it could not start in time on its own
        # (rule 7's soft lane).
        self.short_lane_soft = 0
        self.short_seen_at = -math.inf  # when short work last asked for a device
        self._changes: list[Waiter] = []  # granted or refused since the driver last looked
        self.memory = memory  # each device's memory (rule 8); None: live state is not bounded
        self.resident: dict[str, int] = {}  # model -> its replica's bytes on every device
        # Work other replicas of a fleet have bound to these devices: pool -> predicted ends
        # (this replica's clock), refreshed by the fleet's exchange. Predictions count it
        # (``predicted_wait_ms``); binding does not (the fleet's slot leases bound that).
        self.remote_ends: dict[str, tuple[float, ...]] = {}
        # Of those, the long-bucket work's (rule 7 counts it against the short lane fleet-wide).
        self.remote_long_ends: dict[str, tuple[float, ...]] = {}

    def place(self, model: str, resident_bytes: int) -> None:
        """A model whose replica is resident on every device of the set (a pool dispatches it
        here): its weights and workspace leave less room for live state."""
        self.resident[model] = resident_bytes

    @property
    def live_room_bytes(self) -> float:
        """Bytes each device has for live sequence state (rule 8); infinite without a memory."""
        if self.memory is None:
            return math.inf
        return float(self.memory.live_room_bytes(sum(self.resident.values())))

    def take_changes(self) -> list[Waiter]:
        """Waiters granted a slot or refused since the last call, in that order."""
        changes, self._changes = self._changes, []
        return changes

    def long_cap(self, now: float) -> int:
        """How many devices long work may hold at once: all but the short lane (at least one)
        while short work has asked for a device within SHORT_LANE_IDLE_S; all of them when
        there is no short work to keep the lane for (the lane is not left idle for nobody)."""
        if now - self.short_seen_at > SHORT_LANE_IDLE_S:
            return self.devices
        return max(1, self.devices - max(0, self.short_lane))

    def long_soft_cap(self, now: float) -> int:
        """How many devices long work holds while it can wait for one of them: ``long_cap`` less
        the soft lane (at least one). Beyond it, up to ``long_cap``, only long work that would
        otherwise miss its latest start (``long_urgent``)."""
        if now - self.short_seen_at > SHORT_LANE_IDLE_S:
            return self.devices  # no short work to keep a lane for
        return max(1, self.long_cap(now) - max(0, self.short_lane_soft))

    def long_urgent(self, now: float, latest_start: float, cost_ms: float) -> bool:
        """Would long work waiting only for the soft cap's devices start later than
        ``LONG_URGENT_LEAD`` of its own cost before ``latest_start``? Then it may take a soft-lane
        device (rule 7)."""
        return _too_late(self.long_start(now, cap=self.long_soft_cap(now)), latest_start, cost_ms)

    def long_bound(self, now: float | None = None) -> int:
        """Long work bound to the devices: this replica's, and with ``now`` the other replicas'
        still predicted to run (``remote_long_ends``)."""
        bound = self.bound
        if self.incremental and isinstance(bound, _Bound):
            local = bound.longs()
        else:
            local = sum(1 for slot in bound if slot.long)
        if now is None or not self.remote_long_ends:
            return local
        return local + len(self._remote_long_ends_after(now))

    def _remote_long_ends_after(self, now: float) -> list[float]:
        return [e for ends in self.remote_long_ends.values() for e in ends if e > now]

    def long_start(self, now: float, ahead_ms: Sequence[float] = (), *, cap: int | None = None) -> float:
        """When a new long request may start, by the short lane alone: list scheduling over the
        ``cap`` devices long work may hold (default ``long_cap(now)``), of the long work bound now
        and then the queued long work ahead of it (``ahead_ms``). Work that overran its
        prediction ends now (corrected at release)."""
        cap = self.long_cap(now) if cap is None else cap
        free = [now] * cap
        ends = sorted(
            [max(now, slot.predicted_start + slot.cost_ms / 1000.0) for slot in self.bound if slot.long]
            + self._remote_long_ends_after(now)
        )
        for end in ends[-cap:]:
            heapq.heapreplace(free, end)
        for cost_ms in ahead_ms:
            heapq.heappush(free, heapq.heappop(free) + cost_ms / 1000.0)
        return free[0]

    def schedule(self, now: float, *, replan: bool = False, fleet: bool = False) -> list[_Device]:
        """The list schedule of the work bound to the devices: in binding order (Triton's
        queue is FIFO over the instances) each slot goes to the device that frees first (among
        equals the one holding the least live state), its remaining work from its predicted
        start. Work that overran its prediction is taken to end now (optimistic, and corrected
        at release); its live state counts until it is released.

        ``replan`` (a device just freed, perhaps earlier or later than predicted): work
        still waiting in the backend's queue starts when the next device frees, so its
        predicted start moves there.

        ``fleet``: the work other replicas have bound (``remote_ends``) holds the devices
        first, each request one device until its predicted end (bound before this replica's
        work is looked at, it is ahead of it in the backend's queue)."""
        devices = [_Device(now) for _ in range(self.devices)]
        free = [(now, 0, index) for index in range(self.devices)]
        if fleet and self.remote_ends:
            for remote_end in self._remote_ends_after(now):
                device_free, _, index = heapq.heappop(free)
                devices[index].free_at = max(device_free, remote_end)
                heapq.heappush(free, (devices[index].free_at, 0, index))
        for slot in self.bound:
            if not slot.occupant:
                continue  # its batch's first member holds the device (rule 6)
            device_free, _, index = heapq.heappop(free)
            if replan and slot.predicted_start > now:
                _replan(slot, device_free)
            done_ms = max(0.0, now - slot.predicted_start) * 1000.0
            end = device_free + max(0.0, slot.run_ms - done_ms) / 1000.0
            held = slot.live_bytes if slot.group is None else sum(m.live_bytes for m in slot.group.members)
            device = devices[index]
            device.free_at = end
            device.live_bytes += held
            device.ends.append((end, held))
            device.work.append(slot)
            heapq.heappush(free, (end, device.live_bytes, index))
        return devices

    def free_times(
        self, now: float, *, replan: bool = False, fleet: bool = False, queue: DispatchQueue | None = None
    ) -> list[float]:
        """A heap of the times each device is predicted to finish the work bound to it
        (``schedule``; with ``fleet``, the other replicas' bound work too).

        The same list schedule as ``schedule`` with the devices reduced to their free times:
        which of several equally free devices takes the next slot changes no free time, so
        a heap of floats gives the same times (and the same ``replan``) without the devices'
        live state. It runs for every prediction, binding and release. (``queue``: the pool
        asking; a device set with a topology answers its units' free times, rule 10.)

        Without ``replan`` or other replicas' work it runs from ``_occupancy`` (the same
        floats in the same order, so the same times); with no more occupants than devices each
        occupant has a device of its own, free ``now``, and the heap is their ends and ``now``
        for the rest. Each occupant's remaining run is ``max(0.0, run_ms - max(0.0, now - start)
        * 1000.0)`` as in ``_simulated_free_times``, written with comparisons (``x if x > 0.0
        else 0.0`` is ``max(0.0, x)``: the same float) to spare two calls per occupant."""
        if not replan and self.incremental and not (fleet and self.remote_ends):
            # Kept per (version of the bound work, now, devices): a request's admission asks
            # several pools' predictions at one ``now``. A copy goes out (callers push into it).
            bound = self.bound
            key = (bound.version, now, self.devices) if isinstance(bound, _Bound) else None
            if key is not None and key == self._free_at:
                return self._free_kept.copy()
            free = self._kept_free_times(now)
            self._free_at, self._free_kept = key, free
            return free.copy()
        return self._simulated_free_times(now, replan=replan, fleet=fleet)

    def _kept_free_times(self, now: float) -> list[float]:
        """``free_times`` from the kept occupancy (see there)."""
        occ = self._occupancy()
        count = self.devices
        if len(occ) <= count:
            # Every occupant pops a device still free at ``now`` (the rest stay ``now``).
            free: list[float] = []
            for start, run_ms in occ:
                done_s = now - start
                left_ms = run_ms - (done_s if done_s > 0.0 else 0.0) * 1000.0
                free.append(now + (left_ms if left_ms > 0.0 else 0.0) / 1000.0)
            if len(occ) < count:
                free.extend([now] * (count - len(occ)))
            heapq.heapify(free)
            return free
        free = [now] * count
        for start, run_ms in occ:
            done_s = now - start
            left_ms = run_ms - (done_s if done_s > 0.0 else 0.0) * 1000.0
            heapq.heapreplace(free, free[0] + (left_ms if left_ms > 0.0 else 0.0) / 1000.0)
        return free

    def _simulated_free_times(self, now: float, *, replan: bool = False, fleet: bool = False) -> list[float]:
        """``free_times`` re-simulated from the bound slots themselves (the reference)."""
        free = [now] * self.devices
        if fleet and self.remote_ends:
            for remote_end in self._remote_ends_after(now):
                heapq.heapreplace(free, max(free[0], remote_end))
        for slot in self.bound:  # as in ``schedule``
            if not slot.occupant:
                continue
            device_free = free[0]
            if replan and slot.predicted_start > now:
                _replan(slot, device_free)
            done_ms = max(0.0, now - slot.predicted_start) * 1000.0
            heapq.heapreplace(free, device_free + max(0.0, slot.run_ms - done_ms) / 1000.0)
        return free

    def occupants(self) -> int:
        """How many devices' worth of work is bound: a batch bound together counts once."""
        bound = self.bound
        if self.incremental and isinstance(bound, _Bound):
            return len(bound.occupancy())
        return sum(1 for slot in bound if slot.occupant)

    def _occupancy(self) -> Collection[tuple[float, float]]:
        """Each occupant's (predicted start, run ms) in binding order: the list schedule's
        inputs, kept by the bound work as it changes (``_Bound.occupancy``)."""
        bound = self.bound
        if isinstance(bound, _Bound):
            return bound.occupancy().values()
        return [(slot.predicted_start, slot.run_ms) for slot in bound if slot.occupant]

    def waiting_after(self, now: float) -> bool:
        """Is a bound slot predicted to start after ``now`` (waiting in the backend's queue)?"""
        bound = self.bound
        if self.incremental and isinstance(bound, _Bound):
            return bound.latest() > now
        return any(slot.predicted_start > now for slot in bound)

    def touch(self) -> None:
        """The bound slots changed in place (a start replanned, a batch joined or left)."""
        bound = self.bound
        if isinstance(bound, _Bound):
            bound.touch()

    def _remote_ends_after(self, now: float) -> list[float]:
        return sorted(e for ends in self.remote_ends.values() for e in ends if e > now)

    def fits(self, now: float, live_bytes: int) -> bool:
        """Would work holding ``live_bytes`` of live state fit, bound now, on the device it
        would run on (the first to free; an idle one if any) beside the live state of the work
        bound there (rule 8)?"""
        if live_bytes <= 0 or self.memory is None:
            return True
        if DeviceSet.occupants(self) < self.devices:
            # A device holds no bound work: it frees first (now) and holds the least live
            # state (none), so it is the one the schedule below would pick, at no cost.
            return live_bytes <= self.live_room_bytes
        if not self.incremental:
            device = min(self.schedule(now), key=lambda d: (d.free_at, d.live_bytes))
            return device.live_bytes + live_bytes <= self.live_room_bytes
        _, held = min(self._device_loads(now))
        return held + live_bytes <= self.live_room_bytes

    def _device_loads(self, now: float) -> list[tuple[float, int]]:
        """Each device's (free at, live bytes) in ``schedule`` (no replan, no other replicas'
        work): the same list schedule without building its devices."""
        count = self.devices
        free_at = [now] * count
        live = [0] * count
        heap = [(now, 0, index) for index in range(count)]
        for slot in self.bound:
            if not slot.occupant:
                continue
            device_free, _, index = heapq.heappop(heap)
            done_ms = max(0.0, now - slot.predicted_start) * 1000.0
            end = device_free + max(0.0, slot.run_ms - done_ms) / 1000.0
            group = slot.group
            held = slot.live_bytes if group is None else sum(m.live_bytes for m in group.members)
            free_at[index] = end
            live[index] += held
            heapq.heappush(heap, (end, live[index], index))
        return list(zip(free_at, live, strict=True))

    def room_for(self, now: float, slot: Slot, live_bytes: int) -> bool:
        """May bound ``slot`` hold ``live_bytes`` more live state on the device the list schedule
        puts it on, beside the live state of the work bound there (rule 9's growth)?"""
        if self.memory is None:
            return True
        head = slot if slot.group is None else slot.group.members[0]
        for device in self.schedule(now):
            if head in device.work:
                return device.live_bytes + live_bytes <= self.live_room_bytes
        return False  # not bound here

    def memory_free_at(self, now: float, live_bytes: int) -> float:
        """When work holding ``live_bytes`` would first fit on the device it would run on, as
        the work bound now is predicted to end and free its live state (``now`` if it fits)."""
        devices = self.schedule(now)
        room = self.live_room_bytes
        for t in sorted({now, *(end for device in devices for end, _ in device.ends)}):
            device = min(devices, key=lambda d: (max(d.free_at, t), d.live_at(t)))
            if device.live_at(t) + live_bytes <= room:
                return t
        return max((device.free_at for device in devices), default=now)

    def device_limit(self, live_bytes: int) -> GatewayError | None:
        """The refusal of work whose live state cannot fit even on an idle device (rule 8)."""
        room = self.live_room_bytes
        return device_memory.device_limit(live_bytes, room) if live_bytes > room else None

    def long_may_bind(self, now: float, latest_start: float, cost_ms: float) -> bool:
        """May long work with this latest start be bound now? Only onto a device free now, within
        the soft cap, or up to the hard cap when waiting for the soft cap would make it late."""
        if self.occupants() >= self.devices:
            return False
        held = self.long_bound(now)
        if held < self.long_soft_cap(now):
            return True
        return held < self.long_cap(now) and self.long_urgent(now, latest_start, cost_ms)

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
        """When work bound now would start on a device, or None if it must not be bound yet:
        every device is busy and either it would start after ``latest_start`` or work bound
        earlier is still waiting in the backend's queue (the two would be co-batched). Long
        work binds only onto a device free now, and only while the short lane stays free: in
        the backend's queue it would take whichever device frees first, the lane's included.
        A stream (``stream``) binds only onto a device free now, never ahead (rule 9).
        (``queue``: the pool binding; a device set with a topology binds onto its units.)"""
        if long:
            return now if self.long_may_bind(now, latest_start, cost_ms) else None
        occupants = self.occupants()
        if occupants < self.devices:
            return now
        if stream:
            return None
        # One request (or one batch: ``join``) at most waits in the backend's queue: by
        # prediction (a bound slot not yet started) and in fact (more held than devices: work
        # that overran its prediction still holds its device, whatever the list schedule says).
        if occupants > self.devices or DeviceSet.waiting_after(self, now):
            return None
        start = self.free_times(now)[0]
        return start if start <= latest_start else None

    def join(
        self, now: float, queue: DispatchQueue, batch: BatchShape | None, end_by: float
    ) -> tuple[float, float, Slot] | None:
        """Rule 6's compatible co-batching: may short work of ``queue`` with shape ``batch``,
        whose execution must end by ``end_by``, be bound into the batch waiting in the
        backend's queue? Then (its predicted start, the batch's new cost, the waiting slot it
        joins); else None. Only when the work waiting there is all of the same pool and may
        co-batch, has fewer than the pool's ``co_batch_max`` members, and the pool's own work
        holds every device (every instance of the model busy: the next to free takes the whole
        queue as one batch) with no other replica's work on the devices, and the batch, padded
        to its longest member, still ends within every member's deadline."""
        profile = queue.batch_profile
        if batch is None or profile is None or queue.co_batch_max < 2:
            return None
        if not DeviceSet.waiting_after(self, now):
            return None
        waiting = [s for s in self.bound if s.predicted_start > now]
        if not waiting:
            return None
        head = waiting[0]
        members = head.group.members if head.group is not None else [head]
        if len(members) != len(waiting) or len(members) >= queue.co_batch_max:
            return None
        if any(m.queue is not queue or m.batch is None or m.long for m in members):
            return None
        running = [s for s in self.bound if s.predicted_start <= now and s.occupant]
        if any(s.queue is not queue for s in running):
            return None
        # Never beside other replicas' work (a fleet, ``remote_ends``): this replica cannot see
        # what of theirs waits in the backend's queue, which the batcher would add to the batch.
        if len(running) != self.devices or self._remote_ends_after(now):
            return None
        cost_ms = _batch_cost_ms(profile, [m.batch for m in members if m.batch is not None] + [batch])
        start = min(max(now, s.predicted_start + s.run_ms / 1000.0) for s in running)
        if start - now < JOIN_LEAD_S or head.predicted_start - now < JOIN_LEAD_S:
            return None  # the backend may have started it already
        if start + cost_ms / 1000.0 > min(end_by, *(m.end_by for m in members)):
            return None
        return start, cost_ms, head

    def assign(self, queue: DispatchQueue, slot: Slot) -> None:
        """A slot was granted: a device set with a topology gives it its unit (rule 10)."""

    @property
    def units_mode(self) -> bool:
        """Does this device set schedule units of a topology (rule 10)?"""
        return False


def _batch_cost_ms(profile: DemandProfile, shapes: Sequence[BatchShape]) -> float:
    """Device-ms of ``shapes`` run as one padded batch of the pool's profile (rule 6), at the
    largest of their scales (time scale, estimator correction)."""
    return max(shape.scale for shape in shapes) * batch_accelerator_ms(
        profile, [(shape.input_tokens, shape.output_tokens) for shape in shapes]
    )


def _replan(slot: Slot, start: float) -> None:
    """Work waiting in the backend's queue starts at ``start``: its batch's members with it."""
    for member in slot.group.members if slot.group is not None else (slot,):
        member.predicted_start = start
    slot.queue.device_set.touch()


@dataclass
class _Flow:
    heap: list[Waiter] = field(default_factory=list)
    vtime: float = 0.0
    weight: float = 1.0
    live: int = 0
    streams: int = 0  # of ``live``, the decoding streams (rule 9)


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
        device_set: DeviceSet | None = None,
        stream_share: bool = True,
        max_streams_per_tenant: int | None = None,
    ) -> None:
        """``max_consecutive``: the most grants in a row one flow takes while another of its
        class waits (rule 3; ``limits.max_consecutive_grants``). ``stream_share`` and
        ``max_streams_per_tenant``: the decode share of streams (rule 9;
        ``limits.stream_share``, ``limits.max_decoding_streams_per_tenant``)."""
        self.name = name
        self.devices = max(1, devices)
        self.device_set = device_set or DeviceSet(self.devices)
        self.device_set.queues.append(self)
        self.slots = max(1, slots)
        self.max_queued = max_queued
        # Never reserve every slot: ordinary work must always be able to run.
        self.reserved_control = min(max(0, reserved_control), self.slots - 1)
        self.max_consecutive = max(1, max_consecutive)
        # Rule 9: each tenant's decoding streams by weighted share of the pool's slots and live
        # room (the room is set when a stream asks: models are placed after construction).
        self.decode = DecodeShare(self.slots, enabled=stream_share, max_per_tenant=max_streams_per_tenant)
        self._seq = itertools.count()
        self._inflight: set[Slot] = set()
        self._classes: dict[str, _Flow] = {}  # class -> its virtual time and weight (heap unused)
        self._flows: dict[tuple[str, str], _Flow] = {}
        # The system virtual times (start-time fair queueing), among classes and, per class,
        # among its tenants: while the pool is busy, the start tag of the latest grant; once it
        # is idle, the largest finish tag granted. A flow returning from idle starts there:
        # neither credited nor charged for capacity nobody else wanted (rule 1).
        self._class_vclock = (0.0, 0.0)  # (latest start tag, largest finish tag)
        self._tenant_vclock: dict[str, tuple[float, float]] = {}
        self._last_tenant: tuple[str, str] | None = None
        self._consecutive = 0
        self.granted_ms: dict[tuple[str, str], float] = {}  # accelerator-ms granted per flow
        self.queued_ms = 0.0
        self.queued = 0
        self.held_back = 0  # times a waiter was kept here rather than bound behind busy devices
        self.memory_held = 0  # times a waiter was kept here because its live state did not fit
        self.pushed_out = 0  # waiters refused to make room for a flow with less queued work
        # Rule 6's compatible co-batching: the pool's profile (its batch cost) and the most
        # requests bound together into one backend batch (1: never; at most the model's
        # max_batch_size). ``co_batched`` counts the requests that joined a waiting batch.
        self.batch_profile: DemandProfile | None = None
        self.co_batch_max = 1
        self.co_batched = 0
        # Rule 10: the model's parallel layout (a device set with a topology sets it). Costs and
        # live bytes enter the queue as accelerator-ms and bytes of the whole unit and are held
        # here as the unit's occupancy and each of its devices' share.
        self.layout: Layout = TRIVIAL
        # Devices the ladder counts (``gateway.core.load``): every unit's, less lost units'.
        self.capacity_devices = self.devices
        # ``inflight_remaining_ms``'s last answer and the (bound work's version, now) it is for.
        self._remaining_at: tuple[int, float] | None = None
        self._remaining_ms = 0.0

    def _per_unit(self, cost_ms: float, live_bytes: int) -> tuple[float, int]:
        """Accelerator-ms and live bytes of a whole unit as the unit's occupancy and each of
        its devices' live share (rule 10; unchanged without a layout)."""
        layout = self.layout
        if layout is TRIVIAL:
            return cost_ms, live_bytes
        return layout.occupancy_ms(cost_ms), -(-live_bytes // layout.width)

    @property
    def unit_device_ms(self) -> float:
        """Accelerator-ms per ms of occupancy held here (the unit's devices; 1 without a layout)."""
        return float(self.layout.width)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def inflight_remaining_ms(self, now: float) -> float:
        """Predicted work still to execute in the pool's slots (bound to the backend).

        Kept per (version of the device set's bound work, ``now``): placement asks it of every
        candidate pool's device set, several times per request at one ``now``. Every change to
        the pool's slots (granted, released, replanned) is a change to the bound work, which
        takes a new version. Each slot's ``max(0.0, cost_ms - max(0.0, now - start) * 1000.0)``
        is written with comparisons (the same float) and summed in the same order."""
        bound = self.device_set.bound
        key = (bound.version, now) if isinstance(bound, _Bound) else None
        if key is not None and key == self._remaining_at:
            return self._remaining_ms
        left: list[float] = []
        for slot in self._inflight:
            done_s = now - slot.predicted_start
            left_ms = slot.cost_ms - (done_s if done_s > 0.0 else 0.0) * 1000.0
            left.append(left_ms if left_ms > 0.0 else 0.0)
        remaining: float = sum(left)
        self._remaining_at, self._remaining_ms = key, remaining
        return remaining

    def predicted_wait_ms(
        self,
        now: float,
        *,
        latest_start: float | None = None,
        flow: tuple[str, str] | None = None,
        weight: float = 1.0,
        cost_ms: float = 0.0,
        long: bool = False,
        stream: bool = False,
    ) -> float:
        """How long a new arrival would wait for a device: the work bound to the backend (by
        this replica and, in a fleet, by the others: ``DeviceSet.remote_ends``), then the
        queued work that goes before it, list-scheduled over the pool's devices. On
        shared devices that includes the other pools' waiters (a freed device goes to the most
        urgent). What goes before it:

        * without ``flow``: every waiter with an earlier latest start (all of them when
          ``latest_start`` is None);
        * with ``flow`` (class, tenant): its own flow's waiters with an earlier latest start;
          of another tenant's flow in the same class, only the work fair queuing grants it
          before this request (until that flow's virtual time reaches the one this request
          will finish at: rule 1); other classes and other pools by latest start. A flooder's
          backlog therefore does not make an in-share tenant's request look infeasible.
        * for a new ``stream``, of another tenant's waiting streams no more than that tenant
          may still start within its decode share while this one waits (rule 9): an
          over-share tenant's streams wait for an in-share tenant's.

        Nothing waiting in any pool of the device set, a device holding no bound work and no
        other replica's work on them (the usual case): the list schedule starts it ``now``,
        and it is not run (a topology's units are not devices: there it always runs).
        """
        if self.layout is not TRIVIAL:
            cost_ms = self.layout.occupancy_ms(cost_ms)  # ``_per_unit``'s
        device_set = self.device_set
        queued = False
        for queue in device_set.queues:
            if queue.queued:
                queued = True
                break
        if (
            not queued
            and not device_set.remote_ends
            and device_set.incremental
            and not device_set.units_mode
            and device_set.occupants() < device_set.devices
        ):
            start = now  # a device holds no bound work: ``free_times(...)[0]`` is ``now``
            ahead: list[tuple[float, float, bool, BatchShape | None]] = []
        else:
            free = device_set.free_times(now, fleet=True, queue=self)
            ahead = self._ahead(latest_start, flow, weight, cost_ms, stream=stream) if queued else []
            if ahead:
                # Queued long work beyond what the short lane lets start takes no device here
                # (it waits for a long device: rule 7; mostly within the soft cap).
                long_room = device_set.long_soft_cap(now) - device_set.long_bound(now)
                for _, cost, is_long in self._co_batched(ahead):
                    if is_long:
                        if long_room <= 0:
                            continue
                        long_room -= 1
                    heapq.heappush(free, heapq.heappop(free) + cost / 1000.0)
            start = free[0]
        if long and not self.device_set.units_mode:  # not before a long device frees
            longs_ahead = [cost for _, cost, is_long, _ in ahead if is_long]
            devices = self.device_set
            long_free = devices.long_start(now, longs_ahead, cap=devices.long_soft_cap(now))
            if latest_start is not None and _too_late(long_free, latest_start, cost_ms):
                long_free = devices.long_start(now, longs_ahead)  # it may take the soft lane
            start = max(start, long_free)
        return max(0.0, (start - now) * 1000.0)

    def _co_batched(
        self, ahead: list[tuple[float, float, bool, BatchShape | None]]
    ) -> list[tuple[float, float, bool]]:
        """The work ahead as the devices will take it: this pool's short work that may co-batch
        in batches of up to ``co_batch_max`` (rule 6), each at its padded batch cost, in the
        place of its first member; the rest one by one."""
        profile = self.batch_profile
        if profile is None or self.co_batch_max < 2:
            return [(start, cost, is_long) for start, cost, is_long, _ in ahead]
        out: list[tuple[float, float, bool]] = []
        open_at = -1  # index in ``out`` of the batch being filled
        shapes: list[BatchShape] = []
        for start, cost, is_long, batch in ahead:
            if batch is None:
                out.append((start, cost, is_long))
                continue
            if open_at < 0 or len(shapes) >= self.co_batch_max:
                open_at, shapes = len(out), []
                out.append((start, cost, False))
            shapes.append(batch)
            out[open_at] = (out[open_at][0], _batch_cost_ms(profile, shapes), False)
        return out

    def _ahead(
        self,
        latest_start: float | None,
        flow: tuple[str, str] | None,
        weight: float,
        cost_ms: float,
        *,
        stream: bool = False,
    ) -> list[tuple[float, float, bool, BatchShape | None]]:
        """The queued work that goes before a new arrival (see ``predicted_wait_ms``), by latest
        start: (latest start, cost, long, its batch shape if it may co-batch in this pool)."""

        def earlier(w: Waiter) -> bool:
            return w.live and (latest_start is None or w.latest_start <= latest_start)

        ahead: list[tuple[float, float, bool, BatchShape | None]] = []
        fair: list[tuple[str, _Flow, list[Waiter]]] = []
        for queue in self.device_set.queues:
            for key, f in queue._flows.items():
                if not f.live:
                    continue
                if flow is not None and queue is self and key[0] == flow[0] and key != flow:
                    fair.append((key[1], f, sorted(w for w in f.heap if w.live)))
                else:
                    this_pool = queue is self
                    # Another layout's work on shared units (rule 10) holds its own number of
                    # devices: counted in this pool's units by its device time.
                    wide = 1.0 if this_pool else queue.layout.width / self.layout.width
                    ahead.extend(
                        (w.latest_start, w.cost_ms * wide, w.long, w.batch if this_pool else None)
                        for w in f.heap
                        if earlier(w)
                    )
        if fair and flow is not None:
            own = self._flows.get(flow)
            start_vtime = self._system_vtime(self._tenant_vclock.get(flow[0]))
            if own is not None and own.live:
                start_vtime = own.vtime
            elif own is not None:
                start_vtime = max(own.vtime, start_vtime)
            own_ms = sum(w.cost_ms for w in (own.heap if own is not None else ()) if earlier(w))
            finish_vtime = start_vtime + (own_ms + cost_ms) / max(weight, 1e-9)
            waiting = {tenant: w for tenant, (w, _) in self._streams_waiting().items()}
            waiting[flow[1]] = weight
            for tenant, other, waiters in fair:
                allowance = max(0.0, finish_vtime - other.vtime) * max(other.weight, 1e-9)
                # Rule 9: a tenant's streams beyond its decode share wait for this in-share one.
                streams_room = math.inf
                if stream and self.decode.enabled:
                    bound = self.decode.bound(tenant, other.weight, waiting)
                    streams_room = max(0, bound.streams - self.decode.decoding(tenant).streams)
                for w in waiters:
                    if allowance <= 0.0:
                        break
                    if w.stream:
                        if streams_room <= 0:
                            continue
                        streams_room -= 1
                    ahead.append((w.latest_start, w.cost_ms, w.long, w.batch))
                    allowance -= w.cost_ms
        ahead.sort(key=lambda entry: entry[:3])
        return ahead

    def request(
        self,
        now: float,
        *,
        latest_start: float,
        cost_ms: float,
        request_class: str = "",
        tenant: str = "",
        weight: float = 1.0,
        class_weight: float = 1.0,
        long: bool = False,
        live_bytes: int = 0,
        batch: BatchShape | None = None,
        stream: bool = False,
    ) -> Slot | Waiter:
        """Ask for a slot: granted at once (``Slot``), or a ``Waiter`` in its flow, granted
        later (see ``DeviceSet.take_changes``). ``latest_start`` (the deadline minus the
        predicted execution) orders the flow; the driver withdraws the waiter once it has
        passed (``refusal`` says with which error). Weights set the class's and tenant's
        shares. A full queue raises ResourceExhausted, unless a flow holding more than its
        share of the queue makes room (its least urgent waiter is refused: rule 5).
        ``live_bytes``: the live sequence state it will hold on its device (rule 8); more
        than an idle device holds raises InvalidArgument. ``batch``: its shape, when it may be
        co-batched with compatible short work of the pool (rule 6). ``stream``: a decoding
        stream (rule 9): granted only within its tenant's decode share, never bound ahead,
        ``live_bytes`` its prompt's live state (grown by ``Slot.grow_live``); it never
        co-batches."""
        flow_key = (request_class, tenant)
        cost_ms, live_bytes = self._per_unit(cost_ms, live_bytes)
        too_big = self.device_set.device_limit(live_bytes)
        if too_big is not None:
            raise too_big
        if not long:
            self.device_set.short_seen_at = now
        if stream:
            batch = None  # a stream runs alone (rule 9)
        if (
            self._free(request_class) > 0
            and self.queued == 0
            and (not stream or self.stream_may_start(tenant, weight, live_bytes))
        ):
            end_by = latest_start + cost_ms / 1000.0
            start = self.device_set.bind_start(
                now, latest_start, long=long, cost_ms=cost_ms, stream=stream, queue=self
            )
            join = None if start is not None or long else self.device_set.join(now, self, batch, end_by)
            if join is not None:
                start = join[0]
            if start is not None and self.device_set.fits(now, live_bytes):
                self._charge(flow_key, cost_ms, weight, class_weight)
                return self._grant(
                    cost_ms,
                    now,
                    start,
                    long=long,
                    live_bytes=live_bytes,
                    batch=batch,
                    end_by=end_by,
                    join=join,
                    stream=stream,
                    tenant=tenant,
                    weight=weight,
                )
        if self.queued >= self.max_queued and not self._push_out(now, flow_key, cost_ms, weight):
            raise ResourceExhausted(
                "the model's queue is full",
                rule="queue.full",
                retry_after_ms=max(1, int(self.predicted_wait_ms(now))),
            )
        waiter = Waiter(
            latest_start,
            next(self._seq),
            cost_ms,
            flow_key,
            long=long,
            live_bytes=live_bytes,
            batch=batch,
            stream=stream,
        )
        self._enqueue(waiter, weight, class_weight)
        self.wake_next(now)  # a slot may be free with only ineligible waiters ahead
        return waiter

    def stream_may_start(self, tenant: str, weight: float, live_bytes: int) -> bool:
        """May a stream of ``tenant`` holding ``live_bytes`` start now, a slot being free (rule 9:
        ``DecodeShare.may_start`` against the tenants with a stream waiting here)?"""
        self.decode.live_bytes = self.device_set.live_room_bytes * self.device_set.devices
        return self.decode.may_start(tenant, weight, live_bytes, self._streams_waiting())

    def _streams_waiting(self) -> dict[str, tuple[float, int]]:
        """Tenant -> (weight, live bytes of its most urgent stream) of those with one waiting."""
        waiting: dict[str, tuple[float, int]] = {}
        heads: dict[str, Waiter] = {}
        for (_, tenant), f in self._flows.items():
            if f.streams <= 0:
                continue
            head = min((w for w in f.heap if w.live and w.stream), default=None)
            if head is not None and (tenant not in heads or head < heads[tenant]):
                heads[tenant] = head
                waiting[tenant] = (f.weight, head.live_bytes)
        return waiting

    def refusal(self, waiter: Waiter, now: float) -> GatewayError:
        """Why a waiter whose latest start passed leaves (its driver then withdraws it): held
        for live memory (rule 8), RESOURCE_EXHAUSTED ``memory.live_tokens`` with a retry-after
        from when the bound work is predicted to free enough; a stream last held by its tenant's
        decode share (rule 9), RESOURCE_EXHAUSTED ``queue.stream_share`` with a retry-after from
        when the first of the tenant's decoding streams is predicted to end; otherwise
        DEADLINE_EXCEEDED (``queue.latest_start``)."""
        if waiter.memory_held:
            free_at = self.device_set.memory_free_at(now, waiter.live_bytes)
            return device_memory.waited_too_long((free_at - now) * 1000.0)
        if waiter.share_held:
            mine = [s for s in self._inflight if s.stream and s.tenant == waiter.flow[1]]
            ends = [s.predicted_start + s.cost_ms / 1000.0 for s in mine]
            wait_ms = (min(ends, default=now) - now) * 1000.0
            return ResourceExhausted(
                "this tenant's streams hold its share of the model's decoding streams",
                rule=STREAM_SHARE_RULE,
                retry_after_ms=max(1, math.ceil(wait_ms)),
            )
        return DeadlineExpired("the request could not start before its deadline", rule=LATE_RULE)

    def withdraw(self, waiter: Waiter, now: float) -> Slot | None:
        """The driver gives up on a waiter (latest start passed, caller gone). Returns the
        slot if it had been granted in the meantime, which the driver must release."""
        slot = waiter.slot
        self._forget(waiter)
        self.wake_next(now)  # a waiter held behind this one may fit now
        return slot

    # ------------------------------------------------------------------ flows

    def _push_out(self, now: float, flow_key: tuple[str, str], cost_ms: float, weight: float) -> bool:
        """The queue is full: make room for a newcomer by refusing the least urgent waiter of
        the flow with the most queued work per unit of weight, if that is another flow with
        more than the newcomer's would then be (longest-queue drop, as in fair queuing: a
        flooder fills the queue only with its own backlog, never at an in-share tenant's
        expense). The refused waiter leaves with RESOURCE_EXHAUSTED and a retry-after, as
        if it had met a full queue on arrival."""
        backlog: dict[tuple[str, str], float] = {}
        for key, f in self._flows.items():
            if f.live:
                backlog[key] = sum(w.cost_ms for w in f.heap if w.live) / max(f.weight, 1e-9)
        if not backlog:
            return False
        victim_key = max(backlog, key=lambda k: backlog[k])
        mine = backlog.get(flow_key, 0.0) + cost_ms / max(weight, 1e-9)
        if victim_key == flow_key or backlog[victim_key] <= mine:
            return False
        victim = max((w for w in self._flows[victim_key].heap if w.live), key=lambda w: w.latest_start)
        self._forget(victim)
        victim.refused = ResourceExhausted(
            "the model's queue is full: this tenant holds more than its share of it",
            rule="queue.full",
            retry_after_ms=max(1, int(self.predicted_wait_ms(now))),
        )
        self.device_set._changes.append(victim)
        self.pushed_out += 1
        return True

    def _enqueue(self, waiter: Waiter, weight: float, class_weight: float) -> None:
        request_class, _ = waiter.flow
        cls = self._classes.get(request_class)
        if cls is None:
            cls = self._classes[request_class] = _Flow()
        if cls.live == 0:  # waking up: start at the system's virtual time, bank no credit
            cls.vtime = max(cls.vtime, self._system_vtime(self._class_vclock))
        cls.weight = class_weight
        cls.live += 1
        flow = self._flows.get(waiter.flow)
        if flow is None:
            flow = self._flows[waiter.flow] = _Flow()
        if flow.live == 0:
            flow.vtime = max(flow.vtime, self._system_vtime(self._tenant_vclock.get(request_class)))
        flow.weight = weight
        flow.live += 1
        flow.streams += waiter.stream
        heapq.heappush(flow.heap, waiter)
        self.queued += 1
        self.queued_ms += waiter.cost_ms

    def _forget(self, waiter: Waiter) -> None:
        if waiter.live:
            waiter.live = False
            self.queued -= 1
            self.queued_ms = max(0.0, self.queued_ms - waiter.cost_ms)
            self._flows[waiter.flow].live -= 1
            self._flows[waiter.flow].streams -= waiter.stream
            self._classes[waiter.flow[0]].live -= 1

    def _charge(self, flow_key: tuple[str, str], cost_ms: float, weight: float, class_weight: float) -> None:
        # Looked up first: a ``setdefault`` default would build a ``_Flow`` nobody reads.
        cls = self._classes.get(flow_key[0])
        if cls is None:
            cls = self._classes[flow_key[0]] = _Flow()
        flow = self._flows.get(flow_key)
        if flow is None:
            flow = self._flows[flow_key] = _Flow()
        # Its start tag: its own virtual time, or the system's if it was idle (granted at once).
        cls.vtime = max(cls.vtime, self._system_vtime(self._class_vclock))
        tenant_clock = self._tenant_vclock.get(flow_key[0], (0.0, 0.0))
        flow.vtime = max(flow.vtime, self._system_vtime(tenant_clock))
        tenant_finish = tenant_clock[1]
        class_start = cls.vtime
        tenant_start = flow.vtime
        cls.vtime += cost_ms / max(class_weight, 1e-9)
        flow.vtime += cost_ms / max(weight, 1e-9)
        self._class_vclock = (class_start, max(self._class_vclock[1], cls.vtime))
        self._tenant_vclock[flow_key[0]] = (tenant_start, max(tenant_finish, flow.vtime))
        self.granted_ms[flow_key] = self.granted_ms.get(flow_key, 0.0) + cost_ms
        if flow_key == self._last_tenant:
            self._consecutive += 1
        else:
            self._last_tenant, self._consecutive = flow_key, 1

    def _system_vtime(self, clock: tuple[float, float] | None) -> float:
        """The system virtual time of a (start, finish) clock: the latest grant's start tag while
        the pool has work in flight or waiting, the largest finish tag once it is idle."""
        if clock is None:
            return 0.0
        start, finish = clock
        return start if (self._inflight or self.queued) else finish

    @staticmethod
    def _head(flow: _Flow) -> Waiter | None:
        """The flow's first waiter by latest start (withdrawn ones dropped from the heap's top)."""
        heap = flow.heap
        while heap and not heap[0].live:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _next_waiter(
        self,
        *,
        long_ok: Callable[[Waiter], bool] | None = None,
        prefer_long: bool = False,
        stream_ok: Callable[[Waiter], bool] | None = None,
    ) -> Waiter | None:
        """The waiter to wake: least-virtual-time class, then tenant, then earliest latest start;
        of long waiters only those ``long_ok`` lets take a device now (None: all), else a flow's
        earliest short waiter; with ``prefer_long`` (a long request's device just freed) its
        earliest long waiter that may take it. Of streams, only those ``stream_ok`` lets start
        (None: all; rule 9's decode share): a flow whose streams may not start yields its turn."""

        def ok(w: Waiter) -> bool:
            return (not w.long or long_ok is None or long_ok(w)) and (
                not w.stream or stream_ok is None or stream_ok(w)
            )

        free_for_ordinary = self._free("") > 0
        # Ties of virtual time go to the flow whose waiting work arrived first, never by name.
        heads = {key: self._head(f) for key, f in self._flows.items() if f.live > 0}
        if len(heads) <= 1:  # one flow waits (or none): nothing to order
            for key, head in heads.items():
                if head is None or self._classes[key[0]].live <= 0:
                    return None
                if not (free_for_ordinary or key[0] == CONTROL_CLASS):
                    return None
                return self._pick(self._flows[key].heap, ok, prefer_long)
            return None
        first_seq: dict[str, int] = {}
        for (name, _), head in heads.items():
            if head is not None:
                first_seq[name] = min(first_seq.get(name, head.seq), head.seq)
        classes = sorted(
            (f.vtime, first_seq.get(name, 0), name)
            for name, f in self._classes.items()
            if f.live > 0 and (free_for_ordinary or name == CONTROL_CLASS)
        )
        for _, _, name in classes:
            flows = sorted(
                (self._flows[key].vtime, head.seq, key)
                for key, head in heads.items()
                if key[0] == name and head is not None
            )
            if (
                len(flows) > 1
                and flows[0][2] == self._last_tenant
                and self._consecutive >= self.max_consecutive
            ):
                flows = flows[1:] + flows[:1]  # turn cap: someone else goes first
            for _, _, key in flows:
                picked = self._pick(self._flows[key].heap, ok, prefer_long)
                if picked is not None:
                    return picked
        return None

    @staticmethod
    def _pick(heap: list[Waiter], ok: Callable[[Waiter], bool], prefer_long: bool) -> Waiter | None:
        """A flow's waiter to wake (``_next_waiter``), or None if none of its waiters may start."""
        if heap and prefer_long and not heap[0].long:
            waiting_long = [w for w in heap if w.live and w.long and ok(w)]
            if waiting_long:
                return min(waiting_long)
        if heap and ok(heap[0]):
            return heap[0]
        if heap:
            eligible = [w for w in heap if w.live and ok(w)]
            if eligible:
                return min(eligible)
        return None

    # ------------------------------------------------------------------ slots

    def _grant(
        self,
        cost_ms: float,
        now: float,
        start: float,
        *,
        long: bool = False,
        live_bytes: int = 0,
        batch: BatchShape | None = None,
        end_by: float = math.inf,
        join: tuple[float, float, Slot] | None = None,
        stream: bool = False,
        tenant: str = "",
        weight: float = 1.0,
    ) -> Slot:
        slot = self._make_slot(cost_ms, now, start, long=long, live_bytes=live_bytes)
        slot.batch = batch
        slot.end_by = end_by
        if stream:  # rule 9: its tenant's decode share counts it until it is released
            slot.stream, slot.tenant = True, tenant
            self.decode.start(tenant, weight, live_bytes)
        if join is not None:  # bound into the batch waiting in the backend's queue (rule 6)
            _, batch_ms, head = join
            group = head.group
            if group is None:
                group = head.group = CoBatch([head], head.cost_ms)
            group.members.append(slot)
            group.cost_ms = batch_ms
            group.solo_ms += cost_ms
            slot.group = group
            _replan(head, start)  # touches the bound work (the batch's cost changed too)
            self.co_batched += 1
        self._inflight.add(slot)
        self._remaining_at = None
        self.device_set.assign(self, slot)
        self.device_set.bound[slot] = None
        return slot

    def _release(self, slot: Slot, now: float) -> None:
        self._inflight.discard(slot)
        self._remaining_at = None
        if slot.stream:
            self.decode.end(slot.tenant, slot.live_bytes)
        devices = self.device_set
        devices.bound.pop(slot, None)
        if slot.group is not None and slot in slot.group.members:
            slot.group.members.remove(slot)
            if slot.predicted_start <= now:  # it ran: so did its whole batch
                slot.group.finished = True
            devices.touch()  # its batch's occupant or run changed
        # Work still waiting in the backend's queue starts when the next device frees (the
        # replan moves it); with none waiting the schedule changes nothing.
        if DeviceSet.waiting_after(devices, now):
            devices.free_times(now, replan=True)
        # A device freed by long work goes to waiting long work first (rule 7: short work has
        # its lane; without this, shorts with nearer latest starts would take every device a
        # long request frees, and queued long work would start later than predicted).
        if len(devices.queues) == 1:
            self.wake_next(now, prefer_long=slot.long)
            return
        # A device freed: the pool whose next waiter must start soonest goes first.
        for queue in sorted(devices.queues, key=DispatchQueue.head_latest_start):
            queue.wake_next(now, prefer_long=slot.long)

    def _make_slot(
        self, cost_ms: float, now: float, start: float, *, long: bool, live_bytes: int = 0
    ) -> Slot:
        """A new slot (a driver may hand out its own subclass)."""
        return Slot(self, cost_ms, now, start, long=long, live_bytes=live_bytes)

    def head_latest_start(self) -> float:
        """The latest start of the waiter this queue would grant next (inf: none waits); a
        device set wakes its queues most urgent first by it."""
        waiter = self._next_waiter() if self.queued else None
        return waiter.latest_start if waiter is not None else math.inf

    def _free(self, request_class: str) -> int:
        free = self.slots - len(self._inflight)
        return free if request_class == CONTROL_CLASS else free - self.reserved_control

    def wake_next(self, now: float, *, prefer_long: bool = False) -> None:
        devices = self.device_set
        # One long request per wake-up: two sent to the backend in the same instant would be
        # co-batched by its batcher (one padded batch, about twice the time, both late); the
        # second waits for the next device to free.
        long_granted = False

        def long_ok(waiter: Waiter) -> bool:
            return not long_granted and devices.long_may_bind(now, waiter.latest_start, waiter.cost_ms)

        def stream_ok(waiter: Waiter) -> bool:
            ok = self.stream_may_start(waiter.flow[1], self._flows[waiter.flow].weight, waiter.live_bytes)
            waiter.share_held = not ok
            return ok

        while self._free(CONTROL_CLASS) > 0:
            waiter = self._next_waiter(long_ok=long_ok, prefer_long=prefer_long, stream_ok=stream_ok)
            prefer_long = False  # only for the device that just freed
            if waiter is None:
                return
            start = devices.bind_start(
                now,
                waiter.latest_start,
                long=waiter.long,
                cost_ms=waiter.cost_ms,
                stream=waiter.stream,
                queue=self,
            )
            end_by = waiter.latest_start + waiter.cost_ms / 1000.0
            join = None if start is not None or waiter.long else devices.join(now, self, waiter.batch, end_by)
            if join is not None:
                start = join[0]
            if start is None:
                # Held: bound now, it would wait in the backend's queue past its latest start
                # or be co-batched with work already waiting there. A device freeing wakes it.
                waiter.memory_held = False
                self.held_back += 1
                return
            if not devices.fits(now, waiter.live_bytes):
                # Held for memory (rule 8): a release that frees enough wakes it.
                waiter.memory_held = True
                self.memory_held += 1
                return
            self._forget(waiter)  # leaves its heap lazily (it need not be the head)
            flow = self._flows[waiter.flow]
            self._charge(waiter.flow, waiter.cost_ms, flow.weight, self._classes[waiter.flow[0]].weight)
            waiter.slot = self._grant(
                waiter.cost_ms,
                now,
                start,
                long=waiter.long,
                live_bytes=waiter.live_bytes,
                batch=waiter.batch,
                end_by=end_by,
                join=join,
                stream=waiter.stream,
                tenant=waiter.flow[1],
                weight=flow.weight,
            )
            long_granted = long_granted or waiter.long
            devices._changes.append(waiter)
