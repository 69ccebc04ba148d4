"""Stream objectives (issue 28, item 3): a stream is judged by its first result, and its
results are measured against its first-result deadline and its inter-result gap objective.

Pure core first (``gateway.core.streaming``: the objectives and the ``GapTracker``;
``gateway.core.pricing``: a stream's first-result slack), then the edges that read them:
the ``orchid.first_result_ms`` / ``orchid.gap_ms`` parameters (``gateway.shape``), the
class config, provenance (``gateway.messages``), the metrics (``gateway.telemetry``) and the
status board. No event loop and no clock: every time here is the test's.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from tritonclient.grpc import service_pb2

from gateway.config import RequestClassConfig, TelemetryConfig
from gateway.core import pricing
from gateway.core.admission import AdmissionContext, Candidate, decide
from gateway.core.dispatch import DispatchQueue
from gateway.core.errors import ConfigError, InvalidArgument
from gateway.core.estimate import Estimator
from gateway.core.overload import effects
from gateway.core.profile import DemandProfile
from gateway.core.record import (
    Approximation,
    Decision,
    Identity,
    Mode,
    Outcome,
    RequestRecord,
    Shape,
    Verdict,
)
from gateway.core.streaming import (
    MAX_KEPT_GAPS,
    GapTracker,
    StreamObjectives,
    first_result_reserve_ms,
    stream_objectives,
)
from gateway.exchange import Settled
from gateway.messages import attach_partial, attach_provenance, partial_template, provenance
from gateway.policy.loader import load_policies
from gateway.policy.schema import PolicyContext, RouteFacts, TenantFacts
from gateway.shape import read_hints, stream_objectives_for
from gateway.statusboard import StatusBoard
from gateway.telemetry import Telemetry
from orchid_tools.simulate import render_json, render_text, simulate
from tests.conftest import ROOT

FULL = DemandProfile(fixed_ms=4.4, prefill_ms_per_token=0.1, decode_ms_per_token=0.41875)
TEACHING = Shape(items=1, input_tokens=256, max_output_tokens=64, bucket="short", streaming=True)
LONG_OUTPUT = Shape(items=1, input_tokens=256, max_output_tokens=1024, bucket="short", streaming=True)
STEP_MS = 0.41875  # one decode step of FULL
PREFILL_MS = 30.0  # 4.4 + 0.1 x 256


def identity(mode: Mode = Mode.STREAMING) -> Identity:
    return Identity(
        request_id="s1",
        tenant="orchid",
        request_class="interactive",
        model="full-v18-stream",
        model_version="",
        operation="ModelStreamInfer" if mode is Mode.STREAMING else "ModelInfer",
        mode=mode,
        privacy_cell="eu-restricted",
    )


def priced(
    shape: Shape,
    *,
    mode: Mode = Mode.STREAMING,
    first_result_ms: float | None = None,
    gap_ms: float | None = None,
    queue: DispatchQueue | None = None,
    now: float = 0.0,
) -> RequestRecord:
    record, _ = pricing.price(
        identity(mode),
        shape,
        profile=FULL,
        backend_model="full-v18-stream",
        version="",
        time_scale=1.0,
        estimator=Estimator(),
        queue=queue or DispatchQueue("full-v18-stream", devices=1, slots=1, max_queued=10),
        reserves=pricing.Reserves(
            deadline_ms=200.0, upstream_ms=12.0, fail_ms=15.0, first_result_ms=first_result_ms, gap_ms=gap_ms
        ),
        weight=1.0,
        received_at=0.0,
        ladder_step=0,
        now=now,
    )
    return record


# --------------------------------------------------------------------------- pricing


def test_a_stream_is_judged_by_its_first_result() -> None:
    record = priced(TEACHING, first_result_ms=100.0, gap_ms=20.0)
    budget = record.budget
    assert budget.first_result_deadline_ms == 100.0 and budget.gap_objective_ms == 20.0
    assert budget.deadline_ms == 200.0  # the completion deadline stays
    assert budget.reserve_first_result_ms == pytest.approx(PREFILL_MS + STEP_MS)
    # 100 - 12 - 30.41875 - 15
    assert budget.first_result_slack_ms == pytest.approx(42.58125)
    assert budget.slack_ms == budget.first_result_slack_ms
    assert budget.completion_slack_ms == pytest.approx(200 - 12 - 56.8 - 15)
    assert budget.latest_start_ms == pytest.approx(100 - (PREFILL_MS + STEP_MS) - 15)


def test_the_first_result_deadline_defaults_to_and_never_passes_the_deadline() -> None:
    assert priced(TEACHING).budget.first_result_deadline_ms == 200.0
    assert priced(TEACHING, first_result_ms=5_000.0).budget.first_result_deadline_ms == 200.0


def test_a_long_stream_whose_first_result_is_in_time_is_admissible() -> None:
    # 1,024 tokens of decode (428.8 ms) cannot complete in 200 ms, but the first result can.
    budget = priced(LONG_OUTPUT).budget
    assert budget.completion_slack_ms < 0
    assert budget.slack_ms == pytest.approx(200 - 12 - (PREFILL_MS + STEP_MS) - 15)


def test_unary_work_is_priced_exactly_as_before() -> None:
    shape = Shape(items=1, input_tokens=256, max_output_tokens=64, bucket="short")
    record = priced(shape, mode=Mode.ONLINE, first_result_ms=10.0, gap_ms=1.0, now=0.045)
    budget = record.budget
    assert budget.first_result_deadline_ms is None and budget.gap_objective_ms is None
    assert budget.reserve_first_result_ms == 0.0
    expected = (
        budget.deadline_ms
        - budget.elapsed_ms
        - budget.reserve_upstream_ms
        - budget.reserve_exec_ms
        - budget.reserve_fail_ms
        - budget.queue_wait_ms
    )
    assert budget.slack_ms == expected == budget.first_result_slack_ms  # bit for bit
    assert budget.latest_start_ms == budget.deadline_ms - budget.reserve_exec_ms - budget.reserve_fail_ms


def test_the_first_result_reserve_is_prefill_and_one_decode_step() -> None:
    assert first_result_reserve_ms(30.0, 26.8, 64, 1.0) == pytest.approx(30.0 + 26.8 / 64 + 1.0)
    assert first_result_reserve_ms(30.0, 0.0, 0, 0.0) == 30.0


def _context() -> PolicyContext:
    return PolicyContext(
        tenant=TenantFacts(
            name="orchid",
            allowed_cells=("eu-restricted",),
            allowed_classes=("interactive",),
            allowed_models=("full-v18-stream",),
        ),
        route=RouteFacts(model="full-v18-stream"),
    )


def test_a_stream_whose_first_result_cannot_arrive_in_time_is_refused_before_it_runs() -> None:
    # First result due in 40 ms: 12 upstream + 30.4 prefill and first step + 15 variance > 40.
    record = priced(TEACHING, first_result_ms=40.0)
    assert record.budget.first_result_slack_ms == pytest.approx(40 - 12 - (PREFILL_MS + STEP_MS) - 15)
    assert record.budget.slack_ms < 0 and record.budget.completion_slack_ms > 0
    policy = load_policies(ROOT / "policies").evaluate(record, _context())
    assert not policy.allowed
    assert (policy.status, policy.rule) == ("DEADLINE_EXCEEDED", "deadline-infeasible")
    decision = decide(
        Candidate(record, policy), None, AdmissionContext(effects=effects(0), retry_after_ms=250)
    )
    assert decision.verdict is Verdict.REJECT and decision.status == "DEADLINE_EXCEEDED"
    assert decision.rules == ("deadline-infeasible",)
    # The same stream with its first result due at the deadline is admitted.
    allowed = load_policies(ROOT / "policies").evaluate(priced(TEACHING), _context())
    assert allowed.allowed


def test_a_stream_behind_a_busy_pool_is_judged_by_its_first_result_wait() -> None:
    queue = DispatchQueue("full-v18-stream", devices=1, slots=1, max_queued=10)
    queue.request(0.0, latest_start=1.0, cost_ms=100.0)  # 100 ms of work holds the one device
    record = priced(TEACHING, first_result_ms=120.0, queue=queue)
    assert record.budget.queue_wait_ms == pytest.approx(100.0)
    assert record.budget.slack_ms == pytest.approx(120 - 12 - (PREFILL_MS + STEP_MS) - 15 - 100)


# --------------------------------------------------------------------------- objectives


def test_stream_objectives_prefer_the_callers_over_the_class() -> None:
    o = stream_objectives(deadline_ms=200.0, max_deadline_ms=600_000.0)
    assert o == StreamObjectives(first_result_ms=200.0, completion_ms=200.0, gap_ms=None)
    o = stream_objectives(
        deadline_ms=200.0, max_deadline_ms=1000.0, class_first_result_ms=80.0, class_gap_ms=25.0
    )
    assert (o.first_result_ms, o.gap_ms) == (80.0, 25.0)
    o = stream_objectives(
        deadline_ms=200.0,
        max_deadline_ms=1000.0,
        class_first_result_ms=80.0,
        class_gap_ms=25.0,
        requested_first_result_ms=500.0,  # capped at the completion deadline
        requested_gap_ms=10.0,
    )
    assert (o.first_result_ms, o.gap_ms) == (200.0, 10.0)
    with pytest.raises(InvalidArgument, match=r"orchid\.gap_ms must be at most the class's max deadline"):
        stream_objectives(deadline_ms=200.0, max_deadline_ms=1000.0, requested_gap_ms=1001.0)


def _request(**params: object) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="full-v18-stream")
    for name, value in params.items():
        p = request.parameters[name]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = str(value)
    return request


def test_read_hints_reads_the_stream_objectives() -> None:
    hints = read_hints(_request(**{"orchid.first_result_ms": 80, "orchid.gap_ms": 12.5}))
    assert (hints.first_result_ms, hints.gap_ms) == (80.0, 12.5)
    assert read_hints(_request()).first_result_ms is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("fast", "must be a number of milliseconds"),
        (True, "must be a number of milliseconds"),
        (0, "> 0"),
        (-5.0, "> 0"),
        (math.nan, "> 0"),
        (math.inf, "> 0"),
        (1e12, "> 0"),
    ],
)
def test_bad_stream_objectives_are_invalid_arguments(value: object, problem: str) -> None:
    for name in ("orchid.first_result_ms", "orchid.gap_ms"):
        with pytest.raises(InvalidArgument, match=re.escape(name)) as caught:
            read_hints(_request(**{name: value}))
        assert problem in caught.value.message


def test_requested_objectives_are_bounded_by_the_class() -> None:
    klass = RequestClassConfig(
        default_deadline_ms=200.0, max_deadline_ms=1000.0, first_result_ms=80.0, gap_ms=30.0
    )
    o = stream_objectives_for(read_hints(_request()), klass, 200.0)
    assert (o.first_result_ms, o.gap_ms, o.completion_ms) == (80.0, 30.0, 200.0)
    o = stream_objectives_for(read_hints(_request(**{"orchid.gap_ms": 5})), klass, 150.0)
    assert (o.first_result_ms, o.gap_ms, o.completion_ms) == (80.0, 5.0, 150.0)
    with pytest.raises(InvalidArgument, match=r"orchid\.first_result_ms"):
        stream_objectives_for(read_hints(_request(**{"orchid.first_result_ms": 2000})), klass, 200.0)


def test_the_class_config_validates_stream_objectives() -> None:
    klass = RequestClassConfig(default_deadline_ms=200.0)
    assert klass.first_result_ms is None and klass.gap_ms is None
    with pytest.raises(ValidationError):
        RequestClassConfig(default_deadline_ms=200.0, gap_ms=0.0)
    with pytest.raises(ValidationError, match="first_result_ms"):
        RequestClassConfig(default_deadline_ms=200.0, max_deadline_ms=1000.0, first_result_ms=2000.0)


# --------------------------------------------------------------------------- the tracker

OBJECTIVES = StreamObjectives(first_result_ms=100.0, completion_ms=200.0, gap_ms=20.0)


def test_the_tracker_measures_first_result_and_gaps() -> None:
    tracker = GapTracker(10.0, OBJECTIVES)
    assert tracker.result(10.050) is None  # the first result: 50 ms after arrival
    assert tracker.result(10.060) == pytest.approx(10.0)
    assert tracker.result(10.090) == pytest.approx(30.0)  # over the 20 ms objective
    so_far = tracker.summary(10.095)
    assert so_far.first_result_ms == pytest.approx(50.0) and so_far.first_result_met
    assert (so_far.results, so_far.gaps, so_far.gaps_over_objective) == (3, 2, 1)
    assert so_far.max_gap_ms == pytest.approx(30.0) and so_far.mean_gap_ms == pytest.approx(20.0)
    assert not so_far.gap_objective_met and not so_far.finished
    done = tracker.finish(10.1)
    assert done.finished and done.completion_met and done.last_result_ms == pytest.approx(90.0)
    assert tracker.result(10.2) is None and tracker.finish(11.0) is done  # idempotent


def test_a_stream_with_no_result_missed_its_first_result() -> None:
    summary = GapTracker(0.0, OBJECTIVES).finish(0.3)
    assert summary.first_result_ms is None and not summary.first_result_met
    assert summary.gap_objective_met and summary.max_gap_ms == 0.0
    assert not summary.completion_met  # ended 300 ms after arrival


def test_without_a_gap_objective_no_gap_misses() -> None:
    tracker = GapTracker(0.0, StreamObjectives(first_result_ms=100.0, completion_ms=200.0))
    for t in (0.01, 0.5, 1.5):
        tracker.result(t)
    summary = tracker.finish(1.5)
    assert summary.gap_objective_met and summary.gaps_over_objective == 0
    assert summary.max_gap_ms == pytest.approx(1000.0)


def test_the_tracker_keeps_a_bounded_sample_of_gaps() -> None:
    tracker = GapTracker(0.0, OBJECTIVES)
    for k in range(MAX_KEPT_GAPS + 50):
        tracker.result(k * 0.001)
    summary = tracker.summary(1.0)
    assert summary.gaps == MAX_KEPT_GAPS + 49 and len(summary.gaps_ms) == MAX_KEPT_GAPS


@given(
    start=st.floats(min_value=0.0, max_value=1e4, allow_nan=False),
    offsets=st.lists(st.floats(min_value=0.0, max_value=5.0, allow_nan=False), max_size=60),
    gap_objective=st.one_of(st.none(), st.floats(min_value=0.001, max_value=2000.0)),
    first_objective=st.floats(min_value=0.001, max_value=5000.0),
)
def test_the_tracker_agrees_with_the_definitions(
    start: float, offsets: list[float], gap_objective: float | None, first_objective: float
) -> None:
    times = [start + o for o in sorted(offsets)]
    objectives = StreamObjectives(
        first_result_ms=first_objective, completion_ms=10_000.0, gap_ms=gap_objective
    )
    tracker = GapTracker(start, objectives)
    returned = [tracker.result(t) for t in times]
    summary = tracker.finish(times[-1] if times else start)
    gaps = [(b - a) * 1000.0 for a, b in itertools.pairwise(times)]
    assert summary.results == len(times) and summary.gaps == len(gaps)
    assert returned[:1] == [None] * min(1, len(times))
    assert returned[1:] == pytest.approx(gaps)
    assert summary.max_gap_ms == pytest.approx(max(gaps, default=0.0))
    assert summary.mean_gap_ms == pytest.approx(sum(gaps) / len(gaps) if gaps else 0.0)
    assert summary.max_gap_ms >= summary.mean_gap_ms - 1e-9
    over = sum(g > gap_objective for g in summary.gaps_ms) if gap_objective is not None else 0
    assert summary.gaps_over_objective == over
    assert summary.gap_objective_met == (over == 0)
    if times:
        first = summary.first_result_ms
        assert first is not None and first == pytest.approx((times[0] - start) * 1000.0)
        assert summary.first_result_met == (first <= first_objective)
    else:
        assert summary.first_result_ms is None and not summary.first_result_met


# --------------------------------------------------------------------------- edges


def _settled() -> Settled:
    record = priced(TEACHING, first_result_ms=100.0, gap_ms=20.0)
    decision = Decision(
        verdict=Verdict.ADMIT, target_model="full-v18-stream", route_reason="primary", policy_version="v"
    )
    outcome = Outcome(admitted=True, status="OK", approximation=Approximation.NONE, first_result_ms=40.0)
    return Settled(record, decision, outcome)


def _finished_stream() -> GapTracker:
    tracker = GapTracker(0.0, OBJECTIVES)
    for t in (0.05, 0.06, 0.09):
        tracker.result(t)
    return tracker


STREAM_KEYS = {
    "orchid.first_result_ms",
    "orchid.first_result_deadline_ms",
    "orchid.first_result_met",
    "orchid.max_gap_ms",
    "orchid.gaps",
    "orchid.gap_objective_ms",
    "orchid.gap_objective_met",
    "orchid.gaps_over_objective",
}


def test_provenance_carries_the_stream_objectives_and_keeps_its_keys() -> None:
    settled = _settled()
    plain = provenance(settled)
    assert not STREAM_KEYS & plain.keys()
    summary = _finished_stream().finish(0.1)
    got = provenance(settled, summary)
    assert {k: got[k] for k in plain} == plain  # the existing keys, unchanged
    assert got.keys() >= STREAM_KEYS
    assert got["orchid.first_result_ms"] == 50.0 and got["orchid.first_result_met"] is True
    assert got["orchid.max_gap_ms"] == 30.0 and got["orchid.gap_objective_met"] is False
    assert (got["orchid.gaps"], got["orchid.gaps_over_objective"], got["orchid.gap_objective_ms"]) == (
        2,
        1,
        20.0,
    )
    response = service_pb2.ModelInferResponse()
    attach_provenance(response, settled, summary)
    assert response.parameters["orchid.first_result_met"].bool_param is True
    assert response.parameters["orchid.gaps"].int64_param == 2
    assert response.parameters["orchid.max_gap_ms"].double_param == 30.0


def test_a_partial_response_carries_the_admission_template_and_its_gap() -> None:
    settled = _settled()
    template = partial_template(settled.record, settled.decision, None)
    response = service_pb2.ModelInferResponse()
    attach_partial(response, template)
    got = set(response.parameters)
    assert {"orchid.complete", "orchid.request_id", "orchid.model", "orchid.policy_version"} <= got
    assert "orchid.charged_accelerator_ms" not in got  # settled once, on the final response
    assert response.parameters["orchid.complete"].bool_param is False
    attach_partial(response, template, gap_ms=12.3456)
    assert response.parameters["orchid.gap_ms"].double_param == 12.346


def test_stream_metrics_are_exported() -> None:
    registry = CollectorRegistry()
    telemetry = Telemetry(TelemetryConfig(), registry=registry)
    telemetry.stream_settled(_settled(), _finished_stream().finish(0.1))
    labels = {"request_class": "interactive", "model": "full-v18-stream"}
    value = registry.get_sample_value
    assert value("orchid_stream_first_result_seconds_count", labels) == 1
    assert value("orchid_stream_first_result_seconds_sum", labels) == pytest.approx(0.05)
    assert value("orchid_stream_gap_seconds_count", labels) == 2
    assert value("orchid_stream_gap_seconds_sum", labels) == pytest.approx(0.04)
    assert value("orchid_stream_gap_objective_misses_total", labels) == 1
    assert value("orchid_stream_first_result_misses_total", labels) is None  # in time: no series
    telemetry.stream_settled(_settled(), GapTracker(0.0, OBJECTIVES).finish(0.3))
    assert value("orchid_stream_first_result_misses_total", labels) == 1


def test_the_status_board_shows_streaming_models() -> None:
    board = StatusBoard(wall=lambda: 0.0)
    for _ in range(3):
        board.stream_settled(_settled(), _finished_stream().finish(0.1))
    board.stream_settled(_settled(), GapTracker(0.0, OBJECTIVES).finish(0.3))
    (view,) = board._streams_view()
    assert view["model"] == "full-v18-stream" and view["streams"] == 4
    assert view["first_result_p50_ms"] == 50.0 and view["first_result_p95_ms"] == 50.0
    assert view["gap_p95_ms"] == 30.0
    assert view["first_result_met_share"] == 0.75 and view["gap_met_share"] == 0.25


# --------------------------------------------------------------------------- the simulator


def _stream_scenario(tmp_path: Path, **arrivals: dict[str, Any]) -> Path:
    scenario: dict[str, Any] = {
        "gateway": str(ROOT / "examples" / "orchid" / "gateway.yaml"),
        "tenants_file": str(ROOT / "examples" / "orchid" / "tenants.yaml"),
        "seed": 3,
        "fleet": [
            {
                "name": "pool",
                "cell": "eu-restricted",
                "devices": 4,
                "models": {"full-v18": {}, "full-v18-stream": {}},
            }
        ],
        "arrivals": arrivals,
        "phases": [{"name": "one", "duration_s": 3}],
    }
    path = tmp_path / "streams.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


STREAM_ARRIVAL: dict[str, Any] = {
    "tenant": "orchid",
    "model": "full-v18-stream",
    "class": "interactive",
    "mode": "streaming",
    "rate_per_s": 5,
    "input_tokens": 256,
    "output_tokens": 64,
}


def test_the_simulator_drives_streaming_arrivals(tmp_path: Path) -> None:
    path = _stream_scenario(
        tmp_path,
        # One decode step is 0.41875 ms: a 0.3 ms gap objective is missed by every stream.
        chat={**STREAM_ARRIVAL, "first_result_ms": 100, "gap_ms": 0.3},
        # A 40 ms call deadline: its first result (12 + 30.4 + 15 ms of reserves) cannot arrive
        # in time, so it is refused before it runs.
        tight={**STREAM_ARRIVAL, "deadline_ms": 40},
    )
    document = simulate(path)
    assert document["classes"]["chat"]["mode"] == "streaming"
    assert document["classes"]["chat"]["first_result_ms"] == 100.0
    assert document["classes"]["chat"]["gap_ms"] == 0.3
    chat = document["phases"][0]["classes"]["chat"]
    assert chat["offered"] > 0 and chat["on_time"] == chat["offered"] == chat["streams_started"]
    assert chat["first_result_on_time_pct"] == 100.0 and chat["gap_objective_met_pct"] == 0.0
    assert chat["gaps_over_objective"] == 63 * chat["offered"]  # 64 results, 63 gaps each
    assert chat["first_result_p50_ms"] == pytest.approx(PREFILL_MS + STEP_MS, abs=0.01)
    assert chat["max_gap_p95_ms"] == pytest.approx(STEP_MS, abs=0.01)
    tight = document["phases"][0]["classes"]["tight"]
    assert tight["offered"] > 0 and tight["rejected_early"] == tight["offered"]
    assert tight["streams_started"] == 0 and tight["first_result_on_time_pct"] == 0.0
    assert set(tight["refusals"]) == {"rejected_early:deadline-infeasible"}
    assert "stream class" in render_text(document)
    assert json.loads(render_json(document)) == json.loads(render_json(simulate(path)))  # deterministic


def test_a_streaming_model_needs_streaming_arrivals(tmp_path: Path) -> None:
    online = {k: v for k, v in STREAM_ARRIVAL.items() if k != "mode"}
    with pytest.raises(ConfigError, match="set mode: streaming"):
        simulate(_stream_scenario(tmp_path, chat=online))
    with pytest.raises(ConfigError, match="set mode: streaming too"):
        simulate(_stream_scenario(tmp_path, chat={**online, "gap_ms": 5}))
