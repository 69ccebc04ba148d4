"""Policy as data: CEL rule files compiled into an immutable snapshot and evaluated per request.

The decision core of the gateway's policy stages (privacy -> admission ->
quota -> fallback -> routing). No network I/O; the only clock read is the
evaluation timer. One concept per module:

    schema        what rules can read (declared once), PolicyContext, activation()
    source        located YAML: node marks, expression offsets -> file line:col
    analysis      what no checker covers: limits, syntax tree, bounded evaluation, stage scope
    engine        cel-cpp's type checker (for both engines); the CEL engines behind one protocol
    model         stages, actions, modes, compiled Rule / Variable
    loader        policy directory -> PolicySnapshot, or PolicyLoadError with diagnostics
    snapshot      PolicySnapshot.evaluate / explain -> PolicyResult
    store         the live snapshot: atomic reload, keep-last-good, watch()
    decision_log  JSON-lines decision log with whitelisted fields only
    suites        test suites and request files for the CLI
    metrics       prometheus collectors (get-or-create)
    cli_lint, cli_test, cli_explain   the `orchid-gateway policy ...` subcommands
"""

from gateway.policy.decision_log import DecisionLog, DecisionLogEntry, decision_entry
from gateway.policy.diagnostics import Diagnostic, PolicyLoadError
from gateway.policy.engine import DEFAULT_ENGINE, ENGINE_NAMES, EvaluationError, get_engine
from gateway.policy.loader import compile_policies, content_hash, load_policies
from gateway.policy.model import ActionKind, OnError, Rule, RuleMode, Stage
from gateway.policy.schema import (
    BackendFacts,
    LoadFacts,
    PolicyContext,
    QualityEvidence,
    RouteFacts,
    TenantFacts,
    activation,
    render_schema_markdown,
)
from gateway.policy.snapshot import (
    Explanation,
    FailOpen,
    PolicyResult,
    PolicySnapshot,
    RuleError,
    RuleTrace,
)
from gateway.policy.store import PolicyStore, ReloadResult

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINE_NAMES",
    "ActionKind",
    "BackendFacts",
    "DecisionLog",
    "DecisionLogEntry",
    "Diagnostic",
    "EvaluationError",
    "Explanation",
    "FailOpen",
    "LoadFacts",
    "OnError",
    "PolicyContext",
    "PolicyLoadError",
    "PolicyResult",
    "PolicySnapshot",
    "PolicyStore",
    "QualityEvidence",
    "ReloadResult",
    "RouteFacts",
    "Rule",
    "RuleError",
    "RuleMode",
    "RuleTrace",
    "Stage",
    "TenantFacts",
    "activation",
    "compile_policies",
    "content_hash",
    "decision_entry",
    "get_engine",
    "load_policies",
    "render_schema_markdown",
]
