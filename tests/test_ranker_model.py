"""The ``ranker-v3`` example model, against a real Triton: it consumes an optional ``FEATURES``
input (float32) and answers it back as ``FEATURES_SEEN``, so a test can prove which features
reached the model; without it, it answers ``OUTPUT_IDS`` alone, like every other emulated
model. One batch may mix requests with and without features."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import InferInput

from gateway.backends.local import LocalTriton
from tests.conftest import own_triton

MODEL = "ranker-v3"
CALL_TIMEOUT_S = 30.0
pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def ranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    with own_triton(tmp_path_factory.mktemp("ranker"), time_factor=1.0, models=(MODEL,)) as server:
        yield server


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


def test_one_batch_mixes_requests_with_and_without_features(ranker: LocalTriton) -> None:
    """A long request (300 ms of decode) and 15 short ones, odd ones with features, are sent
    together to the one instance; those that queue are co-batched (up to 8 a batch), and each
    gets its own features back, or none."""
    count = 16
    clients = [grpcclient.InferenceServerClient(ranker.address) for _ in range(count)]

    def features(k: int) -> np.ndarray | None:
        return np.array([[k, k + 0.5, -k]], dtype=np.float32) if k % 2 else None

    def call(k: int) -> Any:
        ids = np.full((1, 16), k, dtype=np.int32)
        tokens = 3000 if k == 0 else 8
        return clients[k].infer(
            MODEL,
            _inputs(ids, features(k)),
            parameters={"max_output_tokens": tokens},
            client_timeout=CALL_TIMEOUT_S,
        )

    try:
        before = clients[0].get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        with ThreadPoolExecutor(count) as pool:
            # All 16 are in flight together: whichever execution starts first holds the one
            # instance while the rest queue, so the next execution takes up to 8 of them. (The
            # blocker used to be awaited before the others were sent: on a slow machine each short
            # request then ran alone.)
            futures = [pool.submit(call, k) for k in range(count)]
            results = [future.result(timeout=2 * CALL_TIMEOUT_S) for future in futures]
        # Triton counts an execution after its responses are sent: read until all 16 are counted.
        after = _statistics_counting(clients[0], int(before.get("inference_count", 0)) + count)
    finally:
        for client in clients:
            client.close()
    for k, result in enumerate(results):
        expected = features(k)
        if expected is None:
            assert result.as_numpy("FEATURES_SEEN") is None, k
        else:
            np.testing.assert_array_equal(result.as_numpy("FEATURES_SEEN"), expected)
        assert result.as_numpy("OUTPUT_IDS").shape == (1, 3000 if k == 0 else 8)
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    assert inferences == count
    assert executions < count, "no request was co-batched: the mixed batch was not exercised"


def _statistics_counting(client: grpcclient.InferenceServerClient, inferences: int) -> dict[str, Any]:
    """The model's statistics once they count ``inferences`` (polled: Triton updates them just
    after the responses go out; bounded, so a count that never comes fails the test)."""
    end = time.monotonic() + CALL_TIMEOUT_S
    while True:
        stats: dict[str, Any] = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        if int(stats.get("inference_count", 0)) >= inferences or time.monotonic() > end:
            return stats
        time.sleep(0.01)
