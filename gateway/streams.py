"""ModelStreamInfer: the request chain adapted to many results per request.

Each request on a client stream runs the chain's admission half on its own
(``RequestChain.admit``: resolve to reserve, with the ladder's shedding at step 5 and a
new stream judged by its first-result slack), then its ``wait`` stage (a dispatch slot,
with late rescue), then the stream form of ``execute``: it runs on a backend stream of
its own, with the shadow and rollout hooks, so one request can be cancelled alone (the
backend call is cancelled and Triton stops decoding it) and a canary that fails before
its first result is answered again by the current version. It settles once, at its
final response, failure or cancellation, never per result.

Every message carries the request's running state: a partial response carries only
what a partial answer needs (``orchid.complete=false``, ``orchid.request_id`` and the gap
before it, ``messages.attach_partial``); the final response (sent when the caller asked
for it with ``triton_enable_empty_final_response``) carries the whole provenance with the
stream's first result and gaps against their objectives (``gateway.core.streaming``); a
request that fails midway ends with an error reply that says ``orchid.complete=false``.

**Cancelling one request.** A message on the stream whose parameter ``orchid.cancel``
names the id of an earlier request on the same stream cancels that request alone: its
backend call is cancelled, its slot and state are freed, it settles by what it held, and
it ends with an error reply (CANCELLED) under its own id; the stream's other requests
go on. A stream the caller cancels sends nothing more: what it sent said false.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.base import BackendStream
from gateway.chain.wait import token_live_bytes
from gateway.core.errors import (
    Cancelled,
    DeadlineExpired,
    GatewayError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from gateway.core.memory import LIVE_TOKENS_RULE
from gateway.core.outputs import OUTPUT_CONTRACT_RULE
from gateway.core.record import Mode
from gateway.core.streaming import GapTracker, StreamObjectives
from gateway.exchange import Admitted, CallContext
from gateway.messages import (
    attach_partial,
    attach_provenance,
    flag,
    flag_response,
    parse_infer_request,
    partial_template,
    stream_error,
)
from gateway.outputs import INVALID_OUTPUTS, check_result
from gateway.scheduler import Slot

if TYPE_CHECKING:
    from gateway.auth import Tenant
    from gateway.chain import RequestChain

log = logging.getLogger(__name__)
CANCEL_PARAMETER = "orchid.cancel"
LIVE_RULE = LIVE_TOKENS_RULE  # the rule a stream that outgrew its device ends with
MAX_PENDING = 1024  # requests in flight on one client stream; more are refused (RESOURCE_EXHAUSTED)


class InvalidCanaryResult(Internal):
    """A streaming canary's result outside its declared outputs (withheld from the caller)."""


@dataclass(slots=True, eq=False)
class _StreamRequest:
    """One request in flight on a stream."""

    request: service_pb2.ModelInferRequest
    admitted: Admitted
    client_id: str
    call: CallContext
    wants_final: bool
    tracker: GapTracker
    template: service_pb2.ModelInferResponse  # partial responses' provenance (``partial_template``)
    token_bytes: int  # live state each generated token adds (``Slot.grow_live``)
    started: float = 0.0
    slot: Slot | None = None
    backend_call: BackendStream | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    done: bool = False

    def release(self) -> None:
        if self.slot is not None:
            self.slot.release()
            self.slot = None


class StreamSession:
    """One client stream: each request admitted on its own, each on a backend stream of its own.

    Backend requests get gateway-assigned ids so a response matches its request even when
    clients reuse or omit ids; the client's id is restored on the way back.
    """

    def __init__(self, chain: RequestChain, tenant: Tenant, call: CallContext) -> None:
        self.chain = chain
        self.tenant = tenant
        self.call = call
        self.out: asyncio.Queue[service_pb2.ModelStreamInferResponse | None] = asyncio.Queue(maxsize=1024)
        self.requests: dict[str, _StreamRequest] = {}  # by client id, while in flight

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
            running = [e.task for e in self.requests.values() if e.task is not None]
            for task in running:
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)
            now = clock.now()
            for entry in list(self.requests.values()):
                self._end(entry, now=now)
            self.requests.clear()

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for raw in requests:
                await self._submit(raw)
            # Client half-closed: let every request in flight finish (a canary answered again
            # starts another task), then end.
            while running := [
                e.task for e in list(self.requests.values()) if e.task is not None and not e.task.done()
            ]:
                await asyncio.gather(*running, return_exceptions=True)
        finally:
            await self.out.put(None)

    def _call(self) -> CallContext:
        # Each request on a stream is its own arrival: its budget starts now, not when the
        # stream opened; the stream's own deadline (if any) still bounds it.
        arrived = clock.now()
        remaining = self.call.time_remaining_s
        return msgspec.structs.replace(
            self.call,
            time_remaining_s=None if remaining is None else remaining - (arrived - self.call.received_at),
            received_at=arrived,
        )

    async def _submit(self, raw: bytes) -> None:
        client_id = ""
        call = self._call()
        try:
            request = parse_infer_request(raw)
            client_id = request.id
            if CANCEL_PARAMETER in request.parameters:
                await self._cancel(request.parameters[CANCEL_PARAMETER].string_param, client_id)
                return
            if len(self.requests) >= MAX_PENDING:
                raise ResourceExhausted(f"at most {MAX_PENDING} requests may be in flight on one stream")
            admitted = await self.chain.admit(
                request, self.tenant, call, operation="ModelStreamInfer", mode=Mode.STREAMING
            )
        except GatewayError as error:
            await self._fail(error, client_id)
            return
        self._start(request, admitted, call, client_id)

    def _start(
        self,
        request: service_pb2.ModelInferRequest,
        admitted: Admitted,
        call: CallContext,
        client_id: str,
    ) -> None:
        budget = admitted.record.budget
        objectives = StreamObjectives(
            first_result_ms=budget.first_result_deadline_ms
            if budget.first_result_deadline_ms is not None
            else budget.deadline_ms,
            completion_ms=budget.deadline_ms,
            gap_ms=budget.gap_objective_ms,
        )
        entry = _StreamRequest(
            request,
            admitted,
            client_id,
            call,
            flag(request, "triton_enable_empty_final_response"),
            GapTracker(call.received_at, objectives),
            partial_template(admitted.record, admitted.decision, admitted.evidence),
            token_live_bytes(admitted),
        )
        self.requests[self._key(client_id, entry)] = entry
        entry.task = asyncio.get_running_loop().create_task(self._execute(entry))

    def _key(self, client_id: str, entry: _StreamRequest) -> str:
        # Requests without an id, or reusing one still in flight, are kept under a private key.
        if client_id and client_id not in self.requests:
            return client_id
        return f"\x00{id(entry)}"

    async def _cancel(self, target: str, client_id: str) -> None:
        entry = self.requests.get(target) if target else None
        if entry is None:
            raise InvalidArgument("orchid.cancel names no request in flight on this stream")
        if entry.task is not None:
            entry.task.cancel()
        self._end(entry, now=clock.now())
        await self._fail(Cancelled("the request was cancelled by the caller"), entry.client_id)

    def _end(self, entry: _StreamRequest, *, now: float, counted: bool = False) -> None:
        """Free what a request that ended early held (its backend call, slot and entry) and
        settle it once: by the work it ran (no lesson for the estimator), or refunded if it
        never started."""
        if entry.done:
            return
        entry.done = True
        if entry.started and not counted:  # a canary cancelled or cut off is no outcome of its own
            self.chain.rollouts.candidate_failed(
                entry.admitted, asyncio.CancelledError(), started=entry.started, now=now
            )
        if entry.backend_call is not None:
            entry.backend_call.cancel()
        live_token_ms = self._live_token_ms(entry, now)
        entry.release()
        self._forget(entry)
        if not entry.started:
            self.chain.settle.abandon(entry.admitted, started=None, now=now)
            return
        self.chain.settle.abandon(entry.admitted, started=entry.started, now=now)  # quota: what it held
        summary = entry.tracker.finish(now)
        settled = self.chain.settle.run(
            entry.admitted,
            queued_s=entry.started - entry.call.received_at,
            started=entry.started,
            finished=now,
            output_tokens=summary.results,
            learn=False,
            first_result=self._first_result(entry, now),
            finished_answer=False,
            observed_live_token_ms=live_token_ms,
        )
        self.chain.listener.stream_settled(settled, summary)

    @staticmethod
    def _live_token_ms(entry: _StreamRequest, now: float) -> float | None:
        """The live-token-ms the stream was observed to hold on its device (its slot's live
        bytes over time, growing with its tokens), before its slot is released."""
        if entry.slot is None or entry.token_bytes <= 0:
            return None
        return entry.slot.live_byte_ms(now) / entry.token_bytes

    @staticmethod
    def _first_result(entry: _StreamRequest, now: float) -> float:
        first_ms = entry.tracker.summary(now).first_result_ms
        return now if first_ms is None else entry.call.received_at + first_ms / 1000.0

    async def _fail(self, error: GatewayError, client_id: str) -> None:
        self.chain.listener.failed(error.status, error.rule or "")
        await self.out.put(stream_error(error, client_id))

    async def _execute(self, entry: _StreamRequest) -> None:
        """Wait for a slot (with late rescue), then run on a backend stream of its own."""
        chain = self.chain
        try:

            async def readmit(first: Admitted) -> Admitted:
                return await chain.admit(
                    entry.request,
                    self.tenant,
                    entry.call,
                    operation="ModelStreamInfer",
                    mode=Mode.STREAMING,
                    late=first,
                )

            first = entry.admitted
            entry.admitted, entry.slot = await chain.wait.run(first, readmit)
            if entry.admitted is not first:  # rescued onto its fallback: its own provenance
                rescued = entry.admitted
                entry.template = partial_template(rescued.record, rescued.decision, rescued.evidence)
                entry.token_bytes = token_live_bytes(rescued)
        except BaseException as error:  # never ran: the wait stage refunded its reservation
            entry.done = True
            self._forget(entry)
            if isinstance(error, GatewayError):
                await self._fail(error, entry.client_id)
                return
            raise
        admitted = entry.admitted
        entry.started = clock.now()
        chain.wait.started(
            admitted, dwell_ms=(entry.started - entry.call.received_at) * 1000.0, now=entry.started
        )
        chain.execute.starting(admitted, self.tenant, entry.started, entry.slot)
        try:
            await self._run_backend(entry)
        except InvalidCanaryResult as invalid:  # the rollout counted it; never sent on
            now = clock.now()
            if entry.tracker.results == 0 and not entry.done:  # nothing sent: answer again
                entry.release()
                entry.done = True
                self._forget(entry)
                chain.settle.abandon(admitted, started=None, now=now)
                await self._again(entry, invalid)
            elif not entry.done:
                self._end(entry, now=now, counted=True)
                await self._fail(invalid, entry.client_id)
        except GatewayError as error:
            now = clock.now()
            if entry.done:
                return
            # A canary's failure is its rollout's sample (counted once, here).
            rescue = chain.rollouts.candidate_failed(admitted, error, started=entry.started, now=now)
            if rescue and entry.tracker.results == 0:
                # A canary failed before its first result: the current version answers, once.
                entry.release()
                entry.done = True
                self._forget(entry)
                chain.settle.abandon(admitted, started=None, now=now)
                await self._again(entry, error)
                return
            self._end(entry, now=now, counted=True)
            await self._fail(error, entry.client_id)

    async def _again(self, entry: _StreamRequest, error: GatewayError) -> None:
        try:
            admitted = await self.chain.admit(
                entry.request,
                self.tenant,
                entry.call,
                operation="ModelStreamInfer",
                mode=Mode.STREAMING,
                canary=False,
            )
        except GatewayError as refused:
            self.chain.rollouts.hedge_unanswered(entry.admitted, refused)
            await self._fail(refused, entry.client_id)
            return
        self._start(entry.request, admitted, entry.call, entry.client_id)

    def _forget(self, entry: _StreamRequest) -> None:
        for key, value in list(self.requests.items()):
            if value is entry:
                del self.requests[key]

    async def _run_backend(self, entry: _StreamRequest) -> None:
        """The request on a backend stream of its own (so it can be cancelled alone), bounded
        by the call's own deadline; a canary must deliver its first result by its hedge."""
        admitted = entry.admitted
        backend_request = admitted.backend_request
        backend_request.id = admitted.record.identity.request_id

        async def one() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield backend_request

        remaining = entry.call.time_remaining_s
        timeout_s = None if remaining is None else remaining - (entry.started - entry.call.received_at)
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExpired("the call's deadline passed before the stream could start")
        call = admitted.backend.stream(one(), timeout_s=timeout_s)
        entry.backend_call = call
        try:
            async with asyncio.timeout_at(admitted.canary_deadline_at) as hedge:
                async for reply in call:
                    if await self._on_reply(entry, reply):
                        return
                    if entry.tracker.results and hedge.when() is not None:
                        hedge.reschedule(None)  # the canary's first result came in time
        except TimeoutError:
            raise DeadlineExpired("the canary's first result missed its hedge budget") from None
        except (GatewayError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the backend stream broke
            code = getattr(exc, "code", None)
            why = f"{type(exc).__name__} {code().name}" if callable(code) else type(exc).__name__
            log.warning(
                "stream request %s: backend stream broke: %s", admitted.record.identity.request_id, exc
            )
            raise Unavailable(f"streaming backend failed ({why})") from None
        finally:
            call.cancel()
        if not entry.done:
            raise Unavailable("the streaming backend ended before the request's final response")

    async def _on_reply(self, entry: _StreamRequest, reply: service_pb2.ModelStreamInferResponse) -> bool:
        """Forward one backend reply; True when the request has ended."""
        if entry.done:
            return True
        response = reply.infer_response
        admitted = entry.admitted
        if reply.error_message:
            logical = admitted.record.identity.model
            detail = reply.error_message.replace(admitted.route.backend_model, logical)
            raise InvalidArgument(f"model {logical!r}: {detail}")
        final = flag_response(response, "triton_final_response")
        has_output = len(response.outputs) > 0
        now = clock.now()
        if has_output and not self.chain.rollouts.candidate_result(
            admitted, response, started=entry.started, now=now
        ):
            raise InvalidCanaryResult(
                f"model {admitted.record.identity.model!r} answered outside its output contract",
                rule=OUTPUT_CONTRACT_RULE,
            )
        if has_output and admitted.route.outputs:
            problems = check_result(response, admitted.route.outputs)
            if problems:  # the route's contract: never forwarded; the stream ends here
                INVALID_OUTPUTS.labels(
                    admitted.record.identity.model, admitted.route.version, "refused"
                ).inc()
                raise Internal(
                    f"model {admitted.record.identity.model!r} answered outside its output contract: "
                    f"{problems[0]}",
                    rule=OUTPUT_CONTRACT_RULE,
                )
        if has_output and entry.tracker.results == 0:  # its first result reports the prefix hit
            self.chain.execute.answered(admitted, response)
        gap_ms = entry.tracker.result(now) if has_output else None
        if has_output and entry.slot is not None and not entry.slot.grow_live(entry.token_bytes, now):
            # Its device has no live room left for the next token: the stream ends here.
            raise ResourceExhausted(
                "the stream's device has no live memory left for its next token", rule=LIVE_RULE
            )
        if not final:
            if has_output:
                response.id = entry.client_id
                response.model_name = admitted.record.identity.model
                attach_partial(response, entry.template, gap_ms=gap_ms)
                await self.out.put(reply)
            return False
        # The final response: settle once, with the stream's summary.
        entry.done = True
        live_token_ms = self._live_token_ms(entry, now)
        entry.release()
        self._forget(entry)
        first_result = self._first_result(entry, now)
        summary = entry.tracker.finish(now)
        settled = self.chain.settle.run(
            admitted,
            queued_s=entry.started - entry.call.received_at,
            started=entry.started,
            finished=now,
            output_tokens=summary.results,
            first_result=first_result,
            observed_live_token_ms=live_token_ms,
        )
        self.chain.listener.settled(settled)
        self.chain.listener.stream_settled(settled, summary)
        self.chain.rollouts.settled(admitted, settled, response)
        if has_output or entry.wants_final:
            response.id = entry.client_id
            response.model_name = admitted.record.identity.model
            attach_provenance(response, settled, summary)
            await self.out.put(reply)
        return True
