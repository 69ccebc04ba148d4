"""Policy files -> one compiled, immutable ``PolicySnapshot`` (or every problem, located).

This module owns the policy directory layout, the policy file format and the
compile pipeline. It never returns half a policy set: either everything
compiles or ``PolicyLoadError`` carries a ``Diagnostic`` for each problem.

Layout::

    policies/
      policy.yaml        optional manifest: ``label`` (author's name for this set), ``description``
      *.yaml, *.yml      rule files, compiled in name order (hidden files ignored)
      tests/*.yaml       test suites for ``orchid-gateway policy test`` (not compiled here)

A rule file::

    description: free text
    variables:                          # named CEL expressions, read as variables.<name>
      long_input: shape.input_tokens > 2048
    rules:
      - id: deadline-infeasible         # unique across the set; [a-z0-9][a-z0-9._-]*
        stage: admission                # privacy | admission | quota | fallback | routing
        description: free text
        condition: budget.slack_ms < 0.0            # CEL bool
        action:
          deny: {status: DEADLINE_EXCEEDED, retry_after_ms: "int(load.drain_ms)"}
        message: "'...' + string(int(budget.remaining_ms))"    # CEL string, caller-facing
        mode: enforce                   # enforce (default) | shadow
        on_error: deny                  # admission/quota only: deny (default) | allow

Actions: ``{deny: {status, retry_after_ms?}}``, ``fallback_eligible``,
``fallback_ineligible``, ``exclude_backend``, ``{limit: {max_output_tokens: <CEL int>}}``,
``{annotate: {key: literal value}}``. Which stage takes which action is in ``model``, and so
is the registry of annotation keys and values something enforces (``ENFORCED_ANNOTATIONS``):
any other annotation is rejected at load time, with its file:line:col.

Version: ``sha256:`` + the first 12 hex digits of SHA-256 over the sorted
(file name, bytes) pairs of ``policy.yaml`` and the rule files. The same hash
is what ``PolicyStore.watch`` polls, so "content changed" and "version
changed" are one notion.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from yaml.nodes import MappingNode, Node, ScalarNode

from gateway.policy import schema
from gateway.policy.analysis import Analysis, Scope, analyze, origins_of
from gateway.policy.diagnostics import Diagnostic, PolicyLoadError
from gateway.policy.engine import DEFAULT_ENGINE, CompiledExpression, CompileProblem, Engine, get_engine
from gateway.policy.model import (
    DENY_STATUSES,
    ENFORCED_ANNOTATIONS,
    ON_ERROR_FIXED,
    ON_ERROR_STAGES,
    STAGE_ACTIONS,
    STAGE_ORDER,
    Action,
    ActionKind,
    OnError,
    Rule,
    RuleMode,
    SourceRef,
    Stage,
    Variable,
)
from gateway.policy.schema import Origin
from gateway.policy.snapshot import BACKENDS_VARIABLE, Plan, PolicySnapshot
from gateway.policy.source import (
    Located,
    SourceFile,
    YamlSyntaxError,
    expression_node,
    is_null,
    mapping_items,
    scalar_text,
    sequence_items,
)

MANIFEST = "policy.yaml"
TESTS_DIR = "tests"
# Why: a policy file is reviewed by people; a megabyte of YAML is a mistake or an attack.
MAX_FILE_BYTES = 1 << 20

RULE_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,79}$")
VARIABLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
ANNOTATION_KEY = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")

_RULE_KEYS = ("id", "stage", "condition", "action", "message", "mode", "on_error", "description")
_FILE_KEYS = ("description", "variables", "rules")
_MANIFEST_KEYS = ("label", "description")


# ---------------------------------------------------------------------------
# Reading the directory
# ---------------------------------------------------------------------------


def policy_file_names(directory: Path) -> list[str]:
    """Rule files and the manifest, in compile order (name order)."""
    names = [
        p.name
        for p in directory.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix in (".yaml", ".yml")
    ]
    return sorted(names)


def read_policy_dir(directory: str | Path) -> dict[str, bytes]:
    """``{file name: bytes}`` of a policy directory; raises ``PolicyLoadError`` when unreadable."""
    root = Path(directory)
    if not root.is_dir():
        problem = "policy directory does not exist" if not root.exists() else "not a directory"
        raise PolicyLoadError([Diagnostic(str(root), 1, 1, problem)])
    files: dict[str, bytes] = {}
    diagnostics: list[Diagnostic] = []
    try:
        names = policy_file_names(root)
    except OSError as exc:
        raise PolicyLoadError(
            [Diagnostic(str(root), 1, 1, f"cannot list policy directory: {exc.strerror}")]
        ) from exc
    for name in names:
        path = root / name
        try:
            data = path.read_bytes()
        except OSError as exc:  # removed or unreadable between listing and reading
            diagnostics.append(Diagnostic(str(path), 1, 1, f"cannot read policy file: {exc.strerror or exc}"))
            continue
        files[name] = data
    if diagnostics:
        raise PolicyLoadError(diagnostics)
    return files


def content_hash(files: Mapping[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(files[name])
        digest.update(b"\0")
    return "sha256:" + digest.hexdigest()[:12]


def directory_hash(directory: str | Path) -> str | None:
    """The version the directory would load as, or ``None`` when it cannot be read."""
    try:
        return content_hash(read_policy_dir(directory))
    except PolicyLoadError:
        return None


def load_policies(directory: str | Path, *, engine: str | Engine = DEFAULT_ENGINE) -> PolicySnapshot:
    """Compile a policy directory into a snapshot; raises ``PolicyLoadError`` with every problem."""
    root = Path(directory)
    return compile_policies(read_policy_dir(root), engine=engine, base=root)


# ---------------------------------------------------------------------------
# Parsing files into raw declarations
# ---------------------------------------------------------------------------


@dataclass
class _RawVariable:
    name: str
    node: ScalarNode
    source: SourceFile
    name_node: ScalarNode


@dataclass
class _RawRule:
    id: str
    id_node: Node
    node: Node
    source: SourceFile
    stage: Stage
    condition: ScalarNode
    action_kind: ActionKind
    action_node: Node
    status: str = ""
    retry_after_ms: ScalarNode | None = None
    max_output_tokens: ScalarNode | None = None
    annotations: tuple[tuple[str, str], ...] = ()
    message: ScalarNode | None = None
    mode: RuleMode = RuleMode.ENFORCE
    on_error: OnError = OnError.DENY
    description: str = ""


@dataclass
class _Parsed:
    variables: list[_RawVariable] = field(default_factory=list)
    rules: list[_RawRule] = field(default_factory=list)
    label: str = ""
    diagnostics: list[Diagnostic] = field(default_factory=list)


def _choice(node: Node, what: str, choices: tuple[str, ...]) -> str:
    text = scalar_text(node, what)
    if text not in choices:
        raise Located(node, f"unknown {what} '{text}' (expected one of: {', '.join(choices)})")
    return text


def _parse_manifest(source: SourceFile, parsed: _Parsed) -> None:
    root = source.compose()
    if root is None or is_null(root):
        return
    for key, key_node, value in mapping_items(root, "policy.yaml"):
        if key not in _MANIFEST_KEYS:
            raise Located(
                key_node, f"unknown key '{key}' in policy.yaml (expected: {', '.join(_MANIFEST_KEYS)})"
            )
        if key == "label":
            parsed.label = scalar_text(value, "label").strip()


def _parse_file(source: SourceFile, parsed: _Parsed) -> None:
    root = source.compose()
    if root is None or is_null(root):
        raise Located(
            None, "policy file is empty (a half-written file?): expected 'rules' and/or 'variables'"
        )
    rules_node: Node | None = None
    for key, key_node, value in mapping_items(root, "a policy file"):
        if key not in _FILE_KEYS:
            raise Located(key_node, f"unknown top-level key '{key}' (expected: {', '.join(_FILE_KEYS)})")
        if key == "variables" and not is_null(value):
            for name, name_node, expression in mapping_items(value, "variables"):
                try:
                    if not VARIABLE_NAME.match(name):
                        raise Located(name_node, f"variable name '{name}' must match {VARIABLE_NAME.pattern}")
                    parsed.variables.append(
                        _RawVariable(
                            name, expression_node(expression, f"variable '{name}'"), source, name_node
                        )
                    )
                except Located as problem:
                    parsed.diagnostics.append(source.diagnostic(problem.node, problem.message))
        elif key == "rules":
            rules_node = value
    if rules_node is not None and not is_null(rules_node):
        for item in sequence_items(rules_node, "rules"):
            try:
                parsed.rules.append(_parse_rule(source, item))
            except Located as problem:
                parsed.diagnostics.append(source.diagnostic(problem.node, problem.message))


def _parse_rule(source: SourceFile, node: Node) -> _RawRule:
    if not isinstance(node, MappingNode):
        raise Located(node, "a rule must be a mapping with id, stage, condition and action")
    values: dict[str, Node] = {}
    for key, key_node, value in mapping_items(node, "a rule"):
        if key not in _RULE_KEYS:
            raise Located(key_node, f"unknown rule key '{key}' (expected: {', '.join(_RULE_KEYS)})")
        values[key] = value
    for required in ("id", "stage", "condition", "action"):
        if required not in values:
            raise Located(node, f"rule is missing '{required}'")
    rule_id = scalar_text(values["id"], "rule id")
    if not RULE_ID.match(rule_id):
        raise Located(values["id"], f"rule id '{rule_id}' must match {RULE_ID.pattern}")
    stage = Stage(_choice(values["stage"], "stage", tuple(str(s) for s in STAGE_ORDER)))
    rule = _RawRule(
        id=rule_id,
        id_node=values["id"],
        node=node,
        source=source,
        stage=stage,
        condition=expression_node(values["condition"], "condition"),
        action_kind=ActionKind.DENY,
        action_node=values["action"],
    )
    _parse_action(rule, values["action"])
    if rule.action_kind not in STAGE_ACTIONS[stage]:
        allowed = ", ".join(sorted(str(a) for a in STAGE_ACTIONS[stage]))
        raise Located(
            values["action"],
            f"action '{rule.action_kind}' is not valid in stage '{stage}' (allowed: {allowed})",
        )
    if "message" in values:
        if rule.action_kind is not ActionKind.DENY:
            raise Located(
                values["message"], "message is the caller-facing reason of a deny; this rule does not deny"
            )
        rule.message = expression_node(values["message"], "message")
    if "mode" in values:
        rule.mode = RuleMode(_choice(values["mode"], "mode", tuple(str(m) for m in RuleMode)))
    if "on_error" in values:
        on_error = OnError(_choice(values["on_error"], "on_error", tuple(str(o) for o in OnError)))
        if stage not in ON_ERROR_STAGES and not (stage is Stage.PRIVACY and on_error is OnError.DENY):
            raise Located(
                values["on_error"],
                f"on_error is not configurable in stage '{stage}': {ON_ERROR_FIXED[stage]}",
            )
        rule.on_error = on_error
    if "description" in values and not is_null(values["description"]):
        rule.description = scalar_text(values["description"], "description")
    return rule


def _parse_action(rule: _RawRule, node: Node) -> None:
    names = tuple(str(a) for a in ActionKind)
    if isinstance(node, ScalarNode):
        kind = ActionKind(_choice(node, "action", names))
        if kind is ActionKind.DENY:
            raise Located(node, "deny needs a status, e.g. action: {deny: {status: PERMISSION_DENIED}}")
        if kind is ActionKind.LIMIT:
            raise Located(
                node,
                "limit needs a value, e.g. action: {limit: {max_output_tokens: tenant.max_output_tokens}}",
            )
        if kind is ActionKind.ANNOTATE:
            raise Located(
                node, "annotate needs key/value pairs, e.g. action: {annotate: {isolation: dedicated}}"
            )
        rule.action_kind = kind
        return
    items = list(mapping_items(node, "action"))
    if len(items) != 1:
        raise Located(node, f"action must name exactly one of: {', '.join(names)}")
    _, key_node, params = items[0]
    kind = ActionKind(_choice(key_node, "action", names))
    rule.action_kind = kind
    if kind is ActionKind.DENY:
        fields = dict((k, v) for k, _, v in mapping_items(params, "deny"))
        for k in fields:
            if k not in ("status", "retry_after_ms"):
                raise Located(params, f"unknown deny key '{k}' (expected: status, retry_after_ms)")
        if "status" not in fields:
            raise Located(params, f"deny needs a status (one of: {', '.join(DENY_STATUSES)})")
        rule.status = _choice(fields["status"], "deny status", DENY_STATUSES)
        if "retry_after_ms" in fields:
            rule.retry_after_ms = expression_node(fields["retry_after_ms"], "retry_after_ms")
    elif kind is ActionKind.LIMIT:
        fields = dict((k, v) for k, _, v in mapping_items(params, "limit"))
        if set(fields) != {"max_output_tokens"}:
            raise Located(params, "limit takes exactly one key: max_output_tokens (a CEL int expression)")
        rule.max_output_tokens = expression_node(fields["max_output_tokens"], "max_output_tokens")
    elif kind is ActionKind.ANNOTATE:
        pairs: list[tuple[str, str]] = []
        for k, k_node, v in mapping_items(params, "annotate"):
            if not ANNOTATION_KEY.match(k):
                raise Located(k_node, f"annotation key '{k}' must match {ANNOTATION_KEY.pattern}")
            if k not in ENFORCED_ANNOTATIONS:
                raise Located(
                    k_node,
                    f"annotation '{k}' has no effect: nothing enforces it (enforced keys: "
                    f"{', '.join(sorted(ENFORCED_ANNOTATIONS))})",
                )
            value = scalar_text(v, f"annotation '{k}'")
            if value not in ENFORCED_ANNOTATIONS[k]:
                raise Located(
                    v,
                    f"annotation {k}={value} has no effect: nothing enforces it (enforced values: "
                    f"{', '.join(sorted(ENFORCED_ANNOTATIONS[k]))})",
                )
            pairs.append((k, value))
        if not pairs:
            raise Located(params, "annotate needs at least one key/value pair")
        rule.annotations = tuple(pairs)
    elif not is_null(params):
        raise Located(params, f"action '{kind}' takes no parameters")


# ---------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------


class _Compiler:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.diagnostics: list[Diagnostic] = []
        self.variable_types: dict[str, str] = {}
        self.variable_origins: dict[str, frozenset[Origin]] = {}
        self.variable_reads: dict[str, frozenset[str]] = {}

    def declarations(self) -> dict[str, str]:
        declared = {f.path: f.cel_type for f in schema.FIELDS}
        declared.update({f"variables.{name}": t for name, t in self.variable_types.items()})
        return declared

    def report(self, source: SourceFile, node: ScalarNode, line: int, column: int, message: str) -> None:
        file_line, file_column = source.expression_position(node, line, column)
        self.diagnostics.append(source.diagnostic_at(file_line, file_column, message))

    def expression(
        self,
        source: SourceFile,
        node: ScalarNode,
        scope: Scope,
        expected: str | None,
        what: str,
    ) -> tuple[CompiledExpression | None, Analysis]:
        """Bounds and dialect (``analysis``), then types (the engine's checker): every problem found."""
        text = str(node.value)
        analysis = analyze(text, scope)
        for problem in analysis.problems:
            self.report(source, node, problem.line, problem.column, problem.message)
        if not analysis.parsed:
            return None, analysis
        try:
            compiled = self.engine.compile(text, self.declarations())
        except CompileProblem as exc:
            seen = {(p.line, p.column) for p in analysis.problems}
            for line, column, message in exc.problems:
                if (line, column) not in seen:  # e.g. ``Foo{}``: construction, not also "undeclared"
                    self.report(source, node, line, column, message)
            return None, analysis
        if analysis.problems:
            return None, analysis
        if expected is not None and compiled.result_type not in (expected, schema.DYN):
            self.report(
                source,
                node,
                1,
                1,
                f"{what} must be a CEL {expected} expression; this one is {compiled.result_type}",
            )
            return None, analysis
        return compiled, analysis


def _topological(
    variables: list[_RawVariable], uses: Mapping[str, frozenset[str]]
) -> tuple[list[str], list[str]]:
    """Dependency order of variables, and the cycles found (as 'a -> b -> a')."""
    order: list[str] = []
    cycles: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = [*path[path.index(name) :], name]
            cycles.append(" -> ".join(cycle))
            return
        state[name] = 1
        for dependency in sorted(uses.get(name, frozenset())):
            if dependency in uses:
                visit(dependency, [*path, name])
        state[name] = 2
        order.append(name)

    for variable in variables:
        visit(variable.name, [])
    return order, cycles


def compile_policies(
    files: Mapping[str, bytes | str],
    *,
    engine: str | Engine = DEFAULT_ENGINE,
    base: str | Path | None = None,
) -> PolicySnapshot:
    """Compile ``{file name: content}`` into a snapshot; raises ``PolicyLoadError``.

    ``base`` prefixes file names in diagnostics (``policies/admission.yaml:3:14``).
    """
    cel = get_engine(engine) if isinstance(engine, str) else engine
    raw = {name: (data.encode() if isinstance(data, str) else data) for name, data in files.items()}
    version = content_hash(raw)
    parsed = _Parsed()
    prefix = Path(base) if base is not None else None
    rule_files: list[str] = []
    for name in sorted(raw):
        display = str(prefix / name) if prefix is not None else name
        data = raw[name]
        if len(data) > MAX_FILE_BYTES:
            parsed.diagnostics.append(
                Diagnostic(
                    display,
                    1,
                    1,
                    f"policy file is {len(data):,} bytes; the limit is {MAX_FILE_BYTES:,} (MAX_FILE_BYTES)",
                )
            )
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            parsed.diagnostics.append(Diagnostic(display, 1, 1, f"policy file is not UTF-8: {exc.reason}"))
            continue
        source = SourceFile(display, text)
        try:
            if name == MANIFEST:
                _parse_manifest(source, parsed)
            else:
                rule_files.append(name)
                _parse_file(source, parsed)
        except YamlSyntaxError as exc:
            parsed.diagnostics.append(exc.diagnostic)
        except Located as problem:
            parsed.diagnostics.append(source.diagnostic(problem.node, problem.message))
    if not rule_files and not parsed.diagnostics:
        where = str(prefix) if prefix is not None else "<policy set>"
        parsed.diagnostics.append(Diagnostic(where, 1, 1, "no policy files (*.yaml) found"))

    compiler = _Compiler(cel)
    diagnostics = compiler.diagnostics
    diagnostics.extend(parsed.diagnostics)

    # Duplicate names.
    seen_variables: dict[str, _RawVariable] = {}
    variables: list[_RawVariable] = []
    for variable in parsed.variables:
        first = seen_variables.get(variable.name)
        if first is not None:
            mark = first.name_node.start_mark
            where = f"{first.source.path}:{mark.line + 1}:{mark.column + 1}"
            diagnostics.append(
                variable.source.diagnostic(
                    variable.name_node, f"duplicate variable '{variable.name}' (first declared at {where})"
                )
            )
            continue
        seen_variables[variable.name] = variable
        variables.append(variable)
    seen_rules: dict[str, _RawRule] = {}
    rules: list[_RawRule] = []
    for rule in parsed.rules:
        first_rule = seen_rules.get(rule.id)
        if first_rule is not None:
            mark = first_rule.id_node.start_mark
            where = f"{first_rule.source.path}:{mark.line + 1}:{mark.column + 1}"
            diagnostics.append(
                rule.source.diagnostic(
                    rule.id_node, f"duplicate rule id '{rule.id}' (first defined at {where})"
                )
            )
            continue
        seen_rules[rule.id] = rule
        rules.append(rule)

    # Variables: discover dependencies, order them, then type and compile in order.
    uses = {v.name: analyze(str(v.node.value), Scope()).variables for v in variables}
    order, cycles = _topological(variables, uses)
    by_name = {v.name: v for v in variables}
    for cycle in cycles:
        start = by_name[cycle.split(" -> ")[0]]
        diagnostics.append(
            start.source.diagnostic(start.node, f"variables depend on each other in a cycle: {cycle}")
        )
    compiled_variables: list[Variable] = []
    if not cycles:
        for name in order:
            variable = by_name[name]
            scope = Scope(variable_origins=dict(compiler.variable_origins))
            compiled, analysis = compiler.expression(
                variable.source, variable.node, scope, None, f"variable '{name}'"
            )
            if compiled is None:
                compiler.variable_types[name] = schema.DYN
                compiler.variable_origins[name] = frozenset({Origin.CALLER})
                continue
            cel_type = compiled.result_type
            compiler.variable_types[name] = cel_type
            compiler.variable_origins[name] = origins_of(analysis, compiler.variable_origins)
            compiler.variable_reads[name] = analysis.reads
            mark = variable.node.start_mark
            compiled_variables.append(
                Variable(
                    name=name,
                    text=str(variable.node.value),
                    expression=compiled,
                    cel_type=cel_type,
                    reads=tuple(sorted(analysis.reads)),
                    uses=tuple(sorted(analysis.variables)),
                    source=SourceRef(variable.source.path, mark.line + 1, mark.column + 1),
                )
            )
    else:
        compiler.variable_types.update({v.name: schema.DYN for v in variables})

    # Rules.
    compiled_rules: list[Rule] = []
    for rule in rules:
        scope = Scope(
            variable_origins=dict(compiler.variable_origins), allow_backend=rule.stage is Stage.ROUTING
        )
        condition, condition_analysis = compiler.expression(
            rule.source, rule.condition, scope, schema.BOOL, "condition"
        )
        analyses = [condition_analysis]
        message: CompiledExpression | None = None
        retry: CompiledExpression | None = None
        max_tokens: CompiledExpression | None = None
        ok = condition is not None
        if rule.message is not None:
            message, analysis = compiler.expression(
                rule.source, rule.message, scope, schema.STRING, "message"
            )
            analyses.append(analysis)
            ok = ok and message is not None
        if rule.retry_after_ms is not None:
            retry, analysis = compiler.expression(
                rule.source, rule.retry_after_ms, scope, schema.INT, "retry_after_ms"
            )
            analyses.append(analysis)
            ok = ok and retry is not None
        if rule.max_output_tokens is not None:
            max_tokens, analysis = compiler.expression(
                rule.source, rule.max_output_tokens, scope, schema.INT, "max_output_tokens"
            )
            analyses.append(analysis)
            ok = ok and max_tokens is not None
        if not ok or condition is None:
            continue
        mark = rule.id_node.start_mark
        compiled_rules.append(
            Rule(
                id=rule.id,
                stage=rule.stage,
                mode=rule.mode,
                on_error=rule.on_error,
                action=Action(
                    kind=rule.action_kind,
                    status=rule.status,
                    retry_after_ms=retry,
                    max_output_tokens=max_tokens,
                    annotations=rule.annotations,
                ),
                condition=condition,
                condition_text=str(rule.condition.value),
                message=message,
                description=rule.description,
                source=SourceRef(rule.source.path, mark.line + 1, mark.column + 1),
                reads=tuple(sorted(set().union(*(a.reads for a in analyses)))),
                uses=tuple(sorted(set().union(*(a.variables for a in analyses)))),
                condition_reads=tuple(sorted(condition_analysis.reads)),
            )
        )

    if diagnostics:
        raise PolicyLoadError(sorted(diagnostics, key=lambda d: (d.path, d.line, d.column)))
    # Rules in stage order, file order within a stage (``rules`` is already in file order).
    ordered = [rule for stage in STAGE_ORDER for rule in compiled_rules if rule.stage is stage]
    return PolicySnapshot(
        version=version,
        label=parsed.label,
        engine=cel,
        rules=ordered,
        variables=compiled_variables,
        files=tuple(sorted(raw)),
        plans=_plans(cel, ordered, compiled_variables),
    )


def _plans(engine: Engine, rules: list[Rule], variables: list[Variable]) -> tuple[Plan, ...]:
    """The fast path over already-checked texts (see ``snapshot.Plan``): at most two plans.

    The cached plan holds the conditions (and the variables) that read only inputs that are
    stable from one request to the next (``schema.volatile``), and the routing rules when all
    of them do; the other plan holds the rest, evaluated for every request. Empty: no plan
    (the engine prefers one expression at a time, or a variable reads another)."""
    if not engine.prefers_plan or any(v.uses for v in variables):
        return ()
    main = [r for r in rules if r.stage is not Stage.ROUTING]
    routing = [r for r in rules if r.stage is Stage.ROUTING]
    stable_variables = {v.name for v in variables if not any(schema.volatile(p) for p in v.reads)}

    def stable(rule: Rule) -> bool:
        # ``uses`` covers every expression of the rule, not only its condition: conservative.
        return not any(schema.volatile(p) for p in rule.condition_reads) and all(
            name in stable_variables for name in rule.uses
        )

    fixed = [i for i, rule in enumerate(main) if stable(rule)]
    moving = [i for i, rule in enumerate(main) if not stable(rule)]
    routing_fixed = all(stable(rule) for rule in routing)
    volatile_variables = [v for v in variables if v.name not in stable_variables]
    plans: list[Plan] = []
    cached = bool(fixed) or (bool(routing) and routing_fixed)
    if cached:
        plan = _compile_plan(
            engine,
            [main[i] for i in fixed],
            routing if routing_fixed else [],
            [v for v in variables if v.name in stable_variables],
            conditions=tuple(fixed),
            cached=True,
        )
        if plan is None:  # pragma: no cover - every element compiled alone
            return ()
        plans.append(plan)
    if moving or not routing_fixed or volatile_variables or not plans:
        used = {name for i in moving for name in main[i].uses} | {
            name for rule in (routing if not routing_fixed else []) for name in rule.uses
        }
        own = [v for v in variables if not cached or v.name not in stable_variables or v.name in used]
        plan = _compile_plan(
            engine,
            [main[i] for i in moving],
            routing if not routing_fixed else [],
            own,
            conditions=tuple(moving),
            cached=False,
        )
        if plan is None:  # pragma: no cover - every element compiled alone
            return ()
        plans.append(plan)
    return tuple(plans)


def _compile_plan(
    engine: Engine,
    rules: list[Rule],
    routing: list[Rule],
    variables: list[Variable],
    *,
    conditions: tuple[int, ...],
    cached: bool,
) -> Plan | None:
    """One plan: ``rules``' conditions (at ``conditions`` among the main rules), ``routing``'s
    per candidate backend (none: an empty list), and ``variables``, as one CEL expression."""

    def item(text: str) -> str:
        # The newline keeps a trailing ``//`` comment from swallowing the closing parenthesis.
        return f"({text}\n)"

    listed = ", ".join(item(r.condition_text) for r in rules)
    values = ", ".join(f"{v.name!r}: {item(v.text)}" for v in variables)
    per_backend = "[]"
    if routing:
        routing_listed = ", ".join(item(r.condition_text) for r in routing)
        per_backend = f"{BACKENDS_VARIABLE}.map(backend, [{routing_listed}])"
    body = f"[variables, [{listed}], {per_backend}]"
    text = f"[{{{values}}}].map(variables, {body})[0]"
    reads = {
        path
        for r in (*rules, *routing)
        for path in r.condition_reads
        if not schema.FIELDS_BY_PATH[path].per_backend
    }
    reads.update(path for v in variables for path in v.reads)
    declarations = {f.path: f.cel_type for f in schema.FIELDS if not f.per_backend}
    declarations[BACKENDS_VARIABLE] = "list(map(string, dyn))"
    try:
        expression = engine.compile(text, declarations)
    except CompileProblem:  # pragma: no cover - every element compiled alone; keep the slow path
        return None
    return Plan(
        expression,
        tuple(v.name for v in variables),
        conditions=conditions,
        routing=bool(routing),
        reads=tuple(sorted(reads)),
        cached=cached,
    )
