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
    dwell: DwellWindow = field(default_factory=DwellWindow)
    ladder: OverloadLadder | None = None
    evidence: LoadEvidence | None = None
    shedder: Shedder = field(default_factory=Shedder)

    def __post_init__(self) -> None:
        self.ladder = OverloadLadder(self.config)

    @property
    def step(self) -> int:
        assert self.ladder is not None
        return int(self.ladder.step)

    def gather(self, now: float, queue: DispatchQueue, *, healthy: bool, evidence_at: float) -> LadderState:
        assert self.ladder is not None
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

    def relief(self, now: float) -> float:
        offered = self.admitted_offered.total_ms(now)
        return min(1.0, self.admitted_running.total_ms(now) / offered) if offered > 0 else 1.0

    def shed(self) -> bool:
        """At step 5+, is the next new online request part of the excess to shed? Step 6
        protects admitted work harder: it aims at half the protected envelope."""
        if self.step < 5 or self.evidence is None:
            return False
        target = self.evidence.protected_capacity_ms_per_s * (0.5 if self.step >= 6 else 1.0)
        effective = self.evidence.offered_ms_per_s * self.evidence.relief
        return not self.shedder.admit(effective, target)

    def drain_ms(self) -> float:
        return drain_ms(self.evidence) if self.evidence is not None else 0.0

    def utilization(self) -> float:
        return self.evidence.utilization if self.evidence is not None else 0.0

    def retry_after_ms(self) -> int:
        if self.evidence is None:
            return self.config.retry_after_min_ms
        return int(retry_after_ms(self.evidence, self.config).ms)
