"""The policy vocabulary: stages, actions, modes, and compiled rules and variables.

This module owns what a rule *is* once loaded - the immutable values the
loader produces and the snapshot evaluates - and the tables that say which
actions a stage accepts and how a stage treats a runtime error. It does no
parsing and no evaluation.

Stages run in this order; a stage's rules run in policy-file order (files
sorted by name, then top to bottom):

    privacy    deny, annotate                  error: deny (always, fail closed)
    admission  deny, limit, annotate           error: on_error (deny by default | allow)
    quota      deny, limit, annotate           error: on_error (deny by default | allow)
    fallback   fallback_eligible/_ineligible,  error: not eligible
               annotate
    routing    exclude_backend (per backend)   error: the backend is excluded

An enforce-mode ``deny`` that fires stops evaluation. Shadow-mode rules are
evaluated and reported, never acted on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from gateway.core.admission import ISOLATION_RULE as ISOLATION_RULE  # the rule it refuses with
from gateway.policy.engine import CompiledExpression


class Stage(StrEnum):
    PRIVACY = "privacy"
    ADMISSION = "admission"
    QUOTA = "quota"
    FALLBACK = "fallback"
    ROUTING = "routing"


STAGE_ORDER: tuple[Stage, ...] = (Stage.PRIVACY, Stage.ADMISSION, Stage.QUOTA, Stage.FALLBACK, Stage.ROUTING)


class RuleMode(StrEnum):
    ENFORCE = "enforce"
    SHADOW = "shadow"


class OnError(StrEnum):
    DENY = "deny"
    ALLOW = "allow"


class ActionKind(StrEnum):
    DENY = "deny"
    LIMIT = "limit"
    ANNOTATE = "annotate"
    FALLBACK_ELIGIBLE = "fallback_eligible"
    FALLBACK_INELIGIBLE = "fallback_ineligible"
    EXCLUDE_BACKEND = "exclude_backend"


# The one registry of annotation keys a rule may set: each key, the values it accepts, and
# what enforces each value. The loader (``gateway.policy.loader``) rejects any other key or
# value with its file:line:col, so an annotation is never a promise that nothing keeps.
ENFORCED_ANNOTATIONS: Mapping[str, Mapping[str, str]] = {
    "isolation": {
        "dedicated": (
            "the request chain's decide stage: the request runs only on a backend model "
            "reserved for its tenant (its own pool, so never batched with another tenant's work), else "
            "PERMISSION_DENIED with rule isolation.dedicated"
        ),
    },
}


# gRPC status names a deny rule may choose (the caller-facing contract, ARCHITECTURE §5).
DENY_STATUSES: tuple[str, ...] = (
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "DEADLINE_EXCEEDED",
    "INVALID_ARGUMENT",
    "UNAVAILABLE",
)

# Status of a fail-closed denial caused by a rule whose own action is not a deny.
FAIL_CLOSED_STATUS = "INTERNAL"
PRIVACY_FAIL_CLOSED_STATUS = "PERMISSION_DENIED"

STAGE_ACTIONS: Mapping[Stage, frozenset[ActionKind]] = {
    Stage.PRIVACY: frozenset({ActionKind.DENY, ActionKind.ANNOTATE}),
    Stage.ADMISSION: frozenset({ActionKind.DENY, ActionKind.LIMIT, ActionKind.ANNOTATE}),
    Stage.QUOTA: frozenset({ActionKind.DENY, ActionKind.LIMIT, ActionKind.ANNOTATE}),
    Stage.FALLBACK: frozenset(
        {ActionKind.FALLBACK_ELIGIBLE, ActionKind.FALLBACK_INELIGIBLE, ActionKind.ANNOTATE}
    ),
    Stage.ROUTING: frozenset({ActionKind.EXCLUDE_BACKEND}),
}

# Stages where the author chooses what a runtime error does.
ON_ERROR_STAGES: frozenset[Stage] = frozenset({Stage.ADMISSION, Stage.QUOTA})

ON_ERROR_FIXED: Mapping[Stage, str] = {
    Stage.PRIVACY: "privacy rules always fail closed (an error denies)",
    Stage.FALLBACK: "an error in a fallback rule always makes the request not eligible",
    Stage.ROUTING: "an error in a routing rule always excludes the backend",
}


@dataclass(frozen=True, slots=True)
class SourceRef:
    """Where something was declared: ``path:line:column`` (1-based)."""

    path: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    status: str = ""  # deny
    retry_after_ms: CompiledExpression | None = None  # deny, CEL int
    max_output_tokens: CompiledExpression | None = None  # limit, CEL int
    annotations: tuple[tuple[str, str], ...] = ()  # annotate: literal key/value pairs

    def describe(self) -> str:
        if self.kind is ActionKind.DENY:
            return f"deny {self.status}"
        if self.kind is ActionKind.ANNOTATE:
            return "annotate " + ", ".join(f"{k}={v}" for k, v in self.annotations)
        return str(self.kind)


@dataclass(frozen=True, slots=True)
class Variable:
    """A named expression declared once and referenced as ``variables.<name>``."""

    name: str
    text: str
    expression: CompiledExpression
    cel_type: str
    reads: tuple[str, ...]  # schema paths it reads directly
    uses: tuple[str, ...]  # variables it reads directly
    source: SourceRef


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    stage: Stage
    mode: RuleMode
    on_error: OnError
    action: Action
    condition: CompiledExpression
    condition_text: str
    message: CompiledExpression | None
    description: str
    source: SourceRef
    reads: tuple[str, ...]  # schema paths read by any of the rule's expressions
    uses: tuple[str, ...]  # variables read by any of the rule's expressions
    condition_reads: tuple[str, ...] = ()  # schema paths the condition alone reads

    @property
    def shadow(self) -> bool:
        return self.mode is RuleMode.SHADOW

    @property
    def per_backend(self) -> bool:
        return self.stage is Stage.ROUTING
