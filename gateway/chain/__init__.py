"""The request chain: every request, unary or streamed, runs through the same ordered stages.

::

    resolve ─▶ place ─▶ shape ─▶ price ─▶ judge ─▶ decide ─▶ reserve ─▶ wait ─▶ execute ─▶ settle
    (route,    (filter,  (tensors (record,  (one     (core     (quota;   (slot;   (backend;  (charge,
     class,     score,    vs the   slack)   policy   admission  undo:     late     shadow,    learn,
     deadline)  pick,     spec)             snapshot decide)    refund)   rescue)  canary)    provenance)
                rollout,                    for every
                fallback)                   candidate)

Each stage is a small object in its own module with one job, and an undo where it
reserves something (``reserve`` refunds; ``wait`` releases the slot; ``settle``'s
``abandon`` closes what a request held when it failed). ``RequestChain`` only sequences
them: the admission half (``admit``: resolve to reserve) is shared by every mode; a
unary call then waits, executes and settles (``unary``); a stream adapts the execute
and settle stages to many results per request (``gateway.streams``); the job runner
calls ``unary`` in ASYNC or BATCH mode. Every decision is the pure core's
(``gateway.core``); no stage reads another's private fields, and the chain holds no
state of its own beyond its stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.auth import Tenant, TenantDirectory
from gateway.chain.decide import Decide
from gateway.chain.execute import Execute
from gateway.chain.judge import Judge
from gateway.chain.place import Place, Placement
from gateway.chain.price import Price, Priced
from gateway.chain.reserve import Reserve
from gateway.chain.resolve import Resolve, Resolved
from gateway.chain.settle import Settle
from gateway.chain.shaping import fallback_shape, shape_of
from gateway.chain.wait import Wait
from gateway.config import GatewayConfig, RouteConfig, RouteTable
from gateway.core import admission, prefix
from gateway.core import memory as device_memory
from gateway.core.errors import InvalidArgument, Unavailable
from gateway.core.estimate import Estimator
from gateway.core.evidence import RouteEvidence
from gateway.core.load import FlowLoad, PoolLoad
from gateway.core.overload import effects as overload_effects
from gateway.core.record import Identity, Mode, RequestRecord, Shape, Verdict
from gateway.core.rollout import HEDGE_REASON
from gateway.core.upstream import FeatureContract
from gateway.evidence import DENIED_DEGRADATION, EvidenceStore
from gateway.exchange import Admitted, BackendHandle, CallContext, GatewayListener, Settled
from gateway.features import Features
from gateway.features.historical import AS_OF_PARAMETER, read_as_of, without_parameter
from gateway.messages import attach_provenance
from gateway.policy.context import quality_floor
from gateway.policy.schema import PolicyContext
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.store import PolicyStore
from gateway.pools import PoolRegistry
from gateway.rollouts import Diverted, RolloutController
from gateway.scheduler import DispatchQueue
from gateway.shadow import ShadowTraffic
from gateway.shape import GATEWAY_OWNED_PARAMETERS
from gateway.state.base import QuotaStore

# New work the ladder's shedder may refuse at step 5: online requests and new streams (a stream
# already admitted runs on; async and batch work is deferred from step 4 instead).
SHED_MODES = frozenset({Mode.ONLINE, Mode.STREAMING})
EXCLUDED_RULE = "routing.excluded_backend"


@dataclass(frozen=True, slots=True)
class _Fallback:
    """The fallback pass of one request: its candidate, price and pool load."""

    candidate: admission.Candidate
    priced: Priced
    load: PoolLoad
    flow: FlowLoad


class RequestChain:
    """The stages, and their order for each mode."""

    def __init__(
        self,
        config: GatewayConfig,
        tenants: TenantDirectory,
        routes: RouteTable,
        pools: PoolRegistry,
        policy: PolicyStore,
        quotas: QuotaStore,
        estimator: Estimator,
        evidence: EvidenceStore,
        rollouts: RolloutController,
        shadows: ShadowTraffic,
        listener: GatewayListener,
        features: Features,
    ) -> None:
        self.config = config
        self.tenants = tenants
        self.routes = routes
        self.pools = pools
        self.quotas = quotas
        self.evidence = evidence
        self.rollouts = rollouts
        self.listener = listener
        self.resolve = Resolve(config, routes, rollouts)
        self.place = Place(pools, rollouts)
        self.price = Price(routes, tenants, estimator)
        self.judge = Judge(policy, routes, pools)
        self.decide = Decide(config)
        self.reserve = Reserve(quotas)
        self.wait = Wait(config, pools, quotas, self._weight)
        self.settle = Settle(pools, quotas, estimator)
        self.execute = Execute(rollouts, shadows, self.settle, pools.prefix)
        self.features = features

    def _weight(self, tenant: str) -> float:
        known = self.tenants.tenants.get(tenant)
        return known.config.weight if known is not None else 1.0

    # ------------------------------------------------------------------ admission half

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
        """Resolve, place, shape, price, judge, decide, reserve: an ``Admitted`` bound to a
        pool, or a ``GatewayError``.

        ``late``: this request was admitted to its primary but its latest start passed in
        the queue (``admission.too_late``); its demand was offered once.
        ``canary``: false when the request was already tried on a rollout's candidate: that
        is its one bounded recovery, so its class's variance reserve (R_fail) is not held
        back again."""
        as_of = read_as_of(request.parameters)
        if as_of is not None:  # the job runner's mark on a snapshot batch's item, nobody else's
            if mode not in (Mode.BATCH, Mode.ASYNC):
                raise InvalidArgument(
                    f"parameter {AS_OF_PARAMETER} is the gateway's own: a batch job declares its "
                    "feature_snapshot (orchid.jobs.v1 SubmitBatch)"
                )
            request = without_parameter(request, AS_OF_PARAMETER)
        resolved = self.resolve.run(
            request, tenant, call, operation=operation, mode=mode, late=late, canary=canary
        )
        contract = self.features.contract(resolved.route)
        if contract is not None:  # refused here, before any placement, if the source cannot serve it
            reserve = self.features.gate(
                contract,
                resolved.request,
                tenant=resolved.identity.tenant,
                scope=feature_scope(resolved),
                now=clock.now(),
                as_of=as_of,
            )
            resolved = msgspec.structs.replace(resolved, features=contract, upstream_reserve_ms=reserve)
        placement = await self.place.primary(resolved)
        shape = shape_of(resolved, placement)
        now = clock.now()
        snapshot = self.judge.snapshot()  # one policy version for every candidate of this request

        def price_on(route: RouteConfig, handle: BackendHandle, queue: DispatchQueue) -> RequestRecord:
            on = Placement(route, handle, placement.spec, queue)
            return self.price.run(
                resolved, on, shape, ladder_step=self.pools.load(queue, route).step, now=now
            ).record

        diverted: Diverted | None = None
        identity = resolved.identity
        rolled = await self.place.rollout(resolved, placement, shape, price_on)
        if rolled is not None:
            placement, diverted = rolled
            identity = msgspec.structs.replace(identity, model_version=diverted.label)
        route = placement.route
        logical = resolved.logical
        class_name = identity.request_class
        request_class = resolved.request_class
        weight = tenant.config.weight

        # Judge the primary; a backend policy excludes is filtered out of placement (an allowed
        # one in the same cell is tried), never refused after it was picked.
        quota = self.quotas.available(tenant.name, class_name, now=now)
        shared_fallback = self.routes.models.get(route.fallback) if route.fallback else None
        verdicts = self.evidence.route_evidence(
            logical, route, shared_fallback, floor=quality_floor(route, shared_fallback), now=clock.wall()
        )
        for _attempt in range(2):
            load = self.pools.load(placement.queue, route)
            flow = load.flow(class_name, tenant.name, weight=weight, class_weight=request_class.weight)
            priced = self.price.run(
                resolved, placement, shape, ladder_step=load.step, now=now, identity=identity
            )
            # Work that can never fit on an idle device of the pool is refused before it is offered.
            device_memory.check_fits(priced.record, placement.queue.device_set.live_room_bytes)
            reduce_output = load.reduce_output(flow)
            context = self.judge.context(
                tenant, route, resolved.cell, load, quota, reduce_output=reduce_output, evidence=verdicts
            )
            primary = self.judge.judge(priced.record, context, snapshot)
            excluded = primary.policy.excluded_backends
            if placement.handle.client.name not in excluded:
                break
            try:
                placement = await self.place.again(placement, resolved, excluded)
            except Unavailable:
                raise Unavailable(
                    f"no backend allowed by policy serves model {logical!r}", rule=EXCLUDED_RULE
                ) from None
        else:
            raise Unavailable(f"no backend allowed by policy serves model {logical!r}", rule=EXCLUDED_RULE)
        offered_ms = priced.record.demand.accelerator_ms
        admissible = admission.offered(primary.policy, late=late is not None)
        if late is not None:
            primary = admission.Candidate(primary.record, admission.too_late(primary.policy))
        shed = False
        if primary.policy.allowed and mode in SHED_MODES and load.shed(flow):
            # Part of this flow's excess at step 5+: policy decides how it is refused.
            shed = True
            context = self.judge.shed(context)
            primary = self.judge.judge(priced.record, context, snapshot)
        effects = overload_effects(load.step)

        # The fallback pass: a dedicated tenant's fallback must be dedicated too.
        fallback_route = (
            shared_fallback.for_tenant(route.fallback, tenant.config)
            if shared_fallback and route.fallback
            else None
        )
        fallback_pools = (
            await self.place.fallback_pools(
                fallback_route, resolved, exclude=primary.policy.excluded_backends
            )
            if fallback_route is not None
            else None
        )
        divert = effects.fallback_for_eligible and primary.policy.fallback_eligible and load.divert(flow)
        fallback_refused = ""  # why the fallback cannot take the request as asked
        fallback: _Fallback | None = None
        if (
            fallback_route is not None
            and fallback_pools is not None
            and route.fallback is not None
            and admission.wants_fallback_pass(primary.policy, effects, True, divert)
            and (fallback_pool := self.place.fallback(fallback_route, fallback_pools)) is not None
        ):
            f_shape, fallback_refused = fallback_shape(resolved, shape, fallback_pool, route.fallback)
            if not fallback_refused:
                fallback = self._fallback_pass(
                    resolved, fallback_pool, f_shape, identity, context, snapshot, route.fallback, now
                )
                load.observed_saving(offered_ms, fallback.priced.record.demand.accelerator_ms)
        decision = self.decide.run(
            primary,
            fallback.candidate if fallback is not None else None,
            load=load,
            effects=effects,
            divert=divert,
            fallback_route=fallback_route,
            fallback_name=route.fallback,
            fallback_refused=fallback_refused,
        )
        if diverted is not None and diverted.reason and decision.verdict is Verdict.ADMIT:
            decision = msgspec.structs.replace(decision, route_reason=diverted.reason)
        elif not canary and late is None and decision.verdict is Verdict.ADMIT:
            decision = msgspec.structs.replace(decision, route_reason=HEDGE_REASON)  # a canary re-answered
        self.listener.decided(primary.record, decision, primary.policy)
        self._count_evidence_denials(logical, route, verdicts, effects.fallback_for_eligible, reduce_output)
        if decision.verdict is Verdict.REJECT:
            if admissible or shed or decision.rules == (admission.DEFER_BATCH_RULE,):
                load.offer(now, flow, offered_ms)
            self.decide.refuse(decision)

        on_fallback = decision.verdict is Verdict.FALLBACK and fallback is not None
        chosen = fallback.priced if on_fallback and fallback is not None else priced
        chosen_policy = fallback.candidate.policy if on_fallback and fallback is not None else primary.policy
        limit = decision.max_output_tokens
        if limit is not None and limit < chosen.record.shape.max_output_tokens:
            # The backend will generate only `limit` tokens: price what will run, so the queue,
            # the quota reservation and the estimator (observed vs predicted) see that work.
            full_ms = chosen.record.demand.accelerator_ms
            chosen = self.price.run(
                resolved,
                chosen.placement,
                msgspec.structs.replace(chosen.record.shape, max_output_tokens=limit),
                ladder_step=fallback.load.step if on_fallback and fallback is not None else load.step,
                now=now,
                identity=chosen.record.identity,
            )
            if not on_fallback:
                load.reduced(now, flow, full_ms, chosen.record.demand.accelerator_ms)
        if chosen.placement.handle.client.name in chosen_policy.excluded_backends:
            # Placement filtered the primary's exclusions; the fallback's own verdict (on its own
            # pool's load) is a second, independent guard (defence in depth), never overridden.
            raise Unavailable(f"no backend allowed by policy serves model {logical!r}", rule=EXCLUDED_RULE)
        self.decide.isolate(
            chosen_policy,
            chosen.placement.route.backend_model,
            frozenset(tenant.config.dedicated_models.values()),
            logical,
        )
        reservation = await self.reserve.run(
            chosen.record,
            offered_ms=offered_ms,
            primary=(load, flow) if late is None else None,
            fallback=(fallback.load, fallback.flow) if on_fallback and fallback is not None else None,
            now=now,
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
        admitted = Admitted(
            record=chosen.record,
            decision=decision,
            route=chosen.placement.route,
            backend=chosen.placement.handle.client,
            queue=chosen.placement.queue,
            backend_request=backend_request(
                request,
                chosen.placement.route,
                max_output,
                mode,
                prefix_scope=prefix.scope_for(
                    tenant.name,
                    resolved.cell,
                    chosen.placement.route.backend_model,
                    chosen.placement.route.version,
                )
                if chosen.placement.spec.prefix_cache is not None
                else None,
            ),
            deadline_at=call.received_at + resolved.deadline_ms / 1000.0,
            correction_key=chosen.correction_key,
            reservation=reservation,
            received_at=call.received_at,
            admitted_at=clock.now(),
            evidence=used_evidence,
            canary_deadline_at=now + diverted.budget_ms / 1000.0
            if diverted is not None
            and diverted.budget_ms is not None
            and chosen.placement.route.backend_model == diverted.route.backend_model
            else None,
            prefix=chosen.placement.prefix,
        )
        if resolved.features is None:
            return admitted
        return await self._read_features(admitted, resolved, resolved.features, as_of=as_of)

    async def _read_features(
        self, admitted: Admitted, resolved: Resolved, contract: FeatureContract, *, as_of: float | None
    ) -> Admitted:
        """Read the request's features (after its quota reservation, before the dispatch queue:
        no device time is queued for a request whose features cannot be had) within the time
        its deadline leaves beyond the reserves for what follows; on a refusal its reservation
        is refunded."""
        budget = admitted.record.budget
        after_ms = budget.reserve_exec_ms + budget.reserve_fail_ms + budget.queue_wait_ms
        try:
            values, snapshot = await self.features.fetch(
                contract,
                resolved.request,
                tenant=resolved.identity.tenant,
                scope=feature_scope(resolved),
                time_left_s=admitted.deadline_at - clock.now() - after_ms / 1000.0,
                as_of=as_of,
            )
        except BaseException:
            self.settle.abandon(admitted, started=None, now=clock.now())
            raise
        self.features.attach(admitted.backend_request, contract, values)
        return msgspec.structs.replace(admitted, features=snapshot)

    def _fallback_pass(
        self,
        resolved: Resolved,
        pool: Placement,
        shape: Shape,
        identity: Identity,
        context: PolicyContext,
        snapshot: PolicySnapshot,
        name: str,
        now: float,
    ) -> _Fallback:
        """The request priced and judged on its warm fallback, on the fallback pool's own load:
        a request shed on the primary is not thereby shed on the fallback, and the fallback's
        own excess is its own."""
        tenant = resolved.tenant
        request_class = resolved.request_class
        load = self.pools.load(pool.queue)
        flow = load.flow(
            identity.request_class,
            tenant.name,
            weight=tenant.config.weight,
            class_weight=request_class.weight,
        )
        f_identity = msgspec.structs.replace(identity, model=name, model_version=pool.route.version)
        priced = self.price.run(resolved, pool, shape, ladder_step=load.step, now=now, identity=f_identity)
        shed = resolved.mode in SHED_MODES and load.shed(flow)
        candidate = self.judge.judge(priced.record, self.judge.on_pool(context, load, shed=shed), snapshot)
        if shed:
            load.offer(now, flow, priced.record.demand.accelerator_ms)
        return _Fallback(candidate, priced, load, flow)

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

    # ------------------------------------------------------------------ unary

    async def unary(
        self,
        request: service_pb2.ModelInferRequest,
        tenant: Tenant,
        call: CallContext,
        *,
        mode: Mode = Mode.ONLINE,
        canary: bool = True,
    ) -> service_pb2.ModelInferResponse:
        """One unary request through every stage: ModelInfer's, and the job runner's
        (``gateway.jobs``: ``mode`` ASYNC or BATCH, the job's class in the request)."""
        admitted = await self.admit(request, tenant, call, operation="ModelInfer", mode=mode, canary=canary)

        async def readmit(first: Admitted) -> Admitted:
            return await self.admit(request, tenant, call, operation="ModelInfer", mode=mode, late=first)

        admitted, slot = await self.wait.run(admitted, readmit)
        started = clock.now()
        self.wait.started(admitted, dwell_ms=(started - call.received_at) * 1000.0, now=started)
        self.execute.starting(admitted, tenant, started, slot)
        try:
            response = await self.execute.run(admitted, started)
        finally:
            slot.release()
        if response is None:  # a canary failed: the current version answers, once
            try:
                return await self.unary(request, tenant, call, mode=mode, canary=False)
            except BaseException as error:
                self.rollouts.hedge_unanswered(admitted, error)  # the canary cost its caller the answer
                raise
        self.execute.answered(admitted, response)
        self.execute.check_outputs(admitted, response)
        finished = clock.now()
        settled = self.settle.run(
            admitted,
            queued_s=started - call.received_at,
            started=started,
            finished=finished,
            backend_wait_s=slot.backend_wait_s(started),
            co_batch=slot.group,
        )
        self.listener.settled(settled)
        self.rollouts.settled(admitted, settled, response)
        response.model_name = admitted.record.identity.model
        attach_provenance(response, settled)
        return response


def feature_scope(resolved: Resolved) -> str:
    """The authorization scope a request's cached features are kept under (beside its tenant):
    its privacy cell and risk class."""
    return f"{resolved.cell}/{resolved.identity.risk_class}"


def backend_request(
    request: service_pb2.ModelInferRequest,
    route: RouteConfig,
    max_output_tokens: int,
    mode: Mode,
    *,
    prefix_scope: str | None = None,
) -> service_pb2.ModelInferRequest:
    """The request as its backend receives it: the backend model and version, the output
    limit the decision set, the prefix-cache scope when its model keeps a prefix cache
    (``gateway.core.prefix``: tenant, cell, model version), and none of the caller's
    parameters the gateway owns."""
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
    if prefix_scope is not None:
        out.parameters[prefix.SCOPE_PARAMETER].string_param = prefix_scope
    return out


__all__ = ["SHED_MODES", "RequestChain", "Settled", "backend_request"]
