"""The overload ladder: offered demand and queue evidence in, a ladder step 0-6 out.

This module owns the ladder's state machine and everything that feeds it: the
sliding windows that turn per-request predictions and observed dwell into a rate
and a percentile, the evidence record, the thresholds, the table of what each
step does, and the retry-after arithmetic. Everything that affects the ladder
step must live here; admission, routing and the scheduler only read
``LadderState.step`` and ``effects(step)``. It never reads a clock and never does
I/O: ``now`` (monotonic seconds) is handed in, as h11 hands in bytes.

The ladder (from the seed, "Overload needs an honest quality policy"); each step
does everything the steps below it do:

    0  normal
    1  stop shadow traffic and optional secondary stages
    2  reduce candidate counts or output limits within declared quality evidence
    3  route eligible classes to a warm validated smaller model
    4  defer asynchronous and batch work
    5  reject new interactive work early with retry guidance
    6  protect already admitted sequences and the control/recovery plane

Rules
-----
1. The step follows *offered* demand: the accelerator-ms predicted for work as it
   arrives, priced on the model it asked for, before any ladder action. A ladder
   fed with the relief it causes (the seed's fallback turns a 121.8 % surge into
   91.0 %) reads its own success as recovery, steps down, turns the relief off and
   oscillates.
2. ``utilization = offered / protected capacity``; protected capacity is healthy
   devices x protected utilization x 1000 ms/s. No capacity (every device lost),
   or offered demand that cannot be read, is infinitely loaded: step 6, never a
   division by zero and never a NaN that compares false into step 0.
3. Climb at once: a step is entered as soon as utilization reaches its threshold,
   skipping steps if needed.
4. Descend slowly: leave step ``s`` only after utilization has stayed below
   ``enter(s) - hysteresis`` (with no floor of rules 5-6 holding it) for
   ``hold_s`` without a break, and only to ``s - 1``; every step change restarts
   the hold, so the ladder descends at most one step per hold period. Sustained,
   not momentary: one quiet reading of a noisy window is not a recovery.
5. Queue evidence can raise the step, never lower it: queue dwell p95 over the
   class's dwell budget means at least step 3.
6. Stale evidence fails safe and is visible: evidence older than
   ``stale_after_s`` means at least step 4 and ``LadderState.stale``.
7. Beyond the fallback, judge what is left: steps 4-6 (defer, reject, protect)
   follow the *effective* utilization, offered demand times the measured relief
   (what admitted work really costs per accelerator-ms of its offered price, < 1
   while the fallback serves part of it). A 1.25x surge that the fallback brings
   back inside the envelope stays at step 3 and sheds nothing; only what the
   fallback cannot absorb is deferred or rejected.

Theory of operation
-------------------
The edge calls ``DemandWindow.add(now, record.demand.accelerator_ms)`` for every
arriving request of a pool and ``DwellWindow.add`` for every dispatch; a
periodic gatherer (the only part that touches Triton) builds ``LoadEvidence``
from the windows, the healthy device count and Triton's pending count, and calls
``OverloadLadder.update(evidence)``. The resulting step goes on every
``RequestRecord.ladder_step`` and into policy; ``effects(step)`` tells the
pipeline what to switch off, reduce, reroute, defer or reject, and
``retry_after_ms(evidence)`` prices the ``retry-after-ms`` of a rejection from
the predicted drain of the backlog, not from a constant.

Thresholds are fractions of *protected* capacity (the seed protects 70 % of each
device), so 1.00 is the planned envelope, not the hardware limit; the hardware
limit is at 1 / 0.70 = 1.43. With the defaults:

    step  enters at  leaves below  the seed's Orchid fleet (24 devices, 16,800 ms/s protected)
    1     0.85       0.77
    2     0.92       0.84          normal load 16,368.8 ms/s = 0.974 sits here
    3     1.00       0.92
    4     1.10       1.02          the 1.25x surge 20,461 ms/s = 1.218 sits here
    5     1.25       1.17
    6     1.40       1.32          offered work beyond the devices' raw time
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

MS_PER_S = 1000.0
# Float seconds subtract with rounding noise (4.1 - 2.1 < 2.0); a hold measured on a
# 100 ms sampling grid must not slip a whole sample for a nanosecond.
_TIME_EPS_S = 1e-9

# The seed protects 70 % of each device-second: the other 30 % absorbs prediction
# error, arrival bursts and one bounded recovery (a retried or re-routed request,
# the loss of a device group while the fallback is proven warm). Admission plans
# only the protected share; the ladder measures load against it.
DEFAULT_PROTECTED_UTILIZATION = 0.70

# Offered demand is noisy even at a steady rate: arrivals are Poisson and the seed's
# long requests (18/s x 467.6 ms) dominate the variance. Over a window of T seconds the
# offered rate has a standard deviation of sqrt(rate x T x E[ms^2]) / T: for the seed's
# mix 937 ms/s (5.6 % of protected capacity) at 5 s, 662 ms/s (3.9 %) at 10 s. The
# steps are 7-15 % apart, so at 5 s the noise alone walks the ladder (measured on a
# simulated Poisson load sitting at 1.00: 3.6 step changes a minute at 5 s, 1.5 at
# 10 s, tests/test_overload.py). 10 s it is; the price is a slower reading of a
# sustained surge (a step from 0.97 to 1.22 reaches the step 4 line after ~5 s instead
# of ~2.6 s), which is why queue dwell, a fast signal over its own shorter window,
# can raise the step on its own (rule 5).
DEFAULT_WINDOW_S = 10.0
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
    """

    __slots__ = ("_counts", "_epochs", "_first", "_sums", "_width_s", "buckets", "window_s")

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, buckets: int = DEFAULT_BUCKETS) -> None:
        if not (math.isfinite(window_s) and window_s > 0.0):
            raise ValueError(f"window_s must be positive (got {window_s})")
        if not 1 <= buckets <= MAX_BUCKETS:
            raise ValueError(f"buckets must be between 1 and {MAX_BUCKETS} (got {buckets})")
        self.window_s = window_s
        self.buckets = buckets
        self._width_s = window_s / buckets
        self._sums = [0.0] * buckets
        self._counts = [0] * buckets
        self._epochs = [-1] * buckets  # absolute bucket number held by each slot; -1: never used
        self._first: int | None = None  # bucket of the first sample ever seen

    def _bucket(self, now: float) -> int:
        if not math.isfinite(now):
            raise ValueError(f"now must be finite (got {now})")
        return math.floor(now / self._width_s)

    def add(self, now: float, accelerator_ms: float) -> None:
        if not (math.isfinite(accelerator_ms) and accelerator_ms >= 0.0):
            raise ValueError(f"accelerator_ms must be finite and at least 0 (got {accelerator_ms})")
        bucket = self._bucket(now)
        slot = bucket % self.buckets
        held = self._epochs[slot]
        if held > bucket:
            return  # the slot already holds a newer bucket: this sample is older than the window
        if held < bucket:
            self._epochs[slot] = bucket
            self._sums[slot] = 0.0
            self._counts[slot] = 0
        self._sums[slot] += accelerator_ms
        self._counts[slot] += 1
        if self._first is None or bucket < self._first:
            self._first = bucket

    def _live(self, now: float) -> tuple[float, int, int]:
        """(sum of ms, count, buckets covered) over the window ending at ``now``."""
        bucket = self._bucket(now)
        oldest = bucket - self.buckets + 1
        total, count = 0.0, 0
        for slot in range(self.buckets):
            if oldest <= self._epochs[slot] <= bucket:
                total += self._sums[slot]
                count += self._counts[slot]
        # A young window divides by its age, but never by less than half the window: one burst
        # in the first 100 ms of a gateway's life is not fifty times its rate.
        floor = max(1, math.ceil(self.buckets * YOUNG_WINDOW_FLOOR))
        covered = (
            self.buckets if self._first is None else max(floor, min(self.buckets, bucket - self._first + 1))
        )
        return total, count, covered

    def total_ms(self, now: float) -> float:
        return self._live(now)[0]

    def count(self, now: float) -> int:
        return self._live(now)[1]

    def rate_ms_per_s(self, now: float) -> float:
        """Offered accelerator-ms per second over the window.

        Divided by the time the window has existed, not its full length, for the
        first ``window_s`` after the first sample: a gateway that just started
        must not read a surge as a fifth of itself (that would fail open).
        """
        total, _, covered = self._live(now)
        return total / (covered * self._width_s)

    def mean_ms(self, now: float) -> float:
        """Mean predicted accelerator-ms per request over the window; 0.0 when empty."""
        total, count, _ = self._live(now)
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
        recent = sorted(self._dwell_ms[i] for i in range(self._size) if since < self._at[i] <= now)
        if not recent:
            return 0.0
        return recent[max(0, math.ceil(q * len(recent)) - 1)]

    def p95_ms(self, now: float) -> float:
        return self.quantile_ms(now, 0.95)


# --------------------------------------------------------------------------- evidence


@dataclass(frozen=True, slots=True)
class LoadEvidence:
    """What the gatherer saw about one pool at ``evidence_at``, judged at ``now``."""

    now: float  # monotonic seconds of this ladder update
    evidence_at: float  # monotonic seconds when the figures below were gathered
    offered_ms_per_s: float  # predicted accelerator-ms arriving per second (DemandWindow)
    protected_capacity_ms_per_s: float  # protected_capacity_ms_per_s(healthy_devices, ...)
    healthy_devices: int
    configured_devices: int
    queue_dwell_p95_ms: float = 0.0  # observed gateway queue dwell, p95 (DwellWindow)
    dwell_budget_ms: float | None = None  # the class's max dwell; None: no dwell evidence applies
    backend_pending: int = 0  # requests Triton reports pending for the pool
    mean_request_ms: float = 0.0  # predicted accelerator-ms per request (DemandWindow.mean_ms)
    queued_accelerator_ms: float = 0.0  # predicted accelerator-ms waiting in the gateway's queues
    window_s: float = DEFAULT_WINDOW_S  # the window offered_ms_per_s was measured over
    # What admitted work actually costs per accelerator-ms of its offered (primary) price over
    # the window: < 1 while the fallback serves part of it. 1.0: no relief (or no evidence).
    relief: float = 1.0

    @property
    def utilization(self) -> float:
        """Offered over protected capacity; ``inf`` without capacity or readable demand (rule 2)."""
        capacity, offered = self.protected_capacity_ms_per_s, self.offered_ms_per_s
        if not (math.isfinite(capacity) and capacity > 0.0):
            return math.inf
        if not (math.isfinite(offered) and offered >= 0.0):
            return math.inf
        return offered / capacity

    @property
    def effective_utilization(self) -> float:
        """Utilization after the fallback's relief: what steps 4-6 are judged by (rule 7)."""
        relief = self.relief if math.isfinite(self.relief) and 0.0 < self.relief <= 1.0 else 1.0
        return self.utilization * relief

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
        """Predicted accelerator-ms already waiting: the gateway's queues plus Triton's pending work."""
        return self.queued_accelerator_ms + max(0, self.backend_pending) * self.mean_request_ms

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


class LadderConfig(BaseModel):
    """Thresholds (fractions of protected capacity) and the timing of the ladder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Step 1 costs no quality (shadow and optional stages return nothing to the
    # caller), so it enters first, while 15 % of the protected envelope is still free.
    shed_optional_at: float = Field(default=0.85, gt=0)
    # Step 2 costs bounded, declared quality; enter when headroom falls under 8 %,
    # about 2 noise-sigma of a 10 s window below the envelope.
    reduce_output_at: float = Field(default=0.92, gt=0)
    # Step 3 at the envelope itself: beyond 1.00 admission would spend the 30 %
    # reserve that exists for errors and recovery; the warm fallback buys it back
    # (the seed's fallback takes a 1.218 surge to 0.910).
    fallback_at: float = Field(default=1.00, gt=0)
    # Step 4 once fallback alone is not keeping up: asynchronous and batch work can
    # wait without missing a deadline, interactive work cannot.
    defer_batch_at: float = Field(default=1.10, gt=0)
    # Step 5 above the seed's 1.25x surge of normal load (1.218): a surge of that size
    # is absorbed by fallback and deferral, as the seed's arithmetic shows, before any
    # interactive caller is refused.
    reject_interactive_at: float = Field(default=1.25, gt=0)
    # Step 6 just below 1 / 0.70 = 1.43, where offered work exceeds the devices' raw
    # time: from there on new work can only be served by starving admitted sequences
    # and recovery, which is what step 6 forbids.
    protect_admitted_at: float = Field(default=1.40, gt=0)

    # Leave a step only below enter - hysteresis: 0.08 is ~2 sigma of the 3.9 %
    # Poisson noise of a 10 s window of the seed's mix, so noise rarely crosses back.
    hysteresis: float = Field(default=0.08, ge=0)
    # Utilization must stay under the leave line this long before each step down: a
    # step's effect (fallback, shorter outputs) shows in the queue only after in-flight
    # work (up to a 467.6 ms long request, behind its queue) finishes, and a sustained
    # 2 s filters single quiet readings; 6 -> 0 takes >= 12 s, more than one window.
    hold_s: float = Field(default=2.0, ge=0)
    # Evidence older than this fails safe: the gatherer refreshes every ~100-500 ms,
    # so 2 s means it or Triton's statistics are stuck.
    stale_after_s: float = Field(default=2.0, gt=0)
    # Stale evidence raises to step 4, not 5: without data the ladder protects
    # itself with the steps that refuse no interactive caller (fallback, deferral);
    # a stuck metrics path must not become an outage.
    stale_step: LadderStep = LadderStep.DEFER_BATCH
    # Dwell p95 over budget raises to step 3: the queue is growing whatever the
    # predictions say (they are optimistic), and step 3 is the first step that
    # removes accelerator work of interactive classes without refusing anyone.
    dwell_step: LadderStep = LadderStep.FALLBACK

    # Retry-after bounds. Below 100 ms a retry arrives before the next evidence
    # refresh and meets the same decision; beyond 30 s the drain is extrapolated
    # far past the demand window, and the caller is better served by its own backoff or
    # a product alternative than by a precise-looking guess.
    retry_after_min_ms: int = Field(default=100, ge=0)
    retry_after_max_ms: int = Field(default=30_000, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        enters = self.thresholds
        for lower, upper in itertools.pairwise(enters):
            if not lower < upper:
                raise ValueError(f"step thresholds must increase strictly (got {list(enters[1:])})")
        if not self.hysteresis < self.shed_optional_at:
            raise ValueError(
                f"hysteresis ({self.hysteresis}) must be below the step 1 threshold "
                f"({self.shed_optional_at}), or step 0 could never be reached again"
            )
        if self.retry_after_min_ms > self.retry_after_max_ms:
            raise ValueError(
                f"retry_after_min_ms ({self.retry_after_min_ms}) exceeds "
                f"retry_after_max_ms ({self.retry_after_max_ms})"
            )
        return self

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


def _judged(step: LadderStep, utilization: float, effective: float) -> float:
    """The utilization a step is left by: offered for steps 1-3, after relief for 4-6."""
    return utilization if step <= LadderStep.FALLBACK else effective


def next_state(
    previous: LadderState, evidence: LoadEvidence, config: LadderConfig = DEFAULT_LADDER
) -> LadderState:
    """The ladder's transition function: the whole state machine, pure."""
    utilization = evidence.utilization
    effective = evidence.effective_utilization
    # Rule 7: steps 1-3 follow offered demand; the steps beyond the fallback (4-6) follow
    # the demand that remains once the fallback serves what it may.
    target = config.step_for(utilization)
    if target > LadderStep.FALLBACK:
        target = max(LadderStep.FALLBACK, config.step_for(effective))
    notes = [evidence.describe()]
    if effective < utilization:
        notes.append(f"after fallback relief x{evidence.relief:.2f}: {effective * 100:.1f}%")
    if evidence.dwell_over_budget:
        notes.append(
            f"queue dwell p95 {evidence.queue_dwell_p95_ms:.0f} ms over budget "
            f"{evidence.dwell_budget_ms:.0f} ms: at least step {config.dwell_step}"
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
    if target > current:
        step = target
        notes.append(f"climb {current} -> {step}")
    elif target < current and not _judged(current, utilization, effective) < config.leaves_below(current):
        notes.append(f"hold step {current}: leaves below {config.leaves_below(current) * 100:.1f}%")
    elif target < current:
        calm_since = now if previous.calm_since is None else previous.calm_since
        if now - calm_since + _TIME_EPS_S < config.hold_s:
            notes.append(f"hold step {current} for {config.hold_s - (now - calm_since):.1f} s more")
        else:
            step = LadderStep(current - 1)
            notes.append(f"descend {current} -> {step}")
            # The calm that earned this step down counts toward the next one only from now:
            # one step per hold period.
            calm_since = (
                now
                if target < step and _judged(step, utilization, effective) < config.leaves_below(step)
                else None
            )
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
    """Sheds the excess, not everything: of the work arriving while the ladder is at step 5+,
    admit the fraction ``target / offered`` (the protected envelope over offered demand) and
    pick the rest as shed, deterministically with a credit accumulator (no randomness, no
    bursts of refusals). A 1.25x surge thus sheds about a fifth of new online work; with no
    capacity everything is shed. Pure: the caller passes the rates in.
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
        reason = (
            f"no protected capacity ({evidence.healthy_devices}/{evidence.configured_devices} devices "
            f"healthy): nothing drains, capped at {high} ms"
        )
        return RetryAfter(ms=high, drain_ms=drain, reason=reason)
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
