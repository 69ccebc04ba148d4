"""The schema is declared once: engine declarations, docs table and test inputs all follow it."""

from __future__ import annotations

from pathlib import Path

from gateway.policy import schema
from gateway.policy.suites import BASE_GIVEN, DERIVED, build_inputs


def test_every_field_has_a_type_an_origin_and_a_reader() -> None:
    for field in schema.FIELDS:
        assert field.namespace in schema.NAMESPACES
        assert field.cel_type in (
            schema.BOOL,
            schema.INT,
            schema.DOUBLE,
            schema.STRING,
            schema.LIST_STRING,
            schema.MAP_STRING_STRING,
        )
        assert (field.read is None) != (field.read_backend is None), field.path
        assert field.per_backend == (field.namespace == "backend")


def test_readers_return_the_declared_python_types() -> None:
    record, context = build_inputs({})
    flat = schema.flat_inputs(record, context, context.backends[0])
    python = {
        schema.BOOL: bool,
        schema.INT: int,
        schema.DOUBLE: float,
        schema.STRING: str,
        schema.LIST_STRING: list,
        schema.MAP_STRING_STRING: dict,
    }
    for field in schema.FIELDS:
        assert type(flat[field.path]) is python[field.cel_type], field.path


def test_base_given_covers_every_settable_field() -> None:
    settable = {f.path for f in schema.FIELDS if not f.per_backend and f.path not in DERIVED}
    given = {f"{ns}.{key}" for ns, fields in BASE_GIVEN.items() if ns != "backends" for key in fields}
    given |= {f"route.quality.{key}" for key in BASE_GIVEN["route"]["quality"]}
    given.discard("route.quality")
    assert settable == given


def test_docs_table_is_generated_from_the_schema() -> None:
    table = schema.render_schema_markdown()
    for field in schema.FIELDS:
        assert f"| `{field.path}` | `{field.cel_type}` | {field.origin} |" in table
    docs = (Path(__file__).resolve().parent.parent / "docs" / "policy-authors.md").read_text()
    assert table in docs, (
        "docs/policy-authors.md is stale: paste gateway.policy.schema.render_schema_markdown()"
    )
