"""Per-pool load evidence and the ladder that reads it.

One ``PoolLoad`` per dispatch pool (backend x backend model) holds the sliding
windows the overload ladder reads (offered demand priced on the requested
model, observed queue dwell) and the pool's ``OverloadLadder``. ``gather``
turns them, the dispatch queue and the backend's health into ``LoadEvidence``
and steps the ladder; the gateway calls it periodically. The state machine
and its rules live in ``overload``; this module only feeds it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from gateway.overload import (
    DEFAULT_PROTECTED_UTILIZATION,
    DemandWindow,
    DwellWindow,
    LadderConfig,
    LadderState,
    LoadEvidence,
    OverloadLadder,
    Shedder,
    drain_ms,
    protected_capacity_ms_per_s,
    retry_after_ms,
)
from gateway.scheduler import DispatchQueue

# Divert to the fallback until offered demand is back to this share of the protected envelope:
# a little under 1.0, so the pool does not sit on the threshold that triggered the ladder.
DIVERT_TARGET = 0.9

log = logging.getLogger("orchid.overload")


@dataclass
class PoolLoad:
    name: str
    devices: int
    dwell_budget_ms: float
    config: LadderConfig
    protected_utilization: float = DEFAULT_PROTECTED_UTILIZATION
    demand: DemandWindow = field(default_factory=DemandWindow)
    # Admitted work, priced as offered (primary) and as it runs (primary or fallback).
    admitted_offered: DemandWindow = field(default_factory=DemandWindow)
    admitted_running: DemandWindow = field(default_factory=DemandWindow)
    # What reduced output saved on admitted work (offered price minus reduced price).
    admitted_reduction: DemandWindow = field(default_factory=DemandWindow)
    dwell: DwellWindow = field(default_factory=DwellWindow)
    ladder: OverloadLadder = field(init=False)
    evidence: LoadEvidence | None = None
    shedder: Shedder = field(default_factory=Shedder)
    diverter: Shedder = field(default_factory=Shedder)
    reducer: Shedder = field(default_factory=Shedder)
    saving: float = 0.45  # mean share of its price a request saves on the fallback (learned)
    reduce_saving: float = 0.2  # mean share of its price a request saves with reduced output (learned)

    def __post_init__(self) -> None:
        self.ladder = OverloadLadder(self.config)

    @property
    def step(self) -> int:
        return int(self.ladder.step)

    def gather(self, now: float, queue: DispatchQueue, *, healthy: bool, evidence_at: float) -> LadderState:
        healthy_devices = self.devices if healthy else 0
        self.evidence = LoadEvidence(
            now=now,
            evidence_at=evidence_at,
            offered_ms_per_s=self.demand.rate_ms_per_s(now),
            protected_capacity_ms_per_s=protected_capacity_ms_per_s(
                healthy_devices, self.protected_utilization
            ),
            healthy_devices=healthy_devices,
            configured_devices=self.devices,
            queue_dwell_p95_ms=self.dwell.p95_ms(now),
            dwell_budget_ms=self.dwell_budget_ms,
            mean_request_ms=self.demand.mean_ms(now),
            queued_accelerator_ms=queue.queued_ms + queue.inflight_remaining_ms(now),
            window_s=self.demand.window_s,
            relief=self.relief(now),
        )
        state = self.ladder.update(self.evidence)
        if state.changed:
            log.warning("pool %s ladder step -> %d: %s", self.name, state.step, state.reason)
        return state

    def admitted(self, now: float, offered_ms: float, running_ms: float) -> None:
        self.admitted_offered.add(now, offered_ms)
        self.admitted_running.add(now, running_ms)

    def reduced(self, now: float, full_ms: float, reduced_ms: float) -> None:
        """An admitted request whose output the ladder capped: learn what that saves."""
        self.admitted_reduction.add(now, max(0.0, full_ms - reduced_ms))
        if full_ms > 0:
            self.reduce_saving += 0.1 * ((1.0 - reduced_ms / full_ms) - self.reduce_saving)

    def reduction_relief(self, now: float) -> float:
        """The share of admitted demand that reduced output actually saved (measured: a route
        without evidence for a cap, or requests already short, save nothing)."""
        offered = self.admitted_offered.total_ms(now)
        return min(1.0, self.admitted_reduction.total_ms(now) / offered) if offered > 0 else 0.0

    def relief(self, now: float) -> float:
        offered = self.admitted_offered.total_ms(now)
        return min(1.0, self.admitted_running.total_ms(now) / offered) if offered > 0 else 1.0

    def reduce_share(self) -> float:
        """At step 2+, the share of requests whose output is capped (where the route has
        quality evidence for it): what brings offered demand down to DIVERT_TARGET of the
        protected envelope, given what a reduced request saves; at most all of them."""
        if self.step < 2 or self.evidence is None:
            return 0.0
        utilization = self.evidence.utilization
        if not math.isfinite(utilization):
            return 1.0
        share = (utilization - DIVERT_TARGET) / (utilization * max(self.reduce_saving, 0.05))
        return min(1.0, max(0.0, share))

    def reduce_output(self) -> bool:
        """Is this request part of the share whose output is capped (policy fact
        ``load.reduce_output``)? The mildest degradation comes first and only as far as
        capacity requires, like the fallback's share."""
        share = self.reduce_share()
        return share >= 1.0 or (share > 0.0 and self.reducer.admit(1.0, share))

    def divert(self) -> bool:
        """At step 3+, is this eligible request part of the share sent to the fallback? The
        share is what brings offered demand down to DIVERT_TARGET of the protected envelope,
        after what reduced output measurably saves, given what a diverted request saves;
        everything eligible when that is more than all."""
        if self.step < 3 or self.evidence is None:
            return False
        utilization = self.evidence.utilization
        if not math.isfinite(utilization):
            return True
        utilization *= 1.0 - self.reduction_relief(self.evidence.now)
        share = (utilization - DIVERT_TARGET) / (utilization * max(self.saving, 0.05))
        # The diverter's "admit" is "divert": it picks `share` of the calls, evenly spread.
        return self.diverter.admit(1.0, min(1.0, max(0.0, share))) if share < 1.0 else True

    def observed_saving(self, primary_ms: float, fallback_ms: float) -> None:
        if primary_ms > 0:
            self.saving += 0.1 * ((1.0 - fallback_ms / primary_ms) - self.saving)

    def shed(self) -> bool:
        """At step 5+, is the next new online request part of the excess to shed? Step 6
        protects admitted work harder: it aims at half the protected envelope."""
        if self.step < 5 or self.evidence is None:
            return False
        target = self.evidence.protected_capacity_ms_per_s * (0.5 if self.step >= 6 else 1.0)
        effective = self.evidence.offered_ms_per_s * self.evidence.relief
        return not self.shedder.admit(effective, target)

    def drain_ms(self) -> float:
        """Predicted drain for policy (``load.drain_ms``): finite, so a rule can compute a
        retry-after from it; with no protected capacity (or unreadable evidence) nothing
        drains and it is the configured maximum retry-after."""
        if self.evidence is None:
            return 0.0
        drain = drain_ms(self.evidence)
        return drain if math.isfinite(drain) else float(self.config.retry_after_max_ms)

    def utilization(self) -> float:
        return self.evidence.utilization if self.evidence is not None else 0.0

    def retry_after_ms(self) -> int:
        if self.evidence is None:
            return self.config.retry_after_min_ms
        return int(retry_after_ms(self.evidence, self.config).ms)
