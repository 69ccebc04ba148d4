"""Stream objectives, and the tracker that measures a stream's results against them.

A stream (``Mode.STREAMING``, ModelStreamInfer) is promised three things, each in
milliseconds (``StreamObjectives``):

* **first result**: the first result arrives within ``first_result_ms`` of the request's
  arrival at the gateway (the class's ``first_result_ms``, or the caller's
  ``orchid.first_result_ms``; default, and never more than, the completion deadline);
* **gap**: no two consecutive results are more than ``gap_ms`` apart (the class's
  ``gap_ms``, or the caller's ``orchid.gap_ms``; ``None``: no gap objective);
* **completion**: the last result within ``completion_ms`` of arrival: the call's deadline,
  or the class's default deadline, exactly as for unary work.

Admission judges a new stream by its first result (``gateway.core.pricing``: the record's
slack and latest start are the first result's), so a stream whose first result cannot
arrive in time is refused before it runs.

``GapTracker`` is fed the arrival times of a stream's results (``now`` handed in, seconds
on the caller's clock, like everything in the core) and keeps quantile-free summaries: the
first result's latency, the result count, the largest and mean gap, how many gaps were over
the objective, and whether each objective was met. Its API, for the stream code:

    tracker = GapTracker(received_at, objectives_of(record.budget))  # at its arrival
    gap_ms = tracker.result(now)   # per result: the gap before it in ms (None: the first)
    summary = tracker.finish(now)  # once: at the final response, a failure or a cancel
    tracker.summary(now)           # the figures so far, at any time (cheap)

A ``StreamSummary`` is what provenance (``gateway.messages``), the metrics and the status
page (``GatewayListener.stream_settled``) and the simulator read.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.core.errors import InvalidArgument
from gateway.core.record import Budget

# Gaps kept individually per stream, for the gap histogram (the summaries count them all).
MAX_KEPT_GAPS = 1024


@dataclass(frozen=True, slots=True)
class StreamObjectives:
    """What a stream is promised, in milliseconds after its arrival (gap: between results)."""

    first_result_ms: float
    completion_ms: float
    gap_ms: float | None = None  # None: no gap objective


def objectives_of(budget: Budget) -> StreamObjectives:
    """The objectives a stream was priced with (``gateway.core.pricing``): for its tracker."""
    first = budget.first_result_deadline_ms
    return StreamObjectives(
        first_result_ms=first if first is not None else budget.deadline_ms,
        completion_ms=budget.deadline_ms,
        gap_ms=budget.gap_objective_ms,
    )


def stream_objectives(
    *,
    deadline_ms: float,
    max_deadline_ms: float,
    class_first_result_ms: float | None = None,
    class_gap_ms: float | None = None,
    requested_first_result_ms: float | None = None,
    requested_gap_ms: float | None = None,
) -> StreamObjectives:
    """A stream's objectives: the caller's (``orchid.first_result_ms``, ``orchid.gap_ms``) over
    its class's, the first result never later than the completion deadline ``deadline_ms``.
    A requested value above the class's ``max_deadline_ms`` is INVALID_ARGUMENT."""
    for name, value in (
        ("orchid.first_result_ms", requested_first_result_ms),
        ("orchid.gap_ms", requested_gap_ms),
    ):
        if value is not None and value > max_deadline_ms:
            raise InvalidArgument(
                f"parameter {name} must be at most the class's max deadline of {max_deadline_ms:g} ms, "
                f"got {value:g}"
            )
    first = requested_first_result_ms if requested_first_result_ms is not None else class_first_result_ms
    gap = requested_gap_ms if requested_gap_ms is not None else class_gap_ms
    return StreamObjectives(
        first_result_ms=min(first, deadline_ms) if first is not None else deadline_ms,
        completion_ms=deadline_ms,
        gap_ms=gap,
    )


@dataclass(frozen=True, slots=True)
class StreamSummary:
    """One stream's results against its objectives (all ms; latencies from its arrival)."""

    objectives: StreamObjectives
    results: int  # results that arrived
    first_result_ms: float | None  # arrival to the first result (None: none arrived)
    last_result_ms: float | None  # arrival to the latest result
    max_gap_ms: float  # 0.0 with fewer than two results
    mean_gap_ms: float  # 0.0 with fewer than two results
    gaps_over_objective: int  # gaps longer than the gap objective (0 without one)
    elapsed_ms: float  # arrival to the time the summary was taken (its end, when finished)
    finished: bool = False
    gaps_ms: tuple[float, ...] = ()  # the first MAX_KEPT_GAPS gaps, in order (for histograms)

    @property
    def gaps(self) -> int:
        return max(self.results - 1, 0)

    @property
    def first_result_met(self) -> bool:
        """The first result arrived by its deadline (False when none did)."""
        return self.first_result_ms is not None and self.first_result_ms <= self.objectives.first_result_ms

    @property
    def gap_objective_met(self) -> bool:
        """No gap was over the objective (True without one, or with fewer than two results)."""
        return self.gaps_over_objective == 0

    @property
    def completion_met(self) -> bool:
        """The stream ended (its last result, or its end) by the completion deadline."""
        end = self.last_result_ms if self.finished and self.last_result_ms is not None else self.elapsed_ms
        return end <= self.objectives.completion_ms


class GapTracker:
    """A stream's result arrivals against its objectives (see the module docstring)."""

    __slots__ = (
        "_count",
        "_finished",
        "_first",
        "_gaps",
        "_last",
        "_max_gap_ms",
        "_over",
        "_sum_gap_ms",
        "objectives",
        "received_at",
    )

    def __init__(self, received_at: float, objectives: StreamObjectives) -> None:
        self.received_at = received_at  # seconds: when the request arrived (its budget's start)
        self.objectives = objectives
        self._count = 0
        self._first: float | None = None
        self._last: float | None = None
        self._max_gap_ms = 0.0
        self._sum_gap_ms = 0.0
        self._over = 0
        self._gaps: list[float] = []
        self._finished: StreamSummary | None = None

    @property
    def results(self) -> int:
        return self._count

    def result(self, now: float) -> float | None:
        """A result arrived at ``now`` (seconds): the gap since the previous one in ms (None for
        the first). Times before the previous result count as a zero gap. Ignored once finished."""
        if self._finished is not None:
            return None
        self._count += 1
        last = self._last
        if last is None:
            self._first = self._last = now
            return None
        gap_ms = max(now - last, 0.0) * 1000.0
        self._last = max(now, last)
        self._sum_gap_ms += gap_ms
        self._max_gap_ms = max(self._max_gap_ms, gap_ms)
        objective = self.objectives.gap_ms
        if objective is not None and gap_ms > objective:
            self._over += 1
        if len(self._gaps) < MAX_KEPT_GAPS:
            self._gaps.append(gap_ms)
        return gap_ms

    def summary(self, now: float) -> StreamSummary:
        """The figures so far (after ``finish``: the finished summary, whatever ``now``)."""
        if self._finished is not None:
            return self._finished
        gaps = max(self._count - 1, 0)
        return StreamSummary(
            objectives=self.objectives,
            results=self._count,
            first_result_ms=_ms(self._first, self.received_at),
            last_result_ms=_ms(self._last, self.received_at),
            max_gap_ms=self._max_gap_ms,
            mean_gap_ms=self._sum_gap_ms / gaps if gaps else 0.0,
            gaps_over_objective=self._over,
            elapsed_ms=max(now - self.received_at, 0.0) * 1000.0,
            gaps_ms=tuple(self._gaps),
        )

    def finish(self, now: float) -> StreamSummary:
        """The stream ended at ``now`` (its final response, a failure or a cancel): its summary.
        Idempotent: a second call returns the first one's."""
        if self._finished is None:
            self._finished = replace(self.summary(now), finished=True)
        return self._finished


def _ms(at: float | None, since: float) -> float | None:
    return None if at is None else max(at - since, 0.0) * 1000.0


def first_result_reserve_ms(
    prefill_ms: float, decode_ms: float, output_tokens: int, host_cpu_ms: float
) -> float:
    """Predicted execution up to a stream's first result: its prefill and one decode step
    (the decode spread evenly over its output tokens), and the host's CPU time."""
    step = decode_ms / output_tokens if output_tokens > 0 else 0.0
    return prefill_ms + step + host_cpu_ms
