"""The overload ladder: offered demand and queue evidence in, a ladder step 0-6 out.

This module owns the ladder's state machine and everything that feeds it: the
sliding windows that turn per-request predictions and observed dwell into a rate
and a percentile, the evidence record, the thresholds, the table of what each
step does, and the retry-after arithmetic. Everything that affects the ladder
step must live here; admission, routing and the scheduler only read
``LadderState.step`` and ``effects(step)``. It never reads a clock and never does
I/O: ``now`` (monotonic seconds) is handed in, as h11 hands in bytes.

The ladder (from the seed, "Overload needs an honest quality policy"); each step
permits everything the steps below it do:

    0  normal
    1  stop shadow traffic and optional secondary stages
    2  reduce candidate counts or output limits within declared quality evidence
    3  route eligible classes to a warm validated smaller model
    4  defer asynchronous and batch work
    5  reject new interactive work early with retry guidance
    6  protect already admitted sequences and the control/recovery plane: only
       control work and each flow's reserved (own weighted) share are admitted

The step says which mechanisms may act; *how much* each one acts, and on whom, is
planned per flow (``plan_flows``): only a flow's excess over its fair share of the
protected envelope is capped, diverted or refused. The tenant inside its share
pays nothing for the one outside it (the WFQ/DRR line: a flow's excess never
costs another flow its share).

Rules
-----
1. The step follows *offered* demand: the accelerator-ms predicted for admissible
   work as it arrives (not refused by its own tenant's quota, entitlement or
   policy), priced on the model it asked for, before any ladder action. A ladder
   fed with the relief it causes (the seed's fallback turns a 121.8 % surge into
   91.0 %) reads its own success as recovery, steps down, turns the relief off and
   oscillates; a ladder fed with a flooder's quota-refused arrivals punishes
   everyone for one tenant's excess.
2. ``utilization = offered / protected capacity``; protected capacity is healthy
   devices x protected utilization x 1000 ms/s. No capacity (every device lost),
   or offered demand that cannot be read, is infinitely loaded: step 6, never a
   division by zero and never a NaN that compares false into step 0.
3. Climb on certainty, at once: a step is entered as soon as the *lower
   confidence bound* of utilization (offered - z sigma over any of the spans,
   sigma estimated from the samples) reaches its threshold, skipping steps if
   needed. A flood is certain within a second, a modest sustained surge over the
   10 s span; Poisson noise inside the envelope climbs nothing (z = 2.5).
4. Descend promptly, but not on one quiet reading: leave step ``s`` once that
   bound has stayed below ``enter(s) - hysteresis`` (with no floor of rules 5-6
   holding it) for ``hold_s`` without a break, straight to the step the evidence
   supports.
5. Queue evidence can raise the step, never lower it: queue dwell p95 over the
   class's dwell budget means at least step 3, but only while the backend is the
   bottleneck (admitted work keeps the devices at least 90 % busy over 4 s, see
   ``load.SATURATED``) and over enough samples. A dwell spike from the gateway's own CPU, or from one long
   request in a small pool, is not overload.
6. Stale evidence fails safe and is visible: evidence older than
   ``stale_after_s`` means at least step 4 and ``LadderState.stale``.
7. Beyond the fallback, judge what is left: steps 4-6 (defer, reject, protect)
   follow the *effective* utilization, the bound times the measured relief
   (what admitted work really costs per accelerator-ms of its offered price, < 1
   while the fallback serves part of it). A 1.25x surge that the fallback brings
   back inside the envelope sheds nothing; only what the fallback cannot absorb
   is deferred or rejected.
8. Amounts follow the excess, per flow: every update re-plans each flow's
   allocation (hierarchical weighted water-filling of the plan capacity: a flow
   inside its share keeps its demand, what it leaves idle is lent to the
   others; at step 6 nothing is lent), and the share of its requests that is
   capped (step 2+), diverted (step 3+) and admitted (step 5+), from a recent
   point estimate (2 s), so the amounts follow a surge's end even while the step
   is held. Control work is never refused by the plan.

Theory of operation
-------------------
The edge counts admissible work into a pool's ``DemandWindow`` and its flow's
window, and ``DwellWindow.add`` for every dispatch; a periodic gatherer
(``load.PoolLoad.gather``) builds ``LoadEvidence`` from the windows, the healthy
device count and the dispatch queue's backlog (everything bound to Triton for the
pool went through it), calls ``OverloadLadder.update(evidence)`` and re-plans the
flows. The resulting step goes on every ``RequestRecord.ladder_step`` and into
policy; ``effects(step)`` says which mechanisms are on, the flow's ``FlowPlan``
how much, and ``retry_after_ms(evidence)`` prices the ``retry-after-ms`` of a
rejection from the predicted drain of the backlog, not from a constant.

Thresholds are fractions of *protected* capacity (the seed protects 70 % of each
device), so 1.00 is the planned envelope, not the hardware limit; the hardware
limit is at 1 / 0.70 = 1.43. With the defaults (judged on the lower bound):

    step  enters at  leaves below  the seed's Orchid fleet (24 devices, 16,800 ms/s protected)
    1     1.00       0.95          normal load 16,368.8 ms/s = 0.974: step 0
    2     1.03       0.98
    3     1.06       1.01          the 1.25x surge 20,461 ms/s = 1.218 (10 s bound ~1.11)
    4     1.15       1.10
    5     1.25       1.20          judged after the fallback's relief
    6     1.43       1.38          offered work beyond the devices' raw time

The amounts are planned against ``plan_utilization`` (0.90) of the devices' raw time,
not the envelope: the seed's surge (85.3 % of raw time) is served whole, at full
quality where admission finds each request feasible; only demand beyond the plan
line is degraded, then refused, and only the excess of the flows over their share.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

MS_PER_S = 1000.0
# Float seconds subtract with rounding noise (4.1 - 2.1 < 2.0); a hold measured on a
# 100 ms sampling grid must not slip a whole sample for a nanosecond.
_TIME_EPS_S = 1e-9

# The seed protects 70 % of each device-second: the other 30 % absorbs prediction
# error, arrival bursts and one bounded recovery (a retried or re-routed request,
# the loss of a device group while the fallback is proven warm). Admission plans
# only the protected share; the ladder measures load against it.
DEFAULT_PROTECTED_UTILIZATION = 0.70

# Offered demand is noisy even at a steady rate: arrivals are Poisson and the seed's long
# requests (18/s x 467.6 ms) dominate the variance. Over T seconds the rate's standard deviation
# is sqrt(rate x T x E[ms^2]) / T: for the seed's 24-device fleet 662 ms/s (3.9 % of protected
# capacity) at 10 s and 1,480 ms/s (8.8 %) at 2 s; on the 4-device benchmark pool six times
# that in relative terms. The ladder therefore never climbs on a point estimate: it climbs when
# a *lower confidence bound* of offered demand (mean - z sigma, sigma estimated from the samples
# themselves) passes a threshold, in any of several spans (DEFAULT_SPANS_S). A sudden flood is
# certain within a second; a modest sustained surge only becomes certain over the long span.
# Demand inside the envelope keeps the ladder at 0 except for z-sigma excursions.
DEFAULT_WINDOW_S = 10.0
DEFAULT_SPANS_S: tuple[float, ...] = (1.0, 2.0, 4.0, 10.0)
# How much each step degrades or sheds is not the step's business: it is planned per flow from
# the flow's *certain* demand, the highest lower bound (rate - PLAN_Z sigma) over these spans. A
# flood is certain within 2 s, so its excess is shed at once; a surge's Poisson noise is not
# excess, so a surge that fits under the plan line degrades nothing (a point estimate over 2 s
# crossed the line on noise alone about a third of the time at the seed's 1.25x, on 4 devices);
# when a surge ends, the short spans fall at once and the 10 s one only holds what it is sure of.
PLAN_SPANS_S: tuple[float, ...] = (2.0, 4.0, 10.0)
PLAN_Z = 1.0
# Two degradations whose modeled quality cost per accelerator-ms saved is within this share of
# each other cost the same, and the plan then degrades the fewest answers. Route quality
# scores come with two decimals (0.92 full, 0.89 capped, 0.86 fallback on the example routes):
# rounding alone leaves a 0.03 loss uncertain by +-17 %, and the learned savings move by
# about 10 % between replicas and runs (0.39-0.45 for the fallback). Without the tie the
# order followed that noise across a knife edge (0.06 / 0.43 vs 0.03 / 0.21: 1.4 % apart;
# 0.06 / 0.39: 12 %), and a pool flipped between capping 46 % of a surge's answers and
# diverting 20 % of them.
QUALITY_TIE = 0.25
# The recent span over which a flow's admitted work, and what capping or the fallback saved of
# it, is measured (the relief the plan counts on), and the pool's point estimate of demand.
DEFAULT_PLAN_SPAN_S = 2.0
# 100 ms buckets: the ladder is evaluated about every 100 ms, and a finer bucket
# would only age samples out in smaller steps at a higher memory cost.
DEFAULT_BUCKETS = 100
# Memory bound of a window, whatever its configuration asks for.
MAX_BUCKETS = 10_000
# Dwell is the fast signal: a 5 s window, and the last 512 samples of it. 512 samples
# leave ~25 above the p95, a stable estimate; at the seed's 158 requests/s they cover
# the last ~3.2 s.
DEFAULT_DWELL_WINDOW_S = 5.0
DEFAULT_DWELL_SAMPLES = 512


@dataclass(frozen=True, slots=True)
class DemandReading:
    """Offered accelerator-ms per second over one span, with the standard error of that rate."""

    span_s: float
    offered_ms_per_s: float
    sigma_ms_per_s: float
    count: int = 0

    def lower_bound(self, z: float) -> float:
        return self.offered_ms_per_s - z * self.sigma_ms_per_s


def certain_rate(window: DemandWindow, now: float, spans: Sequence[float] = PLAN_SPANS_S) -> float:
    """The demand the plan is sure of: the highest lower bound (``PLAN_Z`` standard errors) of
    the window's rate over ``spans`` (those the window holds), but never more than the upper
    bound of the shortest span, at least 0. The cap is what lets a flow that has calmed down
    out of its past: a flood that ended 2 s ago is still in the 10 s span's bound, not in the
    recent evidence, and a tenant back inside its share must not be refused for it."""
    usable = sorted(span for span in spans if span <= window.window_s) or [window.window_s]
    readings = [window.reading(now, span) for span in usable]
    recent = readings[0]
    ceiling = recent.offered_ms_per_s + PLAN_Z * recent.sigma_ms_per_s
    return max(0.0, min(ceiling, max(r.lower_bound(PLAN_Z) for r in readings)))


class LadderStep(IntEnum):
    NORMAL = 0
    SHED_OPTIONAL = 1
    REDUCE_OUTPUT = 2
    FALLBACK = 3
    DEFER_BATCH = 4
    REJECT_INTERACTIVE = 5
    PROTECT_ADMITTED = 6


TOP_STEP = LadderStep.PROTECT_ADMITTED


def protected_capacity_ms_per_s(
    devices: int,
    protected_utilization: float = DEFAULT_PROTECTED_UTILIZATION,
    *,
    time_scale: float = 1.0,
) -> float:
    """Accelerator-ms per second admission may plan on ``devices`` healthy devices.

    ``devices x protected_utilization x 1000`` in device-ms: the unit of
    ``estimate.predict(..., time_scale=...)``, which already scales a profile's
    milliseconds to what the backend's devices spend, so leave ``time_scale`` at 1.0
    for the pipeline's predictions. Pass a backend's ``time_scale`` ("its devices run
    time_scale x profile ms") only when offered demand is counted in *unscaled*
    profile ms: a device then serves ``1000 / time_scale`` profile-ms per second.
    Either way the utilization is the same.
    """
    if devices < 0:
        raise ValueError(f"devices must be at least 0 (got {devices})")
    if not 0.0 < protected_utilization <= 1.0:
        raise ValueError(f"protected_utilization must be in (0, 1] (got {protected_utilization})")
    if not (math.isfinite(time_scale) and time_scale > 0.0):
        raise ValueError(f"time_scale must be positive (got {time_scale})")
    return devices * protected_utilization * MS_PER_S / time_scale


# --------------------------------------------------------------------------- windows


# The shortest time a young window's rate is measured over, as a fraction of the window (see
# DemandWindow.rate_ms_per_s): half of it, so a start-up burst reads as a burst, not a surge.
YOUNG_WINDOW_FLOOR = 0.5


class DemandWindow:
    """Predicted accelerator-ms arriving at one pool over the last ``window_s`` seconds.

    A ring of ``buckets`` time buckets, each holding the sum and count of the
    samples whose time falls in it, tagged with its absolute bucket number so a
    stale slot is recognised and reset lazily. Memory is fixed by ``buckets``,
    not by the arrival rate. A sample older than the window is dropped.

    A reading visits only the slots of its span's buckets (O(span), not O(buckets)), in
    ascending slot order as a pass over the whole ring would, so its sums are the same
    floats; the last reading is kept per (samples added, ``now``, span): a gather reads
    the same span more than once.
    """

    __slots__ = (
        "_added",
        "_counts",
        "_epochs",
        "_first",
        "_kept",
        "_kept_at",
        "_sums",
        "_sumsq",
        "_width_s",
        "buckets",
        "window_s",
    )

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, buckets: int = DEFAULT_BUCKETS) -> None:
        if not (math.isfinite(window_s) and window_s > 0.0):
            raise ValueError(f"window_s must be positive (got {window_s})")
        if not 1 <= buckets <= MAX_BUCKETS:
            raise ValueError(f"buckets must be between 1 and {MAX_BUCKETS} (got {buckets})")
        self.window_s = window_s
        self.buckets = buckets
        self._width_s = window_s / buckets
        self._sums = [0.0] * buckets
        self._sumsq = [0.0] * buckets
        self._counts = [0] * buckets
        self._epochs = [-1] * buckets  # absolute bucket number held by each slot; -1: never used
        self._first: int | None = None  # bucket of the first sample ever seen
        self._added = 0  # samples added: the last reading (``_kept``) is for this many
        self._kept_at: tuple[int, float, int] | None = None  # (samples added, now, span)
        self._kept: tuple[float, float, int, float] = (0.0, 0.0, 0, 0.0)

    def _bucket(self, now: float) -> int:
        if not math.isfinite(now):
            raise ValueError(f"now must be finite (got {now})")
        return math.floor(now / self._width_s)

    def add(self, now: float, accelerator_ms: float) -> None:
        if not (math.isfinite(accelerator_ms) and accelerator_ms >= 0.0):
            raise ValueError(f"accelerator_ms must be finite and at least 0 (got {accelerator_ms})")
        bucket = self._bucket(now)
        self._added += 1
        slot = bucket % self.buckets
        held = self._epochs[slot]
        if held > bucket:
            return  # the slot already holds a newer bucket: this sample is older than the window
        if held < bucket:
            self._epochs[slot] = bucket
            self._sums[slot] = 0.0
            self._sumsq[slot] = 0.0
            self._counts[slot] = 0
        self._sums[slot] += accelerator_ms
        self._sumsq[slot] += accelerator_ms * accelerator_ms
        self._counts[slot] += 1
        if self._first is None or bucket < self._first:
            self._first = bucket

    def _live(self, now: float, span_buckets: int | None = None) -> tuple[float, float, int, float]:
        """(sum of ms, sum of squared ms, count, seconds covered) over the last ``span_buckets``
        buckets (the whole window by default) ending at ``now``. The current bucket counts only
        for the part of it that has passed: a rate read early in a bucket is not diluted by
        the rest of it."""
        span = self.buckets if span_buckets is None else max(1, min(self.buckets, span_buckets))
        key = (self._added, now, span)
        if key == self._kept_at:
            return self._kept
        bucket = self._bucket(now)
        oldest = bucket - span + 1
        total, squares, count = 0.0, 0.0, 0
        epochs, sums, sumsq, counts = self._epochs, self._sums, self._sumsq, self._counts
        # The slots that can hold a bucket of the span, in ascending order: a slot holds bucket
        # b only at b % buckets, so no other slot passes the test below.
        first, last = oldest % self.buckets, bucket % self.buckets
        if span == self.buckets:
            slots: Iterable[int] = range(self.buckets)
        elif first <= last:
            slots = range(first, last + 1)
        else:
            slots = itertools.chain(range(last + 1), range(first, self.buckets))
        for slot in slots:
            if oldest <= epochs[slot] <= bucket:
                total += sums[slot]
                squares += sumsq[slot]
                count += counts[slot]
        # A young window divides by its age, but never by less than half the span: one burst
        # in the first 100 ms of a gateway's life is not fifty times its rate.
        floor = max(1, math.ceil(span * YOUNG_WINDOW_FLOOR))
        age = span if self._first is None else bucket - self._first + 1
        if age <= floor:
            live = (total, squares, count, floor * self._width_s)
        else:
            partial = min(self._width_s, max(0.0, now - bucket * self._width_s))
            seconds = (min(span, age) - 1) * self._width_s + partial
            live = (total, squares, count, max(seconds, 0.5 * self._width_s))
        self._kept_at, self._kept = key, live
        return live

    def reading(self, now: float, span_s: float | None = None) -> DemandReading:
        """The offered rate over the last ``span_s`` seconds (the whole window by default), with
        its standard error. Arrivals are a compound Poisson process: the sum of ``n`` prices
        over ``T`` seconds has variance ``sum(x^2)``, so the rate's standard deviation is
        ``sqrt(sum x^2) / T``, estimated from the samples themselves (no assumed mix)."""
        span_buckets = None if span_s is None else max(1, round(span_s / self._width_s))
        total, squares, count, seconds = self._live(now, span_buckets)
        return DemandReading(
            span_s=seconds,
            offered_ms_per_s=total / seconds,
            sigma_ms_per_s=math.sqrt(squares) / seconds,
            count=count,
        )

    def total_ms(self, now: float) -> float:
        return self._live(now)[0]

    def count(self, now: float) -> int:
        return self._live(now)[2]

    def rate_ms_per_s(self, now: float) -> float:
        """Offered accelerator-ms per second over the window.

        Divided by the time the window has existed, not its full length, for the
        first ``window_s`` after the first sample: a gateway that just started
        must not read a surge as a fifth of itself (that would fail open).
        """
        total, _, _, seconds = self._live(now)
        return total / seconds

    def mean_ms(self, now: float) -> float:
        """Mean predicted accelerator-ms per request over the window; 0.0 when empty."""
        total, _, count, _ = self._live(now)
        return total / count if count else 0.0


class DwellWindow:
    """Recent observed queue dwell samples, for their p95.

    A ring of the last ``capacity`` samples with their times; percentiles are
    taken over those still inside ``window_s``. Memory is fixed by ``capacity``.
    """

    __slots__ = ("_at", "_dwell_ms", "_next", "_size", "capacity", "window_s")

    def __init__(
        self, window_s: float = DEFAULT_DWELL_WINDOW_S, capacity: int = DEFAULT_DWELL_SAMPLES
    ) -> None:
        if not (math.isfinite(window_s) and window_s > 0.0):
            raise ValueError(f"window_s must be positive (got {window_s})")
        if not 1 <= capacity <= MAX_BUCKETS:
            raise ValueError(f"capacity must be between 1 and {MAX_BUCKETS} (got {capacity})")
        self.window_s = window_s
        self.capacity = capacity
        self._at = [0.0] * capacity
        self._dwell_ms = [0.0] * capacity
        self._next = 0
        self._size = 0

    def add(self, now: float, dwell_ms: float) -> None:
        if not (math.isfinite(now) and math.isfinite(dwell_ms) and dwell_ms >= 0.0):
            raise ValueError(f"dwell sample must be finite and at least 0 (got {dwell_ms} at {now})")
        self._at[self._next] = now
        self._dwell_ms[self._next] = dwell_ms
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def quantile_ms(self, now: float, q: float) -> float:
        """Nearest-rank quantile of the dwell samples in the window; 0.0 when there are none."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"q must be in (0, 1] (got {q})")
        since = now - self.window_s
        recent = sorted([dwell for at, dwell in self._samples() if since < at <= now])
        if not recent:
            return 0.0
        return recent[max(0, math.ceil(q * len(recent)) - 1)]

    def p95_ms(self, now: float) -> float:
        return self.quantile_ms(now, 0.95)

    def count(self, now: float) -> int:
        """Samples inside the window."""
        since = now - self.window_s
        return sum(1 for at, _ in self._samples() if since < at <= now)

    def _samples(self) -> Iterable[tuple[float, float]]:
        """(time, dwell ms) of the samples held, in slot order."""
        if self._size == self.capacity:
            return zip(self._at, self._dwell_ms, strict=True)
        return zip(self._at[: self._size], self._dwell_ms[: self._size], strict=True)


# --------------------------------------------------------------------------- evidence


@dataclass(frozen=True, slots=True)
class LoadEvidence:
    """What the gatherer saw about one pool at ``evidence_at``, judged at ``now``."""

    now: float  # monotonic seconds of this ladder update
    evidence_at: float  # monotonic seconds when the figures below were gathered
    # Offered accelerator-ms per second: admissible work (not refused by its own tenant's quota,
    # entitlement or policy), priced on the model asked for. A recent point estimate; the
    # ladder climbs on ``readings`` (rule 3), the shedder plans amounts on this.
    offered_ms_per_s: float
    protected_capacity_ms_per_s: float  # protected_capacity_ms_per_s(healthy_devices, ...)
    healthy_devices: int
    configured_devices: int
    queue_dwell_p95_ms: float = 0.0  # observed gateway queue dwell, p95 (DwellWindow)
    dwell_budget_ms: float | None = None  # the class's max dwell; None: no dwell evidence applies
    dwell_samples: int = 0  # dwell samples behind that p95
    # Is the backend the bottleneck? Admitted work keeps the devices at least load.SATURATED
    # of their raw time busy. Dwell counts as overload evidence only then (rule 5).
    backend_saturated: bool = False
    mean_request_ms: float = 0.0  # predicted accelerator-ms per request (DemandWindow.mean_ms)
    # Predicted accelerator-ms not yet executed: the gateway's queues plus the work it has bound
    # to the backend (everything in Triton's queue for this pool came through the gateway).
    queued_accelerator_ms: float = 0.0
    window_s: float = DEFAULT_WINDOW_S  # the longest span offered demand is read over
    # What admitted work actually costs per accelerator-ms of its offered (primary) price over
    # the window: < 1 while the fallback serves part of it. 1.0: no relief (or no evidence).
    relief: float = 1.0
    # Offered demand over each span (DEFAULT_SPANS_S) with its standard error; empty: only the
    # point estimate is known, and it is taken as certain.
    readings: tuple[DemandReading, ...] = ()

    def _over_capacity(self, offered: float) -> float:
        capacity = self.protected_capacity_ms_per_s
        if not (math.isfinite(capacity) and capacity > 0.0) or not math.isfinite(offered):
            return math.inf
        return max(0.0, offered) / capacity

    @property
    def utilization(self) -> float:
        """Offered over protected capacity; ``inf`` without capacity or readable demand (rule 2)."""
        if not (math.isfinite(self.offered_ms_per_s) and self.offered_ms_per_s >= 0.0):
            return math.inf
        return self._over_capacity(self.offered_ms_per_s)

    def utilization_bound(self, z: float) -> float:
        """The highest lower confidence bound of utilization over the spans (rule 3): the load
        the evidence shows *for certain*; the point estimate when there are no readings."""
        point = self.utilization
        if not self.readings or not math.isfinite(point):
            return point
        return max(self._over_capacity(r.lower_bound(z)) for r in self.readings)

    @property
    def relief_factor(self) -> float:
        return self.relief if math.isfinite(self.relief) and 0.0 < self.relief <= 1.0 else 1.0

    @property
    def age_s(self) -> float:
        age = self.now - self.evidence_at
        return max(0.0, age) if math.isfinite(age) else math.inf

    @property
    def dwell_over_budget(self) -> bool:
        if self.dwell_budget_ms is None:
            return False
        # Written so that a NaN dwell reads as over budget: unreadable evidence fails safe.
        return not self.queue_dwell_p95_ms <= self.dwell_budget_ms

    @property
    def backlog_ms(self) -> float:
        """Predicted accelerator-ms already waiting or running for this pool."""
        return self.queued_accelerator_ms

    def describe(self) -> str:
        devices = f"{self.healthy_devices}/{self.configured_devices} devices healthy"
        utilization = self.utilization
        if not (math.isfinite(self.offered_ms_per_s) and self.offered_ms_per_s >= 0.0):
            return f"offered demand unreadable ({self.offered_ms_per_s}): treated as fully loaded ({devices})"
        if math.isinf(utilization):
            return f"no protected capacity ({devices}): treated as fully loaded"
        return (
            f"offered {self.offered_ms_per_s:.0f} ms/s = {utilization * 100:.1f}% "
            f"of protected {self.protected_capacity_ms_per_s:.0f} ms/s ({devices})"
        )


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True)
class LadderConfig:
    """Thresholds (fractions of protected capacity) and the timing of the ladder. Its file
    schema, bounds and consistency checks are ``gateway.settings.LadderSchema``'s; these
    defaults are the schema's too."""

    # Every threshold is judged on the *lower confidence bound* of offered demand (rule 3): a
    # step is entered only when the evidence shows demand above it for certain. Normal load
    # sits inside the envelope (the seed's 97.43 %), so no step triggers there. The steps
    # that only arm a degradation (1-3) sit close above the envelope; the seed's 1.25x surge
    # (its 10 s bound ~1.11 on the seed's fleet) enters step 3's band and, with 5 %
    # hysteresis (more than the bound's ~4 % noise), does not fall out of it; its upward
    # wobbles reach step 4 (deferring batch work, as the seed's ladder does under a surge)
    # about half the time in simulation. How much a step degrades is planned from each
    # flow's excess (plan_flows), not by the step.
    # Step 1 costs no quality (shadow traffic and optional stages return nothing to callers).
    shed_optional_at: float = 1.00
    # Step 2: cap output within declared quality evidence, for the excess only.
    reduce_output_at: float = 1.03
    # Step 3: route the excess of eligible work to the warm validated fallback. The seed's
    # 1.25x surge (1.218; its 10 s bound ~1.11 on the seed's fleet) sits here, as the seed says.
    fallback_at: float = 1.06
    # Step 4 once the excess is certain and larger: asynchronous and batch work can wait
    # without missing a deadline, interactive work cannot.
    defer_batch_at: float = 1.15
    # Step 5: refuse the excess of new online work, falling first on flows over their
    # weighted share; judged after the fallback's relief (rule 7).
    reject_interactive_at: float = 1.25
    # Step 6 at 1 / 0.70 = 1.43, where offered work exceeds the devices' raw time: only
    # control work and each flow's reserved share are admitted (no flow borrows idle share).
    protect_admitted_at: float = 1.43

    # The per-flow plan fills this share of the devices' raw time before it caps, diverts or
    # refuses anything: the steps say the envelope is exceeded (shadow traffic stops, batch
    # waits, degradations are armed); the amounts spend the reserve between the envelope and
    # this line first, because a degraded answer is a cost the caller sees and the reserve is
    # not. 0.90 serves the seed's 1.25x surge (85.3 % of raw time) whole, with room for its
    # noise; above the line each flow's excess is degraded, then refused. The last 10 % stays
    # for variance, and admission still refuses (or sends to the fallback) any request that
    # cannot finish in time, so no admitted request is promised time the devices lack.
    plan_utilization: float = 0.90
    # z of the lower confidence bound: 2.5 is a one-sided 99.4 % bound per span; with four
    # spans read every 100 ms (the 1 s span alone gives ten fresh readings a second), 2.0 left
    # the seed's normal load off step 0 about 8 % of the time on noise alone (40 simulated
    # seeds), 2.5 about 1 % (tests/test_load.py).
    confidence_z: float = 2.5
    # Leave a step only when the bound is below enter - hysteresis.
    hysteresis: float = 0.05
    # The bound must stay under the leave line this long before the ladder descends (directly
    # to the step the evidence supports). After a 1.25x surge ends, the 10 s span still holds
    # surge samples for several seconds (back at step 0 after a median 7.4 s, simulated); 1 s
    # more (10 updates) filters a single quiet reading, and a longer hold would only keep the
    # steps armed: the amounts follow the 2 s plan span anyway, so a held step degrades nothing
    # once the excess is gone.
    hold_s: float = 1.0
    # Dwell p95 is evidence only over at least this many samples (one slow request is not a p95).
    dwell_min_samples: int = 20
    # Evidence older than this fails safe: the gatherer refreshes every ~100-500 ms,
    # so 2 s means it or Triton's statistics are stuck.
    stale_after_s: float = 2.0
    # Stale evidence raises to step 4, not 5: without data the ladder protects
    # itself with the steps that refuse no interactive caller (fallback, deferral);
    # a stuck metrics path must not become an outage.
    stale_step: LadderStep = LadderStep.DEFER_BATCH
    # Dwell p95 over budget, while the backend is saturated, raises to step 3: the queue is
    # growing whatever the predictions say (they are optimistic).
    dwell_step: LadderStep = LadderStep.FALLBACK

    # Retry-after bounds. Below 100 ms a retry arrives before the next evidence
    # refresh and meets the same decision; beyond 30 s the drain is extrapolated
    # far past the demand window, and the caller is better served by its own backoff or
    # a product alternative than by a precise-looking guess.
    retry_after_min_ms: int = 100
    retry_after_max_ms: int = 30_000
    # With every device lost nothing drains, so there is no drain to price. Capacity comes
    # back only when a health probe (every 0.5 s) sees a backend again: the advice is that
    # re-check horizon (within the bounds above), not the 30 s cap, which would keep
    # well-behaved clients away from a backend that came back after one second.
    retry_after_no_capacity_ms: int = 1_000

    @property
    def thresholds(self) -> tuple[float, ...]:
        """Utilization that enters each step, indexed by step; step 0 is entered at 0."""
        return (
            0.0,
            self.shed_optional_at,
            self.reduce_output_at,
            self.fallback_at,
            self.defer_batch_at,
            self.reject_interactive_at,
            self.protect_admitted_at,
        )

    def step_for(self, utilization: float) -> LadderStep:
        """The highest step whose threshold ``utilization`` reaches (rule 3)."""
        if math.isnan(utilization):
            return TOP_STEP
        reached = LadderStep.NORMAL
        for step in LadderStep:
            if utilization >= self.thresholds[step]:
                reached = step
        return reached

    def leaves_below(self, step: LadderStep) -> float:
        return self.thresholds[step] - self.hysteresis


DEFAULT_LADDER = LadderConfig()


# --------------------------------------------------------------------------- state machine


@dataclass(frozen=True, slots=True)
class LadderState:
    step: LadderStep
    changed: bool  # the step differs from the previous state's
    reason: str  # the evidence and the rule that decided, for logs and provenance
    stale: bool  # decided on stale evidence (rule 6)
    since: float  # monotonic seconds when ``step`` was entered
    # Since when every update has found the step ready to leave (utilization under its
    # leave line, no floor holding it); None while it is not. The step is left once this
    # has lasted ``hold_s`` (rule 4).
    calm_since: float | None = None


def next_state(
    previous: LadderState, evidence: LoadEvidence, config: LadderConfig = DEFAULT_LADDER
) -> LadderState:
    """The ladder's transition function: the whole state machine, pure."""
    bound = evidence.utilization_bound(config.confidence_z)
    effective = bound * evidence.relief_factor
    # Rule 7: steps 1-3 follow offered demand; the steps beyond the fallback (4-6) follow
    # the demand that remains once the fallback serves what it may.
    target = config.step_for(bound)
    if target > LadderStep.FALLBACK:
        target = max(LadderStep.FALLBACK, config.step_for(effective))
    notes = [evidence.describe()]
    if evidence.readings and math.isfinite(bound):
        notes.append(f"certain (z={config.confidence_z:g}): {bound * 100:.1f}%")
    if effective < bound:
        notes.append(f"after fallback relief x{evidence.relief:.2f}: {effective * 100:.1f}%")
    if (
        evidence.dwell_over_budget
        and evidence.backend_saturated
        and evidence.dwell_samples >= config.dwell_min_samples
    ):
        notes.append(
            f"queue dwell p95 {evidence.queue_dwell_p95_ms:.0f} ms over budget "
            f"{evidence.dwell_budget_ms:.0f} ms on a saturated backend: at least step {config.dwell_step}"
        )
        target = max(target, config.dwell_step)
    stale = evidence.age_s > config.stale_after_s
    if stale:
        notes.append(
            f"evidence {evidence.age_s:.1f} s old (stale after {config.stale_after_s:.1f} s): "
            f"at least step {config.stale_step}"
        )
        target = max(target, config.stale_step)

    current, now = previous.step, evidence.now
    step, calm_since = current, None
    judged = bound if current <= LadderStep.FALLBACK else effective
    if target > current:
        step = target
        notes.append(f"climb {current} -> {step}")
    elif target < current and not judged < config.leaves_below(current):
        notes.append(f"hold step {current}: leaves below {config.leaves_below(current) * 100:.1f}%")
    elif target < current:
        calm_since = now if previous.calm_since is None else previous.calm_since
        if now - calm_since + _TIME_EPS_S < config.hold_s:
            notes.append(f"hold step {current} for {config.hold_s - (now - calm_since):.1f} s more")
        else:
            # Down to the step the evidence supports, at once (a recovered pool must not stay
            # degraded one hold period per step), landing with the same hysteresis: on the
            # step whose leave line the bound is above, so one reading does not climb back.
            # Rule 7 for the landing too: steps 1-3 by the bound, 4-6 after the relief.
            landing = config.step_for(bound + config.hysteresis)
            if landing > LadderStep.FALLBACK:
                landing = max(LadderStep.FALLBACK, config.step_for(effective + config.hysteresis))
            step = LadderStep(min(current - 1, max(target, landing)))
            notes.append(f"descend {current} -> {step}")
            calm_since = None
    changed = step != current
    return LadderState(
        step=step,
        changed=changed,
        reason="; ".join(notes),
        stale=stale,
        since=now if changed else previous.since,
        calm_since=calm_since,
    )


class OverloadLadder:
    """The ladder of one pool: holds the current ``LadderState`` and advances it."""

    __slots__ = ("config", "state")

    def __init__(self, config: LadderConfig = DEFAULT_LADDER, *, now: float = 0.0) -> None:
        self.config = config
        self.state = LadderState(
            step=LadderStep.NORMAL, changed=False, reason="no evidence yet", stale=False, since=now
        )

    @property
    def step(self) -> LadderStep:
        return self.state.step

    def update(self, evidence: LoadEvidence) -> LadderState:
        self.state = next_state(self.state, evidence, self.config)
        return self.state


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class LadderEffects:
    """What a step switches on. Cumulative: each step does everything the steps below do."""

    step: LadderStep
    shadow_enabled: bool  # shadow traffic and optional secondary stages run (off from step 1)
    reduce_output: bool  # reduce candidate counts / output limits within declared quality evidence
    fallback_for_eligible: bool  # eligible classes go to a warm validated smaller model
    # Batch and async classes are deferred, or refused with RESOURCE_EXHAUSTED and
    # a retry-after from the predicted drain.
    defer_batch: bool
    reject_new_interactive: bool  # new interactive work is refused early with retry guidance
    protect_control_only: bool  # only the control class and already admitted sequences proceed


def _effects_of(step: LadderStep) -> LadderEffects:
    return LadderEffects(
        step=step,
        shadow_enabled=step < LadderStep.SHED_OPTIONAL,
        reduce_output=step >= LadderStep.REDUCE_OUTPUT,
        fallback_for_eligible=step >= LadderStep.FALLBACK,
        defer_batch=step >= LadderStep.DEFER_BATCH,
        reject_new_interactive=step >= LadderStep.REJECT_INTERACTIVE,
        protect_control_only=step >= LadderStep.PROTECT_ADMITTED,
    )


EFFECTS: tuple[LadderEffects, ...] = tuple(_effects_of(step) for step in LadderStep)


def effects(step: int) -> LadderEffects:
    if not 0 <= step <= TOP_STEP:
        raise ValueError(f"ladder step must be between 0 and {int(TOP_STEP)} (got {step})")
    return EFFECTS[step]


# --------------------------------------------------------------------------- retry guidance


@dataclass(frozen=True, slots=True)
class RetryAfter:
    ms: int  # what goes into ``retry-after-ms``, within the configured bounds
    drain_ms: float  # the unbounded prediction (``inf`` without capacity)
    reason: str


class Shedder:
    """Picks a share of calls, evenly spread: ``admit(offered, target)`` says yes to the fraction
    ``target / offered`` of calls (all when ``offered <= target``, none without a target),
    deterministically with a credit accumulator (no randomness, no bursts of refusals). The
    ladder uses one per flow and mechanism (which requests to cap, divert, admit); shadow
    traffic uses one to sample. Pure: the caller passes the rates in.
    """

    __slots__ = ("_credit",)

    def __init__(self) -> None:
        self._credit = 0.0

    def admit(self, offered_ms_per_s: float, target_ms_per_s: float) -> bool:
        if not (math.isfinite(target_ms_per_s) and target_ms_per_s > 0.0):
            return False
        if not (math.isfinite(offered_ms_per_s) and offered_ms_per_s > target_ms_per_s):
            return True
        self._credit += target_ms_per_s / offered_ms_per_s
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    def pick(self, share: float) -> bool:
        """Is this call part of ``share`` (0..1) of the calls?"""
        if not share > 0.0:
            return False
        return share >= 1.0 or self.admit(1.0, share)


# --------------------------------------------------------------------------- fair shares

FlowKey = tuple[str, str]  # (request class, tenant)


@dataclass(frozen=True, slots=True)
class FlowDemand:
    """One flow's offered demand on a pool, with its place in the share hierarchy."""

    key: FlowKey
    offered_ms_per_s: float
    weight: float = 1.0  # the tenant's weight inside its class
    class_weight: float = 1.0  # the class's weight in the pool


def _water_fill(demands: dict[str, float], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair split of ``capacity``: a claimant asking for less than its weighted
    share gets what it asks; what it leaves is split among the rest by weight (the classic
    water-filling of WFQ/DRR: one flow's excess never costs another its share)."""
    alloc = dict.fromkeys(demands, 0.0)
    left = {name for name, d in demands.items() if d > 0.0}
    remaining = max(0.0, capacity)
    while left and remaining > 1e-9:
        total_weight = sum(max(weights[name], 1e-9) for name in left)
        level = remaining / total_weight
        satisfied = {name for name in left if demands[name] - alloc[name] <= level * max(weights[name], 1e-9)}
        if not satisfied:
            for name in left:
                alloc[name] += level * max(weights[name], 1e-9)
            return alloc
        for name in satisfied:
            remaining -= demands[name] - alloc[name]
            alloc[name] = demands[name]
        left -= satisfied
    return alloc


def _guaranteed(demands: dict[str, float], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Each active claimant's own weighted share, capped at its demand: nothing is lent."""
    active = [name for name, d in demands.items() if d > 0.0]
    total_weight = sum(max(weights[name], 1e-9) for name in active)
    return {
        name: min(d, capacity * max(weights[name], 1e-9) / total_weight) if d > 0.0 and total_weight else 0.0
        for name, d in demands.items()
    }


def fair_allocation(
    flows: Sequence[FlowDemand], capacity_ms_per_s: float, *, lend_idle: bool = True
) -> dict[FlowKey, float]:
    """Each flow's fair part of ``capacity_ms_per_s``, hierarchically: classes by class weight,
    then tenants inside a class by tenant weight. With ``lend_idle`` (steps up to 5) a flow
    inside its share keeps all of its demand and the capacity it leaves idle goes to the
    others by weight; without it (step 6) each flow gets at most its own weighted share."""
    split = _water_fill if lend_idle else _guaranteed
    if not math.isfinite(capacity_ms_per_s) or capacity_ms_per_s <= 0.0:
        return {flow.key: 0.0 for flow in flows}
    class_demand: dict[str, float] = {}
    class_weight: dict[str, float] = {}
    for flow in flows:
        name = flow.key[0]
        class_demand[name] = class_demand.get(name, 0.0) + max(0.0, flow.offered_ms_per_s)
        class_weight[name] = flow.class_weight
    if lend_idle:
        class_alloc = _water_fill(class_demand, class_weight, capacity_ms_per_s)
    else:
        # Each active class's own weighted share (not capped at its demand: its tenants split
        # the share, each keeping at most its own part of it).
        active = [name for name, d in class_demand.items() if d > 0.0]
        total = sum(max(class_weight[name], 1e-9) for name in active)
        class_alloc = {
            name: capacity_ms_per_s * max(class_weight[name], 1e-9) / total if name in active else 0.0
            for name in class_demand
        }
    allocation: dict[FlowKey, float] = {}
    for name, budget in class_alloc.items():
        members = [flow for flow in flows if flow.key[0] == name]
        tenant_alloc = split(
            {flow.key[1]: max(0.0, flow.offered_ms_per_s) for flow in members},
            {flow.key[1]: flow.weight for flow in members},
            budget,
        )
        for flow in members:
            allocation[flow.key] = tenant_alloc[flow.key[1]]
    return allocation


@dataclass(frozen=True, slots=True)
class FlowPlan:
    """What the ladder does to one flow's new requests until the next update: the share of them
    whose output is capped (step 2+), the share sent to the fallback (step 3+), and the share
    admitted at all (step 5+; 1.0 below). Every share falls on the flow's *excess*: demand
    beyond its fair allocation of the protected envelope. A flow inside its share has no
    excess, so none of it is degraded or refused unless the pool cannot carry even the
    in-share demand (then the allocations themselves shrink, by weight)."""

    allocation_ms_per_s: float = math.inf
    excess_ms_per_s: float = 0.0
    reduce_share: float = 0.0
    divert_share: float = 0.0
    admit_share: float = 1.0


NO_PLAN = FlowPlan()


@dataclass(frozen=True, slots=True)
class FlowRelief:
    """What one flow's admitted work measurably saved over the plan span."""

    offered_ms_per_s: float = 0.0  # admitted work priced as offered (on the primary)
    running_ms_per_s: float = 0.0  # the same work priced as it runs (reduced, fallback)
    reduced_ms_per_s: float = 0.0  # what capped output saved of it

    @property
    def diverted_ms_per_s(self) -> float:
        """What the fallback saved of it: all the saving that capping did not."""
        return max(0.0, self.offered_ms_per_s - self.running_ms_per_s - self.reduced_ms_per_s)

    @property
    def relief(self) -> float:
        if self.offered_ms_per_s <= 0.0:
            return 1.0
        return min(1.0, max(0.0, self.running_ms_per_s / self.offered_ms_per_s))


def plan_flows(
    flows: Sequence[FlowDemand],
    reliefs: dict[FlowKey, FlowRelief],
    *,
    capacity_ms_per_s: float,
    step: LadderStep,
    reduce_saving: float,
    fallback_saving: float,
    exempt_classes: frozenset[str] = frozenset(),
    reduce_quality_loss: float = 0.0,
    fallback_quality_loss: float = 0.0,
) -> dict[FlowKey, FlowPlan]:
    """The ladder's plan for every flow of a pool (pure). ``capacity_ms_per_s`` is what the plan
    fills before it degrades anything (``LadderConfig.plan_utilization`` of the devices' raw
    time); ``reduce_saving`` and ``fallback_saving`` are the learned shares of its price a
    request saves when capped or diverted, ``*_quality_loss`` the modeled quality each costs
    (full score minus the capped or fallback score, from the route's evidence);
    ``exempt_classes`` (control) are never refused."""
    fx = effects(step)
    allocation = fair_allocation(flows, capacity_ms_per_s, lend_idle=not fx.protect_control_only)
    plans: dict[FlowKey, FlowPlan] = {}
    for flow in flows:
        offered = max(0.0, flow.offered_ms_per_s)
        allowed = allocation.get(flow.key, 0.0)
        if flow.key[0] in exempt_classes:
            plans[flow.key] = FlowPlan(allocation_ms_per_s=allowed)
            continue
        excess = max(0.0, offered - allowed)
        if excess <= 0.0 or offered <= 0.0:
            plans[flow.key] = FlowPlan(allocation_ms_per_s=allowed)
            continue
        relief = reliefs.get(flow.key, FlowRelief())
        reduce_share = divert_share = 0.0
        reduce_saving, fallback_saving = max(reduce_saving, 0.05), max(fallback_saving, 0.05)
        # The degradation that costs the least modeled quality per accelerator-ms saved goes
        # first (once the step permits both). Within QUALITY_TIE of each other the two cost
        # the same modeled quality for the same saving, and the one that saves more per answer
        # goes first: it degrades the fewest answers (on the example routes the fallback, ~45 %
        # of a price against ~20 % for a capped output).
        fallback_cost = fallback_quality_loss / fallback_saving
        reduce_cost = reduce_quality_loss / reduce_saving
        if abs(fallback_cost - reduce_cost) <= QUALITY_TIE * max(fallback_cost, reduce_cost):
            fallback_first = fx.fallback_for_eligible and fallback_saving >= reduce_saving
        else:
            fallback_first = fx.fallback_for_eligible and fallback_cost < reduce_cost
        if fallback_first:
            divert_share = min(1.0, excess / (offered * fallback_saving))
            left = max(0.0, excess - relief.diverted_ms_per_s)
            reduce_share = min(1.0, left / (offered * reduce_saving)) if fx.reduce_output else 0.0
        else:
            if fx.reduce_output:
                reduce_share = min(1.0, excess / (offered * reduce_saving))
            if fx.fallback_for_eligible:
                left = max(0.0, excess - relief.reduced_ms_per_s)
                divert_share = min(1.0, left / (offered * fallback_saving))
        admit_share = 1.0
        if fx.reject_new_interactive:
            # Admit what the allocation carries at the price admitted work measurably runs at.
            admit_share = min(1.0, allowed / (offered * relief.relief)) if relief.relief > 0 else 1.0
        plans[flow.key] = FlowPlan(
            allocation_ms_per_s=allowed,
            excess_ms_per_s=excess,
            reduce_share=reduce_share,
            divert_share=divert_share,
            admit_share=admit_share,
        )
    return plans


def drain_ms(evidence: LoadEvidence) -> float:
    """Milliseconds until the work ahead of a retry drains at protected capacity.

    The work ahead is the backlog already waiting plus the excess of offered over
    protected demand for one window (``(offered - protected) x window_s``): the
    window says that excess is still arriving, and it is served or shed before a
    retry is. Served at protected capacity, not raw: the 30 % reserve is not
    promised to retries. ``inf`` without capacity or readable evidence.
    """
    capacity = evidence.protected_capacity_ms_per_s
    if not (math.isfinite(capacity) and capacity > 0.0):
        return math.inf
    offered = evidence.offered_ms_per_s
    if not (math.isfinite(offered) and offered >= 0.0):
        return math.inf
    excess_ms_per_s = max(0.0, offered - capacity)
    work_ms = evidence.backlog_ms + excess_ms_per_s * evidence.window_s
    if not (math.isfinite(work_ms) and work_ms >= 0.0):
        return math.inf
    return MS_PER_S * work_ms / capacity


def retry_after_ms(evidence: LoadEvidence, config: LadderConfig = DEFAULT_LADDER) -> RetryAfter:
    """Retry guidance from the predicted drain, bounded to the configured [min, max]."""
    low, high = config.retry_after_min_ms, config.retry_after_max_ms
    drain = drain_ms(evidence)
    capacity = evidence.protected_capacity_ms_per_s
    if not (math.isfinite(capacity) and capacity > 0.0):
        horizon = min(max(config.retry_after_no_capacity_ms, low), high)
        reason = (
            f"no protected capacity ({evidence.healthy_devices}/{evidence.configured_devices} devices "
            f"healthy): nothing drains; retry at the health re-check horizon, {horizon} ms"
        )
        return RetryAfter(ms=horizon, drain_ms=drain, reason=reason)
    if not math.isfinite(drain):
        reason = (
            f"offered demand ({evidence.offered_ms_per_s}) or backlog ({evidence.backlog_ms}) "
            f"unreadable: capped at {high} ms"
        )
        return RetryAfter(ms=high, drain_ms=drain, reason=reason)
    excess = max(0.0, evidence.offered_ms_per_s - capacity)
    explained = (
        f"backlog {evidence.backlog_ms:.0f} ms + excess {excess:.0f} ms/s x {evidence.window_s:.1f} s "
        f"drains at protected {capacity:.0f} ms/s in {drain:.0f} ms"
    )
    if drain < low:
        return RetryAfter(ms=low, drain_ms=drain, reason=f"{explained}; raised to the {low} ms floor")
    if drain > high:
        return RetryAfter(ms=high, drain_ms=drain, reason=f"{explained}; capped at {high} ms")
    return RetryAfter(ms=math.ceil(drain), drain_ms=drain, reason=explained)
