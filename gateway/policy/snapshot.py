"""The compiled, immutable policy set and its evaluation.

This module owns ``PolicySnapshot.evaluate``: the one place that decides what a
policy set says about one request. What it says, ``PolicyResult`` (with ``RuleError`` and
``FailOpen``), is a plain value of the decision core (``gateway.core.policy_result``),
which admission reads; it is re-exported here. It is
pure: no I/O, no metrics, no logging, no clock. ``eval_us`` is measured only
when the caller hands in a ``timer`` (the runtime's ``PolicyStore`` passes
``time.perf_counter_ns``); otherwise it is 0.

Theory of operation (the stage table is in ``model``):

1. Read only the schema fields conditions and variables use, as plain values
   (fields only messages, retry-afters and limits use are read when needed).
2. Fast path (cel-expr): evaluate the ``Plan``s - every variable and condition
   in at most two CEL evaluations, one of them memoised on the stable inputs
   it reads (tenant, route, identity: the same for every request of one
   tenant, route and class) - and act on the rules that fired. Each plan reads
   just its own inputs (step 1's fields are read only if a fired rule's
   message, retry-after or limit needs them). When no enforce deny or limit
   fired, what the main rules decide depends on which fired alone, and is
   memoised per fired set (``_Settled``). If a plan errs, or when explaining,
   go one expression at a time, as below; the outcome is the same, only the
   error attribution needs the slow path.
3. Variables once, in dependency order. A variable that errs poisons every
   rule that reads it (that rule errs).
4. privacy -> admission -> quota, rules in file order. The first enforce deny
   that fires (or a fail-closed error) stops everything after it. Shadow rules
   that fire are reported in ``shadow_fired`` and change nothing.
5. fallback: eligible iff at least one enforce ``fallback_eligible`` fired, no
   enforce ``fallback_ineligible`` fired, and no enforce fallback rule erred.
6. routing: every rule once per ``context.backends`` entry, with ``backend.*``
   bound to it; a firing or erring enforce rule excludes that backend.

Every error lands in ``errors``; every error that let a request through an
``on_error: allow`` rule also lands in ``fail_open``, which the decision log
must carry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

from gateway.core.policy_result import FailOpen as FailOpen
from gateway.core.policy_result import PolicyResult as PolicyResult
from gateway.core.policy_result import RuleError as RuleError
from gateway.core.record import RequestRecord
from gateway.policy import schema
from gateway.policy.engine import CompiledExpression, Engine, EvaluationError
from gateway.policy.model import (
    FAIL_CLOSED_STATUS,
    PRIVACY_FAIL_CLOSED_STATUS,
    STAGE_ORDER,
    ActionKind,
    OnError,
    Rule,
    Stage,
    Variable,
)
from gateway.policy.schema import BackendFacts, PolicyContext


@dataclass(frozen=True, slots=True)
class RuleTrace:
    """One rule evaluation, for ``policy explain``."""

    rule: str
    stage: str
    mode: str
    action: str
    result: str  # "fired" | "not fired" | "error" | "skipped"
    inputs: tuple[tuple[str, Any], ...] = ()
    backend: str = ""
    error: str = ""
    effect: str = ""


@dataclass(frozen=True, slots=True)
class VariableTrace:
    name: str
    value: Any
    error: str = ""


@dataclass(frozen=True, slots=True)
class Explanation:
    result: PolicyResult
    variables: tuple[VariableTrace, ...]
    rules: tuple[RuleTrace, ...]


@dataclass
class _Trace:
    variables: list[VariableTrace] = field(default_factory=list)
    rules: list[RuleTrace] = field(default_factory=list)


class _Denial:
    __slots__ = ("message", "retry_after_ms", "rule", "status")

    def __init__(self, status: str, rule: str, message: str, retry_after_ms: int | None) -> None:
        self.status = status
        self.rule = rule
        self.message = message
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True, slots=True)
class _Settled:
    """What the main rules decide when the plans say which conditions held and no enforce deny or
    limit is among them (those evaluate a message, retry-after or limit from the request's inputs):
    a function of the fired set alone, so each snapshot memoises it (``_settled``)."""

    rules_fired: tuple[str, ...]
    shadow_fired: tuple[str, ...]
    fallback_eligible: bool  # an enforce fallback_eligible fired and no fallback_ineligible
    annotations: tuple[tuple[str, str], ...]


def _settle(rules: Sequence[Rule]) -> _Settled | None:
    """``_run``'s main-rule loop for ``rules``, every one of which fired without error, in
    evaluation order; ``None`` where an enforce deny or limit fired (``_run`` acts on it)."""
    rules_fired: list[str] = []
    shadow_fired: list[str] = []
    annotations: dict[str, str] = {}
    eligible = vetoed = False
    for rule in rules:
        if rule.shadow:
            shadow_fired.append(rule.id)
            continue
        kind = rule.action.kind
        if kind is ActionKind.DENY or kind is ActionKind.LIMIT:
            return None
        rules_fired.append(rule.id)
        if kind is ActionKind.FALLBACK_ELIGIBLE:
            eligible = True
        elif kind is ActionKind.FALLBACK_INELIGIBLE:
            vetoed = True
        else:
            annotations.update(rule.action.annotations)
    return _Settled(
        tuple(rules_fired), tuple(shadow_fired), eligible and not vetoed, tuple(annotations.items())
    )


def _fail_closed_message(rule_id: str) -> str:
    return f"request denied: policy rule '{rule_id}' could not be evaluated"


BACKENDS_VARIABLE = "candidate_backends"


@dataclass(frozen=True, slots=True)
class Plan:
    """Part of the policy set as one CEL expression: one activation, one evaluation.

    The loader builds at most two from the already-checked rule texts::

        [{"v1": (e1), ...}].map(variables,
          [variables, [(c1), (c2), ...],
           candidate_backends.map(backend, [(r1), ...])])[0]

    - its variables as a map, its non-routing conditions (``conditions``: their places among
      the main rules, in evaluation order) and, when ``routing``, per candidate backend the
      routing conditions (otherwise ``[]``). The one-element ``map`` binds ``variables``
      (standard CEL, no extension needed), so both engines run the same plan. CEL is pure, so
      each element equals that expression evaluated alone; if anything errs the plan errs,
      and evaluation falls back to one expression at a time, which attributes the error to its
      rule. ``explain`` always goes one at a time. Only built when no variable reads another
      variable and the engine ``prefers_plan`` (cel-expr: yes; cel-python: no, the plan costs
      it twice as much).

    ``cached``: the plan reads only inputs that are stable between requests
    (``schema.volatile``: tenant and route configuration, identity, warmth, evidence), so
    its result is memoised on the values it reads (``reads``, and when ``routing`` each
    candidate backend's name, model and labels). The memo is exact: the same inputs give the
    same result. The other plan runs for every request with just the inputs it reads.
    """

    expression: CompiledExpression
    variable_names: tuple[str, ...]
    conditions: tuple[int, ...] = ()  # the main rules (evaluation order) its conditions decide
    routing: bool = False  # it evaluates the routing rules per candidate backend
    reads: tuple[str, ...] = ()  # the request-scoped schema paths it reads
    cached: bool = False  # memoised on ``reads`` (and the backends): see above

    # The ``reads``' values as a hashable tuple (``schema.key_reader``; through ``_frozen`` if a
    # container is not a list of strings): the cached plan's memo key.
    read_key: Callable[[RequestRecord, PolicyContext], tuple[Any, ...]] = field(init=False)
    # The same values as ``{path: value}`` (``schema.dict_reader``): what the CEL expression reads.
    read_data: Callable[[RequestRecord, PolicyContext], dict[str, Any]] = field(init=False)
    variable_keys: tuple[str, ...] = field(init=False)  # ``variables.<name>`` per variable name
    variable_set: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        plain = all(
            not cel_type.startswith(_CONTAINERS) or cel_type == schema.LIST_STRING
            for cel_type in (schema.FIELDS_BY_PATH[path].cel_type for path in self.reads)
        )
        read_key = schema.key_reader(self.reads) if plain else _frozen_reader(schema.reader(self.reads))
        object.__setattr__(self, "read_key", read_key)
        object.__setattr__(self, "read_data", schema.dict_reader(self.reads))
        object.__setattr__(self, "variable_keys", tuple(f"variables.{name}" for name in self.variable_names))
        object.__setattr__(self, "variable_set", frozenset(self.variable_names))


_CONTAINERS = ("list(", "map(")

# The memo of a snapshot's cached plan holds at most this many results (tenant x route x class x
# the few stable facts that change, such as warmth and evidence); it starts over when full.
_MEMO_LIMIT = 4096

# A plan's result: its variables' values (in ``Plan.variable_names`` order), the places among the
# main rules of its conditions that held (ascending), and per candidate backend its routing
# conditions (``[]`` when it has none).
_Planned = tuple[tuple[Any, ...], tuple[int, ...], list[list[bool]]]


def _frozen_reader(
    read: Callable[[RequestRecord, PolicyContext], list[Any]],
) -> Callable[[RequestRecord, PolicyContext], tuple[Any, ...]]:
    return lambda record, context: tuple(map(_frozen, read(record, context)))


def _frozen(value: Any) -> Any:
    """``value`` as a hashable memo key part (lists and maps of plain values)."""
    if isinstance(value, list):
        plain = tuple(value)
        try:
            hash(plain)  # a list of plain values (the usual: names from configuration) is its tuple
        except TypeError:
            return tuple(_frozen(v) for v in value)
        return plain
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


class _Bindings:
    """Activations over ``inputs``, built only when needed.

    ``full`` binds every input (rule-by-rule evaluation). ``for_rule`` binds
    just what one rule reads, for the message / retry-after / limit of a rule
    that fired after the plan: a few entries instead of all of them. Once a
    full activation exists it is reused.
    """

    __slots__ = ("_complete", "_engine", "_full", "_inputs", "_rule_keys")

    def __init__(
        self,
        engine: Engine,
        inputs: dict[str, Any],
        rule_keys: Mapping[str, tuple[str, ...]],
        complete: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._inputs = inputs
        self._rule_keys = rule_keys
        self._complete = complete  # reads the fields only messages/limits use into ``inputs``
        self._full: Any = None

    def full(self) -> Any:
        if self._full is None:
            self._complete()
            self._full = self._engine.bind(self._inputs)
        return self._full

    def for_rule(self, rule: Rule) -> Any:
        if self._full is not None:
            return self._full
        self._complete()
        inputs = self._inputs
        return self._engine.bind({key: inputs[key] for key in self._rule_keys[rule.id] if key in inputs})


class PolicySnapshot:
    """An immutable, compiled policy set. Build with ``loader``; share freely across tasks."""

    __slots__ = (
        "_backend_keys",
        "_backend_readers",
        "_by_id",
        "_engine",
        "_files",
        "_label",
        "_main_rules",
        "_memo",
        "_plan_backend_readers",
        "_plans",
        "_read_all",
        "_read_early",
        "_read_late",
        "_routing_keys",
        "_routing_rules",
        "_rule_keys",
        "_rules",
        "_settled_memo",
        "_stages",
        "_variable_keys",
        "_variables",
        "_version",
    )

    def __init__(
        self,
        *,
        version: str,
        label: str,
        engine: Engine,
        rules: Sequence[Rule],
        variables: Sequence[Variable],
        files: Sequence[str],
        plans: Sequence[Plan] = (),
    ) -> None:
        self._version = version
        self._label = label
        self._engine = engine
        self._rules = tuple(rules)
        self._variables = tuple(variables)
        self._files = tuple(files)
        self._plans = tuple(plans)
        self._memo: dict[tuple[Any, ...], _Planned] = {}
        self._settled_memo: dict[tuple[int, ...], _Settled | None] = {}
        self._backend_keys: dict[int, tuple[tuple[BackendFacts, ...], tuple[Any, ...]]] = {}
        self._by_id = {rule.id: rule for rule in self._rules}
        self._stages: dict[Stage, tuple[Rule, ...]] = {
            stage: tuple(rule for rule in self._rules if rule.stage is stage) for stage in Stage
        }
        self._routing_rules = self._stages[Stage.ROUTING]
        # Every rule but routing, in evaluation order (the plan's condition list has this order).
        self._main_rules = tuple(
            rule for stage in STAGE_ORDER if stage is not Stage.ROUTING for rule in self._stages[stage]
        )
        self._rule_keys = {
            rule.id: (
                *(path for path in rule.reads if not schema.FIELDS_BY_PATH[path].per_backend),
                *(f"variables.{name}" for name in rule.uses),
            )
            for rule in self._rules
        }
        # What conditions and variables read is read up front; what only messages,
        # retry-after and limits read is read when one of those is evaluated.
        reads: set[str] = set()
        decides: set[str] = set()
        for rule in self._rules:
            reads.update(rule.reads)
            decides.update(rule.condition_reads)
        for variable in self._variables:
            reads.update(variable.reads)
            decides.update(variable.reads)
        early = [f.path for f in schema.FIELDS if f.path in decides and f.read is not None]
        late = [f.path for f in schema.FIELDS if f.path in reads - decides and f.read is not None]
        self._read_early = schema.dict_reader(early)
        # ``_read_late``'s first field (``None``: no field) is in a request's inputs once read.
        self._read_late = (late[0], schema.dict_reader(late)) if late else None
        self._read_all = (early[0], schema.dict_reader(early + late)) if early else self._read_late
        self._variable_keys = tuple(
            (var, (*var.reads, *(f"variables.{name}" for name in var.uses))) for var in self._variables
        )
        routing_keys: set[str] = set()
        backend_reads: set[str] = set()
        for rule in self._stages[Stage.ROUTING]:
            for path in rule.reads:
                (backend_reads if schema.FIELDS_BY_PATH[path].per_backend else routing_keys).add(path)
            routing_keys.update(f"variables.{name}" for name in rule.uses)
        self._routing_keys = tuple(sorted(routing_keys))
        self._backend_readers = tuple(
            (f.path, f.read_backend)
            for f in schema.FIELDS
            if f.path in backend_reads and f.read_backend is not None
        )
        self._plan_backend_readers = tuple(
            (path.split(".", 1)[1], read) for path, read in self._backend_readers
        )

    # -- identity ------------------------------------------------------------

    @property
    def version(self) -> str:
        """Content hash of the policy files, ``sha256:`` + 12 hex. Stamped on every decision."""
        return self._version

    @property
    def label(self) -> str:
        """The author's label from ``policy.yaml`` ("" when none)."""
        return self._label

    @property
    def display_version(self) -> str:
        return f"{self._label} ({self._version})" if self._label else self._version

    @property
    def engine_name(self) -> str:
        return self._engine.name

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self._rules

    @property
    def variables(self) -> tuple[Variable, ...]:
        return self._variables

    @property
    def files(self) -> tuple[str, ...]:
        return self._files

    @property
    def planned(self) -> bool:
        """Whether evaluation has the plan fast path (see ``Plan``)."""
        return bool(self._plans)

    @property
    def memoised(self) -> int:
        """Results the cached plan holds (one per distinct set of stable inputs seen)."""
        return len(self._memo)

    def clear_memo(self) -> None:
        """Forget the cached plan's results: the next requests pay for it again (what a first
        request of a tenant, route and class costs; ``bench/policy_eval.py`` measures it)."""
        self._memo.clear()

    def rule(self, rule_id: str) -> Rule:
        return self._by_id[rule_id]

    # -- evaluation ----------------------------------------------------------

    def evaluate(
        self, record: RequestRecord, context: PolicyContext, *, timer: Callable[[], int] | None = None
    ) -> PolicyResult:
        """Decide one request. Pure; safe to call concurrently."""
        return self._run(record, context, None, timer)

    def explain(
        self, record: RequestRecord, context: PolicyContext, *, timer: Callable[[], int] | None = None
    ) -> Explanation:
        """``evaluate`` plus every rule's inputs, result and error (always one rule at a time)."""
        trace = _Trace()
        result = self._run(record, context, trace, timer)
        return Explanation(result, tuple(trace.variables), tuple(trace.rules))

    def _run_plans(
        self, record: RequestRecord, context: PolicyContext
    ) -> tuple[list[int], list[list[bool]], list[tuple[tuple[str, ...], tuple[Any, ...]]]] | None:
        """Evaluate the plans (the cached one from its memo when it has these inputs); on success
        answer the places (among the main rules, ascending: evaluation order) of the conditions
        that held, per backend the routing conditions, and per plan its variables' input names
        (``variables.<name>``) and values. ``None``: go one at a time.

        Each plan reads its own inputs straight from the record and context with the schema's
        readers (``Plan.read_key``, ``Plan.read_data``): the same values ``_run`` would read into
        ``inputs``, without reading the fields only rules that did not fire need."""
        fired: list[int] = []
        routing: list[list[bool]] | None = None
        variables: list[tuple[tuple[str, ...], tuple[Any, ...]]] = []
        for plan in self._plans:
            planned: _Planned | None
            if plan.cached:
                # The values it reads (lists as tuples) and every backend fact, not only what the
                # routing rules read: exact all the same.
                key = (
                    plan.read_key(record, context),
                    self._backends_key(context.backends) if plan.routing else (),
                )
                planned = self._memo.get(key)
                if planned is None:
                    planned = self._evaluate_plan(plan, plan.read_data(record, context), context)
                    if planned is None:
                        return None
                    if len(self._memo) >= _MEMO_LIMIT:
                        self._memo.clear()
                    self._memo[key] = planned
            else:
                planned = self._evaluate_plan(plan, plan.read_data(record, context), context)
                if planned is None:
                    return None
            values, held, per_backend = planned
            fired += held
            if plan.routing:
                routing = per_backend
            if values:
                variables.append((plan.variable_keys, values))
        if len(self._plans) > 1:
            fired.sort()
        return fired, routing if routing is not None else [[] for _ in context.backends], variables

    def _backends_key(self, backends: tuple[BackendFacts, ...]) -> tuple[Any, ...]:
        """The backends' part of the memo key. A route's backend facts are one tuple built once
        per route and cell (``gateway.chain.judge``), so the key is derived once per tuple (held,
        so its id cannot be reused while the entry lives)."""
        held = self._backend_keys.get(id(backends))
        if held is not None and held[0] is backends:
            return held[1]
        key = tuple([(b.name, b.model, tuple(b.labels.items())) for b in backends])
        if len(self._backend_keys) >= _MEMO_LIMIT:
            self._backend_keys.clear()
        self._backend_keys[id(backends)] = (backends, key)
        return key

    def _evaluate_plan(self, plan: Plan, data: dict[str, Any], context: PolicyContext) -> _Planned | None:
        """One plan's variables (in ``plan.variable_names`` order), the places of its conditions
        that held and its routing conditions, from ``data`` (its ``reads``); ``None`` if it erred
        or returned something malformed (a dyn-typed condition could yield anything)."""
        if plan.routing:
            readers = self._plan_backend_readers
            data[BACKENDS_VARIABLE] = [{key: read(b) for key, read in readers} for b in context.backends]
        try:
            out = plan.expression.evaluate_inputs(data)
        except EvaluationError:
            return None
        if not isinstance(out, list) or len(out) != 3:
            return None
        values, conditions, routing = out
        if not isinstance(values, dict) or not _bools(conditions, len(plan.conditions)):
            return None
        if not values.keys() >= plan.variable_set:
            return None
        variables = tuple(map(values.__getitem__, plan.variable_names))
        held = tuple(compress(plan.conditions, conditions))  # the places of those that held
        if not plan.routing:
            return (variables, held, []) if routing == [] else None
        if not isinstance(routing, list) or len(routing) != len(context.backends):
            return None
        width = len(self._routing_rules)
        for per_backend in routing:
            if not _bools(per_backend, width):
                return None
        return variables, held, routing

    def _run(
        self,
        record: RequestRecord,
        context: PolicyContext,
        trace: _Trace | None,
        timer: Callable[[], int] | None,
    ) -> PolicyResult:
        started = timer() if timer is not None else 0
        inputs: dict[str, Any] = {}

        fired_conditions: list[int] | None = None  # with the plans: the main rules that fired
        routing_conditions: list[list[bool]] | None = None
        variable_errors: dict[str, str] = {}
        if trace is None and self._plans:
            planned = self._run_plans(record, context)
            if planned is not None:
                fired_conditions, routing_conditions, variables = planned
                settled = self._settled(fired_conditions)
                if settled is not None:
                    return self._settled_result(settled, context, routing_conditions, started, timer)
                for names, values in variables:  # a fired rule's message or limit may read them
                    inputs.update(zip(names, values, strict=True))
        if fired_conditions is None:
            inputs.update(self._read_early(record, context))
            self._variables_one_by_one(inputs, variable_errors, trace)
            late = self._read_late
        else:
            # The plans read their own inputs: the fields conditions and variables read are read
            # here only when a fired rule's message, retry-after or limit needs them.
            late = self._read_all

        def complete() -> None:
            if late is not None and late[0] not in inputs:
                inputs.update(late[1](record, context))

        if trace is not None:
            complete()  # explain shows every value a rule reads
        bindings = _Bindings(self._engine, inputs, self._rule_keys, complete)

        rules_fired: list[str] = []
        shadow_fired: list[str] = []
        errors: list[RuleError] = []
        fail_open: list[FailOpen] = []
        annotations: dict[str, str] = {}
        limit: int | None = None
        denial: _Denial | None = None
        eligible = False
        vetoed = False

        # With the plan's results only the rules that fired need any work: a rule whose
        # condition is false (and did not err) has no effect. Without them, every rule.
        rules = self._main_rules
        order = range(len(rules)) if fired_conditions is None else fired_conditions
        for index in order:
            rule = rules[index]
            if denial is not None:
                if trace is not None:
                    trace.rules.append(_skipped(rule, denial.rule))
                continue
            stage = rule.stage
            error = ""
            fired = True
            if fired_conditions is None:
                try:
                    fired = _condition(rule, bindings.full(), variable_errors)
                except EvaluationError as exc:
                    error = str(exc)
            effect = ""
            if error:
                errors.append(RuleError(rule.id, stage, error, shadow=rule.shadow))
                if rule.shadow:
                    effect = "shadow: error ignored"
                elif stage is Stage.FALLBACK:
                    vetoed = True
                    effect = "error: not eligible"
                elif stage is Stage.PRIVACY or rule.on_error is OnError.DENY:
                    status = (
                        rule.action.status
                        if rule.action.kind is ActionKind.DENY
                        else PRIVACY_FAIL_CLOSED_STATUS
                        if stage is Stage.PRIVACY
                        else FAIL_CLOSED_STATUS
                    )
                    denial = _Denial(status, rule.id, _fail_closed_message(rule.id), None)
                    effect = f"fail closed: deny {status}"
                else:
                    fail_open.append(FailOpen(rule.id, error))
                    effect = "fail open: on_error allow"
            elif fired and rule.shadow:
                shadow_fired.append(rule.id)
                effect = f"shadow: would {rule.action.describe()}"
            elif fired:
                kind = rule.action.kind
                if kind is ActionKind.DENY:
                    rules_fired.append(rule.id)
                    denial = self._deny(rule, bindings.for_rule(rule), errors)
                    effect = f"deny {denial.status}"
                elif kind is ActionKind.LIMIT:
                    try:
                        value = _int_result(
                            rule.action.max_output_tokens, bindings.for_rule(rule), "max_output_tokens"
                        )
                        if value < 0:
                            raise EvaluationError(f"max_output_tokens must be >= 0, got {value}")
                    except EvaluationError as exc:
                        error = str(exc)
                        errors.append(RuleError(rule.id, stage, error))
                        if rule.on_error is OnError.ALLOW:
                            fail_open.append(FailOpen(rule.id, error))
                            effect = "fail open: on_error allow"
                        else:
                            denial = _Denial(FAIL_CLOSED_STATUS, rule.id, _fail_closed_message(rule.id), None)
                            effect = f"fail closed: deny {FAIL_CLOSED_STATUS}"
                    else:
                        rules_fired.append(rule.id)
                        limit = value if limit is None else min(limit, value)
                        effect = f"limit max_output_tokens={value}"
                elif kind is ActionKind.FALLBACK_ELIGIBLE:
                    rules_fired.append(rule.id)
                    eligible = True
                    effect = "eligible"
                elif kind is ActionKind.FALLBACK_INELIGIBLE:
                    rules_fired.append(rule.id)
                    vetoed = True
                    effect = "not eligible"
                else:
                    rules_fired.append(rule.id)
                    annotations.update(rule.action.annotations)
                    effect = rule.action.describe()
            if trace is not None:
                trace.rules.append(_traced(rule, inputs, fired, error, effect))

        excluded: list[str] = []
        if denial is None:
            if self._routing_rules:
                self._routing(
                    context,
                    inputs,
                    variable_errors,
                    routing_conditions,
                    rules_fired,
                    shadow_fired,
                    errors,
                    excluded,
                    trace,
                )
        elif trace is not None:
            trace.rules.extend(_skipped(rule, denial.rule) for rule in self._routing_rules)

        eval_us = (timer() - started) / 1000.0 if timer is not None else 0.0
        if denial is not None:
            return PolicyResult(
                policy_version=self._version,
                allowed=False,
                status=denial.status,
                rule=denial.rule,
                message=denial.message,
                retry_after_ms=denial.retry_after_ms,
                rules_fired=tuple(rules_fired),
                shadow_fired=tuple(shadow_fired),
                annotations=tuple(annotations.items()),
                max_output_tokens=limit,
                fail_open=tuple(fail_open),
                errors=tuple(errors),
                eval_us=eval_us,
            )
        return PolicyResult(
            policy_version=self._version,
            allowed=True,
            rules_fired=tuple(rules_fired),
            shadow_fired=tuple(shadow_fired),
            fallback_eligible=eligible and not vetoed,
            excluded_backends=tuple(excluded),
            max_output_tokens=limit,
            annotations=tuple(annotations.items()),
            fail_open=tuple(fail_open),
            errors=tuple(errors),
            eval_us=eval_us,
        )

    def _settled(self, fired: list[int]) -> _Settled | None:
        """``_settle`` for the main rules at ``fired``, memoised (the rules never change)."""
        key = tuple(fired)
        try:
            return self._settled_memo[key]
        except KeyError:
            pass
        settled = _settle([self._main_rules[index] for index in key])
        if len(self._settled_memo) >= _MEMO_LIMIT:
            self._settled_memo.clear()
        self._settled_memo[key] = settled
        return settled

    def _settled_result(
        self,
        settled: _Settled,
        context: PolicyContext,
        routing_conditions: list[list[bool]],
        started: int,
        timer: Callable[[], int] | None,
    ) -> PolicyResult:
        """``_run``'s result where the plans decided and the main rules settled (no denial, no
        limit, no error): only the routing rules that held are acted on, as ``_run`` does."""
        rules_fired = settled.rules_fired
        shadow_fired = settled.shadow_fired
        excluded: list[str] = []
        if self._routing_rules and any(True in hits for hits in routing_conditions):
            fired, shadows = list(rules_fired), list(shadow_fired)
            self._routing(context, {}, {}, routing_conditions, fired, shadows, [], excluded, None)
            rules_fired, shadow_fired = tuple(fired), tuple(shadows)
        return PolicyResult(
            policy_version=self._version,
            allowed=True,
            rules_fired=rules_fired,
            shadow_fired=shadow_fired,
            fallback_eligible=settled.fallback_eligible,
            excluded_backends=tuple(excluded),
            max_output_tokens=None,
            annotations=settled.annotations,
            eval_us=(timer() - started) / 1000.0 if timer is not None else 0.0,
        )

    def _variables_one_by_one(
        self, inputs: dict[str, Any], variable_errors: dict[str, str], trace: _Trace | None
    ) -> None:
        engine = self._engine
        for variable, keys in self._variable_keys:
            failed = next((name for name in variable.uses if name in variable_errors), None)
            if failed is not None:
                variable_errors[variable.name] = f"variable '{failed}' failed"
            else:
                try:
                    value = variable.expression.evaluate(engine.bind({key: inputs[key] for key in keys}))
                    inputs[f"variables.{variable.name}"] = value
                except EvaluationError as exc:
                    variable_errors[variable.name] = str(exc)
            if trace is not None:
                trace.variables.append(
                    VariableTrace(
                        variable.name,
                        _plain(inputs.get(f"variables.{variable.name}")),
                        variable_errors.get(variable.name, ""),
                    )
                )

    def _deny(self, rule: Rule, bindings: Any, errors: list[RuleError]) -> _Denial:
        message = f"denied by policy rule '{rule.id}'"
        if rule.message is not None:
            try:
                message = _string_result(rule.message, bindings)
            except EvaluationError as exc:
                errors.append(RuleError(rule.id, rule.stage, f"message: {exc}"))
        retry_after_ms: int | None = None
        if rule.action.retry_after_ms is not None:
            try:
                retry_after_ms = max(0, _int_result(rule.action.retry_after_ms, bindings, "retry_after_ms"))
            except EvaluationError as exc:
                errors.append(RuleError(rule.id, rule.stage, f"retry_after_ms: {exc}"))
        return _Denial(rule.action.status, rule.id, message, retry_after_ms)

    def _routing(
        self,
        context: PolicyContext,
        inputs: Mapping[str, Any],
        variable_errors: Mapping[str, str],
        planned: list[list[bool]] | None,
        rules_fired: list[str],
        shadow_fired: list[str],
        errors: list[RuleError],
        excluded: list[str],
        trace: _Trace | None,
    ) -> None:
        engine = self._engine
        rules = self._routing_rules
        base = {key: inputs[key] for key in self._routing_keys if key in inputs} if planned is None else {}
        for number, backend in enumerate(context.backends):
            backend_inputs: dict[str, Any] = {}
            bindings: Any = None
            if planned is None:
                backend_inputs = dict(base)
                for path, read in self._backend_readers:
                    backend_inputs[path] = read(backend)
                bindings = engine.bind(backend_inputs)
                order: Sequence[int] = range(len(rules))
            elif True not in planned[number]:
                continue  # no routing condition held for this backend: nothing to do
            else:
                order = [i for i, hit in enumerate(planned[number]) if hit]
            exclude = False
            for index in order:
                rule = rules[index]
                error = ""
                fired = True
                if planned is None:
                    try:
                        fired = _condition(rule, bindings, variable_errors)
                    except EvaluationError as exc:
                        error = str(exc)
                effect = ""
                if error:
                    errors.append(
                        RuleError(rule.id, Stage.ROUTING, error, backend=backend.name, shadow=rule.shadow)
                    )
                    if rule.shadow:
                        effect = "shadow: error ignored"
                    else:
                        exclude = True
                        effect = f"error: exclude {backend.name}"
                elif fired and rule.shadow:
                    if rule.id not in shadow_fired:
                        shadow_fired.append(rule.id)
                    effect = f"shadow: would exclude {backend.name}"
                elif fired:
                    if rule.id not in rules_fired:
                        rules_fired.append(rule.id)
                    exclude = True
                    effect = f"exclude {backend.name}"
                if trace is not None:
                    trace.rules.append(_traced(rule, backend_inputs, fired, error, effect, backend))
            if exclude:
                excluded.append(backend.name)


_BOOL = {bool}


def _bools(values: Any, width: int) -> bool:
    """A list of exactly ``width`` bools (a dyn-typed condition could yield anything)."""
    if not isinstance(values, list) or len(values) != width:
        return False
    return not values or set(map(type, values)) == _BOOL


def _condition(rule: Rule, bindings: Any, variable_errors: Mapping[str, str]) -> bool:
    if variable_errors:
        for name in rule.uses:
            if name in variable_errors:
                raise EvaluationError(f"variable '{name}' failed: {variable_errors[name]}")
    value = rule.condition.evaluate(bindings)
    if value is True or value is False:
        return value
    raise EvaluationError(f"condition returned {type(value).__name__}, expected bool")


def _int_result(expression: CompiledExpression | None, bindings: Any, what: str) -> int:
    if expression is None:  # pragma: no cover - the loader guarantees it
        raise EvaluationError(f"{what} is missing")
    value = expression.evaluate(bindings)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EvaluationError(f"{what} returned {type(value).__name__}, expected int")
    return value


def _string_result(expression: CompiledExpression, bindings: Any) -> str:
    value = expression.evaluate(bindings)
    if not isinstance(value, str):
        raise EvaluationError(f"message returned {type(value).__name__}, expected string")
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _traced(
    rule: Rule,
    inputs: Mapping[str, Any],
    fired: bool,
    error: str,
    effect: str,
    backend: BackendFacts | None = None,
) -> RuleTrace:
    names = (*rule.reads, *(f"variables.{name}" for name in rule.uses))
    return RuleTrace(
        rule=rule.id,
        stage=str(rule.stage),
        mode=str(rule.mode),
        action=rule.action.describe(),
        result="error" if error else "fired" if fired else "not fired",
        inputs=tuple((name, _plain(inputs.get(name))) for name in names),
        backend=backend.name if backend is not None else "",
        error=error,
        effect=effect,
    )


def _skipped(rule: Rule, deciding_rule: str) -> RuleTrace:
    return RuleTrace(
        rule=rule.id,
        stage=str(rule.stage),
        mode=str(rule.mode),
        action=rule.action.describe(),
        result="skipped",
        effect=f"not evaluated: '{deciding_rule}' already denied",
    )
