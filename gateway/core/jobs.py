"""Asynchronous and batch jobs: the state machine, bounds and pacing, as pure functions.

Owns what a durable operation *is* and how it moves, without storing or running anything
(``gateway.jobs`` does that at the edge): the operation and item statuses and how an
operation's status follows from its items, the submit bounds (payload bytes, items, queued
work per tenant, complete-by window, idempotency key) with their errors, the idempotency
comparison, what an attempt's failure means for an item (defer, retry with backoff, or
fail), expiry and result retention, the trough pacer that lets job work fill only the
capacity interactive work leaves below the protected envelope, and the validation of an
item's output against its model's declared outputs. Every function takes ``now``.

An operation is ``async`` (one item: one KServe request) or ``batch`` (one item per JSONL
line). Statuses follow the OpenAI Batch API's where they mean the same thing:

    queued -> in_progress -> completed | failed          (failed: async only; a batch
           \\-> cancelling -> cancelled                    completes with failed items)
           \\-> expired (complete-by passed; finished items keep their results)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from gateway.core.errors import AlreadyExists, InvalidArgument, ResourceExhausted


class Kind(StrEnum):
    ASYNC = "async"
    BATCH = "batch"


class OpStatus(StrEnum):
    VALIDATING = "validating"  # a batch's input is being parsed (before the durable commit)
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"  # every item is done; the output set is being validated and sealed
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset({OpStatus.COMPLETED, OpStatus.FAILED, OpStatus.EXPIRED, OpStatus.CANCELLED})


class ItemStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ITEM_DONE = frozenset({ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED})

MAX_OPERATION_ID_CHARS = 128
MAX_CUSTOM_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class JobLimits:
    """The bounds every submit and every attempt is held to (``jobs`` in gateway.yaml)."""

    max_queued_per_tenant: int = 10_000  # unfinished items per tenant
    max_payload_bytes: int = 4 * 1024 * 1024  # one request (async) or one JSONL snapshot (batch)
    max_batch_items: int = 50_000
    default_complete_within_s: float = 24 * 3600.0
    max_complete_within_s: float = 7 * 24 * 3600.0
    max_attempts: int = 3
    backoff_base_s: float = 0.5
    backoff_max_s: float = 60.0
    result_retention_s: float = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Counts:
    total: int
    completed: int = 0
    failed: int = 0
    queued: int = 0
    running: int = 0
    cancelled: int = 0


def check_submit(
    limits: JobLimits,
    *,
    payload_bytes: int,
    items: int,
    queued_for_tenant: int,
    complete_within_s: float,
    operation_id: str,
) -> float:
    """The complete-by window (seconds) of an acceptable submit; else the refusal.

    INVALID_ARGUMENT for what retrying cannot fix (too large, too many items, a bad window
    or key); RESOURCE_EXHAUSTED when the tenant already has too much unfinished work."""
    if len(operation_id) > MAX_OPERATION_ID_CHARS:
        raise InvalidArgument(f"operation_id is longer than {MAX_OPERATION_ID_CHARS} characters")
    if payload_bytes > limits.max_payload_bytes:
        raise InvalidArgument(
            f"job payload is {payload_bytes} bytes; the limit is {limits.max_payload_bytes} "
            "(jobs.max_payload_bytes)"
        )
    if items <= 0:
        raise InvalidArgument("a batch needs at least one request line")
    if items > limits.max_batch_items:
        raise InvalidArgument(f"batch has {items} items; the limit is {limits.max_batch_items}")
    if complete_within_s < 0 or complete_within_s != complete_within_s:
        raise InvalidArgument("complete_within_s must be a non-negative number of seconds")
    window = complete_within_s or limits.default_complete_within_s
    if window > limits.max_complete_within_s:
        raise InvalidArgument(
            f"complete_within_s {window:g} is over the limit of {limits.max_complete_within_s:g} s"
        )
    if queued_for_tenant + items > limits.max_queued_per_tenant:
        raise ResourceExhausted(
            f"this credential has {queued_for_tenant} unfinished job items; {items} more would pass "
            f"the limit of {limits.max_queued_per_tenant} (jobs.max_queued_per_tenant)",
            rule="jobs.max_queued_per_tenant",
        )
    return window


def same_submission(operation_id: str, stored_hash: str, submitted_hash: str) -> bool:
    """Idempotency: the same key with the same request is the same operation (True); the same
    key with a different request is refused with ALREADY_EXISTS naming the key."""
    if stored_hash == submitted_hash:
        return True
    raise AlreadyExists(
        f"operation_id {operation_id!r} was already used for a different request",
        rule="jobs.idempotency",
    )


class AttemptAction(StrEnum):
    DEFER = "defer"  # not the item's fault: back to the queue, the attempt not counted
    RETRY = "retry"  # counted; again after a backoff while attempts remain
    FAIL = "fail"  # retrying cannot help


DEFER_RULES = frozenset({"ladder.defer_batch"})
# Statuses a later attempt may succeed at (a straggler past its per-item deadline, a
# backend that went away, a bug) count as attempts.
RETRY_STATUSES = frozenset({"DEADLINE_EXCEEDED", "UNAVAILABLE", "INTERNAL", "CANCELLED", "UNKNOWN"})


def classify(status: str, rule: str) -> AttemptAction:
    """What an attempt's refusal or failure (its status name and deciding rule) means."""
    if rule in DEFER_RULES or status == "RESOURCE_EXHAUSTED":
        return AttemptAction.DEFER  # deferred by the ladder, quota, a full queue: capacity, not the item
    if status in RETRY_STATUSES:
        return AttemptAction.RETRY
    return AttemptAction.FAIL


def backoff_s(attempts: int, limits: JobLimits) -> float:
    """Delay before attempt ``attempts + 1``: exponential from ``backoff_base_s``, capped."""
    return float(min(limits.backoff_max_s, limits.backoff_base_s * (2 ** max(0, attempts - 1))))


@dataclass(frozen=True, slots=True)
class AttemptResult:
    status: ItemStatus
    attempts: int
    next_attempt_at: float


def after_attempt(
    action: AttemptAction, attempts: int, limits: JobLimits, *, now: float, retry_after_s: float = 0.0
) -> AttemptResult:
    """An item after a failed attempt (``attempts``: counted attempts before this one)."""
    if action is AttemptAction.DEFER:
        return AttemptResult(ItemStatus.QUEUED, attempts, now + max(retry_after_s, limits.backoff_base_s))
    counted = attempts + 1
    if action is AttemptAction.FAIL or counted >= limits.max_attempts:
        return AttemptResult(ItemStatus.FAILED, counted, now)
    return AttemptResult(ItemStatus.QUEUED, counted, now + backoff_s(counted, limits))


def operation_status(kind: Kind, counts: Counts, *, cancel_requested: bool, expired: bool) -> OpStatus:
    """An operation's status from its items (and whether it was cancelled or expired)."""
    unfinished = counts.queued + counts.running
    if cancel_requested:
        return OpStatus.CANCELLING if counts.running else OpStatus.CANCELLED
    if expired and unfinished == 0:
        return OpStatus.EXPIRED
    if unfinished == 0:
        if kind is Kind.ASYNC and counts.failed:
            return OpStatus.FAILED
        return OpStatus.COMPLETED
    if counts.running or counts.completed or counts.failed:
        return OpStatus.IN_PROGRESS
    return OpStatus.QUEUED


def results_expire_at(finished_at: float, limits: JobLimits) -> float:
    return finished_at + limits.result_retention_s


# ---------------------------------------------------------------------------- output validation

DTYPE_BYTES = {
    "BOOL": 1,
    "UINT8": 1,
    "INT8": 1,
    "UINT16": 2,
    "INT16": 2,
    "FP16": 2,
    "BF16": 2,
    "UINT32": 4,
    "INT32": 4,
    "FP32": 4,
    "UINT64": 8,
    "INT64": 8,
    "FP64": 8,
}


@dataclass(frozen=True, slots=True)
class OutputFacts:
    name: str
    datatype: str
    shape: tuple[int, ...]
    raw_bytes: int | None  # length of its raw content, None when not sent as raw bytes


@dataclass(frozen=True, slots=True)
class DeclaredOutput:
    """An output as the model's metadata declares it; -1 in ``shape`` is any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def validate_outputs(outputs: tuple[OutputFacts, ...], declared: tuple[DeclaredOutput, ...]) -> str | None:
    """Why an item's response is not a usable output (None: it is). Every output the model
    declares must be present with the declared datatype and the declared rank and fixed
    dimensions; every output must have a known datatype, a non-negative shape and exactly
    as many bytes as that shape and datatype need (BYTES: any length)."""
    present = {o.name: o for o in outputs}
    for spec in declared:
        got = present.get(spec.name)
        if got is None:
            return f"output {spec.name!r} missing from the response"
        if got.datatype != spec.datatype:
            return f"output {spec.name!r} is {got.datatype}; the model declares {spec.datatype}"
        if len(got.shape) != len(spec.shape) or any(
            want >= 0 and have != want for have, want in zip(got.shape, spec.shape, strict=True)
        ):
            return f"output {spec.name!r} has shape {list(got.shape)}; the model declares {list(spec.shape)}"
    if not outputs:
        return "the response has no outputs"
    for output in outputs:
        if any(d < 0 for d in output.shape):
            return f"output {output.name!r} has a negative dimension"
        if output.datatype == "BYTES":
            continue
        size = DTYPE_BYTES.get(output.datatype)
        if size is None:
            return f"output {output.name!r} has unknown datatype {output.datatype!r}"
        elements = 1
        for d in output.shape:
            elements *= d
        if output.raw_bytes is not None and output.raw_bytes != elements * size:
            return (
                f"output {output.name!r} has {output.raw_bytes} bytes; shape {list(output.shape)} of "
                f"{output.datatype} needs {elements * size}"
            )
    return None


# ---------------------------------------------------------------------------- trough pacing


@dataclass(slots=True)
class TroughPacer:
    """Lets job work use only the capacity interactive work leaves under the protected
    envelope of a pool: a bucket of accelerator-ms that fills at the idle rate (protected
    capacity minus the pool's non-job offered demand, times ``fill``) and is spent by each
    started item's predicted work. The bucket may go into debt (an item's price is known
    only once admitted), and nothing starts while it is in debt; it holds at most
    ``burst_ms``. While the ladder defers batch work (step 4 and above) nothing starts at
    all, never more items at once than the idle capacity has devices (at least one), and an
    item starts only onto a device that is idle now with nothing waiting for it: job work
    never queues in front of interactive work."""

    fill: float = 0.9
    burst_ms: float = 500.0
    device_ms_per_s: float = 1000.0  # one device's accelerator-ms per second
    tokens_ms: float = 0.0
    updated_at: float | None = None
    idle_ms_per_s: float = 0.0

    def refill(self, now: float, *, protected_ms_per_s: float, other_ms_per_s: float) -> None:
        self.idle_ms_per_s = max(0.0, protected_ms_per_s - other_ms_per_s) * self.fill
        if self.updated_at is not None and now > self.updated_at:
            self.tokens_ms = min(self.burst_ms, self.tokens_ms + self.idle_ms_per_s * (now - self.updated_at))
        self.updated_at = now

    def may_start(self, *, deferred: bool, running: int, device_idle: bool = True) -> bool:
        """May one more item start, with ``running`` items of this pool already running and
        (``device_idle``) a device free with no request waiting in the pool's queue?"""
        if deferred or not device_idle or self.idle_ms_per_s <= 0.0 or self.tokens_ms < 0.0:
            return False
        return running < max(1, math.ceil(self.idle_ms_per_s / self.device_ms_per_s))

    def spend(self, accelerator_ms: float) -> None:
        self.tokens_ms -= max(0.0, accelerator_ms)

    def wait_s(self) -> float:
        """How long until the bucket is out of debt at the current idle rate (inf: no idle)."""
        if self.tokens_ms >= 0.0:
            return 0.0
        if self.idle_ms_per_s <= 0.0:
            return float("inf")
        return -self.tokens_ms / self.idle_ms_per_s
