"""``gateway.status.to_status`` is the one translation from an exception to a gRPC status: a
domain error keeps its status, rule and retry-after; anything else is INTERNAL with a fixed
message, and neither the caller nor the log sees the exception's text."""

from __future__ import annotations

import logging

import grpc
import pytest

from gateway.core.errors import (
    DeadlineInfeasible,
    GatewayError,
    Internal,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from gateway.status import INTERNAL_MESSAGE, to_status


@pytest.mark.parametrize(
    ("error", "code", "metadata"),
    [
        (
            ResourceExhausted("quota exhausted", rule="quota-accelerator-ms", retry_after_ms=37),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            (("orchid-rule", "quota-accelerator-ms"), ("retry-after-ms", "37")),
        ),
        (
            DeadlineInfeasible("misses the deadline", rule="deadline-infeasible"),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            (("orchid-rule", "deadline-infeasible"),),
        ),
        (PermissionDenied("admin only"), grpc.StatusCode.PERMISSION_DENIED, ()),
        (Unauthenticated("unknown credential"), grpc.StatusCode.UNAUTHENTICATED, ()),
        (NotFound("unknown model 'x'"), grpc.StatusCode.NOT_FOUND, ()),
    ],
)
def test_a_domain_error_keeps_its_status_rule_and_retry_after(
    error: GatewayError, code: grpc.StatusCode, metadata: tuple[tuple[str, str], ...]
) -> None:
    status = to_status(error, where="test")
    assert status.code is code
    assert status.message == error.message
    assert status.trailing_metadata == metadata
    assert status.rule == (error.rule or "")


def _raise_with_payload(payload: str) -> None:
    raise RuntimeError(payload)  # as a bug might, quoting request data


def test_an_unknown_exception_is_internal_without_its_text(caplog: pytest.LogCaptureFixture) -> None:
    try:
        _raise_with_payload("secret " + "payload")
    except RuntimeError as exc:
        with caplog.at_level(logging.ERROR, logger="gateway.status"):
            status = to_status(exc, where="ModelInfer")
    assert status.code is grpc.StatusCode.INTERNAL
    assert status.message == INTERNAL_MESSAGE == "internal gateway error"
    assert "secret payload" not in status.message
    assert status.trailing_metadata == () and status.rule == ""
    # The log names the type and where it was raised, never the text.
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "RuntimeError" in logged and "_raise_with_payload" in logged and "ModelInfer" in logged
    assert "secret payload" not in caplog.text


def test_internal_as_a_domain_error_is_not_rewritten() -> None:
    status = to_status(Internal("unexpected backend answer"), where="test")
    assert (status.code, status.message) == (grpc.StatusCode.INTERNAL, "unexpected backend answer")


def test_a_quoted_name_is_cut_to_the_bound_and_marked() -> None:
    from gateway.status import ELLIPSIS, NAME_BOUND, bounded, shown

    name = "n\x00'" * 30000  # escapes, a quote inside: repr switches to double quotes
    message = bounded(f"unknown version {name!r} of model {'m' * 70000!r}")
    assert message == f"unknown version {shown(name)} of model {shown('m' * 70000)}"
    assert shown("m" * 70000) == repr("m" * NAME_BOUND + ELLIPSIS)
    assert shown(name) == repr(name[:NAME_BOUND] + ELLIPSIS)
    # Short names and prose apostrophes are left alone; to_status applies the bound.
    prose = "this operation is not available through the gateway; use the backend's admin port"
    assert bounded(prose) == prose and bounded("unknown model 'gpt-17'") == "unknown model 'gpt-17'"
    status = to_status(NotFound(f"unknown model {'x' * 65536!r}"), where="test")
    assert status.message == f"unknown model {shown('x' * 65536)}"


def test_a_whole_message_is_cut_to_its_byte_bound() -> None:
    from gateway.status import ELLIPSIS, MESSAGE_BOUND, bounded

    for filler in ("1, ", "\u00e9", "\U0001f600"):  # 1-, 2- and 4-byte UTF-8
        message = bounded("shape [" + filler * 20000 + "]")
        assert len(message.encode("utf-8")) <= MESSAGE_BOUND and message.endswith(ELLIPSIS)
        assert message.startswith("shape [" + filler * 10)
