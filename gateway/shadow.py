"""Shadow traffic: mirroring a share of a route's admitted requests to its candidate
version, off the caller's path (see ``ShadowTraffic``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.base import Backend, infer_streamed
from gateway.core.errors import GatewayError
from gateway.core.overload import Shedder
from gateway.core.overload import effects as overload_effects
from gateway.core.record import Approximation
from gateway.core.topology import Unit
from gateway.core.units import UnitDeviceSet
from gateway.scheduler import Slot
from gateway.shape import DEVICES_PARAMETER

if TYPE_CHECKING:
    from gateway.auth import Tenant
    from gateway.config import RouteTable
    from gateway.exchange import Admitted
    from gateway.pools import PoolRegistry
    from gateway.rollouts import RolloutController


class ShadowTraffic:
    """Mirror a share of a route's admitted requests to its candidate version (the seed's
    "shadowing duplicates selected inputs to a candidate while returning only the control
    result"). The mirror never changes the caller's answer, never enters the production
    dispatch queues (it runs on the candidate's own instances, bounded by ``max_inflight``),
    never leaves the request's privacy cell, never runs for dedicated tenants, never
    cold-loads (the candidate must be warm), and stops from overload ladder step 1. Paired
    latency is recorded for the candidate; its output is discarded unread."""

    def __init__(self, pools: PoolRegistry, routes: RouteTable, rollouts: RolloutController) -> None:
        self.pools = pools
        self.routes = routes
        self.rollouts = rollouts
        self.samplers: dict[str, Shedder] = {}
        self.inflight: dict[str, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.skipped = 0

    def maybe_mirror(self, admitted: Admitted, tenant: Tenant) -> None:
        if self.rollouts.mirror(admitted, tenant):
            return  # a rollout owns the route's version change (gateway.rollouts): no route shadow
        route = self.routes.models.get(admitted.record.identity.model)
        if route is None or route.shadow is None:
            return
        shadow = route.shadow
        if tenant.config.dedicated or admitted.decision.approximation is not Approximation.NONE:
            return
        if not overload_effects(admitted.record.ladder_step).shadow_enabled:
            self.skipped += 1
            return
        sampler = self.samplers.setdefault(shadow.backend_model, Shedder())
        if not sampler.admit(1.0, shadow.rate):
            return
        if self.inflight.get(shadow.backend_model, 0) >= shadow.max_inflight:
            self.skipped += 1
            return
        for name in self.pools.candidate_backends(route, admitted.record.identity.privacy_cell):
            client = self.pools.backends[name].client
            if client.is_warm(shadow.backend_model):
                break
        else:
            self.skipped += 1  # no warm candidate in the request's cell: never cold-load
            return
        # On a backend whose models share their devices the candidate runs on production's
        # accelerators: it may take only a device that is idle now, and holds it in the
        # device set's schedule while it runs, so dispatch predicts around it (it never waits
        # in, or delays, a production queue).
        device_set = self.pools.shared_device_set(name)
        slot: Slot | None = None
        unit: Unit | None = None
        if isinstance(device_set, UnitDeviceSet):
            # A topology (dispatch rule 10): the candidate takes a whole unit of its own layout
            # that is free now and not claimed, named on its request like production's.
            topology = self.pools.backends[name].topology
            units = topology.units_of(device_set.devices, shadow.backend_model) if topology else ()
            unit = device_set.free_unit_among(clock.now(), units)
            if unit is None or not device_set.queues:
                self.skipped += 1
                return
            demand = admitted.record.demand
            slot = Slot(
                device_set.queues[0], demand.accelerator_ms / len(unit.devices), clock.now(), clock.now()
            )
            slot.unit = unit
            device_set.bound[slot] = None
        elif device_set is not None and device_set.queues:
            now = clock.now()
            live_bytes = admitted.record.demand.peak_memory_bytes
            if len(device_set.bound) >= device_set.devices or not device_set.fits(now, live_bytes):
                self.skipped += 1  # no idle device, or not the memory for its live state there
                return
            demand = admitted.record.demand
            slot = Slot(device_set.queues[0], demand.accelerator_ms, now, now, live_bytes=live_bytes)
            device_set.bound[slot] = None
        mirrored = service_pb2.ModelInferRequest()
        mirrored.CopyFrom(admitted.backend_request)
        mirrored.model_name = shadow.backend_model
        mirrored.model_version = ""
        if unit is not None:  # production's unit is not the candidate's
            mirrored.parameters[DEVICES_PARAMETER].string_param = ",".join(str(d) for d in unit.devices)
        remaining_s = admitted.deadline_at - clock.now()
        if remaining_s <= 0:
            if slot is not None:
                slot.release()
            return
        self.inflight[shadow.backend_model] = self.inflight.get(shadow.backend_model, 0) + 1
        self.sent += 1
        task = asyncio.get_running_loop().create_task(
            self._send(client, mirrored, remaining_s, slot, route.streaming)
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(
        self,
        client: Backend,
        request: service_pb2.ModelInferRequest,
        timeout_s: float,
        slot: Slot | None = None,
        streaming: bool = False,
    ) -> None:
        try:
            if streaming:  # a decoupled model answers on a stream
                await infer_streamed(client, request, timeout_s=timeout_s)
            else:
                await client.infer(request, timeout_s=timeout_s, logical=request.model_name)
        except GatewayError:
            pass  # a candidate's failure is evidence about the candidate, never the caller's problem
        finally:
            self.inflight[request.model_name] -= 1
            if slot is not None:
                slot.release()
