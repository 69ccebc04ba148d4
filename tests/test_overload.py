"""The overload ladder: thresholds, hysteresis, hold, fail-safe evidence, windows, retry-after (pure)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from pydantic import ValidationError

from gateway.overload import (
    DEFAULT_LADDER,
    EFFECTS,
    DemandWindow,
    DwellWindow,
    LadderConfig,
    LadderState,
    LadderStep,
    LoadEvidence,
    OverloadLadder,
    drain_ms,
    effects,
    next_state,
    protected_capacity_ms_per_s,
    retry_after_ms,
)

SEED_DEVICES = 24
SEED_CAPACITY = 16_800.0  # 24 devices x 0.70 x 1000 ms/s
SHORT_MS, LONG_MS = 56.8, 467.6


def evidence(
    utilization: float | None = None,
    *,
    now: float = 100.0,
    offered: float | None = None,
    capacity: float = SEED_CAPACITY,
    age_s: float = 0.0,
    healthy: int = SEED_DEVICES,
    **extra: float,
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


def fresh_step(utilization: float) -> LadderStep:
    return OverloadLadder().update(evidence(utilization)).step


# --------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("utilization", "step"),
    [
        (0.0, 0),
        (0.84, 0),
        (0.85, 1),
        (0.91, 1),
        (0.92, 2),
        (0.99, 2),
        (1.00, 3),
        (1.09, 3),
        (1.10, 4),
        (1.24, 4),
        (1.25, 5),
        (1.39, 5),
        (1.40, 6),
        (5.0, 6),
    ],
)
def test_each_step_is_entered_at_its_threshold(utilization: float, step: int) -> None:
    assert fresh_step(utilization) == step


def test_every_step_is_reachable_and_thresholds_increase() -> None:
    enters = DEFAULT_LADDER.thresholds
    assert list(enters) == sorted(enters) and len(set(enters)) == len(LadderStep)
    assert {fresh_step(enters[step]) for step in LadderStep} == set(LadderStep)


def test_seed_arithmetic_normal_and_surge() -> None:
    # The seed: 140 short x 56.8 + 18 long x 467.6 = 16,368.8 accelerator-ms/s on 24 devices at 70 %.
    offered = 140 * SHORT_MS + 18 * LONG_MS
    assert offered == pytest.approx(16_368.8)
    capacity = protected_capacity_ms_per_s(SEED_DEVICES)
    assert capacity == pytest.approx(SEED_CAPACITY)
    normal = evidence(offered=offered, capacity=capacity)
    assert normal.utilization == pytest.approx(0.9743, abs=1e-4)
    # 97.43 % is inside the envelope but past the 8 % headroom line: step 2, shorter outputs
    # within declared quality evidence; no fallback, nobody refused.
    normal_state = OverloadLadder().update(normal)
    assert normal_state.step == LadderStep.REDUCE_OUTPUT
    assert "97.4% of protected 16800 ms/s" in normal_state.reason

    # 1.25x arrivals: 20,461 ms/s = 121.8 %: step 4 (fallback for eligible classes, defer batch);
    # below step 5, so no interactive caller is refused for a surge the seed shows fallback absorbs.
    surge = evidence(offered=1.25 * offered, capacity=capacity)
    assert surge.offered_ms_per_s == pytest.approx(20_461.0)
    assert surge.utilization == pytest.approx(1.218, abs=1e-3)
    surge_state = OverloadLadder().update(surge)
    assert surge_state.step == LadderStep.DEFER_BATCH
    assert "offered 20461 ms/s = 121.8% of protected 16800 ms/s" in surge_state.reason

    # The seed's fallback (60 % of short, 50 % of long to the smaller model) leaves 15,287.5 ms/s =
    # 91.0 %. Fed to the ladder that would read as step 1 and switch the fallback off again, which is
    # why the ladder takes offered demand priced before any ladder action (rule 1).
    after_fallback = evidence(offered=15_287.5, capacity=capacity)
    assert after_fallback.utilization == pytest.approx(0.90997, abs=1e-5)
    assert OverloadLadder().update(after_fallback).step == LadderStep.SHED_OPTIONAL


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


# --------------------------------------------------------------------------- climbing and descending


def test_climbs_immediately_skipping_steps() -> None:
    ladder = OverloadLadder(now=0.0)
    state = ladder.update(evidence(1.3, now=0.1))
    assert state.step == LadderStep.REJECT_INTERACTIVE and state.changed and state.since == 0.1
    state = ladder.update(evidence(2.0, now=0.2))
    assert state.step == LadderStep.PROTECT_ADMITTED and state.changed and state.since == 0.2


def test_descends_one_step_per_hold_period() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(2.0, now=0.0))
    assert ladder.step == 6
    t = 0.0
    history: list[tuple[float, int]] = []
    while t < 20.0:
        t = round(t + 0.1, 1)
        state = ladder.update(evidence(0.1, now=t))
        if state.changed:
            history.append((t, state.step))
    # One step down per 2 s hold, never two at once, all the way to 0.
    assert [step for _, step in history] == [5, 4, 3, 2, 1, 0]
    times = [at for at, _ in history]
    assert times[0] == pytest.approx(2.1)  # calm from the first quiet reading at 0.1 s
    assert all(b - a == pytest.approx(2.0) for a, b in itertools.pairwise(times))


def test_hold_is_reported_and_climb_restarts_it() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.05, now=0.0))
    state = ladder.update(evidence(0.5, now=1.0))
    assert state.step == 3 and not state.changed and "hold step 3 for 2.0 s more" in state.reason
    ladder.update(evidence(1.12, now=1.5))  # climb to 4 restarts the hold
    assert ladder.step == 4 and ladder.state.calm_since is None
    assert ladder.update(evidence(0.5, now=3.0)).step == 4
    assert ladder.update(evidence(0.5, now=4.9)).step == 4
    assert ladder.update(evidence(0.5, now=5.0)).step == 3


def test_descent_needs_sustained_calm() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.05, now=0.0))
    ladder.update(evidence(0.5, now=10.0))
    # One reading back inside the hysteresis band breaks the calm; the hold starts again.
    state = ladder.update(evidence(0.95, now=11.9))
    assert state.step == 3 and state.calm_since is None
    assert ladder.update(evidence(0.5, now=12.0)).step == 3
    assert ladder.update(evidence(0.5, now=13.9)).step == 3
    assert ladder.update(evidence(0.5, now=14.0)).step == 2


def test_hysteresis_band_holds_the_step() -> None:
    ladder = OverloadLadder(now=0.0)
    ladder.update(evidence(1.00, now=0.0))
    # Below the step 3 threshold but not below 1.00 - 0.08: stays at 3 however long it lasts.
    state = ladder.update(evidence(0.93, now=60.0))
    assert state.step == 3 and "leaves below 92.0%" in state.reason
    assert ladder.update(evidence(0.919, now=61.0)).step == 3
    assert ladder.update(evidence(0.919, now=63.0)).step == 2


def test_threshold_oscillation_does_not_flap() -> None:
    # Utilization oscillating +-0.02 around the step 3 threshold for 60 s, sampled every 100 ms.
    ladder = OverloadLadder(now=0.0)
    changes = 0
    for i in range(600):
        utilization = 1.00 + (0.02 if i % 2 == 0 else -0.02)
        if ladder.update(evidence(utilization, now=i * 0.1)).changed:
            changes += 1
    assert changes == 1
    assert ladder.step == LadderStep.FALLBACK


def _poisson_seed_load(seed: int, utilization: float, window_s: float, seconds: float = 60.0) -> int:
    """Step changes in ``seconds`` of the seed's short/long mix arriving as a Poisson process at
    ``utilization`` of protected capacity, read through a DemandWindow every 100 ms."""
    rng = random.Random(seed)
    rate = 158 * utilization * SEED_CAPACITY / 16_368.8  # requests/s
    window = DemandWindow(window_s=window_s, buckets=round(window_s * 10))
    ladder = OverloadLadder(now=0.0)
    arrival, changes = rng.expovariate(rate), 0
    for tick in range(1, round((seconds + window_s) * 10) + 1):
        now = tick / 10
        while arrival < now:
            window.add(arrival, SHORT_MS if rng.random() < 140 / 158 else LONG_MS)
            arrival += rng.expovariate(rate)
        if now < window_s:
            continue  # let the window fill once
        state = ladder.update(evidence(offered=window.rate_ms_per_s(now), now=now))
        changes += state.changed and now > window_s  # the first reading places the ladder
    return changes


def test_poisson_load_on_a_threshold_does_not_flap() -> None:
    # Honest noise: the seed's mix sitting on the step 3 threshold. The default 10 s window keeps
    # it to a step change or two a minute; a 5 s window, whose noise (5.6 % of capacity) is close
    # to the step spacing, walks the ladder about twice as often (the reason for the default).
    seeds = range(12)
    default = [_poisson_seed_load(seed, 1.00, DemandWindow().window_s) for seed in seeds]
    short = [_poisson_seed_load(seed, 1.00, 5.0) for seed in seeds]
    assert sum(default) / len(default) <= 2.5
    assert max(default) <= 5
    assert sum(short) > 1.5 * sum(default)


def test_transition_function_is_pure() -> None:
    start = LadderState(step=LadderStep.NORMAL, changed=False, reason="", stale=False, since=0.0)
    load = evidence(1.3, now=5.0)
    assert next_state(start, load) == next_state(start, load)
    assert start.step == 0


# --------------------------------------------------------------------------- fail-safe evidence


def test_dwell_over_budget_raises_to_at_least_step_3() -> None:
    state = OverloadLadder().update(evidence(0.5, queue_dwell_p95_ms=35.0, dwell_budget_ms=20.0))
    assert state.step == LadderStep.FALLBACK
    assert "queue dwell p95 35 ms over budget 20 ms" in state.reason
    # Never lowers: a higher utilization step stands.
    assert OverloadLadder().update(evidence(1.3, queue_dwell_p95_ms=35.0, dwell_budget_ms=20.0)).step == 5
    # Within budget, or no budget: no effect.
    assert OverloadLadder().update(evidence(0.5, queue_dwell_p95_ms=19.0, dwell_budget_ms=20.0)).step == 0
    assert OverloadLadder().update(evidence(0.5, queue_dwell_p95_ms=500.0)).step == 0
    # Unreadable dwell fails safe.
    assert OverloadLadder().update(evidence(0.5, queue_dwell_p95_ms=math.nan, dwell_budget_ms=20.0)).step == 3


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


def test_recovery_from_stale_descends_slowly() -> None:
    ladder = OverloadLadder(now=0.0)
    assert ladder.update(evidence(0.3, now=0.0, age_s=5.0)).step == 4
    # Calm read on stale evidence does not count toward the hold: it starts with fresh evidence.
    state = ladder.update(evidence(0.3, now=0.5))
    assert state.step == 4 and not state.stale and state.calm_since == 0.5
    assert ladder.update(evidence(0.3, now=2.4)).step == 4
    assert ladder.update(evidence(0.3, now=2.5)).step == 3


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
    assert [e.step for e in EFFECTS] == list(LadderStep)
    for bad in (-1, 7):
        with pytest.raises(ValueError):
            effects(bad)


# --------------------------------------------------------------------------- retry-after


def test_retry_after_follows_the_drain() -> None:
    # 8,400 ms of backlog at 16,800 ms/s protected, no excess: 500 ms.
    calm = evidence(0.5, queued_accelerator_ms=8_400.0)
    assert drain_ms(calm) == pytest.approx(500.0)
    assert retry_after_ms(calm).ms == 500
    # More backlog, longer wait; Triton's pending requests count at their mean predicted cost.
    more = evidence(0.5, queued_accelerator_ms=8_400.0, backend_pending=40, mean_request_ms=105.0)
    assert more.backlog_ms == pytest.approx(12_600.0)
    assert retry_after_ms(more).ms == 750
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
    assert lost.ms == 30_000 and lost.drain_ms == math.inf and "no protected capacity" in lost.reason
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
    end = 1000.0 + 99 * 0.1
    assert window.count(end) == 5 * (140 + 18)
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
    # The window has existed for all 10 buckets by 10.95: 400 ms over 1 s.
    assert window.rate_ms_per_s(10.95) == pytest.approx(400.0)
    assert window.total_ms(10.95) == pytest.approx(400.0) and window.count(10.95) == 3
    # At 11.05 the bucket [10.0, 10.1) has left the window.
    assert window.total_ms(11.05) == pytest.approx(250.0)
    assert window.rate_ms_per_s(11.05) == pytest.approx(250.0)
    # A sample older than the window is dropped, not counted into a newer bucket.
    window.add(9.0, 1e6)
    assert window.total_ms(11.05) == pytest.approx(250.0)


def test_demand_window_young_window_is_not_diluted() -> None:
    window = DemandWindow(window_s=5.0, buckets=50)
    for i in range(30):  # 3 s of 1,000 ms/s
        window.add(50.0 + i * 0.1, 100.0)
    # Measured over the 3 s it has existed, not over 5 s (which would read 600 ms/s: fail open).
    assert window.rate_ms_per_s(52.95) == pytest.approx(1000.0)


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
    assert len(window._sums) == len(window._counts) == len(window._epochs) == 50
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
    assert dwell.p95_ms(11.0) == 95.0
    assert dwell.quantile_ms(11.0, 0.5) == 50.0
    assert dwell.p95_ms(20.0) == 0.0  # all aged out
    for i in range(1000):
        dwell.add(30.0 + i * 0.001, 5.0)
    assert len(dwell._dwell_ms) == 100 and dwell.p95_ms(31.0) == 5.0
    with pytest.raises(ValueError):
        dwell.add(31.0, -1.0)


# --------------------------------------------------------------------------- configuration


def test_config_rejects_inconsistent_ladders() -> None:
    with pytest.raises(ValidationError):
        LadderConfig(fallback_at=0.90)  # below reduce_output_at
    with pytest.raises(ValidationError):
        LadderConfig(hysteresis=0.9)  # step 0 unreachable
    with pytest.raises(ValidationError):
        LadderConfig(retry_after_min_ms=5_000, retry_after_max_ms=1_000)
    with pytest.raises(ValidationError):
        LadderConfig.model_validate({"surprise": 1})
    config = LadderConfig.model_validate({"stale_step": 5, "dwell_step": 2})
    assert config.stale_step is LadderStep.REJECT_INTERACTIVE
    with pytest.raises(ValidationError):
        DEFAULT_LADDER.hold_s = 0.0
    assert DEFAULT_LADDER.leaves_below(LadderStep.FALLBACK) == pytest.approx(0.92)


def test_shedder_sheds_the_excess_not_everything() -> None:
    from gateway.overload import Shedder

    shedder = Shedder()
    # The seed's surge: 20,461 ms/s offered on a 16,800 ms/s envelope -> admit 82.1 %.
    admitted = sum(shedder.admit(20_461.0, 16_800.0) for _ in range(10_000))
    assert admitted == pytest.approx(8_211, abs=2)
    assert all(Shedder().admit(10_000.0, 16_800.0) for _ in range(100))  # under the envelope: none shed
    assert not any(Shedder().admit(5_000.0, 0.0) for _ in range(100))  # no capacity: everything shed


def test_fallback_relief_keeps_a_surge_at_step_3() -> None:
    """Rule 7: the seed's 1.25x surge (121.8 %) with the fallback relieving 25 % of the price
    stays at step 3 (91 % effective) instead of climbing to shedding."""
    ladder = OverloadLadder(DEFAULT_LADDER)

    def evidence(now: float, relief: float) -> LoadEvidence:
        return LoadEvidence(
            now=now,
            evidence_at=now,
            offered_ms_per_s=20_461.0,
            protected_capacity_ms_per_s=16_800.0,
            healthy_devices=24,
            configured_devices=24,
            relief=relief,
        )

    assert ladder.update(evidence(0.0, 1.0)).step == LadderStep.DEFER_BATCH  # no relief yet: 121.8 %
    state = ladder.state
    for i in range(1, 40):
        state = ladder.update(evidence(i * 0.5, 15_287.5 / 20_461.0))  # the seed's modeled saving
    assert state.step == LadderStep.FALLBACK  # descended to 3 and holds there
    assert "after fallback relief" in state.reason
    # Relief that does not suffice still sheds: 121.8 % x 0.95 = 115.7 % -> step 4.
    assert OverloadLadder(DEFAULT_LADDER).update(evidence(0.0, 0.95)).step == LadderStep.DEFER_BATCH
