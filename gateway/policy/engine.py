"""CEL engines behind one small protocol, and the one type checker both use.

This module owns the two CEL implementations the policy core can run on, the
seam between them and the rest of the package, and the type checker:

- ``TypeChecker``: cel-cpp's own checker (``cel-expr-python``), given the
  schema's declared variables (``{dotted name: CEL type}``, from
  ``schema.FIELDS`` and the policy set's ``variables``). It is the only place
  expression types are decided: undeclared references, operand types
  (``budget.slack_ms < 0``), non-bool operands, unknown functions and
  overloads, selections on non-messages, and the result type the loader
  compares with what a condition, message or action must be. Its standard
  library is declared without the timestamp and duration functions
  (``EXCLUDED_FUNCTIONS``): nothing in the schema is a time, and the two
  engines print them differently.
- ``cel-expr`` (default): ``cel-expr-python``, Google's cel-cpp. Compiling is
  checking: the program comes out of the checker. Its one surprise: a runtime
  error (division by zero, missing map key, overflow) is *returned* as a value
  of type ``ERROR`` whose ``value()`` is the message, not raised.
  ``CelExprEngine`` detects that explicitly and raises ``EvaluationError`` -
  an ERROR value must never reach a rule as a result.
- ``cel-python``: ``celpy``, pure Python, about 50-100x slower. It has no
  checker of its own, so ``CelPythonEngine.compile`` runs the same
  ``TypeChecker`` first: lint reports the same problems, with the same types,
  on both engines. Results are still checked at runtime by the snapshot.

Checker errors come back as ``CompileProblem`` with 1-based (line, column)
inside the expression; cel-cpp places a field selection at its ``.`` and a
call at its ``(``, and those are moved to the name the author wrote.

Inputs are handed to ``bind`` as flat ``{dotted name: plain value}``
(``{"budget.slack_ms": 68.0}``); each engine builds its own activation.
Results come back as plain Python values. Engines hold no per-request state.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from gateway.policy import schema


class EvaluationError(Exception):
    """A CEL runtime error (or a result of the wrong type) during evaluation."""


class CompileProblem(Exception):
    """An engine rejected an expression. ``problems`` holds (line, column, message), 1-based."""

    def __init__(self, problems: list[tuple[int, int, str]]) -> None:
        super().__init__("; ".join(p[2] for p in problems))
        self.problems = problems


class CompiledExpression(Protocol):
    @property
    def result_type(self) -> str:
        """The checker's result type (``bool``, ``list(string)``); ``dyn`` when it is not static."""
        ...

    def evaluate(self, bindings: Any) -> Any:
        """Evaluate against ``Engine.bind`` output; raises ``EvaluationError``."""
        ...

    def evaluate_inputs(self, inputs: Mapping[str, Any]) -> Any:
        """Bind and evaluate once (cheaper than ``bind`` + ``evaluate`` for a single use)."""
        ...


class Engine(Protocol):
    name: str
    # Whether one whole-set expression (``snapshot.Plan``) beats one evaluation per rule.
    # True for cel-cpp (per-call overhead dominates); false for celpy, where the plan
    # evaluates every rule even after a deny and costs twice as much.
    prefers_plan: bool

    def compile(self, text: str, declarations: Mapping[str, str]) -> CompiledExpression:
        """Type-check ``text`` against ``{dotted name: CEL type}`` (``TypeChecker``) and compile it.

        Raises ``CompileProblem`` with every problem the checker found.
        """
        ...

    def bind(self, inputs: Mapping[str, Any]) -> Any:
        """An activation for flat ``{dotted name: plain value}`` inputs."""
        ...


# ---------------------------------------------------------------------------
# The type checker: cel-cpp's, for both engines
# ---------------------------------------------------------------------------

# cel-cpp standard-library functions left out of the policy dialect: no schema
# field is a timestamp or a duration, and the two engines disagree on them
# (``string(duration('1.5s'))`` is "1.500s" on cel-cpp, "1s" on celpy).
# Declared to the checker, so using one is its "undeclared reference", like any
# unknown function.
EXCLUDED_FUNCTIONS: tuple[str, ...] = (
    "timestamp",
    "duration",
    "getFullYear",
    "getMonth",
    "getDayOfYear",
    "getDayOfMonth",
    "getDate",
    "getDayOfWeek",
    "getHours",
    "getMinutes",
    "getSeconds",
    "getMilliseconds",
)

_CEL_ERROR = re.compile(r"ERROR: <input>:(\d+):(\d+): (.*)")
_IDENT_CHAR = re.compile(r"[_a-zA-Z0-9]")


def _to_schema_type(name: str) -> str:
    """cel-cpp type names (``LIST<STRING>``) -> schema notation (``list(string)``)."""
    name = name.strip()
    upper = name.upper()
    if upper.startswith("LIST<") and upper.endswith(">"):
        return f"list({_to_schema_type(name[5:-1])})"
    if upper.startswith("MAP<") and upper.endswith(">"):
        inner = name[4:-1]
        depth = 0
        for index, ch in enumerate(inner):
            if ch == "<":
                depth += 1
            elif ch == ">":
                depth -= 1
            elif ch == "," and depth == 0:
                return f"map({_to_schema_type(inner[:index])}, {_to_schema_type(inner[index + 1 :])})"
    simple = {
        "BOOL": "bool",
        "INT": "int",
        "UINT": "uint",
        "DOUBLE": "double",
        "STRING": "string",
        "BYTES": "bytes",
    }
    return simple.get(upper, schema.DYN)


class TypeChecker:
    """cel-cpp's type checker over declared variables: where every expression type is decided.

    One cel-cpp environment per distinct set of declarations (a policy set has
    two or three: with and without its variables, and the plan's), cached.
    """

    def __init__(self) -> None:
        from cel_expr_python import cel

        self._cel = cel
        exclusions = "".join(f"    - name: {name}\n" for name in EXCLUDED_FUNCTIONS)
        self._config = cel.NewEnvConfigFromYaml(f"stdlib:\n  exclude_functions:\n{exclusions}")
        self._envs: dict[tuple[tuple[str, str], ...], Any] = {}
        self._lock = threading.Lock()

    def _type(self, notation: str) -> Any:
        cel = self._cel
        simple = {
            "bool": cel.Type.BOOL,
            "int": cel.Type.INT,
            "uint": cel.Type.UINT,
            "double": cel.Type.DOUBLE,
            "string": cel.Type.STRING,
            "bytes": cel.Type.BYTES,
        }
        if notation in simple:
            return simple[notation]
        if notation.startswith("list(") and notation.endswith(")"):
            return cel.Type.List(self._type(notation[5:-1]))
        if notation.startswith("map(") and notation.endswith(")"):
            inner = notation[4:-1]
            depth = 0
            for index, ch in enumerate(inner):
                if ch == "(":
                    depth += 1
                elif ch == ")":
                    depth -= 1
                elif ch == "," and depth == 0:
                    return cel.Type.Map(
                        self._type(inner[:index].strip()), self._type(inner[index + 1 :].strip())
                    )
        return cel.Type.DYN

    def _env(self, declarations: Mapping[str, str]) -> Any:
        key = tuple(sorted(declarations.items()))
        with self._lock:
            env = self._envs.get(key)
            if env is None:
                env = self._cel.NewEnv(
                    config=self._config,
                    variables={name: self._type(t) for name, t in declarations.items()},
                )
                self._envs[key] = env
            return env

    def check(self, text: str, declarations: Mapping[str, str]) -> tuple[Any, str]:
        """(the checked cel-cpp expression, its result type); raises ``CompileProblem``."""
        try:
            expr = self._env(declarations).compile(text)
        except RuntimeError as exc:
            raise CompileProblem(_parse_cel_errors(str(exc), text)) from exc
        return expr, _to_schema_type(expr.return_type().name())


def _parse_cel_errors(message: str, text: str) -> list[tuple[int, int, str]]:
    problems: list[tuple[int, int, str]] = []
    for line in message.splitlines():
        match = _CEL_ERROR.search(line)
        if match:
            found = re.sub(r"\s*\[[A-Z_]+\]$", "", match.group(3)).strip()
            found = found.replace(" (in container '')", "")
            position = _at_name(text, int(match.group(1)), int(match.group(2)))
            problems.append((*position, found))
    if not problems:
        found = re.sub(
            r"^[A-Z_]+: ", "", message.strip().splitlines()[0] if message.strip() else "compile error"
        )
        problems.append((1, 1, re.sub(r"\s*\[[A-Z_]+\]$", "", found)))
    return problems


def _at_name(text: str, line: int, column: int) -> tuple[int, int]:
    """Move a cel-cpp position from a selection's ``.`` or a call's ``(`` to the name written there."""
    lines = text.split("\n")
    if not 1 <= line <= len(lines) or not 1 <= column <= len(lines[line - 1]):
        return line, column
    source = lines[line - 1]
    index = column - 1
    if source[index] == ".":  # request.tennant: point at 'tennant'
        after = index + 1
        while after < len(source) and source[after] in " \t":
            after += 1
        if after < len(source) and _IDENT_CHAR.match(source[after]):
            return line, after + 1
    elif source[index] == "(":  # foo(1), request.model.lower(): point at the function's name
        end = index
        while end > 0 and source[end - 1] in " \t":
            end -= 1
        start = end
        while start > 0 and _IDENT_CHAR.match(source[start - 1]):
            start -= 1
        if start < end:
            return line, start + 1
    return line, column


_CHECKER: TypeChecker | None = None
_CHECKER_LOCK = threading.Lock()


def get_checker() -> TypeChecker:
    """The shared ``TypeChecker``."""
    global _CHECKER
    with _CHECKER_LOCK:
        if _CHECKER is None:
            _CHECKER = TypeChecker()
        return _CHECKER


# ---------------------------------------------------------------------------
# cel-expr-python (cel-cpp)
# ---------------------------------------------------------------------------


class _CelExprExpression:
    __slots__ = ("_error_type", "_expr", "_plain", "_py", "result_type")

    def __init__(self, expr: Any, result_type: str, error_type: Any) -> None:
        self._expr = expr
        self.result_type = result_type
        self._error_type = error_type
        self._py: type | None = {"bool": bool, "int": int, "double": float}.get(result_type)
        self._plain = result_type.startswith(("list(", "map(")) or result_type == schema.DYN

    def evaluate_inputs(self, inputs: Mapping[str, Any]) -> Any:
        return self._result(self._expr.eval(data=inputs))

    def evaluate(self, bindings: Any) -> Any:
        return self._result(self._expr.eval(bindings))

    def _result(self, value: Any) -> Any:
        if self._plain:  # lists, maps, dyn: one conversion to plain Python values
            plain = value.plain_value()
            # Fast path: a list or a map is a result (an ERROR value's plain value is its message,
            # a str), so the type is asked only of anything else.
            if plain.__class__ is list or plain.__class__ is dict:
                return plain
            if value.type() == self._error_type:
                raise EvaluationError(str(value.value()))
            return plain
        result = value.value()
        # Fast path: a statically bool/int/double expression whose result has that
        # Python type cannot be an ERROR value (those carry a str message).
        if self._py is not None and result.__class__ is self._py:
            return result
        if value.type() == self._error_type:
            raise EvaluationError(str(result))
        if self._py is not None:  # pragma: no cover - checker guarantees the type
            raise EvaluationError(f"expected {self.result_type}, got {value.type().name().lower()}")
        return result


class CelExprEngine:
    """The default engine: cel-expr-python (cel-cpp); its program is the checker's output."""

    name = "cel-expr"
    prefers_plan = True

    def __init__(self) -> None:
        from cel_expr_python import cel

        self._checker = get_checker()
        self._error_type = cel.Type.ERROR
        self._bind_env = cel.NewEnv(variables={})

    def compile(self, text: str, declarations: Mapping[str, str]) -> CompiledExpression:
        expr, result_type = self._checker.check(text, declarations)
        return _CelExprExpression(expr, result_type, self._error_type)

    def bind(self, inputs: Mapping[str, Any]) -> Any:
        return self._bind_env.Activation(inputs)


# ---------------------------------------------------------------------------
# cel-python (celpy)
# ---------------------------------------------------------------------------


class _CelPythonExpression:
    __slots__ = ("_program", "result_type")

    def __init__(self, program: Any, result_type: str) -> None:
        self._program = program
        self.result_type = result_type

    def evaluate_inputs(self, inputs: Mapping[str, Any]) -> Any:
        return self.evaluate({name: _to_celpy(value) for name, value in schema.nest(inputs).items()})

    def evaluate(self, bindings: Any) -> Any:
        try:
            result = self._program.evaluate(bindings)
        except Exception as exc:  # celpy raises CELEvalError and, at times, bare Python errors
            raise EvaluationError(_celpy_message(exc)) from exc
        return _from_celpy(result)


def _celpy_message(exc: Exception) -> str:
    args = getattr(exc, "args", ())
    if args and isinstance(args[0], str):
        return args[0]
    return f"{type(exc).__name__}: {exc}"


def _from_celpy(value: Any) -> Any:
    from celpy import celtypes

    if isinstance(value, Exception):
        raise EvaluationError(_celpy_message(value))
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, celtypes.IntType | celtypes.UintType):
        return int(value)
    if isinstance(value, celtypes.DoubleType):
        return float(value)
    if isinstance(value, celtypes.StringType):
        return str(value)
    if isinstance(value, celtypes.ListType):
        return [_from_celpy(item) for item in value]
    if isinstance(value, celtypes.MapType):
        return {_from_celpy(k): _from_celpy(v) for k, v in value.items()}
    return value


class CelPythonEngine:
    """The pure-Python engine (celpy). It has no checker: ``TypeChecker`` checks for it."""

    name = "cel-python"
    prefers_plan = False

    def __init__(self) -> None:
        import celpy

        self._checker = get_checker()
        self._env = celpy.Environment()

    def compile(self, text: str, declarations: Mapping[str, str]) -> CompiledExpression:
        from celpy.celparser import CELParseError

        _, result_type = self._checker.check(text, declarations)
        try:
            ast = self._env.compile(text)
            program = self._env.program(ast)
        except CELParseError as exc:
            line = getattr(exc, "line", None) or 1
            column = getattr(exc, "column", None) or 1
            raise CompileProblem([(int(line), int(column), "syntax error")]) from exc
        except Exception as exc:
            raise CompileProblem([(1, 1, f"cel-python cannot compile this expression: {exc}")]) from exc
        return _CelPythonExpression(program, result_type)

    def bind(self, inputs: Mapping[str, Any]) -> Any:
        return {name: _to_celpy(value) for name, value in schema.nest(inputs).items()}


def _to_celpy(value: Any) -> Any:
    from celpy import celtypes

    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, Mapping):
        return celtypes.MapType({celtypes.StringType(str(k)): _to_celpy(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return celtypes.ListType([_to_celpy(v) for v in value])
    return value


# ---------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------

ENGINE_NAMES: tuple[str, ...] = ("cel-expr", "cel-python")
DEFAULT_ENGINE = "cel-expr"
_ENGINES: dict[str, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def get_engine(name: str = DEFAULT_ENGINE) -> Engine:
    """The shared engine instance for ``name`` (``cel-expr`` or ``cel-python``)."""
    with _ENGINES_LOCK:
        engine = _ENGINES.get(name)
        if engine is None:
            if name == "cel-expr":
                engine = CelExprEngine()
            elif name == "cel-python":
                engine = CelPythonEngine()
            else:
                raise ValueError(f"unknown CEL engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
            _ENGINES[name] = engine
        return engine
