"""The backend seam: what the runtime uses of a model server, and nothing more.

``Backend`` is the one cut between the gateway's runtime and a model server (as
httpx's ``BaseTransport`` is between its API and the network). The request path
(``gateway.chain``), the protocol edge (``gateway.protocol``) and the process
assembly (``gateway.server``) call only these members. Two implementations:

* ``gateway.backends.triton.TritonBackend``: a real Triton endpoint over gRPC;
* ``gateway.backends.memory.MemoryBackend``: an in-memory capacity emulator on
  asyncio timers (the simulator's backend; in virtual time on
  ``orchid_tools.virtual_time.VirtualTimeLoop``).

Both speak the KServe v2 protobuf messages of ``tritonclient.grpc`` (requests
in, responses, metadata, config and statistics out), so the request path is the
same whichever serves it. Failures are raised as the domain's ``GatewayError``
tree, never as a transport's exceptions.

``ModelSpec`` (with ``InputSpec``) is what the gateway needs to know about one
backend model: its inputs, outputs, batching, instance count and prefix cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tritonclient.grpc import service_pb2

from gateway.core.errors import GatewayError, Unavailable
from gateway.core.prefix import PrefixCacheSpec


@dataclass(frozen=True, slots=True)
class InputSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 = variable; includes the batch dim for batched models
    optional: bool = False


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the gateway needs from a backend model's metadata and config."""

    name: str
    versions: tuple[str, ...]
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    max_batch_size: int
    decoupled: bool
    instances: int  # instance count: each stands for one device in the emulator
    # The model's prefix cache, when its config declares one (``prefix_block_tokens`` and
    # ``prefix_cache_blocks`` parameters): requests carry their scope (gateway.core.prefix).
    prefix_cache: PrefixCacheSpec | None = None

    def input(self, name: str) -> InputSpec | None:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None


class BackendStream(Protocol):
    """One bidirectional ``ModelStreamInfer`` call: responses as they come; ``cancel`` ends it."""

    def __aiter__(self) -> AsyncIterator[service_pb2.ModelStreamInferResponse]: ...

    def cancel(self) -> bool: ...


class Backend(Protocol):
    """A model server as the runtime sees it.

    Health: ``healthy`` is the current view (the request path skips an unhealthy
    backend); ``healthy_at`` when it was last known healthy (the ladder treats
    older evidence as stale); ``is_warm`` whether a model is loaded and ready right
    now (a fallback is never cold-loaded). ``watched_models`` are the models whose
    readiness ``probe`` refreshes; ``start_probing`` keeps probing until ``close``.
    """

    @property
    def name(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def healthy_at(self) -> float: ...

    @property
    def watched_models(self) -> set[str]: ...

    def is_warm(self, model: str) -> bool: ...

    async def probe(self) -> bool: ...

    def start_probing(self, interval_s: float = 0.5) -> None: ...

    async def close(self) -> None: ...

    async def model_ready(self, model: str, version: str = "") -> bool: ...

    async def model_spec(self, model: str, *, logical: str) -> ModelSpec: ...

    def known_spec(self, model: str) -> ModelSpec | None:
        """What ``model_spec`` would return right now without any I/O, or None (then await
        ``model_spec``, which fetches it or raises ``Unavailable``): placement reads it for
        every candidate pool of every request."""
        ...

    async def metadata(self, model: str, version: str) -> service_pb2.ModelMetadataResponse: ...

    async def config(self, model: str, version: str) -> service_pb2.ModelConfigResponse: ...

    async def statistics(self, model: str, version: str = "") -> service_pb2.ModelStatisticsResponse: ...

    async def infer(
        self, request: service_pb2.ModelInferRequest, *, timeout_s: float, logical: str
    ) -> service_pb2.ModelInferResponse:
        """Run one request; ``timeout_s`` is the deadline the server enforces (and cancels at)."""
        ...

    def stream(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], *, timeout_s: float | None
    ) -> BackendStream:
        """Open a ``ModelStreamInfer`` call fed by ``requests``; it ends after the last answer
        to a request sent before ``requests`` ended."""
        ...


@runtime_checkable
class RepositoryControl(Protocol):
    """A backend whose models can be loaded and unloaded on request (Triton's repository API
    in explicit model-control mode): what a rollout (``gateway.rollouts``) needs beyond
    ``Backend``. ``TritonBackend`` has it; the simulator's ``MemoryBackend`` does not."""

    async def load_model(self, model: str, *, timeout_s: float) -> None: ...

    async def unload_model(self, model: str, *, timeout_s: float) -> None: ...

    async def repository_index(self) -> list[tuple[str, str, str]]: ...


async def infer_streamed(
    backend: Backend, request: service_pb2.ModelInferRequest, *, timeout_s: float | None
) -> service_pb2.ModelInferResponse:
    """One request to a decoupled (streaming) model, answered as one response: the request on
    a backend stream of its own, every partial response's outputs concatenated along their
    first dimension, in order (a rollout's warm-up and shadow judge a streaming candidate's
    whole answer against its output contract this way). A backend error reply raises
    UNAVAILABLE with its message (bounded by the caller's error mapping)."""
    request.parameters["triton_enable_empty_final_response"].bool_param = True

    async def one() -> AsyncIterator[service_pb2.ModelInferRequest]:
        yield request

    combined = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    chunks: dict[str, list[bytes]] = {}
    rows: dict[str, int] = {}
    call = backend.stream(one(), timeout_s=timeout_s)
    try:
        async for reply in _replies(call, request.model_name):
            if reply.error_message:
                raise Unavailable(f"{request.model_name}: {reply.error_message[:512]}")
            response = reply.infer_response
            for index, output in enumerate(response.outputs):
                if output.name not in chunks:
                    tensor = combined.outputs.add(name=output.name, datatype=output.datatype)
                    tensor.shape.extend(output.shape)
                    chunks[output.name], rows[output.name] = [], 0
                if index < len(response.raw_output_contents):
                    chunks[output.name].append(response.raw_output_contents[index])
                rows[output.name] += int(output.shape[0]) if output.shape else 1
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
    finally:
        call.cancel()
    for tensor in combined.outputs:
        if tensor.shape:
            tensor.shape[0] = rows[tensor.name]
        combined.raw_output_contents.append(b"".join(chunks[tensor.name]))
    return combined


async def _replies(call: BackendStream, model: str) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
    """The call's replies; a broken stream (a transport error) is UNAVAILABLE."""
    try:
        async for reply in call:
            yield reply
    except GatewayError:
        raise
    except Exception as exc:
        raise Unavailable(f"streaming backend failed for {model} ({type(exc).__name__})") from exc
