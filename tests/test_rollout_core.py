"""Rollouts as data and as a state machine (``gateway.core.rollout``), driven by hand with
explicit times; the rollout files' validation and the two-version memory check
(``gateway.rollouts``). No Triton: see tests/test_rollout_triton.py for the real one."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml
from tritonclient.grpc import service_pb2

from gateway.config import LocalTritonConfig, load_gateway_config, load_routes, load_tenants
from gateway.core.errors import ConfigError, FailedPrecondition
from gateway.core.evidence import Evidence, EvidenceKey
from gateway.core.memory import DeviceMemory
from gateway.core.rollout import (
    Phase,
    RequestFacts,
    Rollout,
    RolloutSpec,
    Sample,
    Selector,
    guardrail_value,
    hedge_budget_ms,
    p95,
)
from gateway.evidence import EvidenceStore
from gateway.outputs import check_outputs
from gateway.rollouts import RolloutController, RolloutRun, check_two_versions, load_rollouts
from gateway.server import repository_key
from gateway.settings import rollout_spec

ROOT = Path(__file__).resolve().parent.parent
CONFIG = load_gateway_config(ROOT / "examples" / "orchid" / "gateway.yaml")
TENANTS = load_tenants(CONFIG.tenants_file)
ROUTES = load_routes(CONFIG.routes_dir)
EXAMPLE = ROOT / "rollouts" / "full-v19.yaml"

SHORT = RequestFacts("interactive", "short", "orchid", "standard")
LONG = RequestFacts("interactive", "long", "orchid", "standard")
LUMEN = RequestFacts("interactive", "short", "lumen", "standard")
REGULATED = RequestFacts("interactive", "short", "lumen", "regulated")


def example_data() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return data


def spec_from(data: dict[str, Any]) -> RolloutSpec:
    return rollout_spec(data)


def write(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "rollouts"
    directory.mkdir(exist_ok=True)
    (directory / "r.yaml").write_text(text)
    return directory


def load_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_rollouts(write(tmp_path, text), CONFIG, TENANTS, ROUTES)
    return caught.value


# --------------------------------------------------------------------------- files


def test_the_shipped_rollout_loads_and_cross_checks() -> None:
    specs = load_rollouts(ROOT / "rollouts", CONFIG, TENANTS, ROUTES)
    spec = specs["full-v19"]
    assert spec.route == "full-v18" and spec.candidate.name == "v19"
    assert [s.kind for s in spec.steps] == ["shadow", "canary", "canary", "promote"]
    assert {s.bucket for s in spec.warmup.shapes} == {"short", "long"}


def test_an_unknown_cohort_class_is_located(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("classes: [interactive, batch]", "classes: [interactive, bulk]")
    error = load_error(tmp_path, text)
    line, column = next((i, t.index("bulk") + 1) for i, t in enumerate(text.splitlines(), 1) if "bulk" in t)
    assert error.location.endswith(f"r.yaml:{line}:{column}")
    assert error.key == "steps.2.cohorts.0.classes.1"
    assert "unknown class 'bulk'" in error.problem


def test_an_unknown_metric_is_located(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("metric: fallback_rate", "metric: fallback_share")
    error = load_error(tmp_path, text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "fallback_share" in t)
    assert error.location.split(":")[-2] == str(line)
    assert error.key.startswith("guardrails.6.metric")


def test_a_warmup_without_the_long_bucket_is_refused(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("    - {bucket: long, input_tokens: 4096, output_tokens: 128}\n", "")
    error = load_error(tmp_path, text)
    assert "short and long buckets (missing long)" in error.problem
    assert error.key == "warmup"


def test_a_warmup_shape_in_the_wrong_bucket_is_refused(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace(
        "{bucket: long, input_tokens: 4096", "{bucket: long, input_tokens: 512"
    )
    error = load_error(tmp_path, text)
    assert error.key == "warmup.shapes.1.input_tokens"
    assert "not in the long bucket" in error.problem


def test_promote_must_be_last_and_cohorts_are_required(tmp_path: Path) -> None:
    data = example_data()
    data["steps"] = [{"kind": "promote"}, *data["steps"][:1]]
    with pytest.raises(ValueError, match="promote must be the last step"):
        spec_from(data)
    data = example_data()
    data["steps"][1]["cohorts"] = []
    with pytest.raises(ValueError, match="a canary step needs cohorts"):
        spec_from(data)
    data = example_data()
    data["steps"][1]["cohorts"] = [{}]
    with pytest.raises(ValueError, match="at least one of classes"):
        spec_from(data)


def test_route_mismatch_is_located(tmp_path: Path) -> None:
    error = load_error(
        tmp_path, EXAMPLE.read_text().replace("{backend_model: full-v18,", "{backend_model: compact-v11,")
    )
    assert error.key == "current.backend_model"
    assert "runs 'full-v18'" in error.problem


# --------------------------------------------------------------------------- cohorts


def test_selector_takes_exactly_its_weight_evenly() -> None:
    selector = Selector(0.25)
    taken = [selector.take() for _ in range(12)]
    assert taken == [False, False, False, True] * 3
    half = Selector(0.5)
    assert sum(half.take() for _ in range(100)) == 50


def test_canary_diverts_only_declared_cohorts_by_class_and_shape() -> None:
    rollout = started(example_data())
    to_step(rollout, 1, now=10.0)
    assert rollout.phase is Phase.CANARY
    # Step 2 cohorts: short interactive of tenant orchid, or short interactive regulated/OOD.
    assert not any(rollout.divert(LONG) for _ in range(8))
    assert not any(rollout.divert(LUMEN) for _ in range(8))
    assert sum(rollout.divert(SHORT) for _ in range(8)) == 2
    assert sum(rollout.divert(REGULATED) for _ in range(8)) == 2


# --------------------------------------------------------------------------- the machine


def started(data: dict[str, Any], now: float = 0.0) -> Rollout:
    rollout = Rollout(spec_from(data))
    rollout.start(now)
    rollout.loaded(now + 1.0)
    rollout.warmed(now + 2.0, [])
    return rollout


def feed(rollout: Rollout, *, candidate_ms: float, current_ms: float, n: int = 6) -> None:
    for _ in range(n):
        rollout.observe(True, Sample(candidate_ms, candidate_ms))
        rollout.observe(False, Sample(current_ms, current_ms))


def to_step(rollout: Rollout, index: int, *, now: float) -> float:
    """Pass intervals with healthy samples until ``rollout`` is at step ``index``."""
    t = now
    while rollout.step < index:
        feed(rollout, candidate_ms=10.0, current_ms=10.0)
        t += rollout.spec.analysis.interval_s
        rollout.tick(t)
    return t


def test_candidate_is_not_routable_before_its_warmup_passes() -> None:
    data = example_data()
    data["steps"][0] = data["steps"][1]  # a canary first: would divert if it were ready
    early = Rollout(spec_from(data))
    early.start(0.0)
    early.loaded(1.0)
    assert early.phase is Phase.WARMING
    assert not any(early.divert(SHORT) for _ in range(10))
    assert not any(early.shadow(SHORT) for _ in range(10)) and not early.serving
    early.warmed(2.0, [])
    assert early.ready_at == 2.0 and early.phase is Phase.CANARY
    assert any(early.divert(SHORT) for _ in range(10))


def test_a_failed_warmup_rolls_back_with_the_reason() -> None:
    rollout = Rollout(spec_from(example_data()))
    rollout.start(0.0)
    rollout.loaded(1.0)
    rollout.warmed(2.0, ["short shape: output OUTPUT_IDS is FP32, expected INT32"])
    assert rollout.phase is Phase.ROLLED_BACK
    assert "warm-up failed: short shape: output OUTPUT_IDS is FP32" in rollout.reason
    assert not rollout.divert(SHORT)


def test_a_load_failure_rolls_back() -> None:
    rollout = Rollout(spec_from(example_data()))
    rollout.start(0.0)
    rollout.load_failed(0.5, "CUDA out of memory loading weights")
    assert rollout.phase is Phase.ROLLED_BACK and "load failed: CUDA out of memory" in rollout.reason


def test_steps_advance_after_their_passing_intervals_and_promote() -> None:
    rollout = started(example_data())
    assert rollout.phase is Phase.SHADOW and rollout.step == 0
    t = 2.0
    feed(rollout, candidate_ms=10.0, current_ms=10.0)
    t += 1.0
    rollout.tick(t)
    assert rollout.step == 0  # shadow holds for 2 intervals
    feed(rollout, candidate_ms=10.0, current_ms=10.0)
    t += 1.0
    rollout.tick(t)
    assert rollout.phase is Phase.CANARY and rollout.step == 1
    t = to_step(rollout, 3, now=t)
    assert rollout.phase is Phase.PROMOTED and rollout.serving
    assert rollout.promoted_at == t
    rollout.retired_drained(t + 0.25)
    rollout.retired_unloaded(t + 0.5, 0.25)
    assert rollout.phase is Phase.COMPLETE
    report = rollout.report()
    assert report["safe_to_remove_after_s"] == 0.25 and report["unload_s"] == 0.25


def test_an_inconclusive_interval_neither_advances_nor_fails() -> None:
    rollout = started(example_data())
    rollout.observe(True, Sample(100.0, 100.0))  # 1 sample < min_samples 5
    rollout.tick(3.0)
    assert rollout.step == 0 and rollout.phase is Phase.SHADOW
    assert rollout.intervals[-1].conclusive is False


def test_slow_candidate_rolls_back_after_consecutive_failing_intervals() -> None:
    rollout = started(example_data())
    t = to_step(rollout, 1, now=2.0)
    feed(rollout, candidate_ms=30.0, current_ms=10.0)
    rollout.tick(t + 1.0)
    assert rollout.phase is Phase.CANARY  # failures: 2 -> one failing interval is not enough
    feed(rollout, candidate_ms=30.0, current_ms=10.0)
    rollout.tick(t + 2.0)
    assert rollout.phase is Phase.ROLLED_BACK
    assert rollout.rolled_back_at == t + 2.0
    assert rollout.reason.startswith("guardrail first_result_p95_ratio = 3.000 > 1.5 in 2 consecutive")
    assert "candidate p95 30.0 ms vs current 10.0 ms" in rollout.reason
    assert not rollout.divert(SHORT)


def test_a_passing_interval_resets_the_failure_count() -> None:
    rollout = started(example_data())
    t = to_step(rollout, 1, now=2.0)
    for candidate_ms in (30.0, 10.0, 30.0):
        feed(rollout, candidate_ms=candidate_ms, current_ms=10.0)
        t += 1.0
        rollout.tick(t)
    assert rollout.phase is Phase.CANARY


def test_error_rate_rolls_back_on_one_interval() -> None:
    rollout = started(example_data())
    t = to_step(rollout, 1, now=2.0)
    feed(rollout, candidate_ms=10.0, current_ms=10.0)
    rollout.observe(True, Sample(10.0, 10.0, error=True))
    rollout.tick(t + 1.0)
    assert rollout.phase is Phase.ROLLED_BACK and "error_rate_delta" in rollout.reason


def test_guardrail_values() -> None:
    cand = [Sample(10.0, 20.0, missed_deadline=True), Sample(10.0, 40.0, fell_back=True, error=True)]
    cur = [Sample(5.0, 10.0), Sample(5.0, 20.0)]
    assert guardrail_value("completion_p95_ratio", cand, cur, 0.0) == 1.0  # errors excluded
    assert guardrail_value("first_result_p95_ratio", cand, cur, 0.0) == 2.0
    assert guardrail_value("deadline_miss_rate_delta", cand, cur, 0.0) == 0.5
    assert guardrail_value("error_rate_delta", cand, cur, 0.0) == 0.5
    assert guardrail_value("fallback_rate", cand, cur, 0.0) == 0.5
    assert guardrail_value("memory_high_water", cand, cur, 0.7) == 0.7
    assert p95([float(i) for i in range(1, 101)]) == 95.0


def test_timed_out_canaries_are_failing_samples_in_their_bucket() -> None:
    """A candidate that is on time for short inputs and runs out of its budget on long ones
    (the canary was answered again by the current version) is rolled back at the step whose
    cohort has long inputs, on the interval the timeouts are counted in."""
    rollout = started(example_data())
    t = to_step(rollout, 2, now=2.0)  # step 3: interactive and batch, short and long
    assert rollout.phase is Phase.CANARY
    feed(rollout, candidate_ms=10.0, current_ms=10.0, n=12)
    for _ in range(2):
        rollout.observe(False, Sample(40.0, 40.0, bucket="long"))
        rollout.observe(True, Sample(150.0, 150.0, timed_out=True, fell_back=True, bucket="long"))
    rollout.tick(t + 1.0)
    assert rollout.phase is Phase.ROLLED_BACK and rollout.step == 2
    assert rollout.reason.startswith("guardrail error_rate_delta = 0.143 > 0.01 in 1 consecutive")
    assert "2 failed, 2 of them timed out" in rollout.reason


def test_timeouts_count_as_late_and_in_latency_but_not_as_errors_of_latency() -> None:
    cand = [Sample(10.0, 10.0), Sample(90.0, 90.0, timed_out=True, fell_back=True)]
    cur = [Sample(10.0, 10.0), Sample(10.0, 10.0)]
    assert guardrail_value("error_rate_delta", cand, cur, 0.0) == 0.5
    assert guardrail_value("deadline_miss_rate_delta", cand, cur, 0.0) == 0.5
    assert guardrail_value("completion_p95_ratio", cand, cur, 0.0) == 9.0  # its budget, a lower bound


def test_a_regression_confined_to_one_bucket_shows_in_that_bucket() -> None:
    """95 short canaries as fast as the current version and 5 long ones 4x slower: the
    whole interval's p95 ratio is 1.0, the long bucket's 4.0. The bucket's value counts."""
    data = example_data()
    data["guardrails"] = [{"metric": "completion_p95_ratio", "max": 1.5, "failures": 1}]
    rollout = started(data)
    t = to_step(rollout, 2, now=2.0)
    for _ in range(95):
        rollout.observe(True, Sample(10.0, 10.0, bucket="short"))
        rollout.observe(False, Sample(10.0, 10.0, bucket="short"))
    for _ in range(5):
        rollout.observe(True, Sample(40.0, 40.0, bucket="long"))
        rollout.observe(False, Sample(10.0, 10.0, bucket="long"))
    rollout.tick(t + 1.0)
    interval = rollout.intervals[-1]
    assert interval.by_bucket["short"]["completion_p95_ratio"] == 1.0
    assert interval.by_bucket["long"]["completion_p95_ratio"] == 4.0
    assert interval.values["completion_p95_ratio"] == 4.0 and interval.worst_bucket == {
        "completion_p95_ratio": "long"
    }
    assert rollout.phase is Phase.ROLLED_BACK
    assert "in the long bucket (candidate p95 40.0 ms vs current 10.0 ms, 5/5 samples)" in rollout.reason
    bucketed = rollout.report()["intervals"]
    assert isinstance(bucketed, list) and bucketed[-1]["by_bucket"]["long"] == {"completion_p95_ratio": 4.0}


def test_a_bucket_with_too_few_samples_is_not_judged_alone() -> None:
    data = example_data()
    data["guardrails"] = [{"metric": "completion_p95_ratio", "max": 1.5, "failures": 1}]
    rollout = started(data)
    t = to_step(rollout, 2, now=2.0)
    for _ in range(20):
        rollout.observe(True, Sample(10.0, 10.0, bucket="short"))
        rollout.observe(False, Sample(10.0, 10.0, bucket="short"))
    rollout.observe(True, Sample(40.0, 40.0, bucket="long"))  # 1 < min_samples 5
    rollout.tick(t + 1.0)
    assert rollout.intervals[-1].by_bucket == {"short": {"completion_p95_ratio": 1.0}}
    assert rollout.phase is Phase.CANARY


def test_a_step_waits_for_its_pending_canaries_before_advancing() -> None:
    """Intervals that pass while a canary dispatched inside them has no outcome yet do not
    move the step on: the slow canary is judged first. A failure still rolls back at once."""
    rollout = started(example_data())
    t = to_step(rollout, 1, now=2.0)  # step 2: canary, 2 intervals
    dispatched = t + 0.5
    for _ in range(3):
        feed(rollout, candidate_ms=10.0, current_ms=10.0)
        t += 1.0
        rollout.tick(t, oldest_pending=dispatched)
    assert rollout.step == 1 and rollout.phase is Phase.CANARY
    rollout.observe(True, Sample(900.0, 900.0, timed_out=True, fell_back=True, bucket="short"))
    feed(rollout, candidate_ms=10.0, current_ms=10.0)
    t += 1.0
    rollout.tick(t, oldest_pending=None)
    assert rollout.phase is Phase.ROLLED_BACK and "error_rate_delta" in rollout.reason
    # Without a pending canary the same passing intervals advance.
    other = started(example_data())
    u = to_step(other, 1, now=2.0)
    for _ in range(2):
        feed(other, candidate_ms=10.0, current_ms=10.0)
        u += 1.0
        other.tick(u, oldest_pending=u + 5.0)  # dispatched after the interval: not waited for
    assert other.step == 2
    # A step held for a pending canary moves on at the first tick after it settled, without
    # waiting for another interval to close.
    third = started(example_data())
    v = to_step(third, 1, now=2.0)
    for _ in range(2):
        feed(third, candidate_ms=10.0, current_ms=10.0)
        v += 1.0
        third.tick(v, oldest_pending=v - 0.01)
    assert third.step == 1 and len(third.intervals) == 4
    third.tick(v + 0.05, oldest_pending=None)
    assert third.step == 2 and len(third.intervals) == 4
    assert third.timeline[-1][0] == v + 0.05


def test_hedge_budget_leaves_the_current_version_its_time() -> None:
    # The current version's slack as priced now, less the stated margin, if the candidate's
    # own predicted execution fits it; else the request is not a canary at all.
    assert hedge_budget_ms(150.0, 40.0, 25.0) == 125.0
    assert hedge_budget_ms(150.0, 130.0, 25.0) is None
    assert hedge_budget_ms(20.0, 1.0, 25.0) is None
    rollout = started(example_data())
    rollout.hedge("timeout", 120.0)
    rollout.hedge("invalid_output", 8.0)
    rollout.hedge("timeout", 100.0)
    report = rollout.report()
    assert report["hedged"] == {"timeout": 2, "invalid_output": 1} and report["hedge_device_ms"] == 228.0
    assert spec_from(example_data()).hedge.reserve_ms == 25.0


def test_a_resumed_rollout_continues_at_its_saved_step_or_serves_its_candidate() -> None:
    canary = Rollout(spec_from(example_data()))
    canary.resumed(50.0, Phase.CANARY, 2)
    assert canary.phase is Phase.CANARY and canary.step == 2 and canary.ready_at == 50.0
    assert canary.timeline[0] == (50.0, "resumed after a gateway restart at step 3/4")
    assert sum(canary.divert(LONG) for _ in range(4)) == 2  # step 3's cohorts, its weight
    done = Rollout(spec_from(example_data()))
    done.resumed(50.0, Phase.COMPLETE, 3)
    assert done.serving and done.phase is Phase.COMPLETE
    early = Rollout(spec_from(example_data()))
    early.resumed(50.0, Phase.WARMING, -1)  # before readiness: starts over from the load
    assert early.phase is Phase.LOADING
    with pytest.raises(ValueError, match="already started"):
        early.resumed(51.0, Phase.CANARY, 1)


def test_rollout_state_is_saved_and_a_complete_one_is_resumed_serving_its_candidate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The controller's durable state without Triton: a complete rollout found in the state
    directory serves its candidate again; a rolled-back one and an unreadable file do not."""
    spec = spec_from(example_data())
    route = ROUTES.models[spec.route]
    writer = RolloutController(SimpleNamespace(backends={}), ROUTES)  # type: ignore[arg-type]
    writer.state_dir = tmp_path
    done = RolloutRun(spec, route, [])
    done.rollout.resumed(1.0, Phase.COMPLETE, 3)
    writer._save(done)
    other = RolloutRun(replace(spec, name="gone"), route, [])
    other.rollout.start(1.0)
    other.rollout.load_failed(2.0, "CUDA out of memory")
    writer._save(other)
    (tmp_path / "torn.json").write_text("{not json")
    saved = json.loads((tmp_path / "full-v19.json").read_text())
    assert (saved["phase"], saved["step"], saved["spec"]["candidate"]["label"]) == ("complete", 3, "v19")
    reader = RolloutController(SimpleNamespace(backends={}), ROUTES)  # type: ignore[arg-type]
    reader.state_dir = tmp_path
    with caplog.at_level("WARNING", logger="orchid.rollout"):
        runs = reader.resume()
    assert [r.name for r in runs] == ["full-v19"] and set(reader.runs) == {"full-v19"}
    assert reader.promoted_route("full-v18", route).backend_model == "full-v19"
    assert "torn.json is unreadable, not resumed" in caplog.text


def test_operator_controls_and_their_refusals() -> None:
    rollout = started(example_data())
    rollout.promote(3.0)
    assert rollout.phase is Phase.PROMOTED
    with pytest.raises(ValueError, match="cannot be rolled back while promoted"):
        rollout.roll_back(4.0, "x")
    with pytest.raises(ValueError, match="cannot be aborted"):
        rollout.abort(4.0)
    other = started(example_data())
    other.abort(3.0)
    assert other.phase is Phase.ABORTED and not other.divert(SHORT)
    with pytest.raises(ValueError, match="cannot be promoted while aborted"):
        other.promote(4.0)


# --------------------------------------------------------------------------- outputs, memory


def response(datatype: str, shape: list[int], values: np.ndarray) -> service_pb2.ModelInferResponse:
    reply = service_pb2.ModelInferResponse()
    out = reply.outputs.add()
    out.name, out.datatype = "OUTPUT_IDS", datatype
    out.shape.extend(shape)
    reply.raw_output_contents.append(values.tobytes())
    return reply


def test_output_checks() -> None:
    checks = spec_from(example_data()).warmup.outputs
    good = response("INT32", [1, 4], np.array([[1, 2, 3, 4]], dtype=np.int32))
    assert check_outputs(good, checks, items=1, input_tokens=8, output_tokens=4, batched=True) == []
    short = response("INT32", [1, 3], np.array([[1, 2, 3]], dtype=np.int32))
    assert check_outputs(short, checks, items=1, input_tokens=8, output_tokens=4, batched=True) == [
        "output OUTPUT_IDS has shape [1, 3], expected [1, 4]"
    ]
    wrong = response("FP32", [1, 4], np.zeros((1, 4), dtype=np.float32))
    assert (
        "is FP32, expected INT32"
        in check_outputs(wrong, checks, items=1, input_tokens=8, output_tokens=4, batched=True)[0]
    )
    out_of_range = response("INT32", [1, 4], np.array([[1, 2, 3, 40_000]], dtype=np.int32))
    assert check_outputs(out_of_range, checks, items=1, input_tokens=8, output_tokens=4, batched=True) == [
        "output OUTPUT_IDS has a value above 31999"
    ]


def fake_pools(device_gib: float) -> Any:
    handle = SimpleNamespace(
        memory=DeviceMemory.from_gib(device_gib, 6.0), shared_devices=False, time_scale=1.0
    )
    return SimpleNamespace(backends={"local": handle}, shared_device_set=lambda name: None)


def test_two_versions_must_fit_or_the_rollback_delay_is_stated() -> None:
    spec = spec_from(example_data())
    check_two_versions(fake_pools(80.0), ROUTES, spec, ["local"])  # 21.85 GiB left >= 12.2 GiB declared
    with pytest.raises(FailedPrecondition) as caught:
        check_two_versions(fake_pools(64.0), ROUTES, spec, ["local"])
    message = caught.value.message
    assert "full-v18 and full-v19 do not both fit a device of backend 'local'" in message
    assert "leaves 5.85 GiB, under the 12.21 GiB of live room declared" in message
    assert (
        "a rollback would wait for full-v19 to unload, full-v18 to load, and its warm-up (3 requests"
        in message
    )


def test_a_held_promotion_keeps_the_last_step_until_an_operator_promotes() -> None:
    rollout = started(example_data())
    rollout.promotion_hold = "full-v19 has 1 device(s) on backend 'local', full-v18 has 4"
    t = to_step(rollout, 2, now=2.0)
    for _ in range(4):
        feed(rollout, candidate_ms=10.0, current_ms=10.0)
        t += 1.0
        rollout.tick(t)
    assert rollout.phase is Phase.CANARY and rollout.step == 2
    assert sum(1 for _, text in rollout.timeline if text.startswith("promotion held: full-v19 has 1")) == 1
    rollout.promote(t, "operator")
    assert rollout.phase is Phase.PROMOTED


def test_quality_drop_reads_both_versions_published_evidence() -> None:
    store = EvidenceStore(ROUTES)
    spec = spec_from(example_data())
    controller = RolloutController(SimpleNamespace(backends={}), ROUTES, store)  # type: ignore[arg-type]
    # full-v18's seeded score 0.92; no evaluation of v19 yet: it counts as 0.
    assert controller.quality_drop(spec) == pytest.approx(0.92)
    now = time.time()
    store.publish(
        Evidence(
            key=EvidenceKey("full-v18", "v19", "orchid-text-eval-2026q3"),
            score=0.90,
            sample_size=500,
            owner="eval-team",
            evaluated_at=now,
            max_age_s=86400.0,
        )
    )
    assert controller.quality_drop(spec) == pytest.approx(0.02)
    data = example_data()
    data["guardrails"] = [{"metric": "quality_score_drop", "max": 0.01, "failures": 1}]
    strict = started(data)
    strict.quality_drop = 0.02
    feed(strict, candidate_ms=10.0, current_ms=10.0)
    strict.tick(3.0)
    assert strict.phase is Phase.ROLLED_BACK and strict.reason.startswith(
        "guardrail quality_score_drop = 0.020"
    )


def test_local_triton_model_control_flags() -> None:
    local = LocalTritonConfig(
        model_repository=Path("repo"), model_control="explicit", load_models=("full-v18",)
    )
    assert local.triton_args() == (
        "--model-control-mode=explicit",
        "--strict-readiness=false",
        "--load-model=full-v18",
    )
    assert LocalTritonConfig(model_repository=Path("repo"), model_control="explicit").triton_args()[-1] == (
        "--load-model=*"
    )
    assert LocalTritonConfig(model_repository=Path("repo")).triton_args() == ()
    assert (
        local.triton_args("k3y")[-1]
        == "--grpc-restricted-protocol=model-repository:orchid-repository-key=k3y"
    )
    with pytest.raises(ValueError, match="load_models is only read with model_control: explicit"):
        LocalTritonConfig(model_repository=Path("repo"), load_models=("full-v18",))


def test_a_named_repository_key_must_be_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCHID_UNSET_REPOSITORY_KEY", raising=False)
    with pytest.raises(ConfigError, match="environment variable ORCHID_UNSET_REPOSITORY_KEY is not set"):
        repository_key("ORCHID_UNSET_REPOSITORY_KEY")
    monkeypatch.setenv("ORCHID_UNSET_REPOSITORY_KEY", "s3cret")
    assert repository_key("ORCHID_UNSET_REPOSITORY_KEY") == "s3cret"
    assert repository_key(None) is None
