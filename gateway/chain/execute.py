"""Stage 9, execute: run an admitted request on its backend, with shadow and canary hooks.

Owns the call to the backend within the request's deadline (or a canary's hedge
budget, whichever is first), the hooks around it (shadow traffic mirrors the request,
the rollout controller sees it start, fail or answer, the prefix index records what
the pool's cache holds and learns the backend's reported hit) and the route's output contract:
an answer outside it never leaves (INTERNAL, rule ``output.contract``), and the tenant
is not charged for it. A canary that failed, ran out of its budget or answered outside
its contract returns no response: the chain answers again from the current version.

Streams adapt this stage (``gateway.streams``): their backend call is one request on
a shared backend stream, with the same hooks. It may call backends and the rollout and
shadow collaborators; it may not judge, place or reserve.
"""

from __future__ import annotations

import logging

from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.auth import Tenant
from gateway.chain.settle import Settle
from gateway.core.dispatch import Slot
from gateway.core.errors import DeadlineExpired, Internal
from gateway.core.outputs import OUTPUT_CONTRACT_RULE
from gateway.exchange import Admitted
from gateway.outputs import INVALID_OUTPUTS, check_outputs
from gateway.prefix_affinity import PrefixAffinity
from gateway.rollouts import RolloutController
from gateway.shadow import ShadowTraffic
from gateway.shape import DEVICES_PARAMETER

log = logging.getLogger(__name__)


class Execute:
    """Backend calls of admitted requests."""

    def __init__(
        self, rollouts: RolloutController, shadows: ShadowTraffic, settle: Settle, prefix: PrefixAffinity
    ) -> None:
        self.rollouts = rollouts
        self.shadows = shadows
        self.settle = settle
        self.prefix = prefix

    def starting(self, admitted: Admitted, tenant: Tenant, started: float, slot: Slot | None = None) -> None:
        """The hooks as a request starts on its backend: the unit its slot holds named on the
        backend request (a topology, dispatch rule 10), shadow mirror, rollout dispatch."""
        if slot is not None and slot.unit is not None:
            devices = ",".join(str(d) for d in slot.unit.devices)
            admitted.backend_request.parameters[DEVICES_PARAMETER].string_param = devices
        if admitted.prefix is not None:  # its blocks are in the pool's cache from now on
            self.prefix.sent(admitted.prefix)
        self.shadows.maybe_mirror(admitted, tenant)
        self.rollouts.dispatched(admitted, started)

    def answered(self, admitted: Admitted, response: service_pb2.ModelInferResponse) -> None:
        """The backend answered: its reported prefix-cache hit teaches the hit rate."""
        if admitted.prefix is not None:
            self.prefix.observe(
                admitted.prefix,
                response,
                route=admitted.record.identity.model,
                tenant=admitted.record.identity.tenant,
            )

    @staticmethod
    def deadline_at(admitted: Admitted) -> float:
        """When the backend must have answered: the request's deadline, or a canary's hedge."""
        if admitted.canary_deadline_at is not None:
            return min(admitted.deadline_at, admitted.canary_deadline_at)
        return admitted.deadline_at

    async def run(self, admitted: Admitted, started: float) -> service_pb2.ModelInferResponse | None:
        """The backend's answer, or None when a canary must be answered again."""
        try:
            timeout_s = self.deadline_at(admitted) - started
            if timeout_s <= 0:
                raise DeadlineExpired("the deadline passed before the request could start")
            response = await admitted.backend.infer(
                admitted.backend_request, timeout_s=timeout_s, logical=admitted.record.identity.model
            )
        except BaseException as error:  # it ran, at least partly: charge what it held
            failed_at = clock.now()
            if not self.rollouts.candidate_failed(admitted, error, started=started, now=failed_at):
                self.settle.abandon(admitted, started=started, now=failed_at)
                raise
            # A rollout candidate failed or ran out of its budget: the current version answers
            # instead, and the candidate's attempt is the rollout's cost, not the tenant's.
            self.settle.abandon(admitted, started=None, now=failed_at)
            return None
        if not self.rollouts.candidate_answered(admitted, response, started=started, now=clock.now()):
            self.settle.abandon(admitted, started=None, now=clock.now())  # an invalid canary answer
            return None
        return response

    def check_outputs(self, admitted: Admitted, response: service_pb2.ModelInferResponse) -> None:
        """The route's output contract: an answer outside it is refused with INTERNAL and
        counted; the tenant is not charged for it."""
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
        self.settle.abandon(admitted, started=None, now=clock.now())
        INVALID_OUTPUTS.labels(record.identity.model, record.identity.model_version, "refused").inc()
        log.warning("model %s: answer outside its output contract: %s", record.identity.model, problems[0])
        raise Internal(
            f"model {record.identity.model!r} answered outside its output contract: {problems[0]}"
            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
            rule=OUTPUT_CONTRACT_RULE,
        )
