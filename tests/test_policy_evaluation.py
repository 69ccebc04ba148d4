"""Evaluation semantics: stage order, fail-closed, fail-open, fallback, routing, shadow, limits."""

from __future__ import annotations

import textwrap
from pathlib import Path

import msgspec
import pytest

from gateway.core.errors import DeadlineInfeasible, PermissionDenied
from gateway.core.record import RequestRecord
from gateway.policy import PolicyContext, PolicySnapshot, compile_policies, load_policies
from gateway.policy.schema import BackendFacts, activation
from gateway.policy.suites import build_inputs, load_suites

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"

ENGINES = ("cel-expr", "cel-python")


def policy(text: str, engine: str = "cel-expr") -> PolicySnapshot:
    return compile_policies({"p.yaml": textwrap.dedent(text)}, engine=engine)


def inputs(**given: object) -> tuple[RequestRecord, PolicyContext]:
    return build_inputs(given)


def comparable(result: object) -> object:
    return msgspec.structs.replace(result, eval_us=0.0)


@pytest.mark.parametrize("engine", ENGINES)
def test_privacy_rule_error_denies(engine: str) -> None:
    snapshot = policy(
        """\
        rules:
          - id: cell-check
            stage: privacy
            condition: tenant.allowed_cells[5] != request.privacy_cell
            action: {deny: {status: PERMISSION_DENIED}}
          - id: later
            stage: admission
            condition: "true"
            action: {annotate: {isolation: dedicated}}
        """,
        engine,
    )
    result = snapshot.evaluate(*inputs())
    assert not result.allowed
    assert (result.status, result.rule) == ("PERMISSION_DENIED", "cell-check")
    assert result.message == "request denied: policy rule 'cell-check' could not be evaluated"
    assert [e.rule for e in result.errors] == ["cell-check"]
    assert result.fail_open == ()
    assert "later" not in result.rules_fired


@pytest.mark.parametrize("engine", ENGINES)
def test_runtime_errors_are_detected_not_taken_as_results(engine: str) -> None:
    # cel-expr returns division by zero and missing keys as an ERROR value: it must not pass as "false".
    for condition in ("shape.input_tokens / (shape.items - 1) > 0", "{'a': true}[request.model]"):
        snapshot = policy(
            f"""\
            rules:
              - id: r
                stage: admission
                condition: "{condition}"
                action: {{deny: {{status: INVALID_ARGUMENT}}}}
            """,
            engine,
        )
        result = snapshot.evaluate(*inputs())
        assert (result.allowed, result.status, result.rule) == (False, "INVALID_ARGUMENT", "r"), condition
        assert result.errors[0].rule == "r"


@pytest.mark.parametrize("engine", ENGINES)
def test_on_error_allow_fails_open_and_says_so(engine: str) -> None:
    snapshot = policy(
        """\
        rules:
          - id: soft-quota
            stage: quota
            on_error: allow
            condition: demand.accelerator_ms / (tenant.available_accelerator_ms - 5000.0) > 1.0 && 1 / 0 > 0
            action: {deny: {status: RESOURCE_EXHAUSTED}}
        """,
        engine,
    )
    result = snapshot.evaluate(*inputs())
    assert result.allowed
    assert [f.rule for f in result.fail_open] == ["soft-quota"]
    assert result.fail_open[0].error
    assert [e.rule for e in result.errors] == ["soft-quota"]


def test_limit_rule_error_fails_closed_by_default_with_internal() -> None:
    snapshot = policy(
        """\
        rules:
          - id: cap
            stage: quota
            condition: "true"
            action: {limit: {max_output_tokens: "shape.max_output_tokens / 0"}}
        """
    )
    result = snapshot.evaluate(*inputs())
    assert (result.allowed, result.status, result.rule) == (False, "INTERNAL", "cap")


@pytest.mark.parametrize("engine", ENGINES)
def test_fallback_error_means_not_eligible(engine: str) -> None:
    text = """\
        rules:
          - id: eligible
            stage: fallback
            condition: "true"
            action: fallback_eligible
          - id: flaky
            stage: fallback
            condition: "{}"
            action: fallback_ineligible
        """
    ok = policy(text.format("route.quality.fallback_score < route.quality.floor"), engine).evaluate(*inputs())
    assert ok.fallback_eligible
    broken = policy(text.format("route.quality.fallback_score > 2.0 || 1 / 0 == 1"), engine)
    result = broken.evaluate(*inputs())
    assert result.allowed and not result.fallback_eligible
    assert [e.rule for e in result.errors] == ["flaky"]
    assert result.fail_open == ()


@pytest.mark.parametrize("engine", ENGINES)
def test_routing_error_excludes_that_backend_only(engine: str) -> None:
    snapshot = policy(
        """\
        rules:
          - id: same-cell
            stage: routing
            condition: backend.labels['cell'] != request.privacy_cell
            action: exclude_backend
        """,
        engine,
    )
    record, context = inputs(
        backends=[
            {"name": "eu", "labels": {"cell": "eu-restricted"}},
            {"name": "us", "labels": {"cell": "us-general"}},
            {"name": "bare"},
        ]
    )
    result = snapshot.evaluate(record, context)
    assert result.excluded_backends == ("us", "bare")
    assert [(e.rule, e.backend) for e in result.errors] == [("same-cell", "bare")]
    assert result.rules_fired == ("same-cell",)


@pytest.mark.parametrize("engine", ENGINES)
def test_shadow_rules_never_change_the_outcome(engine: str) -> None:
    text = """\
        rules:
          - id: candidate
            stage: admission
            mode: {mode}
            condition: shape.input_tokens > 100
            action: {{deny: {{status: RESOURCE_EXHAUSTED}}}}
          - id: candidate-limit
            stage: quota
            mode: {mode}
            condition: "true"
            action: {{limit: {{max_output_tokens: "1"}}}}
          - id: candidate-route
            stage: routing
            mode: {mode}
            condition: "true"
            action: exclude_backend
          - id: broken-candidate
            stage: privacy
            mode: {mode}
            condition: 1 / 0 == 1
            action: {{deny: {{status: PERMISSION_DENIED}}}}
        """
    shadow = policy(text.format(mode="shadow"), engine).evaluate(*inputs())
    assert shadow.allowed
    assert shadow.shadow_fired == ("candidate", "candidate-limit", "candidate-route")
    assert shadow.rules_fired == ()
    assert shadow.max_output_tokens is None and shadow.excluded_backends == ()
    assert [(e.rule, e.shadow) for e in shadow.errors] == [("broken-candidate", True)]
    enforced = policy(text.format(mode="enforce"), engine).evaluate(*inputs())
    assert not enforced.allowed and enforced.rule == "broken-candidate"


def test_stage_order_first_deny_stops_and_limits_take_the_minimum() -> None:
    snapshot = policy(
        """\
        rules:
          - id: quota-deny
            stage: quota
            condition: load.ladder_step >= 3
            action: {deny: {status: RESOURCE_EXHAUSTED}}
          - id: admission-deny
            stage: admission
            condition: load.ladder_step >= 4
            action: {deny: {status: UNAVAILABLE}}
          - id: cap-a
            stage: admission
            condition: "true"
            action: {limit: {max_output_tokens: "48"}}
          - id: cap-b
            stage: quota
            condition: "true"
            action: {limit: {max_output_tokens: "32"}}
        """
    )
    record, context = inputs()
    assert snapshot.evaluate(record, context).max_output_tokens == 32
    at_3 = snapshot.evaluate(record.replace(ladder_step=3), context)
    # Within a stage, file order: quota-deny stops the quota stage before cap-b.
    assert (at_3.rule, at_3.rules_fired, at_3.max_output_tokens) == (
        "quota-deny",
        ("cap-a", "quota-deny"),
        48,
    )
    at_4 = snapshot.evaluate(record.replace(ladder_step=4), context)
    assert (at_4.rule, at_4.rules_fired) == ("admission-deny", ("admission-deny",))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failing_variable_poisons_only_the_rules_that_read_it(engine: str) -> None:
    snapshot = policy(
        """\
        variables:
          ratio: shape.input_tokens / (shape.items - 1)
          long_input: shape.input_tokens > 2048
        rules:
          - id: uses-ratio
            stage: admission
            on_error: allow
            condition: variables.ratio > 10
            action: {deny: {status: RESOURCE_EXHAUSTED}}
          - id: uses-long-input
            stage: admission
            condition: "!variables.long_input"
            action: {annotate: {isolation: dedicated}}
        """,
        engine,
    )
    result = snapshot.evaluate(*inputs())
    assert result.allowed
    assert [f.rule for f in result.fail_open] == ["uses-ratio"]
    assert "variable 'ratio' failed" in result.fail_open[0].error
    assert result.rules_fired == ("uses-long-input",)
    assert result.annotation_map == {"isolation": "dedicated"}


def test_deny_carries_message_retry_after_and_maps_to_the_domain_error() -> None:
    snapshot = load_policies(POLICIES)
    record, context = inputs(budget={"elapsed_ms": 150.0})
    result = snapshot.evaluate(record, context)
    error = result.to_error()
    assert isinstance(error, DeadlineInfeasible)
    assert error.rule == "deadline-infeasible"
    assert "50 ms of 200 ms remain" in error.message
    record, context = inputs(request={"privacy_cell": "us-general"})
    denied = snapshot.evaluate(record, context).to_error()
    assert isinstance(denied, PermissionDenied)
    assert denied.trailing_metadata() == (("orchid-rule", "privacy-cell-allowed"),)
    assert snapshot.evaluate(*inputs()).to_error() is None


@pytest.mark.parametrize("engine", ENGINES)
def test_explain_agrees_with_evaluate_on_the_whole_corpus(engine: str) -> None:
    snapshot = load_policies(POLICIES, engine=engine)
    for case in load_suites(POLICIES / "tests"):
        record, context = build_inputs(case.given)
        fast = snapshot.evaluate(record, context)
        explained = snapshot.explain(record, context)
        assert comparable(fast) == comparable(explained.result), case.name
        evaluated = [t for t in explained.rules if t.result != "skipped"]
        assert evaluated, case.name


def test_the_stable_part_of_the_plan_is_memoised_exactly() -> None:
    """The shipped set splits into a memoised plan (rules that read only stable facts:
    tenant, route, identity, backends) and a plan run for every request. A memo entry is
    reused only for the same stable inputs: changing any of them, or only a volatile one,
    gives what one-at-a-time evaluation (``explain``, never planned) gives."""
    snapshot = load_policies(POLICIES)
    plans = snapshot._plans
    assert [plan.cached for plan in plans] == [True, False]
    main_rules = [rule for rule in snapshot.rules if rule.stage.value != "routing"]
    decided = sorted(index for plan in plans for index in plan.conditions)
    assert decided == list(range(len(main_rules)))  # every main rule in exactly one plan
    cached = {main_rules[i].id for i in plans[0].conditions}
    assert {"privacy-cell-allowed", "class-allowed", "fallback-not-warm"} <= cached
    assert "deadline-behind-queue" not in cached and "quota-accelerator-ms" not in cached
    assert plans[0].routing and not plans[1].routing
    variants: list[dict[str, object]] = [
        {},
        {"tenant": {"allowed_classes": ["batch"]}},  # stable input changed: class-allowed denies
        {"budget": {"elapsed_ms": 150.0}},  # volatile only: same memo entry, deadline denies
        {"request": {"privacy_cell": "us-general"}},
        {"route": {"fallback_warm": False}},  # the fallback is no longer eligible
        {"request": {"risk_class": "high"}},
        {"backends": [{"name": "b1", "labels": {"cell": "us-general"}}]},  # routing excludes b1
        {"backends": [{"name": "b1", "labels": {"cell": "eu-restricted"}}]},
        {"tenant": {"available_accelerator_ms": 1.0}},  # volatile: quota denies
    ]
    outcomes = set()
    for round_ in range(2):  # the second round is answered from the memo where it can be
        for given in variants:
            record, context = inputs(**given)
            fast = snapshot.evaluate(record, context)
            assert comparable(fast) == comparable(snapshot.explain(record, context).result), (round_, given)
            outcomes.add((fast.allowed, fast.rule, fast.fallback_eligible, fast.excluded_backends))
    assert len(outcomes) >= 6  # the variants really decide differently
    assert 0 < snapshot.memoised < len(variants)  # volatile-only variants shared an entry


def test_fast_path_and_rule_by_rule_agree_when_a_rule_errs() -> None:
    snapshot = policy(
        """\
        variables:
          long_input: shape.input_tokens > 2048
        rules:
          - id: flaky
            stage: admission
            on_error: allow
            condition: 1 / (shape.items - 1) > 0
            action: {deny: {status: INVALID_ARGUMENT}}
          - id: big
            stage: quota
            condition: variables.long_input
            action: {deny: {status: RESOURCE_EXHAUSTED}}
          - id: cell
            stage: routing
            condition: backend.labels['cell'] != request.privacy_cell
            action: exclude_backend
        """
    )
    assert snapshot.planned
    for given in (
        {},
        {"shape": {"items": 2}},
        {"shape": {"input_tokens": 4096}},
        {"backends": [{"name": "x"}]},
    ):
        record, context = build_inputs(given)
        assert comparable(snapshot.evaluate(record, context)) == comparable(
            snapshot.explain(record, context).result
        )


def test_explain_reports_inputs_results_and_skips() -> None:
    snapshot = load_policies(POLICIES)
    record, context = inputs(request={"privacy_cell": "us-general"})
    explanation = snapshot.explain(record, context)
    first = explanation.rules[0]
    assert (first.rule, first.result) == ("privacy-cell-allowed", "fired")
    assert dict(first.inputs) == {
        "request.privacy_cell": "us-general",
        "tenant.allowed_cells": ["eu-restricted"],
    }
    assert all(t.result == "skipped" for t in explanation.rules[1:])
    assert {v.name for v in explanation.variables} == {
        "predicted_completion_ms",
        "long_input",
        "prohibited_risk",
    }


def test_activation_keeps_ints_and_doubles_apart() -> None:
    record, context = inputs()
    values = activation(record, context, BackendFacts("b", "m", {"cell": "eu"}))
    assert type(values["shape"]["input_tokens"]) is int
    assert type(values["budget"]["slack_ms"]) is float and values["budget"]["slack_ms"] == 68.0
    assert type(values["tenant"]["max_output_tokens"]) is int
    assert type(values["load"]["ladder_step"]) is int
    assert values["route"]["quality"] == {
        "score": 0.92,
        "fallback_score": 0.86,
        "floor": 0.84,
        "population": "orchid-eval",
        "reduced_output_score": 0.0,
        "fallback_evidence": "valid",
        "reduced_output_evidence": "missing",
    }
    assert type(values["route"]["reduced_output_tokens"]) is int
    assert values["backend"] == {"name": "b", "model": "m", "labels": {"cell": "eu"}}
    assert "backend" not in activation(record, context)


def test_eval_time_is_measured_by_the_callers_timer() -> None:
    ticks = iter([1_000, 43_500])  # the snapshot reads no clock of its own
    result = load_policies(POLICIES).evaluate(*inputs(), timer=lambda: next(ticks))
    assert result.eval_us == 42.5
    assert load_policies(POLICIES).evaluate(*inputs()).eval_us == 0.0
    assert result.policy_version.startswith("sha256:")
