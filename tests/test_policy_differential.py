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
from hypothesis import given, settings
from hypothesis import strategies as st

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


_CELLS = st.sampled_from(["eu-restricted", "us-general", ""])
_RANDOM_GIVEN = st.fixed_dictionaries(
    {
        "request": st.fixed_dictionaries(
            {
                "class": st.sampled_from(["interactive", "batch", "batch-export"]),
                "mode": st.sampled_from(["online", "streaming", "async", "batch"]),
                "privacy_cell": _CELLS,
                "risk_class": st.sampled_from(
                    ["standard", "safety_critical", "regulated", "out_of_distribution"]
                ),
                "allow_fallback": st.booleans(),
            }
        ),
        "shape": st.fixed_dictionaries(
            {"input_tokens": st.integers(0, 10_000), "max_output_tokens": st.integers(0, 10_000)}
        ),
        "demand": st.fixed_dictionaries({"prefill_ms": st.floats(0, 500), "decode_ms": st.floats(0, 500)}),
        "budget": st.fixed_dictionaries(
            {"elapsed_ms": st.floats(0, 250), "queue_wait_ms": st.floats(0, 100)}
        ),
        "tenant": st.fixed_dictionaries(
            {
                "available_accelerator_ms": st.floats(0, 1_000),
                "accelerator_ms_per_s": st.sampled_from([0.0, 250.0, 1000.0]),
                "max_output_tokens": st.sampled_from([0, 64, 4096]),
                "dedicated": st.booleans(),
                "allowed_models": st.sampled_from([[], ["full-v18"], ["compact-v11"]]),
            }
        ),
        "route": st.fixed_dictionaries(
            {
                "fallback_warm": st.booleans(),
                "fallback_cell": _CELLS,
                "quality": st.fixed_dictionaries({"fallback_score": st.floats(0.7, 0.95)}),
            }
        ),
        "load": st.fixed_dictionaries({"ladder_step": st.integers(0, 6), "drain_ms": st.floats(0, 5_000)}),
        "backends": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["a", "b", "c"]), "labels": st.dictionaries(st.just("cell"), _CELLS)}
            ),
            max_size=3,
        ),
    }
)


@settings(max_examples=60, deadline=None)
@given(partial=_RANDOM_GIVEN)
def test_engines_agree_on_random_requests(
    partial: dict[str, Any], engines: tuple[PolicySnapshot, PolicySnapshot]
) -> None:
    """Random partial requests: cel-expr's plan, cel-python rule by rule, and explain agree."""
    cel_expr, cel_python = engines
    record, context = build_inputs(partial)
    fast = cel_expr.evaluate(record, context)
    assert decision(fast) == decision(cel_python.evaluate(record, context))
    assert decision(fast) == decision(cel_expr.explain(record, context).result)
