"""Placement: which of a route's interchangeable pools in a cell takes the next request.

This module owns the ranking ``PoolRegistry.place`` applies to the healthy pools that can
serve a request (same logical model, same privacy cell, one pool per backend), and the
offered-demand rate it balances (``OfferedRate``). No I/O and no clock: ``now`` is handed in.

The ranking, lowest first:

1. the predicted wait for a device (``DispatchQueue.predicted_wait_ms``: on shared devices
   it already counts every model's work bound there);
2. the pool's recent *offered* demand per device (``OfferedRate``, decayed over
   ``PLACEMENT_TAU_S``): the same quantity, priced the same way, that the pool's overload
   ladder judges (``load.PoolLoad.offer``);
3. the work still to run on the pool's whole device set, per device: on shared devices
   that is every model's bound work (a fallback's beside the primary's), not the pool's own.

Why offered demand, and not what runs (the loop this breaks)
-------------------------------------------------------------
Each pool's ladder steps on the demand *offered to it*, so placement decides what each
ladder sees. The ranking used to break ties among pools with an idle device (wait 0, the
usual case below saturation) by the pool's own primary work in flight. A pool at step
5-6 diverts its primaries to the fallback (and the fallback may run on another group's
devices), so it has no primary work in flight and won every tie. It then received 80-90 %
of the fleet's primaries (87-233 bound per second against 2-51 for the other pools, seed
23 of ``examples/orchid/simulate/surge-fault-recovery.yaml``), all recorded as *its*
offered demand: 2.1-3.4x its protected capacity, so its step held, it kept diverting, and
the loop closed. After a device group was lost during a surge and the surge ended, the
fleet stayed there at normal load: 93 % of answers degraded 20-40 s after the surge, one
pool's ladder at 5-6 throughout (a metastable state: the trigger was gone and the state
sustained itself). With three groups the capture exceeds every leave line; with two,
full capture stays below step 4's, which is why two groups recovered.

Ranking by the offered rate instead turns that positive feedback negative: a pool that is
offered more than its devices' share ranks lower, so its demand, and with it its step,
falls back to the fleet's, whatever its ladder is doing. The rate moves with every request
placed (not once per ladder update), so a restored or idle pool is filled in proportion to
its devices rather than herded into. Counting the whole device set's work in the last key
keeps a group whose devices are busy with another model's work from looking idle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# The decay time of the offered rate placement balances: short enough to follow a surge's
# end or a restored group within a second or two, long enough that one long request does
# not swing it (the ladder's shortest span is 1 s).
PLACEMENT_TAU_S = 1.0


@dataclass(slots=True)
class OfferedRate:
    """Offered accelerator-ms, exponentially decayed over ``tau_s``: the pool's recent offered
    demand in ms/s, read and updated in O(1) (placement reads it for every candidate pool of
    every request). A sample older than the last one (a fleet's remote offer) decays from the
    later time, never backwards."""

    tau_s: float = PLACEMENT_TAU_S
    _ms: float = 0.0
    _at: float = 0.0

    def add(self, now: float, accelerator_ms: float) -> None:
        if now > self._at:
            self._ms *= math.exp((self._at - now) / self.tau_s)
            self._at = now
        self._ms += accelerator_ms

    def ms_per_s(self, now: float) -> float:
        """The decayed rate at ``now`` (0 for a pool never offered anything)."""
        if now <= self._at:
            return self._ms / self.tau_s
        return self._ms * math.exp((self._at - now) / self.tau_s) / self.tau_s


def placement_key(
    wait_ms: float, offered_ms_per_s: float, device_work_ms: float, devices: int
) -> tuple[float, float, float]:
    """The rank of one candidate pool (lower is better): predicted wait, then offered demand
    per device, then the device set's remaining bound work per device. ``devices`` below 1
    (a pool that lost every device) ranks last on both per-device terms."""
    head = placement_head(wait_ms, offered_ms_per_s, devices)
    return (*head, device_work_term(device_work_ms, devices))


def placement_head(wait_ms: float, offered_ms_per_s: float, devices: int) -> tuple[float, float]:
    """The first two terms of ``placement_key``: a caller compares these first and needs the
    last term (a sum over the device set's work in flight) only where two candidates tie."""
    if devices < 1:
        return (wait_ms, math.inf)
    return (wait_ms, offered_ms_per_s / devices)


def device_work_term(device_work_ms: float, devices: int) -> float:
    """The last term of ``placement_key``: the device set's remaining bound work per device."""
    return math.inf if devices < 1 else device_work_ms / devices


def best_placement(
    candidates: Sequence[T], head: Callable[[T], tuple[float, float]], work: Callable[[T], float]
) -> T | None:
    """The candidate whose ``placement_key`` is least (the first of equals): ``head`` gives its
    first two terms, ``work`` its last, which is asked only of candidates whose first two terms
    tie with the best so far (it sums the device set's work in flight: the costly term)."""
    best: T | None = None
    best_head: tuple[float, float] = (0.0, 0.0)
    best_work: float | None = None
    for candidate in candidates:
        mine = head(candidate)
        if best is None or mine < best_head:
            best, best_head, best_work = candidate, mine, None
        elif mine == best_head:
            if best_work is None:
                best_work = work(best)
            own = work(candidate)
            if own < best_work:
                best, best_work = candidate, own
    return best
