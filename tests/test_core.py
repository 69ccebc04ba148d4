"""Unit tests of the I/O-free core: record slack, demand profile, shape extraction, admission."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.admission import INFEASIBLE_RULE, AdmissionContext, decide
from gateway.backends.triton import InputSpec, ModelSpec
from gateway.config import ShapeSpec
from gateway.errors import InvalidArgument
from gateway.estimate import predict
from gateway.profile import DemandProfile, batch_accelerator_ms, padding
from gateway.record import Budget, Demand, Identity, Mode, RequestRecord, Shape, Verdict
from gateway.shape import RequestHints, extract_shape, read_hints, validate_tensors

FULL = DemandProfile(fixed_ms=4.4, prefill_ms_per_token=0.1, decode_ms_per_token=0.41875)
SPEC = ModelSpec(
    name="full-v18",
    versions=("1",),
    inputs=(InputSpec("INPUT_IDS", "INT32", (-1, -1)),),
    outputs=("OUTPUT_IDS",),
    max_batch_size=8,
    decoupled=False,
    instances=4,
)


def test_seed_teaching_request_slack_is_68_ms() -> None:
    budget = Budget(deadline_ms=200, elapsed_ms=45, reserve_upstream_ms=12, reserve_exec_ms=60, reserve_fail_ms=15)
    assert budget.slack_ms == pytest.approx(68.0)
    assert budget.remaining_ms == pytest.approx(155.0)


def test_profile_prices_the_seed_requests() -> None:
    assert FULL.accelerator_ms(256, 64) == pytest.approx(56.8)
    assert FULL.accelerator_ms(4096, 128) == pytest.approx(467.6)
    report = padding([256] * 7 + [4096])
    assert (report.useful_tokens, report.padded_tokens) == (5888, 32768)
    assert report.amplification == pytest.approx(5.565, abs=5e-4)
    # Mixed batch pays its padded shape; bucketing pays far less.
    mixed = batch_accelerator_ms(FULL, [(256, 64)] * 7 + [(4096, 128)])
    bucketed = batch_accelerator_ms(FULL, [(256, 64)] * 7) + batch_accelerator_ms(FULL, [(4096, 128)])
    assert mixed > 4 * bucketed


def test_predict_scales_by_correction() -> None:
    shape = Shape(items=1, input_tokens=256, max_output_tokens=64)
    demand = predict(FULL, shape, correction=0.5)
    assert demand.accelerator_ms == pytest.approx(28.4)
    assert demand.correction == 0.5


def request(n: int = 8, **params: object) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = req.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, n])
    req.raw_input_contents.append(np.zeros(n, dtype=np.int32).tobytes())
    for key, value in params.items():
        if isinstance(value, bool):
            req.parameters[key].bool_param = value
        elif isinstance(value, int):
            req.parameters[key].int64_param = value
        else:
            req.parameters[key].string_param = str(value)
    return req


def test_hints_are_read_and_typed() -> None:
    hints = read_hints(
        request(**{"orchid.class": "batch", "orchid.max_output_tokens": 32, "orchid.allow_fallback": False})
    )
    assert hints == RequestHints("batch", 32, False, "")


def test_typed_contents_are_counted() -> None:
    req = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = req.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 3])
    tensor.contents.int_contents.extend([1, 2])
    with pytest.raises(InvalidArgument, match="contents has 2 elements"):
        validate_tensors(req, SPEC, model="full-v18")
    tensor.contents.int_contents.append(3)
    assert validate_tensors(req, SPEC, model="full-v18") == {"INPUT_IDS": (1, 3)}


def test_missing_required_input() -> None:
    req = service_pb2.ModelInferRequest(model_name="full-v18")
    with pytest.raises(InvalidArgument, match="requires input 'INPUT_IDS'"):
        validate_tensors(req, SPEC, model="full-v18")


def test_bytes_payload_framing() -> None:
    spec = ModelSpec("m", ("1",), (InputSpec("TEXT", "BYTES", (-1,)),), ("O",), 0, False, 1)
    req = service_pb2.ModelInferRequest(model_name="m")
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[2])
    req.raw_input_contents.append((3).to_bytes(4, "little") + b"abc" + (9).to_bytes(4, "little") + b"x")
    with pytest.raises(InvalidArgument, match="runs past the end"):
        validate_tensors(req, spec, model="m")


def test_shape_extraction_buckets_and_caps() -> None:
    spec = ShapeSpec(tokens_input="INPUT_IDS", items_dim=0, max_input_tokens=8192, long_input_tokens=1024)
    short = extract_shape({"INPUT_IDS": (1, 256)}, RequestHints(), spec, model="m", streaming=False, input_bytes=0)
    long = extract_shape({"INPUT_IDS": (1, 4096)}, RequestHints(), spec, model="m", streaming=False, input_bytes=0)
    assert (short.bucket, long.bucket) == ("short", "long")
    assert short.max_output_tokens == spec.default_max_output_tokens
    with pytest.raises(InvalidArgument, match="orchid.max_output_tokens: 5000 exceeds"):
        extract_shape(
            {"INPUT_IDS": (1, 8)},
            RequestHints(max_output_tokens=5000),
            spec,
            model="m",
            streaming=False,
            input_bytes=0,
        )
    with pytest.raises(InvalidArgument, match="at least one token"):
        extract_shape({"INPUT_IDS": (1, 0)}, RequestHints(), spec, model="m", streaming=False, input_bytes=0)


def record(deadline_ms: float, exec_ms: float, queue_ms: float = 0.0) -> RequestRecord:
    return RequestRecord(
        identity=Identity("r", "orchid", "interactive", "full-v18", "1", "ModelInfer", Mode.ONLINE, "eu"),
        shape=Shape(items=1, input_tokens=256, max_output_tokens=64),
        demand=Demand(prefill_ms=exec_ms, decode_ms=0.0),
        budget=Budget(deadline_ms, 0.0, 12.0, exec_ms, 15.0, queue_ms),
    )


def test_admission_rejects_infeasible_work_with_its_numbers() -> None:
    context = AdmissionContext(policy_version="v", max_dwell_ms=20)
    assert decide(record(200, 56.8), context).verdict is Verdict.ADMIT
    rejected = decide(record(200, 467.6), context)
    assert rejected.verdict is Verdict.REJECT
    assert rejected.status == "DEADLINE_EXCEEDED"
    assert rejected.rules == (INFEASIBLE_RULE,)
    assert "467.6 ms" in rejected.message and "200.0 ms" in rejected.message
    # Queue wait ahead counts: feasible alone, infeasible behind 150 ms of queued work.
    assert decide(record(200, 56.8, queue_ms=150), context).verdict is Verdict.REJECT
