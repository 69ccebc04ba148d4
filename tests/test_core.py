"""Unit tests of the I/O-free core: record slack, demand profile, shape extraction, admission."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from msgspec.structs import replace
from tritonclient.grpc import service_pb2

from gateway.backends.triton import InputSpec, ModelSpec
from gateway.config import ShapeSpec
from gateway.core.admission import (
    AdmissionContext,
    Candidate,
    FallbackLimits,
    decide,
    fallback_misfit,
    wants_fallback_pass,
)
from gateway.core.errors import InvalidArgument
from gateway.core.estimate import predict
from gateway.core.overload import effects
from gateway.core.profile import DemandProfile, batch_accelerator_ms, padding
from gateway.core.record import Approximation, Budget, Demand, Identity, Mode, RequestRecord, Shape, Verdict
from gateway.policy.snapshot import PolicyResult
from gateway.shape import RequestHints, extract_shape, fallback_refusal, read_hints, validate_tensors

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
    budget = Budget(
        deadline_ms=200, elapsed_ms=45, reserve_upstream_ms=12, reserve_exec_ms=60, reserve_fail_ms=15
    )
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


def test_requested_outputs_must_be_the_models_and_named_once() -> None:
    req = request(3)
    req.outputs.add(name="OUTPUT_IDS")
    assert validate_tensors(req, SPEC, model="full-v18") == {"INPUT_IDS": (1, 3)}
    req.outputs.add(name="OUTPUT_IDS")
    with pytest.raises(InvalidArgument, match="output 'OUTPUT_IDS' is requested twice"):
        validate_tensors(req, SPEC, model="full-v18")
    del req.outputs[:]
    req.outputs.add(name="LOGITS")
    with pytest.raises(
        InvalidArgument, match=r"model 'full-v18' has no output 'LOGITS' \(outputs: OUTPUT_IDS\)"
    ):
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
    short = extract_shape(
        {"INPUT_IDS": (1, 256)}, RequestHints(), spec, model="m", streaming=False, input_bytes=0
    )
    long = extract_shape(
        {"INPUT_IDS": (1, 4096)}, RequestHints(), spec, model="m", streaming=False, input_bytes=0
    )
    assert (short.bucket, long.bucket) == ("short", "long")
    assert short.max_output_tokens == spec.default_max_output_tokens
    with pytest.raises(InvalidArgument, match=r"orchid\.max_output_tokens: 5000 exceeds"):
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


def record(deadline_ms: float, exec_ms: float, queue_ms: float = 0.0, **identity: object) -> RequestRecord:
    fields: dict[str, object] = {
        "request_id": "r",
        "tenant": "orchid",
        "request_class": "interactive",
        "model": "full-v18",
        "model_version": "1",
        "operation": "ModelInfer",
        "mode": Mode.ONLINE,
        "privacy_cell": "eu",
    }
    fields.update(identity)
    return RequestRecord(
        identity=Identity(**fields),  # type: ignore[arg-type]
        shape=Shape(items=1, input_tokens=256, max_output_tokens=64),
        demand=Demand(prefill_ms=exec_ms, decode_ms=0.0),
        budget=Budget(deadline_ms, 0.0, 12.0, exec_ms, 15.0, queue_ms),
    )


ALLOW = PolicyResult(policy_version="sha256:x", allowed=True, rules_fired=("r1",))
ELIGIBLE = PolicyResult(policy_version="sha256:x", allowed=True, fallback_eligible=True)
INFEASIBLE = PolicyResult(
    policy_version="sha256:x",
    allowed=False,
    status="DEADLINE_EXCEEDED",
    rule="deadline-infeasible",
    message="late",
)
DENIED = PolicyResult(
    policy_version="sha256:x", allowed=False, status="PERMISSION_DENIED", rule="privacy", message="no"
)


def context(step: int) -> AdmissionContext:
    return AdmissionContext(effects=effects(step), retry_after_ms=250)


def fallback_candidate(result: PolicyResult = ELIGIBLE) -> Candidate:
    return Candidate(record(200, 32.0, model="compact-v11"), result)


def test_allowed_primary_admits_with_its_rules() -> None:
    decision = decide(Candidate(record(200, 56.8), ALLOW), None, context(0))
    assert decision.verdict is Verdict.ADMIT
    assert (decision.route_reason, decision.rules, decision.policy_version) == (
        "primary",
        ("r1",),
        "sha256:x",
    )


def test_policy_denial_is_final_for_non_capacity_reasons() -> None:
    decision = decide(Candidate(record(200, 56.8), DENIED), fallback_candidate(), context(4))
    assert decision.verdict is Verdict.REJECT
    assert (decision.status, decision.rules) == ("PERMISSION_DENIED", ("privacy",))
    assert not wants_fallback_pass(DENIED, effects(4), fallback_available=True)


def test_infeasible_primary_goes_to_eligible_feasible_fallback() -> None:
    assert wants_fallback_pass(INFEASIBLE, effects(0), fallback_available=True)
    decision = decide(Candidate(record(200, 467.6), INFEASIBLE), fallback_candidate(), context(0))
    assert decision.verdict is Verdict.FALLBACK
    assert decision.approximation is Approximation.FALLBACK
    assert decision.target_model == "compact-v11"
    assert decision.route_reason == "fallback:primary_infeasible"
    # ... but not when the fallback is not eligible (prohibited class, floor, cold, cell ...).
    ineligible = PolicyResult(policy_version="sha256:x", allowed=True, fallback_eligible=False)
    decision = decide(Candidate(record(200, 467.6), INFEASIBLE), fallback_candidate(ineligible), context(0))
    assert decision.verdict is Verdict.REJECT and decision.status == "DEADLINE_EXCEEDED"


def test_overload_routes_eligible_work_to_fallback_only_from_step_3() -> None:
    primary = Candidate(record(200, 56.8), ELIGIBLE)
    assert not wants_fallback_pass(ELIGIBLE, effects(2), fallback_available=True)
    assert decide(primary, None, context(2)).verdict is Verdict.ADMIT
    assert wants_fallback_pass(ELIGIBLE, effects(3), fallback_available=True)
    assert not wants_fallback_pass(ELIGIBLE, effects(3), fallback_available=False)  # cold: never
    decision = decide(primary, fallback_candidate(), context(3))
    assert (decision.verdict, decision.route_reason) == (Verdict.FALLBACK, "fallback:overload")
    # Not eligible: keeps the primary even under overload.
    assert decide(Candidate(record(200, 56.8), ALLOW), None, context(3)).verdict is Verdict.ADMIT


def test_the_fallback_never_takes_a_request_its_limits_do_not() -> None:
    """A request longer than the fallback's context window stays on the primary under
    overload and, denied there for capacity, is refused with the reason; the decision says
    why (``fallback_refused``). One within the limits is diverted as before."""
    compact = FallbackLimits("compact-v11", max_input_tokens=200, max_output_tokens=1024, max_items=8)
    small = AdmissionContext(effects=effects(3), retry_after_ms=250, fallback_limits=compact)
    primary = Candidate(record(200, 56.8), ELIGIBLE)  # 256 input tokens
    decision = decide(primary, fallback_candidate(), small)
    assert decision.verdict is Verdict.ADMIT and decision.target_model == "full-v18"
    assert decision.fallback_refused == "256 input tokens exceed the fallback 'compact-v11''s limit of 200"
    denied = decide(Candidate(record(200, 467.6), INFEASIBLE), fallback_candidate(), small)
    assert (denied.verdict, denied.status) == (Verdict.REJECT, "DEADLINE_EXCEEDED")
    assert denied.message == f"late; the fallback cannot take it: {decision.fallback_refused}"
    # Output cap and items count too; the edge's tensor check (modality, datatype) is final.
    for limits, reason in (
        (FallbackLimits("compact-v11", 8192, 32, 8), "64 output tokens exceed"),
        (FallbackLimits("compact-v11", 8192, 1024, 0), "1 items exceed"),
    ):
        refused = decide(primary, fallback_candidate(), replace(small, fallback_limits=limits))
        assert refused.verdict is Verdict.ADMIT and refused.fallback_refused.startswith(reason)
    fits = FallbackLimits("compact-v11", 256, 64, 1)
    assert fallback_misfit(primary.record.shape, fits) == ""
    taken = decide(primary, fallback_candidate(), replace(small, fallback_limits=fits))
    assert (taken.verdict, taken.fallback_refused) == (Verdict.FALLBACK, "")
    tensors = replace(small, fallback_limits=fits, fallback_refused="the fallback takes no FP32")
    assert decide(primary, None, tensors).fallback_refused == "the fallback takes no FP32"


def test_the_fallback_refusal_reads_the_fallbacks_tensors_and_caps() -> None:
    """The edge's check (``gateway.shape.fallback_refusal``): the fallback's own inputs and
    datatypes (modality), then its route's caps on the request as asked."""
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 3000])
    request.raw_input_contents.append(np.zeros(3000, dtype=np.int32).tobytes())
    asked = Shape(items=1, input_tokens=3000, max_output_tokens=64)
    spec = ShapeSpec(tokens_input="INPUT_IDS", items_dim=0, max_input_tokens=2048)
    compact = dataclasses.replace(SPEC, name="compact-v11")
    assert fallback_refusal(request, compact, spec, asked, model="compact-v11") == (
        "3000 input tokens exceed the fallback 'compact-v11''s limit of 2048"
    )
    wide = spec.model_copy(update={"max_input_tokens": 8192})
    assert fallback_refusal(request, compact, wide, asked, model="compact-v11") == ""
    images = dataclasses.replace(compact, inputs=(InputSpec("PIXELS", "FP32", (-1, -1)),))
    assert "has no input 'INPUT_IDS'" in fallback_refusal(request, images, wide, asked, model="compact-v11")
    fp16 = dataclasses.replace(compact, inputs=(InputSpec("INPUT_IDS", "FP16", (-1, -1)),))
    assert "datatype INT32" in fallback_refusal(request, fp16, wide, asked, model="compact-v11")


def test_step_4_defers_batch_work_with_computed_retry() -> None:
    decision = decide(Candidate(record(30000, 56.8, request_class="batch"), ALLOW), None, context(4))
    assert decision.verdict is Verdict.REJECT
    assert (decision.status, decision.rules, decision.retry_after_ms) == (
        "RESOURCE_EXHAUSTED",
        ("ladder.defer_batch",),
        250,
    )
    assert decide(Candidate(record(30000, 56.8, request_class="batch"), ALLOW), None, context(3)).verdict is (
        Verdict.ADMIT
    )


def test_output_limit_marks_reduced_output() -> None:
    limited = PolicyResult(policy_version="sha256:x", allowed=True, max_output_tokens=16)
    decision = decide(Candidate(record(200, 56.8), limited), None, context(0))
    assert decision.max_output_tokens == 16
    assert decision.approximation is Approximation.REDUCED_OUTPUT


def test_triton_statistics_split_queue_compute_and_batch() -> None:
    from gateway.backends.stats import StatsSample, timing_between

    before = StatsSample(successes=10, queue_ns=0, compute_ns=0, inferences=10, executions=10)
    after = StatsSample(
        successes=30,
        queue_ns=20 * 2_000_000,
        compute_ns=20 * 30_000_000,
        inferences=30,
        executions=20,
    )
    timing = timing_between(before, after)
    assert timing is not None
    assert (timing.queue_ms, timing.compute_ms, timing.batch) == (2.0, 30.0, 2.0)
    assert timing_between(after, before) is None  # counters went backwards: a restart
