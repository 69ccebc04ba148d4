"""Policy test suites and request files: partial inputs, expectations, coverage.

This module owns the data format of ``policies/tests/*.yaml`` (run by
``orchid-gateway policy test``) and of request files (``policy explain
--request``). Both describe an input with the same names rules use, partially:
whatever is left out comes from ``BASE_GIVEN``, the seed's teaching request
(orchid/interactive/7f2: full-v18 with compact-v11 as fallback, 200 ms
deadline, 45 ms elapsed, reserves 12/60/15 -> 68 ms slack, 256 input tokens,
<= 64 output tokens, 56.8 accelerator-ms, 8 MiB peak, cell eu-restricted).

A suite::

    suite: admission                 # optional, default: the file name
    given: {...}                     # optional defaults for every case, merged over BASE_GIVEN
    cases:
      - name: slack below zero is rejected early
        given:
          budget: {elapsed_ms: 150.0}
          load: {ladder_step: 2}
          backends: [{name: triton-eu-1, labels: {cell: eu-restricted}}]
        expect:
          outcome: deny                   # allow | deny
          status: DEADLINE_EXCEEDED
          rule: deadline-infeasible       # the deciding rule
          message: "..."                  # exact; or message_contains: "..."
          retry_after_ms: null
          rules_fired: [deadline-infeasible]   # exact, in order
          shadow_fired: []
          fallback_eligible: false
          excluded_backends: []
          max_output_tokens: null
          annotations: {isolation: dedicated}
          fail_open: []                   # rule ids
          errors: []                      # rule ids

``given`` merges mappings key by key; lists (and ``backends``) replace.
Derived values (``demand.accelerator_ms``, ``budget.slack_ms``,
``budget.remaining_ms``, ``tenant.entitled``) cannot be given: set the terms they
derive from. Tenant and route facts are turned into a context by the gateway's own
builder (``gateway.policy.context.build_policy_context``), so a case reads what serving
would derive from the same configuration. Only the keys in ``expect`` are checked.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yaml.nodes import MappingNode, Node

from gateway.config import QualityEvidence as RouteQuality
from gateway.config import ReducedOutput, RouteConfig, TenantConfig
from gateway.core.evidence import EvidenceStatus, EvidenceVerdict, RouteEvidence
from gateway.core.quota import QuotaView
from gateway.core.record import Budget, Demand, Identity, Mode, RequestRecord, Shape
from gateway.policy import schema
from gateway.policy.context import build_policy_context, declared_evidence
from gateway.policy.diagnostics import Diagnostic, PolicyLoadError
from gateway.policy.model import SourceRef
from gateway.policy.schema import BackendFacts, LoadFacts, PolicyContext
from gateway.policy.snapshot import PolicyResult, PolicySnapshot
from gateway.policy.source import (
    Located,
    SourceFile,
    YamlSyntaxError,
    is_null,
    mapping_items,
    plain_value,
    scalar_text,
    sequence_items,
)

BASE_GIVEN: Mapping[str, Any] = {
    "request": {
        "request_id": "orchid/interactive/7f2",
        "tenant": "orchid",
        "class": "interactive",
        "model": "full-v18",
        "model_version": "",
        "operation": "ModelInfer",
        "mode": "online",
        "privacy_cell": "eu-restricted",
        "risk_class": "standard",
        "allow_fallback": True,
    },
    "shape": {
        "items": 1,
        "input_tokens": 256,
        "max_output_tokens": 64,
        "modality": "text",
        "streaming": False,
        "bucket": "",
        "input_bytes": 0,
    },
    "demand": {
        "prefill_ms": 20.0,
        "decode_ms": 36.8,
        "host_cpu_ms": 0.0,
        "peak_memory_bytes": 8 * 1024 * 1024,
        "live_token_ms": 0.0,
    },
    "budget": {
        "deadline_ms": 200.0,
        "elapsed_ms": 45.0,
        "reserve_upstream_ms": 12.0,
        "reserve_exec_ms": 60.0,
        "reserve_fail_ms": 15.0,
        "queue_wait_ms": 0.0,
    },
    "tenant": {
        "name": "orchid",
        "allowed_cells": ["eu-restricted"],
        "allowed_classes": ["interactive", "batch"],
        "allowed_models": ["full-v18", "compact-v11", "full-v18-stream"],
        "dedicated": False,
        "weight": 1.0,
        "allow_fallback": True,
        "accelerator_ms_per_s": 1000.0,
        "available_accelerator_ms": 5000.0,
        "max_output_tokens": 4096,
    },
    "route": {
        "model": "full-v18",
        "fallback_model": "compact-v11",
        "fallback_classes": ["interactive"],
        "fallback_warm": True,
        "fallback_cell": "eu-restricted",
        "quality": {
            "score": 0.92,
            "fallback_score": 0.86,
            "floor": 0.84,
            "population": "orchid-eval",
            "reduced_output_score": 0.0,
            # "": the verdict serving would derive from the scores and the floor; or set one
            # (valid, missing, expired, below_floor) to state the live store's verdict.
            "fallback_evidence": "",
            "reduced_output_evidence": "",
        },
        "reduced_output_tokens": 0,
    },
    "load": {"ladder_step": 0, "utilization": 0.5, "drain_ms": 0.0, "shed": False, "reduce_output": False},
    "backends": [
        {"name": "triton-eu-1", "model": "full-v18", "labels": {"cell": "eu-restricted"}},
        {"name": "compact-eu-1", "model": "compact-v11", "labels": {"cell": "eu-restricted"}},
    ],
}

DERIVED: Mapping[str, str] = {
    "demand.accelerator_ms": "demand.prefill_ms and demand.decode_ms",
    "budget.slack_ms": "budget.deadline_ms, elapsed_ms, reserve_*_ms and queue_wait_ms",
    "budget.remaining_ms": "budget.deadline_ms and budget.elapsed_ms",
    "tenant.entitled": "request.model and tenant.allowed_models",
}
_GIVEN_KEYS = ("request", "shape", "demand", "budget", "tenant", "route", "load", "backends")
_BACKEND_KEYS = ("name", "model", "labels")
_EXPECT_KEYS = (
    "outcome",
    "status",
    "rule",
    "message",
    "message_contains",
    "retry_after_ms",
    "rules_fired",
    "shadow_fired",
    "fallback_eligible",
    "excluded_backends",
    "max_output_tokens",
    "annotations",
    "fail_open",
    "errors",
)
_LIST_EXPECTATIONS = ("rules_fired", "shadow_fired", "excluded_backends", "fail_open", "errors")


# ---------------------------------------------------------------------------
# given -> record + context
# ---------------------------------------------------------------------------


def _typed(node: Node, path: str, cel_type: str) -> Any:
    value = plain_value(node)
    if cel_type == schema.INT:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Located(node, f"{path} is an int; got {value!r}")
        return value
    if cel_type == schema.DOUBLE:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Located(node, f"{path} is a double; got {value!r}")
        return float(value)
    if cel_type == schema.BOOL:
        if not isinstance(value, bool):
            raise Located(node, f"{path} is a bool; got {value!r}")
        return value
    if cel_type == schema.STRING:
        if not isinstance(value, str):
            raise Located(node, f"{path} is a string; got {value!r} (quote it)")
        return value
    if cel_type == schema.LIST_STRING:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise Located(node, f"{path} is a list of strings; got {value!r}")
        return value
    if cel_type == schema.MAP_STRING_STRING:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise Located(node, f"{path} is a map of strings to strings; got {value!r}")
        return value
    raise Located(node, f"{path}: unsupported type {cel_type}")  # pragma: no cover


def read_given(node: Node) -> dict[str, Any]:
    """Validate a ``given`` mapping against the schema; returns plain nested values."""
    given: dict[str, Any] = {}
    if is_null(node):
        return given
    for namespace, key_node, value in mapping_items(node, "given"):
        if namespace not in _GIVEN_KEYS:
            raise Located(
                key_node, f"unknown input '{namespace}' (expected one of: {', '.join(_GIVEN_KEYS)})"
            )
        if namespace == "backends":
            backends = []
            for item in sequence_items(value, "backends"):
                backend: dict[str, Any] = {}
                for key, bkey_node, bvalue in mapping_items(item, "a backend"):
                    if key not in _BACKEND_KEYS:
                        raise Located(
                            bkey_node, f"unknown backend field '{key}' (expected: {', '.join(_BACKEND_KEYS)})"
                        )
                    backend[key] = _typed(
                        bvalue, f"backend.{key}", schema.FIELDS_BY_PATH[f"backend.{key}"].cel_type
                    )
                if "name" not in backend:
                    raise Located(item, "a backend needs a name")
                backends.append(backend)
            given["backends"] = backends
            continue
        given[namespace] = _read_fields(value, namespace)
    return given


def _read_fields(node: Node, prefix: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if is_null(node):
        return fields
    for key, key_node, value in mapping_items(node, prefix):
        path = f"{prefix}.{key}"
        if path in DERIVED:
            raise Located(key_node, f"{path} is derived from {DERIVED[path]}; set those instead")
        if path == "route.quality":
            fields[key] = _read_fields(value, path)
            continue
        declared = schema.FIELDS_BY_PATH.get(path)
        if declared is None or declared.per_backend:
            known = sorted(
                p.rsplit(".", 1)[1]
                for p in schema.FIELDS_BY_PATH
                if p.rsplit(".", 1)[0] == prefix and p not in DERIVED
            )
            if prefix == "route":
                known.append("quality")
            raise Located(key_node, f"unknown field '{path}' (known: {', '.join(sorted(known))})")
        fields[key] = _typed(value, path, declared.cel_type)
    return fields


def merge_given(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; everything else (lists, backends) replaces."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_given(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _quota_view(tenant: str, request_class: str, rate: float, available: float) -> QuotaView:
    """The ledger's answer a suite states: ``available`` is what it would grant now (borrowing
    included), ``rate`` its refill."""
    return QuotaView(
        tenant=tenant,
        request_class=request_class,
        metered=not math.isinf(available),
        pooled=False,
        available_accelerator_ms=available,
        refill_ms_per_s=rate,
        burst_ms=0.0,
        borrowable_ms=0.0,
        available_live_token_ms=math.inf,
        live_token_refill_ms_per_s=0.0,
        concurrent=0,
        max_concurrent=None,
        queued_ms=0.0,
        max_queued_ms=None,
        max_input_tokens=None,
        max_output_tokens=None,
    )


def build_inputs(given: Mapping[str, Any]) -> tuple[RequestRecord, PolicyContext]:
    """A full record and context from ``BASE_GIVEN`` overlaid with ``given``."""
    g = merge_given(BASE_GIVEN, given)
    r, s, d, b = g["request"], g["shape"], g["demand"], g["budget"]
    t, rt, ld = g["tenant"], g["route"], g["load"]
    try:
        mode = Mode(r["mode"])
    except ValueError as exc:
        raise ValueError(f"request.mode must be one of {', '.join(m.value for m in Mode)}") from exc
    record = RequestRecord(
        identity=Identity(
            request_id=r["request_id"],
            tenant=r["tenant"],
            request_class=r["class"],
            model=r["model"],
            model_version=r["model_version"],
            operation=r["operation"],
            mode=mode,
            privacy_cell=r["privacy_cell"],
            risk_class=r["risk_class"],
            allow_fallback=r["allow_fallback"],
        ),
        shape=Shape(**s),
        demand=Demand(**d),
        budget=Budget(**b),
        ladder_step=ld["ladder_step"],
    )
    quality = rt["quality"]
    # The facts go through the gateway's own builder (``gateway.policy.context``): a suite
    # states a tenant's configuration and a route's evidence in policy's names, and reads
    # back exactly what serving would derive from them (the floor a route with no floor of
    # its own takes, entitlement, no fallback score without a fallback ...).
    tenant_config = TenantConfig.model_construct(
        cells=tuple(t["allowed_cells"]),
        classes=tuple(t["allowed_classes"]),
        models=tuple(t["allowed_models"]),
        dedicated=t["dedicated"],
        weight=t["weight"],
        allow_fallback=t["allow_fallback"],
        max_output_tokens=t["max_output_tokens"],
    )
    route = RouteConfig.model_construct(
        backend_model=rt["model"],
        fallback=rt["fallback_model"] or None,
        fallback_classes=tuple(rt["fallback_classes"]),
        quality=RouteQuality.model_construct(population=quality["population"], score=quality["score"]),
        quality_floor=quality["floor"],
        reduced_output=ReducedOutput.model_construct(
            max_output_tokens=int(rt["reduced_output_tokens"]),
            quality=RouteQuality.model_construct(
                population=quality["population"], score=quality["reduced_output_score"]
            ),
        )
        if rt["reduced_output_tokens"]
        else None,
    )
    fallback = (
        RouteConfig.model_construct(
            backend_model=rt["fallback_model"],
            quality=RouteQuality.model_construct(
                population=quality["population"], score=quality["fallback_score"]
            ),
        )
        if rt["fallback_model"]
        else None
    )
    evidence = _evidence_verdicts(
        declared_evidence(route, fallback), quality["fallback_evidence"], quality["reduced_output_evidence"]
    )
    context = build_policy_context(
        t["name"],
        tenant_config,
        route,
        fallback,
        fallback_warm=rt["fallback_warm"],
        fallback_cell=rt["fallback_cell"],
        load=LoadFacts(
            utilization=ld["utilization"],
            drain_ms=ld["drain_ms"],
            shed=bool(ld["shed"]),
            reduce_output=bool(ld["reduce_output"]),
        ),
        quota=_quota_view(t["name"], r["class"], t["accelerator_ms_per_s"], t["available_accelerator_ms"]),
        backends=tuple(
            BackendFacts(name=x["name"], model=x.get("model", ""), labels=dict(x.get("labels", {})))
            for x in g["backends"]
        ),
        evidence=evidence,
    )
    return record, context


def _evidence_verdicts(declared: RouteEvidence, fallback: str, reduced_output: str) -> RouteEvidence:
    """The declared verdicts, with any status a suite states in their place."""

    def stated(verdict: EvidenceVerdict, status: str, path: str) -> EvidenceVerdict:
        if not status:
            return verdict
        try:
            return EvidenceVerdict(EvidenceStatus(status), verdict.evidence)
        except ValueError:
            known = ", ".join(s.value for s in EvidenceStatus)
            raise ValueError(f"route.quality.{path} must be one of {known}, got {status!r}") from None

    return RouteEvidence(
        fallback=stated(declared.fallback, fallback, "fallback_evidence"),
        reduced_output=stated(declared.reduced_output, reduced_output, "reduced_output_evidence"),
    )


def load_request_file(path: str | Path) -> tuple[RequestRecord, PolicyContext]:
    """A request file (YAML or JSON, the ``given`` format) -> record + context; raises ``PolicyLoadError``."""
    file_path = Path(path)
    source = SourceFile(str(file_path), file_path.read_text(encoding="utf-8"))
    try:
        root = source.compose()
        given = read_given(root) if root is not None else {}
        return build_inputs(given)
    except YamlSyntaxError as exc:
        raise PolicyLoadError([exc.diagnostic]) from exc
    except Located as problem:
        raise PolicyLoadError([source.diagnostic(problem.node, problem.message)]) from problem
    except ValueError as exc:
        raise PolicyLoadError([source.diagnostic(None, str(exc))]) from exc


# ---------------------------------------------------------------------------
# Suites
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyCase:
    suite: str
    name: str
    given: Mapping[str, Any]
    expect: Mapping[str, Any]
    source: SourceRef


@dataclass(frozen=True, slots=True)
class CaseResult:
    case: PolicyCase
    result: PolicyResult | None
    mismatches: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.mismatches


@dataclass(frozen=True, slots=True)
class SuiteReport:
    results: tuple[CaseResult, ...]
    unexercised: tuple[str, ...]  # rule ids no case made fire

    @property
    def failed(self) -> tuple[CaseResult, ...]:
        return tuple(r for r in self.results if not r.passed)


def _read_expect(node: Node) -> dict[str, Any]:
    expect: dict[str, Any] = {}
    for key, key_node, value in mapping_items(node, "expect"):
        if key not in _EXPECT_KEYS:
            raise Located(
                key_node, f"unknown expectation '{key}' (expected one of: {', '.join(_EXPECT_KEYS)})"
            )
        plain = plain_value(value)
        if key == "outcome" and plain not in ("allow", "deny"):
            raise Located(value, "outcome is 'allow' or 'deny'")
        if key in _LIST_EXPECTATIONS and not (
            isinstance(plain, list) and all(isinstance(v, str) for v in plain)
        ):
            raise Located(value, f"{key} is a list of strings")
        if key in ("fallback_eligible",) and not isinstance(plain, bool):
            raise Located(value, f"{key} is a bool")
        if (
            key in ("retry_after_ms", "max_output_tokens")
            and plain is not None
            and (isinstance(plain, bool) or not isinstance(plain, int))
        ):
            raise Located(value, f"{key} is an int or null")
        if key in ("status", "rule", "message", "message_contains") and not isinstance(plain, str):
            raise Located(value, f"{key} is a string")
        if key == "annotations" and not isinstance(plain, dict):
            raise Located(value, "annotations is a mapping")
        expect[key] = plain
    return expect


def _parse_suite(source: SourceFile, default_name: str) -> list[PolicyCase]:
    root = source.compose()
    if root is None or is_null(root):
        raise Located(None, "test suite is empty: expected 'cases'")
    name = default_name
    defaults: dict[str, Any] = {}
    cases_node: Node | None = None
    for key, key_node, value in mapping_items(root, "a test suite"):
        if key == "suite":
            name = scalar_text(value, "suite")
        elif key == "given":
            defaults = read_given(value)
        elif key == "cases":
            cases_node = value
        elif key != "description":
            raise Located(key_node, f"unknown key '{key}' (expected: suite, description, given, cases)")
    if cases_node is None:
        raise Located(root, "test suite has no 'cases'")
    cases: list[PolicyCase] = []
    for item in sequence_items(cases_node, "cases"):
        if not isinstance(item, MappingNode):
            raise Located(item, "a case is a mapping with name, given and expect")
        fields = {k: (k_node, v) for k, k_node, v in mapping_items(item, "a case")}
        for k, (k_node, _) in fields.items():
            if k not in ("name", "description", "given", "expect"):
                raise Located(k_node, f"unknown case key '{k}' (expected: name, description, given, expect)")
        if "name" not in fields or "expect" not in fields:
            raise Located(item, "a case needs a name and an expect")
        case_given = read_given(fields["given"][1]) if "given" in fields else {}
        mark = item.start_mark
        cases.append(
            PolicyCase(
                suite=name,
                name=scalar_text(fields["name"][1], "name"),
                given=merge_given(defaults, case_given),
                expect=_read_expect(fields["expect"][1]),
                source=SourceRef(source.path, mark.line + 1, mark.column + 1),
            )
        )
    return cases


def load_suites(directory: str | Path) -> list[PolicyCase]:
    """Every case of ``directory/*.yaml`` in file order; raises ``PolicyLoadError`` with located problems."""
    root = Path(directory)
    cases: list[PolicyCase] = []
    diagnostics: list[Diagnostic] = []
    for path in sorted(
        p for p in root.iterdir() if p.suffix in (".yaml", ".yml") and not p.name.startswith(".")
    ):
        source = SourceFile(str(path), path.read_text(encoding="utf-8"))
        try:
            cases.extend(_parse_suite(source, path.stem))
        except YamlSyntaxError as exc:
            diagnostics.append(exc.diagnostic)
        except Located as problem:
            diagnostics.append(source.diagnostic(problem.node, problem.message))
    if diagnostics:
        raise PolicyLoadError(diagnostics)
    return cases


def check(expect: Mapping[str, Any], result: PolicyResult, known_rules: frozenset[str]) -> tuple[str, ...]:
    """Mismatches between an expectation and a result (empty: the case passes)."""
    problems: list[str] = []
    actual: dict[str, Any] = {
        **result.to_json(),
        # Suites name the rules that failed open or erred, not their error texts.
        "fail_open": [event.rule for event in result.fail_open],
        "errors": sorted({error.rule for error in result.errors}),
    }
    for key, wanted in expect.items():
        if key in ("rule", "rules_fired", "shadow_fired", "fail_open", "errors"):
            ids = [wanted] if isinstance(wanted, str) else wanted
            unknown = [i for i in ids if i and i not in known_rules]
            if unknown:
                problems.append(f"{key}: unknown rule id {', '.join(repr(i) for i in unknown)}")
                continue
        if key == "message_contains":
            if wanted not in result.message:
                problems.append(f"message: expected to contain {wanted!r}, got {result.message!r}")
            continue
        got = actual[key]
        if key == "errors":
            wanted = sorted(set(wanted))
        if got != wanted:
            problems.append(f"{key}: expected {wanted!r}, got {got!r}")
    return tuple(problems)


def run_cases(snapshot: PolicySnapshot, cases: Sequence[PolicyCase]) -> SuiteReport:
    """Evaluate every case; a case whose input cannot be built fails with the reason."""
    known = frozenset(rule.id for rule in snapshot.rules)
    exercised: set[str] = set()
    results: list[CaseResult] = []
    for case in cases:
        try:
            record, context = build_inputs(case.given)
        except (ValueError, TypeError) as exc:
            results.append(CaseResult(case, None, (f"invalid input: {exc}",)))
            continue
        result = snapshot.evaluate(record, context)
        exercised.update(result.rules_fired)
        exercised.update(result.shadow_fired)
        results.append(CaseResult(case, result, check(case.expect, result, known)))
    unexercised = tuple(rule.id for rule in snapshot.rules if rule.id not in exercised)
    return SuiteReport(tuple(results), unexercised)


__all__ = [
    "BASE_GIVEN",
    "CaseResult",
    "PolicyCase",
    "SuiteReport",
    "build_inputs",
    "check",
    "load_request_file",
    "load_suites",
    "merge_given",
    "read_given",
    "run_cases",
]
