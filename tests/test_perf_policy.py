"""The policy path's fast forms equal the plain ones they replace (issue 31).

``schema.reader`` / ``schema.dict_reader`` inline the fields' ``source`` expressions into one
function: on any record and context they answer exactly what the fields' own ``read`` do. A
snapshot's fast path (its plans, their memo, the settled main-rule outcomes) decides every
request exactly as the same policy set evaluated one expression at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings

from gateway.policy import PolicyResult, PolicySnapshot, load_policies, schema
from gateway.policy.engine import get_engine
from gateway.policy.suites import PolicyCase, build_inputs
from tests.test_policy_differential import _RANDOM_GIVEN, CASES, POLICIES

REQUEST_FIELDS = tuple(f for f in schema.FIELDS if f.read is not None)


def test_every_request_field_declares_its_source() -> None:
    assert REQUEST_FIELDS
    for f in REQUEST_FIELDS:
        assert f.source, f.path
    for f in schema.FIELDS:
        assert bool(f.source) == (f.read is not None), f.path


@settings(max_examples=60, deadline=None)
@given(partial=_RANDOM_GIVEN)
def test_inlined_readers_read_what_each_field_reads(partial: dict[str, Any]) -> None:
    record, context = build_inputs(partial)
    paths = [f.path for f in REQUEST_FIELDS]
    one_by_one = [f.read(record, context) for f in REQUEST_FIELDS if f.read is not None]
    inlined = schema.reader(paths)(record, context)
    assert inlined == one_by_one
    assert [type(v) for v in inlined] == [type(v) for v in one_by_one]
    assert schema.dict_reader(paths)(record, context) == dict(zip(paths, one_by_one, strict=True))
    backwards = paths[::-1]
    assert schema.reader(backwards)(record, context) == one_by_one[::-1]


def test_a_backend_field_has_no_inlined_reader() -> None:
    with pytest.raises(ValueError, match=r"backend\.name"):
        schema.reader(["backend.name"])


def _without_plans(snapshot: PolicySnapshot) -> PolicySnapshot:
    """The same policy set evaluated one expression at a time (no plan, no memo)."""
    return PolicySnapshot(
        version=snapshot.version,
        label=snapshot.label,
        engine=get_engine(snapshot.engine_name),
        rules=snapshot.rules,
        variables=snapshot.variables,
        files=snapshot.files,
    )


@pytest.fixture(scope="module")
def planned() -> tuple[PolicySnapshot, PolicySnapshot]:
    snapshot = load_policies(POLICIES, engine="cel-expr")
    assert snapshot.planned
    return snapshot, _without_plans(snapshot)


def _decided(result: PolicyResult) -> dict[str, Any]:
    decided = result.to_json()
    del decided["eval_us"]
    return {**decided, "version": result.policy_version}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.suite}: {c.name}" for c in CASES])
def test_the_fast_path_decides_every_case_as_one_at_a_time(
    case: PolicyCase, planned: tuple[PolicySnapshot, PolicySnapshot]
) -> None:
    fast, slow = planned
    record, context = build_inputs(case.given)
    for _ in range(2):  # the second time from the memos
        assert _decided(fast.evaluate(record, context)) == _decided(slow.evaluate(record, context))


@settings(max_examples=100, deadline=None)
@given(partial=_RANDOM_GIVEN)
def test_the_fast_path_decides_random_requests_as_one_at_a_time(
    partial: dict[str, Any], planned: tuple[PolicySnapshot, PolicySnapshot]
) -> None:
    fast, slow = planned
    record, context = build_inputs(partial)
    for _ in range(2):
        assert _decided(fast.evaluate(record, context)) == _decided(slow.evaluate(record, context))


@settings(max_examples=60, deadline=None)
@given(partial=_RANDOM_GIVEN)
def test_the_key_reader_keys_by_the_values_read(partial: dict[str, Any]) -> None:
    """A list of strings is keyed by its tuple, anything else as read: equal keys, equal values."""
    record, context = build_inputs(partial)
    paths = [f.path for f in REQUEST_FIELDS]
    key = schema.key_reader(paths)(record, context)
    hash(key)
    values = schema.reader(paths)(record, context)
    assert [list(k) if isinstance(k, tuple) else k for k in key] == values
