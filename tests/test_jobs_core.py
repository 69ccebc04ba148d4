"""The job state machine, bounds, retry arithmetic and trough pacing (``gateway.core.jobs``),
driven with explicit times."""

from __future__ import annotations

import pytest

from gateway.core.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from gateway.core.jobs import (
    AttemptAction,
    Counts,
    DeclaredOutput,
    ItemStatus,
    JobLimits,
    Kind,
    OpStatus,
    OutputFacts,
    TroughPacer,
    after_attempt,
    backoff_s,
    check_submit,
    classify,
    operation_status,
    same_submission,
    validate_outputs,
)

LIMITS = JobLimits(
    max_queued_per_tenant=100,
    max_payload_bytes=1000,
    max_batch_items=10,
    default_complete_within_s=60,
    max_complete_within_s=600,
    max_attempts=3,
    backoff_base_s=0.5,
    backoff_max_s=3.0,
)


def submit(**changes: object) -> float:
    args: dict[str, object] = {
        "payload_bytes": 10,
        "items": 1,
        "queued_for_tenant": 0,
        "complete_within_s": 0.0,
        "operation_id": "",
    }
    args.update(changes)
    return check_submit(LIMITS, **args)  # type: ignore[arg-type]


def test_submit_bounds() -> None:
    assert submit() == 60
    assert submit(complete_within_s=120) == 120
    with pytest.raises(InvalidArgument, match="1001 bytes; the limit is 1000"):
        submit(payload_bytes=1001)
    with pytest.raises(InvalidArgument, match="11 items"):
        submit(items=11)
    with pytest.raises(InvalidArgument, match="over the limit"):
        submit(complete_within_s=601)
    with pytest.raises(InvalidArgument, match="non-negative"):
        submit(complete_within_s=-1)
    with pytest.raises(InvalidArgument, match="operation_id"):
        submit(operation_id="k" * 129)
    with pytest.raises(ResourceExhausted) as full:
        submit(queued_for_tenant=95, items=6)
    assert full.value.rule == "jobs.max_queued_per_tenant"
    assert submit(queued_for_tenant=95, items=5) == 60


def test_idempotency_comparison() -> None:
    assert same_submission("k", "abc", "abc")
    with pytest.raises(AlreadyExists, match="'k'"):
        same_submission("k", "abc", "abd")


def test_attempt_classification_and_backoff() -> None:
    assert classify("RESOURCE_EXHAUSTED", "ladder.defer_batch") is AttemptAction.DEFER
    assert classify("RESOURCE_EXHAUSTED", "quota.tokens") is AttemptAction.DEFER
    assert classify("DEADLINE_EXCEEDED", "queue.latest_start") is AttemptAction.RETRY
    assert classify("UNAVAILABLE", "") is AttemptAction.RETRY
    assert classify("INVALID_ARGUMENT", "") is AttemptAction.FAIL
    assert classify("NOT_FOUND", "") is AttemptAction.FAIL
    assert [backoff_s(n, LIMITS) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    deferred = after_attempt(AttemptAction.DEFER, 1, LIMITS, now=100.0, retry_after_s=2.0)
    assert deferred == type(deferred)(ItemStatus.QUEUED, 1, 102.0)  # not counted
    retried = after_attempt(AttemptAction.RETRY, 0, LIMITS, now=100.0)
    assert (retried.status, retried.attempts, retried.next_attempt_at) == (ItemStatus.QUEUED, 1, 100.5)
    last = after_attempt(AttemptAction.RETRY, 2, LIMITS, now=100.0)
    assert (last.status, last.attempts) == (ItemStatus.FAILED, 3)
    failed = after_attempt(AttemptAction.FAIL, 0, LIMITS, now=100.0)
    assert (failed.status, failed.attempts) == (ItemStatus.FAILED, 1)


@pytest.mark.parametrize(
    ("kind", "counts", "cancel", "expired", "status"),
    [
        (Kind.BATCH, Counts(total=3, queued=3), False, False, OpStatus.QUEUED),
        (Kind.BATCH, Counts(total=3, queued=2, running=1), False, False, OpStatus.IN_PROGRESS),
        (Kind.BATCH, Counts(total=3, queued=2, completed=1), False, False, OpStatus.IN_PROGRESS),
        (Kind.BATCH, Counts(total=3, completed=2, failed=1), False, False, OpStatus.COMPLETED),
        (Kind.ASYNC, Counts(total=1, failed=1), False, False, OpStatus.FAILED),
        (Kind.ASYNC, Counts(total=1, completed=1), False, False, OpStatus.COMPLETED),
        (Kind.BATCH, Counts(total=3, running=1, cancelled=2), True, False, OpStatus.CANCELLING),
        (Kind.BATCH, Counts(total=3, completed=1, cancelled=2), True, False, OpStatus.CANCELLED),
        (Kind.BATCH, Counts(total=3, running=1, failed=2), False, True, OpStatus.IN_PROGRESS),
        (Kind.BATCH, Counts(total=3, completed=1, failed=2), False, True, OpStatus.EXPIRED),
    ],
)
def test_operation_status(kind: Kind, counts: Counts, cancel: bool, expired: bool, status: OpStatus) -> None:
    assert operation_status(kind, counts, cancel_requested=cancel, expired=expired) is status


def test_output_validation() -> None:
    good = OutputFacts("OUTPUT_IDS", "INT32", (1, 8), 32)
    ids = DeclaredOutput("OUTPUT_IDS", "INT32", (-1, -1))
    assert validate_outputs((good,), (ids,)) is None
    assert "missing" in (validate_outputs((good,), (ids, DeclaredOutput("SCORES", "FP32", (-1,)))) or "")
    assert "declares INT64" in (
        validate_outputs((good,), (DeclaredOutput("OUTPUT_IDS", "INT64", (-1, -1)),)) or ""
    )
    assert "declares [-1]" in (
        validate_outputs((good,), (DeclaredOutput("OUTPUT_IDS", "INT32", (-1,)),)) or ""
    )
    assert "declares [-1, 4]" in (
        validate_outputs((good,), (DeclaredOutput("OUTPUT_IDS", "INT32", (-1, 4)),)) or ""
    )
    assert "needs 32" in (validate_outputs((OutputFacts("OUTPUT_IDS", "INT32", (1, 8), 31),), ()) or "")
    assert "unknown datatype" in (validate_outputs((OutputFacts("X", "INT3", (1,), 4),), ()) or "")
    assert validate_outputs((), ()) == "the response has no outputs"
    assert (
        validate_outputs((OutputFacts("S", "BYTES", (2,), 17),), (DeclaredOutput("S", "BYTES", (-1,)),))
        is None
    )


def test_trough_pacer_fills_only_idle_protected_capacity() -> None:
    pacer = TroughPacer(fill=0.9, burst_ms=500.0)
    # Protected 2,800 ms/s, interactive 2,240 (80 %): 560 idle, 504 usable.
    pacer.refill(0.0, protected_ms_per_s=2800.0, other_ms_per_s=2240.0)
    assert pacer.idle_ms_per_s == pytest.approx(504.0)
    assert pacer.may_start(deferred=False, running=0)
    assert not pacer.may_start(deferred=False, running=1)  # 504 ms/s is less than one device
    pacer.spend(252.0)  # in debt: half a second of idle capacity
    assert not pacer.may_start(deferred=False, running=0)
    assert pacer.wait_s() == pytest.approx(0.5)
    pacer.refill(0.5, protected_ms_per_s=2800.0, other_ms_per_s=2240.0)
    assert pacer.may_start(deferred=False, running=0)
    assert not pacer.may_start(deferred=True, running=0)  # ladder step 4: deferred
    assert not pacer.may_start(deferred=False, running=0, device_idle=False)  # never queues ahead
    # Interactive at or above the envelope leaves nothing.
    pacer.refill(1.0, protected_ms_per_s=2800.0, other_ms_per_s=2900.0)
    assert not pacer.may_start(deferred=False, running=0) and pacer.wait_s() == 0.0
    # An idle pool: up to the idle devices' worth at once; the bucket holds at most the burst.
    pacer.refill(100.0, protected_ms_per_s=2800.0, other_ms_per_s=0.0)
    assert pacer.tokens_ms == 500.0
    assert pacer.may_start(deferred=False, running=2) and not pacer.may_start(deferred=False, running=3)


def test_jobs_configuration_is_checked() -> None:
    import yaml
    from pydantic import ValidationError

    from gateway.config import GatewayConfig, JobsConfig
    from tests.conftest import EXAMPLE_CONFIG

    base = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    GatewayConfig.model_validate({**base, "jobs": {"state_dir": "state"}})
    with pytest.raises(
        ValidationError, match="jobs class 'interactive' must be one of classes and of batch_classes"
    ):
        GatewayConfig.model_validate({**base, "jobs": {"state_dir": "state", "classes": ["interactive"]}})
    with pytest.raises(ValidationError, match="store postgres needs postgres_dsn"):
        JobsConfig(store="postgres")
    with pytest.raises(ValidationError, match="store sqlite needs state_dir"):
        JobsConfig()
