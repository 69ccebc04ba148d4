"""Truthful provenance against a real Triton: ``orchid.complete`` is false for a partial answer
(a capped output, a stream's responses before its final one, a stream cancelled midway), and
``orchid.approximation`` names every degradation that applied."""

from __future__ import annotations

import queue
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.core.errors import Unavailable
from gateway.core.record import Approximation, Decision, Verdict
from gateway.exchange import new_request_id
from gateway.messages import approximation, stream_error
from tests.conftest import ORCHID_KEY, ThreadedGateway, bearer
from tests.test_ladder_effects import pin, request

AUTH = (("authorization", f"Bearer {ORCHID_KEY}"),)
TENANT_CAP = 512  # orchid's max_output_tokens (examples/orchid/tenants.yaml): rule output-cap


def provenance(response: Any) -> dict[str, Any]:
    return {
        key: getattr(value, value.WhichOneof("parameter_choice"))
        for key, value in response.parameters.items()
    }


@pytest.fixture(scope="module")
def stub(gateway: ThreadedGateway) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(gateway.address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_a_full_answer_is_complete(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    reply = stub.ModelInfer(request(**{"orchid.max_output_tokens": TENANT_CAP}), metadata=AUTH, timeout=10)
    got = provenance(reply)
    assert (got["orchid.approximation"], got["orchid.complete"]) == ("none", True)
    assert list(reply.outputs[0].shape) == [1, TENANT_CAP]


def test_an_answer_cut_by_a_cap_is_incomplete(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    reply = stub.ModelInfer(
        request(**{"orchid.max_output_tokens": TENANT_CAP + 88}), metadata=AUTH, timeout=10
    )
    got = provenance(reply)
    assert got["orchid.approximation"] == "reduced_output"
    assert got["orchid.complete"] is False
    assert "output-cap" in got["orchid.rules"].split(",")
    assert list(reply.outputs[0].shape) == [1, TENANT_CAP]  # Triton generated only the cap


def _stream(gateway: ThreadedGateway, n_out: int) -> list[Any]:
    """Every reply of one streamed request, the empty final response included."""
    client = grpcclient.InferenceServerClient(gateway.address)
    replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
    # The stream's own deadline (20 s, as long as the test waits for a reply) rather than the
    # interactive class's default 200 ms: what is tested is provenance, whatever the machine's speed.
    client.start_stream(
        callback=lambda result, error: replies.put((result, error)),
        stream_timeout=20.0,
        headers=bearer(ORCHID_KEY),
    )
    tensor = grpcclient.InferInput("INPUT_IDS", [16], "INT32")
    tensor.set_data_from_numpy(np.arange(16, dtype=np.int32))
    try:
        client.async_stream_infer(
            "full-v18-stream",
            [tensor],
            request_id="s1",
            enable_empty_final_response=True,
            parameters={"orchid.max_output_tokens": n_out},
        )
        got = []
        while True:
            result, error = replies.get(timeout=20)
            assert error is None, f"{error.status()}: {error.message()}"
            response = result.get_response()
            got.append(response)
            if response.parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_stream_messages_carry_the_running_state(gateway: ThreadedGateway) -> None:
    """Each partial response says complete=false; the final one says whether it completed:
    true for a full answer, false for one cut by the tenant's output cap."""
    for asked, tokens, complete, approximated in (
        (8, 8, True, "none"),
        (TENANT_CAP + 1, TENANT_CAP, False, "reduced_output"),
    ):
        replies = _stream(gateway, asked)
        *partials, final = replies
        assert len(partials) == tokens and all(len(r.outputs) == 1 for r in partials)
        assert [provenance(r)["orchid.complete"] for r in partials] == [False] * tokens
        assert len(final.outputs) == 0 and provenance(final)["orchid.complete"] is complete
        assert {provenance(r)["orchid.approximation"] for r in replies} == {approximated}


def test_a_stream_cancelled_midway_reported_incomplete(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    """The caller reads three tokens of a 512-token answer and cancels: everything it was sent
    said complete=false (and not because of a cap: the answer was not degraded)."""
    hold = threading.Event()

    def requests() -> Iterator[service_pb2.ModelInferRequest]:
        req = service_pb2.ModelInferRequest(model_name="full-v18-stream", id="c1")
        tensor = req.inputs.add(name="INPUT_IDS", datatype="INT32")
        tensor.shape.append(16)
        req.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
        req.parameters["orchid.max_output_tokens"].int64_param = TENANT_CAP
        yield req
        hold.wait(30)  # keep the stream open (no half-close) until the test is done

    call = stub.ModelStreamInfer(requests(), metadata=AUTH, timeout=30)
    try:
        received = [next(call) for _ in range(3)]
        call.cancel()
    finally:
        hold.set()
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    for reply in received:
        assert not reply.error_message and len(reply.infer_response.outputs) == 1
        got = provenance(reply.infer_response)
        assert (got["orchid.complete"], got["orchid.approximation"]) == (False, "none")
        assert got.get("triton_final_response") is not True


def test_a_stream_request_that_fails_ends_with_an_incomplete_reply() -> None:
    reply = stream_error(Unavailable("streaming backend failed (RpcError)"), "r7")
    assert reply.error_message == "UNAVAILABLE: streaming backend failed (RpcError)"
    assert reply.infer_response.id == "r7"
    parameters = reply.infer_response.parameters
    assert "orchid.complete" in parameters and parameters["orchid.complete"].bool_param is False


@pytest.mark.parametrize(
    ("applied", "limit", "expected"),
    [
        (Approximation.NONE, None, "none"),
        (Approximation.REDUCED_OUTPUT, 32, "reduced_output"),
        (Approximation.FALLBACK, None, "fallback"),
        (Approximation.FALLBACK, 32, "fallback,reduced_output"),
    ],
)
def test_approximation_names_every_degradation(
    applied: Approximation, limit: int | None, expected: str
) -> None:
    verdict = Verdict.FALLBACK if applied is Approximation.FALLBACK else Verdict.ADMIT
    decision = Decision(verdict, "m", "r", approximation=applied, max_output_tokens=limit)
    assert approximation(decision) == expected


def test_a_capped_fallback_answer_says_both(pinned: ThreadedGateway) -> None:
    """Ladder step 3 sends part of the eligible work to the warm fallback; a request over the
    tenant's output cap is capped wherever it runs: ``fallback,reduced_output`` on the
    fallback, ``reduced_output`` on the primary, never complete."""
    with grpc.insecure_channel(pinned.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(request(), metadata=AUTH, timeout=10)  # creates the pool's load
        pin(pinned, 3, 1.22)
        seen: Counter[tuple[str, bool]] = Counter()
        steps: Counter[tuple[str, int, int | None]] = Counter()
        for _ in range(24):
            reply = stub.ModelInfer(
                request(**{"orchid.max_output_tokens": TENANT_CAP + 88}), metadata=AUTH, timeout=10
            )
            got = provenance(reply)
            seen[(got["orchid.approximation"], got["orchid.complete"])] += 1
            fallback_step = got.get("orchid.fallback_ladder_step")
            steps[(got["orchid.model"], got["orchid.ladder_step"], fallback_step)] += 1
    assert seen[("fallback,reduced_output", False)] > 0, seen
    assert set(seen) <= {("fallback,reduced_output", False), ("reduced_output", False)}, seen
    # Every answer says the step that decided it (the primary pool's pinned 3), the fallback's
    # also its own pool's (not pinned: 0), so a stuck primary pool shows on its answers.
    assert set(steps) == {("compact-v11", 3, 0), ("full-v18", 3, None)}, steps


def test_request_ids_are_random_uuid4_hex() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    for rid in ids:
        parsed = uuid.UUID(hex=rid)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and parsed.hex == rid
