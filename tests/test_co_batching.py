"""Co-batching against the real Triton (``gateway.core.dispatch`` rule 6).

Four long requests hold every instance of ``full-v18`` (each one device) on a Triton of the
test's own at time factor 1 (~850 ms each). Two short requests then arrive: the first is bound
ahead into Triton's queue, the second joins it, and when the first long request ends Triton's
dynamic batcher runs the two as one batch: Triton's own statistics show six inferences in five
executions. Both answers are the emulator's exact output for their input. With co-batching
off (``limits.co_batch_max: 1``) the gateway binds the second short request only once the
first has started, and counts no co-batch. (Triton itself may still batch the two then: a
device's response can reach the gateway, which binds the second, before Triton's batcher has
taken the first from its queue; so the execution count is asserted only with co-batching on,
where the pair waits together for about 800 ms.) The four long requests differ in length by a
token each, so that Triton cannot batch two of them together when they reach its queue at once
(on a busy machine it did: six inferences in four executions).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from gateway.backends.local import LocalTriton
from gateway.config import GatewayConfig
from tests.conftest import ORCHID_KEY, ThreadedGateway, bearer, gateway_config

pytestmark = pytest.mark.slow

LONG_INPUT, SHORT_INPUT = 8192, 256
POLL_S = 0.005  # reading the gateway's state while the long requests are being bound
BOUND_WITHIN_S = 10.0


def real_time(config: GatewayConfig, co_batch_max: int) -> GatewayConfig:
    backends = tuple(b.model_copy(update={"time_scale": 1.0}) for b in config.backends)
    limits = config.limits.model_copy(update={"co_batch_max": co_batch_max})
    return config.model_copy(update={"backends": backends, "limits": limits})


def infer(address: str, tokens: np.ndarray, headers: dict[str, str] | None = None) -> np.ndarray:
    client = grpcclient.InferenceServerClient(address)
    tensor = grpcclient.InferInput("INPUT_IDS", [1, tokens.size], "INT32")
    tensor.set_data_from_numpy(tokens.reshape(1, tokens.size))
    try:
        result = client.infer("full-v18", [tensor], headers=headers, client_timeout=10.0)
    finally:
        client.close()
    output = result.as_numpy("OUTPUT_IDS")
    assert output is not None
    return output


def executions(address: str) -> tuple[int, int]:
    """Triton's (inference_count, execution_count) for full-v18."""
    client = grpcclient.InferenceServerClient(address)
    try:
        stats = client.get_inference_statistics("full-v18", as_json=True)
    finally:
        client.close()
    model = stats["model_stats"][0]
    return int(model.get("inference_count", 0)), int(model.get("execution_count", 0))


@pytest.fixture
def started() -> Iterator[list[ThreadedGateway]]:
    running: list[ThreadedGateway] = []
    yield running
    for gateway in running:
        gateway.stop()


def bound_longs(gateway: ThreadedGateway) -> int:
    def read() -> int:
        queues = [q for q in gateway.server.gateway.pools.queues() if q.name == "local/full-v18"]
        return sum(1 for slot in queues[0].device_set.bound if slot.long) if queues else 0

    return int(gateway.call_soon(read))


def run_scenario(gateway: ThreadedGateway, triton: LocalTriton) -> tuple[int, int, list[np.ndarray]]:
    """Four long requests, then two short ones once the four are bound. Returns Triton's new
    inferences and executions, and the two short answers."""
    headers = bearer(ORCHID_KEY)
    rng = np.random.default_rng(7)
    shorts = [rng.integers(0, 1000, SHORT_INPUT, dtype=np.int32) for _ in range(2)]
    before = executions(triton.address)
    with ThreadPoolExecutor(max_workers=6) as pool:
        # Four different lengths: Triton batches only equal shapes (INPUT_IDS is not ragged), so
        # however the four reach its queue each long request is an execution of its own.
        longs = [
            pool.submit(infer, gateway.address, np.arange(LONG_INPUT - i, dtype=np.int32) % 997, headers)
            for i in range(4)
        ]
        deadline = time.monotonic() + BOUND_WITHIN_S
        while bound_longs(gateway) < 4:  # all four hold a device before the short ones arrive
            assert time.monotonic() < deadline, "the long requests were not bound"
            time.sleep(POLL_S)
        answers: list[Future[np.ndarray]] = [pool.submit(infer, gateway.address, s, headers) for s in shorts]
        for future in longs:
            future.result(timeout=30)
        outputs = [future.result(timeout=30) for future in answers]
    after = executions(triton.address)
    # The emulator's answer for each input, straight from Triton.
    for tokens, output in zip(shorts, outputs, strict=True):
        assert np.array_equal(output, infer(triton.address, tokens))
    return after[0] - before[0], after[1] - before[1], outputs


def co_batched(gateway: ThreadedGateway) -> int:
    def read() -> int:
        return sum(q.co_batched for q in gateway.server.gateway.pools.queues())

    return int(gateway.call_soon(read))


@pytest.mark.parametrize(
    ("co_batch_max", "expected_executions", "joined"),
    [(2, 5, 1), (1, None, 0)],
    ids=["co-batching", "co_batch_max-1"],
)
def test_two_short_requests_behind_busy_devices_run_as_one_triton_batch(
    triton_real_time: LocalTriton,
    started: list[ThreadedGateway],
    co_batch_max: int,
    expected_executions: int | None,
    joined: int,
) -> None:
    """Six inferences in five executions with co-batching (the two short requests in one
    Triton batch); without it the gateway co-batches nothing."""
    gateway = ThreadedGateway(real_time(gateway_config(triton_real_time.address), co_batch_max=co_batch_max))
    gateway.start()
    started.append(gateway)
    inferences, execs, _ = run_scenario(gateway, triton_real_time)
    assert co_batched(gateway) == joined
    assert inferences == 6
    if expected_executions is not None:
        assert execs == expected_executions, "Triton did not run the two short requests as one batch"
    # Operators see it on /metrics.
    registry = gateway.server.telemetry.metrics.registry
    counted = registry.get_sample_value("orchid_pool_co_batched_requests_total", {"pool": "local/full-v18"})
    assert counted == joined
