"""The domain error tree, and its single translation to gRPC status.

Every refusal the gateway makes is one of these errors. Each class knows its
gRPC status code; ``protocol`` is the only place that turns them into a status
plus trailing metadata (``orchid-rule``, ``retry-after-ms``). Messages are for
the caller: they never name another tenant, a backend address or payload bytes.

    GatewayError
    ├── Unauthenticated          UNAUTHENTICATED   no or unknown credential
    ├── PermissionDenied         PERMISSION_DENIED model/cell/class not allowed, admin RPC
    ├── InvalidArgument          INVALID_ARGUMENT  bad shape, dtype, parameter, size
    ├── NotFound                 NOT_FOUND         unknown model (or one the tenant may not see)
    ├── ResourceExhausted        RESOURCE_EXHAUSTED quota, overload shedding, queue full
    ├── DeadlineInfeasible       DEADLINE_EXCEEDED predicted completion misses the deadline
    ├── Unavailable              UNAVAILABLE       no warm compatible backend, backend down
    ├── Cancelled                CANCELLED         the caller went away
    └── Internal                 INTERNAL          a bug or an unexpected backend answer
"""

from __future__ import annotations

import grpc


class GatewayError(Exception):
    """Base of the tree. ``rule`` names the deciding rule id when a rule decided."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL

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
    status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(GatewayError):
    status = grpc.StatusCode.PERMISSION_DENIED


class InvalidArgument(GatewayError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GatewayError):
    status = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(GatewayError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineInfeasible(GatewayError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(GatewayError):
    status = grpc.StatusCode.UNAVAILABLE


class Cancelled(GatewayError):
    status = grpc.StatusCode.CANCELLED


class Internal(GatewayError):
    status = grpc.StatusCode.INTERNAL


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

    status = grpc.StatusCode.DEADLINE_EXCEEDED
