"""The one translation from what went wrong to a gRPC status, at the edge.

``to_status`` turns any exception raised while serving a call into the status,
message and trailing metadata the caller sees:

* a domain ``GatewayError``: its status by name, its message, ``orchid-rule`` and
  ``retry-after-ms``;
* a backend's own gRPC error the backend edge did not translate: UNAVAILABLE;
* anything else is a bug: INTERNAL with a fixed message, logged with its type and
  traceback but never with the request's payload or the exception's text (which may
  quote it).

``protocol`` (inference service) and ``admin`` (admin service) both use it, so the two
services cannot disagree about an error's status.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import grpc

from gateway.core.errors import GatewayError, Internal, Unavailable

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal gateway error"  # all a caller learns of a bug


@dataclass(frozen=True, slots=True)
class Status:
    code: grpc.StatusCode
    message: str
    trailing_metadata: tuple[tuple[str, str], ...]
    rule: str


def grpc_code(error: GatewayError) -> grpc.StatusCode:
    return grpc.StatusCode[error.status]


def domain_error(exc: BaseException, *, where: str) -> GatewayError:
    """The domain error an exception stands for (see the module docstring)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        log.warning("backend error on %s: %s", where, exc.code())
        return Unavailable("backend unavailable")
    # The type and the stack, not str(exc): an exception's text may quote request data. (A
    # logged exc_info would print that text, so the frames are formatted without it.)
    frames = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
    log.error("internal error in %s: %s\n%s", where, type(exc).__name__, frames)
    return Internal(INTERNAL_MESSAGE)


def to_status(exc: BaseException, *, where: str) -> Status:
    error = domain_error(exc, where=where)
    return Status(grpc_code(error), error.message, error.trailing_metadata(), error.rule or "")
