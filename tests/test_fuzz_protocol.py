"""Property-based fuzzing of the protocol edge: hostile ModelInferRequests never crash or hang
the gateway, never bypass policy, and always get a well-formed gRPC status."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.conftest import LUMEN_KEY, ORCHID_KEY, ThreadedGateway

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ALREADY_EXISTS,  # an orchid.operation_id reused for another request
}
DTYPES = ["INT32", "FP32", "BYTES", "INT64", "BOOL", "", "INT32\x00", "FP16"]
MODELS = ["full-v18", "compact-v11", "full-v18-stream", "", "../full-v18", "full-v18\n", "x" * 300]
PARAMS = [
    "orchid.class",
    "orchid.max_output_tokens",
    "orchid.allow_fallback",
    "orchid.operation_id",
    "orchid.other",
    "sequence_id",
    "priority",
    "timeout",
    "max_output_tokens",
    "",
]


@st.composite
def hostile_requests(draw: st.DrawFn) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(
        model_name=draw(st.sampled_from(MODELS)),
        model_version=draw(st.sampled_from(["", "1", "2", "-1"])),
        id=draw(st.text(max_size=20)),
    )
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(
            name=draw(st.sampled_from(["INPUT_IDS", "OTHER", ""])), datatype=draw(st.sampled_from(DTYPES))
        )
        tensor.shape.extend(draw(st.lists(st.integers(-(2**62), 2**62) | st.integers(-2, 600), max_size=4)))
        if draw(st.booleans()):
            tensor.contents.int_contents.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40)))
    for _ in range(draw(st.integers(0, 3))):
        request.raw_input_contents.append(draw(st.binary(max_size=2400)))
    for _ in range(draw(st.integers(0, 3))):
        param = request.parameters[draw(st.sampled_from(PARAMS))]
        kind = draw(st.sampled_from(["bool", "int", "str", "double"]))
        if kind == "bool":
            param.bool_param = draw(st.booleans())
        elif kind == "int":
            param.int64_param = draw(st.integers(-(2**63), 2**63 - 1))
        elif kind == "str":
            param.string_param = draw(st.text(max_size=30))
        else:
            param.double_param = draw(st.floats(allow_nan=True, allow_infinity=True))
    return request


@pytest.fixture(scope="module")
def stub(gateway: ThreadedGateway) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(gateway.address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=hostile_requests(), key=st.sampled_from([ORCHID_KEY, LUMEN_KEY, "nope"]))
def test_hostile_requests_get_a_status_and_never_bypass_policy(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest, key: str
) -> None:
    try:
        reply = stub.ModelInfer(request, metadata=(("authorization", f"Bearer {key}"),), timeout=10)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
        assert error.details(), "every refusal says why"
        reply = None
    assert code in ALLOWED, code
    if code is grpc.StatusCode.OK:
        assert reply is not None
        # Only authenticated tenants, only their models, always with provenance.
        assert key != "nope"
        assert not (key == LUMEN_KEY and request.model_name != "full-v18")
        assert reply.parameters["orchid.policy_version"].string_param.startswith("sha256:")


def test_gateway_still_serves_after_fuzzing(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 4])
    tensor.contents.int_contents.extend([1, 2, 3, 4])
    reply = stub.ModelInfer(request, metadata=(("authorization", f"Bearer {ORCHID_KEY}"),), timeout=10)
    assert reply.model_name == "full-v18"
