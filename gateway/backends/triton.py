"""Triton's gRPC API, from the gateway's side.

``TritonBackend`` wraps one Triton endpoint: a ``grpc.aio`` channel, the KServe
v2 stub from ``tritonclient.grpc`` (not a vendored copy), a cache of model
metadata/config keyed by backend model, and a health view updated by a probe
loop. Backend failures are translated to the domain error tree here and only
here; messages never carry the backend's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from gateway import clock
from gateway.backends.base import InputSpec, ModelSpec
from gateway.core.errors import (
    Cancelled,
    DeadlineExpired,
    GatewayError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from gateway.core.prefix import declared_cache

log = logging.getLogger(__name__)

_PASS_THROUGH_MESSAGE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}

__all__ = ["InputSpec", "ModelControlError", "ModelSpec", "TritonBackend", "spec_from", "translate_rpc_error"]


# Triton's --grpc-restricted-protocol=model-repository:orchid-repository-key=KEY checks this
# header (Triton prefixes the key's name with triton-grpc-protocol-).
REPOSITORY_KEY_HEADER = "triton-grpc-protocol-orchid-repository-key"


class ModelControlError(Exception):
    """Triton refused or failed a repository load/unload (explicit model control)."""


def translate_rpc_error(error: grpc.aio.AioRpcError, *, model: str, backend_model: str) -> GatewayError:
    """One mapping from a backend failure to the domain tree, with a caller-safe message."""
    code = error.code()
    detail = (error.details() or "").replace(backend_model, model)
    if code in _PASS_THROUGH_MESSAGE:
        return InvalidArgument(f"model {model!r} rejected the request: {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExpired(f"model {model!r} did not finish before the deadline")
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled("request cancelled")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"model {model!r} is at capacity", retry_after_ms=100)
    if code == grpc.StatusCode.UNAVAILABLE:
        if "queue" in detail.lower() or "exceeds maximum" in detail.lower():
            return ResourceExhausted(f"model {model!r} is at capacity", retry_after_ms=100)
        return Unavailable(f"no healthy backend for model {model!r}")
    if code == grpc.StatusCode.NOT_FOUND:
        return Unavailable(f"model {model!r} is not loaded on its backend")
    return Internal(f"backend error for model {model!r} ({code.name})")


class TritonBackend:
    """One Triton endpoint (a ``gateway.backends.base.Backend``)."""

    def __init__(
        self, name: str, address: str, *, max_message_bytes: int, repository_key: str | None = None
    ) -> None:
        self.name = name
        self.address = address
        # Triton's restricted model-repository protocol: the header its repository API checks.
        self._repository_metadata = ((REPOSITORY_KEY_HEADER, repository_key),) if repository_key else None
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            # A restarted Triton is used again within about a second of being ready: gRPC's
            # default reconnect backoff grows to 120 s, which would keep a recovered backend
            # idle long after the health probe (every 0.5 s) could have seen it.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
        ]
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._specs: dict[str, ModelSpec] = {}
        self._ready_models: dict[str, bool] = {}
        self.healthy = False
        self.healthy_at = 0.0  # monotonic time of the last successful probe
        # Told the backend's name on every health flip (the pool registry: a new generation).
        self.on_health_change: Callable[[str], object] | None = None
        self.watched_models: set[str] = set()  # readiness refreshed by the probe (warm checks)
        self._probe_task: asyncio.Task[None] | None = None

    # -------------------------------------------------------------- health

    async def probe(self) -> bool:
        try:
            reply = await self.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=1.0)
            healthy = bool(reply.ready)
        except grpc.aio.AioRpcError:
            healthy = False
        was = self.healthy
        if healthy != was:
            level = logging.INFO if healthy else logging.WARNING
            log.log(level, "backend %s is now %s", self.name, "healthy" if healthy else "UNHEALTHY")
            # A restarted server may have different models/configs: forget what we cached.
            self._specs.clear()
            self._ready_models.clear()
        if healthy:
            if not was:
                await self._read_specs()
            for model in list(self.watched_models):
                await self.model_ready(model)
        # Seen from here on, with its models' readiness (and, after a flip, metadata) known.
        self.healthy = healthy
        if healthy != was and self.on_health_change is not None:
            self.on_health_change(self.name)
        if healthy:
            self.healthy_at = clock.now()
        return healthy

    async def _read_specs(self) -> None:
        """A server that (re)became ready: the watched models' metadata and config, read before
        it is seen healthy. Otherwise each of its first requests reads them on its own path
        (two calls per model, not priced): ~10-15 ms more on a wave of 8 first calls through
        the gateway (docs/operators.md, "Failure behaviour"). A model that is not ready, or not
        served here, is read on first use."""
        await asyncio.gather(
            *(self.model_spec(model, logical=model) for model in sorted(self.watched_models)),
            return_exceptions=True,
        )

    def is_warm(self, model: str) -> bool:
        """Healthy and the model reported READY at the last probe: never a cold load."""
        return self.healthy and self._ready_models.get(model, False)

    def start_probing(self, interval_s: float = 0.5) -> None:
        async def loop() -> None:
            while True:
                await self.probe()
                await asyncio.sleep(interval_s)

        self._probe_task = asyncio.get_running_loop().create_task(loop(), name=f"probe-{self.name}")

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        await self._channel.close()

    async def model_ready(self, model: str, version: str = "") -> bool:
        try:
            reply = await self.stub.ModelReady(
                service_pb2.ModelReadyRequest(name=model, version=version), timeout=1.0
            )
        except grpc.aio.AioRpcError:
            return False
        self._ready_models[model] = bool(reply.ready)
        return bool(reply.ready)

    # -------------------------------------------------------------- metadata

    def known_spec(self, model: str) -> ModelSpec | None:
        return self._specs.get(model)  # model_spec's own cache

    async def model_spec(self, model: str, *, logical: str) -> ModelSpec:
        cached = self._specs.get(model)
        if cached is not None:
            return cached
        try:
            metadata = await self.stub.ModelMetadata(
                service_pb2.ModelMetadataRequest(name=model), timeout=2.0
            )
            config = await self.stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "unavailable model" in (exc.details() or ""):
                raise Unavailable(f"model {logical!r} is not ready on its backend") from exc
            raise translate_rpc_error(exc, model=logical, backend_model=model) from exc
        spec = spec_from(metadata, config.config)
        self._specs[model] = spec
        return spec

    async def metadata(self, model: str, version: str) -> service_pb2.ModelMetadataResponse:
        return await self.stub.ModelMetadata(
            service_pb2.ModelMetadataRequest(name=model, version=version), timeout=2.0
        )

    async def config(self, model: str, version: str) -> service_pb2.ModelConfigResponse:
        return await self.stub.ModelConfig(
            service_pb2.ModelConfigRequest(name=model, version=version), timeout=2.0
        )

    async def statistics(self, model: str, version: str = "") -> service_pb2.ModelStatisticsResponse:
        return await self.stub.ModelStatistics(
            service_pb2.ModelStatisticsRequest(name=model, version=version), timeout=2.0
        )

    # -------------------------------------------------------------- repository (explicit model control)

    async def load_model(self, model: str, *, timeout_s: float) -> None:
        """Ask Triton to load ``model`` (``RepositoryModelLoad``; explicit model control). A
        refusal or a failed load raises ``ModelControlError`` with Triton's reason."""
        try:
            await self.stub.RepositoryModelLoad(
                service_pb2.RepositoryModelLoadRequest(model_name=model),
                timeout=timeout_s,
                metadata=self._repository_metadata,
            )
        except grpc.aio.AioRpcError as exc:
            raise ModelControlError(f"loading {model!r} failed: {exc.details() or exc.code().name}") from exc
        self._specs.pop(model, None)
        self.watched_models.add(model)
        await self.model_ready(model)

    async def unload_model(self, model: str, *, timeout_s: float) -> None:
        """Ask Triton to unload ``model`` (``RepositoryModelUnload``) and wait until its repository
        index no longer lists it READY or UNLOADING (Triton answers the call at once and lets
        in-flight requests finish first). The probe then reports it cold."""
        deadline = clock.now() + timeout_s
        try:
            await self.stub.RepositoryModelUnload(
                service_pb2.RepositoryModelUnloadRequest(model_name=model),
                timeout=timeout_s,
                metadata=self._repository_metadata,
            )
            while any(
                m == model and state in ("READY", "UNLOADING")
                for m, _, state in await self.repository_index()
            ):
                if clock.now() > deadline:
                    raise ModelControlError(f"{model!r} still unloading after {timeout_s:g} s")
                await asyncio.sleep(0.01)
        except grpc.aio.AioRpcError as exc:
            raise ModelControlError(
                f"unloading {model!r} failed: {exc.details() or exc.code().name}"
            ) from exc
        self._specs.pop(model, None)
        self._ready_models[model] = False

    async def repository_index(self) -> list[tuple[str, str, str]]:
        """(name, version, state) of every model in the repository, as Triton reports them."""
        reply = await self.stub.RepositoryIndex(
            service_pb2.RepositoryIndexRequest(), timeout=5.0, metadata=self._repository_metadata
        )
        return [(m.name, m.version, m.state) for m in reply.models]

    # -------------------------------------------------------------- inference

    async def infer(
        self, request: service_pb2.ModelInferRequest, *, timeout_s: float, logical: str
    ) -> service_pb2.ModelInferResponse:
        try:
            return await self.stub.ModelInfer(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and self.healthy:
                self.healthy = False  # the probe loop will notice recovery
                if self.on_health_change is not None:
                    self.on_health_change(self.name)
            raise translate_rpc_error(exc, model=logical, backend_model=request.model_name) from exc

    def stream(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], *, timeout_s: float | None
    ) -> grpc.aio.StreamStreamCall:
        return self.stub.ModelStreamInfer(requests, timeout=timeout_s)


def spec_from(metadata: service_pb2.ModelMetadataResponse, config: model_config_pb2.ModelConfig) -> ModelSpec:
    optional = {i.name for i in config.input if i.optional}
    return ModelSpec(
        name=metadata.name,
        versions=tuple(metadata.versions),
        inputs=tuple(
            InputSpec(
                name=t.name,
                datatype=t.datatype,
                shape=tuple(int(d) for d in t.shape),
                optional=t.name in optional,
            )
            for t in metadata.inputs
        ),
        outputs=tuple(t.name for t in metadata.outputs),
        max_batch_size=int(config.max_batch_size),
        decoupled=bool(config.model_transaction_policy.decoupled),
        instances=max(1, sum(int(group.count) for group in config.instance_group)),
        prefix_cache=declared_cache({k: v.string_value for k, v in config.parameters.items()}),
    )
