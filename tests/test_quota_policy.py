"""Quota has one meaning: policy sees the ledger's own answer, borrowing included.

The policy rule ``quota-accelerator-ms`` compares a request's demand with
``tenant.available_accelerator_ms``. That fact is what the quota ledger would grant now (the
tenant's balance plus what it may borrow from its class's idle share), so the rule never
refuses a request the ledger would have lent to: a tenant alone on a pool can use its idle
neighbours' share, within the borrowing bound. Driven through the real gateway's admission
(policy snapshot, ledger, pools) on the session's Triton.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.core.errors import ResourceExhausted
from gateway.core.record import Mode
from gateway.exchange import CallContext
from tests.conftest import ORCHID_KEY, ThreadedGateway


def long_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 4096])
    request.raw_input_contents.append(np.arange(4096, dtype=np.int32).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = 128
    return request


def test_a_tenant_past_its_own_balance_borrows_idle_share_instead_of_being_refused(
    gateway: ThreadedGateway,
) -> None:
    gw = gateway.server.gateway
    assert gw is not None
    tenant = gw.tenants.authenticate((("authorization", f"Bearer {ORCHID_KEY}"),))

    async def admit_with_own_balance_spent() -> tuple[float, float, float, float]:
        now = time.monotonic()
        before = gw.quotas.available("orchid", "interactive", now=now)
        # Spend exactly the tenant's own balance: only borrowing can pay for the next request.
        drain = gw.quotas.reserve(
            "orchid", "interactive", demand_ms=max(0.0, before.available_accelerator_ms), now=now
        )
        try:
            call = CallContext(metadata=(), time_remaining_s=5.0, received_at=time.monotonic())
            view = gw.quotas.available("orchid", "interactive", now=call.received_at)
            admitted = await gw.chain.admit(
                long_request(), tenant, call, operation="ModelInfer", mode=Mode.ONLINE
            )
            gw.quotas.release(admitted.reservation, now=time.monotonic())
            return (
                view.available_accelerator_ms,
                view.borrowable_ms,
                admitted.record.demand.accelerator_ms,
                admitted.reservation.borrowed_ms,
            )
        finally:
            gw.quotas.release(drain, now=time.monotonic())

    own, borrowable, demand, borrowed = gateway.call(admit_with_own_balance_spent())
    assert own < demand <= own + borrowable  # its own balance cannot pay; the ledger can lend
    assert borrowed > 0.0  # and it did: admitted on borrowed tokens, not refused by policy


def test_a_tenant_with_nothing_to_borrow_is_refused_by_the_policy_rule(gateway: ThreadedGateway) -> None:
    """The other side of the same meaning: when the ledger cannot lend either (the tenant is
    in debt), policy refuses with the quota rule and a retry-after from the refill."""
    gw = gateway.server.gateway
    assert gw is not None
    tenant = gw.tenants.authenticate((("authorization", f"Bearer {ORCHID_KEY}"),))

    async def admit_in_debt() -> None:
        now = time.monotonic()
        before = gw.quotas.available("orchid", "interactive", now=now)
        drain = gw.quotas.reserve(
            "orchid", "interactive", demand_ms=max(0.0, before.available_accelerator_ms), now=now
        )
        # Settled at twice its reservation: the overcharge puts the tenant's own bucket in debt,
        # and debt blocks borrowing.
        gw.quotas.settle(drain, charged_ms=2.0 * drain.demand_ms + 1000.0, now=now)
        try:
            call = CallContext(metadata=(), time_remaining_s=5.0, received_at=time.monotonic())
            await gw.chain.admit(long_request(), tenant, call, operation="ModelInfer", mode=Mode.ONLINE)
        finally:
            # Refill the debt so later tests see a healthy ledger.
            account = gw.quotas._account_for("orchid", "interactive")
            assert account is not None
            account.accelerator.level_ms = account.accelerator.capacity_ms

    with pytest.raises(ResourceExhausted) as refused:
        gateway.call(admit_in_debt())
    assert refused.value.rule == "quota-accelerator-ms"
    assert refused.value.retry_after_ms is not None and refused.value.retry_after_ms > 0
