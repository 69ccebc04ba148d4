"""Placement among a route's interchangeable pools (``gateway.core.placement``): the offered
rate it balances and the ranking ``bind_pool`` applies. The loop it breaks is tested end to
end in ``tests/test_recovery.py``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.load import PoolLoad
from gateway.core.overload import LadderConfig
from gateway.core.placement import (
    PLACEMENT_TAU_S,
    OfferedRate,
    best_placement,
    device_work_term,
    placement_head,
    placement_key,
)


def test_the_offered_rate_decays_with_its_time_constant() -> None:
    rate = OfferedRate()
    rate.add(10.0, 100.0)
    assert rate.ms_per_s(10.0) == pytest.approx(100.0 / PLACEMENT_TAU_S)
    assert rate.ms_per_s(10.0 + PLACEMENT_TAU_S) == pytest.approx(100.0 / PLACEMENT_TAU_S / math.e)
    rate.add(10.0 + PLACEMENT_TAU_S, 50.0)
    assert rate.ms_per_s(10.0 + PLACEMENT_TAU_S) == pytest.approx((100.0 / math.e + 50.0) / PLACEMENT_TAU_S)


def test_an_older_sample_counts_without_decaying_the_rate_backwards() -> None:
    rate = OfferedRate()
    rate.add(5.0, 10.0)
    rate.add(4.5, 10.0)  # a fleet's remote offer, stamped a little earlier
    assert rate.ms_per_s(5.0) == pytest.approx(20.0 / PLACEMENT_TAU_S)


@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 500.0)), min_size=1, max_size=60))
def test_a_steady_stream_converges_to_its_rate(gaps_and_costs: list[tuple[float, float]]) -> None:
    """Whatever came before, a steady stream of offers reads as its own rate within a few
    time constants: the rate forgets a past surge."""
    rate, now = OfferedRate(), 0.0
    for gap, cost in gaps_and_costs:
        now += gap
        rate.add(now, cost)
    for _ in range(2000):  # 100 ms/s for 10 s (10 time constants)
        now += 0.005
        rate.add(now, 0.5)
    assert rate.ms_per_s(now) == pytest.approx(100.0, rel=0.02)


def test_pool_load_counts_local_and_remote_offers_in_the_placement_rate() -> None:
    load = PoolLoad("a/full-v18", devices=8, dwell_budget_ms=20.0, config=LadderConfig())
    flow = load.flow("interactive", "orchid", weight=2.0, class_weight=1.0)
    load.offer(1.0, flow, 40.0)
    load.add_remote_offer(1.0, flow, 60.0)
    assert load.offered_rate.ms_per_s(1.0) == pytest.approx(100.0 / PLACEMENT_TAU_S)


def test_wait_ranks_first_then_offered_demand_per_device_then_device_work() -> None:
    idle_but_offered_much = placement_key(0.0, 8000.0, 0.0, 8)
    idle_and_offered_little = placement_key(0.0, 2000.0, 400.0, 8)
    busy = placement_key(30.0, 0.0, 0.0, 8)
    assert idle_and_offered_little < idle_but_offered_much < busy
    # Per device: twice the devices carry twice the offered demand at the same rank.
    assert placement_key(0.0, 2000.0, 0.0, 4) == placement_key(0.0, 4000.0, 0.0, 8)
    assert placement_key(0.0, 0.0, 0.0, 0) > placement_key(0.0, 1e9, 1e9, 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 1.5, 7.25, math.inf]),  # waits: few values, so ties are common
            st.sampled_from([0.0, 100.0, 250.0]),
            st.sampled_from([0.0, 12.5, 40.0, 90.0]),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_the_lazy_pick_is_the_least_key_and_sums_work_only_on_ties(
    candidates: list[tuple[float, float, float, int]],
) -> None:
    """``best_placement`` picks what ``min`` over ``placement_key`` picks (the first of equals),
    asking a candidate's device work only where its first two terms tie with the best so far."""
    asked: list[int] = []

    def work(index: int) -> float:
        asked.append(index)
        return device_work_term(candidates[index][2], candidates[index][3])

    def head(index: int) -> tuple[float, float]:
        wait, offered, _, devices = candidates[index]
        return placement_head(wait, offered, devices)

    keys = [placement_key(w, o, d, n) for w, o, d, n in candidates]
    expected = min(range(len(candidates)), key=lambda i: (keys[i], i))
    assert best_placement(range(len(candidates)), head, work) == expected
    heads = [head(i) for i in range(len(candidates))]
    assert all(heads.count(heads[i]) > 1 for i in asked)  # only tied candidates paid for the sum
