"""Static analysis of one CEL expression, the same for every engine.

This module owns the load-time checks that must not depend on which engine
runs the policy, so that ``policy lint`` says the same thing under
``cel-expr`` and ``cel-python``:

- size and nesting limits, checked lexically before parsing;
- syntax (the CEL grammar shipped with cel-python, parsed with positions);
- name resolution against the schema (``schema.FIELDS``) and the policy set's
  ``variables``: unknown names, namespaces used as values, ``backend.*``
  outside the routing stage;
- bounded evaluation: comprehension macros (``all``, ``exists``,
  ``exists_one``, ``map``, ``filter``) may range only over configured lists
  and maps or constant literals - never over anything the caller controls or
  anything computed - and may not nest;
- the type errors authors actually make: int vs double (``slack_ms < 0``),
  string vs number, non-bool operands of ``&&``/``||``/``!``. Inference is
  conservative: it flags a mismatch only when both sides are known, leaving
  the rest to the engine (cel-expr-python type-checks everything at compile).

It also reports what an expression reads (schema paths and variables): the
evaluator binds only those, and ``explain`` shows their values.
Positions are 1-based (line, column) inside the expression.
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
GLOBAL_FUNCTIONS: Mapping[str, str] = {
    "size": schema.INT,
    "int": schema.INT,
    "uint": "uint",
    "double": schema.DOUBLE,
    "string": schema.STRING,
    "bool": schema.BOOL,
    "bytes": "bytes",
    "dyn": schema.DYN,
    "type": schema.DYN,
    "matches": schema.BOOL,
    "has": schema.BOOL,
}
MEMBER_FUNCTIONS: Mapping[str, str] = {
    "size": schema.INT,
    "contains": schema.BOOL,
    "startsWith": schema.BOOL,
    "endsWith": schema.BOOL,
    "matches": schema.BOOL,
}
_NUMERIC = frozenset({schema.INT, "uint", schema.DOUBLE})
_SCALARS = _NUMERIC | {schema.STRING, schema.BOOL, "bytes"}


@dataclass(frozen=True, slots=True)
class Problem:
    line: int
    column: int
    message: str


@dataclass(frozen=True, slots=True)
class Analysis:
    """What an expression reads, its inferred type, and what is wrong with it."""

    reads: frozenset[str]  # schema paths, e.g. "budget.slack_ms"
    variables: frozenset[str]  # names of policy variables, e.g. "long_input"
    result_type: str
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class Scope:
    """What names an expression may use."""

    variable_types: Mapping[str, str] = field(default_factory=dict)
    variable_origins: Mapping[str, frozenset[Origin]] = field(default_factory=dict)
    allow_backend: bool = False


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


@dataclass(frozen=True, slots=True)
class Lit:
    kind: str
    line: int
    column: int


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
class Index:
    operand: Node
    index: Node
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
class Binary:
    op: str
    left: Node
    right: Node
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Unary:
    op: str
    operand: Node
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Cond:
    cond: Node
    then: Node
    other: Node
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class ListLit:
    items: tuple[Node, ...]
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class MapLit:
    entries: tuple[tuple[Node, Node], ...]
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Struct:
    line: int
    column: int


Node = Lit | Ident | Select | Index | Call | Binary | Unary | Cond | ListLit | MapLit | Struct

_BINARY_RULES: Mapping[str, tuple[str, str]] = {
    "relation_lt": ("_<_", "<"),
    "relation_le": ("_<=_", "<="),
    "relation_gt": ("_>_", ">"),
    "relation_ge": ("_>=_", ">="),
    "relation_eq": ("_==_", "=="),
    "relation_ne": ("_!=_", "!="),
    "relation_in": ("@in", "in"),
    "addition_add": ("_+_", "+"),
    "addition_sub": ("_-_", "-"),
    "multiplication_mul": ("_*_", "*"),
    "multiplication_div": ("_/_", "/"),
    "multiplication_mod": ("_%_", "%"),
}


class _Converter:
    """lark parse tree -> the small AST above, with operator positions."""

    def __init__(self, text: str) -> None:
        self.text = text
        starts = [0]
        for index, ch in enumerate(text):
            if ch == "\n":
                starts.append(index + 1)
        self.starts = starts

    def _offset(self, line: int, column: int) -> int:
        return self.starts[min(line, len(self.starts)) - 1] + column - 1

    def _pos(self, offset: int) -> tuple[int, int]:
        line = 1
        for index, start in enumerate(self.starts):
            if start <= offset:
                line = index + 1
        return line, offset - self.starts[line - 1] + 1

    def _start(self, tree: Tree[Token] | Token) -> tuple[int, int]:
        if isinstance(tree, Token):
            return int(tree.line or 1), int(tree.column or 1)
        return int(getattr(tree.meta, "line", None) or 1), int(getattr(tree.meta, "column", None) or 1)

    def _after(self, tree: Tree[Token], symbol: str) -> tuple[int, int]:
        """Position of ``symbol`` after the end of ``tree`` (an infix operator)."""
        end = self._offset(int(tree.meta.end_line), int(tree.meta.end_column))
        found = self.text.find(symbol, end)
        return self._pos(found if found >= 0 else end)

    def convert(self, tree: Tree[Token] | Token) -> Node:
        if isinstance(tree, Token):  # pragma: no cover - grammar always wraps tokens
            line, column = self._start(tree)
            return Lit(str(tree.type), line, column)
        kids = tree.children
        data = tree.data
        line, column = self._start(tree)
        if data == "expr":
            if len(kids) == 1:
                return self.convert(kids[0])
            first = kids[0]
            assert isinstance(first, Tree)
            qline, qcolumn = self._after(first, "?")
            return Cond(self.convert(first), self.convert(kids[1]), self.convert(kids[2]), qline, qcolumn)
        if data in ("conditionalor", "conditionaland"):
            if len(kids) == 1:
                return self.convert(kids[0])
            symbol, op = ("||", "_||_") if data == "conditionalor" else ("&&", "_&&_")
            left = kids[0]
            assert isinstance(left, Tree)
            oline, ocolumn = self._after(left, symbol)
            return Binary(op, self.convert(left), self.convert(kids[1]), oline, ocolumn)
        if data in ("relation", "addition", "multiplication"):
            if len(kids) == 1:
                return self.convert(kids[0])
            operator = kids[0]
            assert isinstance(operator, Tree)
            op, symbol = _BINARY_RULES[str(operator.data)]
            end = self._offset(int(operator.meta.end_line), int(operator.meta.end_column))
            oline, ocolumn = self._pos(max(0, end - len(symbol)))
            return Binary(op, self.convert(operator.children[0]), self.convert(kids[1]), oline, ocolumn)
        if data == "unary":
            if len(kids) == 1:
                return self.convert(kids[0])
            operator = kids[0]
            assert isinstance(operator, Tree)
            op = "!_" if operator.data == "unary_not" else "-_"
            return Unary(op, self.convert(kids[1]), line, column)
        if data in ("member", "primary", "paren_expr"):
            return self.convert(kids[0])
        if data == "member_dot":
            name = kids[1]
            assert isinstance(name, Token)
            nline, ncolumn = self._start(name)
            return Select(self.convert(kids[0]), str(name.value), nline, ncolumn)
        if data == "member_dot_arg":
            name = kids[1]
            assert isinstance(name, Token)
            nline, ncolumn = self._start(name)
            return Call(self.convert(kids[0]), str(name.value), self._exprlist(kids[2:]), nline, ncolumn)
        if data == "member_index":
            target = kids[0]
            assert isinstance(target, Tree)
            iline, icolumn = self._after(target, "[")
            return Index(self.convert(target), self.convert(kids[1]), iline, icolumn)
        if data == "member_object":
            return Struct(line, column)
        if data in ("ident", "dot_ident"):
            name = kids[0]
            assert isinstance(name, Token)
            nline, ncolumn = self._start(name)
            return Ident(str(name.value), nline, ncolumn)
        if data in ("ident_arg", "dot_ident_arg"):
            name = kids[0]
            assert isinstance(name, Token)
            nline, ncolumn = self._start(name)
            return Call(None, str(name.value), self._exprlist(kids[1:]), nline, ncolumn)
        if data == "literal":
            token = kids[0]
            assert isinstance(token, Token)
            return Lit(str(token.type), line, column)
        if data == "list_lit":
            return ListLit(self._exprlist(kids), line, column)
        if data == "map_lit":
            items = self._exprlist(kids[0].children if kids and isinstance(kids[0], Tree) else [])
            return MapLit(tuple(zip(items[0::2], items[1::2], strict=True)), line, column)
        raise ValueError(f"unexpected CEL construct {data}")  # pragma: no cover

    def _exprlist(self, kids: list[Tree[Token] | Token]) -> tuple[Node, ...]:
        if not kids:
            return ()
        holder = kids[0]
        if isinstance(holder, Tree) and holder.data in ("exprlist", "mapinits"):
            return tuple(self.convert(child) for child in holder.children)
        return tuple(self.convert(child) for child in kids)


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
        return _Converter(text).convert(tree)
    except RecursionError as exc:
        raise _Failed(
            Problem(1, 1, f"expression is too deeply nested (MAX_NESTING_DEPTH is {MAX_NESTING_DEPTH})")
        ) from exc


def _end_position(text: str) -> tuple[int, int]:
    stripped = text.rstrip()
    lines = stripped.split("\n")
    return len(lines), len(lines[-1]) + 1


# ---------------------------------------------------------------------------
# Names, types, bounded evaluation
# ---------------------------------------------------------------------------


def _list_elem(cel_type: str) -> str | None:
    if cel_type.startswith("list(") and cel_type.endswith(")"):
        return cel_type[5:-1]
    return None


def _map_parts(cel_type: str) -> tuple[str, str] | None:
    if not (cel_type.startswith("map(") and cel_type.endswith(")")):
        return None
    inner = cel_type[4:-1]
    depth = 0
    for index, ch in enumerate(inner):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            return inner[:index].strip(), inner[index + 1 :].strip()
    return None  # pragma: no cover


def _field_prefixes() -> frozenset[str]:
    prefixes: set[str] = set()
    for path in schema.FIELDS_BY_PATH:
        parts = path.split(".")
        for k in range(1, len(parts)):
            prefixes.add(".".join(parts[:k]))
    return frozenset(prefixes)


_PREFIXES = _field_prefixes()


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


class _Checker:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.reads: set[str] = set()
        self.variables: set[str] = set()
        self.problems: list[Problem] = []

    def fail(self, line: int, column: int, message: str) -> str:
        self.problems.append(Problem(line, column, message))
        return schema.DYN

    # -- names ---------------------------------------------------------------

    def resolve(self, parts: list[tuple[str, int, int]]) -> tuple[str, str | None]:
        """Type of a qualified name, and the schema path or variable it resolved to."""
        root, rline, rcolumn = parts[0]
        dotted = ".".join(p[0] for p in parts)
        resolved: str | None = None
        if root == schema.VARIABLES_NAMESPACE:
            if len(parts) == 1:
                return self.fail(
                    rline, rcolumn, "'variables' is a namespace: name one, e.g. variables.long_input"
                ), None
            name, nline, ncolumn = parts[1]
            if name not in self.scope.variable_types:
                return self.fail(nline, ncolumn, f"undeclared reference to 'variables.{name}'"), None
            self.variables.add(name)
            cel_type = self.scope.variable_types[name]
            rest = parts[2:]
            resolved = f"variables.{name}"
        elif root in schema.NAMESPACES:
            k = len(parts)
            while k > 0 and ".".join(p[0] for p in parts[:k]) not in schema.FIELDS_BY_PATH:
                k -= 1
            if k == 0:
                # the first segment that leaves the declared tree
                j = 1
                while j < len(parts) and ".".join(p[0] for p in parts[: j + 1]) in _PREFIXES:
                    j += 1
                if j >= len(parts):
                    return self.fail(
                        rline, rcolumn, f"'{dotted}' is a namespace, not a value: name one of its fields"
                    ), None
                name, bline, bcolumn = parts[j]
                bad = ".".join(p[0] for p in parts[: j + 1])
                return self.fail(bline, bcolumn, f"undeclared reference to '{bad}'"), None
            path = ".".join(p[0] for p in parts[:k])
            declared = schema.FIELDS_BY_PATH[path]
            if declared.per_backend and not self.scope.allow_backend:
                return self.fail(
                    rline,
                    rcolumn,
                    f"'{path}' is only available to routing-stage rules "
                    "(they run once per candidate backend)",
                ), None
            self.reads.add(path)
            cel_type = declared.cel_type
            rest = parts[k:]
            resolved = path
        else:
            return self.fail(rline, rcolumn, f"undeclared reference to '{dotted}'"), None
        so_far = resolved
        for name, line, column in rest:
            cel_type = self.select_type(cel_type, so_far, name, line, column)
            so_far = f"{so_far}.{name}"
        return cel_type, resolved if not rest else None

    def select_type(self, cel_type: str, what: str, name: str, line: int, column: int) -> str:
        parts = _map_parts(cel_type)
        if parts is not None:
            return parts[1]
        if cel_type == schema.DYN:
            return schema.DYN
        return self.fail(line, column, f"'{what}' is a {cel_type}; it has no field '{name}'")

    def origins(self, before: set[str], before_vars: set[str]) -> set[Origin]:
        found: set[Origin] = set()
        for path in self.reads - before:
            found.add(schema.FIELDS_BY_PATH[path].origin)
        for name in self.variables - before_vars:
            found |= set(self.scope.variable_origins.get(name, frozenset({Origin.CALLER})))
        return found

    # -- walk ----------------------------------------------------------------

    def walk(self, node: Node, bound: Mapping[str, str], depth: int) -> str:
        if isinstance(node, Lit):
            return _LITERAL_TYPES.get(node.kind, schema.DYN)
        if isinstance(node, Ident):
            if node.name in bound:
                return bound[node.name]
            return self.resolve([(node.name, node.line, node.column)])[0]
        if isinstance(node, Select):
            parts = _qualified(node)
            if parts is not None and parts[0][0] not in bound:
                return self.resolve(parts)[0]
            operand = self.walk(node.operand, bound, depth)
            return self.select_type(operand, "expression", node.field, node.line, node.column)
        if isinstance(node, Index):
            return self.index(node, bound, depth)
        if isinstance(node, Call):
            return self.call(node, bound, depth)
        if isinstance(node, Binary):
            return self.binary(node, bound, depth)
        if isinstance(node, Unary):
            operand = self.walk(node.operand, bound, depth)
            if node.op == "!_" and operand in _SCALARS and operand != schema.BOOL:
                return self.fail(
                    node.line, node.column, f"found no matching overload for '!_' applied to '({operand})'"
                )
            if node.op == "-_" and operand in _SCALARS and operand not in _NUMERIC:
                return self.fail(
                    node.line, node.column, f"found no matching overload for '-_' applied to '({operand})'"
                )
            return schema.BOOL if node.op == "!_" else operand
        if isinstance(node, Cond):
            cond = self.walk(node.cond, bound, depth)
            then = self.walk(node.then, bound, depth)
            other = self.walk(node.other, bound, depth)
            if cond in _SCALARS and cond != schema.BOOL:
                return self.fail(
                    node.line,
                    node.column,
                    f"found no matching overload for '_?_:_' applied to '({cond}, {then}, {other})'",
                )
            return then if then == other else schema.DYN
        if isinstance(node, ListLit):
            items = {self.walk(item, bound, depth) for item in node.items}
            return f"list({items.pop()})" if len(items) == 1 else "list(dyn)"
        if isinstance(node, MapLit):
            keys = {self.walk(k, bound, depth) for k, _ in node.entries}
            values = {self.walk(v, bound, depth) for _, v in node.entries}
            key = keys.pop() if len(keys) == 1 else schema.DYN
            value = values.pop() if len(values) == 1 else schema.DYN
            return f"map({key}, {value})"
        return self.fail(
            node.line, node.column, "message construction is not supported in policy expressions"
        )

    def index(self, node: Index, bound: Mapping[str, str], depth: int) -> str:
        operand = self.walk(node.operand, bound, depth)
        key = self.walk(node.index, bound, depth)
        elem = _list_elem(operand)
        if elem is not None:
            if key in _SCALARS and key != schema.INT:
                return self.fail(
                    node.line,
                    node.column,
                    f"found no matching overload for '_[_]' applied to '({operand}, {key})'",
                )
            return elem
        parts = _map_parts(operand)
        if parts is not None:
            if key in _SCALARS and parts[0] in _SCALARS and key != parts[0]:
                return self.fail(
                    node.line,
                    node.column,
                    f"found no matching overload for '_[_]' applied to '({operand}, {key})'",
                )
            return parts[1]
        if operand in _SCALARS:
            return self.fail(
                node.line,
                node.column,
                f"found no matching overload for '_[_]' applied to '({operand}, {key})'",
            )
        return schema.DYN

    def binary(self, node: Binary, bound: Mapping[str, str], depth: int) -> str:
        left = self.walk(node.left, bound, depth)
        right = self.walk(node.right, bound, depth)
        op = node.op

        def mismatch() -> str:
            return self.fail(
                node.line,
                node.column,
                f"found no matching overload for '{op}' applied to '({left}, {right})'",
            )

        if op in ("_&&_", "_||_"):
            if (left in _SCALARS and left != schema.BOOL) or (right in _SCALARS and right != schema.BOOL):
                return mismatch()
            return schema.BOOL
        if op == "@in":
            elem = _list_elem(right)
            parts = _map_parts(right)
            container_key = elem if elem is not None else parts[0] if parts is not None else None
            if right in _SCALARS:
                return mismatch()
            if container_key in _SCALARS and left in _SCALARS and container_key != left:
                return mismatch()
            return schema.BOOL
        both_known = left in _SCALARS and right in _SCALARS
        if op in ("_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_"):
            if both_known and left != right:
                return mismatch()
            return schema.BOOL
        # arithmetic
        if both_known:
            if left != right:
                return mismatch()
            if left == schema.BOOL or (left in (schema.STRING, "bytes") and op != "_+_"):
                return mismatch()
            if op == "_%_" and left == schema.DOUBLE:
                return mismatch()
            return left
        if left == right and op == "_+_" and _list_elem(left) is not None:
            return left
        return left if left == right else schema.DYN

    def call(self, node: Call, bound: Mapping[str, str], depth: int) -> str:
        name = node.name
        if node.target is None:
            if name == "has":
                return self.has(node, bound, depth)
            if name not in GLOBAL_FUNCTIONS:
                for arg in node.args:
                    self.walk(arg, bound, depth)
                return self.fail(node.line, node.column, f"undeclared reference to '{name}'")
            for arg in node.args:
                self.walk(arg, bound, depth)
            return GLOBAL_FUNCTIONS[name]
        if name in COMPREHENSION_MACROS and len(node.args) in (2, 3) and isinstance(node.args[0], Ident):
            return self.comprehension(node, node.target, node.args[0], bound, depth)
        target = self.walk(node.target, bound, depth)
        args = [self.walk(arg, bound, depth) for arg in node.args]
        if name not in MEMBER_FUNCTIONS:
            return self.fail(node.line, node.column, f"undeclared reference to '{name}'")
        if name in ("contains", "startsWith", "endsWith", "matches") and (
            (target in _SCALARS and target != schema.STRING)
            or any(a in _SCALARS and a != schema.STRING for a in args)
        ):
            signature = ", ".join([target, *args])
            return self.fail(
                node.line,
                node.column,
                f"found no matching overload for '{name}' applied to '({signature})'",
            )
        return MEMBER_FUNCTIONS[name]

    def has(self, node: Call, bound: Mapping[str, str], depth: int) -> str:
        if len(node.args) != 1 or not isinstance(node.args[0], Select):
            return self.fail(
                node.line, node.column, "has() takes one field selection, e.g. has(backend.labels.cell)"
            )
        selection = node.args[0]
        parts = _qualified(selection)
        if (
            parts is not None
            and parts[0][0] not in bound
            and ".".join(p[0] for p in parts) in schema.FIELDS_BY_PATH
        ):
            path = ".".join(p[0] for p in parts)
            return self.fail(
                node.line,
                node.column,
                f"has({path}): schema fields are always present; "
                "has() tests map keys, e.g. has(backend.labels.cell)",
            )
        operand = self.walk(selection.operand, bound, depth)
        if operand in _SCALARS or _list_elem(operand) is not None:
            return self.fail(node.line, node.column, f"has() needs a map operand; this one is a {operand}")
        return schema.BOOL

    def comprehension(
        self, node: Call, target: Node, variable: Ident, bound: Mapping[str, str], depth: int
    ) -> str:
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
        before, before_vars = set(self.reads), set(self.variables)
        range_type = self.walk(target, bound, depth)
        parts = _qualified(target)
        configured = False
        if parts is not None and parts[0][0] not in bound:
            path = ".".join(p[0] for p in parts)
            declared = schema.FIELDS_BY_PATH.get(path)
            configured = declared is not None and declared.origin == Origin.CONFIG
        if not configured and not _is_constant(target):
            origins = self.origins(before, before_vars)
            why = "a caller-controlled value" if Origin.CALLER in origins else "a computed value"
            self.fail(
                node.line,
                node.column,
                f"'{node.name}' ranges over {why}: comprehensions may only range over configured lists "
                "and maps (tenant.allowed_cells, route.fallback_classes, backend.labels ...) or constant "
                "literals, so that evaluation stays bounded",
            )
        elem = _list_elem(range_type)
        map_parts = _map_parts(range_type)
        elem_type = elem if elem is not None else map_parts[0] if map_parts is not None else schema.DYN
        inner = dict(bound)
        inner[variable.name] = elem_type
        body_types = [self.walk(arg, inner, depth + 1) for arg in node.args[1:]]
        if node.name in ("all", "exists", "exists_one"):
            return schema.BOOL
        if node.name == "map":
            return f"list({body_types[-1]})"
        return range_type


_LITERAL_TYPES: Mapping[str, str] = {
    "INT_LIT": schema.INT,
    "UINT_LIT": "uint",
    "FLOAT_LIT": schema.DOUBLE,
    "STRING_LIT": schema.STRING,
    "MLSTRING_LIT": schema.STRING,
    "BYTES_LIT": "bytes",
    "BOOL_LIT": schema.BOOL,
    "NULL_LIT": "null",
}


def analyze(text: str, scope: Scope) -> Analysis:
    """Check one expression; never raises for bad input (problems are returned)."""
    try:
        node = parse(text)
    except _Failed as failed:
        return Analysis(frozenset(), frozenset(), schema.DYN, (failed.problem,))
    checker = _Checker(scope)
    try:
        result_type = checker.walk(node, {}, 0)
    except RecursionError:
        checker.problems.append(
            Problem(1, 1, f"expression is too deeply nested (MAX_NESTING_DEPTH is {MAX_NESTING_DEPTH})")
        )
        result_type = schema.DYN
    return Analysis(
        frozenset(checker.reads),
        frozenset(checker.variables),
        result_type,
        tuple(sorted(set(checker.problems), key=lambda p: (p.line, p.column))),
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
