"""The domain error tree, and the one mapping between it and status names.

Every refusal the gateway makes is one of these errors. Each class carries the
name of its gRPC status (a plain string: the core imports no grpc);
``gateway.status`` is the only place that turns an error, or any unexpected
exception, into a gRPC status plus trailing metadata (``orchid-rule``,
``retry-after-ms``). ``error_for_status`` is the only way back from a status
name (a policy rule's ``deny`` status) to an error class. Messages are for the
caller: they never name another tenant, a backend address or payload bytes.

    GatewayError
    ├── Unauthenticated          UNAUTHENTICATED   no or unknown credential
    ├── PermissionDenied         PERMISSION_DENIED model/cell/class not allowed, admin RPC
    ├── InvalidArgument          INVALID_ARGUMENT  bad shape, dtype, parameter, size
    ├── NotFound                 NOT_FOUND         unknown model (or one the tenant may not see)
    ├── AlreadyExists            ALREADY_EXISTS    an idempotency key reused for a different request
    ├── ResourceExhausted        RESOURCE_EXHAUSTED quota, overload shedding, queue full
    ├── FailedPrecondition       FAILED_PRECONDITION an admin operation the state does not allow
    ├── DeadlineInfeasible       DEADLINE_EXCEEDED predicted completion misses the deadline
    ├── Unavailable              UNAVAILABLE       no warm compatible backend, backend down
    ├── Cancelled                CANCELLED         the caller went away
    └── Internal                 INTERNAL          a bug or an unexpected backend answer
"""

from __future__ import annotations

from collections.abc import Mapping


class GatewayError(Exception):
    """Base of the tree. ``rule`` names the deciding rule id when a rule decided."""

    status: str = "INTERNAL"

    def __init__(self, message: str, *, rule: str | None = None, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.rule = rule
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        metadata: list[tuple[str, str]] = []
        if self.rule:
            metadata.append(("orchid-rule", self.rule))
        if self.retry_after_ms is not None:
            metadata.append(("retry-after-ms", str(max(0, int(self.retry_after_ms)))))
        return tuple(metadata)


class Unauthenticated(GatewayError):
    status = "UNAUTHENTICATED"


class PermissionDenied(GatewayError):
    status = "PERMISSION_DENIED"


class InvalidArgument(GatewayError):
    status = "INVALID_ARGUMENT"


class NotFound(GatewayError):
    status = "NOT_FOUND"


class AlreadyExists(GatewayError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(GatewayError):
    """An admin operation the current state does not allow (e.g. a rollout whose two versions
    do not fit, or a promote while nothing is rolling out)."""

    status = "FAILED_PRECONDITION"


class ResourceExhausted(GatewayError):
    status = "RESOURCE_EXHAUSTED"


class DeadlineInfeasible(GatewayError):
    status = "DEADLINE_EXCEEDED"


class Unavailable(GatewayError):
    status = "UNAVAILABLE"


class Cancelled(GatewayError):
    status = "CANCELLED"


class Internal(GatewayError):
    status = "INTERNAL"


class ConfigError(Exception):
    """A configuration or data file is invalid. Not a request error: raised at load time.

    ``location`` is ``file`` or ``file:line:col``; ``key`` the dotted key path.
    """

    def __init__(self, location: str, key: str, problem: str) -> None:
        self.location = location
        self.key = key
        self.problem = problem
        where = f"{location}: {key}" if key else location
        super().__init__(f"{where}: {problem}")


class DeadlineExpired(GatewayError):
    """The deadline passed while the request was queued or executing (not decided at admission)."""

    status = "DEADLINE_EXCEEDED"


_BY_STATUS: Mapping[str, type[GatewayError]] = {
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "ALREADY_EXISTS": AlreadyExists,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "FAILED_PRECONDITION": FailedPrecondition,
    "DEADLINE_EXCEEDED": DeadlineInfeasible,
    "UNAVAILABLE": Unavailable,
    "CANCELLED": Cancelled,
    "INTERNAL": Internal,
}


def error_for_status(status: str) -> type[GatewayError]:
    """The error class a decision's status name maps to (a policy ``deny`` status, an
    admission verdict). An unknown name is a bug upstream: INTERNAL, never a silent allow."""
    return _BY_STATUS.get(status, Internal)
