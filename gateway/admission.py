"""Admission: the pure pipeline that turns a ``RequestRecord`` into a ``Decision``.

No I/O and no clocks: everything it needs is in the record (shape, predicted
demand, deadline budget, ladder step) and the ``AdmissionContext`` handed in
by the edge (route facts, policy evaluation). The rule of the house: reject
work whose predicted completion misses its deadline *before* it spends
accelerator time; never send work outside its privacy cell; route to a
fallback only when quality evidence and eligibility allow.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.record import Approximation, Decision, RequestRecord, Verdict

INFEASIBLE_RULE = "admission.infeasible_deadline"


@dataclass(frozen=True, slots=True)
class AdmissionContext:
    policy_version: str
    max_dwell_ms: float


def infeasible_message(record: RequestRecord) -> str:
    b = record.budget
    predicted_completion = b.elapsed_ms + b.queue_wait_ms + b.reserve_exec_ms
    return (
        f"predicted completion {predicted_completion:.1f} ms plus reserves "
        f"{b.reserve_upstream_ms + b.reserve_fail_ms:.1f} ms exceeds the deadline of {b.deadline_ms:.1f} ms "
        f"(remaining budget {b.remaining_ms:.1f} ms, slack {b.slack_ms:.1f} ms)"
    )


def decide(record: RequestRecord, context: AdmissionContext) -> Decision:
    if record.budget.slack_ms < 0:
        return Decision(
            verdict=Verdict.REJECT,
            target_model=record.identity.model,
            route_reason="rejected",
            rules=(INFEASIBLE_RULE,),
            policy_version=context.policy_version,
            status="DEADLINE_EXCEEDED",
            message=infeasible_message(record),
        )
    return Decision(
        verdict=Verdict.ADMIT,
        target_model=record.identity.model,
        route_reason="primary",
        approximation=Approximation.NONE,
        policy_version=context.policy_version,
        max_dwell_ms=context.max_dwell_ms,
    )
