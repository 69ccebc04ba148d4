"""The policy decision log: one JSON line per decision, whitelisted fields only.

This module owns what a decision log line may contain. Entries are built
field by field from the record's identity and the ``PolicyResult`` - never by
dumping a record, a request or a context - so payloads, tensors, prompts,
embeddings and outputs cannot reach the log even by accident (the record does
not carry them, and nothing here would copy them if it did). Another tenant's
name never appears: each line describes one request of one tenant.

Every ``fail_open`` event (an ``on_error: allow`` rule that erred and let the
request through) is written, as STYLE asks: "say in the decision log whenever
anything fails open". The time is handed in; this module reads no clock.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from gateway.core.record import RequestRecord
from gateway.policy.snapshot import PolicyResult

# Why: an error text is for an operator to recognise the failure, not a dump.
MAX_ERROR_CHARS = 200


@dataclass(frozen=True, slots=True)
class DecisionLogEntry:
    decision_id: str
    time: str  # RFC 3339, UTC, milliseconds
    request_id: str
    tenant: str
    request_class: str
    model: str
    model_version: str  # the version that serves it (a rollout's candidate label on a canary)
    policy_version: str
    outcome: str  # "allow" | "deny", or the admission verdict when the caller passes one
    status: str
    rule: str
    rules_fired: tuple[str, ...]
    shadow_fired: tuple[str, ...]
    fallback_eligible: bool
    max_output_tokens: int | None
    eval_us: float
    fail_open: tuple[tuple[str, str], ...]  # (rule id, error)
    errors: tuple[tuple[str, str], ...]  # (rule id, error)
    # Why the warm fallback could not take the request as asked (its limits, tensors): ""
    # when it could or was not wanted. Counts and model names only, never a payload.
    fallback_refused: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "time": self.time,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "class": self.request_class,
            "model": self.model,
            "model_version": self.model_version,
            "policy_version": self.policy_version,
            "outcome": self.outcome,
            "status": self.status,
            "rule": self.rule,
            "rules_fired": list(self.rules_fired),
            "shadow_fired": list(self.shadow_fired),
            "fallback_eligible": self.fallback_eligible,
            "max_output_tokens": self.max_output_tokens,
            "eval_us": round(self.eval_us, 1) if math.isfinite(self.eval_us) else None,
            "fail_open": [{"rule": rule, "error": error} for rule, error in self.fail_open],
            "errors": [{"rule": rule, "error": error} for rule, error in self.errors],
            "fallback_refused": self.fallback_refused,
        }

    def to_line(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def decision_entry(
    *,
    decision_id: str,
    at_unix_s: float,
    record: RequestRecord,
    result: PolicyResult,
    outcome: str | None = None,
    fallback_refused: str = "",
) -> DecisionLogEntry:
    """Build an entry from explicit fields of ``record`` and ``result``."""
    identity = record.identity
    return DecisionLogEntry(
        decision_id=decision_id,
        time=datetime.fromtimestamp(at_unix_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        request_id=identity.request_id,
        tenant=identity.tenant,
        request_class=identity.request_class,
        model=identity.model,
        model_version=identity.model_version,
        policy_version=result.policy_version,
        outcome=outcome or result.outcome,
        status=result.status,
        rule=result.rule,
        rules_fired=result.rules_fired,
        shadow_fired=result.shadow_fired,
        fallback_eligible=result.fallback_eligible,
        max_output_tokens=result.max_output_tokens,
        eval_us=result.eval_us,
        fail_open=tuple((event.rule, _clip(event.error)) for event in result.fail_open),
        errors=tuple((error.rule, _clip(error.error)) for error in result.errors),
        fallback_refused=_clip(fallback_refused),
    )


class DecisionLog:
    """Writes entries as JSON lines to a text stream or to a ``logging.Logger`` (one record per line)."""

    def __init__(self, sink: TextIO | logging.Logger) -> None:
        self._sink = sink

    def write(self, entry: DecisionLogEntry) -> None:
        line = entry.to_line()
        if isinstance(self._sink, logging.Logger):
            # A fail-open decision is worth a warning; everything else is routine.
            level = logging.WARNING if entry.fail_open else logging.INFO
            self._sink.log(level, "%s", line)
        else:
            self._sink.write(line + "\n")

    def records(self, result: PolicyResult) -> bool:
        """Whether ``record`` would write a line for ``result`` (a logger below INFO drops
        routine decisions; fail-open ones are always written): callers skip building its
        arguments when not."""
        return (
            not isinstance(self._sink, logging.Logger)
            or bool(result.fail_open)
            or self._sink.isEnabledFor(logging.INFO)
        )

    def record(
        self,
        *,
        decision_id: str,
        at_unix_s: float,
        record: RequestRecord,
        result: PolicyResult,
        outcome: str | None = None,
        fallback_refused: str = "",
    ) -> DecisionLogEntry | None:
        """Build and write one entry; returns it (``None`` when the sink would drop it)."""
        if not self.records(result):
            return None  # nobody reads routine decisions at this level: don't build them
        entry = decision_entry(
            decision_id=decision_id,
            at_unix_s=at_unix_s,
            record=record,
            result=result,
            outcome=outcome,
            fallback_refused=fallback_refused,
        )
        self.write(entry)
        return entry
