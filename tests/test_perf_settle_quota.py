"""The quota ledger's inlined arithmetic (``gateway.core.quota``, perf issue 31) against the
code it replaced: ``_Bucket.level_at`` and ``refill`` spell out ``max``/``min`` as comparisons,
and ``reserve``/``settle`` test their arguments inline before calling the named checks. The
same floats must come out, bit for bit, and the same errors, on any input (NaN and infinities
included)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.quota import ClassShareConfig, QuotaConfig, QuotaLedger, QuotaSettings, _Bucket


def _reference_level_at(bucket: _Bucket, now: float) -> float:
    if bucket.updated_at is None:
        return bucket.level_ms
    elapsed_s = max(0.0, now - bucket.updated_at)
    return min(bucket.capacity_ms, bucket.level_ms + bucket.rate_ms_per_s * elapsed_s)


def _reference_refill(bucket: _Bucket, now: float) -> None:
    bucket.level_ms = _reference_level_at(bucket, now)
    bucket.updated_at = now if bucket.updated_at is None else max(bucket.updated_at, now)


def _bits(value: float | None) -> tuple[object, ...]:
    if value is None:
        return (None,)
    if math.isnan(value):
        return ("nan",)
    return (value, math.copysign(1.0, value))


_float = st.floats(allow_nan=True, allow_infinity=True)
_time = st.one_of(st.floats(min_value=-10.0, max_value=1e4), st.just(math.nan), st.just(math.inf))


@settings(max_examples=500, deadline=None)
@given(
    rate=st.floats(min_value=0.0, max_value=1e9),
    capacity=st.floats(min_value=0.0, max_value=1e9),
    level=_float,
    updated_at=st.one_of(st.none(), _time),
    steps=st.lists(st.tuples(_time, st.floats(min_value=-1e6, max_value=1e6)), max_size=20),
)
def test_a_bucket_levels_and_refills_as_before(
    rate: float, capacity: float, level: float, updated_at: float | None, steps: list[tuple[float, float]]
) -> None:
    new = _Bucket(rate, capacity, level, updated_at)
    old = _Bucket(rate, capacity, level, updated_at)
    for now, amount in steps:
        assert _bits(new.level_at(now)) == _bits(_reference_level_at(old, now))
        new.refill(now)
        _reference_refill(old, now)
        assert (_bits(new.level_ms), _bits(new.updated_at)) == (_bits(old.level_ms), _bits(old.updated_at))
        new.debit(amount)
        old.debit(amount)


def _ledger() -> QuotaLedger:
    return QuotaLedger(
        QuotaSettings(
            classes={"interactive": ClassShareConfig(4000.0)},
            tenants={"orchid": {"interactive": QuotaConfig(weight=2, live_token_ms_per_s=1e6)}},
        )
    )


_amount = st.one_of(
    st.floats(min_value=0.0, max_value=10.0),
    st.sampled_from([-1.0, -0.0, math.nan, math.inf, -math.inf]),
)


@settings(max_examples=300, deadline=None)
@given(demand=_amount, live=_amount, tokens=st.sampled_from([0, 5, -1]), now=_amount)
def test_reserve_refuses_bad_arguments_with_the_named_error(
    demand: float, live: float, tokens: int, now: float
) -> None:
    """The first bad argument, in the order the checks always ran, names the error."""
    expected: str | None = None
    for name, value in (("demand_ms", demand), ("live_token_ms", live), ("input_tokens", tokens)):
        if not (math.isfinite(value) and value >= 0):
            expected = f"{name} must be finite and >= 0, got {value!r}"
            break
    else:
        if not math.isfinite(now):
            expected = f"now must be finite, got {now!r}"
    ledger = _ledger()
    if expected is None:
        reservation = ledger.reserve(
            "orchid", "interactive", demand_ms=demand, live_token_ms=live, input_tokens=tokens, now=now
        )
        assert reservation.demand_ms == demand
        with pytest.raises(ValueError) as settle_error:
            ledger.settle(reservation, charged_ms=live - 11.0, now=now)
        assert str(settle_error.value).startswith("charged_ms must be finite and >= 0")
        settled = ledger.settle(reservation, charged_ms=demand, charged_live_token_ms=live, now=now)
        assert settled is not None and settled.charged_ms == demand
        return
    with pytest.raises(ValueError) as error:
        ledger.reserve(
            "orchid", "interactive", demand_ms=demand, live_token_ms=live, input_tokens=tokens, now=now
        )
    assert str(error.value) == expected
