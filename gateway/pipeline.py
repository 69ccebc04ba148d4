"""The runtime container: one ``Gateway`` per process, holding the collaborators a request needs.

``Gateway`` makes no request decision. It holds configuration, tenants, routes, the
policy store, quality evidence, the quota ledger, the pool registry
(``gateway.pools``), the estimator, rollouts, shadow traffic, online idempotency and
the request chain (``gateway.chain``) that runs every request through its stages, and
it is what the edges (``gateway.protocol``, the job runner, the admin service, the
server's periodic tasks) hold. Its methods only route a call to the collaborator that
owns it. The value types of a request's passage live in ``gateway.exchange``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from tritonclient.grpc import service_pb2

from gateway.auth import Tenant, TenantDirectory
from gateway.backends.base import ModelSpec
from gateway.backends.stats import PoolTiming
from gateway.chain import RequestChain
from gateway.config import GatewayConfig, RouteConfig, RouteTable
from gateway.core.estimate import Estimator
from gateway.core.load import PoolLoad
from gateway.core.record import Mode
from gateway.evidence import EvidenceStore
from gateway.exchange import BackendHandle, CallContext, GatewayListener
from gateway.features import Features
from gateway.idempotent import OPERATION_ID, OnlineOperations
from gateway.messages import parse_infer_request
from gateway.policy.store import PolicyStore
from gateway.pools import PoolRegistry
from gateway.rollouts import RolloutController
from gateway.scheduler import DispatchQueue, FleetBinding
from gateway.shadow import ShadowTraffic
from gateway.shape import read_hints
from gateway.state.base import MemoryQuotaStore, QuotaStore
from gateway.streams import StreamSession


class Gateway:
    """The collaborators of the request path. One per process."""

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
        self.policy = policy
        self.evidence = EvidenceStore(routes)  # seeded from the route files; the admin RPC publishes
        # The quota ledger: this process's (state.backend memory) or the fleet's (gateway/state/).
        self.quotas: QuotaStore = quotas if quotas is not None else MemoryQuotaStore(tenants.settings.quotas)
        self.listener: GatewayListener = listener or GatewayListener()
        self.pools = PoolRegistry(config, routes, backends)
        # One generation for every plan cache: a policy reload and an evidence publication start
        # a new one (a rollout step does in ``RolloutController``; health is read live).
        self.generation = self.pools.generation
        if isinstance(policy, PolicyStore):  # (some tests hand in none, or a stand-in)
            policy.on_change = self.generation.bump
        self.evidence.on_change = self.generation.bump
        self.estimator = Estimator()
        self.rollouts = RolloutController(self.pools, routes, self.evidence)  # none by default
        self.shadows = ShadowTraffic(self.pools, routes, self.rollouts)
        self.features = Features(config, routes)  # upstream feature sources (none by default)
        self.chain = RequestChain(
            config,
            tenants,
            routes,
            self.pools,
            policy,
            self.quotas,
            self.estimator,
            self.evidence,
            self.rollouts,
            self.shadows,
            self.listener,
            self.features,
        )
        self.operations = OnlineOperations()  # online requests' orchid.operation_id
        self.accepting = True

    # ------------------------------------------------------------------ collaborators' views

    @property
    def backends(self) -> dict[str, BackendHandle]:
        return self.pools.backends

    @property
    def loads(self) -> dict[str, PoolLoad]:
        return self.pools.loads

    @property
    def pool_timing(self) -> dict[str, PoolTiming]:
        return self.pools.timing

    @property
    def fleet_slots(self) -> FleetBinding | None:
        return self.pools.fleet_slots

    @fleet_slots.setter
    def fleet_slots(self, binding: FleetBinding | None) -> None:
        self.pools.fleet_slots = binding  # set by the server with state.backend redis

    def tenant_route(self, tenant: Tenant, model: str) -> RouteConfig:
        """The route for ``model`` if this tenant may call it (``gateway.chain.resolve``)."""
        return self.chain.resolve.tenant_route(tenant, model)

    async def bind_pool(
        self, route: RouteConfig, cell: str, logical: str
    ) -> tuple[BackendHandle, ModelSpec, DispatchQueue]:
        """The pool placement picks for ``route`` in ``cell`` (``PoolRegistry.place``)."""
        return await self.pools.place(route, cell, logical)

    def queue_named(self, name: str) -> DispatchQueue | None:
        return self.pools.queue_named(name)

    def update_ladders(self, now: float) -> None:
        """Step every pool's ladder from fresh evidence (called periodically)."""
        self.pools.update_ladders(now, self.listener)

    async def sample_statistics(self) -> None:
        await self.pools.sample_statistics()

    # ------------------------------------------------------------------ calls

    async def infer(self, raw: bytes, call: CallContext) -> service_pb2.ModelInferResponse:
        """ModelInfer: authenticate, decode, and run the chain (an ``orchid.operation_id``
        joins or replays an earlier attempt of the same operation: ``gateway.idempotent``)."""
        tenant = self.tenants.authenticate(call.metadata, peer_subjects=call.peer_subjects)
        request = parse_infer_request(raw)
        if OPERATION_ID in request.parameters:
            operation_id = read_hints(request).operation_id
            return await self.operations.run(
                tenant.name,
                operation_id,
                request,
                deadline_at=None
                if call.time_remaining_s is None
                else call.received_at + call.time_remaining_s,
                attempt=lambda: self.chain.unary(request, tenant, call),
            )
        return await self.chain.unary(request, tenant, call)

    async def infer_request(
        self,
        request: service_pb2.ModelInferRequest,
        tenant: Tenant,
        call: CallContext,
        *,
        mode: Mode = Mode.ONLINE,
        canary: bool = True,
    ) -> service_pb2.ModelInferResponse:
        """An authenticated, parsed request through the chain (the job runner's entry)."""
        return await self.chain.unary(request, tenant, call, mode=mode, canary=canary)

    async def stream(
        self, requests: AsyncIterator[bytes], call: CallContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """ModelStreamInfer: each request on the client stream runs the chain's admission half
        on its own and is forwarded over one backend stream (``gateway.streams``)."""
        tenant = self.tenants.authenticate(call.metadata, peer_subjects=call.peer_subjects)
        session = StreamSession(self.chain, tenant, call)
        async for response in session.run(requests):
            yield response
