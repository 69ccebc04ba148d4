"""Rollouts: a version change as data, and the state machine that rehearses it.

This module owns what a rollout is, as plain values (``RolloutSpec``: the route, its current
and candidate backend model versions, the warm-up shapes and the output checks a candidate
must pass before it is ready, the steps, the guardrails and their analysis interval, the
drain bound; the file schema of ``rollouts/*.yaml`` that builds them is
``gateway.settings.RolloutSchema``) and ``Rollout``, the pure state machine that runs one:

    pending -> loading -> warming -> shadow / canary steps -> promoted -> complete
                  |           |              |
                  +-----------+--------------+--> rolled_back   (a guardrail, an
                                                                allocation failure,
                                                                an operator)

* **Readiness**: a candidate serves nothing until every declared warm-up shape has run
  through it with its outputs valid (``warmed``); a load or warm-up failure rolls back.
* **Cohorts**: a canary step diverts only requests whose class, shape bucket, tenant and
  risk class match one of its cohorts, and of those a ``weight`` share, counted
  deterministically (``Selector``): by request class and shape, never by count alone.
* **Guardrails**: every ``analysis.interval_s`` the samples of both versions in that
  interval are compared (``guardrail_value``), over the whole interval and over each shape
  bucket with enough samples (the worst counts); a guardrail over its ``max`` for
  ``failures`` consecutive conclusive intervals rolls back at once. A step advances after
  ``intervals`` conclusive intervals that all pass, once no canary dispatched before the
  last of them is still without an outcome; ``promote`` ends the steps.
* **Failing samples**: an error, a timeout (``Sample.timed_out``: the candidate ran out of
  its budget) and an invalid output all count against the candidate, in their bucket.
* **Hedge**: a canary's budget (``hedge_budget_ms``) leaves the current version time to
  answer; the runtime answers a late, failed or invalid canary from the current version
  and reports the device time the candidate held (``hedge``) as the rollout's cost.
* **Drain**: after promotion (and after a rollback) the retired version is unloaded only
  once its in-flight and queued work is gone; the time until then is reported.

Nothing here reads a clock or does I/O: every transition takes ``now`` (seconds on the
caller's monotonic clock) and the runtime (``gateway.rollouts``) acts on the phase.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from gateway.core.outputs import OutputCheck as OutputCheck  # the one output contract

CANARY_REASON = "canary"
# The route reason of an answer the current version gave after the candidate chosen for it
# timed out inside its budget, failed, or answered outside the declared outputs.
HEDGE_REASON = "canary_hedge"

Bucket = Literal["short", "long"]
Metric = Literal[
    "first_result_p95_ratio",
    "completion_p95_ratio",
    "deadline_miss_rate_delta",
    "error_rate_delta",
    "fallback_rate",
    "invalid_output_rate",
    "memory_high_water",
    "quality_score_drop",
]
# Metrics compared against the current version in the same interval (a ratio or a difference).
PAIRED_METRICS = frozenset(
    {"first_result_p95_ratio", "completion_p95_ratio", "deadline_miss_rate_delta", "error_rate_delta"}
)


# --------------------------------------------------------------------------- the rollout, as values
# Built once by ``gateway.settings.RolloutSchema`` from a validated rollout file: every bound
# and consistency check (and its message) is the schema's.


@dataclass(frozen=True, slots=True)
class VersionRef:
    """One version of the route's model: the backend model, the version Triton reports for it
    (its manifest identity: the repository index must list this version READY), and the
    label provenance stamps (``orchid.model_version``)."""

    backend_model: str
    version: str  # Triton's model version
    label: str = ""  # provenance version label; empty: the version
    profile: str = ""  # demand profile (routes); empty: the route's

    @property
    def name(self) -> str:
        return self.label or self.version


@dataclass(frozen=True, slots=True)
class WarmupShape:
    """One shape a candidate must serve, outputs valid, before it takes any traffic."""

    bucket: Bucket
    input_tokens: int
    output_tokens: int
    items: int = 1
    repeat: int = 1  # how many times it is sent


@dataclass(frozen=True, slots=True)
class Warmup:
    shapes: tuple[WarmupShape, ...]
    # Checked with the route's own ``outputs`` contract (these add to it, or override an
    # output it names): a rollout of a route that declares none must declare some.
    outputs: dict[str, OutputCheck] = field(default_factory=dict)  # output name -> its checks
    timeout_s: float = 30.0  # bound of each warm-up request


@dataclass(frozen=True, slots=True)
class Cohort:
    """Requests a step may divert: every listed field must match (an empty list: any)."""

    classes: tuple[str, ...] = ()
    buckets: tuple[Bucket, ...] = ()
    tenants: tuple[str, ...] = ()
    risk_classes: tuple[str, ...] = ()

    def matches(self, facts: RequestFacts) -> bool:
        return (
            (not self.classes or facts.request_class in self.classes)
            and (not self.buckets or facts.bucket in self.buckets)
            and (not self.tenants or facts.tenant in self.tenants)
            and (not self.risk_classes or facts.risk_class in self.risk_classes)
        )


@dataclass(frozen=True, slots=True)
class Step:
    """``shadow``: mirror ``weight`` of the matching requests to the candidate (answers
    discarded); ``canary``: serve ``weight`` of them from it; ``promote``: the candidate
    serves the route. A step holds for ``intervals`` passing analysis intervals."""

    kind: Literal["shadow", "canary", "promote"]
    cohorts: tuple[Cohort, ...] = ()
    weight: float = 1.0
    intervals: int = 1

    def matches(self, facts: RequestFacts) -> bool:
        return any(cohort.matches(facts) for cohort in self.cohorts)


@dataclass(frozen=True, slots=True)
class Analysis:
    interval_s: float  # length of one analysis interval
    min_samples: int = 5  # per version; fewer: inconclusive


@dataclass(frozen=True, slots=True)
class Guardrail:
    """Roll back when ``metric`` exceeds ``max`` in ``failures`` consecutive conclusive intervals."""

    metric: Metric
    max: float
    failures: int = 1


@dataclass(frozen=True, slots=True)
class Drain:
    max_wait_s: float = 60.0  # the retired version is left loaded if still busy after this


@dataclass(frozen=True, slots=True)
class MemoryCheck:
    """Both versions resident on each device must leave room for ``min_live_tokens`` of the
    current version's live state; otherwise the rollout is refused before anything loads."""

    min_live_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Hedge:
    """A canary's budget leaves the current version time to answer (``hedge_budget_ms``):
    the candidate gets the time by which the current version, re-admitted, would still meet
    the caller's deadline with its own reserves, less ``reserve_ms``: the re-admission and
    the answer's way back, and the variance of the current version's own prediction."""

    reserve_ms: float = 25.0  # margin left beside the current version


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    name: str
    route: str  # the logical model whose version changes
    current: VersionRef
    candidate: VersionRef
    warmup: Warmup
    steps: tuple[Step, ...]
    analysis: Analysis
    guardrails: tuple[Guardrail, ...]
    drain: Drain = Drain()
    memory: MemoryCheck = MemoryCheck()
    hedge: Hedge = Hedge()


# --------------------------------------------------------------------------- facts and samples


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What cohort matching reads of one request."""

    request_class: str
    bucket: str
    tenant: str
    risk_class: str


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request of one version (the candidate: canary or shadow).

    A candidate that timed out (its budget, or the caller's deadline, passed) or was
    cancelled past its budget is a failing sample like an error: ``timed_out``, its latency
    the time it was given (a lower bound, and it counts in the latency percentiles). It is
    counted in its cohort's shape ``bucket``, so a regression confined to one bucket shows
    there (``Rollout._close`` judges every bucket with enough samples as well as the whole)."""

    first_result_ms: float
    completion_ms: float
    missed_deadline: bool = False
    error: bool = False
    invalid_output: bool = False
    fell_back: bool = False  # chosen for the candidate, answered by the current version
    timed_out: bool = False
    bucket: str = ""

    @property
    def failed(self) -> bool:
        return self.error or self.timed_out

    @property
    def late(self) -> bool:
        return self.missed_deadline or self.timed_out


class Phase(StrEnum):
    PENDING = "pending"
    LOADING = "loading"
    WARMING = "warming"
    SHADOW = "shadow"
    CANARY = "canary"
    PROMOTED = "promoted"  # the candidate serves; the old version drains
    COMPLETE = "complete"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"


ACTIVE = frozenset({Phase.LOADING, Phase.WARMING, Phase.SHADOW, Phase.CANARY, Phase.PROMOTED})


def p95(values: Sequence[float]) -> float:
    """Nearest-rank 95th percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def hedge_budget_ms(current_slack_ms: float, candidate_exec_ms: float, reserve_ms: float) -> float | None:
    """How long a canary may run (ms from now) and still leave the current version time to
    answer: the current version's slack as priced now (deadline less elapsed, its upstream,
    execution and variance reserves and its predicted queue wait) less ``reserve_ms``.
    ``None`` when the candidate's own predicted execution does not fit inside that budget:
    the request is not sent to the candidate at all."""
    budget = current_slack_ms - reserve_ms
    if budget <= 0.0 or candidate_exec_ms > budget:
        return None
    return budget


def _rate(samples: Sequence[Sample], attribute: str) -> float:
    return sum(1 for s in samples if getattr(s, attribute)) / len(samples) if samples else 0.0


def guardrail_value(
    metric: Metric,
    candidate: Sequence[Sample],
    current: Sequence[Sample],
    memory_high_water: float,
    quality_drop: float = 0.0,
) -> float:
    """The metric over one interval's samples (the caller checks there are enough).
    ``memory_high_water`` and ``quality_drop`` are the runtime's latest readings."""
    # Latency percentiles leave out errors (no latency to speak of) but keep timeouts: a
    # timed-out sample's latency is the time it was given, a lower bound of its own.
    if metric == "first_result_p95_ratio":
        base = p95([s.first_result_ms for s in current if not s.error])
        return p95([s.first_result_ms for s in candidate if not s.error]) / max(base, 1e-9)
    if metric == "completion_p95_ratio":
        base = p95([s.completion_ms for s in current if not s.error])
        return p95([s.completion_ms for s in candidate if not s.error]) / max(base, 1e-9)
    if metric == "deadline_miss_rate_delta":
        return _rate(candidate, "late") - _rate(current, "late")
    if metric == "error_rate_delta":
        return _rate(candidate, "failed") - _rate(current, "failed")
    if metric == "fallback_rate":
        return _rate(candidate, "fell_back")
    if metric == "invalid_output_rate":
        return _rate(candidate, "invalid_output")
    if metric == "quality_score_drop":
        return quality_drop
    return memory_high_water


@dataclass(frozen=True, slots=True)
class IntervalResult:
    """One closed analysis interval."""

    started_at: float
    ended_at: float
    step: int
    candidate_samples: int
    current_samples: int
    values: dict[str, float]  # metric -> value (conclusive intervals only): the worst of
    # the whole interval's and each conclusive bucket's
    failed: tuple[str, ...]  # metrics over their max
    conclusive: bool
    by_bucket: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> metric -> value
    worst_bucket: dict[str, str] = field(default_factory=dict)  # metric -> bucket that set its value


class Selector:
    """Exactly ``weight`` of the matching requests, spread evenly, without randomness: the
    n-th match is chosen when ``floor(n * weight)`` steps up (a Bresenham walk)."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.seen = 0

    def take(self) -> bool:
        before = math.floor(self.seen * self.weight + 1e-9)
        self.seen += 1
        return math.floor(self.seen * self.weight + 1e-9) > before


@dataclass
class Rollout:
    """One rollout's state. Every method takes ``now``; none reads a clock."""

    spec: RolloutSpec
    phase: Phase = Phase.PENDING
    step: int = -1
    reason: str = ""
    timeline: list[tuple[float, str]] = field(default_factory=list)
    intervals: list[IntervalResult] = field(default_factory=list)
    started_at: float | None = None
    loaded_at: float | None = None
    ready_at: float | None = None
    promoted_at: float | None = None
    rolled_back_at: float | None = None
    retired_drained_at: float | None = None  # the retired version had no work left
    retired_unloaded_at: float | None = None
    unload_s: float | None = None  # how long Triton took to unload the retired version
    memory_high_water: float = 0.0  # peak fraction of the candidate's live room in use
    # Why the candidate may not take the whole route on its own (e.g. fewer devices than the
    # current version): the steps then stop before ``promote``; an operator may still promote.
    promotion_hold: str = ""
    # The current version's quality-evidence score minus the candidate's (its published
    # evaluation; missing or expired counts as 0): the runtime reads it from the evidence store.
    quality_drop: float = 0.0
    _interval_start: float = 0.0
    _candidate: list[Sample] = field(default_factory=list)
    _current: list[Sample] = field(default_factory=list)
    _failing: dict[str, int] = field(default_factory=dict)
    _passed: int = 0
    _selector: Selector | None = None
    diverted: int = 0
    shadowed: int = 0
    # The hedge (``hedge_budget_ms``): canaries answered again by the current version, why
    # (timeout, error, invalid_output), and the device time their candidate attempts held.
    # That time is the rollout's cost, never the tenant's (the runtime refunds its quota).
    hedged: dict[str, int] = field(default_factory=dict)
    hedge_device_ms: float = 0.0
    hedge_unanswered: int = 0  # hedged canaries the current version did not answer either
    # When the oldest canary still without an outcome was dispatched (the runtime's reading
    # at each ``tick``): a step does not advance on intervals whose canaries are unsettled.
    _oldest_pending: float | None = None
    _passed_until: float | None = None  # end of the interval that completed the step's passes

    # ------------------------------------------------------------------ transitions

    def _log(self, now: float, text: str) -> None:
        self.timeline.append((now, text))

    def start(self, now: float) -> None:
        if self.phase is not Phase.PENDING:
            raise ValueError(f"rollout {self.spec.name!r} already started ({self.phase})")
        self.phase, self.started_at = Phase.LOADING, now
        self._log(now, f"load {self.spec.candidate.backend_model} version {self.spec.candidate.version}")

    def loaded(self, now: float) -> None:
        if self.phase is Phase.LOADING:
            self.phase, self.loaded_at = Phase.WARMING, now
            self._log(now, f"loaded; warming {sum(s.repeat for s in self.spec.warmup.shapes)} requests")

    def warmed(self, now: float, problems: Sequence[str]) -> None:
        """The warm-up finished; ``problems`` are the outputs that failed their checks."""
        if self.phase is not Phase.WARMING:
            return
        if problems:
            self.roll_back(
                now,
                f"warm-up failed: {problems[0]}" + (f" (+{len(problems) - 1})" if len(problems) > 1 else ""),
            )
            return
        self.ready_at = now
        self._log(now, "warm-up passed: candidate ready")
        self._enter_step(now, 0)

    def load_failed(self, now: float, problem: str) -> None:
        if self.phase in (Phase.LOADING, Phase.WARMING):
            self.roll_back(now, f"load failed: {problem}")

    def _enter_step(self, now: float, index: int) -> None:
        self.step = index
        step = self.spec.steps[index]
        self._interval_start = now
        self._candidate, self._current = [], []
        self._failing.clear()
        self._passed = 0
        self._passed_until = None
        self._selector = Selector(step.weight)
        if step.kind == "promote":
            if self.promotion_hold:
                self.step = index - 1
                self._log(now, f"promotion held: {self.promotion_hold}")
                self._selector = Selector(self.spec.steps[index - 1].weight)
                self._passed = -(10**9)  # the last step holds until an operator decides
                return
            self.promote(now, "all steps passed")
            return
        self.phase = Phase.SHADOW if step.kind == "shadow" else Phase.CANARY
        self._log(
            now, f"step {index + 1}/{len(self.spec.steps)}: {step.kind} {step.weight:.0%} of {_cohorts(step)}"
        )

    def resumed(self, now: float, phase: Phase, step: int, why: str = "after a gateway restart") -> None:
        """A rollout a restarted gateway found in its state (``phase`` and ``step`` as last
        saved): a shadow or canary step starts again with fresh intervals (the runtime has
        checked the candidate is still loaded and warm first); a promoted or complete one
        serves the candidate. Anything earlier starts over from the load."""
        if self.phase is not Phase.PENDING:
            raise ValueError(f"rollout {self.spec.name!r} already started ({self.phase})")
        self.started_at = now
        if phase in (Phase.SHADOW, Phase.CANARY) and 0 <= step < len(self.spec.steps):
            self.phase, self.loaded_at, self.ready_at = Phase.WARMING, now, now
            self._log(now, f"resumed {why} at step {step + 1}/{len(self.spec.steps)}")
            self._enter_step(now, step)
        elif phase in (Phase.PROMOTED, Phase.COMPLETE):
            self.phase, self.promoted_at, self.step = phase, now, len(self.spec.steps) - 1
            self._log(now, f"resumed {why}: {self.spec.candidate.name} serves {self.spec.route}")
        else:
            self.start(now)

    def follow(self, now: float, phase: Phase, step: int) -> None:
        """Mirror the phase and step of the replica that owns this rollout (a fleet): routing
        (``divert``, ``serving``) follows them; the analysis is the owner's, not run here."""
        if (phase, step) == (self.phase, self.step):
            return
        if self.started_at is None:
            self.started_at = now
        self._log(now, f"following the owner: {phase}, step {step + 1}/{len(self.spec.steps)}")
        self.phase, self.step = phase, step
        if phase in (Phase.SHADOW, Phase.CANARY) and 0 <= step < len(self.spec.steps):
            self._selector = Selector(self.spec.steps[step].weight)
        if phase in (Phase.PROMOTED, Phase.COMPLETE) and self.promoted_at is None:
            self.promoted_at = now
        if phase in (Phase.ROLLED_BACK, Phase.ABORTED) and self.rolled_back_at is None:
            self.rolled_back_at = now

    def promote(self, now: float, why: str = "operator") -> None:
        if self.phase not in (Phase.SHADOW, Phase.CANARY):
            raise ValueError(f"rollout {self.spec.name!r} cannot be promoted while {self.phase}")
        self.phase, self.promoted_at = Phase.PROMOTED, now
        self._log(now, f"promoted ({why}): {self.spec.candidate.name} serves {self.spec.route}")

    def roll_back(self, now: float, reason: str) -> None:
        """Route back to the current version at once."""
        if self.phase not in ACTIVE or self.phase is Phase.PROMOTED:
            raise ValueError(f"rollout {self.spec.name!r} cannot be rolled back while {self.phase}")
        self.phase, self.reason, self.rolled_back_at = Phase.ROLLED_BACK, reason, now
        self._log(now, f"rolled back: {reason}")

    def abort(self, now: float) -> None:
        if self.phase not in ACTIVE:
            raise ValueError(f"rollout {self.spec.name!r} is not running ({self.phase})")
        if self.phase is Phase.PROMOTED:
            raise ValueError("a promoted rollout cannot be aborted: start a rollout back to the old version")
        self.phase, self.reason, self.rolled_back_at = Phase.ABORTED, "aborted by an operator", now
        self._log(now, "aborted by an operator: routed back")

    def retired_drained(self, now: float) -> None:
        """The retired version (old after promotion, candidate after a rollback) has no work."""
        if self.retired_drained_at is None:
            self.retired_drained_at = now
            since = self.promoted_at if self.phase is Phase.PROMOTED else self.rolled_back_at
            self._log(now, f"retired version drained {now - (since or now):.3f} s after the switch")

    def retired_unloaded(self, now: float, unload_s: float) -> None:
        self.retired_unloaded_at, self.unload_s = now, unload_s
        self._log(now, f"retired version unloaded ({unload_s:.3f} s)")
        if self.phase is Phase.PROMOTED:
            self.phase = Phase.COMPLETE

    # ------------------------------------------------------------------ routing

    @property
    def serving(self) -> bool:
        """The candidate serves the whole route (promoted or complete)."""
        return self.phase in (Phase.PROMOTED, Phase.COMPLETE)

    def divert(self, facts: RequestFacts) -> bool:
        """Whether this request of the route is a canary (counts it for the weight)."""
        if self.phase is not Phase.CANARY or self._selector is None:
            return False
        if not self.spec.steps[self.step].matches(facts):
            return False
        return self._selector.take()

    def shadow(self, facts: RequestFacts) -> bool:
        """Whether this admitted request is mirrored to the candidate (shadow step)."""
        if self.phase is not Phase.SHADOW or self._selector is None:
            return False
        if not self.spec.steps[self.step].matches(facts):
            return False
        return self._selector.take()

    def in_cohort(self, facts: RequestFacts) -> bool:
        """A request the current step compares against (its cohorts)."""
        return self.phase in (Phase.SHADOW, Phase.CANARY) and self.spec.steps[self.step].matches(facts)

    # ------------------------------------------------------------------ analysis

    def observe(self, candidate: bool, sample: Sample) -> None:
        if self.phase not in (Phase.SHADOW, Phase.CANARY):
            return
        (self._candidate if candidate else self._current).append(sample)

    def hedge(self, why: str, device_ms: float) -> None:
        """A canary answered again by the current version; ``device_ms`` the candidate held."""
        self.hedged[why] = self.hedged.get(why, 0) + 1
        self.hedge_device_ms += max(0.0, device_ms)

    def observe_memory(self, fraction: float) -> None:
        self.memory_high_water = max(self.memory_high_water, fraction)

    def tick(self, now: float, oldest_pending: float | None = None) -> None:
        """Close every analysis interval that ended by ``now``; roll back or advance. A
        transition is stamped ``now``: the moment routing changes, not the interval's end.
        ``oldest_pending``: when the oldest canary still in flight was dispatched. A step
        advances only once every canary dispatched before the end of its last passing
        interval has an outcome (a slow canary is judged before the step moves on, never
        after); a failure rolls back at once, whatever is pending."""
        self._oldest_pending = oldest_pending
        interval = self.spec.analysis.interval_s
        while self.phase in (Phase.SHADOW, Phase.CANARY) and now >= self._interval_start + interval:
            end = self._interval_start + interval
            step = self.step
            self._close(end, now)
            if self.phase in (Phase.SHADOW, Phase.CANARY) and self.step == step:
                self._interval_start = end
                self._candidate, self._current = [], []
        self._advance(now)  # a step held for a pending canary moves on as soon as it settles

    def _judge(
        self, cand: Sequence[Sample], cur: Sequence[Sample]
    ) -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, str]]:
        """Every guardrail's value over the whole interval, and over each shape bucket with
        enough samples (both versions' for a paired metric); a metric's value is the worst."""
        spec = self.spec
        least = spec.analysis.min_samples
        values: dict[str, float] = {}
        worst: dict[str, str] = {}
        for guard in spec.guardrails:
            values[guard.metric] = guardrail_value(
                guard.metric, cand, cur, self.memory_high_water, self.quality_drop
            )
        by_bucket: dict[str, dict[str, float]] = {}
        for bucket in sorted({s.bucket for s in cand if s.bucket}):
            cand_b = [s for s in cand if s.bucket == bucket]
            cur_b = [s for s in cur if s.bucket == bucket]
            if len(cand_b) < least:
                continue
            for guard in spec.guardrails:
                if guard.metric in ("memory_high_water", "quality_score_drop"):
                    continue  # readings of the version, not of its answers
                if guard.metric in PAIRED_METRICS and len(cur_b) < least:
                    continue
                value = guardrail_value(guard.metric, cand_b, cur_b, 0.0)
                by_bucket.setdefault(bucket, {})[guard.metric] = value
                if value > values[guard.metric]:
                    values[guard.metric], worst[guard.metric] = value, bucket
        return values, by_bucket, worst

    def _close(self, end: float, now: float) -> None:
        spec = self.spec
        cand, cur = self._candidate, self._current
        enough = len(cand) >= spec.analysis.min_samples
        paired_needed = any(g.metric in PAIRED_METRICS for g in spec.guardrails)
        if paired_needed and len(cur) < spec.analysis.min_samples:
            enough = False
        values: dict[str, float] = {}
        by_bucket: dict[str, dict[str, float]] = {}
        worst: dict[str, str] = {}
        failed: list[str] = []
        if enough:
            values, by_bucket, worst = self._judge(cand, cur)
            for guard in spec.guardrails:
                if values[guard.metric] > guard.max:
                    failed.append(guard.metric)
                    self._failing[guard.metric] = self._failing.get(guard.metric, 0) + 1
                else:
                    self._failing[guard.metric] = 0
        self.intervals.append(
            IntervalResult(
                self._interval_start,
                end,
                self.step,
                len(cand),
                len(cur),
                values,
                tuple(failed),
                enough,
                by_bucket,
                worst,
            )
        )
        for guard in spec.guardrails:
            if self._failing.get(guard.metric, 0) >= guard.failures:
                value = values[guard.metric]
                bucket = worst.get(guard.metric)
                if bucket is not None:
                    detail = f" in the {bucket} bucket" + _detail(
                        guard.metric,
                        [s for s in cand if s.bucket == bucket],
                        [s for s in cur if s.bucket == bucket],
                    )
                else:
                    detail = _detail(guard.metric, cand, cur)
                self.roll_back(
                    now,
                    f"guardrail {guard.metric} = {value:.3f} > {guard.max:g} in {guard.failures} "
                    f"consecutive interval(s) of {spec.analysis.interval_s:g} s{detail}",
                )
                return
        if enough and not failed:
            self._passed += 1
            if self._passed >= spec.steps[self.step].intervals:
                self._passed_until = end
        self._advance(now)

    def _advance(self, now: float) -> None:
        """Enter the next step once the step's intervals passed and no canary dispatched
        before the end of the last of them is still without an outcome."""
        if self._passed_until is None or self.phase not in (Phase.SHADOW, Phase.CANARY):
            return
        if self._oldest_pending is not None and self._oldest_pending < self._passed_until:
            return
        self._enter_step(now, self.step + 1)

    # ------------------------------------------------------------------ report

    def report(self) -> dict[str, object]:
        spec = self.spec
        since = self.started_at or 0.0

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - since, 3)

        retired_since = self.promoted_at if self.promoted_at is not None else self.rolled_back_at
        return {
            "name": spec.name,
            "route": spec.route,
            "current": f"{spec.current.backend_model}:{spec.current.version} ({spec.current.name})",
            "candidate": f"{spec.candidate.backend_model}:{spec.candidate.version} ({spec.candidate.name})",
            "phase": str(self.phase),
            "step": self.step + 1 if self.step >= 0 else 0,
            "steps": len(spec.steps),
            "reason": self.reason,
            "promotion_hold": self.promotion_hold,
            "load_s": None if self.loaded_at is None else round(self.loaded_at - since, 3),
            "warm_s": None
            if self.ready_at is None or self.loaded_at is None
            else round(self.ready_at - self.loaded_at, 3),
            "ready_at_s": rel(self.ready_at),
            "promoted_at_s": rel(self.promoted_at),
            "rolled_back_at_s": rel(self.rolled_back_at),
            # Both versions stay resident until the retired one drains (the runtime refuses a
            # rollout whose two versions do not fit), so routing back takes no load: 0 s. Loading
            # the candidate again (after its unload) would take its measured load and warm-up.
            "rewarm_s": None if self.ready_at is None else round(self.ready_at - since, 3),
            "retired_drain_s": None
            if self.retired_drained_at is None or retired_since is None
            else round(self.retired_drained_at - retired_since, 3),
            "safe_to_remove_after_s": None
            if self.retired_drained_at is None or retired_since is None
            else round(self.retired_drained_at - retired_since, 3),
            "unload_s": None if self.unload_s is None else round(self.unload_s, 3),
            "memory_high_water": round(self.memory_high_water, 4),
            "diverted": self.diverted,
            "shadowed": self.shadowed,
            "hedged": dict(self.hedged),
            "hedge_device_ms": round(self.hedge_device_ms, 3),
            "hedge_unanswered": self.hedge_unanswered,
            "intervals": [
                {
                    "at_s": round(i.ended_at - since, 3),
                    "step": i.step + 1,
                    "candidate_samples": i.candidate_samples,
                    "current_samples": i.current_samples,
                    "conclusive": i.conclusive,
                    "values": {k: round(v, 4) for k, v in i.values.items()},
                    "by_bucket": {b: {k: round(v, 4) for k, v in m.items()} for b, m in i.by_bucket.items()},
                    "failed": list(i.failed),
                }
                for i in self.intervals
            ],
            "timeline": [[round(t - since, 3), text] for t, text in self.timeline],
        }


def _cohorts(step: Step) -> str:
    parts = []
    for cohort in step.cohorts:
        fields = [
            f"{name}={'|'.join(values)}"
            for name, values in (
                ("class", cohort.classes),
                ("bucket", cohort.buckets),
                ("tenant", cohort.tenants),
                ("risk", cohort.risk_classes),
            )
            if values
        ]
        parts.append("{" + " ".join(fields) + "}")
    return ", ".join(parts)


def _detail(metric: str, cand: Sequence[Sample], cur: Sequence[Sample]) -> str:
    if metric == "completion_p95_ratio":
        return (
            f" (candidate p95 {p95([s.completion_ms for s in cand]):.1f} ms vs current "
            f"{p95([s.completion_ms for s in cur]):.1f} ms, {len(cand)}/{len(cur)} samples)"
        )
    if metric == "first_result_p95_ratio":
        return (
            f" (candidate p95 {p95([s.first_result_ms for s in cand]):.1f} ms vs current "
            f"{p95([s.first_result_ms for s in cur]):.1f} ms, {len(cand)}/{len(cur)} samples)"
        )
    failed = sum(1 for s in cand if s.failed)
    timed_out = sum(1 for s in cand if s.timed_out)
    return (
        f" ({len(cand)} candidate / {len(cur)} current samples; candidate: {failed} failed, "
        f"{timed_out} of them timed out)"
    )
