"""The policy path's fast forms equal the plain ones they replace (issue 31).

``schema.reader`` / ``schema.dict_reader`` inline the fields' ``source`` expressions into one
function: on any record and context they answer exactly what the fields' own ``read`` do.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings

from gateway.policy import schema
from gateway.policy.suites import build_inputs
from tests.test_policy_differential import _RANDOM_GIVEN

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
