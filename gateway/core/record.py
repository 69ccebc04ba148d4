"""The resource-and-outcome record: the one value every decision reads.

A ``RequestRecord`` is built at the protocol edge from the caller's identity,
the request's shape and the route's demand profile, *before* any execution.
Policy (CEL), admission, quota, overload and routing read it; the decision log
describes it; after execution an ``Outcome`` corrects it with observed work.

Everything here is immutable and free of I/O and clocks: times are plain
milliseconds handed in by the edge. Names follow the seed (``slack_ms``,
``accelerator_ms``, ``live_token_ms``, ``privacy_cell``, ``ladder_step``).

Slack, from the seed: ``S = D - E - R_up - R_exec - R_fail`` (minus predicted
queue wait ahead of the request). The teaching request: 200 - 45 - 12 - 60 - 15
= 68 ms.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec


class Mode(StrEnum):
    ONLINE = "online"
    STREAMING = "streaming"
    ASYNC = "async"
    BATCH = "batch"


class Verdict(StrEnum):
    ADMIT = "admit"
    FALLBACK = "fallback"
    REJECT = "reject"


class Approximation(StrEnum):
    NONE = "none"
    FALLBACK = "fallback"
    REDUCED_OUTPUT = "reduced_output"


class Identity(msgspec.Struct, frozen=True, gc=False):
    """Who asks for what. ``tenant`` comes from the credential, never from the request."""

    request_id: str
    tenant: str
    request_class: str
    model: str  # logical model name the caller used
    model_version: str  # requested version, "" for the route's default
    operation: str  # "ModelInfer" | "ModelStreamInfer"
    mode: Mode
    privacy_cell: str
    risk_class: str = "standard"
    allow_fallback: bool = True
    operation_id: str = ""


# Shape buckets: inputs longer than the route's ``long_input_tokens`` are "long". The bucket is
# part of the batching-compatibility key, and dispatch keeps long work off the short lane.
SHORT_BUCKET = "short"
LONG_BUCKET = "long"


class Shape(msgspec.Struct, frozen=True, gc=False):
    items: int
    input_tokens: int
    max_output_tokens: int
    modality: str = "text"
    streaming: bool = False
    bucket: str = ""  # shape bucket name; part of the batching-compatibility key
    input_bytes: int = 0

    @property
    def long(self) -> bool:
        return self.bucket == LONG_BUCKET


class Demand(msgspec.Struct, frozen=True, gc=False):
    """Predicted demand of one execution on the chosen model version."""

    prefill_ms: float
    decode_ms: float
    host_cpu_ms: float = 0.0
    peak_memory_bytes: int = 0
    live_token_ms: float = 0.0
    correction: float = 1.0  # factor the estimator applied from observed work

    @property
    def accelerator_ms(self) -> float:
        return self.prefill_ms + self.decode_ms


class Budget(msgspec.Struct, frozen=True, gc=False):
    """The deadline and the reserves that spend it, in milliseconds."""

    deadline_ms: float  # D: end to end
    elapsed_ms: float  # E: already spent when the gateway saw the request
    reserve_upstream_ms: float  # R_up: unfinished upstream work
    reserve_exec_ms: float  # R_exec: predicted execution and response
    reserve_fail_ms: float  # R_fail: variance or one bounded recovery
    queue_wait_ms: float = 0.0  # predicted wait behind work already queued
    # A stream's (``Mode.STREAMING``) first-result objective and the predicted execution up
    # to its first result (prefill and one decode step); None/0 for unary work. A stream is
    # judged by its first result: its ``slack_ms`` and ``latest_start_ms`` are the first
    # result's; ``deadline_ms`` stays its completion deadline (gateway.core.streaming).
    first_result_deadline_ms: float | None = None
    reserve_first_result_ms: float = 0.0
    gap_objective_ms: float | None = None  # a stream's inter-result gap objective (None: none)

    @property
    def streaming(self) -> bool:
        return self.first_result_deadline_ms is not None

    @property
    def completion_slack_ms(self) -> float:
        """The seed's slack against the completion deadline (unary work's ``slack_ms``)."""
        return (
            self.deadline_ms
            - self.elapsed_ms
            - self.reserve_upstream_ms
            - self.reserve_exec_ms
            - self.reserve_fail_ms
            - self.queue_wait_ms
        )

    @property
    def first_result_slack_ms(self) -> float:
        """A stream's slack to its first result: ``D_first - E - R_up - R_first - R_fail`` minus
        the predicted wait (unary work: its completion slack)."""
        if self.first_result_deadline_ms is None:
            return self.completion_slack_ms
        return (
            self.first_result_deadline_ms
            - self.elapsed_ms
            - self.reserve_upstream_ms
            - self.reserve_first_result_ms
            - self.reserve_fail_ms
            - self.queue_wait_ms
        )

    @property
    def slack_ms(self) -> float:
        """What admission judges: the completion slack, or a stream's first-result slack."""
        if self.first_result_deadline_ms is None:
            return self.completion_slack_ms
        return self.first_result_slack_ms

    @property
    def remaining_ms(self) -> float:
        return self.deadline_ms - self.elapsed_ms

    @property
    def latest_start_ms(self) -> float:
        """Milliseconds after the request arrived by which it must start on a device: the
        deadline less its predicted execution and response and its variance reserve. The
        queue holds a request no longer than this (a request started later could only finish
        inside the variance reserve, and its answer still has to travel back). A stream's is
        its first result's: its first-result deadline less its prefill and first step."""
        if self.first_result_deadline_ms is not None:
            return self.first_result_deadline_ms - self.reserve_first_result_ms - self.reserve_fail_ms
        return self.deadline_ms - self.reserve_exec_ms - self.reserve_fail_ms


class RequestRecord(msgspec.Struct, frozen=True, gc=False):
    identity: Identity
    shape: Shape
    demand: Demand
    budget: Budget
    ladder_step: int = 0

    def replace(self, **changes: Any) -> RequestRecord:
        return msgspec.structs.replace(self, **changes)


class Decision(msgspec.Struct, frozen=True, gc=False):
    """What admission decided for one record, and why."""

    verdict: Verdict
    target_model: str  # logical model that will execute (the fallback's, if routed there)
    route_reason: str
    approximation: Approximation = Approximation.NONE
    rules: tuple[str, ...] = ()
    shadow_rules: tuple[str, ...] = ()
    policy_version: str = ""
    max_output_tokens: int | None = None  # set when a rule reduced the output limit
    status: str = ""  # gRPC status name of a rejection
    message: str = ""  # caller-facing reason of a rejection
    retry_after_ms: int | None = None
    # The ladder step that decided: the pool the request asked for (its primary's), also
    # when it was answered by the fallback (whose own pool's step is the record's).
    ladder_step: int = 0
    # Why the warm fallback could not take this request as asked ("" when it could, or was
    # not wanted): its limits or tensors (``admission.fallback_misfit``); in the decision log.
    fallback_refused: str = ""


class Outcome(msgspec.Struct, frozen=True, gc=False):
    """What happened: observed work, corrected charge, latency, failure state."""

    admitted: bool
    status: str  # "OK" or a gRPC status name
    rule: str = ""
    backend_model: str = ""
    approximation: Approximation = Approximation.NONE
    complete: bool = True
    queue_ms: float = 0.0  # arrival to dispatch
    first_result_ms: float = 0.0  # dispatch to the first result (a stream's first token; unary: = completion)
    completion_ms: float = 0.0  # dispatch to the last result
    observed_accelerator_ms: float = 0.0
    charged_accelerator_ms: float = 0.0
    charged_live_token_ms: float = 0.0
    output_tokens: int = 0
    failure: str = ""
