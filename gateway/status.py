"""The one translation from what went wrong to a gRPC status, at the edge.

``to_status`` turns any exception raised while serving a call into the status,
message and trailing metadata the caller sees:

* a domain ``GatewayError``: its status by name, its message, ``orchid-rule`` and
  ``retry-after-ms``;
* a backend's own gRPC error the backend edge did not translate: UNAVAILABLE;
* anything else is a bug: INTERNAL with a fixed message, logged with its type and
  traceback but never with the request's payload or the exception's text (which may
  quote it).

Every message a caller sees is bounded here, whoever wrote it (``bounded``): a quoted
caller-chosen name (model, version, input, parameter or class name) shows at most
``NAME_BOUND`` characters and ends in ``…`` when cut, and the whole message is at most
``MESSAGE_BOUND`` bytes of UTF-8. A gRPC status message travels in a trailer, and
clients refuse trailers over 16 KB: an echoed 64 KB model name would otherwise turn
NOT_FOUND into RESOURCE_EXHAUSTED. ``shown`` is the same bound for code that writes a
caller's name into a message.

``protocol`` (inference service) and ``admin`` (admin service) both use it, so the two
services cannot disagree about an error's status.
"""

from __future__ import annotations

import ast
import logging
import re
import traceback
from dataclasses import dataclass

import grpc

from gateway.core.errors import GatewayError, Internal, Unavailable

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal gateway error"  # all a caller learns of a bug

NAME_BOUND = 128  # characters of one caller-chosen name a message shows
MESSAGE_BOUND = 1024  # bytes (UTF-8) of a whole message a caller sees
ELLIPSIS = "\u2026"  # marks a name or message that was cut

# A quoted name as ``{name!r}`` writes it: single or double quotes, backslash escapes. The
# opening quote follows no word character, so a prose apostrophe ("backend's") opens none.
_QUOTED = re.compile(r"""(?<!\w)(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""")


def shown(name: str) -> str:
    """``repr(name)`` as a message shows it: at most ``NAME_BOUND`` characters of the name,
    then ``…`` if it was longer."""
    if len(name) > NAME_BOUND:
        name = name[:NAME_BOUND] + ELLIPSIS
    return repr(name)


def _shorten(match: re.Match[str]) -> str:
    quoted = match.group(0)
    if len(quoted) <= NAME_BOUND + 2:
        return quoted
    try:
        name = ast.literal_eval(quoted)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        name = None
    if isinstance(name, str):
        return shown(name)
    return quoted[: NAME_BOUND + 1] + ELLIPSIS + quoted[0]


def bounded(message: str) -> str:
    """The message a caller may see: every quoted name cut to ``NAME_BOUND`` characters, the
    whole cut to ``MESSAGE_BOUND`` bytes of UTF-8 (see the module docstring)."""
    message = _QUOTED.sub(_shorten, message)
    data = message.encode("utf-8")
    if len(data) <= MESSAGE_BOUND:
        return message
    keep = MESSAGE_BOUND - len(ELLIPSIS.encode("utf-8"))
    return data[:keep].decode("utf-8", "ignore") + ELLIPSIS


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
    return Status(grpc_code(error), bounded(error.message), error.trailing_metadata(), error.rule or "")
