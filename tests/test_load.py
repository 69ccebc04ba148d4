"""Per-pool load: how much eligible work the ladder diverts to the fallback, and relief."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.load import DIVERT_TARGET, PoolLoad
from gateway.overload import DEFAULT_LADDER, LadderStep
from gateway.scheduler import DispatchQueue


def pool_at(utilization: float, step_now: float = 0.0) -> PoolLoad:
    load = PoolLoad("p", devices=24, dwell_budget_ms=20.0, config=DEFAULT_LADDER)
    # The seed's fleet: 24 devices x 0.70 x 1000 = 16,800 ms/s protected.
    for i in range(100):  # a full 10 s window at this rate
        load.demand.add(step_now + i * 0.1, utilization * 16_800.0 * 0.1)
    end = step_now + 9.95
    load.gather(end, DispatchQueue("q", devices=24, slots=48, max_queued=10), healthy=True, evidence_at=end)
    return load


def test_the_seed_surge_diverts_about_the_seeds_share() -> None:
    load = pool_at(20_461.0 / 16_800.0)
    assert load.step >= 3
    diverted = sum(load.divert() for _ in range(10_000)) / 10_000
    # (1.218 - 0.9) / (1.218 x 0.45): ~58 % of eligible work, the seed's 60 % / 50 %.
    assert diverted == pytest.approx((20_461 / 16_800 - DIVERT_TARGET) / (20_461 / 16_800 * 0.45), abs=0.01)


def test_nothing_is_diverted_below_step_3() -> None:
    load = pool_at(0.80)
    assert load.step < 3
    assert not any(load.divert() for _ in range(100))


def test_relief_is_what_admitted_work_runs_at() -> None:
    load = pool_at(1.0)
    for _ in range(10):
        load.admitted(9.0, offered_ms=56.8, running_ms=32.0)  # fallback
        load.admitted(9.0, offered_ms=56.8, running_ms=56.8)  # primary
    assert load.relief(9.5) == pytest.approx((32.0 + 56.8) / (2 * 56.8))


def test_drain_for_policy_is_finite_when_no_device_is_healthy() -> None:
    """With every device down nothing drains; policy still gets a number it can turn into
    a retry-after (the configured maximum), not infinity (``int()`` of it fails in CEL)."""
    load = PoolLoad("p", devices=4, dwell_budget_ms=20.0, config=DEFAULT_LADDER)
    load.demand.add(0.0, 100.0)
    queue = DispatchQueue("q", devices=4, slots=8, max_queued=10)
    load.gather(1.0, queue, healthy=False, evidence_at=1.0)
    assert load.step == 6
    assert load.drain_ms() == float(DEFAULT_LADDER.retry_after_max_ms)
    assert load.retry_after_ms() == DEFAULT_LADDER.retry_after_max_ms


def test_reduced_output_comes_first_and_only_as_far_as_needed() -> None:
    """Step 2's cap is spread over just the share that brings demand back to the divert
    target; the fallback's share then counts only what reduction measurably saved."""
    at_edge = pool_at(0.95)
    at_edge.ladder.state = dataclasses.replace(at_edge.ladder.state, step=LadderStep(2))
    share = at_edge.reduce_share()
    assert share == pytest.approx((0.95 - DIVERT_TARGET) / (0.95 * at_edge.reduce_saving))
    picked = sum(at_edge.reduce_output() for _ in range(1000)) / 1000
    assert picked == pytest.approx(share, abs=0.01)

    surge = pool_at(20_461.0 / 16_800.0)
    assert surge.step >= 3
    baseline = sum(surge.divert() for _ in range(10_000)) / 10_000
    # Admitted work of which reduced output actually saved 20 %: less is left to divert.
    for i in range(100):
        surge.admitted(9.0 + i * 0.001, offered_ms=56.8, running_ms=45.44)
        surge.reduced(9.0 + i * 0.001, full_ms=56.8, reduced_ms=45.44)
    assert surge.reduction_relief(9.95) == pytest.approx(0.2)
    after = sum(surge.divert() for _ in range(10_000)) / 10_000
    expected = (1.218 * 0.8 - DIVERT_TARGET) / (1.218 * 0.8 * 0.45)
    assert after == pytest.approx(expected, abs=0.02) and after < baseline / 2
