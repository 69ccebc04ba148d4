"""Telemetry carries no payloads: a canary secret planted in every tensor, request parameter
and metadata header never reaches logs, the decision log, traces, metrics or error messages."""

from __future__ import annotations

import io
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import msgspec
import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.backends.local import LocalTriton
from gateway.config import JobsConfig, TelemetryConfig
from gateway.core.record import (
    Budget,
    Decision,
    Demand,
    Identity,
    Mode,
    Outcome,
    RequestRecord,
    Shape,
    Verdict,
)
from gateway.exchange import Settled
from gateway.policy.decision_log import DecisionLog
from gateway.policy.snapshot import FailOpen, PolicyResult
from gateway.telemetry import Telemetry
from tests.conftest import ORCHID_KEY, ThreadedGateway, gateway_config

CANARY = "CANARY-d41d8cd98f00b204"
# The canary as the int32 words a tensor would carry it in, too.
CANARY_WORDS = np.frombuffer(CANARY.encode()[:20], dtype=np.int32)


@pytest.fixture(scope="module")
def observed(
    triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ThreadedGateway, Path]]:
    directory = tmp_path_factory.mktemp("telemetry")
    decisions = directory / "decisions.jsonl"
    config = gateway_config(
        triton.address,
        telemetry=TelemetryConfig(decision_log=str(decisions), trace_sample_ratio=1.0, tenant_labels=True),
        jobs=JobsConfig(state_dir=directory / "jobs", poll_s=0.01),
    )
    running = ThreadedGateway(config)
    running.start()
    try:
        yield running, decisions
    finally:
        running.stop()


_OPERATIONS = itertools.count()


def planted(n: int = 24, **overrides: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="full-v18", id=CANARY)
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, n])
    data = np.zeros(n, dtype=np.int32)
    data[: len(CANARY_WORDS)] = CANARY_WORDS
    request.raw_input_contents.append(data.tobytes())
    # Each call a new operation (the same id would replay the first answer: gateway.idempotent).
    request.parameters["orchid.operation_id"].string_param = f"{CANARY}-{next(_OPERATIONS)}"
    request.parameters["user_note"].string_param = CANARY
    for key, value in overrides.items():
        request.parameters[key].string_param = value
    return request


def test_canary_reaches_no_sink(
    observed: tuple[ThreadedGateway, Path], caplog: pytest.LogCaptureFixture
) -> None:
    running, decisions = observed
    telemetry = running.server.telemetry
    exporter = InMemorySpanExporter()
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    telemetry.provider.add_span_processor(SimpleSpanProcessor(exporter))
    caplog.set_level(logging.DEBUG)
    metadata = (("authorization", f"Bearer {ORCHID_KEY}"), ("x-user", CANARY), ("x-trace-note", CANARY))
    errors: list[str] = []
    with grpc.insecure_channel(running.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(3):
            reply = stub.ModelInfer(planted(), metadata=metadata, timeout=10)
            assert reply.model_name == "full-v18"
        # Error paths: bad class value, bad credential value, wrong model, bad dtype, infeasible.
        bad_calls: list[tuple[service_pb2.ModelInferRequest, tuple[tuple[str, str], ...]]] = [
            (planted(**{"orchid.class": CANARY}), metadata),
            (planted(), (("authorization", f"Bearer {CANARY}"), ("x-user", CANARY))),
            (planted(), (("authorization", CANARY),)),
            (planted(n=9000), metadata),  # over the route's input cap
        ]
        wrong_dtype = planted()
        wrong_dtype.inputs[0].datatype = "FP32"
        bad_calls.append((wrong_dtype, metadata))
        for request, call_metadata in bad_calls:
            with pytest.raises(grpc.RpcError) as failure:
                stub.ModelInfer(request, metadata=call_metadata, timeout=10)
            errors.append(f"{failure.value.details()} {failure.value.trailing_metadata()}")
        # An infeasible deadline (1 ms against 27 ms of class reserves): rejected at admission.
        with pytest.raises(grpc.RpcError) as infeasible:
            stub.ModelInfer(planted(), metadata=metadata, timeout=0.001)
        errors.append(f"{infeasible.value.details()} {infeasible.value.trailing_metadata()}")
        # Jobs: the canary in an async request (its idempotency key too) and in a batch's
        # custom_id and data; stored (mode 0600), but in no log, metric, trace or error.
        jobs = jobs_pb2_grpc.OperationsStub(channel)
        line = {
            "custom_id": CANARY,
            "inputs": [
                {"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 5], "data": CANARY_WORDS.tolist()}
            ],
            "parameters": {"user_note": CANARY},
        }
        submitted = [
            jobs.Submit(
                jobs_pb2.SubmitRequest(infer_request=planted().SerializeToString(), operation_id=CANARY),
                metadata=metadata,
                timeout=10,
            ),
            jobs.SubmitBatch(
                jobs_pb2.SubmitBatchRequest(jsonl=json.dumps(line).encode(), model="full-v18"),
                metadata=metadata,
                timeout=10,
            ),
        ]
        for op in submitted:
            final = list(jobs.Wait(jobs_pb2.GetRequest(id=op.id), metadata=metadata, timeout=60))[-1]
            assert final.status == "completed", final.error
        bad_jobs = [
            jobs_pb2.SubmitBatchRequest(
                jsonl=b'{"custom_id": "' + CANARY.encode() + b'", "inputs": 7}', model="full-v18"
            ),
            jobs_pb2.SubmitBatchRequest(jsonl=CANARY.encode(), model="full-v18"),
            jobs_pb2.SubmitBatchRequest(
                jsonl=(json.dumps(line) + "\n" + json.dumps(line)).encode(), model="full-v18"
            ),
        ]
        for bad_job in bad_jobs:
            with pytest.raises(grpc.RpcError) as failure:
                jobs.SubmitBatch(bad_job, metadata=metadata, timeout=10)
            errors.append(f"{failure.value.details()} {failure.value.trailing_metadata()}")
        for missing in (CANARY, "op-" + CANARY):
            with pytest.raises(grpc.RpcError) as failure:
                jobs.Get(jobs_pb2.GetRequest(id=missing), metadata=metadata, timeout=10)
            assert failure.value.code() is grpc.StatusCode.NOT_FOUND
    sinks = {
        "error messages": "\n".join(errors),
        "logs": "\n".join(record.getMessage() for record in caplog.records),
        "decision log": decisions.read_text(),
        "traces": "\n".join(span.to_json() for span in exporter.get_finished_spans()),
        "metrics": generate_latest(telemetry.metrics.registry).decode(),
    }
    assert sinks["decision log"].count("\n") >= 3  # the sinks were really written
    assert exporter.get_finished_spans()
    assert "orchid_charged_accelerator_ms_total" in sinks["metrics"]
    for name, text in sinks.items():
        assert CANARY not in text, f"canary leaked into {name}"
        assert CANARY[:12] not in text, f"canary prefix leaked into {name}"


def test_spans_per_stage_share_the_request_id(observed: tuple[ThreadedGateway, Path]) -> None:
    running, _ = observed
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = InMemorySpanExporter()
    running.server.telemetry.provider.add_span_processor(SimpleSpanProcessor(exporter))
    with grpc.insecure_channel(running.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(planted(), metadata=(("authorization", f"Bearer {ORCHID_KEY}"),), timeout=10)
    request_id = reply.parameters["orchid.request_id"].string_param
    spans = [s for s in exporter.get_finished_spans() if s.attributes.get("orchid.request_id") == request_id]
    names = sorted(s.name for s in spans)
    assert names == ["admission", "backend", "orchid.request", "queue"]
    root = next(s for s in spans if s.name == "orchid.request")
    assert all(
        s.parent is not None and s.parent.span_id == root.context.span_id for s in spans if s is not root
    )
    assert all(s.start_time <= s.end_time for s in spans)


def test_metrics_and_decision_log_describe_decisions(observed: tuple[ThreadedGateway, Path]) -> None:
    running, decisions = observed
    metrics = generate_latest(running.server.telemetry.metrics.registry).decode()
    assert 'orchid_decisions_total{model="full-v18",outcome="admit"' in metrics
    assert "orchid_queue_dwell_seconds_bucket" in metrics
    assert "orchid_observed_over_predicted_bucket" in metrics
    assert "orchid_ladder_step" in metrics
    assert "orchid_policy_eval_seconds_bucket" in metrics  # policy evaluation time is exported
    assert 'orchid_failed_responses_total{rule="",status="UNAUTHENTICATED"}' in metrics
    import json

    lines = [json.loads(line) for line in decisions.read_text().splitlines()]
    assert {
        "decision_id",
        "tenant",
        "class",
        "policy_version",
        "rules_fired",
        "shadow_fired",
        "eval_us",
    } <= set(lines[0])
    assert all(line["policy_version"].startswith("sha256:") for line in lines)


def _settled(deadline_ms: float, completion_ms: float, *, tenant: str = "orchid") -> Settled:
    record = RequestRecord(
        identity=Identity("r", tenant, "interactive", "full-v18", "1", "ModelInfer", Mode.ONLINE, "eu"),
        shape=Shape(items=1, input_tokens=256, max_output_tokens=8, bucket="short"),
        demand=Demand(prefill_ms=2.0, decode_ms=0.0),
        budget=Budget(deadline_ms, 0.0, 12.0, 2.0, 15.0, 0.0),
    )
    decision = Decision(Verdict.ADMIT, "full-v18", "primary")
    outcome = Outcome(True, "OK", completion_ms=completion_ms, observed_accelerator_ms=2.0)
    return Settled(record, decision, outcome)


def test_settled_metrics_are_labelled_once_and_only_when_fed() -> None:
    """The labelled children are cached per (class, model, tenant, bucket), and a series a request
    does not feed (a deadline miss) still appears only once one is counted."""
    registry = CollectorRegistry()
    telemetry = Telemetry(TelemetryConfig(), registry=registry)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(
            name, {"request_class": "interactive", "model": "full-v18", **labels}
        )

    telemetry.settled(_settled(200.0, 5.0))
    telemetry.settled(_settled(200.0, 5.0, tenant="other"))  # the same series: tenant labels are off
    assert registry.get_sample_value("orchid_validated_successes_total", {"model": "full-v18"}) == 2.0
    assert sample("orchid_deadline_misses_total") is None
    assert sample("orchid_completion_seconds_count") == 2.0
    telemetry.settled(_settled(1.0, 5.0))
    assert sample("orchid_deadline_misses_total") == 1.0
    assert registry.get_sample_value("orchid_validated_successes_total", {"model": "full-v18"}) == 2.0
    assert len(telemetry._settled_cache) == 2


def test_decision_log_records_reports_what_record_would_write() -> None:
    quiet = logging.getLogger("orchid.test.quiet-decisions")
    quiet.setLevel(logging.WARNING)
    result = PolicyResult(policy_version="sha256:x", allowed=True)
    assert not DecisionLog(quiet).records(result)
    assert DecisionLog(quiet).records(msgspec.structs.replace(result, fail_open=(FailOpen("r", "boom"),)))
    quiet.setLevel(logging.INFO)
    assert DecisionLog(quiet).records(result)
    assert DecisionLog(io.StringIO()).records(result)
