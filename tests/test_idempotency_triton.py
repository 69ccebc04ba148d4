"""Online idempotency through the real gateway and Triton: a retried request with the same
``orchid.operation_id`` runs once.

The first attempt is held at the backend's door (its ``infer`` waits on a gate the test
opens) so that the retry deterministically arrives while it is in flight; the retry is let
through only once the gateway has recorded it as joined. Executions are counted by Triton's
own statistics, not by anything the gateway reports.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from gateway.core.idempotency import Begin, Step
from tests.conftest import LUMEN_KEY, ORCHID_KEY, ThreadedGateway, bearer, gateway_config

WAIT_S = 20.0  # bound on every wait for a condition below


@pytest.fixture(scope="module")
def running(triton: LocalTriton) -> Iterator[ThreadedGateway]:
    gateway = ThreadedGateway(gateway_config(triton.address))
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.stop()


def successes(triton: LocalTriton) -> int:
    client = grpcclient.InferenceServerClient(triton.address)
    try:
        stats = client.get_inference_statistics("full-v18")
        return int(stats.model_stats[0].inference_stats.success.count)
    finally:
        client.close()


def call(address: str, operation_id: str, *, key: str = ORCHID_KEY, first: int = 0) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(address)
    tensor = grpcclient.InferInput("INPUT_IDS", [1, 256], "INT32")
    tensor.set_data_from_numpy((np.arange(256, dtype=np.int32) + first).reshape(1, 256))
    try:
        result = client.infer(
            "full-v18",
            [tensor],
            headers=bearer(key),
            parameters={"orchid.operation_id": operation_id, "orchid.max_output_tokens": 16},
            client_timeout=WAIT_S,
        )
    finally:
        client.close()
    response = result.get_response()
    out = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.parameters.items()}
    out["output"] = result.as_numpy("OUTPUT_IDS").tobytes()
    return out


def test_a_retried_request_with_the_same_operation_id_runs_once(
    running: ThreadedGateway, triton: LocalTriton, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = running.server.gateway
    assert gw is not None
    call(running.address, "warm-up")  # the pool exists and the model is warm
    gate: asyncio.Event = running.call_soon(asyncio.Event)
    backend = gw.backends["local"].client
    original_infer = backend.infer

    async def gated(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()
        return await original_infer(*args, **kwargs)

    monkeypatch.setattr(backend, "infer", gated)
    steps: dict[Step, threading.Event] = {step: threading.Event() for step in Step}
    original_begin = gw.operations.table.begin

    def begin(*args: Any, **kwargs: Any) -> Begin:
        begun = original_begin(*args, **kwargs)
        steps[begun.step].set()
        return begun

    monkeypatch.setattr(gw.operations.table, "begin", begin)

    before = successes(triton)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(call, running.address, "op-27")
        assert steps[Step.START].wait(WAIT_S)
        retry = pool.submit(call, running.address, "op-27")
        assert steps[Step.JOIN].wait(WAIT_S)  # the retry joined the attempt in flight
        running.loop.call_soon_threadsafe(gate.set)
        answer, joined = first.result(WAIT_S), retry.result(WAIT_S)
    replayed = call(running.address, "op-27")  # after completion, inside the window
    assert steps[Step.REPLAY].is_set()
    assert successes(triton) == before + 1  # Triton ran it once for the three calls

    assert answer["orchid.operation_id"] == "op-27"
    assert "orchid.operation_reused" not in answer
    for again in (joined, replayed):
        assert again["orchid.operation_reused"] is True
        assert again["orchid.request_id"] == answer["orchid.request_id"]
        assert again["output"] == answer["output"]
        assert again["orchid.charged_accelerator_ms"] == answer["orchid.charged_accelerator_ms"]

    # The same id with a different request never gets that answer.
    with pytest.raises(InferenceServerException, match=r"ALREADY_EXISTS.*different request") as refused:
        call(running.address, "op-27", first=1)
    assert "a new request needs a new id" in str(refused.value)
    # Operation ids are per tenant: another tenant's op-27 is its own, and runs.
    other = call(running.address, "op-27", key=LUMEN_KEY)
    assert "orchid.operation_reused" not in other
    assert successes(triton) == before + 2
