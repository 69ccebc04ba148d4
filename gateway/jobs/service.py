"""``orchid.jobs.v1.Operations``: the gRPC face of asynchronous and batch jobs.

Owns the service's calls: authenticate (the inference service's bearer keys and mTLS
subjects), decode, check the submit against the bounds (``gateway.core.jobs``), store it
durably (the reply comes only after the store's commit), and answer reads from the store,
scoped to the caller's tenant: another tenant's operation id answers NOT_FOUND exactly like
a missing one. Every refusal goes through ``gateway.status`` (the one error mapping).

The service is defined in ``proto/orchid/jobs/v1/jobs.proto``; its modules are generated at
build time into ``gateway._proto`` like the admin service's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.auth import Tenant
from gateway.config import JobsConfig, RouteConfig
from gateway.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from gateway.core.jobs import Kind, OpStatus, check_submit, same_submission
from gateway.features.historical import RULE_SNAPSHOT_UNAVAILABLE, feast_installed, iso, parse_snapshot
from gateway.jobs.batch import parse_jsonl, response_json
from gateway.jobs.runner import JobRunner
from gateway.jobs.store import JobStore, NewOperation, Operation
from gateway.messages import decode, encode, parse_infer_request
from gateway.pipeline import Gateway
from gateway.protocol import peer_subjects
from gateway.shape import check_backend_controls, extract_shape, payload_bytes, read_hints, validate_tensors
from gateway.status import shown, to_status

try:
    from gateway._proto import jobs_pb2
except ModuleNotFoundError as exc:  # pragma: no cover - a checkout that was never installed
    raise ModuleNotFoundError(
        f"{exc.name} is generated from proto/ at build time: run scripts/bootstrap.sh "
        "(or pip install -e .) first"
    ) from exc

SERVICE = jobs_pb2.DESCRIPTOR.services_by_name["Operations"].full_name
MAX_LIST_PAGE = 100
MAX_OUTPUT_PAGE = 1000
RESULTS_EXPIRED = "results expired: deleted after the retention period"
WAIT_MARGIN_S = 0.25  # a Wait stream ends this long before the caller's deadline


class OperationsServicer:
    def __init__(self, gateway: Gateway, store: JobStore, runner: JobRunner, config: JobsConfig) -> None:
        self.gateway = gateway
        self.store = store
        self.runner = runner
        self.config = config

    # ------------------------------------------------------------------ helpers

    async def _call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _own(self, tenant: Tenant, op_id: str) -> Operation:
        op: Operation | None = await self._call(self.store.get, tenant.name, op_id) if op_id else None
        if op is None:
            raise NotFound(f"unknown operation {shown(op_id)}")
        return op

    def _class(self, tenant: Tenant, requested: str) -> str:
        name = requested or self.config.default_class
        if name not in self.config.classes:
            raise InvalidArgument(
                f"request_class {shown(name)} is not a job class "
                f"(jobs.classes: {', '.join(self.config.classes)})"
            )
        if name not in tenant.config.classes:
            raise PermissionDenied(f"class {shown(name)} is not allowed for this credential")
        return name

    async def _submit(
        self,
        tenant: Tenant,
        *,
        kind: Kind,
        model: str,
        request_class: str,
        operation_id: str,
        complete_within_s: float,
        size_bytes: int,
        input_sha256: str,
        items: list[tuple[str, bytes]],
        lines: list[int] | None = None,
        feature_snapshot: dict[str, Any] | None = None,
    ) -> Operation:
        route = self.gateway.tenant_route(tenant, model)  # NOT_FOUND for unknown and hidden models
        if route.streaming:
            raise InvalidArgument(f"model {shown(model)} streams its output: jobs run unary models only")
        await self._validate(tenant, route, model, items, lines)
        identity = [str(kind), model, request_class, input_sha256]
        if feature_snapshot is not None:  # a different snapshot is a different request
            identity.append(feature_snapshot["as_of"])
        request_hash = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
        key = operation_id or None
        if key is not None:
            existing: Operation | None = await self._call(self.store.by_key, tenant.name, key)
            if existing is not None and same_submission(key, existing.request_hash, request_hash):
                return existing
        unfinished = await self._call(self.store.unfinished_items, tenant.name)
        window = check_submit(
            self.runner.limits,
            payload_bytes=size_bytes,
            items=len(items),
            queued_for_tenant=unfinished,
            complete_within_s=complete_within_s,
            operation_id=operation_id,
        )
        now = clock.wall()
        new = NewOperation(
            id=f"op-{uuid.uuid4().hex}",
            tenant=tenant.name,
            idempotency_key=key,
            request_hash=request_hash,
            input_sha256=input_sha256,
            kind=kind,
            request_class=request_class,
            model=model,
            model_version=route.version,
            created_at=now,
            complete_by=now + window,
            feature_snapshot=feature_snapshot,
        )
        op, inserted = await self._call(self.store.insert, new, items)  # committed (fsync) on return
        if not inserted:  # a concurrent submit with the same key won the insert
            assert key is not None
            same_submission(key, op.request_hash, request_hash)
        self.runner.wake.set()
        self.runner.changes.bump()
        return op  # type: ignore[no-any-return]

    def _feature_snapshot(self, tenant: Tenant, model: str, text: str) -> dict[str, Any]:
        """A batch's declared feature snapshot, checked: a time (not in the future) and a model
        whose features can be read as of it (a contract, a source with historical retrieval)."""
        as_of = parse_snapshot(text, now=clock.wall())
        contract = self.gateway.tenant_route(tenant, model).features
        if contract is None:
            raise FailedPrecondition(
                f"model {shown(model)} reads no features: a feature_snapshot needs a route with a "
                "feature contract",
                rule=RULE_SNAPSHOT_UNAVAILABLE,
            )
        source = self.gateway.config.feature_sources.get(contract.source)
        if source is None or source.repo is None:
            raise FailedPrecondition(
                f"feature source {shown(contract.source)} has no historical retrieval configured "
                f"(feature_sources.{contract.source}.repo: its Feast feature repository)",
                rule=RULE_SNAPSHOT_UNAVAILABLE,
            )
        if not feast_installed():
            raise FailedPrecondition(
                "point-in-time features need the Feast SDK (the features extra), not installed here",
                rule=RULE_SNAPSHOT_UNAVAILABLE,
            )
        return {
            "as_of": iso(as_of),
            "source": contract.source,
            "feature_service": contract.feature_service,
            "definition_version": contract.definition_version,
        }

    async def _validate(
        self,
        tenant: Tenant,
        route: RouteConfig,
        model: str,
        items: list[tuple[str, bytes]],
        lines: list[int] | None,
    ) -> None:
        """Refuse at submit what would fail every attempt: hints, tensors against the model's
        inputs, and the route's shape limits (the checks the chain's shape stage makes), naming the
        batch line. Without a healthy backend to read the model from, tensors are checked when
        the item runs (accepting work while the backend is away is the point of a job)."""
        try:
            _handle, spec, _queue = await self.gateway.bind_pool(route, tenant.config.home_cell, model)
        except Unavailable:
            spec = None
        for index, (_, blob) in enumerate(items):
            request = service_pb2.ModelInferRequest.FromString(blob)
            try:
                hints = read_hints(request)
                check_backend_controls(request)
                if spec is not None:
                    shapes = validate_tensors(request, spec, model=model)
                    extract_shape(
                        shapes,
                        hints,
                        route.shape,
                        model=model,
                        streaming=False,
                        input_bytes=payload_bytes(request),
                    )
            except InvalidArgument as error:
                if lines is None:
                    raise
                raise InvalidArgument(f"line {lines[index]}: {error.message}", rule=error.rule) from None

    async def _message(self, op: Operation) -> jobs_pb2.Operation:
        message = jobs_pb2.Operation(
            id=op.id,
            kind=str(op.kind),
            status=str(op.status),
            operation_id=op.idempotency_key or "",
            model=op.model,
            model_version=op.model_version,
            request_class=op.request_class,
            input_sha256=op.input_sha256,
            counts=jobs_pb2.Counts(
                total=op.counts.total,
                completed=op.counts.completed,
                failed=op.counts.failed,
                queued=op.counts.queued,
                running=op.counts.running,
            ),
            created_at=op.created_at,
            started_at=op.started_at,
            finished_at=op.finished_at,
            complete_by=op.complete_by,
            results_expire_at=op.results_expire_at,
            results_expired=op.results_expired,
            charged_accelerator_ms=op.charged_ms,
            policy_version=(op.manifest or {}).get("policy_version", ""),
            feature_snapshot=(op.feature_snapshot or {}).get("as_of", ""),
            error=RESULTS_EXPIRED if op.results_expired and not op.error else op.error,
            output_version=op.output_version,
        )
        if op.kind is Kind.ASYNC:
            items = await self._call(self.store.items, op.seq, after_idx=-1, limit=1)
            if items:
                item = items[0]
                message.attempts = item.attempts
                if item.status == "failed" and not message.error:
                    message.error = item.error
                if item.response is not None:
                    message.infer_response = item.response
                if item.provenance:
                    message.provenance.update(item.provenance)
                    message.policy_version = item.provenance.get("orchid.policy_version", "")
        return message

    # ------------------------------------------------------------------ methods

    async def Submit(
        self, tenant: Tenant, request: jobs_pb2.SubmitRequest, context: Any
    ) -> jobs_pb2.Operation:
        infer = parse_infer_request(request.infer_request)
        canonical = infer.SerializeToString(deterministic=True)
        op = await self._submit(
            tenant,
            kind=Kind.ASYNC,
            model=infer.model_name,
            request_class=self._class(tenant, request.request_class),
            operation_id=request.operation_id,
            complete_within_s=request.complete_within_s,
            size_bytes=len(request.infer_request),
            input_sha256=hashlib.sha256(canonical).hexdigest(),
            items=[("", canonical)],
        )
        return await self._message(op)

    async def SubmitBatch(
        self, tenant: Tenant, request: jobs_pb2.SubmitBatchRequest, context: Any
    ) -> jobs_pb2.Operation:
        if not request.model:
            raise InvalidArgument("model is required")
        request_class = self._class(tenant, request.request_class)
        self.gateway.tenant_route(tenant, request.model)  # NOT_FOUND before parsing a large file
        snapshot = (
            self._feature_snapshot(tenant, request.model, request.feature_snapshot)
            if request.feature_snapshot
            else None
        )
        limits = self.runner.limits
        if len(request.jsonl) > limits.max_payload_bytes:
            raise InvalidArgument(
                f"batch input is {len(request.jsonl)} bytes; the limit is {limits.max_payload_bytes} "
                "(jobs.max_payload_bytes)"
            )
        batch = await asyncio.to_thread(
            parse_jsonl, request.jsonl, model=request.model, max_items=limits.max_batch_items
        )
        op = await self._submit(
            tenant,
            kind=Kind.BATCH,
            model=request.model,
            request_class=request_class,
            operation_id=request.operation_id,
            complete_within_s=request.complete_within_s,
            size_bytes=len(request.jsonl),
            input_sha256=batch.sha256,
            items=batch.items,
            lines=batch.lines,
            feature_snapshot=snapshot,
        )
        return await self._message(op)

    async def Get(self, tenant: Tenant, request: jobs_pb2.GetRequest, context: Any) -> jobs_pb2.Operation:
        return await self._message(await self._own(tenant, request.id))

    async def Cancel(self, tenant: Tenant, request: jobs_pb2.GetRequest, context: Any) -> jobs_pb2.Operation:
        await self._own(tenant, request.id)
        op, running = await self._call(self.store.request_cancel, tenant.name, request.id, now=clock.wall())
        if running:
            await self.runner.cancel_running(op.seq)
        self.runner.changes.bump()
        return await self._message(await self._own(tenant, request.id))

    async def Wait(
        self, tenant: Tenant, request: jobs_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[jobs_pb2.Operation]:
        op = await self._own(tenant, request.id)
        remaining = context.time_remaining()
        # Within the caller's deadline (less a margin), so the stream ends cleanly, not in
        # DEADLINE_EXCEEDED: the caller sees the last state and calls Wait again.
        bound = (
            self.config.max_wait_s
            if remaining is None
            else min(max(0.0, remaining - WAIT_MARGIN_S), self.config.max_wait_s)
        )
        ends_at = clock.now() + bound
        last = None
        while True:
            seen = (op.status, op.counts, op.results_expired)
            if seen != last:
                last = seen
                yield await self._message(op)
            if op.done or clock.now() >= ends_at:
                return
            await self.runner.changes.wait(min(1.0, ends_at - clock.now()))
            op = await self._own(tenant, request.id)

    async def List(
        self, tenant: Tenant, request: jobs_pb2.ListRequest, context: Any
    ) -> jobs_pb2.ListResponse:
        if request.status and request.status not in {str(s) for s in OpStatus}:
            raise InvalidArgument(f"unknown status filter {shown(request.status)}")
        if request.kind and request.kind not in {str(k) for k in Kind}:
            raise InvalidArgument("kind filter must be 'async' or 'batch'")
        if request.page_size > MAX_LIST_PAGE:
            raise InvalidArgument(f"page_size is at most {MAX_LIST_PAGE}")
        size = request.page_size or 20
        before = _token(request.page_token)
        ops: list[Operation] = await self._call(
            self.store.page,
            tenant.name,
            status=request.status,
            kind=request.kind,
            before_seq=before,
            limit=size,
        )
        reply = jobs_pb2.ListResponse(operations=[await self._message(op) for op in ops])
        if len(ops) == size:
            reply.next_page_token = str(ops[-1].seq)
        return reply

    async def ReadBatchOutput(
        self, tenant: Tenant, request: jobs_pb2.ReadBatchOutputRequest, context: Any
    ) -> jobs_pb2.ReadBatchOutputResponse:
        op = await self._own(tenant, request.id)
        if request.page_size > MAX_OUTPUT_PAGE:
            raise InvalidArgument(f"page_size is at most {MAX_OUTPUT_PAGE}")
        size = request.page_size or 500
        after = _token(request.page_token)
        items = await self._call(
            self.store.items, op.seq, after_idx=-1 if after is None else after, limit=size
        )
        reply = jobs_pb2.ReadBatchOutputResponse()
        if after is None:
            reply.manifest_json = json.dumps(manifest(op), sort_keys=True)
        for item in items:
            out = reply.items.add(
                index=item.idx,
                custom_id=item.custom_id,
                status=str(item.status),
                error=item.error,
                charged_accelerator_ms=item.charged_ms,
                attempts=item.attempts,
            )
            if item.response is not None:
                body = response_json(service_pb2.ModelInferResponse.FromString(item.response))
                out.response_json = json.dumps(body, sort_keys=True)
        if len(items) == size:
            reply.next_page_token = str(items[-1].idx)
        return reply


def manifest(op: Operation) -> dict[str, Any]:
    """The sealed manifest, or (while it runs) the same fields as they stand."""
    if op.manifest is not None:
        return dict(op.manifest, results_expired=op.results_expired)
    running: dict[str, Any] = {
        "id": op.id,
        "kind": str(op.kind),
        "status": str(op.status),
        "input_sha256": op.input_sha256,
        "model": op.model,
        "model_version": op.model_version,
        "request_class": op.request_class,
        "policy_version": "",
        "total": op.counts.total,
        "completed": op.counts.completed,
        "failed": op.counts.failed,
        "cancelled": op.counts.cancelled,
        "created_at": op.created_at,
        "started_at": op.started_at,
        "finished_at": 0.0,
        "charged_accelerator_ms": round(op.charged_ms, 3),
        "output_version": 0,
        "results_expired": op.results_expired,
    }
    if op.feature_snapshot:
        running["feature_snapshot"] = op.feature_snapshot
    return running


def _token(text: str) -> int | None:
    if not text:
        return None
    if not text.isdigit() or len(text) > 19:
        raise InvalidArgument("malformed page_token: pass the previous page's next_page_token")
    return int(text)


_UNARY = {
    "Submit": jobs_pb2.SubmitRequest,
    "SubmitBatch": jobs_pb2.SubmitBatchRequest,
    "Get": jobs_pb2.GetRequest,
    "Cancel": jobs_pb2.GetRequest,
    "List": jobs_pb2.ListRequest,
    "ReadBatchOutput": jobs_pb2.ReadBatchOutputRequest,
}

Method = Callable[[Tenant, Any, Any], Awaitable[Any]]


def add_to_server(servicer: OperationsServicer, server: grpc.aio.Server) -> None:
    """Every method, raw bytes in (``request_deserializer=None``): authenticate, then decode."""

    async def authorized(
        context: grpc.aio.ServicerContext, raw: bytes, request_type: Any
    ) -> tuple[Tenant, Any]:
        try:
            tenant = servicer.gateway.tenants.authenticate(
                tuple(context.invocation_metadata() or ()), peer_subjects=peer_subjects(context)
            )
            return tenant, decode(request_type, raw)
        except Exception as error:
            await _abort(context, error)
            raise  # unreachable: abort raises

    def unary(
        method: Method, request_type: Any
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            tenant, request = await authorized(context, raw, request_type)
            try:
                return await method(tenant, request, context)
            except Exception as error:
                await _abort(context, error)

        return call

    async def wait(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        tenant, request = await authorized(context, raw, jobs_pb2.GetRequest)
        try:
            async for message in servicer.Wait(tenant, request, context):
                yield message
        except Exception as error:
            await _abort(context, error)

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            unary(getattr(servicer, name), request_type),
            request_deserializer=None,
            response_serializer=encode,
        )
        for name, request_type in _UNARY.items()
    }
    handlers["Wait"] = grpc.unary_stream_rpc_method_handler(
        wait, request_deserializer=None, response_serializer=encode
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    status = to_status(error, where="jobs")
    context.set_trailing_metadata(status.trailing_metadata)
    await context.abort(status.code, status.message)
