"""``orchid-gateway policy explain --request FILE``: every rule, for one request.

FILE is a request record plus context in the test-suite ``given`` format
(YAML or JSON; missing fields come from the documented base request, see
``gateway.policy.suites``). Prints each evaluated rule with the inputs it
read, its result and effect, then the final decision - as a table, or with
``--json`` as one JSON document. Always evaluates one rule at a time. Exit
codes: 0 explained (whatever the decision), 1 invalid policy, 2 usage error
(FILE missing or invalid).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from gateway.policy.diagnostics import PolicyLoadError, render_all
from gateway.policy.engine import DEFAULT_ENGINE, ENGINE_NAMES
from gateway.policy.loader import load_policies
from gateway.policy.schema import activation
from gateway.policy.snapshot import Explanation, PolicyResult, PolicySnapshot
from gateway.policy.suites import load_request_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request", required=True, help="request record + context (YAML or JSON)")
    parser.add_argument("--policies", default="policies", help="policy directory (default %(default)s)")
    parser.add_argument(
        "--engine", choices=ENGINE_NAMES, default=DEFAULT_ENGINE, help="CEL engine (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _show(value: Any) -> str:
    return json.dumps(_plain(value), ensure_ascii=False)


def decision_json(result: PolicyResult) -> dict[str, Any]:
    return result.to_json()


def explanation_json(
    snapshot: PolicySnapshot, explanation: Explanation, inputs: dict[str, Any]
) -> dict[str, Any]:
    return {
        "policy": {"version": snapshot.version, "label": snapshot.label, "engine": snapshot.engine_name},
        "inputs": _plain(inputs),
        "variables": [
            {"name": v.name, "value": _plain(v.value), "error": v.error} for v in explanation.variables
        ],
        "rules": [
            {
                "rule": t.rule,
                "stage": t.stage,
                "mode": t.mode,
                "action": t.action,
                "backend": t.backend,
                "result": t.result,
                "inputs": {name: _plain(value) for name, value in t.inputs},
                "effect": t.effect,
                "error": t.error,
            }
            for t in explanation.rules
        ],
        "decision": decision_json(explanation.result),
    }


def render_table(snapshot: PolicySnapshot, explanation: Explanation, request_line: str) -> str:
    lines = [f"policy {snapshot.display_version}, engine {snapshot.engine_name}", request_line, ""]
    if explanation.variables:
        lines.append("variables")
        for variable in explanation.variables:
            shown = f"error: {variable.error}" if variable.error else _show(variable.value)
            lines.append(f"  {variable.name} = {shown}")
        lines.append("")
    header = ("STAGE", "RULE", "MODE", "RESULT", "EFFECT")
    rows = []
    for t in explanation.rules:
        rule = f"{t.rule} @{t.backend}" if t.backend else t.rule
        rows.append((t.stage, rule, t.mode, t.result, t.effect, t))
    widths = [max(len(header[i]), *(len(str(r[i])) for r in rows)) for i in range(4)] if rows else [10] * 4
    lines.append("  ".join(h.ljust(widths[i]) for i, h in enumerate(header[:4])) + "  " + header[4])
    for stage, rule, mode, outcome, effect, trace in rows:
        cells = "  ".join(str(v).ljust(widths[i]) for i, v in enumerate((stage, rule, mode, outcome)))
        lines.append(f"{cells}  {effect}".rstrip())
        if trace.inputs:
            lines.append("      reads " + ", ".join(f"{name}={_show(value)}" for name, value in trace.inputs))
        if trace.error:
            lines.append(f"      error {trace.error}")
    result = explanation.result
    lines.append("")
    if result.allowed:
        lines.append("decision: allow")
    else:
        retry = f", retry after {result.retry_after_ms} ms" if result.retry_after_ms is not None else ""
        lines.append(f"decision: deny {result.status} by {result.rule}{retry}")
        lines.append(f"  message: {result.message}")
    lines.append(f"  rules fired: {', '.join(result.rules_fired) or '-'}")
    lines.append(f"  shadow fired: {', '.join(result.shadow_fired) or '-'}")
    lines.append(f"  fallback eligible: {'yes' if result.fallback_eligible else 'no'}")
    lines.append(f"  excluded backends: {', '.join(result.excluded_backends) or '-'}")
    limit = result.max_output_tokens
    lines.append(f"  max output tokens: {limit if limit is not None else '-'}")
    if result.annotations:
        lines.append("  annotations: " + ", ".join(f"{k}={v}" for k, v in result.annotations))
    for event in result.fail_open:
        lines.append(f"  FAIL OPEN {event.rule}: {event.error}")
    lines.append(f"  eval: {result.eval_us:.0f} us (explain evaluates one rule at a time)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    request_path = Path(args.request)
    if not request_path.is_file():
        print(f"orchid-gateway policy explain: {request_path}: no such file", file=sys.stderr)
        return 2
    try:
        record, context = load_request_file(request_path)
    except PolicyLoadError as exc:
        print(render_all(exc.diagnostics), file=sys.stderr)
        return 2
    policies = Path(args.policies)
    if not policies.is_dir():
        print(f"orchid-gateway policy explain: {policies}: not a policy directory", file=sys.stderr)
        return 2
    try:
        snapshot = load_policies(policies, engine=args.engine)
    except PolicyLoadError as exc:
        print(render_all(exc.diagnostics))
        return 1
    explanation = snapshot.explain(record, context, timer=time.perf_counter_ns)
    if args.json:
        inputs = activation(record, context)
        print(json.dumps(explanation_json(snapshot, explanation, inputs), indent=2, ensure_ascii=False))
        return 0
    identity = record.identity
    request_line = (
        f"request {identity.request_id}: tenant={identity.tenant} class={identity.request_class} "
        f"model={identity.model} cell={identity.privacy_cell} slack={record.budget.slack_ms:g} ms"
    )
    print(render_table(snapshot, explanation, request_line))
    return 0
