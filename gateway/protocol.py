"""The gRPC edge: ``inference.GRPCInferenceService`` served over the ``Gateway``.

Adapts protobuf calls to the request path in ``pipeline`` and is the one place
that turns a domain ``GatewayError`` into a gRPC status with trailing metadata
(``orchid-rule``, ``retry-after-ms``). ModelInfer and ModelStreamInfer receive
raw bytes so a malformed message is answered with INVALID_ARGUMENT (grpc's
own deserializer would answer INTERNAL). Admin-only RPCs (repository control,
shared memory, trace and log settings) are refused for non-admin credentials.
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
from gateway.pipeline import CallContext, Gateway, GatewayListener
from gateway.status import to_status

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


def _unary(
    handler: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
    listener: GatewayListener,
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(request, context)
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

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.ready())

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._tenant(context)
        return service_pb2.ServerMetadataResponse(
            name="orchid-gateway",
            version=__version__,
            extensions=["parameters", "statistics", "model_configuration"],
        )

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        return self.gateway.tenants.authenticate(
            tuple(context.invocation_metadata() or ()), peer_subjects=peer_subjects(context)
        )

    async def _route_backend(self, context: grpc.aio.ServicerContext, name: str) -> tuple[str, Any, Any]:
        tenant = self._tenant(context)
        route = self.gateway.tenant_route(tenant, name)
        handle, _, _ = await self.gateway.bind_pool(route, tenant.config.home_cell, name)
        return route.backend_model, route, handle.client

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            backend_model, route, backend = await self._route_backend(context, request.name)
        except Unavailable:
            return service_pb2.ModelReadyResponse(ready=False)
        return service_pb2.ModelReadyResponse(ready=await backend.model_ready(backend_model, route.version))

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        backend_model, route, backend = await self._route_backend(context, request.name)
        self._check_version(request.version, route, request.name)
        reply = await backend.metadata(backend_model, route.version)
        reply.name = request.name
        return reply

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        backend_model, route, backend = await self._route_backend(context, request.name)
        self._check_version(request.version, route, request.name)
        reply = await backend.config(backend_model, route.version)
        reply.config.name = request.name
        return reply

    @staticmethod
    def _check_version(version: str, route: Any, name: str) -> None:
        if version and route.version and version != route.version:
            raise NotFound(f"unknown version {version!r} of model {name!r}")

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Triton's statistics are totals over every tenant sharing the model: another tenant's
        # request counts and timings. Only admins may read them (tenants: see the metrics).
        tenant = self._tenant(context)
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

    async def _admin_only(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tenant = self._tenant(context)
        if not tenant.config.admin:
            raise PermissionDenied("this operation needs an admin credential")
        raise InvalidArgument(
            "this operation is not available through the gateway; use the backend's admin port"
        )

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tenant = self._tenant(context)
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

_UNARY = {
    "ServerLive": service_pb2.ServerLiveRequest,
    "ServerReady": service_pb2.ServerReadyRequest,
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


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def method_handlers(servicer: InferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, request_type in _UNARY.items():
        fn = servicer._admin_only if name in _ADMIN_ONLY else getattr(servicer, name)
        wrapped = _unary(fn, servicer.gateway.listener)
        wrapped.__name__ = name
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            wrapped, request_deserializer=request_type.FromString, response_serializer=_serialize
        )
    # Raw bytes in: the pipeline parses, so malformed input is INVALID_ARGUMENT, not INTERNAL.
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        _unary(servicer.ModelInfer, servicer.gateway.listener),
        request_deserializer=None,
        response_serializer=_serialize,
    )
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        servicer.ModelStreamInfer, request_deserializer=None, response_serializer=_serialize
    )
    return handlers


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, method_handlers(servicer)),)
    )
