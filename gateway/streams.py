"""ModelStreamInfer: one client stream multiplexed onto one backend stream per backend.

Each request on a client stream is admitted on its own by the ``Gateway``, waits for a
dispatch slot like any other request and holds it until its final response; a refused
request answers with an error reply and the stream goes on (see ``StreamSession``).

Every message carries the request's running state: a partial response says
``orchid.complete=false``; the final response (sent when the caller asked for it with
``triton_enable_empty_final_response``) says whether the answer completed; a request
that fails midway ends with an error reply that says ``orchid.complete=false``. A
stream the caller cancels sends nothing more: what it sent said false.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.base import Backend
from gateway.core.errors import GatewayError, InvalidArgument, Unavailable
from gateway.core.record import Mode
from gateway.messages import attach_provenance, flag, flag_response, parse_infer_request, stream_error
from gateway.scheduler import Slot

if TYPE_CHECKING:
    from gateway.auth import Tenant
    from gateway.pipeline import Admitted, CallContext, Gateway


@dataclass(slots=True)
class _StreamRequest:
    """One request in flight on a stream."""

    admitted: Admitted
    client_id: str
    arrived: float
    wants_final: bool
    started: float = 0.0
    first_result: float | None = None  # when its first output arrived
    tokens: int = 0
    slot: Slot | None = None

    def release(self) -> None:
        if self.slot is not None:
            self.slot.release()
            self.slot = None


class StreamSession:
    """One client stream multiplexed onto one backend stream per backend.

    Each request on the stream is admitted on its own, waits for a dispatch slot
    like any other request, and holds it until its final response. Backend
    requests get gateway-assigned ids so responses match their record even when
    clients reuse or omit ids; the client's id is restored on the way back.
    """

    def __init__(self, gateway: Gateway, tenant: Tenant, call: CallContext) -> None:
        self.gateway = gateway
        self.tenant = tenant
        self.call = call
        self.out: asyncio.Queue[service_pb2.ModelStreamInferResponse | None] = asyncio.Queue(maxsize=1024)
        self.pending: dict[str, _StreamRequest] = {}
        self.backend_queues: dict[str, asyncio.Queue[service_pb2.ModelInferRequest | None]] = {}
        self.pumps: list[asyncio.Task[None]] = []
        self.dispatches: set[asyncio.Task[None]] = set()

    async def run(
        self, requests: AsyncIterator[bytes]
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while True:
                item = await self.out.get()
                if item is None:
                    break
                yield item
        finally:
            # Client gone or done: cancel everything, release every slot.
            reader.cancel()
            for task in (*self.pumps, *self.dispatches):
                task.cancel()
            await asyncio.gather(reader, *self.pumps, *self.dispatches, return_exceptions=True)
            now = clock.now()
            for entry in self.pending.values():
                entry.release()
                self.gateway.abandon(entry.admitted, started=entry.started, now=now)
            self.pending.clear()

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for raw in requests:
                await self._submit(raw)
            # Client half-closed: dispatch what is waiting, let the backends finish, then end.
            await asyncio.gather(*self.dispatches, return_exceptions=True)
            for queue in self.backend_queues.values():
                await queue.put(None)
            await asyncio.gather(*self.pumps, return_exceptions=True)
        finally:
            await self.out.put(None)

    async def _submit(self, raw: bytes) -> None:
        client_id = ""
        # Each request on a stream is its own arrival: its budget starts now, not when the
        # stream opened; the stream's own deadline (if any) still bounds it.
        arrived = clock.now()
        remaining = self.call.time_remaining_s
        call = dataclasses.replace(
            self.call,
            time_remaining_s=None if remaining is None else remaining - (arrived - self.call.received_at),
            received_at=arrived,
        )
        try:
            request = parse_infer_request(raw)
            client_id = request.id
            admitted = await self.gateway.admit(
                request, self.tenant, call, operation="ModelStreamInfer", mode=Mode.STREAMING
            )
        except GatewayError as error:
            await self._fail(error, client_id)
            return
        entry = _StreamRequest(
            admitted, client_id, arrived, flag(request, "triton_enable_empty_final_response")
        )
        task = asyncio.get_running_loop().create_task(self._dispatch(entry))
        self.dispatches.add(task)
        task.add_done_callback(self.dispatches.discard)

    async def _fail(self, error: GatewayError, client_id: str) -> None:
        self.gateway.listener.failed(error.status, error.rule or "")
        await self.out.put(stream_error(error, client_id))

    async def _dispatch(self, entry: _StreamRequest) -> None:
        admitted = entry.admitted
        try:
            entry.slot = await self.gateway.acquire(admitted)
        except BaseException as error:
            self.gateway.abandon(admitted, started=None, now=clock.now())
            if isinstance(error, GatewayError):
                await self._fail(error, entry.client_id)
                return
            raise
        entry.started = clock.now()
        self.gateway._dispatched(
            admitted, dwell_ms=(entry.started - entry.arrived) * 1000.0, now=entry.started
        )
        internal_id = uuid.uuid4().hex
        admitted.backend_request.id = internal_id
        self.pending[internal_id] = entry
        queue = self.backend_queues.get(admitted.backend.name)
        if queue is None:
            queue = asyncio.Queue()
            self.backend_queues[admitted.backend.name] = queue
            self.pumps.append(asyncio.get_running_loop().create_task(self._pump(admitted.backend, queue)))
        await queue.put(admitted.backend_request)

    async def _pump(
        self, backend: Backend, queue: asyncio.Queue[service_pb2.ModelInferRequest | None]
    ) -> None:
        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item

        call = backend.stream(requests(), timeout_s=self.call.time_remaining_s)
        try:
            # Ends when the backend has answered everything after our half-close.
            async for reply in call:
                await self._on_reply(reply)
        except Exception as exc:  # backend stream broke: fail every request still pending on it
            error = Unavailable(f"streaming backend failed ({type(exc).__name__})")
            for internal_id, entry in list(self.pending.items()):
                if entry.admitted.backend is backend:
                    del self.pending[internal_id]
                    entry.release()
                    self.gateway.abandon(entry.admitted, started=entry.started, now=clock.now())
                    await self._fail(error, entry.client_id)
        finally:
            call.cancel()

    async def _on_reply(self, reply: service_pb2.ModelStreamInferResponse) -> None:
        response = reply.infer_response
        entry = self.pending.get(response.id)
        if entry is None:
            return
        admitted = entry.admitted
        if reply.error_message:
            del self.pending[response.id]
            entry.release()
            self.gateway.abandon(admitted, started=entry.started, now=clock.now())
            logical = admitted.record.identity.model
            detail = reply.error_message.replace(admitted.route.backend_model, logical)
            error = InvalidArgument(f"model {logical!r}: {detail}")
            await self._fail(error, entry.client_id)
            return
        final = flag_response(response, "triton_final_response")
        has_output = len(response.outputs) > 0
        now = clock.now()
        if has_output:
            entry.tokens += 1
            if entry.first_result is None:
                entry.first_result = now
        if final:
            del self.pending[response.id]
            entry.release()
        # Partial responses carry the charge so far; only the final one teaches the estimator.
        settled = self.gateway.settle(
            admitted,
            queued_s=entry.started - entry.arrived,
            started=entry.started,
            finished=now,
            output_tokens=entry.tokens,
            learn=final,
            first_result=entry.first_result if entry.first_result is not None else now,
            finished_answer=final,
        )
        if final:
            self.gateway.listener.settled(settled)
        if has_output or (final and entry.wants_final):
            response.id = entry.client_id
            response.model_name = admitted.record.identity.model
            attach_provenance(response, settled)
            await self.out.put(reply)
