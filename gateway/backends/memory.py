"""An in-memory model server on asyncio timers: the simulator's backend.

``MemoryBackend`` is a ``gateway.backends.base.Backend`` that does what the
example Triton repository's capacity emulator does
(``examples/orchid/emulator/orchid_emulator.py`` behind Triton's dynamic batcher),
with no I/O and no threads: only the running loop's timers. On
``orchid_tools.virtual_time.VirtualTimeLoop`` its time is virtual, so a minute of
a 24-device fleet runs in seconds of wall time. It owns the emulation of one
Triton endpoint: model queues, instances, devices, batches, health and
statistics. It must not decide anything the gateway decides (admission, order,
fallback): it executes what it is sent, as Triton would.

Theory of operation (the emulator's rules, per model):

* **Queue and instances.** Requests wait in the model's FIFO queue. Whenever an
  instance is free, Triton's dynamic batcher (``max_queue_delay`` 0) takes the
  queue's head and the requests behind it while their rows fit
  ``max_batch_size`` (0: one request per execution) and executes them as one batch.
* **Devices.** Each instance stands for one device. With ``devices`` set (the
  emulator's ``ORCHID_DEVICE_DIR`` mode, the gateway's ``shared_devices``), every
  model's instances take turns on that many shared devices: a formed batch waits
  (FIFO) for a free one.
* **Cost** (``DemandProfile``, milliseconds x ``time_factor``): a batch of ``n``
  rows holds its device for ``fixed_ms + prefill_ms_per_token x n x longest input``
  (padded prefill), then decode steps in lockstep: member ``i`` is done after
  ``decode_ms_per_token x its output tokens``; the batch holds the device until its
  last member is done, and every member's response leaves then (synchronized
  completion). A batch of one costs the seed's per-request price. ``call_overhead_ms``
  (default 0) adds a fixed wall time per execution beyond the profile: what a real
  server or the capacity emulator measurably spends per call (a simulation calibrated
  on a measured backend).
* **Cancellation.** A request cancelled while queued leaves the queue; one
  cancelled while its batch runs stops decoding at once (prefill cannot be
  interrupted), which frees the device early when it was the longest member.
  A request's ``timeout_s`` is the deadline the server enforces: it then fails
  with ``DeadlineExpired`` and is cancelled, as Triton cancels a request whose
  gRPC deadline passed.
* **Decoupled models** (``decoupled``: the streaming variant) run one request per
  execution and send one response per generated token as each is decoded, then an
  empty final response.
* **Faults.** ``set_healthy(False)``: the device group is lost: every queued and
  running request fails with ``Unavailable`` (the device time already spent is
  lost), and the backend refuses work until ``set_healthy(True)``.
  ``slow_down(model, k, longer_than=n)``: that model's requests with more than
  ``n`` input tokens take ``k`` x their profile time (underprediction); the batch
  they run in takes ``k`` x as long.
* **Units** (a backend with a topology, ``gateway.core.topology``; the emulator's
  tensor-parallel mode). On shared devices, a request that carries the parameter
  ``devices`` (a string such as ``"4,5"``: the unit the gateway bound it to) runs on
  exactly those devices: its execution holds all of them together for its duration and
  never starts while one of them is busy (it waits; executions that can start go first,
  as the emulator's polling executions do). A model given ``units`` (its units' devices:
  a TP-t model's groups of t) whose request names none takes the first of its units that
  is wholly free; a model without units takes one free device (the lowest). Each
  execution's ``device_ms`` counts every device it held. Requests naming different
  devices are never batched together. ``set_devices_lost(devices, lost)``: a device lost
  is never held again until it is back; an execution holding one fails at once with the
  error a server gives (``Internal``: ``device N is lost``), as does one that names a
  lost device, or a model whose every unit spans one; work running on a device when it is
  lost fails then (its device time is lost). Without ``units``, lost devices and any
  ``devices`` parameter, the devices are scheduled exactly as above (lowest free device,
  FIFO).
* **Cold start and model control.** ``set_healthy(True, cold=True)`` restores the
  group as a restarted server: it answers (``healthy``) at once, but every model
  loads and warms again for its ``load_s`` (Triton's load plus its own
  ``model_warmup``) before it is ready; until then ``is_warm``/``model_ready`` say
  no, ``model_spec`` and ``infer`` answer ``Unavailable`` as Triton answers for an
  unavailable model (so the gateway's readiness path, not a special case, keeps
  work off it), and the statistics counters start again from zero. A model
  declared ``loaded=False`` sits in the repository unloaded (Triton's explicit
  model control): ``load_model`` loads it in ``load_s``, ``unload_model`` lets its
  work finish and unloads it, ``repository_index`` lists each model's state (a
  ``gateway.backends.base.RepositoryControl``, what a rollout needs). Loading
  holds no device time here (the devices' transfer and initialisation are not
  modeled, only the wait).

* **Prefix cache** (a model given ``prefix_cache``, a
  ``gateway.core.prefix.PrefixCacheSpec``; the emulator's ``prefix_block_tokens`` and
  ``prefix_cache_blocks``). Per model, one LRU of block keys bounded by
  ``capacity_blocks`` (``gateway.core.prefix.PrefixIndex``). When a request's batch
  starts (as a server's prefill reads its cache), its prompt (the first row of its
  tokens input, little-endian INT32) is cut into chained block keys under its scope (the
  request parameter ``prefix_scope``, a string; "" when absent): the leading blocks held
  are its cached tokens (``gateway.core.prefix.cached_tokens``: capped at its input less
  one), then all its full blocks are inserted or touched, the deeper ones older (evicted
  first), as the emulator's lookup does. Its batch's prefill is charged on the uncached
  tokens: ``fixed_ms + prefill_ms_per_token x rows x max(input - cached)``; decode is
  unchanged. Each response (every streamed one too) carries the cached tokens as the
  response parameter ``prefix_cached_tokens`` (int64). ``prefix_stats`` gives the
  model's lookups, hits, hit_blocks, miss_blocks, inserted and evictions; a cold restart
  empties the cache and them. A model without ``prefix_cache`` runs exactly as before.

Outputs are the emulator's: ``OUTPUT_IDS`` (INT32, ``[rows, output tokens]``;
``[output tokens]`` for unbatched models), deterministic tokens derived from the
sum of the input ids. Statistics are Triton's cumulative per-model counters
(success, queue and compute time, inference and execution counts), enough for
``gateway.backends.stats.StatsSample``. Every finished execution is reported to
``on_execution`` (request id, model, device-ms, whether it was answered), the
simulator's record of wasted device time.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway import clock
from gateway.backends.base import BackendStream, InputSpec, ModelSpec
from gateway.core.errors import DeadlineExpired, GatewayError, Internal, InvalidArgument, Unavailable
from gateway.core.prefix import (
    CACHED_TOKENS_PARAMETER,
    SCOPE_PARAMETER,
    TOKEN_BYTES,
    PrefixCacheSpec,
    PrefixIndex,
    block_keys,
    cached_tokens,
)
from gateway.core.profile import DemandProfile
from gateway.shape import prompt_bytes

VOCAB = 32_000  # the emulator's output token range
NS_PER_S = 1_000_000_000
DEVICES_PARAMETER = "devices"  # gateway.shape.DEVICES_PARAMETER: the unit a request is bound to


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """One model a ``MemoryBackend`` serves: what its Triton config would declare."""

    name: str
    profile: DemandProfile  # fixed_ms, prefill_ms_per_token, decode_ms_per_token: its real cost
    instances: int = 1  # each stands for one device (unless the backend's devices are shared)
    max_batch_size: int = 8  # 0: no batching; inputs then have no batch dimension
    default_max_output_tokens: int = 64
    output_limit_parameter: str = "max_output_tokens"
    decoupled: bool = False  # one response per generated token (the streaming variant)
    version: str = "1"
    input_name: str = "INPUT_IDS"
    output_name: str = "OUTPUT_IDS"
    load_s: float = 0.0  # load + warm-up before it is ready (a cold start, a repository load)
    loaded: bool = True  # False: in the repository, not loaded (explicit model control)
    prefix_cache: PrefixCacheSpec | None = None  # a prefix cache (see the module docstring)

    def spec(self) -> ModelSpec:
        dims = (-1, -1) if self.max_batch_size > 0 else (-1,)
        return ModelSpec(
            name=self.name,
            versions=(self.version,),
            inputs=(InputSpec(self.input_name, "INT32", dims),),
            outputs=(self.output_name,),
            max_batch_size=self.max_batch_size,
            decoupled=self.decoupled,
            instances=self.instances,
            prefix_cache=self.prefix_cache,
        )


@dataclass(frozen=True, slots=True)
class Execution:
    """One request's part of an execution, reported when it ends."""

    request_id: str
    model: str
    started_at: float  # loop time its batch took a device
    device_ms: float  # its share of the batch's device time (by batch-of-one price)
    answered: bool  # its response was delivered (False: cancelled, expired or lost)


class _State(Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3


@dataclass(eq=False, slots=True)
class _Work:
    """One request at the backend: queued, then a member of an executing batch."""

    model: _Model
    request: service_pb2.ModelInferRequest
    logical: str
    rows: int
    input_tokens: int
    output_tokens: int
    arrived: float
    deliver: Callable[[_Work, service_pb2.ModelInferResponse | None, GatewayError | None], None]
    token: Callable[[_Work, int], None] | None = None  # decoupled: one call per generated token
    state: _State = _State.QUEUED
    batch: _Batch | None = None
    decode_end: float = 0.0  # when its last token is decoded (its batch's clock)
    cancelled: bool = False
    deadline: asyncio.TimerHandle | None = None
    tokens_sent: int = 0
    devices: tuple[int, ...] | None = None  # the unit its request names (parameter ``devices``)
    cached: int = 0  # prompt tokens its model's prefix cache served (looked up when its batch starts)
    input_sum: int | None = None  # the sum of its input ids (``_work_sum``), once needed

    @property
    def solo_ms(self) -> float:
        """Its batch-of-one price, the weight of its share of a batch's device time."""
        return (
            self.model.profile.accelerator_ms(self.input_tokens - self.cached, self.output_tokens) * self.rows
        )


@dataclass(eq=False, slots=True)
class _Batch:
    model: _Model
    members: list[_Work]
    device: int = -1
    devices: tuple[int, ...] = ()  # every device it holds (units mode; () otherwise: ``device``)
    started: float = 0.0
    prefill_end: float = 0.0
    end: float = 0.0
    timer: asyncio.TimerHandle | None = None
    token_timer: asyncio.TimerHandle | None = None


@dataclass(eq=False, slots=True)
class _PrefixCache:
    """One model's prefix cache on one backend: its blocks (an LRU) and its counters."""

    spec: PrefixCacheSpec
    index: PrefixIndex
    lookups: int = 0  # prompts looked up
    hits: int = 0  # of them, with at least one cached block
    hit_blocks: int = 0  # leading blocks found cached
    miss_blocks: int = 0  # full blocks looked up but not cached
    inserted: int = 0  # blocks newly inserted

    @classmethod
    def of(cls, spec: PrefixCacheSpec) -> _PrefixCache:
        return cls(spec, PrefixIndex(spec.capacity_blocks))

    def lookup(self, scope: str, prompt: bytes) -> int:
        """Look one prompt up, then hold all of its full blocks (the deeper older): its
        cached tokens."""
        block = self.spec.block_tokens
        keys = block_keys(scope, prompt, block)
        index = self.index
        matched = index.match(keys)
        before = len(index) + index.evictions
        index.record(keys)  # the shallowest most recent: the deeper go first (PrefixIndex.record)
        self.inserted += len(index) + index.evictions - before
        self.lookups += 1
        if matched:
            self.hits += 1
        self.hit_blocks += matched
        self.miss_blocks += len(keys) - matched
        return cached_tokens(matched, block, len(prompt) // TOKEN_BYTES)

    def stats(self) -> dict[str, int]:
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_blocks": self.hit_blocks,
            "miss_blocks": self.miss_blocks,
            "inserted": self.inserted,
            "evictions": self.index.evictions,
            "held_blocks": len(self.index),
        }


class _Devices:
    """A set of devices and the batches waiting for one (FIFO), shared by several models
    when the backend's devices are shared."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.free = list(range(count))  # a heap: the lowest free device first (never a lost one)
        self.waiting: deque[_Batch] = deque()
        self.running: dict[_Batch, None] = {}
        # Units mode: batches hold sets of devices (a topology's units, a request's ``devices``).
        self.units_mode = False
        self.lost: set[int] = set()


@dataclass(eq=False)
class _Model:
    spec: MemoryModel
    devices: _Devices
    free_instances: int
    queue: deque[_Work] = field(default_factory=deque)
    slow_factor: float = 1.0
    slow_longer_than: int = 0
    success_count: int = 0
    success_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    failures: int = 0
    inferences: int = 0
    executions: int = 0
    state: str = "READY"  # Triton's repository states: READY, LOADING, UNAVAILABLE
    loading: asyncio.TimerHandle | None = None
    loaded_waiters: list[asyncio.Future[None]] = field(default_factory=list)
    model_spec: ModelSpec | None = None  # spec.spec(), built once (both are frozen)
    prefix: _PrefixCache | None = None  # its prefix cache (spec.prefix_cache)

    @property
    def ready(self) -> bool:
        return self.state == "READY"

    @property
    def profile(self) -> DemandProfile:
        return self.spec.profile


class MemoryBackend:
    """One emulated Triton endpoint serving ``models`` (see the module docstring)."""

    def __init__(
        self,
        name: str,
        models: Mapping[str, MemoryModel] | list[MemoryModel],
        *,
        devices: int | None = None,
        time_factor: float = 1.0,
        call_overhead_ms: float = 0.0,
        on_execution: Callable[[Execution], None] | None = None,
        units: Mapping[str, Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """``units`` (shared ``devices`` only): a backend with a topology; per model, the
        devices of each of its units (a model not named runs on one device per execution)."""
        if time_factor < 0:
            raise ValueError(f"time_factor must be >= 0, got {time_factor}")
        if units is not None and devices is None:
            raise ValueError("units need shared devices (devices=N)")
        if not call_overhead_ms >= 0:
            raise ValueError(f"call_overhead_ms must be >= 0, got {call_overhead_ms}")
        self.name = name
        self.time_factor = time_factor
        self.call_overhead_ms = call_overhead_ms
        self.on_execution = on_execution
        self.shared_devices = devices is not None
        shared = _Devices(devices) if devices is not None else None
        listed = list(models.values()) if isinstance(models, Mapping) else list(models)
        self._models: dict[str, _Model] = {}
        for model in listed:
            pool = shared if shared is not None else _Devices(model.instances)
            self._models[model.name] = _Model(
                model,
                pool,
                model.instances,
                state="READY" if model.loaded else "UNAVAILABLE",
                prefix=_PrefixCache.of(model.prefix_cache) if model.prefix_cache is not None else None,
            )
        self._pools: list[_Devices] = list({id(m.devices): m.devices for m in self._models.values()}.values())
        self._shared = shared
        self._units: dict[str, tuple[tuple[int, ...], ...]] = {}
        if shared is not None and units is not None:
            shared.units_mode = True
            for model_name, model_units in units.items():
                planned = tuple(tuple(int(d) for d in unit) for unit in model_units)
                for unit in planned:
                    if (
                        not unit
                        or any(not 0 <= d < shared.count for d in unit)
                        or len(set(unit)) != len(unit)
                    ):
                        raise ValueError(
                            f"{model_name}: unit {list(unit)} is not a set of devices 0..{shared.count - 1}"
                        )
                self._units[model_name] = planned
        self._healthy = True
        self._down_at = 0.0
        self.watched_models: set[str] = set()
        self._streams: dict[_MemoryStream, None] = {}

    # ------------------------------------------------------------------ health

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def healthy_at(self) -> float:
        """Now while healthy (it needs no probe to know); when it went down otherwise."""
        return clock.now() if self._healthy else self._down_at

    def set_healthy(self, healthy: bool, *, cold: bool = False) -> None:
        """Lose (False) or restore (True) the whole device group. Losing it fails every
        queued and running request with ``Unavailable``; their device time is lost. Restored
        ``cold``, it is a restarted server: each model that was loaded loads and warms again
        for its ``load_s`` before it is ready, and the statistics start from zero."""
        if healthy == self._healthy:
            return
        self._healthy = healthy
        if healthy:
            for model in self._models.values():
                if model.state == "UNAVAILABLE":
                    continue  # not loaded: it stays in the repository
                if cold:
                    model.success_count = model.success_ns = model.queue_ns = model.compute_ns = 0
                    model.failures = model.inferences = model.executions = 0
                    if model.prefix is not None:  # a restarted server's cache starts empty
                        model.prefix = _PrefixCache.of(model.prefix.spec)
                if cold or model.state == "LOADING":
                    self._begin_load(model)  # a load the loss interrupted starts again too
            return
        self._down_at = clock.now()
        for model in self._models.values():
            if model.loading is not None:
                model.loading.cancel()  # it loads again when the group is back
                model.loading = None
            for waiter in model.loaded_waiters:  # a repository load in progress fails
                if not waiter.done():
                    waiter.set_exception(ConnectionError(f"backend {self.name} was lost while loading"))
            model.loaded_waiters.clear()
        for model in self._models.values():
            while model.queue:
                work = model.queue.popleft()
                if not work.cancelled:
                    self._fail(work, self._unavailable(work))
        for pool in self._pools:
            for batch in [*pool.waiting, *pool.running]:
                self._abort(batch)
            pool.waiting.clear()
        for stream in list(self._streams):
            stream.broken(Unavailable(f"backend {self.name} is unavailable"))

    def slow_down(self, model: str, factor: float, *, longer_than: int = 0) -> None:
        """Requests to ``model`` with more than ``longer_than`` input tokens take ``factor`` x
        their profile time from now on (1.0 restores the profile)."""
        state = self._model(model, model)
        state.slow_factor = factor
        state.slow_longer_than = longer_than

    def set_devices_lost(self, devices: Iterable[int], lost: bool = True) -> None:
        """Devices lost (or back, ``lost=False``) on a backend with shared devices: an
        execution holding a lost device fails at once (``device N is lost``), and none holds
        one again until it is back (see the module docstring)."""
        pool = self._shared
        if pool is None:
            raise ValueError(f"backend {self.name} has no shared devices to lose")
        changed = sorted(set(devices))
        for d in changed:
            if not 0 <= d < pool.count:
                raise ValueError(f"device {d} is out of range (0..{pool.count - 1})")
        pool.units_mode = True
        if lost:
            pool.lost.update(changed)
            pool.free = [d for d in pool.free if d not in pool.lost]
            heapq.heapify(pool.free)
            for batch in list(pool.running):
                hit = sorted(set(batch.devices).intersection(changed))
                if hit:
                    self._abort(batch, f"device {hit[0]} is lost")
        else:
            pool.lost.difference_update(changed)
            held = {d for batch in pool.running for d in batch.devices}
            for d in changed:
                if d not in held and d not in pool.free:
                    heapq.heappush(pool.free, d)
        if not self._healthy:
            return
        for model in self._models.values():
            if model.devices is pool:
                self._form(model)
        self._place(pool)

    @property
    def lost_devices(self) -> tuple[int, ...]:
        """The shared devices lost now."""
        return tuple(sorted(self._shared.lost)) if self._shared is not None else ()

    def is_warm(self, model: str) -> bool:
        """Healthy and the model loaded and warmed: ready to serve (never a cold load)."""
        state = self._models.get(model)
        return self._healthy and state is not None and state.ready

    # ------------------------------------------------------------------ model control

    def _begin_load(self, model: _Model) -> None:
        """Load and warm ``model``: ready after its ``load_s``."""
        model.state = "LOADING"
        if model.loading is not None:
            model.loading.cancel()
        delay = model.spec.load_s
        model.loading = asyncio.get_running_loop().call_at(clock.now() + delay, self._loaded, model)

    def _loaded(self, model: _Model) -> None:
        model.loading = None
        if not self._healthy:
            return
        model.state = "READY"
        for waiter in model.loaded_waiters:
            if not waiter.done():
                waiter.set_result(None)
        model.loaded_waiters.clear()
        self._dispatch(model)

    async def load_model(self, model: str, *, timeout_s: float) -> None:
        """Load ``model`` from the repository (Triton's ``RepositoryModelLoad``): it is ready
        after its ``load_s``; a load that outlasts ``timeout_s`` fails."""
        from gateway.backends.triton import ModelControlError  # the same error a Triton raises

        state = self._models.get(model)
        if state is None:
            raise ModelControlError(f"loading {model!r} failed: not in the model repository")
        if not self._healthy:
            raise ModelControlError(f"loading {model!r} failed: backend {self.name} is unavailable")
        if state.ready:
            return
        if state.state != "LOADING":
            self._begin_load(state)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        state.loaded_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            raise ModelControlError(f"loading {model!r} failed: not ready after {timeout_s:g} s") from None
        except ConnectionError as exc:
            raise ModelControlError(f"loading {model!r} failed: {exc}") from None

    async def unload_model(self, model: str, *, timeout_s: float) -> None:
        """Unload ``model`` (``RepositoryModelUnload``): new requests are refused from now on;
        work already queued or running still finishes (as Triton lets it), after this returns."""
        state = self._model(model, model)
        if state.loading is not None:
            state.loading.cancel()
            state.loading = None
        for waiter in state.loaded_waiters:  # a load in progress fails: it was unloaded
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"{model!r} was unloaded while loading"))
        state.loaded_waiters.clear()
        state.state = "UNAVAILABLE"

    async def repository_index(self) -> list[tuple[str, str, str]]:
        """(name, version, state) of every model in the repository."""
        return [(name, m.spec.version, m.state) for name, m in sorted(self._models.items())]

    def prefix_stats(self, model: str) -> dict[str, int] | None:
        """``model``'s prefix-cache counters since start (or a cold restart): lookups, hits,
        hit_blocks, miss_blocks, inserted, evictions and the blocks held now; None for a
        model without a prefix cache."""
        state = self._model(model, model)
        return state.prefix.stats() if state.prefix is not None else None

    async def probe(self) -> bool:
        return self._healthy

    def start_probing(self, interval_s: float = 0.5) -> None:
        """Nothing to poll: faults change the health view directly."""
        return None

    async def close(self) -> None:
        for stream in list(self._streams):
            stream.cancel()
        self.set_healthy(False)

    async def model_ready(self, model: str, version: str = "") -> bool:
        return self.is_warm(model)

    # ------------------------------------------------------------------ metadata

    def _model(self, model: str, logical: str) -> _Model:
        state = self._models.get(model)
        if state is None:
            raise Unavailable(f"model {logical!r} is not loaded on its backend")
        return state

    def known_spec(self, model: str) -> ModelSpec | None:
        state = self._models.get(model)
        if not self._healthy or state is None or not state.ready:
            return None  # model_spec raises Unavailable
        return state.model_spec  # None until model_spec built it once

    async def model_spec(self, model: str, *, logical: str) -> ModelSpec:
        if not self._healthy or not (state := self._model(model, logical)).ready:
            raise Unavailable(f"model {logical!r} is not ready on its backend")
        if state.model_spec is None:
            state.model_spec = state.spec.spec()
        return state.model_spec

    async def metadata(self, model: str, version: str) -> service_pb2.ModelMetadataResponse:
        spec = self._model(model, model).spec
        dims = [-1, -1] if spec.max_batch_size > 0 else [-1]
        out_dims = [-1, -1] if spec.max_batch_size > 0 else [1 if spec.decoupled else -1]
        reply = service_pb2.ModelMetadataResponse(name=spec.name, versions=[spec.version], platform="python")
        reply.inputs.add(name=spec.input_name, datatype="INT32", shape=dims)
        reply.outputs.add(name=spec.output_name, datatype="INT32", shape=out_dims)
        return reply

    async def config(self, model: str, version: str) -> service_pb2.ModelConfigResponse:
        spec = self._model(model, model).spec
        config = model_config_pb2.ModelConfig(
            name=spec.name, backend="python", max_batch_size=spec.max_batch_size
        )
        config.input.add(name=spec.input_name, data_type=model_config_pb2.TYPE_INT32, dims=[-1])
        config.output.add(
            name=spec.output_name, data_type=model_config_pb2.TYPE_INT32, dims=[1 if spec.decoupled else -1]
        )
        config.instance_group.add(count=spec.instances, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
        config.model_transaction_policy.decoupled = spec.decoupled
        if spec.max_batch_size > 0:
            config.dynamic_batching.max_queue_delay_microseconds = 0
        profile = spec.profile
        for key, value in (
            ("fixed_ms", profile.fixed_ms),
            ("prefill_ms_per_token", profile.prefill_ms_per_token),
            ("decode_ms_per_token", profile.decode_ms_per_token),
            ("default_max_output_tokens", spec.default_max_output_tokens),
        ):
            config.parameters[key].string_value = str(value)
        return service_pb2.ModelConfigResponse(config=config)

    async def statistics(self, model: str, version: str = "") -> service_pb2.ModelStatisticsResponse:
        """Triton's cumulative counters for ``model`` (all models when empty)."""
        names = [model] if model else list(self._models)
        reply = service_pb2.ModelStatisticsResponse()
        for name in names:
            state = self._model(name, name)
            entry = reply.model_stats.add(
                name=name,
                version=state.spec.version,
                inference_count=state.inferences,
                execution_count=state.executions,
            )
            stats = entry.inference_stats
            stats.success.count, stats.success.ns = state.success_count, state.success_ns
            stats.fail.count = state.failures
            stats.queue.count, stats.queue.ns = state.success_count, state.queue_ns
            stats.compute_infer.count, stats.compute_infer.ns = state.success_count, state.compute_ns
        return reply

    # ------------------------------------------------------------------ inference

    async def infer(
        self, request: service_pb2.ModelInferRequest, *, timeout_s: float, logical: str
    ) -> service_pb2.ModelInferResponse:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[service_pb2.ModelInferResponse] = loop.create_future()

        def deliver(
            work: _Work, response: service_pb2.ModelInferResponse | None, error: GatewayError | None
        ) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(response)

        work = self._submit(request, logical, deliver)
        if timeout_s <= 0:
            self._expire(work)
        else:
            work.deadline = loop.call_at(loop.time() + timeout_s, self._expire, work)
        try:
            return await future
        finally:
            if work.state is not _State.DONE:
                self._cancel(work)  # the caller went away (or was told the deadline passed)

    def stream(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], *, timeout_s: float | None
    ) -> BackendStream:
        stream = _MemoryStream(self, requests, timeout_s)
        self._streams[stream] = None
        return stream

    # ------------------------------------------------------------------ the engine

    def _unavailable(self, work: _Work) -> Unavailable:
        return Unavailable(f"no healthy backend for model {work.logical!r}")

    def _submit(
        self,
        request: service_pb2.ModelInferRequest,
        logical: str,
        deliver: Callable[[_Work, service_pb2.ModelInferResponse | None, GatewayError | None], None],
        token: Callable[[_Work, int], None] | None = None,
    ) -> _Work:
        if not self._healthy:
            raise Unavailable(f"no healthy backend for model {logical!r}")
        model = self._model(request.model_name, logical)
        if not model.ready:  # loading, warming or unloaded: Triton's "unavailable model"
            raise Unavailable(f"model {logical!r} is not ready on its backend")
        spec = model.spec
        input_name = spec.input_name
        shape = None  # the first tensor named input_name's
        for tensor in request.inputs:
            if tensor.name == input_name:
                shape = tensor.shape
                break
        if not shape:
            raise InvalidArgument(
                f"model {logical!r} rejected the request: input {spec.input_name} is required"
            )
        rows = int(shape[0]) if spec.max_batch_size > 0 and len(shape) > 1 else 1
        output_tokens = spec.default_max_output_tokens
        param = request.parameters.get(spec.output_limit_parameter) if spec.output_limit_parameter else None
        if param is not None:
            kind = param.WhichOneof("parameter_choice")
            value = param.int64_param if kind == "int64_param" else param.uint64_param
            if kind not in ("int64_param", "uint64_param") or value < 1:
                raise InvalidArgument(
                    f"model {logical!r} rejected the request: parameter "
                    f"{spec.output_limit_parameter} must be a positive integer"
                )
            output_tokens = int(value)
        devices = self._named_devices(request, model, logical) if self._shared is not None else None
        work = _Work(
            model=model,
            request=request,
            logical=logical,
            rows=max(1, rows),
            input_tokens=int(shape[-1]),
            output_tokens=output_tokens,
            arrived=clock.now(),
            deliver=deliver,
            token=token,
            devices=devices,
        )
        model.queue.append(work)
        self._dispatch(model)
        return work

    def _named_devices(
        self, request: service_pb2.ModelInferRequest, model: _Model, logical: str
    ) -> tuple[int, ...] | None:
        """The devices the request's ``devices`` parameter names (shared devices only; the
        emulator ignores it otherwise), checked as the emulator checks them."""
        pool = self._shared
        param = request.parameters.get(DEVICES_PARAMETER) if pool is not None else None
        if pool is None or param is None:
            return None
        text = param.string_param if param.WhichOneof("parameter_choice") == "string_param" else ""
        problem = ""
        try:
            named = tuple(int(part) for part in text.split(","))
        except ValueError:
            named, problem = (), f"must list device indices, got {text!r}"
        width = len(self._units[model.spec.name][0]) if self._units.get(model.spec.name) else 1
        if problem:
            pass
        elif any(not 0 <= d < pool.count for d in named):
            problem = f"names a device out of range 0..{pool.count - 1}: {text!r}"
        elif len(set(named)) != len(named):
            problem = f"names a device twice: {text!r}"
        elif len(named) != width:
            problem = f"names {len(named)} devices; the model runs on {width}"
        if problem:
            raise InvalidArgument(f"model {logical!r} rejected the request: parameter devices {problem}")
        pool.units_mode = True
        return named

    def _dispatch(self, model: _Model) -> None:
        """Form batches while the model has a free instance and queued work."""
        self._form(model)
        self._place(model.devices)

    def _form(self, model: _Model) -> None:
        """Form batches while the model has a free instance and queued work; they wait for
        devices in the model's device set."""
        limit = max(1, model.spec.max_batch_size) if not model.spec.decoupled else 1
        units_mode = model.devices.units_mode
        queue = model.queue
        while model.free_instances > 0 and queue:
            members: list[_Work] = []
            rows = 0
            while queue:
                head = queue[0]
                if head.cancelled:
                    queue.popleft()
                    continue
                if members and rows + head.rows > limit:
                    break
                if units_mode and members and head.devices != members[0].devices:
                    break  # another unit: an execution of its own
                queue.popleft()
                members.append(head)
                rows += head.rows
            if not members:
                return
            model.free_instances -= 1
            batch = _Batch(model, members)
            for work in members:
                work.state = _State.RUNNING
                work.batch = batch
            model.devices.waiting.append(batch)

    def _place(self, pool: _Devices) -> None:
        """Start waiting batches on free devices, first come first served."""
        if pool.units_mode:
            self._place_units(pool)
            return
        while pool.waiting and pool.free:
            batch = pool.waiting.popleft()
            batch.device = heapq.heappop(pool.free)
            self._start(batch, pool)

    def _place_units(self, pool: _Devices) -> None:
        """Units mode: start every waiting batch (in arrival order) whose devices are all
        free; fail at once those whose devices are lost. A batch that must wait holds up no
        other (each execution takes its devices when they are free, as the emulator's do)."""
        while True:
            failed: dict[_Model, None] = {}
            kept: deque[_Batch] = deque()
            while pool.waiting:
                batch = pool.waiting.popleft()
                choice = self._choose(pool, batch)
                if choice is None:
                    kept.append(batch)
                elif isinstance(choice, str):
                    self._abort(batch, choice)
                    failed[batch.model] = None
                else:
                    taken = set(choice)
                    pool.free = [d for d in pool.free if d not in taken]
                    heapq.heapify(pool.free)
                    batch.devices = choice
                    batch.device = choice[0]
                    self._start(batch, pool)
            pool.waiting = kept
            if not failed or not self._healthy:
                return
            for model in failed:  # its next batches form (and are placed in the next round)
                self._form(model)

    def _choose(self, pool: _Devices, batch: _Batch) -> tuple[int, ...] | str | None:
        """The devices ``batch`` starts on now; None: it waits; a string: why it fails."""
        free = set(pool.free)
        named = batch.members[0].devices
        if named is not None:
            gone = sorted(pool.lost.intersection(named))
            if gone:
                return f"device {gone[0]} is lost"
            return named if free.issuperset(named) else None
        units = self._units.get(batch.model.spec.name)
        if units:
            live = [unit for unit in units if pool.lost.isdisjoint(unit)]
            if not live:
                return f"no unit of {len(units[0])} device(s) is left: devices {sorted(pool.lost)} are lost"
            return next((unit for unit in live if free.issuperset(unit)), None)
        if pool.free:
            return (pool.free[0],)
        if len(pool.lost) >= pool.count:
            return f"no device is left: devices {sorted(pool.lost)} are lost"
        return None

    def _scale(self, model: _Model, works: list[_Work]) -> float:
        """Seconds per profile millisecond for this batch: the time factor, times the
        underprediction factor when any member is long enough to be slowed."""
        factor = self.time_factor / 1000.0
        if model.slow_factor != 1.0 and any(w.input_tokens > model.slow_longer_than for w in works):
            factor *= model.slow_factor
        return factor

    def _start(self, batch: _Batch, pool: _Devices) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        model = batch.model
        profile = model.profile
        live = [w for w in batch.members if not w.cancelled]
        scale = self._scale(model, live or batch.members)
        rows = sum(w.rows for w in batch.members)
        cache = model.prefix
        if cache is None:
            longest = max(w.input_tokens for w in batch.members)
        else:  # each member's prompt is looked up in turn (a member may hit one before it)
            input_name = model.spec.input_name
            for work in batch.members:
                work.cached = cache.lookup(_scope(work.request), prompt_bytes(work.request, input_name))
            longest = max(w.input_tokens - w.cached for w in batch.members)
        batch.started = now
        batch.prefill_end = (
            now
            + (profile.fixed_ms + profile.prefill_ms_per_token * rows * longest) * scale
            + self.call_overhead_ms / 1000.0
        )
        for work in batch.members:
            decode = profile.decode_ms_per_token * work.output_tokens * scale
            work.decode_end = batch.prefill_end if work.cancelled else batch.prefill_end + decode
        pool.running[batch] = None
        self._reschedule(batch)
        if model.spec.decoupled:
            self._next_token(batch)

    def _reschedule(self, batch: _Batch) -> None:
        """(Re)arm the batch's end: when its last member's decode is done."""
        end = max([batch.prefill_end, *(w.decode_end for w in batch.members)])
        if batch.timer is not None and end == batch.end:
            return
        if batch.timer is not None:
            batch.timer.cancel()
        batch.end = end
        batch.timer = asyncio.get_running_loop().call_at(end, self._finish, batch)

    def _next_token(self, batch: _Batch) -> None:
        """Decoupled: arm the timer of the next token of the batch's (single) request."""
        work = batch.members[0]
        if work.cancelled or work.tokens_sent >= work.output_tokens:
            return
        per_token = (work.decode_end - batch.prefill_end) / max(1, work.output_tokens)
        due = batch.prefill_end + per_token * (work.tokens_sent + 1)
        batch.token_timer = asyncio.get_running_loop().call_at(due, self._emit_token, batch)

    def _emit_token(self, batch: _Batch) -> None:
        work = batch.members[0]
        if work.cancelled or work.token is None:
            return
        work.tokens_sent += 1
        work.token(work, work.tokens_sent)
        self._next_token(batch)

    def _finish(self, batch: _Batch) -> None:
        model = batch.model
        pool = model.devices
        if batch.token_timer is not None:  # decoupled: every token is out before the final response
            batch.token_timer.cancel()
            batch.token_timer = None
            work = batch.members[0]
            while not work.cancelled and work.token is not None and work.tokens_sent < work.output_tokens:
                work.tokens_sent += 1
                work.token(work, work.tokens_sent)
        pool.running.pop(batch, None)
        batch.timer = None
        duration_s = batch.end - batch.started
        solos = [w.solo_ms for w in batch.members]  # each member's, read once
        total_solo = sum(solos) or 1.0
        held = len(batch.devices) or 1  # a unit's execution holds all its devices
        answered_rows = 0
        for work, solo_ms in zip(batch.members, solos, strict=True):
            answered = not work.cancelled
            if answered:
                answered_rows += work.rows
                model.success_count += 1
                model.success_ns += int((batch.end - work.arrived) * NS_PER_S)
                model.queue_ns += int((batch.started - work.arrived) * NS_PER_S)
                model.compute_ns += int(duration_s * NS_PER_S)
                self._complete(work)
            self._report(work, batch, duration_s * 1000.0 * solo_ms / total_solo * held, answered)
        model.inferences += answered_rows
        model.executions += 1
        self._release(batch, pool)

    def _free_devices(self, batch: _Batch, pool: _Devices) -> None:
        """The devices ``batch`` held are free again (a lost one is not)."""
        if not batch.devices:
            heapq.heappush(pool.free, batch.device)
            return
        for d in batch.devices:
            if d not in pool.lost:
                heapq.heappush(pool.free, d)

    def _release(self, batch: _Batch, pool: _Devices) -> None:
        self._free_devices(batch, pool)
        batch.model.free_instances += 1
        if not self._healthy:
            return
        self._dispatch(batch.model)  # forms its next batch, which queues for a device
        self._place(pool)  # on shared devices, perhaps another model's batch goes first

    def _report(self, work: _Work, batch: _Batch, device_ms: float, answered: bool) -> None:
        if self.on_execution is not None:
            self.on_execution(
                Execution(work.request.id, batch.model.spec.name, batch.started, device_ms, answered)
            )

    def _complete(self, work: _Work) -> None:
        work.state = _State.DONE
        if work.deadline is not None:
            work.deadline.cancel()
        spec = work.model.spec
        response = service_pb2.ModelInferResponse(
            model_name=spec.name, model_version=spec.version, id=work.request.id
        )
        if spec.prefix_cache is not None:
            response.parameters[CACHED_TOKENS_PARAMETER].int64_param = work.cached
        if spec.decoupled:
            work.deliver(work, response, None)  # the empty final response
            return
        tokens = _output_bytes(_work_sum(work), work.output_tokens)
        output = response.outputs.add(name=spec.output_name, datatype="INT32")
        if spec.max_batch_size > 0:
            output.shape.extend([work.rows, work.output_tokens])
            tokens *= work.rows  # the rows' tokens one after the other (np.tile's bytes)
        else:
            output.shape.append(work.output_tokens)
        response.raw_output_contents.append(tokens)
        work.deliver(work, response, None)

    def _fail(self, work: _Work, error: GatewayError) -> None:
        if work.state is _State.DONE:
            return
        work.state = _State.DONE
        work.cancelled = True
        work.model.failures += 1
        if work.deadline is not None:
            work.deadline.cancel()
        work.deliver(work, None, error)

    def _abort(self, batch: _Batch, why: str = "") -> None:
        """The device group was lost under this batch (or, ``why``, a device it holds or
        names): its members fail, its time is lost."""
        model = batch.model
        pool = model.devices
        now = clock.now()
        if batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        if batch.token_timer is not None:
            batch.token_timer.cancel()
        started = batch in pool.running
        pool.running.pop(batch, None)
        elapsed_ms = (now - batch.started) * 1000.0 if started else 0.0
        total_solo = sum(w.solo_ms for w in batch.members) or 1.0
        held = len(batch.devices) or 1
        for work in batch.members:
            if started:
                self._report(work, batch, elapsed_ms * work.solo_ms / total_solo * held, False)
            if work.state is not _State.DONE:
                error = (
                    Internal(f"model {work.logical!r} failed on its backend: {why}")
                    if why
                    else self._unavailable(work)
                )
                self._fail(work, error)
        if started:
            self._free_devices(batch, pool)
        model.free_instances += 1

    def _expire(self, work: _Work) -> None:
        work.deadline = None
        if work.state is _State.DONE:
            return
        self._fail(work, DeadlineExpired(f"model {work.logical!r} did not finish before the deadline"))
        self._withdraw(work)

    def _cancel(self, work: _Work) -> None:
        """The caller went away: the request stops where it is; nobody is answered."""
        if work.state is _State.DONE:
            return
        work.state = _State.DONE
        work.cancelled = True
        if work.deadline is not None:
            work.deadline.cancel()
            work.deadline = None
        self._withdraw(work)

    def _withdraw(self, work: _Work) -> None:
        """A cancelled request stops: out of the queue, or its decode ends now."""
        work.cancelled = True
        batch = work.batch
        if batch is None:
            return  # still queued: skipped (and dropped) when the next batch is formed
        if batch.device < 0 or batch.timer is None:
            return  # its batch waits for a device: it starts without this member's decode
        now = clock.now()
        work.decode_end = max(batch.prefill_end, min(work.decode_end, now))
        if batch.token_timer is not None and batch.model.spec.decoupled:
            batch.token_timer.cancel()
            batch.token_timer = None
        self._reschedule(batch)


def _input_sum(request: service_pb2.ModelInferRequest, input_name: str) -> int:
    """The sum of the input ids (the last tensor named ``input_name``; 0 without one)."""
    total = 0
    for index, tensor in enumerate(request.inputs):
        if tensor.name != input_name:
            continue
        if index < len(request.raw_input_contents):
            total = _raw_sum(request.raw_input_contents[index])
        else:
            total = int(sum(tensor.contents.int_contents))
    return total


_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)
_add_reduce = np.add.reduce


def _raw_sum(raw: bytes) -> int:
    """The sum of raw INT32 ids: ``np.frombuffer(raw, np.int32).sum(dtype=np.int64)``, called
    as the reduce that is, with its dtypes made once (half its fixed cost); integer sums are
    exact in any order. (Not memoised: hashing a long prompt costs more than summing it.)"""
    return int(_add_reduce(np.frombuffer(raw, _INT32), dtype=_INT64))


def _work_sum(work: _Work) -> int:
    """``_input_sum`` of the work's request, read once per request (a stream's every token
    derives from it)."""
    if work.input_sum is None:
        work.input_sum = _input_sum(work.request, work.model.spec.input_name)
    return work.input_sum


def _scope(request: service_pb2.ModelInferRequest) -> str:
    """The request's ``prefix_scope`` parameter ("" when absent or not a string)."""
    param = request.parameters.get(SCOPE_PARAMETER)
    if param is None or param.WhichOneof("parameter_choice") != "string_param":
        return ""
    return str(param.string_param)


def _tokens(seed: int, count: int) -> npt.NDArray[np.int32]:
    steps = np.arange(count, dtype=np.int64)
    tokens: npt.NDArray[np.int32] = ((seed + 7919 * steps + 17) % VOCAB).astype(np.int32)
    return tokens


def _last_token_bytes(seed: int, count: int) -> bytes:
    """``_tokens(seed, count)[-1:].tobytes()`` without the row before it (a stream's token
    ``count``): token ``i`` is ``(seed + 7919 i + 17) mod VOCAB``, below VOCAB, so Python's
    int arithmetic gives numpy's int64 value (0 <= seed < VOCAB) and int32 holds it."""
    if count < 1:
        return b""
    return np.int32((seed + 7919 * (count - 1) + 17) % VOCAB).tobytes()


@functools.lru_cache(maxsize=4096)
def _output_bytes_of(seed: int, count: int) -> bytes:
    return _tokens(seed, count).tobytes()


def _output_bytes(total: int, count: int) -> bytes:
    """The emulator's deterministic 'generated' tokens (``_tokens`` seeded by the sum of the input
    ids, ``total``) as bytes, memoised by (sum mod VOCAB, count): a simulation's requests
    repeat a few templates, so the same few token rows are generated again and again."""
    return _output_bytes_of(total % VOCAB, count)


class _MemoryStream:
    """One ``ModelStreamInfer`` call on a ``MemoryBackend``: requests in, responses out."""

    def __init__(
        self,
        backend: MemoryBackend,
        requests: AsyncIterator[service_pb2.ModelInferRequest],
        timeout_s: float | None,
    ) -> None:
        self.backend = backend
        self._out: asyncio.Queue[service_pb2.ModelStreamInferResponse | GatewayError | None] = asyncio.Queue()
        self._live: dict[_Work, None] = {}
        self._closing = False
        self._ended = False
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(requests))
        self._deadline = (
            loop.call_at(
                loop.time() + timeout_s, self.broken, DeadlineExpired("the stream's deadline passed")
            )
            if timeout_s is not None
            else None
        )

    async def _read(self, requests: AsyncIterator[service_pb2.ModelInferRequest]) -> None:
        async for request in requests:
            self._submit(request)
        self._closing = True
        self._maybe_end()

    def _submit(self, request: service_pb2.ModelInferRequest) -> None:
        try:
            work = self.backend._submit(request, request.model_name, self._deliver, self._token)
        except GatewayError as error:
            reply = service_pb2.ModelStreamInferResponse(error_message=error.message)
            reply.infer_response.id = request.id
            self._out.put_nowait(reply)
            return
        if work.state is not _State.DONE:
            self._live[work] = None

    def _token(self, work: _Work, index: int) -> None:
        spec = work.model.spec
        token = _last_token_bytes(_work_sum(work) % VOCAB, index)  # _tokens(...)[-1:]
        response = service_pb2.ModelInferResponse(
            model_name=spec.name, model_version=spec.version, id=work.request.id
        )
        response.outputs.add(name=spec.output_name, datatype="INT32", shape=[1])
        response.raw_output_contents.append(token)
        response.parameters["triton_final_response"].bool_param = False
        if spec.prefix_cache is not None:
            response.parameters[CACHED_TOKENS_PARAMETER].int64_param = work.cached
        self._out.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))

    def _deliver(
        self, work: _Work, response: service_pb2.ModelInferResponse | None, error: GatewayError | None
    ) -> None:
        self._live.pop(work, None)
        if error is not None:
            if isinstance(error, Unavailable):
                return  # the whole stream breaks (``broken``), as a gRPC stream does
            reply = service_pb2.ModelStreamInferResponse(error_message=error.message)
            reply.infer_response.id = work.request.id
            self._out.put_nowait(reply)
        elif response is not None:
            response.parameters["triton_final_response"].bool_param = True
            self._out.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
        self._maybe_end()

    def _maybe_end(self) -> None:
        if self._closing and not self._live and not self._ended:
            self._ended = True
            self._out.put_nowait(None)
            self._forget()

    def broken(self, error: GatewayError) -> None:
        """The call failed (backend lost, deadline): iteration raises ``error``."""
        if self._ended:
            return
        self._ended = True
        self._stop_work()
        self._out.put_nowait(error)
        self._forget()

    def cancel(self) -> bool:
        if self._ended:
            self._forget()
            return False
        self._ended = True
        self._stop_work()
        self._out.put_nowait(None)
        self._forget()
        return True

    def _stop_work(self) -> None:
        self._reader.cancel()
        for work in list(self._live):
            self.backend._cancel(work)
        self._live.clear()

    def _forget(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.backend._streams.pop(self, None)

    def __aiter__(self) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        while True:
            item = await self._out.get()
            if item is None:
                return
            if isinstance(item, GatewayError):
                raise item
            yield item


__all__ = ["Execution", "MemoryBackend", "MemoryModel"]
