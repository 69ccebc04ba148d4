"""Differential: the whole policy test corpus on both engines, compared case by case.

cel-expr-python (cel-cpp) and cel-python (celpy) are independent CEL
implementations. Whatever the expectations in the suites say, the two must
reach the same decision on every case - outcome, status, rule, message,
retry-after, fired and shadow rules, fallback, routing, limits, annotations,
and which rules erred or failed open (error texts differ by engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.policy import PolicyResult, PolicySnapshot, load_policies
from gateway.policy.suites import PolicyCase, build_inputs, load_suites

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"

CASES = load_suites(POLICIES / "tests")


def decision(result: PolicyResult) -> dict[str, Any]:
    return {
        "version": result.policy_version,
        "allowed": result.allowed,
        "status": result.status,
        "rule": result.rule,
        "message": result.message,
        "retry_after_ms": result.retry_after_ms,
        "rules_fired": result.rules_fired,
        "shadow_fired": result.shadow_fired,
        "fallback_eligible": result.fallback_eligible,
        "excluded_backends": result.excluded_backends,
        "max_output_tokens": result.max_output_tokens,
        "annotations": result.annotations,
        "fail_open": tuple(event.rule for event in result.fail_open),
        "errors": tuple((error.rule, error.backend, error.shadow) for error in result.errors),
    }


@pytest.fixture(scope="module")
def engines() -> tuple[PolicySnapshot, PolicySnapshot]:
    return load_policies(POLICIES, engine="cel-expr"), load_policies(POLICIES, engine="cel-python")


def test_the_corpus_is_not_trivial() -> None:
    assert len(CASES) >= 25
    assert {case.expect.get("outcome") for case in CASES} >= {"allow", "deny"}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.suite}: {c.name}" for c in CASES])
def test_engines_agree(case: PolicyCase, engines: tuple[PolicySnapshot, PolicySnapshot]) -> None:
    cel_expr, cel_python = engines
    record, context = build_inputs(case.given)
    assert decision(cel_expr.evaluate(record, context)) == decision(cel_python.evaluate(record, context))
    # and rule by rule, not only in the fast path
    left = cel_expr.explain(record, context).rules
    right = cel_python.explain(record, context).rules
    assert [(t.rule, t.backend, t.result) for t in left] == [(t.rule, t.backend, t.result) for t in right]
