"""Integration: unmodified tritonclient (sync, aio, streaming) through the gateway to a real Triton."""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from tests.conftest import LUMEN_KEY, OPS_KEY, ORCHID_KEY, ThreadedGateway, bearer

PROVENANCE_KEYS = {
    "orchid.model",
    "orchid.model_version",
    "orchid.route_reason",
    "orchid.approximation",
    "orchid.complete",
    "orchid.policy_version",
    "orchid.rules",
    "orchid.ladder_step",
    "orchid.predicted_accelerator_ms",
    "orchid.charged_accelerator_ms",
    "orchid.request_id",
    "orchid.risk_class",
}


def tokens(n: int, *, batched: bool = True, offset: int = 0) -> grpcclient.InferInput:
    data = (np.arange(n, dtype=np.int32) + offset) % 32000
    shape = [1, n] if batched else [n]
    tensor = grpcclient.InferInput("INPUT_IDS", shape, "INT32")
    tensor.set_data_from_numpy(data.reshape(shape))
    return tensor


def params(response: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in response.parameters.items():
        out[key] = getattr(value, value.WhichOneof("parameter_choice"))
    return out


@pytest.fixture(scope="module")
def client(gateway: ThreadedGateway) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(gateway.address)


@pytest.fixture(scope="module")
def direct(triton: LocalTriton) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(triton.address)


def test_sync_infer_matches_direct_triton_and_carries_provenance(
    client: grpcclient.InferenceServerClient, direct: grpcclient.InferenceServerClient
) -> None:
    for n, out in ((256, 64), (17, 3)):
        via = client.infer(
            "full-v18", [tokens(n)], headers=bearer(ORCHID_KEY), parameters={"orchid.max_output_tokens": out}
        )
        ref = direct.infer("full-v18", [tokens(n)], parameters={"max_output_tokens": out})
        np.testing.assert_array_equal(via.as_numpy("OUTPUT_IDS"), ref.as_numpy("OUTPUT_IDS"))
        assert via.as_numpy("OUTPUT_IDS").shape == (1, out)
        got = params(via.get_response())
        assert set(got) == PROVENANCE_KEYS
        assert got["orchid.model"] == "full-v18"
        assert got["orchid.model_version"] == "1"
        assert got["orchid.approximation"] == "none"
        assert got["orchid.complete"] is True
        assert got["orchid.route_reason"] == "primary"
        assert got["orchid.ladder_step"] == 0
        assert got["orchid.charged_accelerator_ms"] > 0
        assert via.get_response().model_name == "full-v18"


def test_prediction_is_the_profile_price_times_learned_correction(
    gateway: ThreadedGateway, client: grpcclient.InferenceServerClient
) -> None:
    # 256 in / 64 out = 56.8 accelerator-ms on the profile, on the emulator's time scale (0.05),
    # times what the estimator has learned from observed work so far.
    import time

    from gateway.core.estimate import CorrectionKey

    gw = gateway.server.gateway
    assert gw is not None
    key = CorrectionKey("full-v18", "1", "short")
    correction = gw.estimator.correction(key, "orchid", time.monotonic())
    via = client.infer("full-v18", [tokens(256)], headers=bearer(ORCHID_KEY))
    got = params(via.get_response())
    assert got["orchid.predicted_accelerator_ms"] == pytest.approx(56.8 * 0.05 * correction, rel=0.02)
    assert 0.1 <= correction <= 100  # model correction x tenant factor, each bounded to [0.1, 10]


async def test_aio_infer_matches_direct(gateway: ThreadedGateway, triton: LocalTriton) -> None:
    async with (
        aioclient.InferenceServerClient(gateway.address) as via_client,
        aioclient.InferenceServerClient(triton.address) as direct_client,
    ):
        calls = [
            via_client.infer("full-v18", [tokens(64, offset=k)], headers=bearer(ORCHID_KEY)) for k in range(6)
        ]
        refs = [
            direct_client.infer("full-v18", [tokens(64, offset=k)], parameters={"max_output_tokens": 64})
            for k in range(6)
        ]
        results = await asyncio.gather(*calls)
        expected = await asyncio.gather(*refs)
    for via, ref in zip(results, expected, strict=True):
        np.testing.assert_array_equal(via.as_numpy("OUTPUT_IDS"), ref.as_numpy("OUTPUT_IDS"))
        assert params(via.get_response())["orchid.model"] == "full-v18"
    ids = {params(r.get_response())["orchid.request_id"] for r in results}
    assert len(ids) == 6


def _stream_tokens(
    address: str, headers: dict[str, str] | None, model: str, n_in: int, n_out: int, **kw: Any
) -> list[Any]:
    client = grpcclient.InferenceServerClient(address)
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)), headers=headers)
    try:
        client.async_stream_infer(model, [tokens(n_in, batched=False)], request_id="r1", **kw)
        got = []
        for _ in range(n_out):
            result, error = replies.get(timeout=20)
            got.append(error if error is not None else result)
            if error is not None:
                break
        return got
    finally:
        client.stop_stream()
        client.close()


def test_streaming_matches_direct_and_carries_provenance(
    gateway: ThreadedGateway, triton: LocalTriton
) -> None:
    via = _stream_tokens(
        gateway.address,
        bearer(ORCHID_KEY),
        "full-v18-stream",
        16,
        5,
        parameters={"orchid.max_output_tokens": 5},
    )
    ref = _stream_tokens(triton.address, None, "full-v18-stream", 16, 5, parameters={"max_output_tokens": 5})
    assert all(not isinstance(r, Exception) for r in via), via
    assert [int(r.as_numpy("OUTPUT_IDS")[0]) for r in via] == [int(r.as_numpy("OUTPUT_IDS")[0]) for r in ref]
    # Partial responses carry the admission's provenance (built once per request) and say they
    # are partial; the charge comes on the final response, which this caller did not ask for.
    for reply in via:
        got = params(reply.get_response())
        assert set(got) >= PROVENANCE_KEYS - {"orchid.charged_accelerator_ms"}
        assert "orchid.charged_accelerator_ms" not in got
        assert got["orchid.model"] == "full-v18-stream" and got["orchid.complete"] is False
        assert reply.get_response().id == "r1"
    gaps = [params(reply.get_response()).get("orchid.gap_ms") for reply in via]
    assert gaps[0] is None and all(isinstance(g, float) and g >= 0.0 for g in gaps[1:])


def test_stream_rejection_is_reported_and_stream_continues(gateway: ThreadedGateway) -> None:
    client = grpcclient.InferenceServerClient(gateway.address)
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(
        callback=lambda result, error: replies.put((result, error)), headers=bearer(ORCHID_KEY)
    )
    try:
        client.async_stream_infer("no-such-model", [tokens(8, batched=False)], request_id="bad")
        _, error = replies.get(timeout=20)
        assert isinstance(error, InferenceServerException)
        assert "NOT_FOUND" in str(error)
        client.async_stream_infer(
            "full-v18-stream",
            [tokens(8, batched=False)],
            request_id="good",
            parameters={"orchid.max_output_tokens": 2},
        )
        results = [replies.get(timeout=20) for _ in range(2)]
        assert all(error is None for _, error in results)
    finally:
        client.stop_stream()


def test_server_and_model_metadata(client: grpcclient.InferenceServerClient) -> None:
    headers = bearer(ORCHID_KEY)
    assert client.is_server_live(headers=headers)
    assert client.is_server_ready(headers=headers)
    assert client.is_model_ready("full-v18", headers=headers)
    meta = client.get_model_metadata("full-v18", headers=headers)
    assert meta.name == "full-v18"
    assert [i.name for i in meta.inputs] == ["INPUT_IDS"]
    config = client.get_model_config("full-v18", headers=headers)
    assert config.config.name == "full-v18"
    with pytest.raises(InferenceServerException) as denied:
        client.get_inference_statistics("full-v18", headers=headers)  # totals over all tenants
    assert denied.value.status() == "StatusCode.PERMISSION_DENIED"
    stats = client.get_inference_statistics("full-v18", headers=bearer(OPS_KEY))
    assert stats.model_stats[0].name == "full-v18"
    assert client.get_server_metadata(headers=headers).name == "orchid-gateway"


def test_tenant_sees_only_its_models(client: grpcclient.InferenceServerClient) -> None:
    # lumen may call full-v18 only; compact-v11 exists but must look exactly like a missing model.
    with pytest.raises(InferenceServerException) as hidden:
        client.infer("compact-v11", [tokens(8)], headers=bearer(LUMEN_KEY))
    with pytest.raises(InferenceServerException) as missing:
        client.infer("no-such-model", [tokens(8)], headers=bearer(LUMEN_KEY))
    assert hidden.value.status() == missing.value.status() == "StatusCode.NOT_FOUND"
    assert "compact" not in str(missing.value)
    with pytest.raises(InferenceServerException) as meta:
        client.get_model_metadata("compact-v11", headers=bearer(LUMEN_KEY))
    assert meta.value.status() == "StatusCode.NOT_FOUND"


def test_admin_rpcs_refused_for_tenants(client: grpcclient.InferenceServerClient) -> None:
    for call in (
        lambda h: client.load_model("full-v18", headers=h),
        lambda h: client.unload_model("full-v18", headers=h),
        lambda h: client.get_system_shared_memory_status(headers=h),
        lambda h: client.get_trace_settings(headers=h),
        lambda h: client.get_log_settings(headers=h),
        lambda h: client.get_model_repository_index(headers=h),
    ):
        with pytest.raises(InferenceServerException) as denied:
            call(bearer(ORCHID_KEY))
        assert denied.value.status() == "StatusCode.PERMISSION_DENIED"
    index = client.get_model_repository_index(headers=bearer(OPS_KEY))
    assert {m.name for m in index.models} == {
        "full-v18",
        "compact-v11",
        "full-v18-stream",
        "ranker",
        "full-v18-tp2",
        "chat",
    }


def test_health_service_and_reflection(gateway: ThreadedGateway) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(gateway.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=5
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert "inference.GRPCInferenceService" in names


def test_client_cancel_frees_queued_and_running_work(gateway: ThreadedGateway) -> None:
    """Cancelled callers leave nothing behind: no dispatch slot, no queued entry."""
    gw = gateway.server.gateway
    assert gw is not None

    def occupancy() -> tuple[int, int]:
        return (sum(q.inflight for q in gw.pools.queues()), sum(q.queued for q in gw.pools.queues()))

    async def scenario() -> tuple[tuple[int, int], int]:
        async with aioclient.InferenceServerClient(gateway.address) as c:
            tasks = [
                asyncio.ensure_future(
                    c.infer(
                        "full-v18",
                        [tokens(4096, offset=k)],
                        headers=bearer(OPS_KEY),
                        parameters={"orchid.class": "batch", "orchid.max_output_tokens": 1024},
                    )
                )
                for k in range(24)
            ]
            # Cancel once the gateway holds both kinds of work: some running, some queued (24
            # long requests, 8 slots). Polled, bounded; off this loop, which sends the requests.
            deadline = time.monotonic() + 30.0
            while True:
                during = await asyncio.to_thread(gateway.call_soon, occupancy)
                if during[0] > 0 and during[1] > 0:
                    break
                assert time.monotonic() < deadline, f"never both running and queued work: {during}"
                await asyncio.sleep(0.005)  # the poll interval of a bounded condition wait
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        return during, sum(isinstance(r, asyncio.CancelledError) for r in results)

    during, cancelled = asyncio.run(scenario())
    assert cancelled > 0, during

    async def settle() -> tuple[int, int]:
        """Occupancy once it is (0, 0), or after 2 s (a bounded condition wait)."""
        deadline = asyncio.get_running_loop().time() + 2.0
        while occupancy() != (0, 0) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return occupancy()

    assert gateway.call(settle()) == (0, 0), "cancelled work still holds a slot or a queue entry"
    # ... and every quota reservation was settled or released: nothing leaks.
    assert gateway.call_soon(lambda: gw.quotas.outstanding().count) == 0


def raw_stub(address: str) -> service_pb2_grpc.GRPCInferenceServiceStub:
    return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(address))


def test_first_result_is_the_first_token_for_streams_and_the_response_for_unary(
    gateway: ThreadedGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's outcome separates time to first result from completion (the seed's
    streaming objectives): a 48-token stream's first token comes before its last, where a
    unary call's first result is its completion. (No ratio between the two: at the tests'
    time factor the 48 decode steps take ~1 ms each, and a first token delayed by the
    machine's load once came at a quarter of the stream's time.)"""
    core = gateway.server.gateway
    assert core is not None
    outcomes: list[Any] = []
    original = core.listener.settled
    monkeypatch.setattr(
        core.listener, "settled", lambda settled: (outcomes.append(settled), original(settled))
    )
    got = _stream_tokens(
        gateway.address,
        bearer(ORCHID_KEY),
        "full-v18-stream",
        16,
        48,
        parameters={"orchid.max_output_tokens": 48},
    )
    assert all(not isinstance(r, Exception) for r in got), got
    client = grpcclient.InferenceServerClient(gateway.address)
    client.infer("full-v18", [tokens(64)], headers=bearer(ORCHID_KEY))
    client.close()
    deadline = time.monotonic() + 10
    while len(outcomes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    by_model = {s.decision.target_model: s.outcome for s in outcomes}
    stream, unary = by_model["full-v18-stream"], by_model["full-v18"]
    assert 0 < stream.first_result_ms < stream.completion_ms
    assert unary.first_result_ms == unary.completion_ms > 0
    registry = gateway.server.telemetry.metrics.registry
    labels = {"request_class": "interactive", "model": "full-v18-stream"}
    assert (registry.get_sample_value("orchid_first_result_seconds_count", labels) or 0) >= 1
