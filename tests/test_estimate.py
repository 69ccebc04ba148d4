"""The estimator's tenant corrections (``gateway.core.estimate``), driven by hand with
generated observations: pricing falls on the tenant that underpredicts.

Two tenants send the same declared shape on one (model, version, bucket); one of them
really costs 3x what it declares. The honest tenant's prediction stays within 10 % of its
observed work throughout, the understating tenant's converges to its own, and the shared
correction moves by no more than the understating tenant's share of the traffic.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.estimate import CorrectionKey, Estimator

KEY = CorrectionKey("full-v18", "18", "short")
BASE_MS = 10.0  # both tenants' uncorrected prediction: the same declared shape
UNDERSTATED = 3.0  # the dishonest tenant's real cost over its declared shape
NOISE = 0.04  # timing noise on each observation, +-4 %
WITHIN = 0.10


def _observed(rng: random.Random, ratio: float) -> float:
    return BASE_MS * ratio * (1.0 + rng.uniform(-NOISE, NOISE))


def _error(estimator: Estimator, tenant: str, observed_ms: float, now: float) -> float:
    predicted = BASE_MS * estimator.correction(KEY, tenant, now)
    return abs(predicted / observed_ms - 1.0)


def test_the_honest_tenant_is_not_priced_for_an_understating_one() -> None:
    rng = random.Random(27)
    estimator = Estimator()
    now = 0.0
    for _ in range(40):  # the honest tenant alone first: its history
        now += 0.01
        estimator.observe(KEY, "honest", base_ms=BASE_MS, observed_ms=_observed(rng, 1.0), now=now)
    honest_errors: list[float] = []
    dishonest_errors: list[float] = []
    for _ in range(200):  # then both, equal traffic
        for tenant, ratio, errors in (
            ("honest", 1.0, honest_errors),
            ("understating", UNDERSTATED, dishonest_errors),
        ):
            now += 0.01
            observed = _observed(rng, ratio)
            errors.append(_error(estimator, tenant, observed, now))
            estimator.observe(KEY, tenant, base_ms=BASE_MS, observed_ms=observed, now=now)
    assert max(honest_errors) <= WITHIN, max(honest_errors)
    assert dishonest_errors[0] > 0.5  # it started priced at its declared shape ...
    assert max(dishonest_errors[12:]) <= WITHIN  # ... and is priced at its own cost from then on
    # The shared correction (a new tenant's price) is the traffic's blend: half the excess.
    assert math.log(estimator.model_correction(KEY, now)) <= 0.5 * math.log(UNDERSTATED) + 0.05


@settings(max_examples=60, deadline=None)
@given(
    history=st.integers(min_value=10, max_value=60),
    arrivals=st.lists(st.booleans(), min_size=1, max_size=300),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_the_honest_tenant_stays_priced_by_its_own_work_whatever_the_other_sends(
    history: int, arrivals: list[bool], seed: int
) -> None:
    """Any interleaving, bursts included, after the honest tenant has some history."""
    rng = random.Random(seed)
    estimator = Estimator()
    now = 0.0
    for _ in range(history):
        now += 0.01
        estimator.observe(KEY, "honest", base_ms=BASE_MS, observed_ms=_observed(rng, 1.0), now=now)
    for understating in arrivals:
        now += 0.01
        if understating:
            observed = _observed(rng, UNDERSTATED)
            estimator.observe(KEY, "understating", base_ms=BASE_MS, observed_ms=observed, now=now)
        else:
            observed = _observed(rng, 1.0)
            assert _error(estimator, "honest", observed, now) <= WITHIN
            estimator.observe(KEY, "honest", base_ms=BASE_MS, observed_ms=observed, now=now)


@settings(max_examples=60, deadline=None)
@given(history=st.integers(min_value=1, max_value=200), burst=st.integers(min_value=1, max_value=200))
def test_a_burst_moves_the_shared_correction_by_its_share_of_the_traffic(history: int, burst: int) -> None:
    """However bunched, the understating tenant's observations move the shared correction by
    at most its share of the traffic times its own excess (time barely passes: no ageing)."""
    estimator = Estimator()
    now = 0.0
    for _ in range(history):
        now += 1e-6
        estimator.observe(KEY, "honest", base_ms=BASE_MS, observed_ms=BASE_MS, now=now)
    for _ in range(burst):
        now += 1e-6
        estimator.observe(KEY, "understating", base_ms=BASE_MS, observed_ms=BASE_MS * UNDERSTATED, now=now)
    share = burst / (history + burst)
    assert math.log(estimator.model_correction(KEY, now)) <= share * math.log(UNDERSTATED) + 1e-6


def test_the_shared_correction_is_the_traffic_weighted_mean_of_the_tenants_own() -> None:
    """Even when one tenant's own mean is past the shared correction's bound (50x): the sums
    behind the weighted mean stay exact, only the reading is bounded."""
    estimator = Estimator()
    now = 0.0
    for tenant, ratio in (("absurd", 50.0), ("honest", 1.0)):
        for _ in range(40):
            now += 0.01
            estimator.observe(KEY, tenant, base_ms=BASE_MS, observed_ms=BASE_MS * ratio, now=now)
    assert estimator.correction(KEY, "absurd", now) == pytest.approx(50.0, rel=0.05)
    assert estimator.correction(KEY, "honest", now) == pytest.approx(1.0, rel=0.05)
    # Equal traffic: half of log(50), less the prior's small pull.
    assert estimator.model_correction(KEY, now) == pytest.approx(math.sqrt(50.0), rel=0.05)
