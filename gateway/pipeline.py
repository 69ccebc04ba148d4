"""The request path: authenticate, shape, estimate, decide, queue, dispatch, settle.

``Gateway`` owns the runtime state the request path needs (tenants, routes,
backends and their dispatch queues) and runs one request through the stages of
ARCHITECTURE §3. Decisions are delegated to the pure core (``shape``,
``estimate``, ``admission``); this module only sequences them and does the
awaiting: on the dispatch queue and on the Triton backend. It knows nothing
about gRPC servers: ``protocol`` adapts it to ``inference.GRPCInferenceService``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.auth import Tenant, TenantDirectory
from gateway.backends.base import Backend, ModelSpec
from gateway.backends.stats import PoolTiming, StatsSample, timing_between
from gateway.config import GatewayConfig, RequestClassConfig, RouteConfig, RouteTable
from gateway.core import admission, pricing, settlement
from gateway.core import memory as device_memory
from gateway.core.dispatch import LATE_RULE, BatchShape, CoBatch
from gateway.core.dwell import dwell_sample_ms
from gateway.core.errors import (
    DeadlineExpired,
    DeadlineInfeasible,
    GatewayError,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    error_for_status,
)
from gateway.core.estimate import CorrectionKey, Estimator
from gateway.core.evidence import Evidence, RouteEvidence
from gateway.core.load import PoolLoad
from gateway.core.memory import DeviceMemory
from gateway.core.outputs import OUTPUT_CONTRACT_RULE
from gateway.core.overload import effects as overload_effects
from gateway.core.placement import placement_key
from gateway.core.profile import DemandProfile
from gateway.core.quota import QuotaView, Reservation
from gateway.core.record import (
    Decision,
    Identity,
    Mode,
    Outcome,
    RequestRecord,
    Shape,
    Verdict,
)
from gateway.core.risk import resolve_risk_class
from gateway.core.rollout import HEDGE_REASON
from gateway.evidence import DENIED_DEGRADATION, EvidenceStore
from gateway.idempotent import OPERATION_ID, OnlineOperations
from gateway.messages import attach_provenance, parse_infer_request
from gateway.outputs import INVALID_OUTPUTS, check_outputs
from gateway.policy.context import build_policy_context, quality_floor
from gateway.policy.model import ISOLATION_RULE
from gateway.policy.schema import BackendFacts, LoadFacts, PolicyContext
from gateway.policy.snapshot import PolicyResult
from gateway.policy.store import PolicyStore
from gateway.rollouts import RolloutController
from gateway.scheduler import DeviceSet, DispatchQueue, FleetBinding, Slot
from gateway.shadow import ShadowTraffic
from gateway.shape import (
    GATEWAY_OWNED_PARAMETERS,
    check_backend_controls,
    extract_shape,
    fallback_refusal,
    payload_bytes,
    read_hints,
    validate_tensors,
)
from gateway.state.base import MemoryQuotaStore, QuotaStore
from gateway.streams import StreamSession

log = logging.getLogger(__name__)
# Ladder step changes (the core returns them; bench/surge.py and bench/noisy_neighbour.py read them).
overload_log = logging.getLogger("orchid.overload")

# New work the ladder's shedder may refuse at step 5: online requests and new streams (a stream
# already admitted runs on; async and batch work is deferred from step 4 instead).
SHED_MODES = frozenset({Mode.ONLINE, Mode.STREAMING})

# A random (version 4) UUID's bits: everything but the version and variant fields are random.
_UUID4_RANDOM = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_FIXED = (4 << 76) | (0x8000 << 48)


def new_request_id() -> str:
    """A request id: ``uuid.uuid4().hex`` (the same random bits and format), without building
    a ``UUID`` object on every request."""
    return f"{int.from_bytes(os.urandom(16)) & _UUID4_RANDOM | _UUID4_FIXED:032x}"


class GatewayListener:
    """Typed events out of the request path; telemetry subscribes. The base class ignores them.

    decided  every admission decision (admit, fallback, reject) with its policy result
    settled  every completed request with observed work and stage times
    failed   every call answered with an error status (``rule``: the deciding rule, or "")
    ladder   a pool's ladder step, after each update
    """

    def decided(self, record: RequestRecord, decision: Decision, policy: PolicyResult) -> None:
        return None

    def settled(self, settled: Settled) -> None:
        return None

    def failed(self, status: str, rule: str) -> None:
        return None

    def ladder(self, pool: str, step: int) -> None:
        return None

    def stream_settled(self, settled: Settled, stream: settlement.StreamSummary) -> None:
        """A stream request ended (final response, failure or cancel): its settlement and how
        its results met its objectives (``GapTracker.finish``; first result, gaps)."""
        return None


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Monotonic timestamps of one request's stages (telemetry builds spans from them)."""

    received_at: float
    admitted_at: float
    dispatched_at: float
    finished_at: float


@dataclass(frozen=True, slots=True)
class BackendHandle:
    """A configured backend: its client and the facts from its config."""

    client: Backend
    labels: dict[str, str]
    devices: int
    max_inflight_per_device: int
    time_scale: float = 1.0  # its devices run time_scale x the profile's milliseconds
    shared_devices: bool = False  # all its models run on the same `devices` accelerators
    memory: DeviceMemory | None = None  # each device's memory; None: live state is not bounded


@dataclass(frozen=True, slots=True)
class CallContext:
    """What the protocol edge knows about a call."""

    metadata: tuple[tuple[str, str | bytes], ...]
    time_remaining_s: float | None  # the caller's gRPC deadline, None if it set none
    received_at: float  # clock.now() when the call arrived (the event loop clock)
    peer_subjects: tuple[str, ...] = ()  # verified client-certificate common names (mTLS)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed admission, bound to a pool, ready to dispatch."""

    record: RequestRecord
    decision: Decision
    route: RouteConfig
    backend: Backend
    queue: DispatchQueue
    backend_request: service_pb2.ModelInferRequest
    deadline_at: float
    correction_key: CorrectionKey
    reservation: Reservation
    received_at: float
    admitted_at: float
    evidence: Evidence | None = None  # the quality evidence a degraded answer rests on
    # A canary's hedge: the candidate must answer by then, leaving the current version time.
    canary_deadline_at: float | None = None


@dataclass(frozen=True, slots=True)
class _Priced:
    record: RequestRecord
    route: RouteConfig
    handle: BackendHandle
    queue: DispatchQueue
    correction_key: CorrectionKey


@dataclass(frozen=True, slots=True)
class _RouteFacts:
    """A route's policy facts that depend on configuration alone (``Gateway._route_facts``)."""

    route: RouteConfig  # held, so the id keying it cannot be reused while the entry lives
    fallback: RouteConfig | None
    fallback_handles: tuple[BackendHandle, ...]  # the fallback's backends in the cell, in order
    backends: tuple[BackendFacts, ...]


_MAX_ROUTE_FACTS = 1024


@dataclass(frozen=True, slots=True)
class Settled:
    record: RequestRecord
    decision: Decision
    outcome: Outcome
    stages: StageTimes | None = None
    evidence: Evidence | None = None  # the quality evidence a degraded answer rests on


class Gateway:
    """Runtime state and the request path. One per process."""

    def __init__(
        self,
        config: GatewayConfig,
        tenants: TenantDirectory,
        routes: RouteTable,
        backends: dict[str, BackendHandle],
        policy: PolicyStore,
        *,
        listener: GatewayListener | None = None,
        quotas: QuotaStore | None = None,
    ) -> None:
        self.config = config
        self.tenants = tenants
        self.routes = routes
        self.backends = backends
        self.policy = policy
        self.evidence = EvidenceStore(routes)  # seeded from the route files; the admin RPC publishes
        # The quota ledger: this process's (state.backend memory) or the fleet's (gateway/state/).
        self.quotas: QuotaStore = quotas if quotas is not None else MemoryQuotaStore(tenants.settings.quotas)
        self.fleet_slots: FleetBinding | None = None  # set by the server with state.backend redis
        self.listener: GatewayListener = listener or GatewayListener()
        self.loads: dict[str, PoolLoad] = {}
        self._tenant_routes: dict[tuple[str, str], RouteConfig | None] = {}
        self._route_facts_cache: dict[tuple[int, str], _RouteFacts] = {}  # see _route_facts
        self.shadows = ShadowTraffic(self)
        self.rollouts = RolloutController(self)  # version changes (gateway.rollouts); none by default
        self._queues: dict[tuple[str, str], DispatchQueue] = {}
        self._device_sets: dict[str, DeviceSet] = {}  # backends whose models share devices
        self.estimator = Estimator()
        self.pool_timing: dict[str, PoolTiming] = {}
        self._stats_samples: dict[str, StatsSample] = {}
        self.operations = OnlineOperations()  # online requests' orchid.operation_id
        self.accepting = True

    # ------------------------------------------------------------------ lookup

    def tenant_route(self, tenant: Tenant, model: str) -> RouteConfig:
        """The route for ``model`` if this tenant may call it. Unknown and forbidden models
        answer the same NOT_FOUND, so a tenant cannot probe which models exist."""
        route = self.routes.models.get(model)
        if route is None or not tenant.may_call(model):
            raise NotFound(f"unknown model {model!r}")
        key = (model, tenant.name)
        if key not in self._tenant_routes:  # a dedicated tenant's copy is built once, not per request
            self._tenant_routes[key] = route.for_tenant(model, tenant.config)
        own = self._tenant_routes[key]
        if own is None:  # config checks rule this out at load; never fall back to shared instances
            raise PermissionDenied(f"model {model!r} has no dedicated capacity for this credential")
        return own

    def request_class(self, requested: str | None) -> tuple[str, RequestClassConfig]:
        """The class's reserves. Whether this tenant may use it is policy's call (class-allowed)."""
        name = requested or self.config.default_class
        config = self.config.classes.get(name)
        if config is None:
            known = ", ".join(sorted(self.config.classes))
            # The value is not echoed: parameters may carry user data (see docs/security.md).
            raise InvalidArgument(f"unknown request class in orchid.class (known: {known})")
        return name, config

    def candidate_backends(self, route: RouteConfig, cell: str) -> list[str]:
        names = route.backends or tuple(self.backends)
        return [n for n in names if n in self.backends and self.backends[n].labels.get("cell") == cell]

    def queue_for(
        self, backend_name: str, spec: ModelSpec, profile: DemandProfile | None = None
    ) -> DispatchQueue:
        """The pool of ``spec`` on the backend, created on first use. ``profile`` (the route's)
        places the model's replica on the pool's devices for the live-memory bound."""
        key = (backend_name, spec.name)
        queue = self._queues.get(key)
        if queue is None:
            handle = self.backends[backend_name]
            devices = spec.instances  # in the emulator each instance stands for one device
            device_set = DeviceSet(devices, memory=handle.memory)
            if handle.shared_devices:
                devices = handle.devices
                device_set = self._device_sets.setdefault(
                    backend_name, DeviceSet(devices, memory=handle.memory)
                )
            queue = DispatchQueue(
                f"{backend_name}/{spec.name}",
                devices=devices,
                slots=devices * handle.max_inflight_per_device,
                max_queued=self.config.limits.max_queued_per_backend,
                reserved_control=self.config.limits.reserved_control_slots,
                device_set=device_set,
            )
            queue.device_set.short_lane = self.config.limits.short_lane_devices
            queue.device_set.short_lane_soft = self.config.limits.short_lane_soft_devices
            # Co-batching (dispatch rule 6) binds work into a batch waiting in the backend's
            # queue, which a replica of a fleet cannot see the others' work in: it stays off
            # there. A stream runs alone (one request per execution).
            if not spec.decoupled and self.fleet_slots is None:
                queue.co_batch_max = max(1, min(self.config.limits.co_batch_max, spec.max_batch_size))
            queue.fleet = self.fleet_slots  # a fleet's shared dispatch slots (None: this process only)
            queue.batch_profile = profile  # its batch cost, for co-batching (dispatch rule 6)
            if profile is not None:
                queue.device_set.place(spec.name, device_memory.resident_bytes(profile))
            self._queues[key] = queue
        return queue

    async def bind_pool(
        self, route: RouteConfig, cell: str, logical: str
    ) -> tuple[BackendHandle, ModelSpec, DispatchQueue]:
        """Pick the healthy backend in the request's cell that ``core.placement`` ranks first:
        the least predicted wait, then the least recent offered demand per device (what each
        pool's ladder judges, so placement never feeds a degrading pool more demand; the
        module docstring tells the metastable loop this breaks), then the least work still to
        run on the pool's device set. Nothing is predicted when there is no choice."""
        best: tuple[tuple[float, float, float], BackendHandle, ModelSpec, DispatchQueue] | None = None
        candidates = self.candidate_backends(route, cell)
        now = clock.now()
        for name in candidates:
            handle = self.backends[name]
            backend = handle.client
            if not backend.healthy:
                continue
            try:
                spec = await backend.model_spec(route.backend_model, logical=logical)
            except Unavailable:
                continue
            queue = self.queue_for(name, spec, self.routes.profiles.get(route.profile))
            if len(candidates) > 1:
                load = self.loads.get(queue.name)
                key = placement_key(
                    queue.predicted_wait_ms(now),
                    load.offered_rate.ms_per_s(now) if load is not None else 0.0,
                    sum(q.inflight_remaining_ms(now) for q in queue.device_set.queues),
                    queue.devices,
                )
            else:
                key = (0.0, 0.0, 0.0)
            if best is None or key < best[0]:
                best = (key, handle, spec, queue)
        if best is None:
            raise Unavailable(
                f"no healthy backend serves model {logical!r} in this credential's privacy cell"
            )
        return best[1], best[2], best[3]

    # ------------------------------------------------------------------ admission

    async def admit(
        self,
        request: service_pb2.ModelInferRequest,
        tenant: Tenant,
        call: CallContext,
        *,
        operation: str,
        mode: Mode,
        late: Admitted | None = None,
        canary: bool = True,
    ) -> Admitted:
        """Authenticated request in; an ``Admitted`` bound to a pool out, or a ``GatewayError``.

        Prices the request on its route (and on the route's warm fallback when the
        decision may need it), evaluates the policy snapshot, and lets the pure
        ``admission.decide`` choose.

        ``late``: this request was admitted to its primary but its latest start passed in
        the queue. The primary then counts as denied for capacity (DEADLINE_EXCEEDED,
        ``queue.latest_start``), so the decision is the warm fallback if policy allows it
        and it can still finish in time, or that refusal; its demand was offered once.

        ``canary``: false when the request was already tried on a rollout's candidate (it is
        answered by the current version, see ``RolloutController.candidate_failed``): that
        is its one bounded recovery, so its class's variance reserve (R_fail), which the
        canary's budget left for it, is not held back again."""
        logical = request.model_name
        # A promoted rollout's candidate serves the route (its old version may be unloaded).
        route = self.rollouts.promoted_route(logical, self.tenant_route(tenant, logical))
        if route.streaming != (mode is Mode.STREAMING):
            if route.streaming:
                raise InvalidArgument(f"model {logical!r} streams its output: call ModelStreamInfer")
            raise InvalidArgument(f"model {logical!r} does not stream: call ModelInfer")
        if request.model_version and route.version and request.model_version != route.version:
            raise NotFound(f"unknown version {request.model_version!r} of model {logical!r}")
        hints = read_hints(request)
        check_backend_controls(request)
        class_name, request_class = self.request_class(hints.request_class)
        if not canary:  # a canary answered again: this is the request's one bounded recovery
            request_class = request_class.model_copy(update={"reserve_fail_ms": 0.0})  # (R_fail)
        cell = tenant.config.home_cell
        handle, spec, queue = await self.bind_pool(route, cell, logical)
        shapes = validate_tensors(request, spec, model=logical)
        shape = extract_shape(
            shapes,
            hints,
            route.shape,
            model=logical,
            streaming=mode is Mode.STREAMING,
            input_bytes=payload_bytes(request),
        )
        now = clock.now()
        deadline_ms = self._deadline_ms(call, request_class)
        identity = Identity(
            request_id=late.record.identity.request_id if late is not None else new_request_id(),
            tenant=tenant.name,
            request_class=class_name,
            model=logical,
            model_version=route.version,
            operation=operation,
            mode=mode,
            privacy_cell=cell,
            risk_class=resolve_risk_class(
                self.config.risk_classes,
                tenant_default=tenant.config.risk_class,
                route_default=route.risk_class,
                requested=hints.risk_class,
            ),
            allow_fallback=hints.allow_fallback and tenant.config.allow_fallback,
            operation_id=hints.operation_id,
        )

        # A rollout may serve this request from its candidate (a canary, or promoted). A
        # canary's hedge budget compares its price on both versions (``price_on``).
        def price_on(on: RouteConfig, on_handle: BackendHandle, on_queue: DispatchQueue) -> RequestRecord:
            step = self.pool_load(on_queue, request_class, on).step
            return self._price(
                identity, on, shape, on_handle, on_queue, call, deadline_ms, request_class, step, now
            ).record

        diverted = await self.rollouts.divert(
            logical,
            route,
            tenant,
            request_class=class_name,
            shape=shape,
            risk_class=identity.risk_class,
            cell=cell,
            mode=mode,
            canary=canary and late is None,
            current_pool=(handle, queue),
            price=price_on,
        )
        if diverted is not None:
            route, handle, queue = diverted.route, diverted.handle, diverted.queue
            identity = dataclasses.replace(identity, model_version=diverted.label)
        load = self.pool_load(queue, request_class, route)
        flow = load.flow(
            class_name, tenant.name, weight=tenant.config.weight, class_weight=request_class.weight
        )
        quota = self.quotas.available(tenant.name, class_name, now=now)
        priced = self._price(
            identity, route, shape, handle, queue, call, deadline_ms, request_class, load.step, now
        )
        # Work that can never fit on an idle device of the pool is refused before it is offered.
        device_memory.check_fits(priced.record, queue.device_set.live_room_bytes)
        offered_ms = priced.record.demand.accelerator_ms
        policy = self.policy.current()
        reduce_output = load.reduce_output(flow)
        shared_fallback = self.routes.models.get(route.fallback) if route.fallback else None
        verdicts = self.evidence.route_evidence(
            logical, route, shared_fallback, floor=quality_floor(route, shared_fallback), now=clock.wall()
        )
        context = self._policy_context(
            tenant, route, cell, load, quota, reduce_output=reduce_output, evidence=verdicts
        )
        primary = admission.Candidate(priced.record, self.policy.evaluate(priced.record, context, policy))
        # Offered demand is admissible work, priced on the model asked for, before any ladder
        # action: a request its own tenant's quota, entitlement or policy refuses is not load
        # (the flooder's excess is its own problem); one refused for want of capacity is.
        admissible = primary.policy.allowed or primary.policy.status == "DEADLINE_EXCEEDED"
        if late is not None:
            admissible = False  # offered (and admitted) once already, on its first pass
            primary = admission.Candidate(
                primary.record,
                dataclasses.replace(
                    primary.policy,
                    allowed=False,
                    status="DEADLINE_EXCEEDED",
                    rule=LATE_RULE,
                    message="the request could not start before its deadline",
                    retry_after_ms=None,
                ),
            )
        shed = False
        if primary.policy.allowed and mode in SHED_MODES and load.shed(flow):
            # Part of this flow's excess at step 5+: policy decides how it is refused.
            shed = True
            context = dataclasses.replace(context, load=dataclasses.replace(context.load, shed=True))
            primary = admission.Candidate(priced.record, self.policy.evaluate(priced.record, context, policy))
        effects = overload_effects(load.step)
        fallback: admission.Candidate | None = None
        fallback_priced: _Priced | None = None
        fallback_load: PoolLoad | None = None
        # A dedicated tenant's fallback must be dedicated too; otherwise it has none.
        fallback_route = (
            shared_fallback.for_tenant(route.fallback, tenant.config)
            if shared_fallback and route.fallback
            else None
        )
        fallback_pool = await self._warm_fallback(fallback_route, cell, logical) if fallback_route else None
        divert = effects.fallback_for_eligible and primary.policy.fallback_eligible and load.divert(flow)
        fallback_refused = ""  # why the fallback cannot take the request as asked
        taking: tuple[BackendHandle, ModelSpec, DispatchQueue] | None = None  # the fallback pass's pool
        if fallback_route is not None and admission.wants_fallback_pass(
            primary.policy, effects, fallback_pool is not None, divert
        ):
            assert fallback_pool is not None and route.fallback is not None
            fallback_refused = fallback_refusal(
                request, fallback_pool[1], fallback_route.shape, shape, model=route.fallback
            )
            taking = None if fallback_refused else fallback_pool
        if taking is not None and fallback_route is not None and route.fallback is not None:
            f_handle, _f_spec, f_queue = taking
            f_identity = dataclasses.replace(
                identity, model=route.fallback, model_version=fallback_route.version
            )
            f_shape = dataclasses.replace(
                shape, max_output_tokens=min(shape.max_output_tokens, fallback_route.shape.max_output_tokens)
            )
            fallback_load = self.pool_load(f_queue, request_class)
            f_flow = fallback_load.flow(
                class_name, tenant.name, weight=tenant.config.weight, class_weight=request_class.weight
            )
            fallback_priced = self._price(
                f_identity,
                fallback_route,
                f_shape,
                f_handle,
                f_queue,
                call,
                deadline_ms,
                request_class,
                fallback_load.step,
                now,
            )
            # The fallback is judged on its own pool's load: a request shed on the primary is
            # not thereby shed on the fallback, and the fallback's own excess is its own.
            f_shed = mode in SHED_MODES and fallback_load.shed(f_flow)
            f_context = dataclasses.replace(
                context,
                load=LoadFacts(
                    utilization=fallback_load.utilization(),
                    drain_ms=fallback_load.drain_ms(),
                    shed=f_shed,
                    reduce_output=False,
                ),
            )
            fallback = admission.Candidate(
                fallback_priced.record, self.policy.evaluate(fallback_priced.record, f_context, policy)
            )
            if f_shed:
                fallback_load.offer(now, f_flow, fallback_priced.record.demand.accelerator_ms)
            load.observed_saving(
                priced.record.demand.accelerator_ms, fallback_priced.record.demand.accelerator_ms
            )
        decision = admission.decide(
            primary,
            fallback,
            admission.AdmissionContext(
                effects=effects,
                retry_after_ms=load.retry_after_ms(),
                batch_classes=frozenset(self.config.batch_classes),
                divert=divert,
                fallback_limits=admission.FallbackLimits(
                    model=route.fallback,
                    max_input_tokens=fallback_route.shape.max_input_tokens,
                    max_output_tokens=fallback_route.shape.max_output_tokens,
                    max_items=fallback_route.shape.max_items,
                )
                if fallback_route is not None and route.fallback
                else None,
                fallback_refused=fallback_refused,
            ),
        )
        if diverted is not None and diverted.reason and decision.verdict is Verdict.ADMIT:
            decision = dataclasses.replace(decision, route_reason=diverted.reason)
        elif not canary and late is None and decision.verdict is Verdict.ADMIT:
            decision = dataclasses.replace(decision, route_reason=HEDGE_REASON)  # a canary re-answered
        self.listener.decided(primary.record, decision, primary.policy)
        self._count_evidence_denials(logical, route, verdicts, effects.fallback_for_eligible, reduce_output)
        if decision.verdict is Verdict.REJECT:
            if admissible or shed or decision.rules == (admission.DEFER_BATCH_RULE,):
                load.offer(now, flow, offered_ms)
            error_type = error_for_status(decision.status)
            rule = decision.rules[0] if decision.rules else None
            raise error_type(decision.message, rule=rule, retry_after_ms=decision.retry_after_ms)
        chosen = fallback_priced if decision.verdict is Verdict.FALLBACK and fallback_priced else priced
        limit = decision.max_output_tokens
        if limit is not None and limit < chosen.record.shape.max_output_tokens:
            # The backend will generate only `limit` tokens: price what will run, so the queue,
            # the quota reservation and the estimator (observed vs predicted) see that work,
            # not the longer output that was asked for.
            full_ms = chosen.record.demand.accelerator_ms
            on_fallback = chosen is fallback_priced and fallback_load is not None
            chosen = self._price(
                chosen.record.identity,
                chosen.route,
                dataclasses.replace(chosen.record.shape, max_output_tokens=limit),
                chosen.handle,
                chosen.queue,
                call,
                deadline_ms,
                request_class,
                fallback_load.step if on_fallback and fallback_load is not None else load.step,
                now,
            )
            if not on_fallback:
                load.reduced(now, flow, full_ms, chosen.record.demand.accelerator_ms)
        chosen_policy = (
            fallback.policy if fallback is not None and chosen is fallback_priced else primary.policy
        )
        if chosen.handle.client.name in chosen_policy.excluded_backends:
            # Routing already keeps to the cell; a routing rule that still excludes the chosen
            # backend is a second, independent guard (defence in depth), never overridden.
            raise Unavailable(
                f"no backend allowed by policy serves model {logical!r}", rule="routing.excluded_backend"
            )
        if chosen_policy.annotation_map.get("isolation") == "dedicated" and (
            chosen.route.backend_model not in tenant.config.dedicated_models.values()
        ):
            # The one enforcement of `annotate: {isolation: dedicated}` (policy.model's registry):
            # a reserved backend model is its own pool, so its batches hold no other tenant.
            raise PermissionDenied(
                f"policy requires dedicated isolation, and model {logical!r} has no capacity "
                "reserved for this credential",
                rule=ISOLATION_RULE,
            )
        # Reserve the predicted demand of what will run; settled with the observed charge. A
        # refusal here (the tenant's own concurrency or queued-work limit) is not pool load.
        reservation = await self.quotas.reserve_admitted(chosen.record, now=now)
        if late is None:
            load.offer(now, flow, offered_ms)
            load.admitted(now, flow, offered_ms, chosen.record.demand.accelerator_ms)
        if chosen is fallback_priced and fallback_load is not None:
            f_flow = fallback_load.flow(
                class_name, tenant.name, weight=tenant.config.weight, class_weight=request_class.weight
            )
            fallback_load.offer(now, f_flow, chosen.record.demand.accelerator_ms)
            fallback_load.admitted(
                now, f_flow, chosen.record.demand.accelerator_ms, chosen.record.demand.accelerator_ms
            )
        max_output = decision.max_output_tokens or chosen.record.shape.max_output_tokens
        used_evidence = None
        if decision.verdict is Verdict.FALLBACK:
            used_evidence = verdicts.fallback.evidence
        elif (
            decision.max_output_tokens is not None
            and route.reduced_output is not None
            and decision.max_output_tokens == route.reduced_output.max_output_tokens
            and verdicts.reduced_output.valid
        ):
            used_evidence = verdicts.reduced_output.evidence
        backend_request = self._backend_request(request, chosen.route, max_output, mode)
        return Admitted(
            record=chosen.record,
            decision=decision,
            route=chosen.route,
            backend=chosen.handle.client,
            queue=chosen.queue,
            backend_request=backend_request,
            deadline_at=call.received_at + deadline_ms / 1000.0,
            correction_key=chosen.correction_key,
            reservation=reservation,
            received_at=call.received_at,
            admitted_at=clock.now(),
            evidence=used_evidence,
            canary_deadline_at=now + diverted.budget_ms / 1000.0
            if diverted is not None
            and diverted.budget_ms is not None
            and chosen.route.backend_model == diverted.route.backend_model
            else None,
        )

    @staticmethod
    def _count_evidence_denials(
        logical: str, route: RouteConfig, verdicts: RouteEvidence, fallback_step: bool, reduce_output: bool
    ) -> None:
        """Count a request the ladder would degrade (fallback step, or picked for a capped
        output) on a route whose evidence for that degradation is not valid."""
        if fallback_step and route.fallback and not verdicts.fallback.valid:
            DENIED_DEGRADATION.labels(logical, "fallback", str(verdicts.fallback.status)).inc()
        if reduce_output and route.reduced_output is not None and not verdicts.reduced_output.valid:
            DENIED_DEGRADATION.labels(logical, "reduced_output", str(verdicts.reduced_output.status)).inc()

    def _price(
        self,
        identity: Identity,
        route: RouteConfig,
        shape: Shape,
        handle: BackendHandle,
        queue: DispatchQueue,
        call: CallContext,
        deadline_ms: float,
        request_class: RequestClassConfig,
        ladder_step: int,
        now: float,
    ) -> _Priced:
        """The record of this request as it would run on ``route`` in ``queue``."""
        tenant = self.tenants.tenants.get(identity.tenant)
        record, correction_key = pricing.price(
            identity,
            shape,
            profile=self.routes.profiles[route.profile],
            backend_model=route.backend_model,
            version=route.version,
            time_scale=handle.time_scale,
            estimator=self.estimator,
            queue=queue,
            reserves=pricing.Reserves(
                deadline_ms=deadline_ms,
                upstream_ms=request_class.reserve_upstream_ms,
                fail_ms=request_class.reserve_fail_ms,
            ),
            weight=tenant.config.weight if tenant is not None else 1.0,
            received_at=call.received_at,
            ladder_step=ladder_step,
            now=now,
        )
        return _Priced(record, route, handle, queue, correction_key)

    async def _warm_fallback(
        self, route: RouteConfig, cell: str, logical: str
    ) -> tuple[BackendHandle, ModelSpec, DispatchQueue] | None:
        """The fallback's pool in the same cell, only if it is warm right now (never cold-load)."""
        try:
            handle, spec, queue = await self.bind_pool(route, cell, logical)
        except Unavailable:
            return None
        return (handle, spec, queue) if handle.client.is_warm(route.backend_model) else None

    def _policy_context(
        self,
        tenant: Tenant,
        route: RouteConfig,
        cell: str,
        load: PoolLoad,
        quota: QuotaView,
        *,
        shed: bool = False,
        reduce_output: bool = False,
        evidence: RouteEvidence | None = None,
    ) -> PolicyContext:
        """What this gateway observes (fallback warmth, live load, configured backends), put
        into policy's terms by the one builder, ``gateway.policy.context``."""
        facts = self._route_facts(route, cell)
        fallback = facts.fallback
        fallback_warm = False
        fallback_cell = ""
        if fallback is not None:
            for handle in facts.fallback_handles:
                if handle.client.is_warm(fallback.backend_model):
                    fallback_warm, fallback_cell = True, handle.labels.get("cell", "")
                    break
        return build_policy_context(
            tenant.name,
            tenant.config,
            route,
            fallback,
            fallback_warm=fallback_warm,
            fallback_cell=fallback_cell,
            load=LoadFacts(
                utilization=load.utilization(),
                drain_ms=load.drain_ms(),
                shed=shed,
                reduce_output=reduce_output,
            ),
            quota=quota,
            backends=facts.backends,
            evidence=evidence,
        )

    def _route_facts(self, route: RouteConfig, cell: str) -> _RouteFacts:
        """What ``_policy_context`` reads from configuration alone for ``route`` in ``cell``,
        derived once: the routes, tenants and backends a ``Gateway`` holds do not change
        (a rollout's or a dedicated tenant's route is another ``RouteConfig`` object)."""
        key = (id(route), cell)
        facts = self._route_facts_cache.get(key)
        if facts is None or facts.route is not route:
            fallback = self.routes.models.get(route.fallback) if route.fallback else None
            facts = _RouteFacts(
                route=route,
                fallback=fallback,
                fallback_handles=tuple(
                    self.backends[name] for name in self.candidate_backends(fallback, cell)
                )
                if fallback is not None
                else (),
                # Routing-stage rules judge every backend configured for the route, in any cell.
                backends=tuple(
                    BackendFacts(name=name, model=route.backend_model, labels=self.backends[name].labels)
                    for name in (route.backends or tuple(self.backends))
                    if name in self.backends
                ),
            )
            if len(self._route_facts_cache) >= _MAX_ROUTE_FACTS:
                self._route_facts_cache.clear()  # bounded: rollouts' candidate routes come and go
            self._route_facts_cache[key] = facts
        return facts

    def pool_load(
        self, queue: DispatchQueue, request_class: RequestClassConfig, route: RouteConfig | None = None
    ) -> PoolLoad:
        load = self.loads.get(queue.name)
        if load is None:
            load = PoolLoad(
                queue.name,
                devices=queue.devices,
                dwell_budget_ms=request_class.max_dwell_ms,
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

    def queue_named(self, name: str) -> DispatchQueue | None:
        """The dispatch queue of pool ``name`` (``backend/model``), if it exists (the job runner
        reads whether a device is idle)."""
        return next((q for q in self._queues.values() if q.name == name), None)

    def update_ladders(self, now: float) -> None:
        """Step every pool's ladder from fresh evidence (called periodically)."""
        for (backend_name, _), queue in list(self._queues.items()):
            load = self.loads.get(queue.name)
            handle = self.backends.get(backend_name)
            if load is None or handle is None:
                continue
            evidence_at = now if handle.client.healthy else handle.client.healthy_at
            state = load.gather(now, queue, healthy=handle.client.healthy, evidence_at=evidence_at)
            if state.changed:
                overload_log.warning("pool %s ladder step -> %d: %s", load.name, state.step, state.reason)
            self.listener.ladder(queue.name, int(state.step))

    def _deadline_ms(self, call: CallContext, request_class: RequestClassConfig) -> float:
        if call.time_remaining_s is None:
            return request_class.default_deadline_ms
        # The caller's deadline, from when the call arrived (``time_remaining_s`` was read then):
        # a second decision later in the call (a late rescue) keeps the same deadline.
        deadline_ms = call.time_remaining_s * 1000.0
        if deadline_ms <= 0:
            raise DeadlineInfeasible(
                "the call's deadline has already passed", rule="admission.deadline_passed"
            )
        if deadline_ms > request_class.max_deadline_ms:
            # An effectively infinite deadline (many gRPC clients default to days) means "use the class's".
            return request_class.default_deadline_ms
        return deadline_ms

    @staticmethod
    def _backend_request(
        request: service_pb2.ModelInferRequest, route: RouteConfig, max_output_tokens: int, mode: Mode
    ) -> service_pb2.ModelInferRequest:
        out = service_pb2.ModelInferRequest()
        out.CopyFrom(request)
        out.model_name = route.backend_model
        out.model_version = route.version
        owned = [n for n in out.parameters if n.startswith("orchid.") or n in GATEWAY_OWNED_PARAMETERS]
        for name in owned:
            del out.parameters[name]  # the gateway's own; the backend never sees the caller's
        if route.shape.output_limit_parameter:
            out.parameters[route.shape.output_limit_parameter].int64_param = max_output_tokens
        if mode is Mode.STREAMING:
            out.parameters["triton_enable_empty_final_response"].bool_param = True
        return out

    # ------------------------------------------------------------------ execution

    async def infer(self, raw: bytes, call: CallContext) -> service_pb2.ModelInferResponse:
        tenant = self.tenants.authenticate(call.metadata, peer_subjects=call.peer_subjects)
        request = parse_infer_request(raw)
        if OPERATION_ID in request.parameters:
            # Online idempotency (gateway.idempotent): a retry joins or replays the first attempt.
            operation_id = read_hints(request).operation_id
            return await self.operations.run(
                tenant.name,
                operation_id,
                request,
                deadline_at=None
                if call.time_remaining_s is None
                else call.received_at + call.time_remaining_s,
                attempt=lambda: self.infer_request(request, tenant, call),
            )
        return await self.infer_request(request, tenant, call)

    async def infer_request(
        self,
        request: service_pb2.ModelInferRequest,
        tenant: Tenant,
        call: CallContext,
        *,
        mode: Mode = Mode.ONLINE,
        canary: bool = True,
    ) -> service_pb2.ModelInferResponse:
        """The request path of an authenticated, parsed request: ModelInfer's, and the job
        runner's (``gateway.jobs``: ``mode`` ASYNC or BATCH, the job's class in the request)."""
        admitted = await self.admit(request, tenant, call, operation="ModelInfer", mode=mode, canary=canary)
        try:
            slot = await self.acquire(admitted)
        except DeadlineExpired as late:  # its latest start passed in the queue: the fallback?
            self.quotas.release(admitted.reservation, now=clock.now())
            admitted, slot = await self._rescue(request, tenant, call, admitted, late, mode=mode)
        except BaseException:  # never ran (queue full, caller gone): refund all
            self.quotas.release(admitted.reservation, now=clock.now())
            raise
        started = clock.now()
        self._dispatched(admitted, dwell_ms=(started - call.received_at) * 1000.0, now=started)
        self.shadows.maybe_mirror(admitted, tenant)
        self.rollouts.dispatched(admitted, started)
        try:
            deadline_at = admitted.deadline_at
            if admitted.canary_deadline_at is not None:  # a canary's hedge budget
                deadline_at = min(deadline_at, admitted.canary_deadline_at)
            timeout_s = deadline_at - started
            if timeout_s <= 0:
                raise DeadlineExpired("the deadline passed before the request could start")
            response = await admitted.backend.infer(
                admitted.backend_request, timeout_s=timeout_s, logical=admitted.record.identity.model
            )
        except BaseException as error:  # it ran, at least partly: charge what it held
            failed_at = clock.now()
            if not self.rollouts.candidate_failed(admitted, error, started=started, now=failed_at):
                self.abandon(admitted, started=started, now=failed_at)
                raise
            # A rollout candidate failed or ran out of its budget: the current version answers
            # instead, and the candidate's attempt is the rollout's cost, not the tenant's.
            self.abandon(admitted, started=None, now=failed_at)
            response = None
        finally:
            slot.release()
        if response is not None and not self.rollouts.candidate_answered(
            admitted, response, started=started, now=clock.now()
        ):
            self.abandon(admitted, started=None, now=clock.now())  # an invalid canary answer
            response = None
        if response is None:
            try:
                return await self.infer_request(request, tenant, call, mode=mode, canary=False)
            except BaseException as error:
                self.rollouts.hedge_unanswered(admitted, error)  # the canary cost its caller the answer
                raise
        self._check_outputs(admitted, response, started=started)
        finished = clock.now()
        settled = self.settle(
            admitted,
            queued_s=started - call.received_at,
            started=started,
            finished=finished,
            backend_wait_s=max(0.0, slot.predicted_start - slot.started_at),
            co_batch=slot.group,
        )
        self.listener.settled(settled)
        self.rollouts.settled(admitted, settled, response)
        response.model_name = admitted.record.identity.model
        attach_provenance(response, settled)
        return response

    def _check_outputs(
        self, admitted: Admitted, response: service_pb2.ModelInferResponse, *, started: float
    ) -> None:
        """The route's output contract (``outputs``): an answer outside it never leaves. It is
        refused with INTERNAL (rule ``output.contract``) and counted; the tenant is not
        charged for it."""
        route = admitted.route
        if not route.outputs:
            return
        record = admitted.record
        problems = check_outputs(
            response,
            route.outputs,
            items=record.shape.items,
            input_tokens=record.shape.input_tokens,
            output_tokens=admitted.decision.max_output_tokens or record.shape.max_output_tokens,
            batched=route.shape.items_dim is not None,
        )
        if not problems:
            return
        self.abandon(admitted, started=None, now=clock.now())
        INVALID_OUTPUTS.labels(record.identity.model, record.identity.model_version, "refused").inc()
        log.warning("model %s: answer outside its output contract: %s", record.identity.model, problems[0])
        raise Internal(
            f"model {record.identity.model!r} answered outside its output contract: {problems[0]}"
            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
            rule=OUTPUT_CONTRACT_RULE,
        )

    async def _rescue(
        self,
        request: service_pb2.ModelInferRequest,
        tenant: Tenant,
        call: CallContext,
        admitted: Admitted,
        late: DeadlineExpired,
        *,
        mode: Mode = Mode.ONLINE,
    ) -> tuple[Admitted, Slot]:
        """A request whose latest start passed in its primary's queue: decided again, once,
        with the primary counted as too late (see ``admit``'s ``late``). It runs on the warm
        fallback if policy allows and it can still finish in time; otherwise the caller gets
        the late refusal. A request already on its fallback is not decided again."""
        if admitted.decision.verdict is not Verdict.ADMIT or admitted.route.fallback is None:
            raise late
        try:
            rescued = await self.admit(
                request, tenant, call, operation="ModelInfer", mode=mode, late=admitted
            )
        except GatewayError:
            raise late from None
        try:
            return rescued, await self.acquire(rescued)
        except BaseException:
            self.quotas.release(rescued.reservation, now=clock.now())
            raise

    def settle(
        self,
        admitted: Admitted,
        *,
        queued_s: float,
        started: float,
        finished: float,
        output_tokens: int = 0,
        learn: bool = True,
        backend_wait_s: float | None = None,
        first_result: float | None = None,
        finished_answer: bool = True,
        co_batch: CoBatch | None = None,
    ) -> Settled:
        """Charge observed work: backend time minus the time the request waited in Triton's
        own queue, and teach the estimator. That wait is ``backend_wait_s`` when the
        dispatch queue knows it (a request bound ahead waits until the device before it
        frees, which the queue observes at release); otherwise the pool's mean from
        Triton's statistics. The device time is shared with the pool's mean batch from those
        statistics, unless the queue co-batches its own work and bound this request: then it
        ran alone, or in the ``co_batch`` it was bound into, whose device time its members
        share by their solo prices.

        The outcome is complete only for a finished answer (``finished_answer``: false for a
        stream's partial responses) whose output limit no rule or ladder step reduced (a
        reduced limit may have cut the answer)."""
        wall_ms = (finished - started) * 1000.0
        timing = self.pool_timing.get(admitted.queue.name)
        # The pool's mean batch from Triton's statistics; but where the queue co-batches its own
        # work (dispatch rule 6), that mean counts those batches, which are charged by their
        # members below, and a request the queue bound alone (``backend_wait_s``) ran alone.
        batch, solo_factor = (timing.batch if timing else 1.0), 1.0
        if backend_wait_s is not None and admitted.queue.co_batch_max >= 2:
            batch = 1.0
        if co_batch is not None and co_batch.cost_ms > 0.0:
            own_ms = admitted.record.demand.accelerator_ms
            batch = co_batch.solo_ms / own_ms if own_ms > 0.0 else 1.0
            solo_factor = co_batch.solo_ms / co_batch.cost_ms
        if backend_wait_s is not None:
            backend_queue_ms = backend_wait_s * 1000.0
        else:
            backend_queue_ms = timing.queue_ms if timing else 0.0
        outcome = settlement.settle(
            admitted.record,
            admitted.decision,
            admitted.reservation,
            admitted.correction_key,
            quotas=self.quotas,
            estimator=self.estimator,
            backend_model=admitted.route.backend_model,
            queue_ms=queued_s * 1000.0,
            wall_ms=wall_ms,
            backend_queue_ms=backend_queue_ms,
            batch=batch,
            solo_factor=solo_factor,
            first_result_ms=wall_ms if first_result is None else (first_result - started) * 1000.0,
            output_tokens=output_tokens,
            learn=learn,
            now=finished,
        )
        complete = finished_answer and admitted.decision.max_output_tokens is None
        if not complete:
            outcome = dataclasses.replace(outcome, complete=False)
        stages = StageTimes(admitted.received_at, admitted.admitted_at, started, finished)
        return Settled(admitted.record, admitted.decision, outcome, stages, evidence=admitted.evidence)

    async def acquire(self, admitted: Admitted) -> Slot:
        """Wait for a dispatch slot in the admitted request's pool, in its class's and tenant's share."""
        identity = admitted.record.identity
        tenant = self.tenants.tenants.get(identity.tenant)
        request_class = self.config.classes.get(identity.request_class)
        return await admitted.queue.acquire(
            latest_start=admitted.received_at + admitted.record.budget.latest_start_ms / 1000.0,
            cost_ms=admitted.record.demand.accelerator_ms,
            request_class=identity.request_class,
            tenant=identity.tenant,
            weight=tenant.config.weight if tenant else 1.0,
            class_weight=request_class.weight if request_class else 1.0,
            long=admitted.record.shape.long,
            live_bytes=admitted.record.demand.peak_memory_bytes,
            batch=self._batch_shape(admitted),
        )

    def _batch_shape(self, admitted: Admitted) -> BatchShape | None:
        """What the request brings to a co-batch (dispatch rule 6): its shape, and its price
        over the pool's profile price (time scale, estimator correction). Long work never
        co-batches; nor does a pool without a profile."""
        shape = admitted.record.shape
        profile = admitted.queue.batch_profile
        if shape.long or profile is None or admitted.queue.co_batch_max < 2:
            return None
        output_tokens = admitted.decision.max_output_tokens or shape.max_output_tokens
        list_price = profile.accelerator_ms(shape.input_tokens, output_tokens)
        if list_price <= 0.0:
            return None
        scale = admitted.record.demand.accelerator_ms / list_price
        return BatchShape(shape.input_tokens, output_tokens, scale)

    def abandon(self, admitted: Admitted, *, started: float | None, now: float) -> None:
        """A request that failed or was cancelled: settle quota by what it held, or refund."""
        settlement.abandon(self.quotas, admitted.reservation, started=started, now=now)

    def _dispatched(self, admitted: Admitted, *, dwell_ms: float, now: float) -> None:
        self.quotas.start(admitted.reservation, now=now)
        load = self.loads.get(admitted.queue.name)
        if load is not None:
            # Judged against the request's own class's cap (gateway.core.dwell).
            request_class = self.config.classes.get(admitted.record.identity.request_class)
            cap_ms = request_class.max_dwell_ms if request_class is not None else load.dwell_budget_ms
            sample_ms = dwell_sample_ms(dwell_ms, class_cap_ms=cap_ms, budget_ms=load.dwell_budget_ms)
            load.dwell.add(now, sample_ms)

    async def sample_statistics(self) -> None:
        """Refresh per-pool Triton queue/compute timing from statistics deltas."""
        for (backend_name, model), queue in list(self._queues.items()):
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
                    self.pool_timing[queue.name] = timing

    async def stream(
        self, requests: AsyncIterator[bytes], call: CallContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """ModelStreamInfer: each request on the client stream is admitted on its own and
        forwarded over one backend stream; responses carry provenance; a rejected request
        answers with an ``error_message`` and the stream goes on."""
        tenant = self.tenants.authenticate(call.metadata, peer_subjects=call.peer_subjects)
        session = StreamSession(self, tenant, call)
        async for response in session.run(requests):
            yield response
