"""Per-pool load evidence, per-flow plans, and the ladder that reads them.

One ``PoolLoad`` per dispatch pool (backend x backend model) holds the sliding
windows the overload ladder reads (offered demand priced on the requested
model, observed queue dwell, admitted work priced as offered and as it runs),
one ``FlowLoad`` per (request class, tenant) flow that offered work to it, and
the pool's ``OverloadLadder``. ``gather`` turns them, the dispatch queue and the
backend's health into ``LoadEvidence``, steps the ladder, and re-plans every
flow (``overload.plan_flows``): which share of each flow's new requests is
capped, diverted to the fallback, or refused. The gateway calls it
periodically; the request path asks ``reduce_output`` / ``divert`` / ``shed``
per request. The state machine, the fair shares and their rules live in
``overload``; this module only feeds them and keeps the per-flow pickers.

Offered demand means admissible work (``offer``): the request path counts a
request only once its own tenant's quota, concurrency limit, entitlement and
policy would let it in (or it was refused by the ladder itself, or for want of
capacity). A flooder's arrivals that its own quota refuses are that tenant's
problem, not the pool's load.

A fleet of replicas (``gateway/state/fleet_load.py``) decides on the fleet's sum: with
``offers`` set, every offered sample is also kept there for the fleet to publish, and the
other replicas' samples are added to the same windows (``add_remote_offer``), so each
replica's ladder and plan read the fleet's offered demand. Admitted work and what capping it
saved travel the same way (``admits``/``add_admitted``, ``reductions``/``add_reduction``), so
the relief the ladder judges steps 4-6 by, the saturation test and each flow's plan all read
the fleet's admitted work against the fleet's demand. Each replica's ladder steps on that
shared evidence, and the request path acts on the highest step any replica holds
(``fleet_step``): the few hundred milliseconds by which replicas' evidence can differ near a
threshold, and the descent's hold period, would otherwise keep them a step apart for seconds.
``capacity_share`` is the part of the pool's devices the ladder plans for: 1 alone or with
fresh fleet evidence, 1/N while a replica decides on its own demand only (fleet evidence
stale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.core.dispatch import CONTROL_CLASS, DispatchQueue
from gateway.core.overload import (
    DEFAULT_BUCKETS,
    DEFAULT_PLAN_SPAN_S,
    DEFAULT_PROTECTED_UTILIZATION,
    DEFAULT_SPANS_S,
    MS_PER_S,
    NO_PLAN,
    DemandWindow,
    DwellWindow,
    FlowDemand,
    FlowKey,
    FlowPlan,
    FlowRelief,
    LadderConfig,
    LadderState,
    LadderStep,
    LoadEvidence,
    OverloadLadder,
    Shedder,
    certain_rate,
    drain_ms,
    plan_flows,
    protected_capacity_ms_per_s,
    retry_after_ms,
)
from gateway.core.placement import OfferedRate

# Queue dwell is overload evidence only while the devices are this busy (of their raw time),
# judged over this span: below it, dwell is ordinary queueing (Poisson arrivals and long
# requests in front of short ones at 68 % raw utilization give a p95 over a 20 ms budget).
SATURATED = 0.9
SATURATION_SPAN_S = 4.0

# A flow's admitted work (and what degrading it saved) is measured over the plan span only.
_FLOW_BUCKETS = max(1, round(DEFAULT_BUCKETS * DEFAULT_PLAN_SPAN_S / 10.0))


def _plan_window() -> DemandWindow:
    return DemandWindow(DEFAULT_PLAN_SPAN_S, _FLOW_BUCKETS)


@dataclass
class FlowLoad:
    """One (request class, tenant) flow on one pool: its recent demand, what its admitted work
    saved, and the pickers that spread the plan's shares evenly over its requests."""

    key: FlowKey
    weight: float = 1.0
    class_weight: float = 1.0
    demand: DemandWindow = field(default_factory=DemandWindow)  # offered, over every plan span
    admitted_offered: DemandWindow = field(default_factory=_plan_window)
    admitted_running: DemandWindow = field(default_factory=_plan_window)
    admitted_reduction: DemandWindow = field(default_factory=_plan_window)
    plan: FlowPlan = NO_PLAN
    reducer: Shedder = field(default_factory=Shedder)
    diverter: Shedder = field(default_factory=Shedder)
    admitter: Shedder = field(default_factory=Shedder)

    def relief(self, now: float) -> FlowRelief:
        return FlowRelief(
            offered_ms_per_s=self.admitted_offered.rate_ms_per_s(now),
            running_ms_per_s=self.admitted_running.rate_ms_per_s(now),
            reduced_ms_per_s=self.admitted_reduction.rate_ms_per_s(now),
        )


@dataclass
class PoolLoad:
    name: str
    devices: int
    dwell_budget_ms: float
    config: LadderConfig
    protected_utilization: float = DEFAULT_PROTECTED_UTILIZATION
    demand: DemandWindow = field(default_factory=DemandWindow)
    # The same offered demand, decayed, for placement to balance (``core.placement``).
    offered_rate: OfferedRate = field(default_factory=OfferedRate)
    # Admitted work, priced as offered (primary) and as it runs (primary or fallback).
    admitted_offered: DemandWindow = field(default_factory=DemandWindow)
    admitted_running: DemandWindow = field(default_factory=DemandWindow)
    dwell: DwellWindow = field(default_factory=DwellWindow)
    flows: dict[FlowKey, FlowLoad] = field(default_factory=dict)
    ladder: OverloadLadder = field(init=False)
    evidence: LoadEvidence | None = None
    saving: float = 0.45  # mean share of its price a request saves on the fallback (learned)
    reduce_saving: float = 0.2  # mean share of its price a request saves with reduced output (learned)
    # Modeled quality lost per capped / fallback answer (set from the route's evidence).
    reduce_quality_loss: float = 0.0
    fallback_quality_loss: float = 0.0
    # Fleet (see the module docstring): samples to publish, and this replica's capacity share.
    offers: list[tuple[float, FlowKey, float]] | None = None
    admits: list[tuple[float, FlowKey, float, float]] | None = None  # offered, running
    # The highest step another replica of the fleet published recently (0 alone).
    fleet_step: int = 0
    reductions: list[tuple[float, FlowKey, float]] | None = None  # saved by capping
    capacity_share: float = 1.0
    # The request path asks every request's retry-after and drain of the same evidence, which
    # changes only at a gather: kept with the (evidence, config) they were priced from.
    _priced: tuple[LoadEvidence, LadderConfig, int, float] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.ladder = OverloadLadder(self.config)

    @property
    def step(self) -> int:
        """The step the request path acts on: this pool's ladder, or in a fleet the highest step
        another replica published in the last exchanges (``fleet_step``), if higher."""
        return max(int(self.ladder.step), self.fleet_step)

    # ------------------------------------------------------------------ evidence

    def flow(self, request_class: str, tenant: str, *, weight: float, class_weight: float) -> FlowLoad:
        """The flow's state (created on its first request: tenants and classes are bounded by
        configuration, so memory is too)."""
        key = (request_class, tenant)
        flow = self.flows.get(key)
        if flow is None:
            flow = self.flows[key] = FlowLoad(key)
        flow.weight, flow.class_weight = weight, class_weight
        return flow

    def offer(self, now: float, flow: FlowLoad, accelerator_ms: float) -> None:
        """Admissible work arrived: it counts toward the pool's and the flow's offered demand."""
        self.demand.add(now, accelerator_ms)
        self.offered_rate.add(now, accelerator_ms)
        flow.demand.add(now, accelerator_ms)
        if self.offers is not None:
            self.offers.append((now, flow.key, accelerator_ms))

    def add_remote_offer(self, now: float, flow: FlowLoad, accelerator_ms: float) -> None:
        """Another replica's offered sample (at ``now`` on this replica's clock): counted in the
        pool's and the flow's offered demand like a local one, and not published again."""
        self.demand.add(now, accelerator_ms)
        self.offered_rate.add(now, accelerator_ms)
        flow.demand.add(now, accelerator_ms)

    def admitted(self, now: float, flow: FlowLoad, offered_ms: float, running_ms: float) -> None:
        self.add_admitted(now, flow, offered_ms, running_ms)
        if self.admits is not None:
            self.admits.append((now, flow.key, offered_ms, running_ms))

    def reduced(self, now: float, flow: FlowLoad, full_ms: float, reduced_ms: float) -> None:
        """An admitted request whose output the ladder capped: learn what that saves."""
        saved_ms = max(0.0, full_ms - reduced_ms)
        self.add_reduction(now, flow, saved_ms)
        if self.reductions is not None:
            self.reductions.append((now, flow.key, saved_ms))
        if full_ms > 0:
            self.reduce_saving += 0.1 * ((1.0 - reduced_ms / full_ms) - self.reduce_saving)

    def add_admitted(self, now: float, flow: FlowLoad, offered_ms: float, running_ms: float) -> None:
        """Admitted work, priced as offered and as it runs: this replica's own, or another's
        from the fleet's exchange (not published again). The relief the ladder and the plan
        read is then the fleet's, in the units of its demand."""
        self.admitted_offered.add(now, offered_ms)
        self.admitted_running.add(now, running_ms)
        flow.admitted_offered.add(now, offered_ms)
        flow.admitted_running.add(now, running_ms)

    def add_reduction(self, now: float, flow: FlowLoad, saved_ms: float) -> None:
        """What capping an admitted request's output saved (this replica's or another's)."""
        flow.admitted_reduction.add(now, saved_ms)

    def observed_saving(self, primary_ms: float, fallback_ms: float) -> None:
        if primary_ms > 0:
            self.saving += 0.1 * ((1.0 - fallback_ms / primary_ms) - self.saving)

    def relief(self, now: float) -> float:
        offered = self.admitted_offered.total_ms(now)
        return min(1.0, self.admitted_running.total_ms(now) / offered) if offered > 0 else 1.0

    def gather(self, now: float, queue: DispatchQueue, *, healthy: bool, evidence_at: float) -> LadderState:
        """Build this pool's evidence, step its ladder and re-plan its flows; the ladder's new
        state (``changed`` and ``reason`` say whether and why the step moved: the caller logs
        it, the core does no I/O)."""
        # The devices of the pool's units left (a unit with a lost device counts none of its
        # devices: gateway.core.units), all of them when healthy.
        healthy_devices = queue.capacity_devices if healthy else 0
        capacity = (
            protected_capacity_ms_per_s(healthy_devices, self.protected_utilization) * self.capacity_share
        )
        spans = tuple(span for span in DEFAULT_SPANS_S if span <= self.demand.window_s)
        # The backend is the bottleneck when admitted work (priced as it runs, corrected by
        # observed work) keeps its devices at least SATURATED of their raw time busy.
        running = self.admitted_running.reading(now, SATURATION_SPAN_S).offered_ms_per_s
        raw_capacity = capacity / self.protected_utilization
        self.evidence = LoadEvidence(
            now=now,
            evidence_at=evidence_at,
            offered_ms_per_s=self.demand.reading(now, DEFAULT_PLAN_SPAN_S).offered_ms_per_s,
            protected_capacity_ms_per_s=capacity,
            healthy_devices=healthy_devices,
            configured_devices=self.devices,
            queue_dwell_p95_ms=self.dwell.p95_ms(now),
            dwell_budget_ms=self.dwell_budget_ms,
            dwell_samples=self.dwell.count(now),
            backend_saturated=capacity <= 0.0 or running >= SATURATED * raw_capacity,
            mean_request_ms=self.demand.mean_ms(now),
            queued_accelerator_ms=(queue.queued_ms + queue.inflight_remaining_ms(now)) * queue.unit_device_ms,
            window_s=self.demand.window_s,
            relief=self.relief(now),
            readings=tuple(self.demand.reading(now, span) for span in spans),
        )
        state = self.ladder.update(self.evidence)
        self._plan(
            now,
            healthy_devices
            * MS_PER_S
            * max(self.config.plan_utilization, self.protected_utilization)
            * self.capacity_share,
        )
        return state

    def set_quality(self, *, reduce_loss: float, fallback_loss: float) -> None:
        """The modeled quality a capped output and a fallback answer cost on this pool's route."""
        self.reduce_quality_loss, self.fallback_quality_loss = reduce_loss, fallback_loss

    def _plan(self, now: float, capacity: float) -> None:
        # Flows idle for a whole window drop out of the plan (and of memory's hot path).
        active = [flow for flow in self.flows.values() if flow.demand.count(now) > 0]
        demands = [
            FlowDemand(flow.key, certain_rate(flow.demand, now), flow.weight, flow.class_weight)
            for flow in active
        ]
        plans = plan_flows(
            demands,
            {flow.key: flow.relief(now) for flow in active},
            capacity_ms_per_s=capacity,
            step=LadderStep(self.step),
            reduce_saving=self.reduce_saving,
            fallback_saving=self.saving,
            exempt_classes=frozenset({CONTROL_CLASS}),
            reduce_quality_loss=self.reduce_quality_loss,
            fallback_quality_loss=self.fallback_quality_loss,
        )
        for flow in self.flows.values():
            flow.plan = plans.get(flow.key, NO_PLAN)

    # ------------------------------------------------------------------ per-request decisions

    def reduce_output(self, flow: FlowLoad) -> bool:
        """Is this request part of its flow's share whose output is capped (policy fact
        ``load.reduce_output``)? Only a flow's excess is capped, and only as far as capacity
        requires: the mildest degradation first."""
        return flow.reducer.pick(flow.plan.reduce_share)

    def divert(self, flow: FlowLoad) -> bool:
        """Is this eligible request part of its flow's share sent to the fallback?"""
        return flow.diverter.pick(flow.plan.divert_share)

    def shed(self, flow: FlowLoad) -> bool:
        """Is this new online request part of its flow's excess to refuse (steps 5-6)? A flow
        inside its fair share is refused only when the pool cannot carry the in-share
        demand; control work never (the plan exempts it). Without any protected capacity
        (every device lost) everything is shed."""
        if self.evidence is not None and self.evidence.protected_capacity_ms_per_s <= 0.0:
            return self.step >= 5 and flow.key[0] != CONTROL_CLASS
        share = flow.plan.admit_share
        return share < 1.0 and not flow.admitter.pick(share)

    def drain_ms(self) -> float:
        """Predicted drain for policy (``load.drain_ms``): finite, so a rule can compute a
        retry-after from it; with no protected capacity (or unreadable evidence) nothing
        drains and it is the configured maximum retry-after."""
        if self.evidence is None:
            return 0.0
        return self._price()[1]

    def utilization(self) -> float:
        return self.evidence.utilization if self.evidence is not None else 0.0

    def retry_after_ms(self) -> int:
        if self.evidence is None:
            return self.config.retry_after_min_ms
        return self._price()[0]

    def _price(self) -> tuple[int, float]:
        """(``retry_after_ms``, ``drain_ms``) of the current evidence, priced once per evidence
        and config (both immutable: a gather or a new config replaces the object)."""
        evidence, config = self.evidence, self.config
        assert evidence is not None
        priced = self._priced
        if priced is None or priced[0] is not evidence or priced[1] is not config:
            drain = drain_ms(evidence)
            priced = self._priced = (
                evidence,
                config,
                int(retry_after_ms(evidence, config).ms),
                drain if math.isfinite(drain) else float(config.retry_after_max_ms),
            )
        return priced[2], priced[3]
