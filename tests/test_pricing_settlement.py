"""Pricing and settlement in the decision core, driven by hand with explicit times.

``core.pricing.price`` builds a request's record on one pool (demand from the profile and
the estimator's correction, budget with the queue wait the dispatch queue predicts);
``core.settlement`` charges observed work, teaches the estimator and refunds. No event
loop and no clock: every time here is the test's.
"""

from __future__ import annotations

import pytest

from gateway.core import pricing, settlement
from gateway.core.dispatch import DispatchQueue, Slot
from gateway.core.estimate import CorrectionKey, Estimator
from gateway.core.profile import DemandProfile
from gateway.core.quota import QuotaConfig, QuotaLedger, QuotaSettings
from gateway.core.record import Approximation, Decision, Identity, Mode, RequestRecord, Shape, Verdict

FULL = DemandProfile(fixed_ms=4.4, prefill_ms_per_token=0.1, decode_ms_per_token=0.41875)
IDENTITY = Identity(
    request_id="r1",
    tenant="orchid",
    request_class="interactive",
    model="full-v18",
    model_version="",
    operation="ModelInfer",
    mode=Mode.ONLINE,
    privacy_cell="eu-restricted",
)
TEACHING = Shape(items=1, input_tokens=256, max_output_tokens=64, bucket="short")
RESERVES = pricing.Reserves(deadline_ms=200.0, upstream_ms=12.0, fail_ms=15.0)
ADMITTED = Decision(
    verdict=Verdict.ADMIT, target_model="full-v18", route_reason="primary", approximation=Approximation.NONE
)


def priced(
    queue: DispatchQueue, estimator: Estimator, *, now: float, received_at: float = 0.0
) -> tuple[RequestRecord, CorrectionKey]:
    return pricing.price(
        IDENTITY,
        TEACHING,
        profile=FULL,
        backend_model="full-v18",
        version="",
        time_scale=1.0,
        estimator=estimator,
        queue=queue,
        reserves=RESERVES,
        weight=2.0,
        received_at=received_at,
        ladder_step=0,
        now=now,
    )


def orchid_quotas() -> QuotaLedger:
    """Tenant orchid's interactive class: 100 accelerator-ms/s, a 1,000 ms burst."""
    return QuotaLedger(
        QuotaSettings(
            tenants={"orchid": {"interactive": QuotaConfig(accelerator_ms_per_s=100.0, burst_ms=1000.0)}}
        )
    )


def test_the_teaching_request_is_priced_at_56_8_ms_with_its_reserves() -> None:
    queue = DispatchQueue("full-v18", devices=1, slots=2, max_queued=10)
    record, key = priced(queue, Estimator(), now=0.045, received_at=0.0)
    assert record.demand.accelerator_ms == pytest.approx(56.8)  # 4.4 + 25.6 + 26.8
    assert record.budget.elapsed_ms == pytest.approx(45.0)
    assert record.budget.queue_wait_ms == 0.0  # an idle pool
    assert key.model == "full-v18" and key.bucket == "short"


def test_the_predicted_queue_wait_is_the_work_bound_ahead() -> None:
    queue = DispatchQueue("full-v18", devices=1, slots=2, max_queued=10)
    running = queue.request(0.0, latest_start=1.0, cost_ms=100.0)
    assert isinstance(running, Slot)
    record, _ = priced(queue, Estimator(), now=0.04)
    assert record.budget.queue_wait_ms == pytest.approx(60.0)  # the device frees at 0.1 s
    assert pricing.latest_start(0.0, RESERVES, 56.8) == pytest.approx((200.0 - 56.8 - 15.0) / 1000.0)


def test_settlement_charges_observed_work_and_teaches_the_estimator() -> None:
    quotas = orchid_quotas()
    estimator = Estimator()
    queue = DispatchQueue("full-v18", devices=1, slots=2, max_queued=10)
    record, key = priced(queue, estimator, now=0.0)
    reservation = quotas.reserve_record(record, now=0.0)
    assert quotas.available("orchid", "interactive", now=0.0).available_accelerator_ms == pytest.approx(943.2)
    # 130 ms on the backend, of which 16 ms waiting in its own queue, alone in its batch:
    # 114 ms held, twice the 56.8 ms predicted.
    outcome = settlement.settle(
        record,
        ADMITTED,
        reservation,
        key,
        quotas=quotas,
        estimator=estimator,
        backend_model="full-v18",
        queue_ms=5.0,
        wall_ms=130.0,
        backend_queue_ms=16.0,
        batch=1.0,
        first_result_ms=130.0,
        output_tokens=64,
        learn=True,
        now=0.2,
    )
    assert outcome.charged_accelerator_ms == pytest.approx(114.0)
    # The reservation (56.8) is replaced by the charge (114), after 0.2 s of refill at 100 ms/s.
    after = quotas.available("orchid", "interactive", now=0.2).available_accelerator_ms
    assert after == pytest.approx(943.2 + 20.0 + 56.8 - 114.0)
    assert estimator.correction(key, "orchid", 0.2) > 1.0  # it learned the underprediction
    assert settlement.observed_accelerator_ms(100.0, 20.0, 2.0) == pytest.approx(40.0)


def test_a_co_batched_request_pays_its_share_and_teaches_its_solo_price() -> None:
    """Dispatch rule 6 bound two teaching requests into one batch (82.4 ms predicted, 113.6 ms
    alone). Each is charged its share of the batch's device time by solo price (half of the
    82.4 ms it ran), and the estimator learns that share scaled back to what it would have held
    alone (56.8 ms, as predicted): co-batching never teaches it that single requests got cheaper."""
    quotas = orchid_quotas()
    estimator = Estimator()
    queue = DispatchQueue("full-v18", devices=1, slots=2, max_queued=10)
    record, key = priced(queue, estimator, now=0.0)
    reservation = quotas.reserve_record(record, now=0.0)
    outcomes = [
        settlement.settle(
            record,
            ADMITTED,
            reservation,
            key,
            quotas=quotas,
            estimator=estimator,
            backend_model="full-v18",
            queue_ms=5.0,
            wall_ms=82.4,
            backend_queue_ms=0.0,
            batch=113.6 / 56.8,
            solo_factor=113.6 / 82.4,
            first_result_ms=82.4,
            output_tokens=64,
            learn=True,
            now=0.1 * i,
        )
        for i in range(1, 20)
    ]
    assert outcomes[0].charged_accelerator_ms == pytest.approx(41.2)
    assert estimator.correction(key, "orchid", 2.0) == pytest.approx(1.0)


def test_abandon_refunds_what_never_started_and_charges_what_ran() -> None:
    quotas = QuotaLedger(
        QuotaSettings(
            tenants={"orchid": {"interactive": QuotaConfig(accelerator_ms_per_s=100.0, burst_ms=200.0)}}
        )
    )
    queue = DispatchQueue("full-v18", devices=1, slots=2, max_queued=10)
    record, _ = priced(queue, Estimator(), now=0.0)
    never = quotas.reserve_record(record, now=0.0)
    settlement.abandon(quotas, never, started=None, now=0.0)
    assert quotas.available("orchid", "interactive", now=0.0).available_accelerator_ms == pytest.approx(200.0)
    ran = quotas.reserve_record(record, now=0.0)
    settlement.abandon(quotas, ran, started=0.0, now=0.03)  # it held the device for 30 ms
    # 143.2 left after the reservation, 3 ms of refill, then the 56.8 reserved becomes 30 charged.
    left = quotas.available("orchid", "interactive", now=0.03).available_accelerator_ms
    assert left == pytest.approx(143.2 + 3.0 + 56.8 - 30.0)


def test_a_tensor_parallel_request_costs_both_devices_and_reserves_its_wall_time() -> None:
    """On a TP-2 unit (dispatch rule 10) the profile's 56.8 ms are the pair's wall time: the
    record's accelerator-ms are both devices' (113.6), the execution reserve the wall time;
    settlement charges observed wall x 2; a pipeline's unit is held for its cadence."""
    from gateway.core.topology import Layout, Topology, plan_units
    from gateway.core.units import UnitDeviceSet

    topology = Topology(4, domains={"host": {"a": (0, 1), "b": (2, 3)}})
    devices = UnitDeviceSet(topology)
    queue = DispatchQueue("tp2", devices=2, slots=2, max_queued=10, device_set=devices)
    devices.attach(queue, Layout(tensor_parallel=2), plan_units(topology, Layout(tensor_parallel=2), "m"))
    record, _ = priced(queue, Estimator(), now=0.0)
    assert record.demand.accelerator_ms == pytest.approx(113.6)
    assert record.budget.reserve_exec_ms == pytest.approx(56.8)
    slot = queue.request(0.0, latest_start=1.0, cost_ms=record.demand.accelerator_ms, tenant="orchid")
    assert isinstance(slot, Slot) and slot.cost_ms == pytest.approx(56.8)  # the pair is held 56.8 ms
    quotas = orchid_quotas()
    outcome = settlement.settle(
        record,
        ADMITTED,
        quotas.reserve_record(record, now=0.0),
        CorrectionKey("full-v18", "", "short"),
        quotas=quotas,
        estimator=Estimator(),
        backend_model="full-v18",
        queue_ms=0.0,
        wall_ms=60.0,
        backend_queue_ms=0.0,
        batch=1.0,
        first_result_ms=60.0,
        output_tokens=64,
        learn=False,
        now=0.1,
        unit_device_ms=queue.layout.device_ms_per_ms,
    )
    assert outcome.observed_accelerator_ms == pytest.approx(120.0)
    pipe = Layout(tensor_parallel=1, stage_shares=(0.5, 0.5))  # 2 stages: a new request each half
    pipeline = UnitDeviceSet(topology)
    staged = DispatchQueue("pp", devices=2, slots=2, max_queued=10, device_set=pipeline)
    pipeline.attach(staged, pipe, plan_units(topology, pipe, "p"))
    record, _ = priced(staged, Estimator(), now=0.0)
    assert record.demand.accelerator_ms == pytest.approx(56.8)  # 2 devices x a 28.4 ms cadence
    assert record.budget.reserve_exec_ms == pytest.approx(56.8)  # the latency: both stages
    slot = staged.request(0.0, latest_start=1.0, cost_ms=record.demand.accelerator_ms, tenant="orchid")
    assert isinstance(slot, Slot) and slot.cost_ms == pytest.approx(28.4)  # held for the cadence
