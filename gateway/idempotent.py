"""Online idempotency at the edge: a ModelInfer request carrying ``orchid.operation_id``.

``gateway.core.idempotency`` decides (its rules); this module does the awaiting. The first
attempt runs as a task of its own, so that a caller who gives up (a client timeout, a
dropped connection) does not cancel it: the retry that follows joins it, or, once it has
answered, collects the same answer. Every caller, the first included, waits for that task
only as long as its own deadline allows.

An answer a retry gets from an earlier attempt (joined or replayed) is that attempt's
answer byte for byte, with two changes: the response ``id`` is the retry's own, and
``orchid.operation_reused`` is true. It is not admitted, queued or charged again: the
first attempt's provenance (``orchid.request_id``, ``orchid.charged_accelerator_ms``) says
what ran, once.

Streams (ModelStreamInfer) and jobs are not covered here: the jobs service has its own
operation ids; a stream request's ``orchid.operation_id`` is carried into provenance only.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import TypeAlias

from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.core.errors import AlreadyExists, DeadlineExpired, ResourceExhausted
from gateway.core.idempotency import OperationTable, Step

OPERATION_ID = "orchid.operation_id"
REUSED = "orchid.operation_reused"
CONFLICT_RULE = "operation.id_reused"
GONE_RULE = "operation.completed"
FULL_RULE = "operation.table_full"

Response: TypeAlias = service_pb2.ModelInferResponse


def request_fingerprint(request: service_pb2.ModelInferRequest) -> bytes:
    """A hash of everything the caller sent but the operation id and the request ``id``
    (which a client may number per attempt): model, version, tensors, parameters."""
    copy = service_pb2.ModelInferRequest()
    copy.CopyFrom(request)
    copy.id = ""
    del copy.parameters[OPERATION_ID]
    return hashlib.blake2b(copy.SerializeToString(deterministic=True), digest_size=16).digest()


class OnlineOperations:
    """The operation ids of this gateway's online requests, and their first attempts' tasks."""

    def __init__(self, table: OperationTable | None = None) -> None:
        self.table = table or OperationTable()
        self._running: dict[tuple[str, str], asyncio.Task[Response]] = {}
        self.joined = 0  # retries that joined an attempt in flight
        self.replayed = 0  # retries answered from a completed attempt

    async def run(
        self,
        tenant: str,
        operation_id: str,
        request: service_pb2.ModelInferRequest,
        *,
        deadline_at: float | None,
        attempt: Callable[[], Awaitable[Response]],
    ) -> Response:
        """Answer ``request`` once per (tenant, operation id). ``attempt`` runs the request
        path; ``deadline_at`` (loop clock; None: none) bounds this caller's wait."""
        key = (tenant, operation_id)
        begun = self.table.begin(tenant, operation_id, request_fingerprint(request), clock.now())
        if begun.step is Step.START:
            task = asyncio.ensure_future(self._first(key, attempt))
            task.add_done_callback(_retrieve)
            self._running[key] = task
            return await _wait(task, deadline_at)
        if begun.step is Step.JOIN:
            self.joined += 1
            return _reused(await _wait(self._running[key], deadline_at), request)
        if begun.step is Step.REPLAY:
            assert begun.answer is not None
            self.replayed += 1
            return _reused(service_pb2.ModelInferResponse.FromString(begun.answer), request)
        if begun.step is Step.FULL:
            raise ResourceExhausted(begun.message, rule=FULL_RULE, retry_after_ms=begun.retry_after_ms)
        rule = CONFLICT_RULE if begun.step is Step.CONFLICT else GONE_RULE
        raise AlreadyExists(begun.message, rule=rule)

    async def _first(self, key: tuple[str, str], attempt: Callable[[], Awaitable[Response]]) -> Response:
        try:
            response = await attempt()
        except BaseException:
            self.table.fail(*key)
            raise
        else:
            self.table.finish(*key, response.SerializeToString(), clock.now())
            return response
        finally:
            self._running.pop(key, None)


async def _wait(task: asyncio.Task[Response], deadline_at: float | None) -> Response:
    """The attempt's answer, or DEADLINE_EXCEEDED at this caller's deadline (the attempt runs on)."""
    timeout = None if deadline_at is None else max(0.0, deadline_at - clock.now())
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        raise DeadlineExpired(
            "the operation is still running; retry with the same orchid.operation_id to collect its answer"
        ) from None


def _reused(response: Response, request: service_pb2.ModelInferRequest) -> Response:
    out = service_pb2.ModelInferResponse()
    out.CopyFrom(response)
    out.id = request.id
    out.parameters[REUSED].bool_param = True
    return out


def _retrieve(task: asyncio.Task[Response]) -> None:
    # The attempt's error reached its callers (or none was left waiting): not a loop warning.
    if not task.cancelled():
        task.exception()
