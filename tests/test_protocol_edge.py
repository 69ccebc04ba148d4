"""The protocol edge against a real Triton: bounded messages, every RPC decoding its own bytes
after authentication, and the credential rules docs/security.md states."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway.admin import admin_pb2
from gateway.status import ELLIPSIS, MESSAGE_BOUND, NAME_BOUND
from tests.conftest import LUMEN_KEY, OPS_KEY, ORCHID_KEY, ThreadedGateway, bearer

SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
PREFIX = "/inference.GRPCInferenceService/"
AUTH = (("authorization", f"Bearer {ORCHID_KEY}"),)
OPEN = {"ServerLive", "ServerReady"}  # health: no credential needed
NOT_UTF8 = b"\xff\xfe\xc3("
HUGE = "m" * 65536


@pytest.fixture(scope="module")
def channel(gateway: ThreadedGateway) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.address) as opened:
        yield opened


def infer_request(model: str = "full-v18", n: int = 8) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, n])
    request.raw_input_contents.append(np.arange(n, dtype=np.int32).tobytes())
    return request


def assert_bounded(message: str, name: str) -> None:
    assert len(message.encode("utf-8")) <= MESSAGE_BOUND, len(message)
    assert name[:NAME_BOUND] + ELLIPSIS in message, message[:300]
    assert name[: NAME_BOUND + 1] not in message


# ---------------------------------------------------------------- bounded messages


def test_a_64_kb_name_answers_not_found_with_a_bounded_message(
    gateway: ThreadedGateway, channel: grpc.Channel
) -> None:
    client = grpcclient.InferenceServerClient(gateway.address)
    try:
        for call in (
            lambda: client.get_model_metadata(HUGE, headers=bearer(ORCHID_KEY)),
            lambda: client.get_model_config(HUGE, headers=bearer(ORCHID_KEY)),
            lambda: client.is_model_ready(HUGE, headers=bearer(ORCHID_KEY)),
            lambda: client.get_inference_statistics(HUGE, headers=bearer(OPS_KEY)),
        ):
            with pytest.raises(InferenceServerException) as failure:
                call()
            assert failure.value.status() == "StatusCode.NOT_FOUND", failure.value.message()[:300]
            assert_bounded(failure.value.message(), HUGE)
    finally:
        client.close()
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    # A huge name on the inference path (the request path's own NotFound) and a huge version.
    with pytest.raises(grpc.RpcError) as failure:
        stub.ModelInfer(infer_request(HUGE), metadata=AUTH, timeout=10)
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    assert_bounded(failure.value.details(), HUGE)
    with pytest.raises(grpc.RpcError) as failure:
        stub.ModelMetadata(
            service_pb2.ModelMetadataRequest(name="full-v18", version=HUGE), metadata=AUTH, timeout=10
        )
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    assert_bounded(failure.value.details(), HUGE)
    # ... and on a stream, the per-request error reply is bounded the same way.
    replies = list(stub.ModelStreamInfer(iter([infer_request(HUGE)]), metadata=AUTH, timeout=10))
    assert len(replies) == 1 and replies[0].error_message.startswith("NOT_FOUND: ")
    assert_bounded(replies[0].error_message, HUGE)


def test_a_message_without_quoted_names_is_bounded_too(channel: grpc.Channel) -> None:
    # The shape is echoed whole in this message; 20,000 dimensions would be ~60 KB of trailer.
    request = infer_request()
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([1, -8] + [1] * 20000)
    with pytest.raises(grpc.RpcError) as failure:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, metadata=AUTH, timeout=10)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = failure.value.details()
    assert details.startswith("input 'INPUT_IDS': shape [1, -8, 1, 1") and details.endswith(ELLIPSIS)
    assert len(details.encode("utf-8")) <= MESSAGE_BOUND


# ---------------------------------------------------------------- every RPC decodes its own bytes


def malformed(method: Any) -> bytes:
    """Bytes for ``method``'s request that its decoder must refuse: a name (or the first
    string field) that is not UTF-8; a truncated varint for a message with no string field."""
    strings = [f for f in method.input_type.fields if f.type == FieldDescriptor.TYPE_STRING]
    strings.sort(key=lambda f: (f.name not in ("name", "model_name"), f.number))
    if not strings:
        return b"\xff\xff\xff\x0f\x01garbage"
    return bytes([strings[0].number << 3 | 2, len(NOT_UTF8)]) + NOT_UTF8


UNARY = [m for m in SERVICE.methods if not m.client_streaming and not m.server_streaming]


def gateway_lines(caplog: pytest.LogCaptureFixture, start: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records[start:] if not r.name.startswith("gateway.backends")]


@pytest.mark.parametrize("method", UNARY, ids=[m.name for m in UNARY])
def test_non_utf8_names_are_refused_after_authentication_without_a_traceback(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture, method: Any
) -> None:
    """Without a credential: UNAUTHENTICATED and no log line; with one: INVALID_ARGUMENT and
    one bounded INFO line. Never UNKNOWN, never a traceback (a log-flood vector)."""
    caplog.set_level(logging.DEBUG)
    call = channel.unary_unary(PREFIX + method.name)
    raw = malformed(method)
    for metadata, expected in (
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer not-a-key"),), grpc.StatusCode.UNAUTHENTICATED),
        (AUTH, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        if method.name in OPEN:
            expected = grpc.StatusCode.INVALID_ARGUMENT
        start = len(caplog.records)
        with pytest.raises(grpc.RpcError) as failure:
            call(raw, metadata=metadata, timeout=10)
        assert failure.value.code() == expected, (metadata, failure.value.details())
        if expected is grpc.StatusCode.INVALID_ARGUMENT:
            assert "not valid protobuf" in failure.value.details()
        lines = gateway_lines(caplog, start)
        assert not [r for r in lines if r.exc_info or r.levelno >= logging.WARNING], [
            r.getMessage()[:200] for r in lines
        ]
        assert "Traceback" not in caplog.text
        refusals = [r.getMessage() for r in lines if "malformed" in r.getMessage()]
        authenticated = metadata == AUTH and method.name not in OPEN
        assert len(refusals) == (1 if authenticated else 0), refusals
        assert all(len(line) < 200 and "\\xff" not in line for line in refusals)


def test_non_utf8_model_name_on_a_stream(channel: grpc.Channel, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    stream = channel.stream_stream(
        PREFIX + "ModelStreamInfer", response_deserializer=service_pb2.ModelStreamInferResponse.FromString
    )
    raw = malformed(SERVICE.methods_by_name["ModelStreamInfer"])
    with pytest.raises(grpc.RpcError) as failure:
        list(stream(iter([raw]), metadata=(), timeout=10))
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    replies = list(stream(iter([raw]), metadata=AUTH, timeout=10))
    assert len(replies) == 1
    assert replies[0].error_message.startswith("INVALID_ARGUMENT: malformed ModelInferRequest")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text


# ---------------------------------------------------------------- what docs/security.md states


def test_model_statistics_refuses_every_tenant_alike(gateway: ThreadedGateway) -> None:
    """Statistics are totals over every tenant: admin-only. A tenant's own model, a model it may
    not see, a missing one and no name answer the same PERMISSION_DENIED (no existence oracle);
    an admin asking for a missing model gets NOT_FOUND."""
    client = grpcclient.InferenceServerClient(gateway.address)
    try:
        answers = set()
        for key, name in (
            (LUMEN_KEY, "full-v18"),
            (LUMEN_KEY, "compact-v11"),
            (LUMEN_KEY, "no-such-model"),
            (LUMEN_KEY, ""),
            (ORCHID_KEY, "full-v18-stream"),
        ):
            with pytest.raises(InferenceServerException) as denied:
                client.get_inference_statistics(name, headers=bearer(key))
            answers.add((denied.value.status(), denied.value.message()))
        assert answers == {("StatusCode.PERMISSION_DENIED", "model statistics need an admin credential")}
        with pytest.raises(InferenceServerException) as missing:
            client.get_inference_statistics("no-such-model", headers=bearer(OPS_KEY))
        assert missing.value.status() == "StatusCode.NOT_FOUND"
        assert client.get_inference_statistics("full-v18", headers=bearer(OPS_KEY)).model_stats
    finally:
        client.close()


def test_duplicate_authorization_headers_are_refused(channel: grpc.Channel) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    good = ("authorization", f"Bearer {ORCHID_KEY}")
    bad = ("authorization", "Bearer not-a-key")
    for metadata in ((good, good), (good, bad), (bad, good)):
        for call in (
            lambda md: stub.ModelInfer(infer_request(), metadata=md, timeout=10),
            lambda md: stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="full-v18"), metadata=md),
        ):
            with pytest.raises(grpc.RpcError) as failure:
                call(metadata)
            assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "more than one 'authorization' header" in failure.value.details()
    assert stub.ModelInfer(infer_request(), metadata=(good,), timeout=10).model_name == "full-v18"


def test_bearer_scheme_is_case_insensitive_the_key_is_not(channel: grpc.Channel) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    for header in (f"bearer {ORCHID_KEY}", f"BEARER {ORCHID_KEY}", f"BeArEr  {ORCHID_KEY} "):
        reply = stub.ModelInfer(infer_request(), metadata=(("authorization", header),), timeout=10)
        assert reply.model_name == "full-v18"
    for header in (f"Bearer {ORCHID_KEY.upper()}", f"Basic {ORCHID_KEY}", f"Bearer{ORCHID_KEY}"):
        with pytest.raises(grpc.RpcError) as failure:
            stub.ModelInfer(infer_request(), metadata=(("authorization", header),), timeout=10)
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED


ADMIN = admin_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"]
ADMIN_METHODS = list(ADMIN.methods)


@pytest.mark.parametrize("method", ADMIN_METHODS, ids=[m.name for m in ADMIN_METHODS])
def test_admin_rpcs_decode_their_own_bytes_after_authentication(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture, method: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    call = channel.unary_unary(f"/{ADMIN.full_name}/{method.name}")
    for metadata, expected in (
        ((), grpc.StatusCode.UNAUTHENTICATED),
        (AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        ((("authorization", f"Bearer {OPS_KEY}"),), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.RpcError) as failure:
            call(malformed(method), metadata=metadata, timeout=10)
        assert failure.value.code() == expected, (metadata, failure.value.details())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text
