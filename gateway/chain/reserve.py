"""Stage 7, reserve (and unreserve): what an admitted request holds before it runs.

Owns the quota reservation of the admitted record's predicted demand (settled later
with the observed charge, or refunded), and the pool's load accounting that goes with
admission: the demand offered, what was admitted, and on a fallback its own pool's
share. ``undo`` refunds a reservation of a request that never ran; the settle stage
closes it for one that did.

It may write quota and pools' load; it may not judge, place or run anything.
"""

from __future__ import annotations

from gateway.core.load import FlowLoad, PoolLoad
from gateway.core.quota import Reservation
from gateway.core.record import RequestRecord
from gateway.state.base import QuotaStore


class Reserve:
    """Quota reservations of admitted requests."""

    def __init__(self, quotas: QuotaStore) -> None:
        self.quotas = quotas

    async def run(
        self,
        record: RequestRecord,
        *,
        offered_ms: float,
        primary: tuple[PoolLoad, FlowLoad] | None,
        fallback: tuple[PoolLoad, FlowLoad] | None,
        now: float,
    ) -> Reservation:
        """Reserve the predicted demand of what will run. A refusal here (the tenant's own
        concurrency or queued-work limit) is not pool load. ``primary``: the primary pool's
        flow, to count its offered and admitted demand (None for a late rescue, offered once
        already); ``fallback``: the fallback pool's flow when the request runs there."""
        reservation = await self.quotas.reserve_admitted(record, now=now)
        demand_ms = record.demand.accelerator_ms
        if primary is not None:
            load, flow = primary
            load.offer(now, flow, offered_ms)
            load.admitted(now, flow, offered_ms, demand_ms)
        if fallback is not None:
            load, flow = fallback
            load.offer(now, flow, demand_ms)
            load.admitted(now, flow, demand_ms, demand_ms)
        return reservation

    def undo(self, reservation: Reservation, *, now: float) -> None:
        """Refund a reservation of a request that never ran."""
        self.quotas.release(reservation, now=now)
