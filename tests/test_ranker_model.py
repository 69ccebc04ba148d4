"""The ``ranker-v3`` example model, against a real Triton: it consumes an optional ``FEATURES``
input (float32) and answers it back as ``FEATURES_SEEN``, so a test can prove which features
reached the model; without it, it answers ``OUTPUT_IDS`` alone, like every other emulated
model. One batch may mix requests with and without features."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import InferInput

from gateway.backends.local import LocalTriton
from tests.conftest import MODEL_REPOSITORY

MODEL = "ranker-v3"
CALL_TIMEOUT_S = 30.0
pytestmark = pytest.mark.triton


QUEUE_DELAY_US = 200_000  # the batcher waits up to 200 ms to fill a batch (this module's copy only)


@pytest.fixture(scope="module")
def ranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    """ranker-v3 on a Triton of the module's own, its batcher told to wait for a batch: requests
    with the same inputs sent together are co-batched whatever the machine's speed (with the
    shipped delay of 0 a request that finds the instance free runs alone)."""
    work = tmp_path_factory.mktemp("ranker")
    repository = work / "repo" / "model_repository"
    shutil.copytree(MODEL_REPOSITORY / MODEL, repository / MODEL)
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", work / "repo" / "emulator")
    config = repository / MODEL / "config.pbtxt"
    text, count = re.subn(
        r"max_queue_delay_microseconds: \d+",
        f"max_queue_delay_microseconds: {QUEUE_DELAY_US}",
        config.read_text(),
    )
    assert count == 1
    config.write_text(text)
    server = LocalTriton(repository, work / "triton", time_factor=1.0)
    server.start()
    try:
        yield server
    finally:
        server.kill()  # disposable: see conftest.own_triton


def _inputs(ids: np.ndarray, features: np.ndarray | None) -> list[InferInput]:
    tensor = InferInput("INPUT_IDS", list(ids.shape), "INT32")
    tensor.set_data_from_numpy(ids)
    inputs = [tensor]
    if features is not None:
        seen = InferInput("FEATURES", list(features.shape), "FP32")
        seen.set_data_from_numpy(features)
        inputs.append(seen)
    return inputs


def _infer(address: str, ids: np.ndarray, features: np.ndarray | None, **kwargs: object) -> object:
    client = grpcclient.InferenceServerClient(address)
    try:
        return client.infer(MODEL, _inputs(ids, features), client_timeout=CALL_TIMEOUT_S, **kwargs)
    finally:
        client.close()


def test_features_reach_the_model(ranker: LocalTriton) -> None:
    ids = np.arange(16, dtype=np.int32).reshape(1, 16)
    features = np.array([[11.0, 101.0, 0.015625]], dtype=np.float32)  # user 1's ranker_v12 row
    result = _infer(ranker.address, ids, features)
    seen = result.as_numpy("FEATURES_SEEN")  # type: ignore[attr-defined]
    assert seen is not None and seen.dtype == np.float32
    np.testing.assert_array_equal(seen, features)
    out = result.as_numpy("OUTPUT_IDS")  # type: ignore[attr-defined]
    assert out.shape == (1, 8) and out.dtype == np.int32  # default_max_output_tokens 8


def test_without_features_the_model_still_answers(ranker: LocalTriton) -> None:
    ids = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = _infer(ranker.address, ids, None)
    assert result.as_numpy("OUTPUT_IDS").shape == (1, 8)  # type: ignore[attr-defined]
    assert result.as_numpy("FEATURES_SEEN") is None  # type: ignore[attr-defined]
    with_features = _infer(ranker.address, ids, np.zeros((1, 3), dtype=np.float32))
    np.testing.assert_array_equal(  # features change nothing else
        with_features.as_numpy("OUTPUT_IDS"),  # type: ignore[attr-defined]
        result.as_numpy("OUTPUT_IDS"),  # type: ignore[attr-defined]
    )


def _send_together(
    ranker: LocalTriton, features: Callable[[int], np.ndarray | None], count: int
) -> tuple[list[Any], int, int]:
    """``count`` requests sent at once (request k with ``features(k)``): their results and the
    inferences and executions Triton counted for them."""
    clients = [grpcclient.InferenceServerClient(ranker.address) for _ in range(count)]

    def call(k: int) -> Any:
        ids = np.full((1, 16), k, dtype=np.int32)
        return clients[k].infer(
            MODEL,
            _inputs(ids, features(k)),
            parameters={"max_output_tokens": 8},
            client_timeout=CALL_TIMEOUT_S,
        )

    try:
        before = clients[0].get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        with ThreadPoolExecutor(count) as pool:
            results = list(pool.map(call, range(count), timeout=2 * CALL_TIMEOUT_S))
        # Triton counts an execution after its responses are sent: read until all are counted.
        after = _statistics_counting(clients[0], int(before.get("inference_count", 0)) + count)
    finally:
        for client in clients:
            client.close()
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    return results, inferences, executions


def test_co_batched_requests_each_get_their_own_features(ranker: LocalTriton) -> None:
    """16 requests with features, sent together to the one instance, are co-batched (the
    module's batcher waits for a batch of up to 8) and each gets its own row back."""

    def features(k: int) -> np.ndarray:
        return np.array([[k, k + 0.5, -k]], dtype=np.float32)

    results, inferences, executions = _send_together(ranker, features, 16)
    for k, result in enumerate(results):
        np.testing.assert_array_equal(result.as_numpy("FEATURES_SEEN"), features(k))
        assert result.as_numpy("OUTPUT_IDS").shape == (1, 8)
    assert inferences == 16
    assert executions <= 4, f"16 requests ran in {executions} executions: the batch was not exercised"


def test_requests_with_and_without_features_sent_together_each_get_their_own(ranker: LocalTriton) -> None:
    """Odd requests with features, even ones without, sent together: each gets its own
    features back, or none. (Triton batches only requests that carry the same inputs, so these
    run in batches of one kind each: measured, 16 alternating requests took 11-16 executions
    even with a 200 ms queue delay, against 2 when all carry features.)"""

    def features(k: int) -> np.ndarray | None:
        return np.array([[k, k + 0.5, -k]], dtype=np.float32) if k % 2 else None

    results, inferences, _ = _send_together(ranker, features, 16)
    for k, result in enumerate(results):
        expected = features(k)
        if expected is None:
            assert result.as_numpy("FEATURES_SEEN") is None, k
        else:
            np.testing.assert_array_equal(result.as_numpy("FEATURES_SEEN"), expected)
    assert inferences == 16


def _statistics_counting(client: grpcclient.InferenceServerClient, inferences: int) -> dict[str, Any]:
    """The model's statistics once they count ``inferences`` (polled: Triton updates them just
    after the responses go out; bounded, so a count that never comes fails the test)."""
    end = time.monotonic() + CALL_TIMEOUT_S
    while True:
        stats: dict[str, Any] = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        if int(stats.get("inference_count", 0)) >= inferences or time.monotonic() > end:
            return stats
        time.sleep(0.01)
