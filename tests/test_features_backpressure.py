"""A late feature source reaches admission (issue 29): new requests are refused before they read
or queue, with their own rule and a retry-after; only probes read the source meanwhile; once the
source recovers, the probes see it and requests are served again (no stuck state). Against the
real Feast server behind ``orchid_tools.slowproxy.SlowProxy`` and the session Triton.

The side-by-side figures (the same schedule with ``backpressure: false``: device time wasted,
reads made, how long a refused caller waited) are ``bench/features_backpressure.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from gateway.config import FeatureSourceConfig
from orchid_tools.featurestore import FeastServer
from orchid_tools.slowproxy import SlowProxy
from tests.conftest import ORCHID_KEY, ThreadedGateway, gateway_config
from tests.test_features import ask

PROBE_S = 0.3


@pytest.fixture
def slow(feast_server: FeastServer) -> Iterator[SlowProxy]:
    with SlowProxy(feast_server.url) as proxy:
        yield proxy


@pytest.fixture
def behind_proxy(
    triton: LocalTriton, feast_server: FeastServer, slow: SlowProxy, tmp_path: Path
) -> Iterator[ThreadedGateway]:
    source = FeatureSourceConfig(
        url=slow.url,
        registry=feast_server.registry_path,
        timeout_ms=100.0,
        budget_ms=40.0,
        min_samples=20,
        window_s=10.0,
        probe_interval_s=PROBE_S,
        cache_ttl_ms=0.0,  # every request reads
    )
    running = ThreadedGateway(gateway_config(triton.address, feature_sources={"feast": source}))
    running.start()
    try:
        yield running
    finally:
        running.stop()


def backpressured(error: InferenceServerException) -> bool:
    """The gateway's backpressure refusal (``features.upstream_backpressure``: tritonclient
    shows the status and message, not the rule in the trailers)."""
    message = str(error.message())
    return error.status() == "StatusCode.UNAVAILABLE" and message.startswith("the feature source is")


def outcome(gateway: ThreadedGateway, user: int) -> InferenceServerException | None:
    try:
        ask(gateway, user)
    except InferenceServerException as error:
        return error
    return None


def inference_count(triton: LocalTriton) -> int:
    """Triton's inference count of ranker-v3 (the ranker route's model)."""
    client = grpcclient.InferenceServerClient(triton.address)
    try:
        stats = client.get_inference_statistics("ranker-v3", as_json=True)
    finally:
        client.close()
    return int(stats["model_stats"][0].get("inference_count", 0))


def raw_refusal(gateway: ThreadedGateway) -> dict[str, str]:
    """One ranker request over plain gRPC, refused: its trailing metadata."""
    request = service_pb2.ModelInferRequest(model_name="ranker")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 16])
    del tensor  # its bytes go in raw_input_contents
    request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    request.parameters["user_id"].int64_param = 3
    with grpc.insecure_channel(gateway.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failure:
            stub.ModelInfer(request, metadata=(("authorization", f"Bearer {ORCHID_KEY}"),), timeout=10)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value.details()
    return {k: str(v) for k, v in (failure.value.trailing_metadata() or ())}


def test_a_late_source_is_refused_early_read_only_by_probes_and_served_again_once_it_recovers(
    behind_proxy: ThreadedGateway, slow: SlowProxy, triton: LocalTriton
) -> None:
    gateway = behind_proxy
    normal = [outcome(gateway, 1 + i % 5) for i in range(10)]
    assert all(e is None for e in normal), [str(e) for e in normal]  # normal: served

    slow.delay_ms = 150.0  # the source is late: every read outlives its 100 ms timeout
    refused = None
    for i in range(40):
        error = outcome(gateway, 1 + i % 5)
        if error is not None and backpressured(error):
            refused = error
            break
    assert refused is not None, ("a late source never made the gateway refuse early", str(error))
    assert refused.status() == "StatusCode.UNAVAILABLE"
    assert "over its 40 ms budget" in str(refused.message()) or "failed" in str(refused.message())

    # Refused at once and with a retry-after; only one read per probe interval reaches the source,
    # and nothing reaches Triton (no device time is spent on a request the source cannot serve).
    reads, started = slow.requests, time.monotonic()
    inferences = inference_count(triton)
    early = 0
    for i in range(30):
        error = outcome(gateway, 1 + i % 5)
        assert error is not None, "a request was served by a source 150 ms late"
        early += backpressured(error)
    elapsed = time.monotonic() - started
    assert early >= 25
    assert slow.requests - reads <= 1 + elapsed / PROBE_S + 1, "requests read a late source"
    trailers = raw_refusal(gateway)  # the trailers tritonclient does not show
    assert trailers.get("orchid-rule") == "features.upstream_backpressure", trailers
    assert 0 < int(trailers["retry-after-ms"]) <= PROBE_S * 1000 + 1, trailers
    assert inference_count(triton) == inferences, "a refused request reached Triton"

    slow.delay_ms = 0.0  # recovered: two good probes in a row clear it, and every request reads again
    served_in_a_row, tries = 0, 0
    while served_in_a_row < 10:
        tries += 1
        assert tries < 400, "still refused long after the source recovered"
        if outcome(gateway, 1 + tries % 5) is None:
            served_in_a_row += 1
        else:
            served_in_a_row = 0
            gateway.call(asyncio.sleep(0.02))


@pytest.fixture
def failing(feast_server: FeastServer) -> Iterator[SlowProxy]:
    with SlowProxy(feast_server.url) as proxy:
        yield proxy


def test_a_source_that_is_down_is_refused_with_its_own_rule(
    triton: LocalTriton, feast_server: FeastServer, failing: SlowProxy
) -> None:
    source = FeatureSourceConfig(
        url=failing.url,
        registry=feast_server.registry_path,
        min_samples=3,
        probe_interval_s=5.0,
        cache_ttl_ms=0.0,
    )
    running = ThreadedGateway(gateway_config(triton.address, feature_sources={"feast": source}))
    running.start()
    try:
        failing.fail = True
        first = outcome(running, 1)
        assert first is not None and first.status() == "StatusCode.UNAVAILABLE"
        assert "features.source_failed" in str(first.debug_details() or "") or "unreachable" in str(
            first.message()
        )
        rules = [outcome(running, 1) for _ in range(6)]
        assert any(e is not None and "most recent reads failed" in str(e.message()) for e in rules)
    finally:
        running.stop()


def test_a_request_whose_features_are_cached_is_served_while_the_source_is_backpressured(
    triton: LocalTriton, feast_server: FeastServer, slow: SlowProxy
) -> None:
    """The cache answers it: it needs no read, reserves no upstream time, and the late source's
    backpressure does not refuse it; a user not in the cache is refused."""
    source = FeatureSourceConfig(
        url=slow.url,
        registry=feast_server.registry_path,
        timeout_ms=100.0,
        budget_ms=40.0,
        window_s=10.0,
        probe_interval_s=5.0,
        cache_ttl_ms=60_000.0,
    )
    running = ThreadedGateway(gateway_config(triton.address, feature_sources={"feast": source}))
    running.start()
    try:
        assert outcome(running, 1) is None  # now cached
        slow.delay_ms = 150.0
        tripped = False
        for user in range(2, 50):
            if user in (7, 8):
                continue
            error = outcome(running, user)
            if error is not None and backpressured(error):
                tripped = True
                break
        assert tripped, "the late source never backpressured"
        cached = ask(running, 1)
        assert cached.get_response().parameters["orchid.feature_cached"].bool_param
        refused = outcome(running, 49)
        assert refused is not None and backpressured(refused)
    finally:
        running.stop()
