"""The ladder's windows read only their span's buckets and keep their last reading (issue 31):
the same floats as a pass over the whole ring.

``DemandWindow._live`` visits the slots of the span's buckets in ascending slot order and keeps
its answer per (samples added, ``now``, span); ``DwellWindow`` reads its samples through one
zip. On random samples (times going back and forth, gaps longer than the window, negative
times) every reading equals the one written as before, bit for bit.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.overload import YOUNG_WINDOW_FLOOR, DemandWindow, DwellWindow


def live_as_before(
    window: DemandWindow, now: float, span_buckets: int | None
) -> tuple[float, float, int, float]:
    """``DemandWindow._live`` as it was written before (a pass over every slot of the ring)."""
    span = window.buckets if span_buckets is None else max(1, min(window.buckets, span_buckets))
    width = window.window_s / window.buckets
    bucket = math.floor(now / width)
    oldest = bucket - span + 1
    total, squares, count = 0.0, 0.0, 0
    for slot in range(window.buckets):
        if oldest <= window._epochs[slot] <= bucket:
            total += window._sums[slot]
            squares += window._sumsq[slot]
            count += window._counts[slot]
    floor = max(1, math.ceil(span * YOUNG_WINDOW_FLOOR))
    age = span if window._first is None else bucket - window._first + 1
    if age <= floor:
        return total, squares, count, floor * width
    partial = min(width, max(0.0, now - bucket * width))
    seconds = (min(span, age) - 1) * width + partial
    return total, squares, count, max(seconds, 0.5 * width)


moves = st.lists(
    st.tuples(
        st.sampled_from([-0.3, -0.05, 0.0, 0.0, 0.01, 0.04, 0.1, 0.7, 3.0, 25.0]),  # time step
        st.one_of(st.none(), st.floats(0.0, 500.0)),  # a sample (None: only read)
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    window_s=st.sampled_from([1.0, 2.0, 10.0]),
    buckets=st.sampled_from([1, 7, 20, 100]),
    start=st.sampled_from([-3.0, 0.0, 1234.5]),
    steps=moves,
)
def test_demand_readings_equal_a_pass_over_the_ring(
    window_s: float, buckets: int, start: float, steps: list[tuple[float, float | None]]
) -> None:
    window = DemandWindow(window_s, buckets)
    now = start
    width = window_s / buckets
    for step, sample in steps:
        now += step
        if sample is not None:
            window.add(now, sample)
        for span_s in (None, 0.1, 1.0, 2.0, 4.0, 10.0, 60.0):
            span_buckets = None if span_s is None else max(1, round(span_s / width))
            expected = live_as_before(window, now, span_buckets)
            assert window._live(now, span_buckets) == expected
            assert window._live(now, span_buckets) == expected  # the kept reading
        assert window.total_ms(now) == live_as_before(window, now, None)[0]


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.sampled_from([1, 5, 64]),
    steps=st.lists(
        st.tuples(st.sampled_from([0.0, 0.01, 0.5, 3.0, 7.0]), st.floats(0.0, 100.0)), max_size=150
    ),
)
def test_dwell_readings_equal_the_indexed_ones(capacity: int, steps: list[tuple[float, float]]) -> None:
    window = DwellWindow(5.0, capacity)
    now = 0.0
    for step, dwell in steps:
        now += step
        window.add(now, dwell)
        since = now - window.window_s
        held = [window._dwell_ms[i] for i in range(window._size) if since < window._at[i] <= now]
        assert window.count(now) == len(held)
        for q in (0.5, 0.95, 1.0):
            recent = sorted(held)
            expected = recent[max(0, math.ceil(q * len(recent)) - 1)] if recent else 0.0
            assert window.quantile_ms(now, q) == expected
