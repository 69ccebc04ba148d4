"""Admission: the pure pipeline that turns priced records and policy results into a ``Decision``.

No I/O and no clocks. The edge prices the request on its primary route (and,
when one exists, on the route's warm fallback in the same privacy cell),
evaluates the policy snapshot on the primary record, and asks ``decide``. When
``wants_fallback_pass`` says so, it also evaluates the policy on the fallback
record and hands that result in too.

Rules, in order:

1. A policy denial is final unless it is a *capacity* denial
   (``DEADLINE_EXCEEDED``: infeasible slack; ``RESOURCE_EXHAUSTED``: quota or
   shedding) and the request may be answered by the fallback: then the
   fallback is tried (rule 3).
2. Overload ladder step 4 and above defer batch and async work: rejected with
   ``RESOURCE_EXHAUSTED`` and a ``retry-after-ms`` from the predicted drain.
3. The fallback serves a request only when every one of these holds: the
   policy's fallback stage found it eligible (allowed class, no prohibited
   risk class, caller did not opt out, quality evidence at or above the floor,
   fallback warm, same cell — see ``policies/40-fallback.yaml``), and the
   policy allows the request *as priced on the fallback* (its own slack and
   quota). It is taken when the ladder is at step 3+ (overload) for the share of
   eligible work the pool diverts (just enough to bring demand back inside the
   envelope: quality is degraded only as far as capacity requires), or when the
   primary was denied for capacity. Provenance says
   ``orchid.approximation=fallback`` and why. And never when the fallback's limits do
   not take the request as asked (``fallback_misfit``: its input tokens, output cap and
   items; the edge adds its tensors' modality and datatypes): a fallback with a smaller
   context window would fail or truncate it. The decision then says why
   (``Decision.fallback_refused``, in the decision log), and a refusal's message names it.
4. A policy output limit below the requested output is applied and marked
   ``reduced_output``.
5. Otherwise the primary admits.
"""

from __future__ import annotations

import msgspec

from gateway.core.dispatch import LATE_RULE
from gateway.core.overload import LadderEffects
from gateway.core.policy_result import PolicyResult
from gateway.core.record import Approximation, Decision, RequestRecord, Shape, Verdict

CAPACITY_STATUSES = frozenset({"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
DEFER_BATCH_RULE = "ladder.defer_batch"
BATCH_MODES = frozenset({"batch", "async"})
FALLBACK = Approximation.FALLBACK


class Candidate(msgspec.Struct, frozen=True):
    """One way to serve the request: the record priced on that route, and what policy said."""

    record: RequestRecord
    policy: PolicyResult


class FallbackLimits(msgspec.Struct, frozen=True, gc=False):
    """What the fallback's route takes (its ``shape`` caps)."""

    model: str
    max_input_tokens: int
    max_output_tokens: int
    max_items: int


def fallback_misfit(shape: Shape, limits: FallbackLimits) -> str:
    """Why the fallback cannot take a request of ``shape`` as asked ("" when it can): a
    caller's answer is never cut or failed by a smaller fallback."""
    if shape.input_tokens > limits.max_input_tokens:
        return (
            f"{shape.input_tokens} input tokens exceed the fallback {limits.model!r}'s limit of "
            f"{limits.max_input_tokens}"
        )
    if shape.max_output_tokens > limits.max_output_tokens:
        return (
            f"{shape.max_output_tokens} output tokens exceed the fallback {limits.model!r}'s limit of "
            f"{limits.max_output_tokens}"
        )
    if shape.items > limits.max_items:
        return f"{shape.items} items exceed the fallback {limits.model!r}'s limit of {limits.max_items}"
    return ""


class AdmissionContext(msgspec.Struct, frozen=True):
    effects: LadderEffects
    retry_after_ms: int  # from the predicted drain of the pool
    batch_classes: frozenset[str] = frozenset({"batch"})
    divert: bool = True  # under overload, is this request part of the share sent to the fallback?
    fallback_limits: FallbackLimits | None = None  # the fallback route's caps (None: no fallback)
    # Why the fallback's tensors cannot take the request (modality, datatype), from the edge.
    fallback_refused: str = ""


def wants_fallback_pass(
    primary: PolicyResult, effects: LadderEffects, fallback_available: bool, divert: bool = True
) -> bool:
    """Should the edge price the fallback and evaluate policy on it? Under overload only for
    the share of eligible work the pool diverts (``divert``); always for a primary denied for
    capacity (a fallback answer instead of a rejection)."""
    if not fallback_available:
        return False
    if not primary.allowed:
        return primary.status in CAPACITY_STATUSES
    return effects.fallback_for_eligible and primary.fallback_eligible and divert


def _reject(record: RequestRecord, result: PolicyResult) -> Decision:
    return Decision(
        ladder_step=record.ladder_step,
        verdict=Verdict.REJECT,
        target_model=record.identity.model,
        route_reason="rejected",
        rules=(result.rule,) if result.rule else result.rules_fired,
        shadow_rules=result.shadow_fired,
        policy_version=result.policy_version,
        status=result.status,
        message=result.message,
        retry_after_ms=result.retry_after_ms,
    )


def _admit(
    candidate: Candidate,
    *,
    route_reason: str,
    approximation: Approximation,
    context: AdmissionContext,
    ladder_step: int,
) -> Decision:
    record, result = candidate.record, candidate.policy
    limit = result.max_output_tokens
    reduced = limit is not None and limit < record.shape.max_output_tokens
    if reduced and approximation is Approximation.NONE:
        approximation = Approximation.REDUCED_OUTPUT
    return Decision(
        verdict=Verdict.FALLBACK if approximation is Approximation.FALLBACK else Verdict.ADMIT,
        target_model=record.identity.model,
        route_reason=route_reason,
        approximation=approximation,
        rules=result.rules_fired,
        shadow_rules=result.shadow_fired,
        policy_version=result.policy_version,
        max_output_tokens=limit if reduced else None,
        ladder_step=ladder_step,
    )


def decide(primary: Candidate, fallback: Candidate | None, context: AdmissionContext) -> Decision:
    record = primary.record
    is_batch = (
        str(record.identity.mode) in BATCH_MODES or record.identity.request_class in context.batch_classes
    )
    if context.effects.defer_batch and is_batch:
        return Decision(
            verdict=Verdict.REJECT,
            target_model=record.identity.model,
            route_reason="rejected",
            rules=(DEFER_BATCH_RULE,),
            policy_version=primary.policy.policy_version,
            status="RESOURCE_EXHAUSTED",
            message=f"batch work is deferred while the service is overloaded (step {record.ladder_step})",
            retry_after_ms=context.retry_after_ms,
            ladder_step=record.ladder_step,
        )
    capacity_denied = not primary.policy.allowed and primary.policy.status in CAPACITY_STATUSES
    refused = ""
    if fallback is not None or context.fallback_refused:
        refused = context.fallback_refused or (
            fallback_misfit(record.shape, context.fallback_limits) if context.fallback_limits else ""
        )
    if refused:
        decision = _decide(primary, None, context)
        message = decision.message
        if decision.verdict is Verdict.REJECT and capacity_denied:
            message = f"{message}; the fallback cannot take it: {refused}"
        return msgspec.structs.replace(decision, fallback_refused=refused, message=message)
    return _decide(primary, fallback, context)


def _decide(primary: Candidate, fallback: Candidate | None, context: AdmissionContext) -> Decision:
    record = primary.record
    capacity_denied = not primary.policy.allowed and primary.policy.status in CAPACITY_STATUSES
    eligible = primary.policy.fallback_eligible or (
        # A primary denied for capacity never reached the fallback stage; the fallback pass decides.
        capacity_denied and fallback is not None and fallback.policy.fallback_eligible
    )
    if fallback is not None and eligible and fallback.policy.allowed:
        if capacity_denied:
            if primary.policy.rule == LATE_RULE:
                reason = "fallback:primary_late"  # its latest start passed in the primary's queue
            elif primary.policy.status == "DEADLINE_EXCEEDED":
                reason = "fallback:primary_infeasible"
            else:
                reason = "fallback:primary_shed"
            return _admit(
                fallback,
                route_reason=reason,
                approximation=Approximation.FALLBACK,
                context=context,
                ladder_step=record.ladder_step,
            )
        if context.effects.fallback_for_eligible and context.divert:
            return _admit(
                fallback,
                route_reason="fallback:overload",
                approximation=Approximation.FALLBACK,
                context=context,
                ladder_step=record.ladder_step,
            )
    if not primary.policy.allowed:
        return _reject(record, primary.policy)
    return _admit(
        primary,
        route_reason="primary",
        approximation=Approximation.NONE,
        context=context,
        ladder_step=record.ladder_step,
    )


# ---------------------------------------------------------------------- around the decision
# The judgements the request chain makes around ``decide``: whether a request's demand is
# offered load, the late rescue's override, and isolation. Pure, so the chain only applies them.

ISOLATION_RULE = "isolation.dedicated"  # the rule named when ``isolation: dedicated`` refuses


def offered(primary: PolicyResult, *, late: bool) -> bool:
    """Whether the request's demand is admissible work (offered load, before any ladder
    action): a request its own tenant's quota, entitlement or policy refuses is not load
    (the flooder's excess is its own problem); one refused for want of capacity is. A late
    rescue was offered (and admitted) once already, on its first pass."""
    if late:
        return False
    return primary.allowed or primary.status == "DEADLINE_EXCEEDED"


def too_late(primary: PolicyResult) -> PolicyResult:
    """A late rescue's primary: its latest start passed in the queue, so it counts as denied
    for capacity (``DEADLINE_EXCEEDED``, ``queue.latest_start``) and the decision is the warm
    fallback if policy allows it and it can still finish in time, or that refusal."""
    return msgspec.structs.replace(
        primary,
        allowed=False,
        status="DEADLINE_EXCEEDED",
        rule=LATE_RULE,
        message="the request could not start before its deadline",
        retry_after_ms=None,
    )


def isolation_refusal(chosen: PolicyResult, backend_model: str, dedicated_models: frozenset[str]) -> str:
    """Why the chosen candidate may not run under ``annotate: {isolation: dedicated}`` ("" if
    it may): it must run on a backend model reserved for its tenant, a pool of its own whose
    batches hold no other tenant."""
    if chosen.annotation_map.get("isolation") != "dedicated" or backend_model in dedicated_models:
        return ""
    return (
        "policy requires dedicated isolation, and model {model!r} has no capacity "
        "reserved for this credential"
    )
