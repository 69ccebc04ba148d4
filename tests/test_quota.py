"""Quota ledgers: bucket arithmetic, reserve-then-settle, borrowing, fairness, limits, no leaks.

Pure unit tests: the ledger takes ``now`` from the test, so simulated seconds cost microseconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import FrozenInstanceError
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pydantic import ValidationError

from gateway.core.errors import PermissionDenied, ResourceExhausted
from gateway.core.quota import (
    POOL_TENANT,
    RULE_ACCELERATOR_MS,
    RULE_CONCURRENCY,
    RULE_LIVE_TOKEN_MS,
    RULE_MAX_INPUT_TOKENS,
    RULE_MAX_OUTPUT_TOKENS,
    RULE_QUEUED_WORK,
    ClassShareConfig,
    QuotaConfig,
    QuotaLedger,
    QuotaSettings,
    Reservation,
)
from gateway.core.record import Budget, Demand, Identity, Mode, RequestRecord, Shape
from gateway.settings import QuotaConfigSchema, QuotaSettingsSchema


def single(**config: Any) -> QuotaLedger:
    """One tenant ``acme`` in class ``interactive``, no class share (no borrowing)."""
    return QuotaLedger(QuotaSettings(tenants={"acme": {"interactive": QuotaConfig(**config)}}))


def refused(excinfo: pytest.ExceptionInfo[ResourceExhausted]) -> tuple[str | None, int | None]:
    return excinfo.value.rule, excinfo.value.retry_after_ms


# --------------------------------------------------------------------------- bucket arithmetic


def test_refill_is_linear_and_capped_at_burst() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    assert ledger.available("acme", "interactive", now=0.0).available_accelerator_ms == 200.0
    ledger.reserve("acme", "interactive", demand_ms=200.0, now=0.0)
    assert ledger.available("acme", "interactive", now=0.0).available_accelerator_ms == 0.0
    assert ledger.available("acme", "interactive", now=0.5).available_accelerator_ms == pytest.approx(50.0)
    assert ledger.available("acme", "interactive", now=1.25).available_accelerator_ms == pytest.approx(125.0)
    assert ledger.available("acme", "interactive", now=60.0).available_accelerator_ms == 200.0


def test_default_burst_is_two_seconds_of_refill() -> None:
    view = single(accelerator_ms_per_s=250.0).available("acme", "interactive", now=0.0)
    assert view.burst_ms == 500.0
    assert view.refill_ms_per_s == 250.0


def test_retry_after_is_the_refill_time_to_the_needed_tokens() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    ledger.reserve("acme", "interactive", demand_ms=200.0, now=10.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=50.0, now=10.0)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 500)  # 50 ms at 100 ms/s
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=50.0, now=10.499)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 1)
    ledger.reserve("acme", "interactive", demand_ms=50.0, now=10.5)


@settings(max_examples=300, deadline=None)
@given(
    rate=st.integers(min_value=1, max_value=20_000),
    burst_tenths=st.integers(min_value=10, max_value=100_000),
    first_tenths=st.integers(min_value=0, max_value=100_000),
    demand_tenths=st.integers(min_value=1, max_value=100_000),
    start_ms=st.integers(min_value=0, max_value=100_000_000),
)
def test_retry_after_is_the_smallest_whole_ms_that_passes(
    rate: int, burst_tenths: int, first_tenths: int, demand_tenths: int, start_ms: int
) -> None:
    burst, first, demand, now = burst_tenths / 10, first_tenths / 10, demand_tenths / 10, start_ms / 1000
    ledger = single(accelerator_ms_per_s=float(rate), burst_ms=burst)
    ledger.reserve("acme", "interactive", demand_ms=min(first, burst), now=now)
    try:
        ledger.reserve("acme", "interactive", demand_ms=demand, now=now)
        event("fit")
        return
    except ResourceExhausted as error:
        assert error.rule == RULE_ACCELERATOR_MS
        retry = error.retry_after_ms
    assert retry is not None and retry >= 1
    level = burst - min(first, burst)
    expected = math.ceil((min(demand, burst) - level) / rate * 1000 - 1e-6)  # up to the float slack
    assert retry in (expected, max(1, expected - 1))
    if retry > 1:
        with pytest.raises(ResourceExhausted):
            ledger.reserve("acme", "interactive", demand_ms=demand, now=now + (retry - 1) / 1000)
    ledger.reserve("acme", "interactive", demand_ms=demand, now=now + retry / 1000)


def test_a_request_larger_than_the_bucket_passes_when_full_and_leaves_debt() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    ledger.reserve("acme", "interactive", demand_ms=10.0, now=0.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=500.0, now=0.0)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 100)  # until full again: 10 ms at 100 ms/s
    ledger.reserve("acme", "interactive", demand_ms=500.0, now=0.1)
    assert ledger.available("acme", "interactive", now=0.1).available_accelerator_ms == pytest.approx(-300.0)
    # the long-run rate holds: the debt refills first
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=10.0, now=0.1)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 3100)


def test_time_going_backwards_is_no_time_passing() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    ledger.reserve("acme", "interactive", demand_ms=200.0, now=5.0)
    assert ledger.available("acme", "interactive", now=4.0).available_accelerator_ms == 0.0
    with pytest.raises(ResourceExhausted):
        ledger.reserve("acme", "interactive", demand_ms=1.0, now=4.0)
    assert ledger.available("acme", "interactive", now=5.5).available_accelerator_ms == pytest.approx(50.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"demand_ms": -1.0},
        {"demand_ms": math.nan},
        {"demand_ms": math.inf},
        {"demand_ms": 1.0, "live_token_ms": -1.0},
        {"demand_ms": 1.0, "input_tokens": -1},
    ],
)
def test_impossible_amounts_are_programming_errors(kwargs: dict[str, Any]) -> None:
    ledger = single(accelerator_ms_per_s=100.0)
    with pytest.raises(ValueError):
        ledger.reserve("acme", "interactive", now=0.0, **kwargs)
    with pytest.raises(ValueError):
        ledger.reserve("acme", "interactive", demand_ms=1.0, now=math.nan)
    assert ledger.outstanding().count == 0


# --------------------------------------------------------------------------- reserve, settle, release


def test_settle_refunds_an_overprediction() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    reservation = ledger.reserve("acme", "interactive", demand_ms=150.0, now=0.0)
    settlement = ledger.settle(reservation, charged_ms=40.0, now=0.0)
    assert settlement is not None
    assert (settlement.kind, settlement.refunded_ms, settlement.extra_ms) == ("settled", 110.0, 0.0)
    assert ledger.available("acme", "interactive", now=0.0).available_accelerator_ms == pytest.approx(160.0)


def test_settle_charges_an_underprediction_and_the_debt_delays_the_next_admission() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    reservation = ledger.reserve("acme", "interactive", demand_ms=200.0, now=0.0)
    settlement = ledger.settle(reservation, charged_ms=300.0, now=0.0)
    assert settlement is not None and settlement.extra_ms == 100.0
    assert ledger.available("acme", "interactive", now=0.0).available_accelerator_ms == pytest.approx(-100.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=10.0, now=0.0)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 1100)  # 110 ms of tokens at 100 ms/s


def test_a_refund_never_overfills_the_bucket() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    reservation = ledger.reserve("acme", "interactive", demand_ms=150.0, now=0.0)
    ledger.settle(reservation, charged_ms=0.0, now=10.0)  # refilled meanwhile
    assert ledger.available("acme", "interactive", now=10.0).available_accelerator_ms == 200.0
    ledger.reserve("acme", "interactive", demand_ms=200.0, now=10.0)  # the refund was not banked
    assert ledger.available("acme", "interactive", now=10.0).available_accelerator_ms == 0.0


def test_release_refunds_everything_and_frees_the_slot() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0, live_token_ms_per_s=1000.0, max_concurrent=1)
    reservation = ledger.reserve("acme", "interactive", demand_ms=120.0, live_token_ms=700.0, now=0.0)
    view = ledger.available("acme", "interactive", now=0.0)
    assert (view.concurrent, view.available_accelerator_ms, view.available_live_token_ms) == (1, 80.0, 1300.0)
    settlement = ledger.release(reservation, now=0.0)
    assert settlement is not None and settlement.kind == "released" and settlement.charged_ms == 0.0
    view = ledger.available("acme", "interactive", now=0.0)
    assert (view.concurrent, view.available_accelerator_ms, view.available_live_token_ms) == (
        0,
        200.0,
        2000.0,
    )
    assert ledger.outstanding().count == 0
    ledger.reserve("acme", "interactive", demand_ms=1.0, now=0.0)


def test_requests_open_elsewhere_count_against_the_concurrency_limit() -> None:
    """A degraded replica's share: its requests still open in the fleet's ledger count, and the
    refusal's retry-after is the soonest of all predicted ends (theirs whole: started when, is
    not known here)."""
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0, max_concurrent=3)
    here = ledger.reserve("acme", "interactive", demand_ms=40.0, now=0.0, open_elsewhere=(30.0,))
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=5.0, now=0.0, open_elsewhere=(30.0, 25.0))
    assert refused(excinfo) == ("quota.concurrency", 25)
    assert "3 requests of class 'interactive' are open (limit 3)" in str(excinfo.value)
    ledger.reserve("acme", "interactive", demand_ms=5.0, now=0.0, open_elsewhere=(30.0,))
    assert ledger.settle(here, charged_ms=40.0, now=0.01) is not None


def test_closing_is_idempotent() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=200.0)
    reservation = ledger.reserve("acme", "interactive", demand_ms=100.0, now=0.0)
    assert ledger.start(reservation, now=0.0) is True
    assert ledger.start(reservation, now=0.0) is False
    assert ledger.settle(reservation, charged_ms=50.0, now=0.0) is not None
    level = ledger.available("acme", "interactive", now=0.0).available_accelerator_ms
    assert ledger.settle(reservation, charged_ms=0.0, now=0.0) is None
    assert ledger.release(reservation, now=0.0) is None
    assert ledger.start(reservation, now=0.0) is False
    assert ledger.available("acme", "interactive", now=0.0).available_accelerator_ms == level == 150.0

    released = ledger.reserve("acme", "interactive", demand_ms=10.0, now=0.0)
    assert ledger.release(released, now=0.0) is not None
    assert ledger.settle(released, charged_ms=500.0, now=0.0) is None
    assert ledger.available("acme", "interactive", now=0.0).available_accelerator_ms == 150.0


def test_a_reservation_from_another_ledger_is_not_closed_here() -> None:
    first, second = single(accelerator_ms_per_s=100.0), single(accelerator_ms_per_s=100.0)
    mine = first.reserve("acme", "interactive", demand_ms=10.0, now=0.0)
    theirs = second.reserve("acme", "interactive", demand_ms=20.0, now=0.0)
    assert mine.id == theirs.id
    assert first.settle(theirs, charged_ms=0.0, now=0.0) is None
    assert first.outstanding().count == 1


def test_live_token_ms_are_settled_as_observed_or_as_predicted() -> None:
    ledger = single(accelerator_ms_per_s=100.0, live_token_ms_per_s=1000.0, live_token_burst_ms=1000.0)
    reservation = ledger.reserve("acme", "interactive", demand_ms=1.0, live_token_ms=600.0, now=0.0)
    ledger.settle(reservation, charged_ms=1.0, charged_live_token_ms=900.0, now=0.0)
    assert ledger.available("acme", "interactive", now=0.0).available_live_token_ms == pytest.approx(100.0)
    ledger = single(accelerator_ms_per_s=100.0, live_token_ms_per_s=1000.0, live_token_burst_ms=1000.0)
    reservation = ledger.reserve("acme", "interactive", demand_ms=1.0, live_token_ms=600.0, now=0.0)
    ledger.settle(reservation, charged_ms=1.0, now=0.0)
    assert ledger.available("acme", "interactive", now=0.0).available_live_token_ms == pytest.approx(400.0)


def test_reserve_record_reads_tenant_class_demand_and_shape() -> None:
    ledger = single(accelerator_ms_per_s=100.0, max_output_tokens=64)
    record = RequestRecord(
        identity=Identity("r1", "acme", "interactive", "full-v18", "", "ModelInfer", Mode.ONLINE, "eu"),
        shape=Shape(items=1, input_tokens=256, max_output_tokens=64),
        demand=Demand(prefill_ms=30.0, decode_ms=26.8, live_token_ms=1000.0),
        budget=Budget(200.0, 45.0, 12.0, 60.0, 15.0),
    )
    reservation = ledger.reserve_record(record, now=0.0)
    assert (reservation.tenant, reservation.request_class) == ("acme", "interactive")
    assert reservation.demand_ms == pytest.approx(56.8)
    assert reservation.live_token_ms == 1000.0
    with pytest.raises(PermissionDenied):
        ledger.reserve_record(
            record.replace(shape=Shape(items=1, input_tokens=256, max_output_tokens=65)), now=0.0
        )


# --------------------------------------------------------------------------- no leak


class LedgerMachine(RuleBasedStateMachine):
    """Random reserve/start/settle/release/time steps; the model is the set of open handles."""

    TENANTS = ("acme", "lumen", "stranger")  # stranger: unconfigured, lands in the default pool
    CLASSES = ("interactive", "batch")  # batch: no share, unmetered for everyone but acme

    def __init__(self) -> None:
        super().__init__()
        self.ledger = QuotaLedger(
            QuotaSettings(
                classes={
                    "interactive": ClassShareConfig(
                        accelerator_ms_per_s=1000.0,
                        default=QuotaConfig(weight=1.0, max_concurrent=2),
                    )
                },
                tenants={
                    "acme": {
                        "interactive": QuotaConfig(
                            weight=2.0, max_concurrent=3, max_queued_ms=800.0, live_token_ms_per_s=5000.0
                        ),
                        "batch": QuotaConfig(accelerator_ms_per_s=200.0, max_input_tokens=4096),
                    },
                    "lumen": {"interactive": QuotaConfig(weight=1.0, borrow_fraction=1.0)},
                },
            )
        )
        self.now = 0.0
        self.open: dict[int, Reservation] = {}
        self.closed: list[Reservation] = []

    @rule(
        tenant=st.sampled_from(TENANTS),
        request_class=st.sampled_from(CLASSES),
        demand=st.one_of(
            st.floats(min_value=0.0, max_value=300.0), st.floats(min_value=0.0, max_value=1500.0)
        ),
        live=st.floats(min_value=0.0, max_value=6_000.0),
        input_tokens=st.integers(min_value=0, max_value=8192),
    )
    def reserve(self, tenant: str, request_class: str, demand: float, live: float, input_tokens: int) -> None:
        try:
            reservation = self.ledger.reserve(
                tenant,
                request_class,
                demand_ms=demand,
                live_token_ms=live,
                input_tokens=input_tokens,
                now=self.now,
            )
        except ResourceExhausted as error:
            assert error.retry_after_ms is not None and error.retry_after_ms >= 1
            event(f"refused {error.rule}")
            return
        except PermissionDenied as error:
            assert error.rule == RULE_MAX_INPUT_TOKENS and error.retry_after_ms is None
            event("refused length")
            return
        event("borrowed" if reservation.borrowed_ms else ("pooled" if reservation.pooled else "reserved"))
        assert reservation.id not in self.open
        self.open[reservation.id] = reservation

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        reservation = data.draw(st.sampled_from(sorted(self.open.values(), key=lambda r: r.id)))
        self.ledger.start(reservation, now=self.now)

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), factor=st.floats(min_value=0.0, max_value=3.0), live_factor=st.floats(0.0, 3.0))
    def settle(self, data: st.DataObject, factor: float, live_factor: float) -> None:
        reservation = data.draw(st.sampled_from(sorted(self.open.values(), key=lambda r: r.id)))
        settlement = self.ledger.settle(
            reservation,
            charged_ms=reservation.demand_ms * factor,
            charged_live_token_ms=reservation.live_token_ms * live_factor,
            now=self.now,
        )
        assert settlement is not None
        self.closed.append(self.open.pop(reservation.id))

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        reservation = data.draw(st.sampled_from(sorted(self.open.values(), key=lambda r: r.id)))
        assert self.ledger.release(reservation, now=self.now) is not None
        self.closed.append(self.open.pop(reservation.id))

    @precondition(lambda self: bool(self.closed))
    @rule(data=st.data(), settle_again=st.booleans())
    def close_again(self, data: st.DataObject, settle_again: bool) -> None:
        reservation = data.draw(st.sampled_from(self.closed))
        before = self.ledger.available(reservation.tenant, reservation.request_class, now=self.now)
        if settle_again:
            assert self.ledger.settle(reservation, charged_ms=1e6, now=self.now) is None
        else:
            assert self.ledger.release(reservation, now=self.now) is None
        assert self.ledger.available(reservation.tenant, reservation.request_class, now=self.now) == before

    @rule(seconds=st.floats(min_value=0.0, max_value=3.0))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def outstanding_matches_the_open_handles(self) -> None:
        outstanding = self.ledger.outstanding()
        assert outstanding.count == len(self.open)
        assert outstanding.accelerator_ms == pytest.approx(sum(r.demand_ms for r in self.open.values()))
        assert outstanding.borrowed_ms == pytest.approx(sum(r.borrowed_ms for r in self.open.values()))
        for tenant, request_class in self.ledger.accounts():
            view = self.ledger.available(tenant, request_class, now=self.now)
            mine = [
                r
                for r in self.open.values()
                if r.request_class == request_class
                and r.metered
                and (r.tenant == tenant or (tenant == POOL_TENANT and r.pooled))
            ]
            assert view.concurrent == len(mine)
            if view.max_concurrent is not None:
                assert view.concurrent <= view.max_concurrent
            borrow_limit = self.ledger.settings.tenants.get(tenant, {}).get(request_class)
            fraction = borrow_limit.borrow_fraction if borrow_limit else 0.5
            assert sum(r.borrowed_ms for r in mine) <= fraction * view.burst_ms + 1e-6

    def teardown(self) -> None:
        for reservation in list(self.open.values()):
            self.ledger.release(reservation, now=self.now)
        outstanding = self.ledger.outstanding()
        assert (outstanding.count, outstanding.accelerator_ms, outstanding.borrowed_ms) == (0, 0.0, 0.0)
        later = self.now + 1e6  # long enough to repay any debt
        for tenant, request_class in self.ledger.accounts():
            view = self.ledger.available(tenant, request_class, now=later)
            assert (view.concurrent, view.queued_ms, view.borrowable_ms >= 0) == (0, 0.0, True)
            assert view.available_accelerator_ms == pytest.approx(view.burst_ms)


LedgerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLedgerNeverLeaks = LedgerMachine.TestCase


# --------------------------------------------------------------------------- hierarchy and borrowing


def pair(
    *, share: float = 1000.0, a: dict[str, Any] | None = None, b: dict[str, Any] | None = None
) -> QuotaLedger:
    """Tenants a and b in class ``interactive`` with a class share; equal weights unless told."""
    return QuotaLedger(
        QuotaSettings(
            classes={"interactive": ClassShareConfig(accelerator_ms_per_s=share)},
            tenants={
                "a": {"interactive": QuotaConfig(**(a or {}))},
                "b": {"interactive": QuotaConfig(**(b or {}))},
            },
        )
    )


def test_class_share_is_split_by_weight_after_explicit_rates() -> None:
    ledger = QuotaLedger(
        QuotaSettings(
            classes={
                "interactive": ClassShareConfig(accelerator_ms_per_s=1000.0, default=QuotaConfig(weight=1.0))
            },
            tenants={
                "fixed": {"interactive": QuotaConfig(accelerator_ms_per_s=400.0)},
                "small": {"interactive": QuotaConfig(weight=1.0)},
                "large": {"interactive": QuotaConfig(weight=4.0)},
            },
        )
    )
    rates = {
        t: ledger.available(t, "interactive", now=0.0).refill_ms_per_s for t in ("fixed", "small", "large")
    }
    assert rates == {"fixed": 400.0, "small": pytest.approx(100.0), "large": pytest.approx(400.0)}
    assert ledger.available("anyone", "interactive", now=0.0).refill_ms_per_s == pytest.approx(100.0)


def test_borrowing_is_bounded_by_borrow_fraction_of_the_burst() -> None:
    ledger = pair()  # each 500 ms/s, burst 1000, may borrow 500
    ledger.reserve("b", "interactive", demand_ms=1000.0, now=0.0)  # own bucket empty, a idle
    assert ledger.available("b", "interactive", now=0.0).borrowable_ms == 500.0
    first = ledger.reserve("b", "interactive", demand_ms=300.0, now=0.0)
    second = ledger.reserve("b", "interactive", demand_ms=200.0, now=0.0)
    assert (first.borrowed_ms, second.borrowed_ms) == (300.0, 200.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("b", "interactive", demand_ms=1.0, now=0.0)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 2)  # own refill: 1 ms at 500 ms/s
    # the bound is on borrowed work outstanding: settling gives it back
    ledger.settle(first, charged_ms=300.0, now=0.0)
    assert ledger.available("b", "interactive", now=0.0).borrowable_ms == 300.0
    assert ledger.reserve("b", "interactive", demand_ms=250.0, now=0.0).borrowed_ms == 250.0


def test_borrowing_takes_only_the_idle_capacity_of_the_class() -> None:
    ledger = pair()
    ledger.reserve("b", "interactive", demand_ms=1000.0, now=0.0)
    ledger.reserve("a", "interactive", demand_ms=900.0, now=0.0)  # a busy: 100 ms idle left in the class
    assert ledger.available("b", "interactive", now=0.0).borrowable_ms == 100.0
    assert ledger.reserve("b", "interactive", demand_ms=100.0, now=0.0).borrowed_ms == 100.0
    with pytest.raises(ResourceExhausted):
        ledger.reserve("b", "interactive", demand_ms=10.0, now=0.0)


def test_a_borrower_never_blocks_the_lenders_guarantee() -> None:
    ledger = pair()
    ledger.reserve("b", "interactive", demand_ms=1000.0, now=0.0)
    ledger.reserve("b", "interactive", demand_ms=500.0, now=0.0)  # borrowed from a's idle tokens
    ledger.reserve("a", "interactive", demand_ms=1000.0, now=0.0)  # a's own burst still passes
    assert ledger.available("b", "interactive", now=0.0).borrowable_ms == 0.0  # class now over-committed


def test_a_borrower_spends_its_own_remainder_first() -> None:
    ledger = pair()
    ledger.reserve("b", "interactive", demand_ms=900.0, now=0.0)
    reservation = ledger.reserve("b", "interactive", demand_ms=300.0, now=0.0)
    assert reservation.borrowed_ms == 200.0
    assert ledger.available("b", "interactive", now=0.0).available_accelerator_ms == 0.0
    # settled below the loan: the tenant's own 100 come back, the class is charged what ran
    ledger.settle(reservation, charged_ms=150.0, now=0.0)
    assert ledger.available("b", "interactive", now=0.0).available_accelerator_ms == 100.0


def test_debt_and_a_zero_fraction_block_borrowing() -> None:
    ledger = pair(b={"borrow_fraction": 0.0})
    ledger.reserve("b", "interactive", demand_ms=1000.0, now=0.0)
    assert ledger.available("b", "interactive", now=0.0).borrowable_ms == 0.0
    with pytest.raises(ResourceExhausted):
        ledger.reserve("b", "interactive", demand_ms=1.0, now=0.0)

    ledger = pair()
    overrun = ledger.reserve("b", "interactive", demand_ms=1000.0, now=0.0)
    ledger.settle(overrun, charged_ms=1100.0, now=0.0)  # 100 ms in debt, a still idle
    assert ledger.available("b", "interactive", now=0.0).borrowable_ms == 0.0
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("b", "interactive", demand_ms=10.0, now=0.0)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 220)  # 110 ms at 500 ms/s


def test_there_is_no_borrowing_without_a_class_share() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=100.0, borrow_fraction=1.0)
    ledger.reserve("acme", "interactive", demand_ms=100.0, now=0.0)
    assert ledger.available("acme", "interactive", now=0.0).borrowable_ms == 0.0
    with pytest.raises(ResourceExhausted):
        ledger.reserve("acme", "interactive", demand_ms=1.0, now=0.0)


# --------------------------------------------------------------------------- fairness over simulated time

STEP_S = 0.005
REQUEST_MS = 10.0
SHARE_TOLERANCE = 0.02  # absolute, on a share of served accelerator-ms


def _run(
    ledger: QuotaLedger,
    tenants: tuple[str, ...],
    *,
    start_s: float,
    duration_s: float,
    measure_from_s: float = 0.0,
) -> dict[str, float]:
    """Saturating ``tenants`` offer 10 ms requests every step; returns accelerator-ms served per tenant
    from ``measure_from_s`` (seconds into the run) to the end.

    Requests settle one step after admission at the observed charge: the prediction times a
    seeded factor in [0.8, 1.2], so settlement both refunds and overcharges.
    """
    noise = random.Random(7)
    served = dict.fromkeys(tenants, 0.0)
    running: list[Reservation] = []
    for step in range(round(duration_s / STEP_S)):
        now = start_s + step * STEP_S
        for reservation in running:
            charged = reservation.demand_ms * noise.uniform(0.8, 1.2)
            ledger.settle(reservation, charged_ms=charged, now=now)
            if step * STEP_S >= measure_from_s:
                served[reservation.tenant] += charged
        running = []
        for tenant in sorted(tenants, key=lambda _: noise.random()):  # no fixed first mover
            while True:
                try:
                    running.append(ledger.reserve(tenant, "interactive", demand_ms=REQUEST_MS, now=now))
                except ResourceExhausted:
                    break
    for reservation in running:
        ledger.release(reservation, now=start_s + duration_s)
    assert ledger.outstanding().count == 0
    return served


def test_weighted_tenants_converge_to_their_shares_under_contention() -> None:
    ledger = pair(a={"weight": 3.0}, b={"weight": 1.0})  # 750 and 250 ms/s of 1000
    served = _run(ledger, ("a", "b"), start_s=0.0, duration_s=30.0)
    total = served["a"] + served["b"]
    # bursts are weight-proportional too, so the share holds from the start
    assert served["a"] / total == pytest.approx(0.75, abs=SHARE_TOLERANCE)
    # the class delivers its share plus the initial bursts, not more: 1000 ms/s x 30 s + 2000
    assert total == pytest.approx(32_000.0, rel=0.02)


def test_idle_capacity_is_lent_and_recalled_when_the_lender_returns() -> None:
    ledger = pair(a={"weight": 3.0}, b={"weight": 1.0})
    alone = _run(ledger, ("b",), start_s=0.0, duration_s=10.0)
    # b's own share is 250 ms/s; borrowing lends it all of a's idle capacity:
    # the class's 1000 ms/s x 10 s plus its initial 2000 ms burst
    assert alone["b"] == pytest.approx(12_000.0, rel=0.02)
    # a returns with a full bucket (1500 ms), then both converge to 3:1 once it is spent
    both = _run(ledger, ("a", "b"), start_s=10.0, duration_s=30.0, measure_from_s=5.0)
    assert both["a"] / (both["a"] + both["b"]) == pytest.approx(0.75, abs=SHARE_TOLERANCE)
    assert both["a"] + both["b"] == pytest.approx(25_000.0, rel=0.02)


# -------------------------------------------------------------------- concurrency, queued work, lengths


def test_concurrency_limit_counts_open_requests_and_predicts_the_first_to_end() -> None:
    ledger = single(accelerator_ms_per_s=1000.0, max_concurrent=2)
    short = ledger.reserve("acme", "interactive", demand_ms=40.0, now=0.0)
    ledger.reserve("acme", "interactive", demand_ms=100.0, now=0.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=1.0, now=0.0)
    assert refused(excinfo) == (RULE_CONCURRENCY, 40)  # both queued: at least the short one's run
    ledger.start(short, now=0.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=1.0, now=0.0105)
    assert refused(excinfo) == (RULE_CONCURRENCY, 30)  # 29.5 ms left, ceiled
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=1.0, now=0.05)
    assert refused(excinfo) == (RULE_CONCURRENCY, 40)  # overdue: expect up to one more prediction
    ledger.settle(short, charged_ms=40.0, now=0.05)
    ledger.reserve("acme", "interactive", demand_ms=1.0, now=0.05)


def test_queued_work_limit_counts_reserved_work_not_yet_started() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=1000.0, max_queued_ms=100.0)
    first = ledger.reserve("acme", "interactive", demand_ms=60.0, now=0.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=60.0, now=0.0)
    assert refused(excinfo) == (RULE_QUEUED_WORK, 200)  # 20 ms excess drained at 100 ms/s
    assert ledger.available("acme", "interactive", now=0.0).queued_ms == 60.0
    ledger.start(first, now=0.0)
    second = ledger.reserve("acme", "interactive", demand_ms=60.0, now=0.0)
    ledger.release(second, now=0.0)
    # one request may always wait when nothing of the tenant's is queued, however large
    ledger.reserve("acme", "interactive", demand_ms=400.0, now=0.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=1.0, now=0.0)
    assert refused(excinfo) == (RULE_QUEUED_WORK, 3010)  # 301 ms excess at 100 ms/s


def test_live_token_ms_bucket_refuses_with_its_own_rule_and_refill() -> None:
    ledger = single(accelerator_ms_per_s=1000.0, live_token_ms_per_s=10_000.0, live_token_burst_ms=20_000.0)
    ledger.reserve("acme", "interactive", demand_ms=1.0, live_token_ms=18_000.0, now=0.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=1.0, live_token_ms=5_000.0, now=0.0)
    assert refused(excinfo) == (RULE_LIVE_TOKEN_MS, 300)  # 3,000 at 10,000/s


def test_the_longest_wait_among_refusing_limits_is_reported() -> None:
    ledger = single(accelerator_ms_per_s=100.0, burst_ms=100.0, max_concurrent=1)
    ledger.reserve("acme", "interactive", demand_ms=100.0, now=0.0)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("acme", "interactive", demand_ms=50.0, now=0.0)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 500)  # not the concurrency's 100 ms


@pytest.mark.parametrize(
    ("input_tokens", "output_tokens", "rule"),
    [(4097, 10, RULE_MAX_INPUT_TOKENS), (10, 257, RULE_MAX_OUTPUT_TOKENS)],
)
def test_length_caps_are_permission_denied_and_not_retryable(
    input_tokens: int, output_tokens: int, rule: str
) -> None:
    ledger = single(accelerator_ms_per_s=100.0, max_input_tokens=4096, max_output_tokens=256)
    with pytest.raises(PermissionDenied) as excinfo:
        ledger.reserve(
            "acme",
            "interactive",
            demand_ms=1.0,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            now=0.0,
        )
    assert (excinfo.value.rule, excinfo.value.retry_after_ms) == (rule, None)
    assert ledger.outstanding().count == 0
    assert ledger.available("acme", "interactive", now=0.0).available_accelerator_ms == 200.0
    ledger.reserve("acme", "interactive", demand_ms=1.0, input_tokens=4096, output_tokens=256, now=0.0)


# --------------------------------------------------------------------------- tenants without a quota


def test_unconfigured_tenant_in_a_class_without_share_is_unmetered_and_creates_no_state() -> None:
    ledger = single(accelerator_ms_per_s=100.0)
    accounts = ledger.accounts()
    for n in range(1000):
        reservation = ledger.reserve(f"tenant-{n}", "interactive", demand_ms=1e6, input_tokens=10**6, now=0.0)
        assert (reservation.metered, reservation.pooled) == (False, False)
        if n % 2:
            ledger.settle(reservation, charged_ms=5.0, now=0.0)
        else:
            ledger.release(reservation, now=0.0)
    assert ledger.accounts() == accounts
    assert ledger.outstanding().count == 0
    view = ledger.available("tenant-1", "interactive", now=0.0)
    assert (view.metered, view.available_accelerator_ms, view.refill_ms_per_s) == (False, math.inf, 0.0)
    # an unknown class too
    assert ledger.reserve("acme", "unknown-class", demand_ms=1e6, now=0.0).metered is False
    assert ledger.available("acme", "unknown-class", now=0.0).metered is False


def test_unconfigured_tenants_share_the_class_default_pool() -> None:
    ledger = QuotaLedger(
        QuotaSettings(
            classes={
                "interactive": ClassShareConfig(
                    accelerator_ms_per_s=1000.0,
                    default=QuotaConfig(weight=1.0, burst_ms=100.0, borrow_fraction=0.0),
                )
            },
            tenants={"acme": {"interactive": QuotaConfig(weight=1.0)}},
        )
    )
    first = ledger.reserve("stranger-1", "interactive", demand_ms=70.0, now=0.0)
    assert (first.metered, first.pooled) == (True, True)
    with pytest.raises(ResourceExhausted) as excinfo:
        ledger.reserve("stranger-2", "interactive", demand_ms=70.0, now=0.0)
    assert refused(excinfo) == (RULE_ACCELERATOR_MS, 80)  # 40 ms at the pool's 500 ms/s
    assert not any(ch.isdigit() for ch in excinfo.value.message)  # the pool's numbers are shared
    view = ledger.available("stranger-2", "interactive", now=0.0)
    assert (view.pooled, view.available_accelerator_ms, view.concurrent) == (True, 30.0, 1)
    assert set(ledger.accounts()) == {("acme", "interactive"), (POOL_TENANT, "interactive")}


def test_unmetered_work_still_uses_the_class_share_others_could_borrow() -> None:
    ledger = QuotaLedger(
        QuotaSettings(
            classes={"interactive": ClassShareConfig(accelerator_ms_per_s=1000.0)},
            tenants={"acme": {"interactive": QuotaConfig(accelerator_ms_per_s=500.0, borrow_fraction=1.0)}},
        )
    )
    ledger.reserve("acme", "interactive", demand_ms=1000.0, now=0.0)  # own bucket empty
    assert ledger.available("acme", "interactive", now=0.0).borrowable_ms == 1000.0
    stranger = ledger.reserve("stranger", "interactive", demand_ms=800.0, now=0.0)
    assert stranger.metered is False
    assert ledger.available("acme", "interactive", now=0.0).borrowable_ms == 200.0
    ledger.settle(stranger, charged_ms=300.0, now=0.0)
    assert ledger.available("acme", "interactive", now=0.0).borrowable_ms == 700.0


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"tenants": {"a": {"interactive": {"weight": 1.0}}}}, "has no share"),
        (
            {
                "classes": {"interactive": {"accelerator_ms_per_s": 100.0}},
                "tenants": {
                    "a": {"interactive": {"accelerator_ms_per_s": 100.0}},
                    "b": {"interactive": {"weight": 1.0}},
                },
            },
            "whole class share",
        ),
        ({"tenants": {"*": {"interactive": {"accelerator_ms_per_s": 1.0}}}}, "reserved"),
        ({"tenants": {"a": {"interactive": {"accelerator_ms_per_s": 1.0, "burst": 3}}}}, "Extra inputs"),
        ({"tenants": {"a": {"interactive": {"accelerator_ms_per_s": math.nan}}}}, "finite"),
        ({"tenants": {"a": {"interactive": {"accelerator_ms_per_s": 0.0}}}}, "greater than 0"),
        (
            {"tenants": {"a": {"interactive": {"accelerator_ms_per_s": 1.0, "borrow_fraction": 1.5}}}},
            "less than",
        ),
        (
            {"tenants": {"a": {"interactive": {"accelerator_ms_per_s": 1.0, "live_token_burst_ms": 5}}}},
            "needs",
        ),
    ],
)
def test_invalid_settings_are_refused_with_a_reason(data: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        QuotaSettingsSchema.model_validate(data)


def test_settings_are_immutable() -> None:
    config = QuotaConfig(accelerator_ms_per_s=1.0)
    with pytest.raises(FrozenInstanceError):
        config.weight = 2.0  # type: ignore[misc]
    schema = QuotaConfigSchema(accelerator_ms_per_s=1.0)
    with pytest.raises(ValidationError):
        schema.weight = 2.0


def test_validated_settings_are_the_cores_values() -> None:
    settings = QuotaSettingsSchema.model_validate(
        {
            "classes": {"interactive": {"accelerator_ms_per_s": 1000.0, "default": {"weight": 2.0}}},
            "tenants": {"a": {"interactive": {"weight": 1.0, "max_concurrent": 3}}},
        }
    ).value()
    assert settings == QuotaSettings(
        classes={
            "interactive": ClassShareConfig(accelerator_ms_per_s=1000.0, default=QuotaConfig(weight=2.0))
        },
        tenants={"a": {"interactive": QuotaConfig(weight=1.0, max_concurrent=3)}},
    )
    assert QuotaConfigSchema().value() == QuotaConfig()  # the same defaults
