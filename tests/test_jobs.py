"""Asynchronous and batch jobs (``orchid.jobs.v1.Operations``) against the real Triton.

One gateway of the module's own with a job store in a temporary state directory. Its
ladder's periodic update is switched off (as in ``conftest.pinned``) so a test can pin a
pool at step 4 and watch job work be deferred, not refused, then resume. Expiry and
retention are driven by calling the store's housekeeping with the due time, not by
waiting for the clock."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.backends.local import LocalTriton
from gateway.config import JobsConfig, TelemetryConfig
from gateway.core.overload import LadderState, LadderStep
from gateway.jobs.store import DB_NAME
from tests.conftest import OPS_KEY, ORCHID_KEY, ThreadedGateway, gateway_config

ORCHID = (("authorization", f"Bearer {ORCHID_KEY}"),)
OPS = (("authorization", f"Bearer {OPS_KEY}"),)
POOL = "local/full-v18"


def infer_request(n: int = 32, seed: int = 0) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, n])
    request.raw_input_contents.append((np.arange(n, dtype=np.int32) + seed).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = 8
    return request


def submit(
    stub: jobs_pb2_grpc.OperationsStub, *, key: str = "", seed: int = 0, who=ORCHID
) -> jobs_pb2.Operation:
    reply: jobs_pb2.Operation = stub.Submit(
        jobs_pb2.SubmitRequest(infer_request=infer_request(seed=seed).SerializeToString(), operation_id=key),
        metadata=who,
        timeout=10,
    )
    return reply


def wait_done(stub: jobs_pb2_grpc.OperationsStub, op_id: str, who=ORCHID) -> jobs_pb2.Operation:
    updates = list(stub.Wait(jobs_pb2.GetRequest(id=op_id), metadata=who, timeout=60))
    assert updates and updates[-1].status in {"completed", "failed", "expired", "cancelled"}
    return updates[-1]


def jsonl(n: int, *, prefix: str = "item") -> bytes:
    lines = []
    for i in range(n):
        body = {
            "custom_id": f"{prefix}-{i}",
            "inputs": [
                {"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 16], "data": list(range(i, i + 16))}
            ],
            "parameters": {"orchid.max_output_tokens": 4},
        }
        lines.append(json.dumps(body))
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def jobs_gateway(triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedGateway]:
    state = tmp_path_factory.mktemp("jobs") / "state"
    # Tenant labels on the metrics: a test reads what the gateway charged a tenant.
    running = ThreadedGateway(
        gateway_config(
            triton.address,
            jobs=JobsConfig(state_dir=state, poll_s=0.01),
            telemetry=TelemetryConfig(tenant_labels=True),
        )
    )
    running.start()
    gw = running.server.gateway
    assert gw is not None
    gw.update_ladders = lambda now: None  # type: ignore[method-assign]  # the tests pin the step
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def stub(jobs_gateway: ThreadedGateway) -> Iterator[jobs_pb2_grpc.OperationsStub]:
    with grpc.insecure_channel(jobs_gateway.address) as channel:
        yield jobs_pb2_grpc.OperationsStub(channel)


def set_step(running: ThreadedGateway, step: int) -> None:
    gw = running.server.gateway
    assert gw is not None

    def apply() -> None:
        load = gw.loads[POOL]
        load.ladder.state = LadderState(
            LadderStep(step), False, "pinned by the test", False, time.monotonic()
        )

    running.call_soon(apply)
    runner = running.server.jobs_runner
    assert runner is not None
    running.call_soon(runner.wake.set)


def test_submit_runs_through_the_request_path_and_get_returns_result(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    registry = jobs_gateway.server.telemetry.metrics.registry

    def settled() -> tuple[float, float]:
        """The gateway's own count of settled batch-class full-v18 requests and of orchid's
        charged accelerator-ms: the online path's settlement, read apart from the job's record."""
        count = registry.get_sample_value(
            "orchid_completion_seconds_count", {"request_class": "batch", "model": "full-v18"}
        )
        charged = registry.get_sample_value(
            "orchid_charged_accelerator_ms_total", {"model": "full-v18", "tenant": "orchid"}
        )
        return count or 0.0, charged or 0.0

    count_before, charged_before = settled()
    accepted = submit(stub)
    assert accepted.id.startswith("op-")
    assert accepted.kind == "async" and accepted.request_class == "batch"
    assert accepted.status in {"queued", "in_progress", "completed"}
    done = wait_done(stub, accepted.id)
    assert done.status == "completed", done.error
    assert done.counts.total == 1 and done.counts.completed == 1
    got = stub.Get(jobs_pb2.GetRequest(id=accepted.id), metadata=ORCHID, timeout=10)
    response = service_pb2.ModelInferResponse.FromString(got.infer_response)
    assert response.outputs[0].name == "OUTPUT_IDS"
    # Provenance and charge of the same path as online work, in the job's class: the gateway
    # settled one batch-class request, and charged orchid exactly what the job reports.
    assert got.provenance["orchid.model"] == "full-v18"
    assert got.provenance["orchid.policy_version"] == got.policy_version != ""
    count_after, charged_after = settled()
    assert count_after - count_before == 1
    assert got.charged_accelerator_ms > 0
    assert got.charged_accelerator_ms == pytest.approx(charged_after - charged_before, abs=1e-3)
    assert got.attempts == 0


def test_idempotency_same_request_same_operation_different_request_already_exists(
    stub: jobs_pb2_grpc.OperationsStub,
) -> None:
    first = submit(stub, key="nightly-42")
    again = submit(stub, key="nightly-42")
    assert again.id == first.id
    with pytest.raises(grpc.RpcError) as refused:
        submit(stub, key="nightly-42", seed=7)
    assert refused.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert "'nightly-42'" in (refused.value.details() or "")
    # The key is the tenant's own: another tenant may use the same key for its own operation.
    other = submit(stub, key="nightly-42", seed=7, who=OPS)
    assert other.id != first.id
    wait_done(stub, first.id)
    wait_done(stub, other.id, who=OPS)


def test_other_tenants_operation_is_not_found_exactly_like_a_missing_one(
    stub: jobs_pb2_grpc.OperationsStub,
) -> None:
    mine = submit(stub)
    missing = "op-" + "0" * 32
    answers = {}
    for name, op_id in (("theirs", mine.id), ("missing", missing)):
        for method in (stub.Get, stub.Cancel):
            with pytest.raises(grpc.RpcError) as error:
                method(jobs_pb2.GetRequest(id=op_id), metadata=OPS, timeout=10)
            answers[(name, method._method)] = (  # type: ignore[attr-defined]
                error.value.code(),
                (error.value.details() or "").replace(op_id, "ID"),
            )
    for method in (stub.Get, stub.Cancel):
        assert answers[("theirs", method._method)] == answers[("missing", method._method)]  # type: ignore[attr-defined]
        assert answers[("theirs", method._method)][0] is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    listed = stub.List(jobs_pb2.ListRequest(page_size=100), metadata=OPS, timeout=10)
    assert mine.id not in {op.id for op in listed.operations}
    wait_done(stub, mine.id)


def test_bad_input_gets_specific_errors(stub: jobs_pb2_grpc.OperationsStub) -> None:
    cases = [
        (jobs_pb2.SubmitRequest(infer_request=b"\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
        (
            jobs_pb2.SubmitRequest(
                infer_request=infer_request().SerializeToString(), request_class="interactive"
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not a job class",
        ),
        (
            jobs_pb2.SubmitRequest(infer_request=infer_request().SerializeToString(), operation_id="k" * 200),
            grpc.StatusCode.INVALID_ARGUMENT,
            "operation_id",
        ),
        (
            jobs_pb2.SubmitRequest(
                infer_request=service_pb2.ModelInferRequest(model_name="nope").SerializeToString()
            ),
            grpc.StatusCode.NOT_FOUND,
            "unknown model",
        ),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as error:
            stub.Submit(request, metadata=ORCHID, timeout=10)
        assert error.value.code() is code
        assert text in (error.value.details() or "")
    with pytest.raises(grpc.RpcError) as error:
        stub.Get(jobs_pb2.GetRequest(id="x"), timeout=10)
    assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
    line = {
        "custom_id": "a",
        "inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 2], "data": [1]}],
    }
    bad = json.dumps(line).encode()
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitBatch(
            jobs_pb2.SubmitBatchRequest(jsonl=bad, model="full-v18"), metadata=ORCHID, timeout=10
        )
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "line 1: inputs[0]" in (error.value.details() or "")
    wrong_input = jsonl(3, prefix="w").replace(b'"INPUT_IDS"', b'"TOKENS"').split(b"\n")
    mixed = b"\n".join([jsonl(1, prefix="ok").strip(), b"", wrong_input[1]])
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitBatch(
            jobs_pb2.SubmitBatchRequest(jsonl=mixed, model="full-v18"), metadata=ORCHID, timeout=10
        )
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (error.value.details() or "").startswith("line 3: ")  # checked against the model's inputs
    fp32 = infer_request()
    fp32.inputs[0].datatype = "FP32"
    with pytest.raises(grpc.RpcError) as error:
        stub.Submit(
            jobs_pb2.SubmitRequest(infer_request=fp32.SerializeToString()), metadata=ORCHID, timeout=10
        )
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    duplicate = jsonl(2, prefix="same").replace(b"same-1", b"same-0")
    with pytest.raises(grpc.RpcError) as error:
        stub.SubmitBatch(
            jobs_pb2.SubmitBatchRequest(jsonl=duplicate, model="full-v18"), metadata=ORCHID, timeout=10
        )
    assert "line 2: duplicate custom_id" in (error.value.details() or "")
    with pytest.raises(grpc.RpcError) as error:
        stub.List(jobs_pb2.ListRequest(page_token="zz"), metadata=ORCHID, timeout=10)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_store_files_are_private(jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub) -> None:
    wait_done(stub, submit(stub).id)
    store = jobs_gateway.server.jobs_store
    assert store is not None
    assert stat.S_IMODE(os.stat(store.state_dir).st_mode) == 0o700
    files = [p for p in Path(store.state_dir).iterdir()]
    assert {p.name for p in files} >= {DB_NAME, f"{DB_NAME}-wal"}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name


def test_step_4_defers_jobs_then_they_resume(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    wait_done(stub, submit(stub).id)  # the pool exists
    set_step(jobs_gateway, 4)
    try:
        op = submit(stub)
        runner = jobs_gateway.server.jobs_runner
        assert runner is not None
        # Deferred: the runner does not start it while the step holds. The tick that saw
        # step 4 is awaited (a runner tick is driven here, not waited for).
        jobs_gateway.call(runner._tick())
        got = stub.Get(jobs_pb2.GetRequest(id=op.id), metadata=ORCHID, timeout=10)
        assert got.status == "queued" and got.counts.queued == 1 and got.attempts == 0
        # Online batch-class work is still refused at step 4 (retry-after), as before.
    finally:
        set_step(jobs_gateway, 0)
    done = wait_done(stub, op.id)
    assert done.status == "completed" and done.attempts == 0


def test_cancel_queued_and_expiry_and_retention(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    wait_done(stub, submit(stub).id)
    store = jobs_gateway.server.jobs_store
    assert store is not None
    set_step(jobs_gateway, 4)  # hold new work in the queue
    try:
        queued = submit(stub)
        cancelled = stub.Cancel(jobs_pb2.GetRequest(id=queued.id), metadata=ORCHID, timeout=10)
        assert cancelled.status == "cancelled" and cancelled.counts.queued == 0
        expiring = submit(stub)
        got = stub.Get(jobs_pb2.GetRequest(id=expiring.id), metadata=ORCHID, timeout=10)
        expired_ids = jobs_gateway.call(asyncio.to_thread(store.expire_due, now=got.complete_by))
        assert expiring.id in expired_ids
        got = stub.Get(jobs_pb2.GetRequest(id=expiring.id), metadata=ORCHID, timeout=10)
        assert got.status == "expired" and "complete-by" in got.error
    finally:
        set_step(jobs_gateway, 0)
    done = wait_done(stub, submit(stub).id)
    assert done.infer_response and done.results_expire_at > done.finished_at
    purged = jobs_gateway.call(asyncio.to_thread(store.purge_due, now=done.results_expire_at))
    assert done.id in purged
    after = stub.Get(jobs_pb2.GetRequest(id=done.id), metadata=ORCHID, timeout=10)
    assert after.status == "completed" and after.results_expired
    assert not after.infer_response and "results expired" in after.error
    # A cancelled operation stays cancelled; Cancel on a finished one returns it unchanged.
    again = stub.Cancel(jobs_pb2.GetRequest(id=done.id), metadata=ORCHID, timeout=10)
    assert again.status == "completed"


def test_cancel_running_frees_slot_and_reservation(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    """The item is held inside the backend call (it has a dispatch slot and its quota
    reservation); Cancel stops it there, and the request path gives both back."""
    gw = jobs_gateway.server.gateway
    assert gw is not None
    wait_done(stub, submit(stub).id)
    backend = gw.backends["local"].client
    real_infer = backend.infer

    async def arm() -> tuple[asyncio.Future[None], asyncio.Event]:
        return asyncio.get_running_loop().create_future(), asyncio.Event()

    entered, never = jobs_gateway.call(arm())

    async def held_infer(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not entered.done():
            entered.set_result(None)
        await never.wait()  # until cancelled: the call is running at the backend
        return await real_infer(*args, **kwargs)

    def open_now() -> tuple[int, int]:
        queue = gw.queue_named(POOL)
        assert queue is not None
        return gw.quotas.available("orchid", "batch", now=time.monotonic()).concurrent, queue.inflight

    backend.infer = held_infer  # type: ignore[method-assign]
    try:
        op = submit(stub)

        async def until_running() -> None:
            await entered

        jobs_gateway.call(until_running(), timeout=30)
        assert jobs_gateway.call_soon(open_now) == (1, 1)  # one reservation, one slot
        cancelled = stub.Cancel(jobs_pb2.GetRequest(id=op.id), metadata=ORCHID, timeout=10)
        assert cancelled.status in {"cancelling", "cancelled"}
        final = wait_done(stub, op.id)
        assert final.status == "cancelled" and final.counts.running == 0
        assert jobs_gateway.call_soon(open_now) == (0, 0)
    finally:
        del backend.infer


def test_small_batch_output_set_and_manifest(stub: jobs_pb2_grpc.OperationsStub) -> None:
    data = jsonl(12)
    accepted = stub.SubmitBatch(
        jobs_pb2.SubmitBatchRequest(jsonl=data, model="full-v18", operation_id="batch-small"),
        metadata=ORCHID,
        timeout=10,
    )
    assert accepted.kind == "batch" and accepted.counts.total == 12
    done = wait_done(stub, accepted.id)
    assert done.status == "completed" and done.counts.completed == 12 and done.output_version == 1
    items, token, manifest = [], "", None
    while True:
        page = stub.ReadBatchOutput(
            jobs_pb2.ReadBatchOutputRequest(id=accepted.id, page_size=5, page_token=token),
            metadata=ORCHID,
            timeout=10,
        )
        manifest = manifest or json.loads(page.manifest_json)
        items.extend(page.items)
        token = page.next_page_token
        if not token:
            break
    assert [i.custom_id for i in items] == [f"item-{i}" for i in range(12)]
    for item in items:
        body = json.loads(item.response_json)
        assert body["outputs"][0]["name"] == "OUTPUT_IDS" and body["outputs"][0]["datatype"] == "INT32"
        assert len(body["outputs"][0]["data"]) == int(np.prod(body["outputs"][0]["shape"]))
    import hashlib

    assert manifest["input_sha256"] == hashlib.sha256(data).hexdigest()
    assert (manifest["total"], manifest["completed"], manifest["failed"]) == (12, 12, 0)
    assert manifest["model"] == "full-v18" and manifest["model_version"] and manifest["policy_version"]
    assert manifest["charged_accelerator_ms"] == pytest.approx(
        sum(i.charged_accelerator_ms for i in items), abs=0.01
    )
    listed = stub.List(jobs_pb2.ListRequest(kind="batch"), metadata=ORCHID, timeout=10)
    assert accepted.id in {op.id for op in listed.operations}


def test_cli_batch_and_jobs_commands(
    jobs_gateway: ThreadedGateway,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from orchid_tools.cli import main

    target = ["--target", jobs_gateway.address]
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(7, prefix="cli"))
    monkeypatch.delenv("ORCHID_API_KEY", raising=False)
    assert main(["batch", "get", "op-x", *target]) == 2
    assert "ORCHID_API_KEY" in capsys.readouterr().err
    monkeypatch.setenv("ORCHID_API_KEY", ORCHID_KEY)
    out_dir = tmp_path / "out"
    code = main(
        ["batch", "submit", str(source), "--model", "full-v18", "--wait", "--output", str(out_dir), *target]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    op_id = captured.out.splitlines()[0]
    assert "7/7" in captured.err and "/s ETA" in captured.err  # the progress bar
    output_set = out_dir / f"{op_id}.v1"
    lines = [json.loads(line) for line in (output_set / "output.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"cli-{i}" for i in range(7)]
    assert all(line["status"] == "succeeded" and line["response"]["outputs"] for line in lines)
    for path in output_set.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert main(["batch", "get", op_id, "--json", *target]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert {k: manifest[k] for k in ("status", "total", "completed", "failed")} == {
        "status": "completed",
        "total": 7,
        "completed": 7,
        "failed": 0,
    }
    body = tmp_path / "request.json"
    body.write_text(
        json.dumps(
            {"inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
        )
    )
    assert main(["jobs", "submit", "--model", "full-v18", "--request", str(body), "--wait", *target]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["status"] == "completed" and single["response"]["outputs"][0]["name"] == "OUTPUT_IDS"
    assert main(["jobs", "get", single["id"], *target]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == single["id"]
    assert main(["jobs", "wait", single["id"], *target]) == 0
    assert "completed 1/1" in capsys.readouterr().out
    assert main(["jobs", "list", "--kind", "batch", *target]) == 0
    assert op_id in {op["id"] for op in json.loads(capsys.readouterr().out)["operations"]}
    assert main(["jobs", "cancel", single["id"], *target]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
    monkeypatch.setenv("ORCHID_API_KEY", OPS_KEY)
    assert main(["jobs", "get", single["id"], *target]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_one_gateway_per_state_directory(tmp_path: Path) -> None:
    from gateway.core.jobs import JobLimits
    from gateway.jobs.store import SqliteJobStore, StateDirectoryBusy

    first = SqliteJobStore(tmp_path / "state", JobLimits())
    try:
        with pytest.raises(StateDirectoryBusy, match="in use by another gateway"):
            SqliteJobStore(tmp_path / "state", JobLimits())
    finally:
        first.close()
    SqliteJobStore(tmp_path / "state", JobLimits()).close()  # free again once the first closed


def test_runner_takes_tenants_in_turn(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    """Two tenants' batches queued together start alternately (the pool here runs one job item
    at a time: its ladder has no evidence), not one tenant's whole batch first."""
    wait_done(stub, submit(stub).id)
    set_step(jobs_gateway, 4)
    try:
        first = stub.SubmitBatch(
            jobs_pb2.SubmitBatchRequest(jsonl=jsonl(4, prefix="a"), model="full-v18"), metadata=ORCHID
        )
        second = stub.SubmitBatch(
            jobs_pb2.SubmitBatchRequest(jsonl=jsonl(4, prefix="b"), model="full-v18"), metadata=OPS
        )
    finally:
        set_step(jobs_gateway, 0)
    assert wait_done(stub, first.id).status == "completed"
    assert wait_done(stub, second.id, who=OPS).status == "completed"
    store = jobs_gateway.server.jobs_store
    assert store is not None
    import sqlite3

    with sqlite3.connect(f"file:{store.path}?mode=ro", uri=True) as db:
        order = [
            tenant
            for (tenant,) in db.execute(
                "SELECT o.tenant FROM items i JOIN operations o ON o.seq = i.op_seq WHERE o.id IN (?, ?) "
                "ORDER BY i.started_at",
                (first.id, second.id),
            )
        ]
    assert len(order) == 8
    assert all(a != b for a, b in itertools.pairwise(order)), order


def test_straggler_is_retried_within_the_attempt_bound(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    """An attempt that runs past its deadline (the backend call ends in DEADLINE_EXCEEDED) is
    retried after a backoff and counted; the next attempt's answer is the item's."""
    from gateway.core.errors import DeadlineExpired

    gw = jobs_gateway.server.gateway
    assert gw is not None
    wait_done(stub, submit(stub).id)
    backend = gw.backends["local"].client
    real_infer = backend.infer
    calls = []

    async def straggle_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise DeadlineExpired("the backend call ran past the item's deadline")
        return await real_infer(*args, **kwargs)

    backend.infer = straggle_once  # type: ignore[method-assign]
    try:
        done = wait_done(stub, submit(stub, seed=3).id)
    finally:
        del backend.infer
    assert done.status == "completed" and done.attempts == 1 and len(calls) == 2


def test_item_failing_every_attempt_fails_the_operation_with_its_error(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    from gateway.core.errors import Unavailable

    gw = jobs_gateway.server.gateway
    assert gw is not None
    wait_done(stub, submit(stub).id)
    backend = gw.backends["local"].client

    async def down(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise Unavailable("backend unavailable")

    backend.infer = down  # type: ignore[method-assign]
    try:
        done = wait_done(stub, submit(stub, seed=4).id)
    finally:
        del backend.infer
    assert done.status == "failed" and done.attempts == 3  # jobs.max_attempts
    assert done.error == "UNAVAILABLE: backend unavailable" and not done.infer_response
    assert done.charged_accelerator_ms == 0


def test_wait_ends_cleanly_within_the_callers_deadline(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    wait_done(stub, submit(stub).id)
    set_step(jobs_gateway, 4)  # the operation stays queued for the whole wait
    try:
        op = submit(stub)
        updates = list(stub.Wait(jobs_pb2.GetRequest(id=op.id), metadata=ORCHID, timeout=1.0))
        assert updates and updates[-1].status == "queued"  # ended by the bound, not an error
    finally:
        set_step(jobs_gateway, 0)
    assert wait_done(stub, op.id).status == "completed"


def test_an_output_not_as_the_model_declares_is_not_accepted(
    jobs_gateway: ThreadedGateway, stub: jobs_pb2_grpc.OperationsStub
) -> None:
    """Validation reads the model's declared outputs (Triton's metadata): an answer whose
    output has another datatype is retried, and after the attempt bound the item fails."""
    gw = jobs_gateway.server.gateway
    assert gw is not None
    wait_done(stub, submit(stub).id)
    backend = gw.backends["local"].client
    real_infer = backend.infer

    async def wrong_dtype(*args, **kwargs):  # type: ignore[no-untyped-def]
        response = await real_infer(*args, **kwargs)
        response.outputs[0].datatype = "FP32"  # same byte count as INT32: only the declaration tells
        return response

    backend.infer = wrong_dtype  # type: ignore[method-assign]
    try:
        done = wait_done(stub, submit(stub, seed=5).id)
    finally:
        del backend.infer
    assert done.status == "failed" and done.attempts == 3
    assert done.error == "invalid output: output 'OUTPUT_IDS' is FP32; the model declares INT32"
