"""Stage 1, resolve: which route, class, deadline and identity a request runs under.

Owns the lookup from an authenticated tenant and a model name to its route (a
dedicated tenant's own copy, a promoted rollout's candidate), the request class and its
reserves, the privacy cell, the deadline (for a stream also its first-result deadline
and gap objective: the caller's ``orchid.first_result_ms`` / ``orchid.gap_ms`` over its
class's), and the request's ``Identity``. Unknown and
forbidden models answer the same NOT_FOUND, so a tenant cannot probe which models exist.

It may read configuration and the rollout controller's promoted routes; it may not touch
pools, quota, policy or the backend.
"""

from __future__ import annotations

import msgspec
from tritonclient.grpc import service_pb2

from gateway.auth import Tenant
from gateway.config import GatewayConfig, RequestClassConfig, RouteConfig, RouteTable
from gateway.core.errors import DeadlineInfeasible, InvalidArgument, NotFound, PermissionDenied
from gateway.core.record import Identity, Mode
from gateway.core.risk import resolve_risk_class
from gateway.core.streaming import StreamObjectives
from gateway.core.upstream import FeatureContract
from gateway.exchange import Admitted, CallContext, new_request_id
from gateway.rollouts import RolloutController
from gateway.shape import RequestHints, check_backend_controls, read_hints, stream_objectives_for


class Resolved(msgspec.Struct, frozen=True):
    """A request with its route, class, deadline and identity: what every later stage reads."""

    request: service_pb2.ModelInferRequest
    tenant: Tenant
    call: CallContext
    mode: Mode
    route: RouteConfig  # the route the tenant reaches (before any canary diverts it)
    hints: RequestHints
    request_class: RequestClassConfig
    deadline_ms: float
    identity: Identity
    objectives: StreamObjectives | None = None  # a stream's first-result, gap and completion
    late: Admitted | None = None  # a late rescue's first admission (``gateway.chain.wait``)
    canary: bool = True  # false: a canary's re-answer by the current version
    # The route's feature contract and the upstream reserve its source's measured latency
    # sets aside (``gateway.features``); None: the class's constant reserve.
    features: FeatureContract | None = None
    upstream_reserve_ms: float | None = None

    @property
    def logical(self) -> str:
        return self.identity.model

    @property
    def cell(self) -> str:
        return self.identity.privacy_cell


class Resolve:
    """Route, class, deadline and identity of a request."""

    def __init__(self, config: GatewayConfig, routes: RouteTable, rollouts: RolloutController) -> None:
        self.config = config
        self.routes = routes
        self.rollouts = rollouts
        self._tenant_routes: dict[tuple[str, str], RouteConfig | None] = {}

    def tenant_route(self, tenant: Tenant, model: str) -> RouteConfig:
        """The route for ``model`` if this tenant may call it."""
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

    @staticmethod
    def deadline_ms(call: CallContext, request_class: RequestClassConfig) -> float:
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

    def run(
        self,
        request: service_pb2.ModelInferRequest,
        tenant: Tenant,
        call: CallContext,
        *,
        operation: str,
        mode: Mode,
        late: Admitted | None = None,
        canary: bool = True,
    ) -> Resolved:
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
        deadline_ms = self.deadline_ms(call, request_class)
        return Resolved(
            request=request,
            tenant=tenant,
            call=call,
            mode=mode,
            route=route,
            hints=hints,
            request_class=request_class,
            deadline_ms=deadline_ms,
            identity=identity,
            objectives=stream_objectives_for(hints, request_class, deadline_ms)
            if mode is Mode.STREAMING
            else None,
            late=late,
            canary=canary,
        )
