"""Decoding streams per tenant, bounded by weighted share: the pool's decode-turn fairness.

A stream (a decoupled model's request: one prompt, then tokens one by one until it ends)
holds a dispatch slot and live sequence state on its device for as long as it decodes, not
for one predicted run. Start-time fair queuing (``gateway.core.dispatch`` rule 1) orders who
*starts* next; it does not stop one tenant that arrived first from holding every slot of the
pool with long streams while another tenant's first token waits for one of them to end. This
module is the gateway's form of capping consecutive decode turns: per pool, each tenant's
concurrently decoding streams and their live state are bounded by its weighted share.

* **The bound.** A tenant's share is its weight over the sum of the weights of the tenants
  with a stream decoding or waiting on the pool (itself included). Its bound is that share
  of the pool's stream capacity: ``max(1, floor(share x streams))`` streams and
  ``share x live_bytes`` of live state. A tenant alone has share 1 and may use everything
  (work-conserving); under contention an over-share tenant's NEW streams wait while an
  in-share tenant's start. Never below one stream: a tenant with no stream decoding may
  always start one (its live state then bounded only by the device, ``DeviceSet.fits``), so
  no tenant is shut out by a neighbour's share of memory.
* **What it bounds.** Admission of new streams only. A stream already decoding keeps its
  slot and grows its live state token by token (``grow``) until the device's live room is
  exhausted (``gateway.core.dispatch.Slot.grow_live``); the bound then holds that tenant's
  next stream back until its share has room again. Cutting a running stream short to make
  room would waste the work it has done.
* **Work-conserving under contention too.** A tenant over its share starts a new stream only
  while no other tenant with a stream waiting is within its own share (``may_start``): the
  in-share tenant gets the free slot, and a slot that no in-share tenant wants is not left
  idle (the floors of several shares may sum to fewer than the pool's streams).
* **An override.** ``max_per_tenant`` caps every tenant's decoding streams whatever its
  share, alone or not (None: the share alone); ``enabled=False`` turns the share off (only
  the override, if any, applies).

Live state is counted in bytes (``live_cache_bytes_per_token`` per live token: the record's
memory and the device's ``live_room_bytes``, ``gateway.core.memory``), so bytes here are live
tokens at the pool's rate. Pure: no clock, no I/O; the dispatch queue calls it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class TenantStreams:
    """One tenant's decoding streams on a pool and the live state they hold."""

    streams: int = 0
    live_bytes: int = 0
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class StreamBound:
    """A tenant's bound on one pool: decoding streams and the live state they may hold."""

    streams: int
    live_bytes: float
    share: float


class DecodeShare:
    """Per pool: each tenant's concurrently decoding streams, bounded by weighted share."""

    def __init__(
        self,
        streams: int,
        live_bytes: float = math.inf,
        *,
        enabled: bool = True,
        max_per_tenant: int | None = None,
    ) -> None:
        self.streams = max(1, streams)  # the pool's stream slots
        self.live_bytes = live_bytes  # the pool's live room (every device's), bytes
        self.enabled = enabled
        self.max_per_tenant = None if max_per_tenant is None else max(1, max_per_tenant)
        self.tenants: dict[str, TenantStreams] = {}

    def decoding(self, tenant: str) -> TenantStreams:
        """The tenant's decoding streams now (zeros for a tenant with none)."""
        return self.tenants.get(tenant) or TenantStreams()

    def bound(self, tenant: str, weight: float, waiting: Mapping[str, float] | None = None) -> StreamBound:
        """The tenant's bound: its ``weight`` over the weights of the tenants decoding or
        ``waiting`` (tenant -> weight, of those with a stream waiting) and its own."""
        weights = {name: t.weight for name, t in self.tenants.items() if t.streams > 0}
        weights.update(waiting or {})
        weights[tenant] = weight
        total = sum(max(w, 1e-9) for w in weights.values())
        share = max(weight, 1e-9) / total if self.enabled else 1.0
        streams = max(1, math.floor(share * self.streams + 1e-9))
        return StreamBound(streams, share * self.live_bytes, share)

    def in_share(
        self, tenant: str, weight: float, live_bytes: int, waiting: Mapping[str, float] | None = None
    ) -> bool:
        """Would a new stream of the tenant holding ``live_bytes`` keep it within its bound?
        Within its stream bound, and within its live-state bound unless it has no stream
        decoding (never below one stream)."""
        mine = self.decoding(tenant)
        bound = self.bound(tenant, weight, waiting)
        if mine.streams + 1 > bound.streams:
            return False
        return mine.streams == 0 or mine.live_bytes + live_bytes <= bound.live_bytes

    def may_start(
        self, tenant: str, weight: float, live_bytes: int, waiting: Mapping[str, tuple[float, int]]
    ) -> bool:
        """May the tenant start a new stream holding ``live_bytes`` now, a slot being free?
        ``waiting``: tenant -> (weight, live bytes of its next stream) of the tenants with a
        stream waiting on the pool. Never beyond ``max_per_tenant``; within its share, yes;
        beyond it only while no other waiting tenant's next stream is within that tenant's
        share (work-conserving: a free slot nobody in-share wants is not left idle)."""
        mine = self.decoding(tenant)
        if self.max_per_tenant is not None and mine.streams >= self.max_per_tenant:
            return False
        weights = {name: w for name, (w, _) in waiting.items()}
        if self.in_share(tenant, weight, live_bytes, weights):
            return True
        return not any(
            self.in_share(other, w, held, weights)
            for other, (w, held) in waiting.items()
            if other != tenant
            and (self.max_per_tenant is None or self.decoding(other).streams < self.max_per_tenant)
        )

    def start(self, tenant: str, weight: float, live_bytes: int) -> None:
        """A stream of the tenant was granted a slot, holding ``live_bytes``."""
        mine = self.tenants.setdefault(tenant, TenantStreams())
        mine.streams += 1
        mine.live_bytes += max(0, live_bytes)
        mine.weight = weight

    def grow(self, tenant: str, live_bytes: int) -> None:
        """A decoding stream of the tenant holds ``live_bytes`` more (its new tokens)."""
        mine = self.tenants.get(tenant)
        if mine is not None:
            mine.live_bytes += max(0, live_bytes)

    def end(self, tenant: str, live_bytes: int) -> None:
        """A stream of the tenant ended, freeing the ``live_bytes`` it held."""
        mine = self.tenants.get(tenant)
        if mine is None:
            return
        mine.streams = max(0, mine.streams - 1)
        mine.live_bytes = max(0, mine.live_bytes - live_bytes)
        if mine.streams == 0:
            del self.tenants[tenant]
