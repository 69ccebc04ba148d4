"""What the CEL engines cannot check: evaluation bounds and the policy dialect's own rules.

Types are not decided here. Every expression also goes through cel-cpp's type
checker (``engine.TypeChecker``, for both engines), which reports undeclared
names, operand and argument types, unknown functions and the result type.
This module owns the load-time checks that checker cannot express, the same
for every engine:

- size and nesting limits (``MAX_EXPRESSION_CHARS``, ``MAX_NESTING_DEPTH``),
  checked lexically before anything parses: they bound compile time, and the
  recursion of the pure-Python engine and of the walk below;
- syntax, from the CEL grammar cel-python ships (``celpy/cel.lark``), parsed
  with positions: the checks below need a syntax tree, which cel-expr-python
  does not expose, and an expression must parse on cel-python too;
- bounded evaluation: comprehension macros (``all``, ``exists``,
  ``exists_one``, ``map``, ``filter``) may range only over configured lists
  and maps or constant literals - never over anything the caller controls or
  anything computed - may not nest, and their variable may not shadow a
  namespace. A type checker knows a value's type, not who controls it or how
  long it is; the origins come from ``schema.FIELDS``;
- stage scope: ``backend.*`` only in routing-stage rules (they run once per
  candidate backend). The checker knows the fields' types; which stage may
  read them is the policy model's rule;
- ``has()`` on a schema field or a policy variable: those are always present.
  cel-cpp resolves ``has(request.model)`` to the declared variable itself (the
  checker types it ``string`` and evaluation returns the string), so the
  checker cannot be the one to refuse it;
- message construction (``google.protobuf.Duration{...}``): the checker
  accepts well-known types; policy expressions build none.

It also reports what an expression reads (schema paths and policy variables):
the evaluator binds only those, ``explain`` shows their values, and variable
dependencies are ordered by them. Positions are 1-based (line, column) inside
the expression.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from gateway.policy import schema
from gateway.policy.schema import Origin

# Why these limits: a rule longer than a screen is not reviewable, and both
# limits bound compile time, evaluation time and the recursion depth of the
# pure-Python engine. cel-cpp itself refuses parser recursion deeper than 32;
# 16 levels of brackets leave room for its own operator nesting.
MAX_EXPRESSION_CHARS = 2048
MAX_NESTING_DEPTH = 16

COMPREHENSION_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})


@dataclass(frozen=True, slots=True)
class Problem:
    line: int
    column: int
    message: str


@dataclass(frozen=True, slots=True)
class Analysis:
    """What an expression reads, and what is wrong with it beyond its types."""

    reads: frozenset[str]  # schema paths, e.g. "budget.slack_ms"
    variables: frozenset[str]  # names of policy variables, e.g. "long_input"
    problems: tuple[Problem, ...]
    # False when the expression did not parse or exceeded a limit: nothing else was
    # looked at, and the text must not reach an engine.
    parsed: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class Scope:
    """Where an expression is: the policy variables declared so far and the rule's stage."""

    # The policy variables declared so far, with who controls their inputs (transitively).
    variable_origins: Mapping[str, frozenset[Origin]] = field(default_factory=dict)
    allow_backend: bool = False  # a routing-stage rule


# ---------------------------------------------------------------------------
# Parsing into a small AST
# ---------------------------------------------------------------------------

_PARSER: Lark | None = None
_PARSER_LOCK = threading.Lock()


def _bool_literals(token: Token) -> Token:
    if token.value in ("true", "false"):
        return Token.new_borrow_pos("BOOL_LIT", token.value, token)
    return token


def _parser() -> Lark:
    global _PARSER
    with _PARSER_LOCK:
        if _PARSER is None:
            import celpy.celparser

            grammar = (Path(celpy.celparser.__file__).parent / "cel.lark").read_text()
            _PARSER = Lark(
                grammar,
                parser="lalr",
                start="expr",
                lexer_callbacks={"IDENT": _bool_literals},
                propagate_positions=True,
                maybe_placeholders=False,
                priority="invert",
            )
        return _PARSER


# Only what the checks below look at keeps its shape: names, selections, calls
# (macros, has()), literals (constant ranges), message construction. Operators,
# the conditional and indexing are just their operands.


@dataclass(frozen=True, slots=True)
class Lit:
    pass


@dataclass(frozen=True, slots=True)
class Ident:
    name: str
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Select:
    operand: Node
    field: str
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Call:
    target: Node | None
    name: str
    args: tuple[Node, ...]
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Unary:
    operand: Node


@dataclass(frozen=True, slots=True)
class ListLit:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class MapLit:
    entries: tuple[tuple[Node, Node], ...]


@dataclass(frozen=True, slots=True)
class Struct:
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Operands:
    """A binary operator, the conditional or an index: only the operands matter here."""

    operands: tuple[Node, ...]


Node = Lit | Ident | Select | Call | Unary | ListLit | MapLit | Struct | Operands


def _start(tree: Tree[Token] | Token) -> tuple[int, int]:
    if isinstance(tree, Token):
        return int(tree.line or 1), int(tree.column or 1)
    return int(getattr(tree.meta, "line", None) or 1), int(getattr(tree.meta, "column", None) or 1)


def _convert(tree: Tree[Token] | Token) -> Node:
    """lark parse tree -> the small AST above."""
    if isinstance(tree, Token):  # pragma: no cover - grammar always wraps tokens
        return Lit()
    kids = tree.children
    data = tree.data
    if data in ("expr", "conditionalor", "conditionaland"):
        if len(kids) == 1:
            return _convert(kids[0])
        return Operands(tuple(_convert(kid) for kid in kids))
    if data in ("relation", "addition", "multiplication"):
        if len(kids) == 1:
            return _convert(kids[0])
        operator = kids[0]  # e.g. relation_lt, holding the left operand
        assert isinstance(operator, Tree)
        return Operands((_convert(operator.children[0]), _convert(kids[1])))
    if data == "unary":
        return _convert(kids[0]) if len(kids) == 1 else Unary(_convert(kids[1]))
    if data in ("member", "primary", "paren_expr"):
        return _convert(kids[0])
    if data == "member_index":
        return Operands((_convert(kids[0]), _convert(kids[1])))
    if data in ("member_dot", "member_dot_arg"):
        name = kids[1]
        assert isinstance(name, Token)
        line, column = _start(name)
        if data == "member_dot":
            return Select(_convert(kids[0]), str(name.value), line, column)
        return Call(_convert(kids[0]), str(name.value), _exprlist(kids[2:]), line, column)
    if data in ("ident", "dot_ident", "ident_arg", "dot_ident_arg"):
        name = kids[0]
        assert isinstance(name, Token)
        line, column = _start(name)
        if data in ("ident", "dot_ident"):
            return Ident(str(name.value), line, column)
        return Call(None, str(name.value), _exprlist(kids[1:]), line, column)
    if data == "member_object":
        return Struct(*_start(tree))
    if data == "literal":
        return Lit()
    if data == "list_lit":
        return ListLit(_exprlist(kids))
    if data == "map_lit":
        items = _exprlist(kids[0].children if kids and isinstance(kids[0], Tree) else [])
        return MapLit(tuple(zip(items[0::2], items[1::2], strict=True)))
    raise ValueError(f"unexpected CEL construct {data}")  # pragma: no cover


def _exprlist(kids: list[Tree[Token] | Token]) -> tuple[Node, ...]:
    if not kids:
        return ()
    holder = kids[0]
    if isinstance(holder, Tree) and holder.data in ("exprlist", "mapinits"):
        return tuple(_convert(child) for child in holder.children)
    return tuple(_convert(child) for child in kids)


class _Failed(Exception):
    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def _check_limits(text: str) -> None:
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _Failed(
            Problem(
                1,
                1,
                f"expression is {len(text):,} characters; the limit is {MAX_EXPRESSION_CHARS:,} "
                "(MAX_EXPRESSION_CHARS): split it into variables",
            )
        )
    depth = 0
    line, column = 1, 0
    quote = ""
    index = 0
    while index < len(text):
        ch = text[index]
        column += 1
        if ch == "\n":
            line, column = line + 1, 0
        if quote:
            if ch == "\\":
                index += 2
                column += 1
                continue
            if text.startswith(quote, index):
                index += len(quote)
                column += len(quote) - 1
                quote = ""
                continue
        elif ch in "\"'":
            quote = text[index : index + 3] if text[index : index + 3] in ('"""', "'''") else ch
            index += len(quote)
            column += len(quote) - 1
            continue
        elif ch in "([{":
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                raise _Failed(
                    Problem(
                        line,
                        column,
                        f"expression nests deeper than {MAX_NESTING_DEPTH} levels (MAX_NESTING_DEPTH): "
                        "flatten it or move parts into variables",
                    )
                )
        elif ch in ")]}":
            depth -= 1
        index += 1


def parse(text: str) -> Node:
    """Parse one expression after the limit checks; raises ``_Failed``."""
    _check_limits(text)
    try:
        tree = _parser().parse(text)
    except UnexpectedCharacters as exc:
        raise _Failed(
            Problem(exc.line, exc.column, f"syntax error: unexpected character {exc.char!r}")
        ) from exc
    except UnexpectedEOF as exc:
        raise _Failed(Problem(exc.line, exc.column, "syntax error: unexpected end of expression")) from exc
    except UnexpectedToken as exc:
        token = exc.token
        if token.type == "$END":
            line, column = _end_position(text)
            raise _Failed(Problem(line, column, "syntax error: unexpected end of expression")) from exc
        raise _Failed(Problem(exc.line, exc.column, f"syntax error: unexpected {token.value!r}")) from exc
    except UnexpectedInput as exc:  # pragma: no cover - other lark input errors
        raise _Failed(Problem(exc.line, exc.column, "syntax error")) from exc
    try:
        return _convert(tree)
    except RecursionError as exc:
        raise _Failed(
            Problem(1, 1, f"expression is too deeply nested (MAX_NESTING_DEPTH is {MAX_NESTING_DEPTH})")
        ) from exc


def _end_position(text: str) -> tuple[int, int]:
    stripped = text.rstrip()
    lines = stripped.split("\n")
    return len(lines), len(lines[-1]) + 1


# ---------------------------------------------------------------------------
# Bounded evaluation, stage scope, has(), message construction
# ---------------------------------------------------------------------------


def _qualified(node: Node) -> list[tuple[str, int, int]] | None:
    """``a.b.c`` as [(name, line, col)...] when ``node`` is a pure select chain."""
    parts: list[tuple[str, int, int]] = []
    cursor: Node = node
    while isinstance(cursor, Select):
        parts.append((cursor.field, cursor.line, cursor.column))
        cursor = cursor.operand
    if not isinstance(cursor, Ident):
        return None
    parts.append((cursor.name, cursor.line, cursor.column))
    parts.reverse()
    return parts


def _is_constant(node: Node) -> bool:
    if isinstance(node, Lit):
        return True
    if isinstance(node, Unary):
        return _is_constant(node.operand)
    if isinstance(node, ListLit):
        return all(_is_constant(item) for item in node.items)
    if isinstance(node, MapLit):
        return all(_is_constant(k) and _is_constant(v) for k, v in node.entries)
    return False


_HAS_MAP_KEYS = "has() tests map keys, e.g. has(backend.labels.cell)"


class _Walker:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.reads: set[str] = set()
        self.variables: set[str] = set()
        self.problems: list[Problem] = []

    def fail(self, line: int, column: int, message: str) -> None:
        self.problems.append(Problem(line, column, message))

    def name(self, parts: list[tuple[str, int, int]]) -> None:
        """Record what a qualified name reads. Names that resolve to nothing are the checker's."""
        root, line, column = parts[0]
        if root == schema.VARIABLES_NAMESPACE:
            if len(parts) > 1:
                self.variables.add(parts[1][0])
            return
        for k in range(len(parts), 0, -1):
            path = ".".join(p[0] for p in parts[:k])
            declared = schema.FIELDS_BY_PATH.get(path)
            if declared is None:
                continue
            if declared.per_backend and not self.scope.allow_backend:
                self.fail(
                    line,
                    column,
                    f"'{path}' is only available to routing-stage rules "
                    "(they run once per candidate backend)",
                )
            else:
                self.reads.add(path)
            return

    def origins(self) -> set[Origin]:
        found = {schema.FIELDS_BY_PATH[path].origin for path in self.reads}
        for name in self.variables:
            found |= self.scope.variable_origins.get(name, frozenset({Origin.CALLER}))
        return found

    def walk(self, node: Node, bound: frozenset[str], depth: int) -> None:
        if isinstance(node, Ident):
            if node.name not in bound:
                self.name([(node.name, node.line, node.column)])
        elif isinstance(node, Select):
            parts = _qualified(node)
            if parts is not None and parts[0][0] not in bound:
                self.name(parts)
            else:
                self.walk(node.operand, bound, depth)
        elif isinstance(node, Call):
            if node.target is None and node.name == "has":
                self.has(node, bound, depth)
            elif (
                node.target is not None
                and node.name in COMPREHENSION_MACROS
                and len(node.args) in (2, 3)
                and isinstance(node.args[0], Ident)
            ):
                self.comprehension(node, node.target, node.args[0], bound, depth)
            else:
                for child in (node.target, *node.args) if node.target is not None else node.args:
                    self.walk(child, bound, depth)
        elif isinstance(node, Unary):
            self.walk(node.operand, bound, depth)
        elif isinstance(node, Operands | ListLit):
            for child in node.operands if isinstance(node, Operands) else node.items:
                self.walk(child, bound, depth)
        elif isinstance(node, MapLit):
            for key, value in node.entries:
                self.walk(key, bound, depth)
                self.walk(value, bound, depth)
        elif isinstance(node, Struct):
            self.fail(node.line, node.column, "message construction is not supported in policy expressions")

    def has(self, node: Call, bound: frozenset[str], depth: int) -> None:
        parts = _qualified(node.args[0]) if len(node.args) == 1 else None
        if parts is not None and len(parts) > 1 and parts[0][0] not in bound:
            path = ".".join(p[0] for p in parts)
            if path in schema.FIELDS_BY_PATH:
                self.fail(
                    node.line, node.column, f"has({path}): schema fields are always present; {_HAS_MAP_KEYS}"
                )
            elif (
                parts[0][0] == schema.VARIABLES_NAMESPACE
                and len(parts) == 2
                and parts[1][0] in self.scope.variable_origins
            ):
                self.fail(
                    node.line,
                    node.column,
                    f"has({path}): policy variables are always present; {_HAS_MAP_KEYS}",
                )
        for arg in node.args:  # anything else about has() is the checker's
            self.walk(arg, bound, depth)

    def comprehension(
        self, node: Call, target: Node, variable: Ident, bound: frozenset[str], depth: int
    ) -> None:
        if depth > 0:
            self.fail(
                node.line,
                node.column,
                f"nested comprehension '{node.name}' is not allowed: evaluation must stay bounded",
            )
        if variable.name in schema.NAMESPACES or variable.name == schema.VARIABLES_NAMESPACE:
            self.fail(
                variable.line,
                variable.column,
                f"comprehension variable '{variable.name}' shadows a namespace",
            )
        ranged = _Walker(self.scope)  # what the range alone reads
        ranged.walk(target, bound, depth)
        self.reads |= ranged.reads
        self.variables |= ranged.variables
        self.problems.extend(ranged.problems)
        parts = _qualified(target)
        configured = False
        if parts is not None and parts[0][0] not in bound:
            declared = schema.FIELDS_BY_PATH.get(".".join(p[0] for p in parts))
            configured = declared is not None and declared.origin == Origin.CONFIG
        if not configured and not _is_constant(target):
            why = "a caller-controlled value" if Origin.CALLER in ranged.origins() else "a computed value"
            self.fail(
                node.line,
                node.column,
                f"'{node.name}' ranges over {why}: comprehensions may only range over configured lists "
                "and maps (tenant.allowed_cells, route.fallback_classes, backend.labels ...) or constant "
                "literals, so that evaluation stays bounded",
            )
        inner = bound | {variable.name}
        for arg in node.args[1:]:
            self.walk(arg, inner, depth + 1)


def analyze(text: str, scope: Scope) -> Analysis:
    """Check one expression; never raises for bad input (problems are returned)."""
    try:
        node = parse(text)
    except _Failed as failed:
        return Analysis(frozenset(), frozenset(), (failed.problem,), parsed=False)
    walker = _Walker(scope)
    try:
        walker.walk(node, frozenset(), 0)
    except RecursionError:
        problem = Problem(1, 1, f"expression is too deeply nested (MAX_NESTING_DEPTH is {MAX_NESTING_DEPTH})")
        return Analysis(frozenset(), frozenset(), (problem,), parsed=False)
    return Analysis(
        frozenset(walker.reads),
        frozenset(walker.variables),
        tuple(sorted(set(walker.problems), key=lambda p: (p.line, p.column))),
    )


def origins_of(analysis: Analysis, variable_origins: Mapping[str, frozenset[Origin]]) -> frozenset[Origin]:
    """Who controls the inputs of an expression (through variables, transitively)."""
    found: set[Origin] = {schema.FIELDS_BY_PATH[path].origin for path in analysis.reads}
    for name in analysis.variables:
        found |= variable_origins.get(name, frozenset())
    return frozenset(found)


__all__ = [
    "COMPREHENSION_MACROS",
    "MAX_EXPRESSION_CHARS",
    "MAX_NESTING_DEPTH",
    "Analysis",
    "Problem",
    "Scope",
    "analyze",
    "origins_of",
]
