"""A request whose latest start passes in its primary's queue is decided again, once: it runs
on the warm fallback if policy allows and it can still finish in time, and otherwise gets the
late refusal (DEADLINE_EXCEEDED, ``queue.latest_start``). Against the real Triton.

The primary's pool is made to stall deterministically: the test holds every slot of
``local/full-v18`` that can be bound (as if long work overran its prediction) and never
releases them while the probe waits. Admission still predicts the probe a prompt start (held
work that overran its prediction is taken to end now), so the probe is admitted, waits, and
reaches its latest start: the situation the surge benchmark's late refusals come from.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gateway import clock
from gateway.backends.local import LocalTriton
from gateway.core.dispatch import Slot
from tests.conftest import ORCHID_KEY, ThreadedGateway, bearer, gateway_config

LONG_INPUT = 8192  # long bucket: waits for a long device, priced ~42 ms at the tests' time factor


@pytest.fixture(scope="module")
def stalled(triton: LocalTriton) -> Iterator[ThreadedGateway]:
    config = gateway_config(triton.address)
    classes = dict(config.classes)
    # No upstream reserve: the seed's R_up is work before the gateway, which these calls do
    # not have; with it the fallback's slack at the primary's latest start would be
    # (R_exec primary - R_exec fallback - R_up), negative at the tests' time factor.
    # A 100 ms variance reserve: the probe is late 100 ms + its predicted execution before its
    # deadline, which leaves the fallback room to run and answer well inside it.
    classes["interactive"] = classes["interactive"].model_copy(
        update={"reserve_upstream_ms": 0.0, "reserve_fail_ms": 100.0}
    )
    running = ThreadedGateway(config.model_copy(update={"classes": classes}))
    running.start()
    try:
        yield running
    finally:
        running.stop()


def infer(address: str, deadline_s: float = 1.0, **parameters: Any) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(address)
    tensor = grpcclient.InferInput("INPUT_IDS", [1, LONG_INPUT], "INT32")
    tensor.set_data_from_numpy(np.arange(LONG_INPUT, dtype=np.int32).reshape(1, LONG_INPUT) % 1000)
    try:
        response = client.infer(
            "full-v18", [tensor], headers=bearer(ORCHID_KEY), parameters=parameters, client_timeout=deadline_s
        ).get_response()
    finally:
        client.close()
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.parameters.items()}


def hold_primary(gateway: ThreadedGateway, pool: str = "local/full-v18") -> list[Slot]:
    """Bind every slot of the primary's pool (or ``pool``) that can be bound, and keep them."""

    def hold() -> list[Slot]:
        queue = next(q for q in gateway.server.gateway.pools.queues() if q.name == pool)
        held: list[Slot] = []
        while True:
            granted = queue.request(clock.now(), latest_start=clock.now() + 60.0, cost_ms=1.0)
            if not isinstance(granted, Slot):
                queue.withdraw(granted, clock.now())
                return held
            held.append(granted)

    return gateway.call_soon(hold)  # type: ignore[no-any-return]


def release(gateway: ThreadedGateway, held: list[Slot]) -> None:
    def free() -> None:
        for slot in held:
            slot.release(clock.now())

    gateway.call_soon(free)


def test_a_request_late_in_the_primary_queue_is_answered_by_the_fallback(stalled: ThreadedGateway) -> None:
    assert infer(stalled.address)["orchid.model"] == "full-v18"  # creates the pool: idle, the primary
    held = hold_primary(stalled)
    try:
        assert len(held) >= 4  # every device of the pool is taken
        # A 1 s budget: admitted (a prompt start is predicted), then late at ~0.86 s.
        provenance = infer(stalled.address)
    finally:
        release(stalled, held)
    assert provenance["orchid.model"] == "compact-v11"
    assert provenance["orchid.approximation"] == "fallback"
    assert provenance["orchid.route_reason"] == "fallback:primary_late"


def test_without_a_fallback_the_late_request_is_refused_as_late(stalled: ThreadedGateway) -> None:
    infer(stalled.address)
    held = hold_primary(stalled)
    try:
        with pytest.raises(InferenceServerException) as refused:
            infer(stalled.address, **{"orchid.allow_fallback": False})
    finally:
        release(stalled, held)
    assert refused.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "could not start before its deadline" in (refused.value.message() or "")


def test_a_rescue_keeps_the_callers_deadline(stalled: ThreadedGateway) -> None:
    """The second decision prices the fallback against the deadline the call arrived with, not
    that deadline plus the time already spent waiting: with the fallback's pool stalled too, the
    rescued request reaches the fallback's latest start inside the caller's 1 s and is refused
    by the gateway (``queue.latest_start``), rather than waiting in the fallback's queue until
    the caller's own deadline expires."""
    held = hold_primary(stalled)
    try:  # a first rescue creates the fallback's pool
        assert infer(stalled.address)["orchid.route_reason"] == "fallback:primary_late"
        held += hold_primary(stalled, "local/compact-v11")
        assert len(held) >= 8
        started = clock.wall()
        with pytest.raises(InferenceServerException) as refused:
            infer(stalled.address, deadline_s=1.5)
        elapsed_s = clock.wall() - started
    finally:
        release(stalled, held)
    assert refused.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    # The gateway's refusal, not the client's own deadline expiring ("Deadline Exceeded").
    assert "could not start before its deadline" in (refused.value.message() or "")
    assert elapsed_s < 1.5
