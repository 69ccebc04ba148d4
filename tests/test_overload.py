"""The overload ladder (pure): thresholds on the lower confidence bound, hysteresis, hold and
direct descent, fail-safe evidence, windows and their standard errors, retry-after, and the
per-flow fair-share plans (water-filling, what each flow's excess gets capped, diverted,
refused). Virtual time only: every ``now`` is passed in."""

from __future__ import annotations

import math
import random
from dataclasses import FrozenInstanceError

import pytest
from pydantic import ValidationError

from gateway.core.overload import (
    DEFAULT_LADDER,
    DEFAULT_SPANS_S,
    DemandReading,
    DemandWindow,
    DwellWindow,
    FlowDemand,
    FlowPlan,
    FlowRelief,
    LadderConfig,
    LadderState,
    LadderStep,
    LoadEvidence,
    OverloadLadder,
    Shedder,
    drain_ms,
    effects,
    fair_allocation,
    next_state,
    plan_flows,
    protected_capacity_ms_per_s,
    retry_after_ms,
)
from gateway.settings import LadderSchema

SEED_DEVICES = 24
SEED_CAPACITY = 16_800.0  # 24 devices x 0.70 x 1000 ms/s
SHORT_MS, LONG_MS = 56.8, 467.6
SEED_NORMAL = 140 * SHORT_MS + 18 * LONG_MS  # 16,368.8 ms/s
SEED_SURGE = 20_461.0  # 1.25x
SEED_RELIEF = 15_287.5 / 20_461.0  # the seed's fallback (60 % of short, 50 % of long) on the surge


def evidence(
    utilization: float | None = None,
    *,
    now: float = 100.0,
    offered: float | None = None,
    capacity: float = SEED_CAPACITY,
    age_s: float = 0.0,
    healthy: int = SEED_DEVICES,
    **extra: object,
) -> LoadEvidence:
    if offered is None:
        assert utilization is not None
        offered = utilization * capacity
    return LoadEvidence(
        now=now,
        evidence_at=now - age_s,
        offered_ms_per_s=offered,
        protected_capacity_ms_per_s=capacity,
        healthy_devices=healthy,
        configured_devices=SEED_DEVICES,
        **extra,  # type: ignore[arg-type]
    )


def reading(
    span_s: float, utilization: float, sigma: float, capacity: float = SEED_CAPACITY
) -> DemandReading:
    """A reading of ``utilization`` +- ``sigma`` (both as fractions of ``capacity``)."""
    return DemandReading(span_s, utilization * capacity, sigma * capacity)


def fresh_step(utilization: float) -> LadderStep:
    return OverloadLadder().update(evidence(utilization)).step


# --------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("utilization", "step"),
    [
        (0.0, 0),
        (0.99, 0),
        (1.00, 1),
        (1.029, 1),
        (1.03, 2),
        (1.059, 2),
        (1.06, 3),
        (1.149, 3),
        (1.15, 4),
        (1.249, 4),
        (1.25, 5),
        (1.429, 5),
        (1.43, 6),
        (5.0, 6),
    ],
)
def test_each_step_is_entered_at_its_threshold(utilization: float, step: int) -> None:
    # Without readings the point estimate is taken as certain: it is the bound.
    assert fresh_step(utilization) == step


def test_every_step_is_reachable_and_thresholds_increase() -> None:
    enters = DEFAULT_LADDER.thresholds
    assert enters == pytest.approx((0.0, 1.00, 1.03, 1.06, 1.15, 1.25, 1.43))
    assert list(enters) == sorted(enters) and len(set(enters)) == len(LadderStep)
    assert {fresh_step(enters[step]) for step in LadderStep} == set(LadderStep)
    assert DEFAULT_LADDER.confidence_z == 2.5 and DEFAULT_LADDER.hysteresis == 0.05
    assert DEFAULT_LADDER.plan_utilization == 0.90
    assert DEFAULT_LADDER.hold_s == 1.0 and DEFAULT_LADDER.dwell_min_samples == 20
    # Step 6 sits just past the devices' raw time: 1 / 0.70 of protected.
    assert 1 / 0.70 < DEFAULT_LADDER.protect_admitted_at < 1 / 0.70 + 0.01


def test_seed_arithmetic_normal_and_surge() -> None:
    # The seed: 140 short x 56.8 + 18 long x 467.6 = 16,368.8 accelerator-ms/s on 24 devices at 70 %.
    normal_ms_per_s = 140 * SHORT_MS + 18 * LONG_MS
    assert normal_ms_per_s == pytest.approx(16_368.8)
    capacity = protected_capacity_ms_per_s(SEED_DEVICES)
    assert capacity == pytest.approx(SEED_CAPACITY)
    normal = evidence(offered=SEED_NORMAL, capacity=capacity)
    assert normal.utilization == pytest.approx(0.9743, abs=1e-4)
    # 97.43 % is inside the envelope: step 0, nothing degraded, not even shadow traffic stopped.
    normal_state = OverloadLadder().update(normal)
    assert normal_state.step == LadderStep.NORMAL
    assert "97.4% of protected 16800 ms/s" in normal_state.reason

    # 1.25x arrivals: 20,461 ms/s = 121.8 %. Taken as certain and with no relief measured yet,
    # that is step 4 (defer batch; refusals start at 125 %); the seed's fallback relief
    # (15,287.5 / 20,461) leaves 91.0 % effective, so rule 7 holds the surge at step 3.
    surge = evidence(offered=1.25 * SEED_NORMAL, capacity=capacity)
    assert surge.offered_ms_per_s == pytest.approx(SEED_SURGE)
    assert surge.utilization == pytest.approx(1.218, abs=1e-3)
    surge_state = OverloadLadder().update(surge)
    assert surge_state.step == LadderStep.DEFER_BATCH
    assert "offered 20461 ms/s = 121.8% of protected 16800 ms/s" in surge_state.reason
    relieved = evidence(offered=SEED_SURGE, capacity=capacity, relief=SEED_RELIEF)
    assert relieved.utilization * relieved.relief_factor == pytest.approx(0.90997, abs=1e-5)
    assert OverloadLadder().update(relieved).step == LadderStep.FALLBACK

    # Over the 10 s span the surge's standard error is sqrt(1.25 x 10 x sum x^2 per s) / 10 =
    # 740.6 ms/s (4.41 % of protected): at z = 2.5 the lower bound is 110.77 % (at z = 2.0 it was
    # 112.98 %), inside step 3's band: 4.8 points over its enter line (106 %), 9.8 over its leave
    # line (101 %) and 4.2 under step 4's line (115 %).
    sigma = math.sqrt(1.25 * 10 * (140 * SHORT_MS**2 + 18 * LONG_MS**2)) / 10
    assert sigma == pytest.approx(740.6, abs=0.1)
    assert sigma / capacity == pytest.approx(0.0441, abs=1e-4)

    def surge_reading(k: float) -> LoadEvidence:
        """The surge's 10 s reading with its mean ``k`` standard errors off the expected rate."""
        mean = SEED_SURGE + k * sigma
        return evidence(offered=mean, capacity=capacity, readings=(DemandReading(10.0, mean, sigma),))

    certain = surge_reading(0.0)
    assert certain.utilization_bound(DEFAULT_LADDER.confidence_z) == pytest.approx(1.1077, abs=1e-4)
    assert certain.utilization_bound(2.0) == pytest.approx(1.1298, abs=1e-4)
    assert OverloadLadder().update(certain).step == LadderStep.FALLBACK
    # Its sampling noise moves the bound by a standard error (4.41 points) per standard error of
    # the mean. A mean one standard error lower (117.4 %) still has a bound of 106.4 %, step 3 (it
    # was step 2 with step 3 at 110 %); step 3 is entered down to 1.08 standard errors low. Once
    # at step 3 it is left only when the mean is 2.2 standard errors low (112.0 %: bound 101 %).
    lower = surge_reading(-1.0)
    assert lower.utilization_bound(2.5) == pytest.approx(1.0636, abs=1e-4)
    assert OverloadLadder().update(lower).step == LadderStep.FALLBACK
    assert surge_reading(-1.1).utilization_bound(2.5) < DEFAULT_LADDER.fallback_at
    assert surge_reading(-2.2).utilization_bound(2.5) > DEFAULT_LADDER.leaves_below(LadderStep.FALLBACK)
    assert surge_reading(-2.3).utilization_bound(2.5) < DEFAULT_LADDER.leaves_below(LadderStep.FALLBACK)
    # Upward the band is narrower: 0.96 standard errors high (126.0 %) the bound reaches step 4's
    # line (115.2 % one standard error high), and with no relief measured that defers batch work;
    # with the seed's relief (x 0.747: 86.0 %) rule 7 holds it at step 3.
    higher = surge_reading(1.0)
    assert higher.utilization_bound(2.5) == pytest.approx(1.1518, abs=1e-4)
    assert surge_reading(0.95).utilization_bound(2.5) < DEFAULT_LADDER.defer_batch_at
    assert OverloadLadder().update(higher).step == LadderStep.DEFER_BATCH
    relieved_higher = evidence(
        offered=SEED_SURGE + sigma,
        capacity=capacity,
        relief=SEED_RELIEF,
        readings=(DemandReading(10.0, SEED_SURGE + sigma, sigma),),
    )
    assert OverloadLadder().update(relieved_higher).step == LadderStep.FALLBACK

    # What the fallback leaves, 15,287.5 ms/s = 91.0 %, fed to the ladder would read as step 0 and
    # switch the fallback off again: the ladder takes offered demand, priced before any ladder
    # action (rule 1).
    after_fallback = evidence(offered=15_287.5, capacity=capacity)
    assert after_fallback.utilization == pytest.approx(0.90997, abs=1e-5)
    assert OverloadLadder().update(after_fallback).step == LadderStep.NORMAL


def test_time_scale_does_not_change_utilization() -> None:
    # Device-ms (what estimate.predict(..., time_scale=...) records) against device capacity equals
    # profile-ms against capacity scaled by the backend's time_scale.
    time_scale = 0.05
    device_ms = 16_368.8 * time_scale
    in_device_ms = evidence(offered=device_ms, capacity=protected_capacity_ms_per_s(24))
    in_profile_ms = evidence(
        offered=16_368.8, capacity=protected_capacity_ms_per_s(24, time_scale=time_scale)
    )
    assert in_device_ms.utilization == pytest.approx(in_profile_ms.utilization)
    assert protected_capacity_ms_per_s(4, 0.5) == pytest.approx(2000.0)
    with pytest.raises(ValueError):
        protected_capacity_ms_per_s(4, 0.0)
    with pytest.raises(ValueError):
        protected_capacity_ms_per_s(-1)


# --------------------------------------------------------------------------- the lower bound


def test_utilization_bound_is_the_highest_lower_bound_over_the_spans() -> None:
    spans = (reading(1.0, 1.10, 0.08), reading(2.0, 1.05, 0.02), reading(10.0, 0.98, 0.01))
    load = evidence(offered=1.05 * SEED_CAPACITY, readings=spans)
    # (1.10 - 2 x 0.08, 1.05 - 2 x 0.02, 0.98 - 2 x 0.01) = (0.94, 1.01, 0.96): the 2 s span decides.
    assert load.utilization_bound(2.0) == pytest.approx(1.01)
    # At the default z = 2.5: (0.90, 1.00, 0.955), the 2 s span still decides.
    assert load.utilization_bound(DEFAULT_LADDER.confidence_z) == pytest.approx(1.00)
    assert load.utilization_bound(0.0) == pytest.approx(1.10)  # z = 0: the highest point estimate
    assert load.utilization == pytest.approx(1.05)  # the point estimate is not the bound
    # No readings: the point estimate is the bound.
    assert evidence(1.05).utilization_bound(2.0) == pytest.approx(1.05)
    # A bound below zero is no demand, not negative demand.
    assert evidence(0.1, readings=(reading(1.0, 0.1, 0.2),)).utilization_bound(2.0) == 0.0
    # Fail safe: no capacity, unreadable demand or an unreadable reading is infinitely loaded.
    assert evidence(offered=100.0, capacity=0.0, readings=spans).utilization_bound(2.0) == math.inf
    assert evidence(offered=math.nan, readings=spans).utilization_bound(2.0) == math.inf
    broken = (reading(1.0, 0.5, 0.01), DemandReading(2.0, math.nan, 0.0))
    assert evidence(0.5, readings=broken).utilization_bound(2.0) == math.inf


def test_a_noisy_short_reading_does_not_climb() -> None:
    """A 1 s reading of 130 % whose standard error is 20 % (a few long requests) is not certain:
    its lower bound is 80 %, and the 10 s span says 87 %. The same point estimate taken as
    certain would be step 5."""
    noisy = (reading(1.0, 1.30, 0.20), reading(10.0, 0.97, 0.04))
    state = OverloadLadder().update(evidence(1.30, readings=noisy))
    assert state.step == LadderStep.NORMAL
    assert "certain (z=2.5): 87.0%" in state.reason
    assert fresh_step(1.30) == LadderStep.REJECT_INTERACTIVE
    # At a lower confidence (z = 1) the same reading is certain enough to climb (110 %: step 3).
    assert OverloadLadder(LadderConfig(confidence_z=1.0)).update(evidence(1.30, readings=noisy)).step == 3


def test_a_huge_sudden_flood_climbs_at_once() -> None:
    """A flood is certain in the 1 s span while the 10 s span still averages it with the calm
    before: one update is enough to reach step 6."""
    flood = (reading(1.0, 3.0, 0.13), reading(2.0, 2.0, 0.07), reading(10.0, 1.2, 0.03))
    state = OverloadLadder(now=0.0).update(evidence(3.0, now=0.1, readings=flood))
    assert state.step == LadderStep.PROTECT_ADMITTED and state.changed
    assert "certain (z=2.5): 267.5%" in state.reason
    # A modest sustained surge is certain only once the long span holds enough of it.
    early = (reading(1.0, 1.22, 0.13), reading(10.0, 1.04, 0.04))
    assert OverloadLadder().update(evidence(1.22, readings=early)).step == 0
    late = (reading(1.0, 1.22, 0.13), reading(10.0, 1.218, 0.044))  # bound 1.108
    assert OverloadLadder().update(evidence(1.22, readings=late)).step == LadderStep.FALLBACK


def test_the_bound_also_decides_the_descent() -> None:
    """Once the evidence no longer shows the load above the step for certain (the point estimate
    may still be above it), the ladder leaves the step after the hold."""
    ladder = OverloadLadder(now=0.0)
    certain = (reading(1.0, 1.12, 0.005), reading(10.0, 1.12, 0.005))  # bound 1.1075
    assert ladder.update(evidence(1.12, now=0.0, readings=certain)).step == LadderStep.FALLBACK
    # bound max(1.12 - 2.5 x 0.08, 1.00 - 2.5 x 0.03) = max(0.92, 0.925): under step 3's leave line
    # (1.01) and, plus the hysteresis (0.975), under step 1's enter line: straight to step 0.
    uncertain = (reading(1.0, 1.12, 0.08), reading(10.0, 1.00, 0.03))
    for i in range(1, 10):
        assert ladder.update(evidence(1.12, now=i * 0.1, readings=uncertain)).step == LadderStep.FALLBACK
    state = ladder.update(evidence(1.12, now=1.1, readings=uncertain))
    assert state.step == LadderStep.NORMAL and "descend 3 -> 0" in state.reason
    assert "certain (z=2.5): 92.5%" in state.reason


# --------------------------------------------------------------------------- climbing and descending


def test_climbs_immediately_skipping_steps() -> None:
    ladder = OverloadLadder(now=0.0)
    state = ladder.update(evidence(1.3, now=0.1))
    assert state.step == LadderStep.REJECT_INTERACTIVE and state.changed and state.since == 0.1
    state = ladder.update(evidence(2.0, now=0.2))
    assert state.step == LadderStep.PROTECT_ADMITTED and state.changed and state.since == 0.2


def test_descends_straight_to_the_supported_step_after_the_hold() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(2.0, now=0.0))
    assert ladder.step == 6
    history: list[tuple[float, int, str]] = []
    for i in range(1, 50):
        state = ladder.update(evidence(0.1, now=i * 0.1))
        if state.changed:
            history.append((round(i * 0.1, 1), state.step, state.reason))
    # Calm from the first quiet reading at 0.1 s; 1 s later straight from 6 to 0, in one change.
    assert [(at, step) for at, step, _ in history] == [(1.1, 0)]
    assert "descend 6 -> 0" in history[0][2]

    # To an intermediate step: load falls from 200 % to 108 %, which step 3 (enters 1.06) supports;
    # plus the hysteresis (1.13) it is still under step 4's line, so it lands on step 3.
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(2.0, now=0.0))
    steps = [ladder.update(evidence(1.08, now=i * 0.1)).step for i in range(1, 60)]
    assert steps[:10] == [6] * 10 and set(steps[10:]) == {LadderStep.FALLBACK}
    # Landing with the hysteresis: 112 % is step 3 by its enter lines, but it is above step 4's
    # leave line (1.10; 1.12 + 0.05 reaches step 4's 1.15), so the descent stops at step 4 and
    # holds there: a reading at 115 % would otherwise climb straight back.
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(2.0, now=0.0))
    steps = [ladder.update(evidence(1.12, now=i * 0.1)).step for i in range(1, 60)]
    assert DEFAULT_LADDER.step_for(1.12) == LadderStep.FALLBACK
    assert steps[:10] == [6] * 10 and set(steps[10:]) == {LadderStep.DEFER_BATCH}
    assert "hold step 4: leaves below 110.0%" in ladder.state.reason

    # The target is the one supported when the hold ends, not when it began.
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.3, now=0.0))
    assert ladder.step == 5
    for i in range(1, 6):
        ladder.update(evidence(1.12, now=i * 0.1))  # would land on step 4, under step 5's leave line (1.20)
    for i in range(6, 11):
        ladder.update(evidence(0.5, now=i * 0.1))
    assert ladder.step == 5
    state = ladder.update(evidence(0.5, now=1.1))
    assert state.step == 0 and "descend 5 -> 0" in state.reason


def test_hold_is_reported_and_climb_restarts_it() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.12, now=0.0))
    state = ladder.update(evidence(0.5, now=0.5))
    assert state.step == 3 and not state.changed and "hold step 3 for 1.0 s more" in state.reason
    assert state.calm_since == 0.5
    ladder.update(evidence(1.16, now=0.8))  # climb to 4 restarts the hold
    assert ladder.step == 4 and ladder.state.calm_since is None
    assert ladder.update(evidence(0.5, now=1.0)).step == 4
    assert ladder.update(evidence(0.5, now=1.9)).step == 4
    assert ladder.update(evidence(0.5, now=2.0)).step == 0


def test_descent_needs_sustained_calm() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.12, now=0.0))
    ladder.update(evidence(0.5, now=10.0))
    # One reading back inside the hysteresis band [1.01, 1.06) breaks the calm; the hold starts again.
    state = ladder.update(evidence(1.03, now=10.9))
    assert state.step == 3 and state.calm_since is None and "leaves below 101.0%" in state.reason
    assert ladder.update(evidence(0.5, now=11.0)).step == 3
    assert ladder.update(evidence(0.5, now=11.9)).step == 3
    assert ladder.update(evidence(0.5, now=12.0)).step == 0


def test_hysteresis_band_holds_the_step() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.10, now=0.0))
    assert ladder.step == 3
    # Below the step 3 threshold but not below 1.06 - 0.05: stays at 3 however long it lasts.
    state = ladder.update(evidence(1.011, now=60.0))
    assert state.step == 3 and "leaves below 101.0%" in state.reason
    assert ladder.update(evidence(1.009, now=61.0)).step == 3
    # Straight down after the hold, but onto step 2, not the step 1 that 100.9 % enters: it is
    # above step 2's leave line (0.98), so step 2 is where the hysteresis holds it.
    state = ladder.update(evidence(1.009, now=62.0))
    assert state.step == 2 and "descend 3 -> 2" in state.reason
    # Step 2 (enters 1.03) leaves below 0.98; 0.96 is above step 1's leave line: lands on 1.
    assert ladder.update(evidence(0.985, now=100.0)).step == 2
    assert ladder.update(evidence(0.96, now=101.0)).step == 2
    assert ladder.update(evidence(0.96, now=102.0)).step == 1
    # Step 1 (enters 1.00) leaves below 0.95.
    assert ladder.update(evidence(0.96, now=103.0)).step == 1
    assert ladder.update(evidence(0.949, now=104.0)).step == 1
    assert ladder.update(evidence(0.949, now=105.0)).step == 0


def test_threshold_oscillation_does_not_flap() -> None:
    # Utilization oscillating +-0.04 around 1.10 for 60 s, sampled every 100 ms: the low readings
    # (1.06, step 3's enter line) stay above its leave line (1.01), the high ones (1.14) under step 4.
    ladder = OverloadLadder(now=0.0)
    changes = 0
    for i in range(600):
        utilization = 1.10 + (0.04 if i % 2 == 0 else -0.04)
        if ladder.update(evidence(utilization, now=i * 0.1)).changed:
            changes += 1
    assert changes == 1
    assert ladder.step == LadderStep.FALLBACK


# The seed's 1.25x surge: the standard error of its 10 s rate, 740.6 ms/s (see the seed arithmetic).
SURGE_SIGMA_10S = math.sqrt(1.25 * 10 * (140 * SHORT_MS**2 + 18 * LONG_MS**2)) / 10


def test_the_seed_surge_wobbling_inside_step_3s_band_holds_step_3() -> None:
    """The seed's surge read over the 10 s span, its mean wobbling by up to 2.1 standard errors
    below and 0.9 above the expected 20,461 ms/s: the bound ranges 101.5-114.7 %, inside step 3's
    band (left below 101 %, step 4 from 115 %). One climb, then step 3 for the whole minute:
    no flapping. Once at step 3 the order of the readings does not matter: every one of them
    is under step 4's line and none under step 3's leave line."""
    wobble = (0.0, -2.1, 0.9, -1.0, 0.5, -2.1, 0.9, -0.5, -1.8, 0.2)  # standard errors off the mean
    bounds = []
    ladder = OverloadLadder(now=0.0)
    changes = 0
    for i in range(600):
        mean = SEED_SURGE + wobble[(i * 7) % len(wobble)] * SURGE_SIGMA_10S
        load = evidence(offered=mean, now=i * 0.1, readings=(DemandReading(10.0, mean, SURGE_SIGMA_10S),))
        bounds.append(load.utilization_bound(DEFAULT_LADDER.confidence_z))
        state = ladder.update(load)
        changes += state.changed
        assert state.step == LadderStep.FALLBACK, i
    assert changes == 1
    assert min(bounds) == pytest.approx(1.0151, abs=1e-4) and max(bounds) == pytest.approx(1.1474, abs=1e-4)
    assert DEFAULT_LADDER.leaves_below(LadderStep.FALLBACK) < min(bounds)
    assert max(bounds) < DEFAULT_LADDER.defer_batch_at
    # The low end alone, read on a fresh ladder, would be step 1: only the hysteresis holds it.
    assert DEFAULT_LADDER.step_for(min(bounds)) == LadderStep.SHED_OPTIONAL


def test_descent_lands_with_the_hysteresis() -> None:
    """After the hold the ladder goes straight down, but lands on the step whose leave line the
    judged load is above (``step_for(judged + hysteresis)``), not on the one whose enter line it
    is above: a descent from step 3 with the bound at 97 %, just under step 1's enter line
    (100 %) and above its leave line (95 %), lands on step 1, one step above the step 0 that
    step_for(0.97) says, and one reading at 100 % then changes nothing. Without the landing
    hysteresis that reading would climb back."""
    ladder = OverloadLadder(now=0.0)
    assert ladder.update(evidence(1.10, now=0.0)).step == LadderStep.FALLBACK
    for i in range(1, 11):
        assert ladder.update(evidence(0.97, now=i * 0.1)).step == LadderStep.FALLBACK
    state = ladder.update(evidence(0.97, now=1.1))
    assert DEFAULT_LADDER.step_for(0.97) == LadderStep.NORMAL
    assert state.step == LadderStep.SHED_OPTIONAL and "descend 3 -> 1" in state.reason
    at_the_line = ladder.update(evidence(1.00, now=1.2))
    assert at_the_line.step == LadderStep.SHED_OPTIONAL and not at_the_line.changed
    # Hysteresis is a setting: with none, the same descent lands on step 0 and the same single
    # reading at 100 % climbs straight back to 1 (a flap).
    bare = OverloadLadder(LadderConfig(hysteresis=0.0), now=0.0)
    bare.update(evidence(1.10, now=0.0))
    for i in range(1, 12):
        bare.update(evidence(0.97, now=i * 0.1))
    assert bare.step == LadderStep.NORMAL
    climbed = bare.update(evidence(1.00, now=1.2))
    assert climbed.changed and climbed.step == LadderStep.SHED_OPTIONAL
    # 99 % is above step 2's leave line (98 %): the descent stops at step 2, two above the 0 that
    # step_for(0.99) says, where a ladder already at step 2 would stay. A reading at step 2's
    # enter line (103 %) does not climb.
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.10, now=0.0))
    for i in range(1, 12):
        state = ladder.update(evidence(0.99, now=i * 0.1))
    assert state.step == LadderStep.REDUCE_OUTPUT and "descend 3 -> 2" in state.reason
    assert not ladder.update(evidence(1.03, now=1.2)).changed
    # The landing is always below the step being left: just under step 3's leave line
    # (1.009 + 0.05 < 1.06) it lands one step down.
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.10, now=0.0))
    for i in range(1, 12):
        ladder.update(evidence(1.009, now=i * 0.1))
    assert ladder.step == LadderStep.REDUCE_OUTPUT
    # Above step 3 the judged load is the bound x the relief (rule 7): from step 6, 130 % relieved
    # x 0.87 is 113.1 % effective, step 3 by its enter lines but above step 4's leave line (110 %):
    # it lands on step 4, and a reading at 115 % effective does not climb.
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(2.0, now=0.0))
    for i in range(1, 12):
        state = ladder.update(evidence(1.30, now=i * 0.1, relief=0.87))
    assert state.step == LadderStep.DEFER_BATCH and "descend 6 -> 4" in state.reason
    assert not ladder.update(evidence(1.15 / 0.87, now=1.2, relief=0.87)).changed


def test_transition_function_is_pure() -> None:
    start = LadderState(step=LadderStep.NORMAL, changed=False, reason="", stale=False, since=0.0)
    load = evidence(1.3, now=5.0, readings=(reading(1.0, 1.3, 0.01),))
    assert next_state(start, load) == next_state(start, load)
    assert start.step == 0


def test_fallback_relief_keeps_a_surge_at_step_3() -> None:
    """Rule 7: the seed's 1.25x surge (121.8 %) with the fallback relieving 25 % of the price
    stays at step 3 (91 % effective) instead of climbing to deferral (step 4)."""
    ladder = OverloadLadder(DEFAULT_LADDER)

    def surge(now: float, relief: float, offered: float = SEED_SURGE) -> LoadEvidence:
        return evidence(offered=offered, now=now, relief=relief)

    assert ladder.update(surge(0.0, 1.0)).step == LadderStep.DEFER_BATCH  # no relief yet
    state = ladder.state
    for i in range(1, 40):
        state = ladder.update(surge(i * 0.5, SEED_RELIEF))
        if i == 2:
            assert state.step == LadderStep.DEFER_BATCH  # calm since 0.5 s, held 0.5 s
    assert state.step == LadderStep.FALLBACK  # descended to 3 and holds there
    assert "after fallback relief" in state.reason
    # Steps up to 3 follow offered demand: relief never takes the surge below the fallback.
    assert OverloadLadder().update(surge(0.0, 0.1)).step == LadderStep.FALLBACK
    # Relief that does not suffice still defers: 121.8 % x 0.95 = 115.7 % -> step 4; x 0.94 -> 3.
    assert OverloadLadder().update(surge(0.0, 0.95)).step == LadderStep.DEFER_BATCH
    assert OverloadLadder().update(surge(0.0, 0.94)).step == LadderStep.FALLBACK
    # The seed's surge alone never reaches refusals (125 %); 1.5x the seed's load (146.2 %) does,
    # unless the fallback relieves it enough: x 0.9 = 131.6 % -> step 5, x 0.8 = 117.0 % -> 4.
    larger = 1.5 * SEED_NORMAL
    assert OverloadLadder().update(surge(0.0, 0.9, larger)).step == LadderStep.REJECT_INTERACTIVE
    assert OverloadLadder().update(surge(0.0, 0.8, larger)).step == LadderStep.DEFER_BATCH
    # Unreadable relief is no relief.
    assert OverloadLadder().update(surge(0.0, math.nan)).step == LadderStep.DEFER_BATCH
    assert OverloadLadder().update(surge(0.0, math.nan, larger)).step == LadderStep.PROTECT_ADMITTED


# --------------------------------------------------------------------------- fail-safe evidence


def test_dwell_raises_to_step_3_only_on_a_saturated_backend_with_enough_samples() -> None:
    def step(
        p95_ms: float,
        *,
        saturated: bool,
        samples: int,
        budget_ms: float | None = 20.0,
        utilization: float = 0.5,
        config: LadderConfig = DEFAULT_LADDER,
    ) -> LadderState:
        load = evidence(
            utilization,
            queue_dwell_p95_ms=p95_ms,
            dwell_budget_ms=budget_ms,
            backend_saturated=saturated,
            dwell_samples=samples,
        )
        return OverloadLadder(config).update(load)

    saturated = step(35.0, saturated=True, samples=20)
    assert saturated.step == LadderStep.FALLBACK
    assert "queue dwell p95 35 ms over budget 20 ms on a saturated backend" in saturated.reason
    # The backend is not the bottleneck: dwell is ordinary queueing, not overload.
    assert step(35.0, saturated=False, samples=500).step == 0
    # Too few samples for a p95 (one slow request is not a percentile).
    assert step(35.0, saturated=True, samples=19).step == 0
    assert step(35.0, saturated=True, samples=5, config=LadderConfig(dwell_min_samples=5)).step == 3
    # Never lowers: a higher utilization step stands.
    assert step(35.0, saturated=True, samples=20, utilization=1.3).step == 5
    # Within budget, or no budget: no effect.
    assert step(19.0, saturated=True, samples=99).step == 0
    assert step(500.0, saturated=True, samples=99, budget_ms=None).step == 0
    # Unreadable dwell on a saturated backend fails safe; the configured dwell step applies.
    assert step(math.nan, saturated=True, samples=20).step == 3
    two = LadderConfig(dwell_step=LadderStep.REDUCE_OUTPUT)
    assert step(35.0, saturated=True, samples=20, config=two).step == 2


def test_stale_evidence_fails_safe_and_is_visible() -> None:
    state = OverloadLadder().update(evidence(0.3, age_s=2.5))
    assert state.step == LadderStep.DEFER_BATCH and state.stale
    assert "2.5 s old (stale after 2.0 s)" in state.reason
    # Stale evidence of a worse load keeps the worse step.
    assert OverloadLadder().update(evidence(1.5, age_s=10.0)).step == 6
    fresh = OverloadLadder().update(evidence(0.3, age_s=1.9))
    assert fresh.step == 0 and not fresh.stale
    # Unknown gathering time is stale.
    assert OverloadLadder().update(evidence(0.3, age_s=math.inf)).stale


def test_recovery_from_stale_waits_for_the_hold() -> None:
    ladder = OverloadLadder(now=0.0)
    assert ladder.update(evidence(0.3, now=0.0, age_s=5.0)).step == 4
    # Calm read on stale evidence does not count toward the hold: it starts with fresh evidence.
    state = ladder.update(evidence(0.3, now=0.5))
    assert state.step == 4 and not state.stale and state.calm_since == 0.5
    assert ladder.update(evidence(0.3, now=1.4)).step == 4
    assert ladder.update(evidence(0.3, now=1.5)).step == 0


def test_zero_capacity_is_maximally_loaded() -> None:
    state = OverloadLadder().update(evidence(offered=1000.0, capacity=0.0, healthy=0))
    assert state.step == LadderStep.PROTECT_ADMITTED
    assert "no protected capacity (0/24 devices healthy)" in state.reason
    # Even with no demand: with no devices there is nothing to admit onto.
    assert evidence(offered=0.0, capacity=0.0, healthy=0).utilization == math.inf
    assert protected_capacity_ms_per_s(0) == 0.0


def test_unreadable_demand_is_maximally_loaded() -> None:
    for offered in (math.nan, math.inf, -1.0):
        state = OverloadLadder().update(evidence(offered=offered))
        assert state.step == LadderStep.PROTECT_ADMITTED, offered
        assert "unreadable" in state.reason


# --------------------------------------------------------------------------- effects


def test_effects_are_cumulative_per_step() -> None:
    rows = [
        (
            e.shadow_enabled,
            e.reduce_output,
            e.fallback_for_eligible,
            e.defer_batch,
            e.reject_new_interactive,
            e.protect_control_only,
        )
        for e in (effects(step) for step in range(7))
    ]
    assert rows == [
        (True, False, False, False, False, False),
        (False, False, False, False, False, False),
        (False, True, False, False, False, False),
        (False, True, True, False, False, False),
        (False, True, True, True, False, False),
        (False, True, True, True, True, False),
        (False, True, True, True, True, True),
    ]
    # The steps are the seed's ladder, in its order, and effects(n) is step n's.
    assert [(int(s), s.name) for s in LadderStep] == [
        (0, "NORMAL"),
        (1, "SHED_OPTIONAL"),
        (2, "REDUCE_OUTPUT"),
        (3, "FALLBACK"),
        (4, "DEFER_BATCH"),
        (5, "REJECT_INTERACTIVE"),
        (6, "PROTECT_ADMITTED"),
    ]
    assert [effects(step).step for step in range(7)] == list(range(7))
    for bad in (-1, 7):
        with pytest.raises(ValueError):
            effects(bad)


# --------------------------------------------------------------------------- retry-after


def test_retry_after_follows_the_drain() -> None:
    # 8,400 ms of backlog at 16,800 ms/s protected, no excess: 500 ms.
    calm = evidence(0.5, queued_accelerator_ms=8_400.0)
    assert drain_ms(calm) == pytest.approx(500.0)
    assert retry_after_ms(calm).ms == 500
    # More backlog, longer wait. The backlog is the predicted work queued in or bound through
    # the gateway (everything in Triton's queue for the pool came through it): no separate
    # count of Triton's pending requests is added, whatever the mean request costs.
    more = evidence(0.5, queued_accelerator_ms=12_600.0, mean_request_ms=105.0)
    assert more.backlog_ms == pytest.approx(12_600.0)
    assert retry_after_ms(more).ms == 750
    assert "backend_pending" not in LoadEvidence.__dataclass_fields__
    # The seed's surge: 3,661 ms/s excess over the 10 s window adds 36,610 ms of work ahead.
    surge = evidence(offered=20_461.0, queued_accelerator_ms=8_400.0)
    assert surge.window_s == 10.0
    assert drain_ms(surge) == pytest.approx(1000 * (8_400 + 3_661 * 10.0) / 16_800)
    advice = retry_after_ms(surge)
    assert advice.ms == math.ceil(advice.drain_ms) == 2680
    assert "excess 3661 ms/s x 10.0 s" in advice.reason
    # A shorter window of the same excess means less work ahead.
    assert retry_after_ms(evidence(offered=20_461.0, queued_accelerator_ms=8_400.0, window_s=5.0)).ms == 1590


def test_retry_after_is_bounded_with_reasons() -> None:
    idle = retry_after_ms(evidence(0.2))
    assert idle.ms == 100 and idle.drain_ms == 0.0 and "100 ms floor" in idle.reason
    flooded = retry_after_ms(evidence(0.5, queued_accelerator_ms=10_000_000.0))
    assert flooded.ms == 30_000 and flooded.drain_ms > 30_000 and "capped at 30000 ms" in flooded.reason
    lost = retry_after_ms(evidence(offered=5_000.0, capacity=0.0, healthy=0))
    # Every device lost: nothing drains, so no drain is priced; the advice is the health
    # re-check horizon, not the cap (a backend back in 1 s must not wait out 30 s of backoff).
    assert lost.ms == 1_000 and lost.drain_ms == math.inf and "no protected capacity" in lost.reason
    assert "re-check horizon, 1000 ms" in lost.reason
    assert (
        retry_after_ms(
            lost_evidence := evidence(offered=5_000.0, capacity=0.0, healthy=0),
            LadderConfig(retry_after_no_capacity_ms=2_500),
        ).ms
        == 2_500
    )
    # The horizon stays within the configured bounds.
    assert (
        retry_after_ms(lost_evidence, LadderConfig(retry_after_min_ms=10, retry_after_max_ms=500)).ms == 500
    )
    unreadable = retry_after_ms(evidence(offered=math.nan))
    assert unreadable.ms == 30_000
    config = LadderConfig(retry_after_min_ms=10, retry_after_max_ms=1_000)
    assert retry_after_ms(evidence(0.2), config).ms == 10
    assert retry_after_ms(evidence(0.5, queued_accelerator_ms=10_000_000.0), config).ms == 1_000


# --------------------------------------------------------------------------- windows


def test_demand_window_rate_over_the_window() -> None:
    window = DemandWindow(window_s=5.0, buckets=50)
    # The seed's mix for 10 s, 100 ms ticks: 14 short each tick, 2 long on 9 ticks of 10 (140 + 18 /s).
    for tick in range(100):
        now = 1000.0 + tick * 0.1
        for _ in range(14):
            window.add(now, SHORT_MS)
        for _ in range(2 if tick % 10 else 0):
            window.add(now, LONG_MS)
    # Near the end of the last tick's bucket the window covers 4.999 s of its last 50 buckets.
    end = 1000.0 + 99 * 0.1 + 0.099
    assert window.count(end) == 5 * (140 + 18)
    last_5_s = 700 * SHORT_MS + 90 * LONG_MS  # ticks 50-99: 9 of every 10 carry two long
    assert window.total_ms(end) == pytest.approx(last_5_s)
    assert window.rate_ms_per_s(end) == pytest.approx(last_5_s / 4.999)
    assert window.rate_ms_per_s(end) == pytest.approx(16_368.8, rel=0.02)
    assert window.mean_ms(end) == pytest.approx(16_368.8 / 158, rel=0.02)
    # Everything ages out after one window of silence.
    assert window.rate_ms_per_s(end + 5.1) == 0.0
    assert window.count(end + 5.1) == 0 and window.mean_ms(end + 5.1) == 0.0


def test_demand_window_exact_arithmetic() -> None:
    window = DemandWindow(window_s=1.0, buckets=10)
    window.add(10.00, 100.0)
    window.add(10.05, 50.0)
    window.add(10.95, 250.0)
    # By 10.95 the window spans all 10 buckets, the current one [10.9, 11.0) only for the half of
    # it that has passed: 400 ms over 0.95 s, not diluted over the whole bucket.
    assert window.rate_ms_per_s(10.95) == pytest.approx(400.0 / 0.95)
    assert window.total_ms(10.95) == pytest.approx(400.0) and window.count(10.95) == 3
    # At the bucket's very end, the whole second: 400 ms/s.
    assert window.rate_ms_per_s(10.99999) == pytest.approx(400.0, rel=1e-4)
    # At 11.05 the bucket [10.0, 10.1) has left the window: 250 ms over [11.0 - 0.9, 11.05).
    assert window.total_ms(11.05) == pytest.approx(250.0)
    assert window.rate_ms_per_s(11.05) == pytest.approx(250.0 / 0.95)
    # At a bucket's very start the current bucket counts for no time: 0.9 s of whole buckets.
    assert window.rate_ms_per_s(11.0) == pytest.approx(250.0 / 0.9)
    # A sample older than the window is dropped, not counted into a newer bucket.
    window.add(9.0, 1e6)
    assert window.total_ms(11.05) == pytest.approx(250.0)


def test_demand_window_young_window_is_not_diluted() -> None:
    window = DemandWindow(window_s=5.0, buckets=50)
    for i in range(30):  # 3 s of 1,000 ms/s, 100 ms at the start of every bucket
        window.add(50.0 + i * 0.1, 100.0)
    # Measured over the 2.95 s since its first bucket began, not over 5 s (which would read
    # 600 ms/s: fail open).
    assert window.rate_ms_per_s(52.95) == pytest.approx(3000.0 / 2.95)
    assert window.rate_ms_per_s(52.95) > 1000.0


def test_demand_window_damps_a_start_up_burst() -> None:
    window = DemandWindow(window_s=5.0, buckets=50)
    for i in range(5):  # a burst of 500 ms in the first half second
        window.add(50.0 + i * 0.1, 100.0)
    # Never measured over less than half the window: 500 ms / 2.5 s, not 500 ms / 0.5 s.
    assert window.rate_ms_per_s(50.45) == pytest.approx(200.0)


def test_demand_window_memory_is_bounded() -> None:
    window = DemandWindow(window_s=5.0, buckets=50)
    rng = random.Random(1)
    now = 0.0
    for _ in range(200_000):
        now += rng.expovariate(2_000.0)
        window.add(now, rng.choice((SHORT_MS, LONG_MS)))
    assert len(window._sums) == len(window._sumsq) == len(window._counts) == len(window._epochs) == 50
    assert not hasattr(window, "__dict__")
    assert window.count(now) == pytest.approx(2_000 * 5, rel=0.05)
    with pytest.raises(ValueError):
        DemandWindow(buckets=0)
    with pytest.raises(ValueError):
        DemandWindow(window_s=0.0)
    with pytest.raises(ValueError):
        window.add(now, math.nan)
    with pytest.raises(ValueError):
        window.add(math.nan, 1.0)


def test_dwell_window_p95_and_bounds() -> None:
    dwell = DwellWindow(window_s=5.0, capacity=100)
    for i in range(100):
        dwell.add(10.0 + i * 0.01, float(i + 1))  # 1..100 ms
    assert dwell.p95_ms(11.0) == 95.0 and dwell.count(11.0) == 100
    assert dwell.quantile_ms(11.0, 0.5) == 50.0
    assert dwell.count(15.505) == 49  # the samples after 10.505 s are still inside the 5 s window
    assert dwell.p95_ms(20.0) == 0.0 and dwell.count(20.0) == 0  # all aged out
    for i in range(1000):
        dwell.add(30.0 + i * 0.001, 5.0)
    assert len(dwell._dwell_ms) == 100 and dwell.p95_ms(31.0) == 5.0 and dwell.count(31.0) == 100
    with pytest.raises(ValueError):
        dwell.add(31.0, -1.0)


# --------------------------------------------------------------------------- configuration


def test_demand_reading_is_the_rate_with_its_compound_poisson_standard_error() -> None:
    window = DemandWindow(window_s=10.0, buckets=100)
    window.add(9.05, 100.0)
    window.add(9.55, 50.0)
    window.add(9.95, 250.0)
    window.add(5.05, 400.0)
    # The 1 s span at 9.99 s: the nine whole buckets [9.0, 9.9) and the 0.09 s of [9.9, 10.0)
    # that has passed, 0.99 s.
    one = window.reading(9.99, 1.0)
    assert one.span_s == pytest.approx(0.99) and one.count == 3
    assert one.offered_ms_per_s == pytest.approx(400.0 / 0.99)
    assert one.sigma_ms_per_s == pytest.approx(math.sqrt(100**2 + 50**2 + 250**2) / 0.99)
    assert one.lower_bound(2.5) == pytest.approx((400.0 - 2.5 * math.sqrt(75_000.0)) / 0.99)
    # Over 10 s the window's age (first sample at 5.05 s, in bucket 50) is 50 buckets, half the
    # span: the young-window floor, 5 s whatever part of the current bucket has passed.
    whole = window.reading(9.99)
    assert whole.span_s == pytest.approx(5.0) and whole.count == 4
    assert whole.offered_ms_per_s == pytest.approx(800.0 / 5.0)
    assert whole.sigma_ms_per_s == pytest.approx(math.sqrt(75_000.0 + 400.0**2) / 5.0)
    # Older than the floor, it is read over its age: at 10.06 s (bucket 100, age 51) the 50
    # whole buckets since 5.0 s and the 0.06 s of the current one, 5.06 s.
    assert window.reading(10.06).span_s == pytest.approx(5.06)
    assert window.reading(10.0).span_s == pytest.approx(5.0)  # no jump at the floor's end
    # The span is whole buckets: 4 s are the last 40, the current one as far as it has passed.
    four = window.reading(9.99, 4.0)
    assert four.span_s == pytest.approx(3.99) and four.count == 3
    # A young window reads a span over its age, never less than half the span.
    young = DemandWindow(window_s=10.0, buckets=100)
    young.add(0.05, 300.0)
    assert young.reading(0.29, 1.0).span_s == pytest.approx(0.5)  # age 3 buckets: the floor (5)
    assert young.reading(0.49, 1.0).span_s == pytest.approx(0.5)  # age 5: still the floor
    assert young.reading(0.59, 1.0).span_s == pytest.approx(0.59)  # age 6: 0.5 s + 0.09 s
    assert young.reading(0.79, 1.0).span_s == pytest.approx(0.79)
    assert young.reading(0.79, 1.0).offered_ms_per_s == pytest.approx(300.0 / 0.79)
    # Empty: no demand, no error.
    empty = DemandWindow().reading(50.0, 2.0)
    assert (empty.offered_ms_per_s, empty.sigma_ms_per_s, empty.count) == (0.0, 0.0, 0)
    assert DEFAULT_SPANS_S == (1.0, 2.0, 4.0, 10.0)


def test_seed_mix_standard_errors_match_the_documented_figures() -> None:
    """The module's figures for the seed's fleet: 662 ms/s (3.9 % of protected) at 10 s and
    1,480 ms/s (8.8 %) at 2 s, read off a window filled with the seed's mix at the very end of
    its last bucket (each span then covers all of its seconds)."""
    window = DemandWindow()
    for tick in range(100):  # 14 short every tick, 2 long on 9 ticks of 10: 140 + 18 per second
        now = 100.0 + tick * 0.1 + 0.05
        for _ in range(14):
            window.add(now, SHORT_MS)
        for _ in range(2 if tick % 10 else 0):
            window.add(now, LONG_MS)
    end = 110.0 - 1e-9
    ten, two = window.reading(end, 10.0), window.reading(end, 2.0)
    assert ten.span_s == pytest.approx(10.0) and two.span_s == pytest.approx(2.0)
    assert ten.offered_ms_per_s == pytest.approx(SEED_NORMAL)
    assert ten.sigma_ms_per_s == pytest.approx(662.4, abs=0.1)
    assert ten.sigma_ms_per_s / SEED_CAPACITY == pytest.approx(0.039, abs=0.001)
    assert two.sigma_ms_per_s == pytest.approx(1481.1, abs=0.1)
    assert two.sigma_ms_per_s / SEED_CAPACITY == pytest.approx(0.088, abs=0.001)


# --------------------------------------------------------------------------- configuration


def test_config_rejects_inconsistent_ladders() -> None:
    with pytest.raises(ValidationError):
        LadderSchema(fallback_at=1.02)  # below reduce_output_at (1.03)
    with pytest.raises(ValidationError):
        LadderSchema(hysteresis=1.0)  # step 0 unreachable: nothing is below 1.00 - 1.00
    assert LadderSchema(hysteresis=0.99).value().leaves_below(LadderStep.SHED_OPTIONAL) == pytest.approx(0.01)
    with pytest.raises(ValidationError):
        LadderSchema(retry_after_min_ms=5_000, retry_after_max_ms=1_000)
    with pytest.raises(ValidationError):
        LadderSchema(confidence_z=-1.0)
    with pytest.raises(ValidationError):
        LadderSchema(dwell_min_samples=0)
    for bad in (0.0, 1.01):
        with pytest.raises(ValidationError):
            LadderSchema(plan_utilization=bad)
    with pytest.raises(ValidationError):
        LadderSchema.model_validate({"surprise": 1})
    config = LadderSchema.model_validate({"stale_step": 5, "dwell_step": 2}).value()
    assert isinstance(config, LadderConfig)
    assert config.stale_step is LadderStep.REJECT_INTERACTIVE
    assert LadderSchema().value() == DEFAULT_LADDER  # the schema's defaults are the core's
    with pytest.raises(FrozenInstanceError):
        DEFAULT_LADDER.hold_s = 0.0  # type: ignore[misc]
    assert DEFAULT_LADDER.leaves_below(LadderStep.SHED_OPTIONAL) == pytest.approx(0.95)
    assert DEFAULT_LADDER.leaves_below(LadderStep.REDUCE_OUTPUT) == pytest.approx(0.98)
    assert DEFAULT_LADDER.leaves_below(LadderStep.FALLBACK) == pytest.approx(1.01)
    assert DEFAULT_LADDER.leaves_below(LadderStep.PROTECT_ADMITTED) == pytest.approx(1.38)


# --------------------------------------------------------------------------- shedder


def test_shedder_sheds_the_excess_not_everything() -> None:
    shedder = Shedder()
    # The seed's surge: 20,461 ms/s offered on a 16,800 ms/s envelope -> admit 82.1 %.
    admitted = sum(shedder.admit(20_461.0, 16_800.0) for _ in range(10_000))
    assert admitted == pytest.approx(8_211, abs=2)
    assert all(Shedder().admit(10_000.0, 16_800.0) for _ in range(100))  # under the envelope: none shed
    assert not any(Shedder().admit(5_000.0, 0.0) for _ in range(100))  # no capacity: everything shed


def test_shedder_picks_a_share_evenly() -> None:
    picker = Shedder()
    picked = [picker.pick(0.25) for _ in range(10_000)]
    assert sum(picked) == 2_500
    # Evenly spread: every run of four calls holds exactly one pick (no bursts).
    assert all(sum(picked[i : i + 4]) == 1 for i in range(0, 10_000, 4))
    assert all(Shedder().pick(1.0) for _ in range(100)) and all(Shedder().pick(1.5) for _ in range(100))
    for nothing in (0.0, -0.5, math.nan):
        assert not any(Shedder().pick(nothing) for _ in range(100))


# --------------------------------------------------------------------------- fair shares


def flows(*specs: tuple[str, str, float, float, float]) -> list[FlowDemand]:
    """(class, tenant, offered, tenant weight, class weight) per flow."""
    return [
        FlowDemand((c, t), offered, weight, class_weight) for c, t, offered, weight, class_weight in specs
    ]


def test_water_filling_gives_an_in_share_flow_all_it_asks() -> None:
    # Equal weights, capacity 1.0: a asks 0.2 (under its half) and gets it; b gets the rest.
    alloc = fair_allocation(flows(("i", "a", 0.2, 1, 1), ("i", "b", 5.0, 1, 1)), 1.0)
    assert alloc[("i", "a")] == pytest.approx(0.2) and alloc[("i", "b")] == pytest.approx(0.8)
    # Both over their share: split 2 : 1 by weight.
    alloc = fair_allocation(flows(("i", "a", 5.0, 2, 1), ("i", "b", 5.0, 1, 1)), 1.0)
    assert alloc[("i", "a")] == pytest.approx(2 / 3) and alloc[("i", "b")] == pytest.approx(1 / 3)
    # Several levels: c (0.1) is satisfied, then b and d split the rest 1 : 2 at level 0.3.
    alloc = fair_allocation(flows(("i", "c", 0.1, 1, 1), ("i", "b", 0.5, 1, 1), ("i", "d", 0.9, 2, 1)), 1.0)
    assert [alloc[("i", t)] for t in "cbd"] == pytest.approx([0.1, 0.3, 0.6])
    # Everyone fits: everyone gets its demand, nothing more.
    alloc = fair_allocation(flows(("i", "a", 0.2, 1, 1), ("i", "b", 0.3, 5, 1)), 1.0)
    assert alloc == pytest.approx({("i", "a"): 0.2, ("i", "b"): 0.3})
    # An idle flow gets nothing and takes no share from the others.
    alloc = fair_allocation(flows(("i", "a", 0.0, 100, 1), ("i", "b", 5.0, 1, 1)), 1.0)
    assert alloc == pytest.approx({("i", "a"): 0.0, ("i", "b"): 1.0})


def test_fair_allocation_is_hierarchical() -> None:
    # Classes first (interactive 3 : batch 1), then tenants inside each class by tenant weight.
    # batch's tenant weight (5) counts only inside batch.
    spec = flows(
        ("interactive", "a", 10.0, 1, 3), ("interactive", "b", 10.0, 2, 3), ("batch", "c", 10.0, 5, 1)
    )
    alloc = fair_allocation(spec, 8.0)
    assert alloc[("interactive", "a")] == pytest.approx(2.0)
    assert alloc[("interactive", "b")] == pytest.approx(4.0)
    assert alloc[("batch", "c")] == pytest.approx(2.0)
    # A class under its share lends the rest to the other class.
    quiet = flows(
        ("interactive", "a", 1.0, 1, 3), ("interactive", "b", 0.0, 2, 3), ("batch", "c", 10.0, 5, 1)
    )
    alloc = fair_allocation(quiet, 8.0)
    assert alloc == pytest.approx({("interactive", "a"): 1.0, ("interactive", "b"): 0.0, ("batch", "c"): 7.0})


def test_without_lending_each_flow_is_capped_at_its_weighted_share() -> None:
    # Step 6: a gets its 0.2; b gets its own half, not the 0.8 water-filling would lend it.
    two = flows(("i", "a", 0.2, 1, 1), ("i", "b", 5.0, 1, 1))
    assert fair_allocation(two, 1.0, lend_idle=False) == pytest.approx({("i", "a"): 0.2, ("i", "b"): 0.5})
    weighted = flows(("i", "orchid", 0.5, 2, 1), ("i", "lumen", 3.9, 1, 1))
    alloc = fair_allocation(weighted, 1.0, lend_idle=False)
    assert alloc == pytest.approx({("i", "orchid"): 0.5, ("i", "lumen"): 1 / 3})
    # Hierarchical too: batch holds to its class share (1/4 of 8) though interactive asks for 1.
    quiet = flows(("interactive", "a", 1.0, 1, 3), ("batch", "c", 10.0, 5, 1))
    alloc = fair_allocation(quiet, 8.0, lend_idle=False)
    assert alloc == pytest.approx({("interactive", "a"): 1.0, ("batch", "c"): 2.0})


def test_fair_allocation_without_usable_capacity_allocates_nothing() -> None:
    spec = flows(("i", "a", 0.2, 1, 1), ("i", "b", 5.0, 1, 1))
    for capacity in (0.0, -1.0, math.nan, math.inf):
        for lend in (True, False):
            assert fair_allocation(spec, capacity, lend_idle=lend) == {("i", "a"): 0.0, ("i", "b"): 0.0}
    assert fair_allocation([], 1.0) == {}


def test_water_filling_properties_on_random_flows() -> None:
    """Work-conserving weighted max-min fairness, on 300 random single-class cases: nobody gets
    more than it asks, the envelope is filled up to the total demand, and a flow that gets less
    than it asks has at least the weighted level of every other flow. Without lending, each
    flow gets exactly the lesser of its demand and its own weighted share, never more than
    with lending."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 6)
        demand = [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(n)]
        weight = [rng.uniform(0.1, 5.0) for _ in range(n)]
        capacity = rng.uniform(0.5, 5.0)
        spec = [FlowDemand(("i", str(k)), demand[k], weight[k]) for k in range(n)]
        lent = fair_allocation(spec, capacity)
        alloc = [lent[("i", str(k))] for k in range(n)]
        assert all(-1e-9 <= a <= d + 1e-9 for a, d in zip(alloc, demand, strict=True))
        assert sum(alloc) == pytest.approx(min(capacity, sum(demand)), abs=1e-6)
        for k in range(n):
            if alloc[k] < demand[k] - 1e-6:
                assert all(alloc[k] / weight[k] >= alloc[j] / weight[j] - 1e-6 for j in range(n))
        kept = fair_allocation(spec, capacity, lend_idle=False)
        active = sum(w for w, d in zip(weight, demand, strict=True) if d > 0)
        for k in range(n):
            own_share = capacity * weight[k] / active if demand[k] > 0 else 0.0
            # Each flow gets exactly its own weighted share, or its demand if that is less.
            assert kept[("i", str(k))] == pytest.approx(min(demand[k], own_share), abs=1e-9)
            assert kept[("i", str(k))] <= alloc[k] + 1e-9


def test_without_lending_a_flow_inside_its_own_share_keeps_its_demand() -> None:
    # One class, equal weights, capacity 1.0: b's own share is 0.5 and it asks 0.5; a asks 0.1.
    # Step 6 lends nothing, but b is inside its own share and gets all of it (0.4 stays idle):
    # the class keeps its whole weighted share (1.0), not its demand (0.6), for its tenants
    # to split, each up to its own part.
    spec = flows(("i", "a", 0.1, 1, 1), ("i", "b", 0.5, 1, 1))
    assert fair_allocation(spec, 1.0, lend_idle=False) == pytest.approx({("i", "a"): 0.1, ("i", "b"): 0.5})
    # Across classes too: a quiet class's idle share is not lent, a class under its share keeps
    # what its tenants ask. interactive (weight 3) holds 6 of 8, batch (weight 1) 2.
    spec = flows(("interactive", "a", 1.0, 1, 3), ("interactive", "b", 4.0, 1, 3), ("batch", "c", 10.0, 1, 1))
    alloc = fair_allocation(spec, 8.0, lend_idle=False)
    assert alloc == pytest.approx({("interactive", "a"): 1.0, ("interactive", "b"): 3.0, ("batch", "c"): 2.0})


# --------------------------------------------------------------------------- per-flow plans


def plan(
    spec: list[FlowDemand],
    step: int,
    *,
    capacity: float = SEED_CAPACITY,
    reliefs: dict[tuple[str, str], FlowRelief] | None = None,
    reduce_saving: float = 0.2,
    fallback_saving: float = 0.45,
    reduce_quality_loss: float = 0.0,
    fallback_quality_loss: float = 0.0,
) -> dict[tuple[str, str], FlowPlan]:
    return plan_flows(
        spec,
        reliefs or {},
        capacity_ms_per_s=capacity,
        step=LadderStep(step),
        reduce_saving=reduce_saving,
        fallback_saving=fallback_saving,
        reduce_quality_loss=reduce_quality_loss,
        fallback_quality_loss=fallback_quality_loss,
        exempt_classes=frozenset({"control"}),
    )


NEIGHBOURS = flows(
    ("interactive", "orchid", 0.5 * SEED_CAPACITY, 2, 1), ("interactive", "lumen", 3.9 * SEED_CAPACITY, 1, 1)
)
ORCHID, LUMEN = ("interactive", "orchid"), ("interactive", "lumen")


def test_noisy_neighbour_plan_step_by_step() -> None:
    """orchid (weight 2) at 0.5 of the plan's capacity, lumen (weight 1) at 3.9x: every step's
    mechanism falls on lumen's excess only; orchid, inside its share, is never touched. Lumen's
    allocation is what orchid leaves (0.5) up to step 5, its own third at step 6."""
    for step in LadderStep:
        plans = plan(NEIGHBOURS, step)
        orchid = plans[ORCHID]
        assert orchid.allocation_ms_per_s == pytest.approx(0.5 * SEED_CAPACITY), step
        assert (orchid.excess_ms_per_s, orchid.reduce_share, orchid.divert_share) == (0.0, 0.0, 0.0), step
        assert orchid.admit_share == 1.0, step
        lumen = plans[LUMEN]
        allocation = SEED_CAPACITY / 3 if step == 6 else 0.5 * SEED_CAPACITY
        assert lumen.allocation_ms_per_s == pytest.approx(allocation), step
        assert lumen.excess_ms_per_s == pytest.approx(3.9 * SEED_CAPACITY - allocation), step
        assert lumen.reduce_share == (1.0 if step >= 2 else 0.0), step
        assert lumen.divert_share == (1.0 if step >= 3 else 0.0), step
        admit = allocation / (3.9 * SEED_CAPACITY) if step >= 5 else 1.0
        assert lumen.admit_share == pytest.approx(admit), step
    assert plan(NEIGHBOURS, 5)[LUMEN].admit_share == pytest.approx(0.5 / 3.9)
    assert plan(NEIGHBOURS, 6)[LUMEN].admit_share == pytest.approx((1 / 3) / 3.9)


def test_admit_share_counts_what_admitted_work_measurably_runs_at() -> None:
    # lumen's admitted work runs at 60 % of its offered price (diverted to the fallback): its
    # allocation carries 1 / 0.6 as many requests.
    relief = {LUMEN: FlowRelief(offered_ms_per_s=1000.0, running_ms_per_s=600.0)}
    assert plan(NEIGHBOURS, 5, reliefs=relief)[LUMEN].admit_share == pytest.approx(0.5 / (3.9 * 0.6))
    assert FlowRelief().relief == 1.0  # nothing admitted yet: no relief
    assert FlowRelief(offered_ms_per_s=100.0, running_ms_per_s=150.0).relief == 1.0  # never above 1
    # Of 1,000 ms/s admitted running at 600, capping saved 100: the fallback the other 300.
    measured = FlowRelief(offered_ms_per_s=1000.0, running_ms_per_s=600.0, reduced_ms_per_s=100.0)
    assert measured.diverted_ms_per_s == pytest.approx(300.0)
    assert FlowRelief(offered_ms_per_s=100.0, running_ms_per_s=150.0).diverted_ms_per_s == 0.0


SURGE_FLOW = flows(("interactive", "orchid", SEED_SURGE, 1, 1))
SOLO = ("interactive", "orchid")
SURGE_EXCESS = SEED_SURGE - SEED_CAPACITY  # over a plan capacity of 16,800 ms/s


def test_surge_plan_diverts_first_when_quality_costs_are_equal() -> None:
    """The seed's surge (20,461 ms/s) on a plan capacity of 16,800: step 2 caps (1.218 - 1) /
    (1.218 x 0.2) = 89.5 % of the requests' output; from step 3, with no modeled quality
    difference, the fallback goes first (it saves 45 % of a price, a cap 20 %: fewer answers
    degraded) and diverts (1.218 - 1) / (1.218 x 0.45) = 39.8 %; capping is planned only for
    what diverting has not measurably saved. Nobody is refused before step 5."""
    at_2 = plan(SURGE_FLOW, 2)[SOLO]
    assert at_2.excess_ms_per_s == pytest.approx(SURGE_EXCESS)
    assert at_2.reduce_share == pytest.approx(SURGE_EXCESS / (SEED_SURGE * 0.2))
    assert at_2.reduce_share == pytest.approx(0.8946, abs=1e-4)
    assert at_2.divert_share == 0.0 and at_2.admit_share == 1.0
    at_3 = plan(SURGE_FLOW, 3)[SOLO]
    assert at_3.divert_share == pytest.approx(SURGE_EXCESS / (SEED_SURGE * 0.45))
    assert at_3.divert_share == pytest.approx(0.3976, abs=1e-4) and at_3.admit_share == 1.0
    assert at_3.reduce_share == pytest.approx(at_2.reduce_share)  # nothing measured yet
    # Diverted work measurably saved 2,000 of the 3,661 ms/s excess: cap for the rest only.
    saved = {SOLO: FlowRelief(offered_ms_per_s=SEED_SURGE, running_ms_per_s=SEED_SURGE - 2_000.0)}
    partly = plan(SURGE_FLOW, 3, reliefs=saved)[SOLO]
    assert partly.reduce_share == pytest.approx((SURGE_EXCESS - 2_000.0) / (SEED_SURGE * 0.2))
    assert partly.divert_share == pytest.approx(at_3.divert_share)
    covered = {SOLO: FlowRelief(offered_ms_per_s=SEED_SURGE, running_ms_per_s=SEED_SURGE - SURGE_EXCESS)}
    assert plan(SURGE_FLOW, 4, reliefs=covered)[SOLO].reduce_share == 0.0


def test_measured_reduction_comes_first_and_lowers_the_divert_share() -> None:
    """When a capped output costs less modeled quality per accelerator-ms saved than a fallback
    answer (0.01 / 0.2 < 0.1 / 0.45), capping goes first, and what it measurably saved is taken
    off the excess before the fallback's share is planned."""
    at_3 = plan(SURGE_FLOW, 3, reduce_quality_loss=0.01, fallback_quality_loss=0.1)[SOLO]
    assert at_3.reduce_share == pytest.approx(SURGE_EXCESS / (SEED_SURGE * 0.2))
    assert at_3.divert_share == pytest.approx(SURGE_EXCESS / (SEED_SURGE * 0.45))  # nothing measured yet
    reduced = {SOLO: FlowRelief(reduced_ms_per_s=0.1 * SEED_CAPACITY)}
    after = plan(SURGE_FLOW, 3, reliefs=reduced, reduce_quality_loss=0.01, fallback_quality_loss=0.1)[SOLO]
    assert after.divert_share == pytest.approx((SURGE_EXCESS - 0.1 * SEED_CAPACITY) / (SEED_SURGE * 0.45))
    assert after.divert_share == pytest.approx(0.2152, abs=1e-4) and after.divert_share < at_3.divert_share
    assert after.reduce_share == pytest.approx(at_3.reduce_share)
    # Reduction that saved the whole excess leaves nothing to divert.
    covered = {SOLO: FlowRelief(reduced_ms_per_s=SURGE_EXCESS)}
    reduced_first = plan(SURGE_FLOW, 4, reliefs=covered, reduce_quality_loss=0.01, fallback_quality_loss=0.1)
    assert reduced_first[SOLO].divert_share == 0.0
    # The other way round (a fallback answer costs less quality per ms saved): fallback first,
    # and measured reduction no longer lowers its share.
    first = plan(SURGE_FLOW, 3, reliefs=reduced, reduce_quality_loss=0.1, fallback_quality_loss=0.01)[SOLO]
    assert first.divert_share == pytest.approx(at_3.divert_share)


def test_degradations_of_equal_quality_cost_degrade_the_fewest_answers() -> None:
    """The example routes: a capped output loses 0.03 of modeled quality for ~21 % of a price
    saved, a fallback answer 0.06 for 39-45 %. Per accelerator-ms saved they cost the same
    within the scores' precision (QUALITY_TIE), whichever way the learned savings wobble, so
    the fallback, which degrades about half as many answers for the same saving, goes first
    every time; a real difference in quality cost still decides the order."""
    for fallback_saving in (0.388, 0.43, 0.45):
        tied = plan(
            SURGE_FLOW,
            3,
            reduce_saving=0.221,
            fallback_saving=fallback_saving,
            reduce_quality_loss=0.03,
            fallback_quality_loss=0.06,
        )[SOLO]
        assert tied.divert_share == pytest.approx(SURGE_EXCESS / (SEED_SURGE * fallback_saving))
        # Fallback first: with nothing measured yet the cap is planned for the whole excess too,
        # but measured diversion takes it off (reduce-first would ignore it).
        diverted = {SOLO: FlowRelief(offered_ms_per_s=SEED_SURGE, running_ms_per_s=SEED_SURGE - SURGE_EXCESS)}
        covered = plan(
            SURGE_FLOW,
            3,
            reliefs=diverted,
            reduce_saving=0.221,
            fallback_saving=fallback_saving,
            reduce_quality_loss=0.03,
            fallback_quality_loss=0.06,
        )[SOLO]
        assert covered.reduce_share == 0.0 and covered.divert_share == pytest.approx(tied.divert_share)
    # Outside the tie (a fallback answer losing twice as much per ms saved), capping goes first.
    capped_first = plan(
        SURGE_FLOW,
        3,
        reliefs={SOLO: FlowRelief(reduced_ms_per_s=SURGE_EXCESS)},
        reduce_saving=0.221,
        fallback_saving=0.43,
        reduce_quality_loss=0.03,
        fallback_quality_loss=0.12,
    )[SOLO]
    assert capped_first.divert_share == 0.0


def test_learned_savings_are_floored_at_5_percent() -> None:
    # A saving of ~0 would make every request a candidate for a mechanism that saves nothing.
    small = flows(("interactive", "orchid", 17_000.0, 1, 1))
    reduce_only = plan(small, 2, reduce_saving=0.0)[SOLO]
    assert reduce_only.reduce_share == pytest.approx(200.0 / (17_000.0 * 0.05))
    both = plan(small, 3, reduce_saving=0.2, fallback_saving=0.01)[SOLO]
    assert both.divert_share == pytest.approx(200.0 / (17_000.0 * 0.05))


def test_in_share_flows_pay_only_when_the_pool_cannot_carry_them() -> None:
    # Two tenants, equal weight, each at 0.8: each is over its half, so each sheds its own excess.
    pair = flows(
        ("interactive", "a", 0.8 * SEED_CAPACITY, 1, 1), ("interactive", "b", 0.8 * SEED_CAPACITY, 1, 1)
    )
    plans = plan(pair, 5)
    assert plans[("interactive", "a")].admit_share == pytest.approx(0.5 / 0.8)
    assert plans[("interactive", "b")].admit_share == pytest.approx(0.5 / 0.8)
    # Inside the envelope in total, nobody has an excess at steps 0-5. At step 6 nothing is
    # lent: a (inside its half) keeps all it asks, b is held to its own half.
    fit = flows(
        ("interactive", "a", 0.3 * SEED_CAPACITY, 1, 1), ("interactive", "b", 0.6 * SEED_CAPACITY, 1, 1)
    )
    for step in range(6):
        assert all(p.excess_ms_per_s == 0.0 and p.admit_share == 1.0 for p in plan(fit, step).values())
    protected = plan(fit, 6)
    assert protected[("interactive", "a")].excess_ms_per_s == 0.0
    assert protected[("interactive", "a")].admit_share == 1.0
    assert protected[("interactive", "b")].allocation_ms_per_s == pytest.approx(0.5 * SEED_CAPACITY)
    assert protected[("interactive", "b")].admit_share == pytest.approx(0.5 / 0.6)
    # No capacity at all: every flow is all excess, refused from step 5.
    assert plan(pair, 5, capacity=0.0)[("interactive", "a")].admit_share == 0.0


def test_control_work_is_never_planned_to_shed() -> None:
    spec = flows(
        ("control", "ops", 2.0 * SEED_CAPACITY, 1, 1), ("interactive", "lumen", 2.0 * SEED_CAPACITY, 1, 1)
    )
    for step in LadderStep:
        control = plan(spec, step)[("control", "ops")]
        assert (control.reduce_share, control.divert_share, control.admit_share) == (0.0, 0.0, 1.0), step
        assert control.excess_ms_per_s == 0.0
    # It still counts for its class's share: lumen is held to the other half.
    assert plan(spec, 6)[("interactive", "lumen")].allocation_ms_per_s == pytest.approx(0.5 * SEED_CAPACITY)
    assert plan(spec, 6, capacity=0.0)[("control", "ops")].admit_share == 1.0
