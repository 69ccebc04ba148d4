"""A service the gateway's config does not enable says so.

The session gateway has no ``jobs:`` block (``tests.conftest.gateway_config``): every call to
``orchid.jobs.v1.Operations`` (unary and server-streaming) answers UNIMPLEMENTED naming the
service and the config block that enables it, the ``orchid-gateway jobs``/``batch`` commands
print that line, and a service nobody serves still gets grpc's own answer."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.jobs import service as jobs_service
from gateway.server import OPTIONAL_SERVICES, not_configured_message
from orchid_tools import cli
from tests.conftest import ORCHID_KEY, ThreadedGateway

METADATA = (("authorization", f"Bearer {ORCHID_KEY}"),)
EXPECTED = not_configured_message(jobs_service.SERVICE, "jobs")


def test_the_message_names_the_service_and_the_block() -> None:
    assert OPTIONAL_SERVICES[jobs_service.SERVICE] == "jobs"
    assert "orchid.jobs.v1.Operations" in EXPECTED and "`jobs:` block" in EXPECTED
    assert len(EXPECTED) < 200


def test_every_jobs_call_answers_unimplemented_with_the_block(gateway: ThreadedGateway) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        stub = jobs_pb2_grpc.OperationsStub(channel)  # type: ignore[no-untyped-call]
        calls = (
            lambda: stub.Get(jobs_pb2.GetRequest(id="op-x"), metadata=METADATA, timeout=10),
            lambda: stub.SubmitBatch(
                jobs_pb2.SubmitBatchRequest(jsonl=b"{}\n", model="full-v18"), metadata=METADATA, timeout=10
            ),
            lambda: list(stub.Wait(jobs_pb2.GetRequest(id="op-x"), metadata=METADATA, timeout=10)),
            # No credential at all: the service is still named (nothing to authenticate for).
            lambda: stub.List(jobs_pb2.ListRequest(), timeout=10),
        )
        for call in calls:
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED
            assert raised.value.details() == EXPECTED


def test_an_unknown_service_keeps_grpcs_answer(gateway: ThreadedGateway) -> None:
    with grpc.insecure_channel(gateway.address) as channel:
        call = channel.unary_unary("/orchid.nothing.v1.Nowhere/Get")
        with pytest.raises(grpc.RpcError) as raised:
            call(b"", timeout=10)
    assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "jobs" not in (raised.value.details() or "")


def test_the_cli_prints_the_line(
    gateway: ThreadedGateway,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("ORCHID_API_KEY", ORCHID_KEY)
    target = ["--target", gateway.address, "--timeout", "10"]
    assert cli.main(["jobs", "get", "op-x", *target]) == 1
    assert capsys.readouterr().err == f"orchid-gateway: UNIMPLEMENTED: {EXPECTED}\n"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"custom_id": "a", "inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 2], '
        '"data": [1, 2]}]}\n'
    )
    assert cli.main(["batch", "submit", str(rows), "--model", "full-v18", *target]) == 1
    assert capsys.readouterr().err == f"orchid-gateway: UNIMPLEMENTED: {EXPECTED}\n"
