"""What the policy set decided for one request, as a plain value the decision core reads.

This module owns ``PolicyResult`` (and the ``RuleError`` and ``FailOpen`` it carries): the
outcome of evaluating a policy set, its denial's status, rule, message and retry-after, the
rules that fired, fallback eligibility, excluded backends, limits and annotations. Policy
evaluation (``gateway.policy.snapshot``) produces it; admission (``gateway.core.admission``)
decides from it. The core never imports ``gateway.policy``: the dependency points the other
way. No I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.core.errors import GatewayError, error_for_status


@dataclass(frozen=True, slots=True)
class RuleError:
    """A runtime error in one rule (or in a variable it reads)."""

    rule: str
    stage: str
    error: str
    backend: str = ""  # routing rules: the backend being evaluated
    shadow: bool = False


@dataclass(frozen=True, slots=True)
class FailOpen:
    """An ``on_error: allow`` rule erred and the request went on: must reach the decision log."""

    rule: str
    error: str


class PolicyResult(msgspec.Struct, frozen=True):
    """What the policy set decided for one request."""

    policy_version: str
    allowed: bool
    status: str = ""  # gRPC status name of the denial
    rule: str = ""  # the deciding rule of a denial
    message: str = ""  # caller-facing reason of a denial
    retry_after_ms: int | None = None
    rules_fired: tuple[str, ...] = ()  # enforce rules whose condition held, in evaluation order
    shadow_fired: tuple[str, ...] = ()  # shadow rules that would have acted
    fallback_eligible: bool = False
    excluded_backends: tuple[str, ...] = ()
    max_output_tokens: int | None = None  # min over fired limit rules
    annotations: tuple[tuple[str, str], ...] = ()
    fail_open: tuple[FailOpen, ...] = ()
    errors: tuple[RuleError, ...] = ()
    eval_us: float = 0.0

    @property
    def outcome(self) -> str:
        return "allow" if self.allowed else "deny"

    @property
    def annotation_map(self) -> dict[str, str]:
        return dict(self.annotations)

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values (explain --json, policy test comparisons)."""
        return {
            "outcome": self.outcome,
            "status": self.status,
            "rule": self.rule,
            "message": self.message,
            "retry_after_ms": self.retry_after_ms,
            "rules_fired": list(self.rules_fired),
            "shadow_fired": list(self.shadow_fired),
            "fallback_eligible": self.fallback_eligible,
            "excluded_backends": list(self.excluded_backends),
            "max_output_tokens": self.max_output_tokens,
            "annotations": dict(self.annotations),
            "fail_open": [{"rule": e.rule, "error": e.error} for e in self.fail_open],
            "errors": [
                {"rule": e.rule, "stage": e.stage, "backend": e.backend, "error": e.error}
                for e in self.errors
            ],
            "eval_us": round(self.eval_us, 1),
        }

    def to_error(self) -> GatewayError | None:
        """The domain error a denial maps to (``None`` when allowed)."""
        if self.allowed:
            return None
        error_class = error_for_status(self.status)
        return error_class(self.message, rule=self.rule or None, retry_after_ms=self.retry_after_ms)
