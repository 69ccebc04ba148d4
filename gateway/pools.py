"""The pool registry: every (backend, model) pool's dispatch queue, device set and load.

This module owns the runtime's pools and the one way to reach them: the configured
backends (``BackendHandle``), each pool's ``DispatchQueue`` created on first use, the
device sets that backends with shared devices pool their models on, each pool's
``PoolLoad`` (the ladder's evidence) and Triton's measured timing per pool. The
placement stage (``gateway.chain.place``) asks it for candidates; rollouts, shadow
traffic, telemetry, the status page and the job runner read pools through its public
methods, never through another module's private fields.

It decides nothing about a request: ranking is ``gateway.core.placement``'s, the ladder
is ``gateway.core.overload``'s. It may await a backend (a model's spec, statistics); it
never reads a request's policy, quota or price.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.base import ModelSpec
from gateway.backends.stats import PoolTiming, StatsSample, timing_between
from gateway.backends.triton import TritonBackend
from gateway.config import GatewayConfig, RouteConfig, RouteTable
from gateway.core import memory as device_memory
from gateway.core.errors import InvalidArgument, Unavailable
from gateway.core.load import PoolLoad
from gateway.core.placement import best_placement, device_work_term, placement_head
from gateway.core.prefix import Option, PrefixMatch, choose
from gateway.core.profile import DemandProfile
from gateway.core.units import UnitDeviceSet
from gateway.exchange import BackendHandle, GatewayListener
from gateway.prefix_affinity import PrefixAffinity
from gateway.scheduler import DeviceSet, DispatchQueue, FleetBinding

# Ladder step changes (the core returns them; bench/surge.py and bench/noisy_neighbour.py read them).
overload_log = logging.getLogger("orchid.overload")

_NONE_EXCLUDED: frozenset[str] = frozenset()  # the usual exclusion: one set, hashed once
Pool = tuple[BackendHandle, ModelSpec, DispatchQueue]


class Generation:
    """The generation of everything a request's plan is derived from: configuration, policy,
    quality evidence, backend health and rollout state. One per ``Gateway`` (its pool
    registry's); whoever changes one of those calls ``bump``, and every cache of per-request
    plans (pool candidates, route facts, the stable policy context, evidence verdicts) keys
    on ``value``, so a change takes effect on the very next request."""

    __slots__ = ("reasons", "value")

    def __init__(self) -> None:
        self.value = 0
        self.reasons: dict[str, int] = {}  # bumps by reason (for tests and the status page)

    def bump(self, reason: str = "") -> int:
        self.value += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return self.value


class _Candidates:
    """A route's candidate backends in one cell, less an exclusion: derived once per
    generation (``PoolRegistry.place``). Health is read live on every request."""

    __slots__ = ("generation", "handles", "profile", "route")

    def __init__(
        self,
        generation: int,
        route: RouteConfig,
        handles: tuple[tuple[str, BackendHandle], ...],
        profile: DemandProfile | None,
    ) -> None:
        self.generation = generation
        self.route = route  # held, so the id keying it cannot be reused while the entry lives
        self.handles = handles
        self.profile = profile


MAX_PLANS = 4096  # cached candidate plans (route x cell x exclusion); cleared when full


class PoolRegistry:
    """Backends and their pools. One per ``Gateway``."""

    def __init__(self, config: GatewayConfig, routes: RouteTable, backends: dict[str, BackendHandle]) -> None:
        self.config = config
        self.routes = routes
        self.backends = backends
        self.fleet_slots: FleetBinding | None = None  # set by the server with state.backend redis
        self.loads: dict[str, PoolLoad] = {}
        self.timing: dict[str, PoolTiming] = {}
        self._queues: dict[tuple[str, str], DispatchQueue] = {}
        self._device_sets: dict[str, DeviceSet] = {}  # backends whose models share devices
        # A backend with a topology: one device set of units for all its models, from the start
        # (an operator may mark devices lost before a pool exists: dispatch rule 10).
        for name, handle in backends.items():
            if handle.topology is not None:
                self._device_sets[name] = UnitDeviceSet(
                    handle.topology.topology(handle.devices),
                    memory=handle.memory,
                    lost=handle.topology.lost_devices(),
                )
        self._stats_samples: dict[str, StatsSample] = {}
        self.generation = Generation()
        self.prefix = PrefixAffinity()  # prefix-cache indexes, learned hit rates, counters
        for handle in backends.values():
            if isinstance(handle.client, TritonBackend):  # MemoryBackend's health is read live only
                handle.client.on_health_change = self.health_changed
        self._plans: dict[tuple[int, str, frozenset[str]], _Candidates] = {}
        default = config.classes.get(config.default_class)
        # One dwell budget per pool, whatever class arrives first: the default class's cap.
        self.dwell_budget_ms = default.max_dwell_ms if default is not None else 20.0

    # ------------------------------------------------------------------ reading

    def queues(self) -> list[DispatchQueue]:
        """Every pool's dispatch queue, in creation order."""
        return list(self._queues.values())

    def pools(self) -> Iterator[tuple[str, str, DispatchQueue]]:
        """(backend name, backend model, queue) of every pool."""
        for (backend_name, model), queue in list(self._queues.items()):
            yield backend_name, model, queue

    def queue_named(self, name: str) -> DispatchQueue | None:
        """The dispatch queue of pool ``name`` (``backend/model``), if it exists."""
        return next((q for q in self._queues.values() if q.name == name), None)

    def queues_of_model(self, backend_model: str) -> list[DispatchQueue]:
        """Every pool of ``backend_model``, on any backend."""
        return [q for (_b, m), q in list(self._queues.items()) if m == backend_model]

    def shared_device_set(self, backend_name: str) -> DeviceSet | None:
        """The device set a backend with shared devices pools its models on, once one exists."""
        return self._device_sets.get(backend_name)

    def candidate_backends(self, route: RouteConfig, cell: str, exclude: Iterable[str] = ()) -> list[str]:
        """The route's backends in ``cell``, in configured order, less ``exclude`` (the
        backends a policy routing rule excluded: a placement filter)."""
        excluded = frozenset(exclude)
        names = route.backends or tuple(self.backends)
        return [
            n
            for n in names
            if n in self.backends and self.backends[n].labels.get("cell") == cell and n not in excluded
        ]

    # ------------------------------------------------------------------ pools

    def queue_for(
        self, backend_name: str, spec: ModelSpec, profile: DemandProfile | None = None
    ) -> DispatchQueue:
        """The pool of ``spec`` on the backend, created on first use. ``profile`` (the route's)
        places the model's replica on the pool's devices for the live-memory bound."""
        key = (backend_name, spec.name)
        queue = self._queues.get(key)
        if queue is None:
            handle = self.backends[backend_name]
            limits = self.config.limits
            devices = spec.instances  # in the emulator each instance stands for one device
            device_set = DeviceSet(devices, memory=handle.memory)
            topology = handle.topology
            units = None
            if topology is not None:  # one device set of units for all its models (rule 10)
                units = topology.units_of(handle.devices, spec.name)
                devices = len(units)
                device_set = self._device_sets[backend_name]
            elif handle.shared_devices:
                devices = handle.devices
                device_set = self._device_sets.setdefault(
                    backend_name, DeviceSet(devices, memory=handle.memory)
                )
            queue = DispatchQueue(
                f"{backend_name}/{spec.name}",
                devices=devices,
                slots=devices * handle.max_inflight_per_device,
                max_queued=limits.max_queued_per_backend,
                reserved_control=limits.reserved_control_slots,
                device_set=device_set,
            )
            queue.apply_limits(limits)  # the turn cap and the per-tenant decode share
            queue.device_set.short_lane = limits.short_lane_devices
            queue.device_set.short_lane_soft = limits.short_lane_soft_devices
            # Co-batching (dispatch rule 6) binds work into a batch waiting in the backend's
            # queue, which a replica of a fleet cannot see the others' work in: it stays off
            # there. A stream runs alone (one request per execution).
            if not spec.decoupled and self.fleet_slots is None:
                queue.co_batch_max = max(1, min(limits.co_batch_max, spec.max_batch_size))
            queue.fleet = self.fleet_slots  # a fleet's shared dispatch slots (None: this process only)
            queue.batch_profile = profile  # its batch cost, for co-batching (dispatch rule 6)
            width = 1
            if topology is not None and units is not None and isinstance(device_set, UnitDeviceSet):
                layout = topology.layout_of(spec.name)
                device_set.attach(queue, layout, units)
                width = layout.width
            if profile is not None:  # each device holds its share of a unit's shards
                queue.device_set.place(spec.name, -(-device_memory.resident_bytes(profile) // width))
            self._queues[key] = queue
        return queue

    # ------------------------------------------------------------------ topology

    def unit_set(self, backend_name: str) -> UnitDeviceSet:
        """The units of a backend with a topology (InvalidArgument for any other name)."""
        device_set = self._device_sets.get(backend_name)
        if not isinstance(device_set, UnitDeviceSet):
            known = sorted(n for n, d in self._device_sets.items() if isinstance(d, UnitDeviceSet))
            raise InvalidArgument(
                f"backend {backend_name[:64]!r} has no topology; "
                f"backends with one: {', '.join(known) or 'none'}"
            )
        return device_set

    def set_devices_lost(self, backend_name: str, devices: Iterable[int], *, lost: bool, now: float) -> None:
        """Mark a topology's devices lost or back (``UnitDeviceSet.mark_lost``)."""
        unit_set = self.unit_set(backend_name)
        try:
            unit_set.mark_lost(devices, lost=lost, now=now)
        except ValueError as exc:
            raise InvalidArgument(f"backend {backend_name!r}: {exc}") from None
        overload_log.warning(
            "backend %s: devices %s marked %s; lost now: %s",
            backend_name,
            sorted(devices),
            "lost" if lost else "back",
            sorted(unit_set.lost) or "none",
        )

    def topologies(self) -> Iterator[tuple[str, UnitDeviceSet]]:
        """(backend name, its units) of every backend with a topology."""
        for name, device_set in sorted(self._device_sets.items()):
            if isinstance(device_set, UnitDeviceSet):
                yield name, device_set

    def health_changed(self, backend_name: str) -> None:
        """A backend's health flipped (its client calls this): a new generation."""
        self.generation.bump(f"health:{backend_name}")

    def candidates(self, route: RouteConfig, cell: str, exclude: Iterable[str] = ()) -> _Candidates:
        """``candidate_backends`` with their handles and the route's profile, derived once per
        (generation, route, cell, exclusion)."""
        excluded = (
            exclude if isinstance(exclude, frozenset) else frozenset(exclude) if exclude else _NONE_EXCLUDED
        )
        key = (id(route), cell, excluded)
        generation = self.generation.value
        plan = self._plans.get(key)
        if plan is None or plan.generation != generation or plan.route is not route:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()  # bounded: rollouts' candidate routes come and go
            plan = _Candidates(
                generation,
                route,
                tuple((n, self.backends[n]) for n in self.candidate_backends(route, cell, excluded)),
                self.routes.profiles.get(route.profile),
            )
            self._plans[key] = plan
        return plan

    async def place(
        self, route: RouteConfig, cell: str, logical: str, *, exclude: Iterable[str] = ()
    ) -> Pool:
        """Filter, score, pick: the healthy backends of the route in ``cell`` (less
        ``exclude``), ranked by ``core.placement``: the least predicted wait, then the least
        recent offered demand per device (what each pool's ladder judges, so placement
        never feeds a degrading pool more demand), then the least work still to run on the
        pool's device set (``core.placement.best_placement``: that sum over the work in flight
        only where the first two terms tie). Nothing is predicted when there is no choice."""
        return self._least(await self._healthy(route, cell, logical, exclude), clock.now())

    async def place_prompt(
        self,
        route: RouteConfig,
        cell: str,
        logical: str,
        request: service_pb2.ModelInferRequest,
        tenant: str,
        *,
        exclude: Iterable[str] = (),
    ) -> tuple[Pool, PrefixMatch | None]:
        """``place``, for a request whose prompt a backend's prefix cache may hold: when the
        model declares a cache, the request's scope and block keys are matched against each
        candidate pool's index and, if the route asks for affinity, the pool with the best
        expected saving within ``max_extra_wait_ms`` of the least-loaded pool's predicted
        wait is chosen (``core.prefix.choose``; otherwise the least-loaded, a spill). The
        match is what pricing takes off the request's prefill."""
        pools = await self._healthy(route, cell, logical, exclude)
        spec = pools[0][1].prefix_cache
        if spec is None:
            return self._least(pools, clock.now()), None
        query = self.prefix.query(
            request,
            route.shape.tokens_input,
            spec,
            tenant=tenant,
            cell=cell,
            model=route.backend_model,
            version=route.version,
        )
        now = clock.now()
        affinity = route.prefix_affinity
        profile = self.routes.profiles.get(route.profile)
        per_token = profile.prefill_ms_per_token if profile is not None else 0.0
        if affinity is None or len(pools) == 1 or not query.keys:
            chosen = self._least(pools, now)
            spilled, extra_wait_ms = False, 0.0
        else:  # each pool's predicted wait once: the load ranking and the bound both read it
            waits = {pool[2].name: pool[2].predicted_wait_ms(now) for pool in pools}
            least = self._least(pools, now, waits)
            options = [
                Option(
                    wait_ms=waits[pool[2].name],
                    saving_ms=query.tokens(self.prefix.index(pool[2].name, spec).match(query.keys))
                    * per_token
                    * pool[0].time_scale,
                )
                for pool in pools
            ]
            choice = choose(options, pools.index(least), affinity.max_extra_wait_ms)
            chosen, spilled, extra_wait_ms = pools[choice.index], choice.spilled, choice.extra_wait_ms
        match = self.prefix.match(
            query,
            chosen[2].name,
            spec,
            route=logical,
            tenant=tenant,
            prefill_ms_per_token=per_token * chosen[0].time_scale,
            spilled=spilled,
            extra_wait_ms=extra_wait_ms,
        )
        return chosen, match

    async def _healthy(
        self, route: RouteConfig, cell: str, logical: str, exclude: Iterable[str]
    ) -> list[Pool]:
        """The route's healthy pools in ``cell`` less ``exclude`` (Unavailable: none)."""
        plan = self.candidates(route, cell, exclude)
        pools: list[Pool] = []
        for name, handle in plan.handles:
            backend = handle.client
            if not backend.healthy:  # read live: a flip takes effect on the next request
                continue
            spec = backend.known_spec(route.backend_model)
            if spec is None:  # not known without I/O (or not ready: model_spec raises)
                try:
                    spec = await backend.model_spec(route.backend_model, logical=logical)
                except Unavailable:
                    continue
            pools.append((handle, spec, self.queue_for(name, spec, plan.profile)))
        if not pools:
            raise Unavailable(
                f"no healthy backend serves model {logical!r} in this credential's privacy cell"
            )
        return pools

    def _least(self, pools: list[Pool], now: float, waits: dict[str, float] | None = None) -> Pool:
        """The load ranking's pick (``core.placement``) among ``pools`` (``waits``: their
        predicted waits by queue name, when the caller has them already); the only pool when
        there is no choice, with nothing predicted."""
        if len(pools) == 1:
            return pools[0]

        def head(pool: Pool) -> tuple[float, float]:
            queue = pool[2]
            load = self.loads.get(queue.name)
            offered = load.offered_rate.ms_per_s(now) if load is not None else 0.0
            wait = waits[queue.name] if waits is not None else queue.predicted_wait_ms(now)
            return placement_head(wait, offered, queue.devices)

        def device_work(pool: Pool) -> float:
            queue = pool[2]
            work = sum(q.inflight_remaining_ms(now) for q in queue.device_set.queues)
            return device_work_term(work, queue.devices)

        chosen = best_placement(pools, head, device_work)
        assert chosen is not None  # pools is not empty
        return chosen

    async def healthy(
        self, route: RouteConfig, cell: str, logical: str, *, exclude: Iterable[str] = ()
    ) -> list[Pool] | None:
        """The route's healthy pools in ``cell`` less ``exclude`` (None: none), their queues
        created on first use, for a caller that picks among them only if it needs a pool
        (``warm_pick``)."""
        try:
            return await self._healthy(route, cell, logical, exclude)
        except Unavailable:
            return None

    def warm_pick(self, route: RouteConfig, pools: list[Pool]) -> Pool | None:
        """``place``'s pick among ``healthy``'s pools, only if it is warm right now (a fallback
        never cold-loads)."""
        handle, spec, queue = self._least(pools, clock.now())
        return (handle, spec, queue) if handle.client.is_warm(route.backend_model) else None

    def load(self, queue: DispatchQueue, route: RouteConfig | None = None) -> PoolLoad:
        """The pool's ladder evidence, created on first use (with the route's quality losses)."""
        load = self.loads.get(queue.name)
        if load is None:
            load = PoolLoad(
                queue.name,
                devices=queue.capacity_devices,  # a topology's: its units' devices
                dwell_budget_ms=self.dwell_budget_ms,
                config=self.config.ladder,
                protected_utilization=self.config.protected_utilization,
            )
            self.loads[queue.name] = load
            if route is not None and route.quality is not None:
                fallback = self.routes.models.get(route.fallback) if route.fallback else None
                full = route.quality.score
                reduced = route.reduced_output.quality.score if route.reduced_output else full
                compact = fallback.quality.score if fallback and fallback.quality else full
                load.set_quality(reduce_loss=max(0.0, full - reduced), fallback_loss=max(0.0, full - compact))
        return load

    # ------------------------------------------------------------------ periodic

    def update_ladders(self, now: float, listener: GatewayListener) -> None:
        """Step every pool's ladder from fresh evidence (called periodically)."""
        self._share_units(now)
        for backend_name, _model, queue in self.pools():
            load = self.loads.get(queue.name)
            handle = self.backends.get(backend_name)
            if load is None or handle is None:
                continue
            evidence_at = now if handle.client.healthy else handle.client.healthy_at
            state = load.gather(now, queue, healthy=handle.client.healthy, evidence_at=evidence_at)
            if state.changed:
                overload_log.warning("pool %s ladder step -> %d: %s", load.name, state.step, state.reason)
            listener.ladder(queue.name, int(state.step))

    def _share_units(self, now: float) -> None:
        """On a backend with a topology every pool's units share the same devices: each pool's
        ladder plans for its part of them, in proportion to the demand offered to it
        (``PoolLoad.capacity_share``: its offered accelerator-ms per second over all the pools'
        on the devices; all of them while it is offered none). Every pool then reads the devices'
        whole load, and all step together. Without it each pool counted every device as its
        own: a TP-2 model's load beside a TP-1 model's overloaded the devices while neither
        ladder stepped, and the fallback both divert to ran late."""
        for _backend, units in self.topologies():
            loads = [self.loads[q.name] for q in units.queues if q.name in self.loads]
            if len(loads) < 2:
                continue
            offered = [load.demand.rate_ms_per_s(now) for load in loads]
            total = sum(offered)
            for load, mine in zip(loads, offered, strict=True):
                # A pool offered nothing (a fallback its primary diverts to, counted there) has
                # nothing to shed: it keeps every device, never a capacity of zero to step on.
                load.capacity_share = mine / total if mine > 0 else 1.0

    async def sample_statistics(self) -> None:
        """Refresh per-pool Triton queue/compute timing from statistics deltas."""
        for backend_name, model, queue in self.pools():
            handle = self.backends.get(backend_name)
            if handle is None or not handle.client.healthy:
                continue
            try:
                sample = StatsSample.from_response(await handle.client.statistics(model))
            except Exception:  # statistics are evidence, not a dependency of serving
                continue
            before = self._stats_samples.get(queue.name)
            self._stats_samples[queue.name] = sample
            if before is not None:
                timing = timing_between(before, sample)
                if timing is not None:
                    self.timing[queue.name] = timing
