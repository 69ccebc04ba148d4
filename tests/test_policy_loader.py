"""Loader errors: every kind of bad input is reported at ``file:line:col`` inside the file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gateway.core.errors import ConfigError
from gateway.policy import analysis
from gateway.policy.diagnostics import Diagnostic, PolicyLoadError
from gateway.policy.loader import compile_policies, content_hash, load_policies

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"

ENGINES = ("cel-expr", "cel-python")


def problems(files: dict[str, str], engine: str = "cel-expr") -> list[Diagnostic]:
    with pytest.raises(PolicyLoadError) as info:
        compile_policies(
            {name: textwrap.dedent(text) for name, text in files.items()}, engine=engine, base="pol"
        )
    return list(info.value.diagnostics)


def one(files: dict[str, str], engine: str = "cel-expr") -> Diagnostic:
    found = problems(files, engine)
    assert len(found) == 1, [d.render() for d in found]
    return found[0]


def where(text: str, line: int, needle: str) -> tuple[int, int]:
    """1-based (line, column) of ``needle`` on 1-based ``line`` of the dedented file."""
    source_line = textwrap.dedent(text).splitlines()[line - 1]
    return line, source_line.index(needle) + 1


def rule(
    condition: str, *, stage: str = "admission", action: str = "{deny: {status: PERMISSION_DENIED}}"
) -> str:
    return f"""\
    rules:
      - id: r1
        stage: {stage}
        condition: {condition}
        action: {action}
    """


def test_default_policy_set_compiles_on_both_engines() -> None:
    for engine in ENGINES:
        snapshot = load_policies(POLICIES, engine=engine)
        assert snapshot.version.startswith("sha256:") and len(snapshot.version) == len("sha256:") + 12
        assert snapshot.label == "orchid-default-2"
        assert len(snapshot.rules) >= 10


def test_yaml_syntax_error_points_at_the_problem_and_its_context() -> None:
    text = """\
    rules:
      - id: r1
        stage: privacy
        condition: [unclosed
    """
    d = one({"a.yaml": text})
    assert d.location == "pol/a.yaml:5:1"
    assert d.message.startswith("YAML syntax error: expected ',' or ']'")
    assert "flow sequence at line 4, column 16" in d.message


def test_cel_syntax_error_in_a_plain_scalar() -> None:
    text = rule("request.model == == 'x'")
    d = one({"a.yaml": text})
    assert (d.line, d.column) == where(text, 4, "== 'x'")
    assert d.message == "syntax error: unexpected '=='"
    assert d.source_line.strip() == "condition: request.model == == 'x'"
    rendered = d.render().splitlines()
    assert rendered[0] == f"pol/a.yaml:4:{d.column}: syntax error: unexpected '=='"
    assert rendered[2].index("^") - 4 == d.column - 1  # caret under the column


@pytest.mark.parametrize("engine", ENGINES)
def test_type_error_in_a_block_scalar_points_into_the_second_line(engine: str) -> None:
    text = """\
    rules:
      - id: r1
        stage: admission
        condition: |
          request.model == 'x' &&
            shape.input_tokens > 1.5
        action: {deny: {status: PERMISSION_DENIED}}
    """
    d = one({"a.yaml": text}, engine)
    assert (d.line, d.column) == where(text, 6, ">")
    assert d.message == "found no matching overload for '_>_' applied to '(int, double)'"


def test_int_versus_double_is_a_type_error_with_the_cel_expr_message() -> None:
    text = rule("budget.slack_ms < 0")
    d = one({"a.yaml": text})
    assert (d.line, d.column) == where(text, 4, "<")
    assert d.message == "found no matching overload for '_<_' applied to '(double, int)'"


def test_position_survives_escapes_in_a_double_quoted_scalar() -> None:
    text = rule('"request.model == \\"x\\" && shape.input_tokens > 1.5"')
    d = one({"a.yaml": text})
    assert (d.line, d.column) == where(text, 4, ">")


def test_position_in_a_folded_scalar() -> None:
    text = """\
    rules:
      - id: r1
        stage: admission
        condition: >
          request.model == 'x'
          && request.nope
        action: {deny: {status: PERMISSION_DENIED}}
    """
    d = one({"a.yaml": text})
    assert (d.line, d.column) == where(text, 6, "nope")
    assert d.message == "undeclared reference to 'request.nope'"


@pytest.mark.parametrize("engine", ENGINES)
def test_unknown_variable_is_reported_the_same_on_both_engines(engine: str) -> None:
    text = rule("request.tennant == 'orchid'")
    d = one({"a.yaml": text}, engine)
    assert (d.line, d.column) == where(text, 4, "tennant")
    assert d.message == "undeclared reference to 'request.tennant'"


@pytest.mark.parametrize("engine", ENGINES)
def test_unknown_top_level_name_and_namespace_used_as_value(engine: str) -> None:
    d = one({"a.yaml": rule("tenants.name == 'x'")}, engine)
    assert d.message == "undeclared reference to 'tenants.name'"
    text = rule("route.quality == 'x'")
    d = one({"a.yaml": text}, engine)
    assert (d.line, d.column) == where(text, 4, "quality")
    assert d.message == "undeclared reference to 'route.quality'"  # the checker's wording


def test_undeclared_policy_variable() -> None:
    text = rule("variables.long_inputs")
    d = one({"a.yaml": text})
    assert (d.line, d.column) == where(text, 4, "long_inputs")
    assert d.message == "undeclared reference to 'variables.long_inputs'"


def test_duplicate_rule_ids_across_files_name_both_places() -> None:
    first = rule("true")
    second = rule("false")
    d = one({"a.yaml": first, "b.yaml": second})
    assert d.location == "pol/b.yaml:2:9"
    assert d.message == "duplicate rule id 'r1' (first defined at pol/a.yaml:2:9)"


def test_duplicate_yaml_keys_are_errors() -> None:
    text = """\
    rules:
      - id: r1
        stage: admission
        condition: "true"
        condition: "false"
        action: {deny: {status: PERMISSION_DENIED}}
    """
    d = one({"a.yaml": text})
    assert d.location == "pol/a.yaml:5:5"
    assert d.message == "duplicate key 'condition' in a rule (first at line 4)"


def test_unknown_stage_action_status_and_rule_key() -> None:
    d = one({"a.yaml": rule("true", stage="admision")})
    assert d.location == "pol/a.yaml:3:12"
    assert d.message.startswith("unknown stage 'admision' (expected one of: privacy, admission, quota")
    d = one({"a.yaml": rule("true", action="reject")})
    assert d.location == "pol/a.yaml:5:13"
    assert d.message.startswith("unknown action 'reject' (expected one of: deny, limit, annotate")
    d = one({"a.yaml": rule("true", action="{deny: {status: DENIED}}")})
    assert d.message.startswith("unknown deny status 'DENIED'")
    d = one({"a.yaml": rule("true", action="deny")})
    assert d.message.startswith("deny needs a status")
    d = one({"a.yaml": rule("true") + "    priority: 3\n"})
    assert d.message.startswith("unknown rule key 'priority'")


def test_action_must_fit_the_stage() -> None:
    d = one({"a.yaml": rule("true", stage="privacy", action="fallback_eligible")})
    assert d.location == "pol/a.yaml:5:13"
    assert d.message == "action 'fallback_eligible' is not valid in stage 'privacy' (allowed: annotate, deny)"


def test_on_error_allow_is_refused_where_it_would_fail_open_isolation() -> None:
    text = rule("true", stage="privacy") + "    on_error: allow\n"
    d = one({"a.yaml": text})
    assert d.location == "pol/a.yaml:6:15"
    assert "privacy rules always fail closed" in d.message
    text = rule("true", stage="fallback", action="fallback_eligible") + "    on_error: allow\n"
    assert "not eligible" in one({"a.yaml": text}).message


def test_huge_expression_is_rejected_with_the_limit_named() -> None:
    big = " || ".join(["request.model == 'full-v18'"] * 100)
    d = one({"a.yaml": rule(big)})
    assert d.location == "pol/a.yaml:4:16"
    assert f"the limit is {analysis.MAX_EXPRESSION_CHARS:,} (MAX_EXPRESSION_CHARS)" in d.message


def test_deep_nesting_is_rejected_with_the_limit_named() -> None:
    depth = analysis.MAX_NESTING_DEPTH + 1
    text = rule("(" * depth + "true" + ")" * depth)
    d = one({"a.yaml": text})
    assert d.message.startswith(
        f"expression nests deeper than {analysis.MAX_NESTING_DEPTH} levels (MAX_NESTING_DEPTH)"
    )
    assert (d.line, d.column) == (4, 16 + analysis.MAX_NESTING_DEPTH)


@pytest.mark.parametrize("engine", ENGINES)
def test_comprehension_over_caller_controlled_values_is_rejected(engine: str) -> None:
    text = rule("\"[request.model, request.class].exists(m, m == 'x')\"")
    d = one({"a.yaml": text}, engine)
    assert (d.line, d.column) == where(text, 4, "exists")
    assert d.message.startswith("'exists' ranges over a caller-controlled value")


def test_comprehension_over_a_variable_built_from_caller_values_is_rejected() -> None:
    text = """\
    variables:
      names: "[request.model, request.class]"
    rules:
      - id: r1
        stage: admission
        condition: variables.names.all(n, n != '')
        action: {deny: {status: PERMISSION_DENIED}}
    """
    d = one({"a.yaml": text})
    assert (d.line, d.column) == where(text, 6, "all(")
    assert "caller-controlled" in d.message


def test_nested_comprehension_is_rejected_and_config_lists_are_fine() -> None:
    text = rule("tenant.allowed_cells.exists(c, tenant.allowed_classes.exists(k, k == c))")
    d = one({"a.yaml": text})
    assert (d.line, d.column) == where(text, 4, "exists(k")
    assert d.message == "nested comprehension 'exists' is not allowed: evaluation must stay bounded"
    compile_policies(
        {"a.yaml": textwrap.dedent(rule("tenant.allowed_cells.exists(c, c == request.privacy_cell)"))}
    )


def test_backend_fields_exist_only_in_routing_rules() -> None:
    text = rule("backend.labels['cell'] == 'x'")
    d = one({"a.yaml": text})
    assert "only available to routing-stage rules" in d.message
    compile_policies(
        {
            "a.yaml": textwrap.dedent(
                rule("backend.labels['cell'] == 'x'", stage="routing", action="exclude_backend")
            )
        }
    )


def test_condition_must_be_bool_and_message_only_on_deny() -> None:
    d = one({"a.yaml": rule("shape.input_tokens")})
    assert d.message == "condition must be a CEL bool expression; this one is int"
    text = rule("true", stage="fallback", action="fallback_eligible") + "    message: \"'x'\"\n"
    assert one({"a.yaml": text}).message.startswith("message is the caller-facing reason of a deny")


def test_variable_cycles_and_duplicates() -> None:
    text = """\
    variables:
      a: variables.b
      b: variables.a
    rules: []
    """
    d = one({"a.yaml": text})
    assert d.message == "variables depend on each other in a cycle: a -> b -> a"
    dup = "variables:\n  a: 'true'\n"
    d = one({"a.yaml": dup, "b.yaml": dup})
    assert d.location == "pol/b.yaml:2:3"
    assert d.message == "duplicate variable 'a' (first declared at pol/a.yaml:2:3)"


def test_empty_file_anchors_and_no_files() -> None:
    assert one({"a.yaml": ""}).message.startswith("policy file is empty (a half-written file?)")
    text = "variables:\n  a: &x 'true'\n  b: *x\n"
    assert one({"a.yaml": text}).message == "YAML anchors and aliases are not allowed in policy files"
    assert one({"policy.yaml": "label: x\n"}).message == "no policy files (*.yaml) found"


def test_every_problem_is_reported_not_just_the_first() -> None:
    text = """\
    rules:
      - id: r1
        stage: admission
        condition: request.nope
        action: {deny: {status: PERMISSION_DENIED}}
      - id: r2
        stage: quota
        condition: budget.slack_ms < 1
        action: {deny: {status: RESOURCE_EXHAUSTED}}
    """
    found = problems({"a.yaml": text})
    assert [d.line for d in found] == [4, 8]


def test_policy_load_error_is_a_config_error_with_a_location() -> None:
    with pytest.raises(ConfigError) as info:
        compile_policies({"a.yaml": textwrap.dedent(rule("request.nope"))}, base="pol")
    assert info.value.location == "pol/a.yaml:4:24"


def test_missing_directory() -> None:
    with pytest.raises(PolicyLoadError) as info:
        load_policies("/nonexistent/policies")
    assert info.value.diagnostics[0].message == "policy directory does not exist"


def test_version_is_a_content_hash_and_label_comes_from_the_manifest() -> None:
    files = {"a.yaml": textwrap.dedent(rule("true"))}
    first = compile_policies(files)
    again = compile_policies(dict(files))
    assert first.version == again.version == content_hash({k: v.encode() for k, v in files.items()})
    changed = compile_policies({"a.yaml": textwrap.dedent(rule("false"))})
    assert changed.version != first.version
    labelled = compile_policies({**files, "policy.yaml": "label: spring-rollout\n"})
    assert labelled.label == "spring-rollout"
    assert labelled.display_version == f"spring-rollout ({labelled.version})"
    assert labelled.version != first.version


def test_an_annotation_nothing_enforces_fails_to_load_with_its_location(tmp_path: Path) -> None:
    """Issue 13: every annotation a rule sets must be in ``ENFORCED_ANNOTATIONS``; any other
    key or value is refused at load time, at its file:line:col, not silently ignored."""
    text = rule("true", action="{annotate: {batching: never}}")
    d = one({"a.yaml": text})
    assert d.location == "pol/a.yaml:{}:{}".format(*where(text, 5, "batching"))
    assert d.message == "annotation 'batching' has no effect: nothing enforces it (enforced keys: isolation)"
    text = rule("true", action="{annotate: {isolation: shared}}")
    d = one({"a.yaml": text})
    assert d.location == "pol/a.yaml:{}:{}".format(*where(text, 5, "shared"))
    assert "isolation=shared has no effect" in d.message and "enforced values: dedicated" in d.message
    # The same through the directory loader and its real file names; the enforced pair loads.
    (tmp_path / "policy.yaml").write_text("label: t\n")
    text = rule("true", action="{annotate: {shard: x}}")
    (tmp_path / "10-a.yaml").write_text(textwrap.dedent(text))
    with pytest.raises(PolicyLoadError) as info:
        load_policies(tmp_path)
    line, column = where(text, 5, "shard")
    assert info.value.diagnostics[0].location == f"{tmp_path / '10-a.yaml'}:{line}:{column}"
    (tmp_path / "10-a.yaml").write_text(
        textwrap.dedent(rule("true", action="{annotate: {isolation: dedicated}}"))
    )
    assert load_policies(tmp_path).rules[0].action.annotations == (("isolation", "dedicated"),)
