"""``orchid.admin.v1.GatewayAdmin``: the gateway's own admin service (policy reload, status,
quality evidence).

The service is defined in ``proto/orchid/admin/v1/admin.proto``, the only source of
truth; its Python modules are generated from it at build time (``setup.py``, run by
``pip install -e .`` in ``scripts/bootstrap.sh``) into ``gateway._proto`` and are not
committed. Every call needs an admin credential; a failed reload answers
FAILED_PRECONDITION with the ``file:line:col`` diagnostics while the last good policy
keeps serving. Like the inference service, every method receives raw bytes and decodes
them after authentication (``messages.decode``): a malformed request answers
UNAUTHENTICATED without a valid credential, else INVALID_ARGUMENT, never grpc's
UNKNOWN with a logged traceback.

``PublishEvidence`` records an evaluation in the gateway's evidence store
(``gateway.evidence``): it governs fallback and reduced output from the next request.
``ListEvidence`` shows the latest evidence and each route's verdict on it.

``RolloutStart``/``Status``/``Promote``/``Rollback``/``Abort`` drive a version change by hand
(``gateway.rollouts``): the same steps the rollout takes on its own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gateway import clock
from gateway.core.errors import ConfigError, GatewayError, InvalidArgument, PermissionDenied
from gateway.core.evidence import Evidence, EvidenceKey, EvidenceVerdict
from gateway.evidence import population
from gateway.messages import decode, encode
from gateway.pipeline import Gateway
from gateway.policy.context import quality_floor
from gateway.protocol import peer_subjects
from gateway.rollouts import RolloutRun, parse_rollout
from gateway.status import to_status
from gateway.yaml_source import YamlError, parse_yaml

try:
    from gateway._proto import admin_pb2, admin_pb2_grpc
except ModuleNotFoundError as exc:  # pragma: no cover - a checkout that was never installed
    raise ModuleNotFoundError(
        f"{exc.name} is generated from proto/ at build time: run scripts/bootstrap.sh "
        "(or pip install -e .) first"
    ) from exc

SERVICE = admin_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name

RawUnary = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]
Method = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class AdminServicer(admin_pb2_grpc.GatewayAdminServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    """The methods assume an authorized caller: ``add_to_server`` registers each one behind
    ``authorized`` (authenticate, decode, admin check)."""

    def authorized(self, method: Method, request_type: Any) -> RawUnary:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                tenant = self.gateway.tenants.authenticate(
                    tuple(context.invocation_metadata() or ()), peer_subjects=peer_subjects(context)
                )
                request = decode(request_type, raw)
                if not tenant.config.admin:
                    raise PermissionDenied("this operation needs an admin credential")
            except Exception as error:  # a refusal keeps its status; a bug is INTERNAL, not hidden
                status = to_status(error, where="admin")
                context.set_trailing_metadata(status.trailing_metadata)
                await context.abort(status.code, status.message)
            try:
                return await method(request, context)
            except GatewayError as error:  # a refusal of the operation itself (rollouts)
                status = to_status(error, where="admin")
                context.set_trailing_metadata(status.trailing_metadata)
                await context.abort(status.code, status.message)

        return call

    async def ReloadPolicies(
        self, request: admin_pb2.ReloadPoliciesRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ReloadPoliciesResponse:
        result = await asyncio.to_thread(self.gateway.policy.reload)
        reply = admin_pb2.ReloadPoliciesResponse(
            ok=result.ok,
            version=result.version,
            previous_version=result.previous_version,
            diagnostics=[d.render() for d in result.diagnostics],
        )
        if not result.ok:
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            context.set_details(
                f"policy rejected, still serving {result.version or 'nothing'}: "
                f"{len(result.diagnostics)} problem(s); first: {result.diagnostics[0].headline()}"
                if result.diagnostics
                else f"policy rejected, still serving {result.version or 'nothing'}"
            )
        return reply

    async def PolicyStatus(
        self, request: admin_pb2.PolicyStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PolicyStatusResponse:
        store = self.gateway.policy
        return admin_pb2.PolicyStatusResponse(
            version=store.version,
            ready=store.ready,
            failed_reloads=store.failures,
            last_diagnostics=[d.render() for d in store.last_diagnostics],
        )

    async def LadderStatus(
        self, request: admin_pb2.LadderStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LadderStatusResponse:
        pools = []
        for name, load in sorted(self.gateway.loads.items()):
            state = load.ladder.state
            pools.append(
                admin_pb2.PoolLadder(
                    pool=name,
                    step=load.step,
                    reason=state.reason,
                    utilization=load.utilization(),
                    stale=state.stale,
                )
            )
        return admin_pb2.LadderStatusResponse(pools=pools)

    async def PublishEvidence(
        self, request: admin_pb2.PublishEvidenceRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PublishEvidenceResponse:
        try:
            recorded = self.gateway.evidence.publish(self._evidence(request.evidence))
        except InvalidArgument as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        return admin_pb2.PublishEvidenceResponse(evidence=_evidence_message(recorded))

    def _evidence(self, message: admin_pb2.EvidenceRecord) -> Evidence:
        route = self.gateway.routes.models.get(message.model)
        if route is None:
            raise InvalidArgument(f"unknown model {message.model[:128]!r}: evidence names a route")
        return Evidence(
            key=EvidenceKey(
                message.model, message.version or route.version, message.population, message.output_cap
            ),
            score=message.score,
            sample_size=message.sample_size,
            owner=message.owner,
            evaluated_at=message.evaluated_at or clock.wall(),
            review_by=message.review_by or None,
            max_age_s=message.max_age_s or None,
        )

    async def ListEvidence(
        self, request: admin_pb2.ListEvidenceRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListEvidenceResponse:
        gateway, now = self.gateway, clock.wall()
        statuses = []
        for name, route in sorted(gateway.routes.models.items()):
            fallback = gateway.routes.models.get(route.fallback) if route.fallback else None
            floor = quality_floor(route, fallback)
            verdicts = gateway.evidence.route_evidence(name, route, fallback, floor=floor, now=now)
            pop = population(route, fallback)
            if fallback is not None and route.fallback:
                key = EvidenceKey(route.fallback, fallback.version, pop)
                statuses.append(_status(name, "fallback", verdicts.fallback, floor, key))
            if route.reduced_output is not None:
                key = EvidenceKey(name, route.version, pop, route.reduced_output.max_output_tokens)
                statuses.append(_status(name, "reduced_output", verdicts.reduced_output, floor, key))
        return admin_pb2.ListEvidenceResponse(
            evidence=[_evidence_message(e) for e in gateway.evidence.all()], routes=statuses
        )

    async def RolloutStart(
        self, request: admin_pb2.RolloutStartRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RolloutStatusResponse:
        gateway = self.gateway
        try:
            if request.yaml:
                document = parse_yaml(request.path or "<rollout>", request.yaml)
                spec = parse_rollout(document, gateway.config, gateway.tenants.settings, gateway.routes)
            else:
                found = gateway.rollouts.specs.get(request.name)
                if found is None:
                    known = ", ".join(sorted(gateway.rollouts.specs)) or "none"
                    raise InvalidArgument(f"unknown rollout {request.name[:128]!r} (declared: {known})")
                spec = found
        except YamlError as error:
            raise InvalidArgument(str(error)) from None
        except ConfigError as error:
            raise InvalidArgument(str(error)) from None
        return _rollout_status(await gateway.rollouts.start_owned(spec))  # a fleet: one owner

    async def RolloutStatus(
        self, request: admin_pb2.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RolloutStatusResponse:
        return _rollout_status(self.gateway.rollouts.run_named(request.name))

    async def RolloutPromote(
        self, request: admin_pb2.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RolloutStatusResponse:
        return _rollout_status(self.gateway.rollouts.promote(request.name))

    async def RolloutRollback(
        self, request: admin_pb2.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RolloutStatusResponse:
        return _rollout_status(self.gateway.rollouts.rollback(request.name))

    async def RolloutAbort(
        self, request: admin_pb2.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RolloutStatusResponse:
        return _rollout_status(self.gateway.rollouts.abort(request.name))

    async def SetDevicesLost(
        self, request: admin_pb2.SetDevicesLostRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.TopologyStatusResponse:
        if not request.devices:
            raise InvalidArgument("name at least one device")
        self.gateway.pools.set_devices_lost(
            request.backend, tuple(request.devices), lost=request.lost, now=clock.now()
        )
        return _topology_status(self.gateway)

    async def TopologyStatus(
        self, request: admin_pb2.TopologyStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.TopologyStatusResponse:
        return _topology_status(self.gateway)


def _topology_status(gateway: Gateway) -> admin_pb2.TopologyStatusResponse:
    backends = []
    for name, units in gateway.pools.topologies():
        pools = []
        for queue in units.queues:
            left = set(units.available_units(queue))
            pools.append(
                admin_pb2.TopologyPool(
                    pool=queue.name,
                    width=queue.layout.width,
                    capacity_devices=queue.capacity_devices,
                    units=[
                        admin_pb2.TopologyUnit(name=u.name, devices=u.devices, available=u in left)
                        for u in units.units.get(queue, ())
                    ],
                )
            )
        backends.append(
            admin_pb2.BackendTopology(
                backend=name, devices=units.devices, lost=sorted(units.lost), pools=pools
            )
        )
    return admin_pb2.TopologyStatusResponse(backends=backends)


def _rollout_status(run: RolloutRun) -> admin_pb2.RolloutStatusResponse:
    rollout = run.rollout
    return admin_pb2.RolloutStatusResponse(
        name=run.name,
        phase=str(rollout.phase),
        reason=rollout.reason,
        report_json=json.dumps(rollout.report(), separators=(",", ":")),
    )


def _evidence_message(evidence: Evidence) -> admin_pb2.EvidenceRecord:
    key = evidence.key
    return admin_pb2.EvidenceRecord(
        model=key.model,
        version=key.version,
        population=key.population,
        output_cap=key.output_cap,
        score=evidence.score,
        sample_size=evidence.sample_size,
        owner=evidence.owner,
        evaluated_at=evidence.evaluated_at or 0.0,
        review_by=evidence.review_by or 0.0,
        max_age_s=evidence.max_age_s or 0.0,
        source=evidence.source,
    )


def _status(
    route: str, degradation: str, verdict: EvidenceVerdict, floor: float, key: EvidenceKey
) -> admin_pb2.RouteEvidenceStatus:
    expires = verdict.evidence.expires_at() if verdict.evidence is not None else None
    return admin_pb2.RouteEvidenceStatus(
        route=route,
        degradation=degradation,
        status=str(verdict.status),
        floor=floor,
        model=key.model,
        version=key.version,
        population=key.population,
        output_cap=key.output_cap,
        expires_at=expires or 0.0,
    )


_REQUESTS = {
    "ReloadPolicies": admin_pb2.ReloadPoliciesRequest,
    "PolicyStatus": admin_pb2.PolicyStatusRequest,
    "LadderStatus": admin_pb2.LadderStatusRequest,
    "PublishEvidence": admin_pb2.PublishEvidenceRequest,
    "ListEvidence": admin_pb2.ListEvidenceRequest,
    "RolloutStart": admin_pb2.RolloutStartRequest,
    "RolloutStatus": admin_pb2.RolloutRequest,
    "RolloutPromote": admin_pb2.RolloutRequest,
    "RolloutRollback": admin_pb2.RolloutRequest,
    "RolloutAbort": admin_pb2.RolloutRequest,
    "SetDevicesLost": admin_pb2.SetDevicesLostRequest,
    "TopologyStatus": admin_pb2.TopologyStatusRequest,
}


def add_to_server(gateway: Gateway, server: grpc.aio.Server) -> None:
    """Every method of the service, raw bytes in (``request_deserializer=None``)."""
    servicer = AdminServicer(gateway)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            servicer.authorized(getattr(servicer, name), request_type),
            request_deserializer=None,
            response_serializer=encode,
        )
        for name, request_type in _REQUESTS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
