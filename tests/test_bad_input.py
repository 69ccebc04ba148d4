"""Every bad input gets a clear gRPC status and message; the gateway stays up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.backends.local import LocalTriton
from tests.conftest import (
    MODEL_REPOSITORY,
    ORCHID_KEY,
    ROOT,
    TIME_FACTOR,
    ThreadedGateway,
    gateway_config,
    ladder_steps,
)

AUTH = (("authorization", f"Bearer {ORCHID_KEY}"),)


@pytest.fixture(scope="module")
def stub(gateway: ThreadedGateway) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(gateway.address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def good_request(n: int = 8) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, n])
    request.raw_input_contents.append(np.arange(n, dtype=np.int32).tobytes())
    return request


def expect(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, request: object, code: grpc.StatusCode, *words: str
) -> str:
    with pytest.raises(grpc.RpcError) as failure:
        stub.ModelInfer(request, metadata=AUTH, timeout=10)
    error = failure.value
    assert error.code() == code, error.details()
    for word in words:
        assert word in error.details(), error.details()
    return str(error.details())


def test_good_request_passes(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    reply = stub.ModelInfer(good_request(), metadata=AUTH, timeout=10)
    assert reply.model_name == "full-v18"


def test_malformed_protobuf(gateway: ThreadedGateway) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as failure:
            raw(b"\xff\xff\xff\x0f\x01garbage", metadata=AUTH, timeout=10)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not valid protobuf" in failure.value.details()


def test_unknown_model(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request()
    request.model_name = "gpt-17"
    expect(stub, request, grpc.StatusCode.NOT_FOUND, "unknown model 'gpt-17'")


def test_wrong_datatype(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request()
    request.inputs[0].datatype = "FP32"
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "INPUT_IDS", "FP32", "expects INT32")


def test_wrong_rank_and_unknown_input(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request()
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([8])
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "rank 1", "expects rank 2")
    request = good_request()
    request.inputs[0].name = "PROMPT"
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "no input 'PROMPT'")


def test_raw_contents_length_disagrees_with_shape(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request(8)
    request.raw_input_contents[0] = request.raw_input_contents[0][:-3]
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "29 bytes", "needs 32")
    request = good_request(8)
    request.raw_input_contents.append(b"\x00" * 4)
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "2 entries", "1 inputs")


def test_negative_and_overflowing_dims(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request()
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([1, -8])
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "negative dimension -8")
    request = good_request()
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([2**40, 2**40])
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "more than")


def test_shape_over_route_caps(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request(9000)
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "9000 tokens exceeds the limit of 8192")


def test_parameters_of_wrong_type(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request()
    request.parameters["orchid.max_output_tokens"].string_param = "lots"
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "orchid.max_output_tokens must be an integer")
    request = good_request()
    request.parameters["orchid.max_output_tokens"].int64_param = 0
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "must be >= 1")
    request = good_request()
    request.parameters["orchid.allow_fallback"].string_param = "yes"
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "orchid.allow_fallback must be a bool")
    request = good_request()
    request.parameters["orchid.class"].int64_param = 3
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "orchid.class must be a non-empty string")
    request = good_request()
    request.parameters["orchid.klass"].string_param = "interactive"
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "unknown parameter 'orchid.klass'")


def test_backend_controls_are_refused_or_owned_by_the_gateway(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    request = good_request()
    request.parameters["sequence_id"].int64_param = 42
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "parameter 'sequence_id' is not available")
    request = good_request()
    request.inputs[0].parameters["shared_memory_region"].string_param = "someone-elses-region"
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "shared memory is not available")
    request = good_request()
    request.outputs.add(name="OUTPUT_IDS").parameters["shared_memory_region"].string_param = "r"
    expect(stub, request, grpc.StatusCode.INVALID_ARGUMENT, "shared memory is not available")
    # priority and timeout are the gateway's: a caller's values are dropped, the call succeeds.
    request = good_request()
    request.parameters["priority"].int64_param = 1
    request.parameters["timeout"].int64_param = 1
    assert stub.ModelInfer(request, metadata=AUTH, timeout=10).model_name == "full-v18"


def test_an_output_the_model_lacks_is_refused_by_the_gateway(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    request = good_request()
    request.outputs.add(name="OUTPUT_IDS")
    reply = stub.ModelInfer(request, metadata=AUTH, timeout=10)
    assert [o.name for o in reply.outputs] == ["OUTPUT_IDS"]
    request.outputs.add(name="LOGITS")
    # The gateway's own words (Triton would say "unexpected inference output"): refused before
    # admission, no backend call.
    expect(
        stub,
        request,
        grpc.StatusCode.INVALID_ARGUMENT,
        "model 'full-v18' has no output 'LOGITS' (outputs: OUTPUT_IDS)",
    )


def test_class_not_allowed(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = good_request()
    request.parameters["orchid.class"].string_param = "control"
    expect(stub, request, grpc.StatusCode.PERMISSION_DENIED, "request class control is not enabled")
    request.parameters["orchid.class"].string_param = "platinum"
    expect(
        stub,
        request,
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown request class in orchid.class (known: batch, control, interactive)",
    )


def test_message_over_size_limit(gateway: ThreadedGateway) -> None:
    limit = gateway.server.config.limits.max_message_bytes
    n = limit // 4 + 16
    request = good_request(8)
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([1, n])
    request.raw_input_contents[0] = b"\x00" * (4 * n)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failure:
            stub.ModelInfer(request, metadata=AUTH, timeout=10)
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in failure.value.details()


def test_infeasible_deadline_is_rejected_at_admission(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    # 4,096 input tokens cost 467.6 x 0.05 ms on the emulator; a 10 ms deadline minus the
    # interactive class's 12 + 15 ms reserves cannot fit it: rejected before execution.
    with pytest.raises(grpc.RpcError) as failure:
        stub.ModelInfer(good_request(4096), metadata=AUTH, timeout=0.010)
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "misses the deadline" in failure.value.details()
    trailing = dict(failure.value.trailing_metadata() or ())
    assert trailing.get("orchid-rule") == "deadline-infeasible"


def test_gateway_still_serves_after_bad_input(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, gateway: ThreadedGateway
) -> None:
    assert max(ladder_steps(gateway).values(), default=0) < 5  # the bad inputs above did not load it
    assert stub.ModelInfer(good_request(), metadata=AUTH, timeout=10).model_name == "full-v18"


def test_backend_down_then_recovery_without_gateway_restart(tmp_path: Path) -> None:
    triton = LocalTriton(MODEL_REPOSITORY, tmp_path / "t", time_factor=TIME_FACTOR)
    triton.start()
    running = ThreadedGateway(gateway_config(triton.address))
    running.start()
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ModelInfer(good_request(), metadata=AUTH, timeout=10).model_name == "full-v18"
            triton.kill()
            with pytest.raises(grpc.RpcError) as failure:
                stub.ModelInfer(good_request(), metadata=AUTH, timeout=10)
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
            assert triton.address.split(":")[1] not in failure.value.details()  # no backend address leaks
            triton.start()
            recovered = False
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not recovered:
                try:
                    recovered = (
                        stub.ModelInfer(good_request(), metadata=AUTH, timeout=10).model_name == "full-v18"
                    )
                except grpc.RpcError as error:
                    # Down: UNAVAILABLE. Back, while the ladder descends from the capacity loss
                    # (one step per hold period): shed with a computed retry-after.
                    assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
                    pause_s = 0.2
                    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        retry_after_ms = int(dict(error.trailing_metadata())["retry-after-ms"])
                        assert retry_after_ms > 0
                        pause_s = max(pause_s, retry_after_ms / 1000.0)  # a well-behaved client
                    time.sleep(pause_s)
            assert recovered
    finally:
        running.stop()
        triton.kill()  # disposable: see conftest.own_triton


def test_routing_rules_are_enforced_at_serve_time(triton: LocalTriton, tmp_path: Path) -> None:
    """A routing-stage rule that excludes the backend the request would use stops it, even
    when cell routing alone would have let it through (defence in depth)."""
    import shutil

    policies = tmp_path / "policies"
    shutil.copytree(ROOT / "policies", policies)
    (policies / "50-drain.yaml").write_text(
        "rules:\n  - id: drain-device-group\n    stage: routing\n"
        "    condition: \"backend.labels['device_group'] == 'local-a'\"\n    action: exclude_backend\n"
    )
    running = ThreadedGateway(gateway_config(triton.address, policies_dir=policies))
    running.start()
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as failure:
                stub.ModelInfer(good_request(), metadata=AUTH, timeout=10)
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
            assert dict(failure.value.trailing_metadata())["orchid-rule"] == "routing.excluded_backend"
    finally:
        running.stop()


def test_a_background_loop_that_swallows_its_cancellation_does_not_hang_shutdown(
    triton: LocalTriton, caplog: pytest.LogCaptureFixture
) -> None:
    """Stop cancels the background loops and waits for them, bounded: one that turns its
    cancellation into an error it catches (as a library may) is named in the log and
    abandoned, and the gateway still stops."""
    running = ThreadedGateway(gateway_config(triton.address))
    running.start()
    gate = threading.Event()

    async def stubborn() -> None:
        while not gate.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # swallowed: the loop goes on
                await asyncio.sleep(0.05)

    async def add() -> None:
        running.server._tasks.append(asyncio.get_running_loop().create_task(stubborn(), name="stubborn"))

    running.call(add())
    try:
        with caplog.at_level(logging.ERROR, logger="orchid.gateway"):
            running.stop()
    finally:
        gate.set()
    assert any("background task stubborn did not stop" in r.getMessage() for r in caplog.records)
