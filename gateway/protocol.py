"""The gRPC edge: ``inference.GRPCInferenceService`` served over the ``Gateway``.

Adapts protobuf calls to the request path in ``pipeline`` and is the one place
that turns a domain ``GatewayError`` into a gRPC status with trailing metadata
(``orchid-rule``, ``retry-after-ms``; messages bounded by ``status.bounded``).
Every method receives raw bytes and decodes them itself after authenticating the
caller (``messages.decode``): a malformed message answers UNAUTHENTICATED without a
credential, else INVALID_ARGUMENT, never grpc's own UNKNOWN with a logged traceback.
Only ServerLive and ServerReady (health) need no credential. Admin-only RPCs
(repository control, shared memory, trace and log settings) are refused for
non-admin credentials; ModelStatistics is admin-only (PERMISSION_DENIED for every
tenant, whatever model it names).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from gateway import __version__, clock
from gateway.auth import Tenant
from gateway.core.errors import (
    GatewayError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from gateway.exchange import CallContext, GatewayListener
from gateway.messages import decode, encode
from gateway.pipeline import Gateway
from gateway.status import shown, to_status

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"


def peer_subjects(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    """Common names of the client certificate, as verified in the TLS handshake (mTLS only:
    the server requires and verifies client certificates whenever a client CA is set)."""
    names = context.auth_context().get("x509_common_name", ())
    return tuple(n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names)


def _call_context(context: grpc.aio.ServicerContext) -> CallContext:
    remaining = context.time_remaining()
    return CallContext(
        metadata=tuple(context.invocation_metadata() or ()),
        time_remaining_s=remaining if remaining is not None else None,
        received_at=clock.now(),
        peer_subjects=peer_subjects(context),
    )


async def _abort(context: grpc.aio.ServicerContext, error: BaseException, listener: GatewayListener) -> None:
    status = to_status(error, where="inference")
    listener.failed(status.code.name, status.rule)
    context.set_trailing_metadata(status.trailing_metadata)
    await context.abort(status.code, status.message)


RawUnary = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]
Handler = Callable[[Any, Tenant, grpc.aio.ServicerContext], Awaitable[Any]]


def _unary(handler: RawUnary, listener: GatewayListener) -> RawUnary:
    async def wrapped(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(raw, context)
        except Exception as error:  # domain errors, untranslated backend errors, bugs
            await _abort(context, error, listener)
        return None  # unreachable: abort raises

    wrapped.__name__ = handler.__name__
    return wrapped


class InferenceServicer:
    """KServe v2 / Triton inference API, as the gateway serves it."""

    def __init__(self, gateway: Gateway, *, ready: Callable[[], bool]) -> None:
        self.gateway = gateway
        self.ready = ready

    # ------------------------------------------------------------ health/metadata

    async def ServerLive(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        decode(service_pb2.ServerLiveRequest, raw, quiet=True)
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        decode(service_pb2.ServerReadyRequest, raw, quiet=True)
        return service_pb2.ServerReadyResponse(ready=self.ready())

    async def ServerMetadata(self, request: Any, tenant: Tenant, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerMetadataResponse(
            name="orchid-gateway",
            version=__version__,
            extensions=["parameters", "statistics", "model_configuration"],
        )

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        return self.gateway.tenants.authenticate(
            tuple(context.invocation_metadata() or ()), peer_subjects=peer_subjects(context)
        )

    def authenticated(self, handler: Handler, request_type: Any) -> RawUnary:
        """``handler`` behind authentication, then decoding: no credential is UNAUTHENTICATED
        whatever the bytes; a credential with bytes that are not a ``request_type`` is
        INVALID_ARGUMENT."""

        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            tenant = self._tenant(context)
            return await handler(decode(request_type, raw), tenant, context)

        return call

    async def _route_backend(self, tenant: Tenant, name: str) -> tuple[str, Any, Any]:
        route = self.gateway.tenant_route(tenant, name)
        handle, _, _ = await self.gateway.bind_pool(route, tenant.config.home_cell, name)
        return route.backend_model, route, handle.client

    async def ModelReady(self, request: Any, tenant: Tenant, context: grpc.aio.ServicerContext) -> Any:
        try:
            backend_model, route, backend = await self._route_backend(tenant, request.name)
        except Unavailable:
            return service_pb2.ModelReadyResponse(ready=False)
        return service_pb2.ModelReadyResponse(ready=await backend.model_ready(backend_model, route.version))

    async def ModelMetadata(self, request: Any, tenant: Tenant, context: grpc.aio.ServicerContext) -> Any:
        backend_model, route, backend = await self._route_backend(tenant, request.name)
        self._check_version(request.version, route, request.name)
        reply = await backend.metadata(backend_model, route.version)
        reply.name = request.name
        return reply

    async def ModelConfig(self, request: Any, tenant: Tenant, context: grpc.aio.ServicerContext) -> Any:
        backend_model, route, backend = await self._route_backend(tenant, request.name)
        self._check_version(request.version, route, request.name)
        reply = await backend.config(backend_model, route.version)
        reply.config.name = request.name
        return reply

    @staticmethod
    def _check_version(version: str, route: Any, name: str) -> None:
        if version and route.version and version != route.version:
            raise NotFound(f"unknown version {shown(version)} of model {shown(name)}")

    async def ModelStatistics(self, request: Any, tenant: Tenant, context: grpc.aio.ServicerContext) -> Any:
        # Triton's statistics are totals over every tenant sharing the model: another tenant's
        # request counts and timings. Only admins may read them (tenants: see the metrics). A
        # tenant is refused before the name is looked at, so its own, another tenant's and a
        # missing model answer alike: no existence oracle.
        if not tenant.config.admin:
            raise PermissionDenied("model statistics need an admin credential")
        names = [request.name] if request.name else list(tenant.config.models)
        reply = service_pb2.ModelStatisticsResponse()
        for name in names:
            route = self.gateway.tenant_route(tenant, name)
            try:
                handle, _, _ = await self.gateway.bind_pool(route, tenant.config.home_cell, name)
            except Unavailable:
                if request.name:
                    raise
                continue
            stats = await handle.client.statistics(route.backend_model, route.version)
            for entry in stats.model_stats:
                entry.name = name
                reply.model_stats.append(entry)
        return reply

    # ------------------------------------------------------------ inference

    async def ModelInfer(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self.gateway.infer(raw, _call_context(context))

    async def ModelStreamInfer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            async for reply in self.gateway.stream(requests, _call_context(context)):
                yield reply
        except GatewayError as error:
            await _abort(context, error, self.gateway.listener)

    # ------------------------------------------------------------ admin-only

    async def _admin_only(self, request: Any, tenant: Tenant, context: grpc.aio.ServicerContext) -> Any:
        if not tenant.config.admin:
            raise PermissionDenied("this operation needs an admin credential")
        raise InvalidArgument(
            "this operation is not available through the gateway; use the backend's admin port"
        )

    async def RepositoryIndex(self, request: Any, tenant: Tenant, context: grpc.aio.ServicerContext) -> Any:
        if not tenant.config.admin:
            raise PermissionDenied("this operation needs an admin credential")
        reply = service_pb2.RepositoryIndexResponse()
        for name, route in sorted(self.gateway.routes.models.items()):
            reply.models.add(name=name, version=route.version, state="", reason="")
        return reply


_ADMIN_ONLY = (
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
    "TraceSetting",
    "LogSettings",
)

_OPEN = ("ServerLive", "ServerReady")  # health: no credential, decoded quietly

_UNARY = {
    "ServerMetadata": service_pb2.ServerMetadataRequest,
    "ModelReady": service_pb2.ModelReadyRequest,
    "ModelMetadata": service_pb2.ModelMetadataRequest,
    "ModelConfig": service_pb2.ModelConfigRequest,
    "ModelStatistics": service_pb2.ModelStatisticsRequest,
    "RepositoryIndex": service_pb2.RepositoryIndexRequest,
    "RepositoryModelLoad": service_pb2.RepositoryModelLoadRequest,
    "RepositoryModelUnload": service_pb2.RepositoryModelUnloadRequest,
    "SystemSharedMemoryStatus": service_pb2.SystemSharedMemoryStatusRequest,
    "SystemSharedMemoryRegister": service_pb2.SystemSharedMemoryRegisterRequest,
    "SystemSharedMemoryUnregister": service_pb2.SystemSharedMemoryUnregisterRequest,
    "CudaSharedMemoryStatus": service_pb2.CudaSharedMemoryStatusRequest,
    "CudaSharedMemoryRegister": service_pb2.CudaSharedMemoryRegisterRequest,
    "CudaSharedMemoryUnregister": service_pb2.CudaSharedMemoryUnregisterRequest,
    "TraceSetting": service_pb2.TraceSettingRequest,
    "LogSettings": service_pb2.LogSettingsRequest,
}


def method_handlers(servicer: InferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Every method takes raw bytes (``request_deserializer=None``) and decodes them itself
    after authentication, so grpc's own decoder never answers for the gateway."""
    listener = servicer.gateway.listener
    calls: dict[str, RawUnary] = {name: getattr(servicer, name) for name in _OPEN}
    for name, request_type in _UNARY.items():
        handler = servicer._admin_only if name in _ADMIN_ONLY else getattr(servicer, name)
        calls[name] = servicer.authenticated(handler, request_type)
    # The pipeline authenticates, then parses (``messages.parse_infer_request``).
    calls["ModelInfer"] = servicer.ModelInfer
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, call in calls.items():
        wrapped = _unary(call, listener)
        wrapped.__name__ = name
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            wrapped, request_deserializer=None, response_serializer=encode
        )
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        servicer.ModelStreamInfer, request_deserializer=None, response_serializer=encode
    )
    return handlers


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, method_handlers(servicer)),)
    )
