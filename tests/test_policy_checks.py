"""Every kind of problem in a CEL expression is caught at load, located, on both engines.

Two owners: cel-cpp's type checker (``engine.TypeChecker``: names, types,
functions, result types) and ``analysis`` (limits, syntax, bounded
evaluation, stage scope, ``has()`` on always-present names, message
construction). Each row below is one kind of error; the test compiles it as a
rule under each engine and requires exactly that one diagnostic, at the
column of ``at`` inside the expression.
"""

from __future__ import annotations

import textwrap

import pytest

from gateway.policy.diagnostics import Diagnostic, PolicyLoadError
from gateway.policy.engine import EXCLUDED_FUNCTIONS, CompileProblem, get_checker, get_engine
from gateway.policy.loader import compile_policies
from gateway.policy.schema import FIELDS

ENGINES = ("cel-expr", "cel-python")
CONDITION_COLUMN = 17  # `    condition: "` in the file below: the expression's first character
END = ""  # `at` for a problem just past the expression's last character

# (kind, stage, condition, the text the caret must be on, message)
TYPE_ERRORS: list[tuple[str, str, str, str, str]] = [
    # operand types
    (
        "int vs double comparison",
        "admission",
        "budget.slack_ms < 0",
        "<",
        "found no matching overload for '_<_' applied to '(double, int)'",
    ),
    (
        "int vs double equality",
        "admission",
        "shape.items == 1.0",
        "==",
        "found no matching overload for '_==_' applied to '(int, double)'",
    ),
    (
        "int vs double arithmetic",
        "admission",
        "shape.input_tokens + 1.0 > 2.0",
        "+",
        "found no matching overload for '_+_' applied to '(int, double)'",
    ),
    (
        "string + number",
        "admission",
        "'left: ' + budget.remaining_ms == ''",
        "+",
        "found no matching overload for '_+_' applied to '(string, double)'",
    ),
    (
        "arithmetic on bools",
        "admission",
        "request.allow_fallback + shape.streaming == true",
        "+",
        "found no matching overload for '_+_' applied to '(bool, bool)'",
    ),
    (
        "arithmetic on strings other than +",
        "admission",
        "request.model - 'x' == ''",
        "-",
        "found no matching overload for '_-_' applied to '(string, string)'",
    ),
    (
        "double modulo",
        "admission",
        "demand.prefill_ms % 2.0 == 0.0",
        "%",
        "found no matching overload for '_%_' applied to '(double, double)'",
    ),
    (
        "non-bool operand of &&",
        "admission",
        "shape.items && true",
        "&&",
        "found no matching overload for '_&&_' applied to '(int, bool)'",
    ),
    (
        "non-bool operand of ||",
        "admission",
        "request.model || true",
        "||",
        "found no matching overload for '_||_' applied to '(string, bool)'",
    ),
    (
        "non-bool operand of !",
        "admission",
        "!shape.items",
        "!",
        "found no matching overload for '!_' applied to '(int)'",
    ),
    (
        "negating a string",
        "admission",
        "-request.model == ''",
        "-",
        "found no matching overload for '-_' applied to '(string)'",
    ),
    (
        "non-bool condition of ?:",
        "admission",
        "shape.items ? true : false",
        "?",
        "found no matching overload for '_?_:_' applied to '(int, bool, bool)'",
    ),
    (
        "list index that is not an int",
        "admission",
        "tenant.allowed_cells['a'] == ''",
        "[",
        "found no matching overload for '_[_]' applied to '(list(string), string)'",
    ),
    (
        "map index of the wrong key type",
        "routing",
        "backend.labels[1] == ''",
        "[",
        "found no matching overload for '_[_]' applied to '(map(string, string), int)'",
    ),
    (
        "indexing a scalar",
        "admission",
        "request.model[0] == ''",
        "[",
        "found no matching overload for '_[_]' applied to '(string, int)'",
    ),
    (
        "in over a scalar",
        "admission",
        "request.model in shape.items",
        "in ",
        "found no matching overload for '@in' applied to '(string, int)'",
    ),
    (
        "in with the wrong element type",
        "admission",
        "1 in tenant.allowed_cells",
        "in ",
        "found no matching overload for '@in' applied to '(int, list(string))'",
    ),
    (
        "string function on a number",
        "admission",
        "shape.items.startsWith('a')",
        "startsWith",
        "found no matching overload for 'startsWith' applied to '(int, string)'",
    ),
    (
        "string function with a number",
        "admission",
        "request.model.contains(1)",
        "contains",
        "found no matching overload for 'contains' applied to '(string, int)'",
    ),
    (
        "selecting a field of a scalar",
        "admission",
        "request.model.x == ''",
        "x ==",
        "expression of type 'string' cannot be the operand of a select operation",
    ),
    (
        "has() on a scalar's field",
        "admission",
        "has(shape.items.x)",
        "has",
        "expression of type 'int' cannot be the operand of a select operation",
    ),
    (
        "has() without a field selection",
        "admission",
        "has(1)",
        "1",
        "has() argument must be a field selection",
    ),
    # names
    (
        "unknown field",
        "admission",
        "request.tennant == 'orchid'",
        "tennant",
        "undeclared reference to 'request.tennant'",
    ),
    (
        "unknown top-level name",
        "admission",
        "tenants.name == 'x'",
        "name",
        "undeclared reference to 'tenants.name'",
    ),
    (
        "namespace used as a value",
        "admission",
        "route.quality == 'x'",
        "quality",
        "undeclared reference to 'route.quality'",
    ),
    (
        "the variables namespace used as a value",
        "admission",
        "variables == 1",
        "variables",
        "undeclared reference to 'variables'",
    ),
    (
        "undeclared policy variable",
        "admission",
        "variables.long_inputs",
        "long_inputs",
        "undeclared reference to 'variables.long_inputs'",
    ),
    # functions
    (
        "unknown function",
        "admission",
        "lower(request.model) == ''",
        "lower",
        "undeclared reference to 'lower'",
    ),
    (
        "unknown member function",
        "admission",
        "request.model.lower() == ''",
        "lower",
        "undeclared reference to 'lower'",
    ),
    (
        "standard function outside the policy dialect",
        "admission",
        "request.model == string(duration('1s'))",
        "duration",
        "undeclared reference to 'duration'",
    ),
    (
        "timestamp accessor outside the policy dialect",
        "admission",
        "dyn(request.model).getHours() == 1",
        "getHours",
        "undeclared reference to 'getHours'",
    ),
]

DIALECT_ERRORS: list[tuple[str, str, str, str, str]] = [
    (
        "backend field outside routing",
        "admission",
        "backend.labels['cell'] == 'x'",
        "backend",
        "'backend.labels' is only available to routing-stage rules (they run once per candidate backend)",
    ),
    (
        "comprehension over caller-controlled values",
        "admission",
        "[request.model, request.class].exists(m, m == 'x')",
        "exists",
        "'exists' ranges over a caller-controlled value: comprehensions may only range over configured "
        "lists and maps (tenant.allowed_cells, route.fallback_classes, backend.labels ...) or constant "
        "literals, so that evaluation stays bounded",
    ),
    (
        "comprehension over a computed value",
        "admission",
        "tenant.allowed_cells.filter(c, c != '').exists(c, c == 'x')",
        "exists",
        "'exists' ranges over a computed value: comprehensions may only range over configured "
        "lists and maps (tenant.allowed_cells, route.fallback_classes, backend.labels ...) or constant "
        "literals, so that evaluation stays bounded",
    ),
    (
        "nested comprehension",
        "admission",
        "tenant.allowed_cells.exists(c, tenant.allowed_classes.exists(k, k == c))",
        "exists(k",
        "nested comprehension 'exists' is not allowed: evaluation must stay bounded",
    ),
    (
        "comprehension variable shadowing a namespace",
        "admission",
        "tenant.allowed_cells.exists(request, request == 'x')",
        "request,",
        "comprehension variable 'request' shadows a namespace",
    ),
    (
        "has() on a schema field",
        "admission",
        "has(request.model)",
        "has",
        "has(request.model): schema fields are always present; "
        "has() tests map keys, e.g. has(backend.labels.cell)",
    ),
    (
        "message construction of a well-known type",
        "admission",
        "google.protobuf.BoolValue{value: true}",
        "google",
        "message construction is not supported in policy expressions",
    ),
    (
        "message construction of an unknown type",
        "admission",
        "Foo{}",
        "Foo",
        "message construction is not supported in policy expressions",
    ),
    (
        "syntax error",
        "admission",
        "request.model == == 'x'",
        "== 'x'",
        "syntax error: unexpected '=='",
    ),
    (
        "unexpected end",
        "admission",
        "request.model ==",
        END,
        "syntax error: unexpected end of expression",
    ),
]


def rule_file(condition: str, stage: str, extra: str = "") -> str:
    action = {
        "routing": "exclude_backend",
        "fallback": "fallback_eligible",
    }.get(stage, "{deny: {status: PERMISSION_DENIED}}")
    quoted = condition.replace("\\", "\\\\").replace('"', '\\"')
    return f'rules:\n  - id: r1\n    stage: {stage}\n    condition: "{quoted}"\n    action: {action}\n{extra}'


def diagnostics(files: dict[str, str], engine: str) -> list[Diagnostic]:
    with pytest.raises(PolicyLoadError) as info:
        compile_policies(files, engine=engine, base="pol")
    return list(info.value.diagnostics)


def one(files: dict[str, str], engine: str) -> Diagnostic:
    found = diagnostics(files, engine)
    assert len(found) == 1, [d.render() for d in found]
    return found[0]


def _column(condition: str, at: str) -> int:
    return CONDITION_COLUMN + (len(condition) if at == END else condition.index(at))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("kind", "stage", "condition", "at", "message"),
    TYPE_ERRORS + DIALECT_ERRORS,
    ids=[row[0] for row in TYPE_ERRORS + DIALECT_ERRORS],
)
def test_each_kind_of_error_is_one_located_diagnostic(
    engine: str, kind: str, stage: str, condition: str, at: str, message: str
) -> None:
    d = one({"a.yaml": rule_file(condition, stage)}, engine)
    assert d.message == message
    assert (d.line, d.column) == (4, _column(condition, at)), kind


def test_the_type_errors_come_from_the_checker_and_the_rest_does_not() -> None:
    """The split of work: the TYPE_ERRORS rows are cel-cpp's own findings; DIALECT_ERRORS are not."""
    checker = get_checker()
    declarations = {f.path: f.cel_type for f in FIELDS}
    for kind, _, condition, _, message in TYPE_ERRORS:
        with pytest.raises(CompileProblem) as info:
            checker.check(condition, declarations)
        assert [problem[2] for problem in info.value.problems] == [message], kind
    for kind, _, condition, _, _ in DIALECT_ERRORS:
        if kind.startswith(("syntax", "unexpected", "message construction of an unknown")):
            continue
        checker.check(condition, declarations)  # the checker accepts these: analysis must refuse them


def test_has_on_a_declared_name_is_the_value_itself_in_cel_cpp() -> None:
    """Why ``analysis`` refuses has(request.model): cel-cpp's checker types it as the field."""
    expression, result_type = get_checker().check("has(request.model)", {"request.model": "string"})
    assert result_type == "string"
    assert expression.eval(data={"request.model": "full-v18"}).value() == "full-v18"


@pytest.mark.parametrize("engine", ENGINES)
def test_has_on_a_policy_variable_is_refused(engine: str) -> None:
    text = "variables:\n  long_input: shape.input_tokens > 2048\n" + rule_file(
        "has(variables.long_input)", "admission"
    )
    d = one({"a.yaml": text}, engine)
    assert d.message == (
        "has(variables.long_input): policy variables are always present; "
        "has() tests map keys, e.g. has(backend.labels.cell)"
    )
    assert (d.line, d.column) == (6, CONDITION_COLUMN)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("stage", "condition", "extra", "line", "message"),
    [
        (
            "admission",
            "shape.input_tokens",
            "",
            4,
            "condition must be a CEL bool expression; this one is int",
        ),
        (
            "admission",
            "true",
            "    message: request.model.size()\n",
            6,
            "message must be a CEL string expression; this one is int",
        ),
        (
            "admission",
            "true",
            "",
            5,
            "retry_after_ms must be a CEL int expression; this one is double",
        ),
        (
            "quota",
            "true",
            "",
            5,
            "max_output_tokens must be a CEL int expression; this one is list(string)",
        ),
    ],
    ids=["condition", "message", "retry_after_ms", "max_output_tokens"],
)
def test_result_types_come_from_the_checker_on_both_engines(
    engine: str, stage: str, condition: str, extra: str, line: int, message: str
) -> None:
    text = rule_file(condition, stage, extra)
    if message.startswith("retry_after_ms"):
        text = text.replace(
            "{deny: {status: PERMISSION_DENIED}}",
            "{deny: {status: UNAVAILABLE, retry_after_ms: load.drain_ms}}",
        )
    if message.startswith("max_output_tokens"):
        text = text.replace(
            "{deny: {status: PERMISSION_DENIED}}", "{limit: {max_output_tokens: tenant.allowed_cells}}"
        )
    d = one({"a.yaml": text}, engine)
    assert d.message == message
    assert d.line == line


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bounds_problem_and_a_type_error_in_one_expression_are_both_reported(engine: str) -> None:
    condition = "[request.model].exists(m, m == 1)"
    found = diagnostics({"a.yaml": rule_file(condition, "admission")}, engine)
    assert [(d.column, d.message.split(":")[0]) for d in found] == [
        (_column(condition, "exists"), "'exists' ranges over a caller-controlled value"),
        (_column(condition, "=="), "found no matching overload for '_==_' applied to '(string, int)'"),
    ]


def test_variables_are_typed_by_the_checker_on_both_engines() -> None:
    text = textwrap.dedent(
        """\
        variables:
          cells: tenant.allowed_cells
          ratio: demand.accelerator_ms / budget.remaining_ms
        rules:
          - id: r1
            stage: admission
            condition: variables.ratio > 1.0 && size(variables.cells) > 0
            action: {deny: {status: RESOURCE_EXHAUSTED}}
        """
    )
    for engine in ENGINES:
        snapshot = compile_policies({"a.yaml": text}, engine=engine)
        assert {v.name: v.cel_type for v in snapshot.variables} == {
            "cells": "list(string)",
            "ratio": "double",
        }
        # a variable's checked type is what later expressions are checked against
        bad = text.replace("variables.ratio > 1.0", "variables.ratio > 1")
        d = one({"a.yaml": bad}, engine)
        assert d.message == "found no matching overload for '_>_' applied to '(double, int)'"


def test_excluded_functions_are_standard_cel_that_the_checker_refuses() -> None:
    from cel_expr_python import cel

    plain = cel.NewEnv(variables={})  # cel-cpp's whole standard library
    for name in EXCLUDED_FUNCTIONS:
        if name in ("timestamp", "duration"):
            standard, dialect = f"{name}('1s')", f"{name}('1s')"
        else:  # the timestamp accessors
            standard, dialect = f"timestamp('2024-01-01T00:00:00Z').{name}()", f"dyn(1).{name}()"
        plain.compile(standard)  # standard CEL (a typo in EXCLUDED_FUNCTIONS would fail here) ...
        with pytest.raises(CompileProblem, match=f"undeclared reference to '{name}'"):
            get_checker().check(dialect, {})  # ... outside the policy dialect


def test_cel_python_gets_the_checkers_result_type() -> None:
    declarations = {f.path: f.cel_type for f in FIELDS}
    for text, result_type in (
        ("tenant.allowed_cells", "list(string)"),
        ("budget.slack_ms * 2.0", "double"),
        ("request.model.startsWith('full')", "bool"),
        ("backend.labels", "map(string, string)"),
    ):
        assert get_engine("cel-python").compile(text, declarations).result_type == result_type
        assert get_engine("cel-expr").compile(text, declarations).result_type == result_type
