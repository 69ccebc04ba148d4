"""Rollouts in a fleet: one replica owns a rollout's state machine, the others follow it.

With ``state.backend: redis`` every replica's ``RolloutController`` gets a ``FleetRollouts``.
Keys, under the fleet's ``state.key_prefix``, one set per route:

* ``rollout-owner:{route}``: the owning replica's id, with the fleet's lease TTL
  (``state.lease_ttl_ms``), taken with ``SET NX`` when a rollout starts (a second replica's
  ``rollout start`` for the route is refused, FAILED_PRECONDITION, naming the owner) and
  renewed by the owner at every analysis tick;
* ``rollout-state:{route}``: the owner's durable record (spec, phase, step: the same record as
  ``rollouts_state_dir``'s file), written at every phase or step change;
* ``rollout-samples:{route}``: the followers' samples (their canaries' and their cohort's
  current-version requests), pushed every ``WATCH_S`` and drained by the owner at every tick
  into its analysis intervals.

Every replica runs ``watch``: a replica that does not own a route's rollout follows the
owner's phase and step (its canaries go by the owner's step; a promoted rollout's candidate
serves its requests too); when the owner's lease has expired (the replica died) while the
rollout was running, the first replica to take the lease resumes it from the record, as a
restarted gateway does (``RolloutController._resume``: the candidate must still be READY
and pass its warm-up again, else it rolls back). Hedging is each replica's own.

This module does Redis I/O only; what it decides with is ``gateway.core.rollout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from gateway import clock
from gateway.core.rollout import ACTIVE, Phase, RolloutSpec, Sample
from gateway.settings import rollout_spec

if TYPE_CHECKING:
    from gateway.rollouts import RolloutController
    from gateway.state.redis_store import RedisFleet

log = logging.getLogger("orchid.rollout")

WATCH_S = 0.2  # how often a replica follows the owners' steps and sends its samples

# Renew or release a lease only while this replica holds it.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class FleetRollouts:
    """This replica's part in the fleet's rollouts (see the module docstring)."""

    def __init__(self, controller: RolloutController, fleet: RedisFleet) -> None:
        self.controller = controller
        self.fleet = fleet
        self.me = fleet.replica_id
        self.prefix = fleet.config.key_prefix
        self.ttl_ms = fleet.config.lease_ttl_ms
        self._renew = fleet.client.register_script(RENEW)
        self._release = fleet.client.register_script(RELEASE)
        self._outbox: dict[str, list[str]] = {}  # route -> samples to push
        self.task: asyncio.Task[None] | None = None

    def _key(self, kind: str, route: str) -> str:
        return f"{self.prefix}rollout-{kind}:{route}"

    # ------------------------------------------------------------------ the owner

    async def claim(self, route: str) -> str | None:
        """Take the route's lease; ``None`` when this replica holds it now, else the holder."""
        key = self._key("owner", route)
        taken = await self.fleet.call(self.fleet.client.set(key, self.me, nx=True, px=self.ttl_ms))
        if taken:
            return None
        holder = await self.fleet.call(self.fleet.client.get(key))
        if holder is None:  # expired between the two calls: try once more
            taken = await self.fleet.call(self.fleet.client.set(key, self.me, nx=True, px=self.ttl_ms))
            return None if taken else "another replica"
        text = holder.decode() if isinstance(holder, bytes) else str(holder)
        return None if text == self.me else text

    async def renew(self, route: str) -> bool:
        return bool(
            await self.fleet.call(self._renew(keys=[self._key("owner", route)], args=[self.me, self.ttl_ms]))
        )

    async def release(self, route: str) -> None:
        with contextlib.suppress(Exception):
            await self.fleet.call(self._release(keys=[self._key("owner", route)], args=[self.me]))

    async def publish(self, route: str, record: dict[str, Any]) -> None:
        await self.fleet.call(
            self.fleet.client.set(self._key("state", route), json.dumps(record, sort_keys=True))
        )

    async def drain(self, route: str) -> list[tuple[bool, Sample]]:
        """The followers' samples since the last drain (atomically taken)."""
        key = self._key("samples", route)
        pipe = self.fleet.client.pipeline(transaction=True)
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        raw, _ = await self.fleet.call(pipe.execute())
        samples: list[tuple[bool, Sample]] = []
        for item in raw:
            try:
                data = json.loads(item)
                samples.append((bool(data.pop("candidate")), Sample(**data)))
            except (ValueError, TypeError, KeyError):
                continue
        return samples

    # ------------------------------------------------------------------ the followers

    def report(self, route: str, candidate: bool, sample: Sample) -> None:
        """A follower's sample, sent to the owner with the next ``watch`` round."""
        outbox = self._outbox.setdefault(route, [])
        if len(outbox) < 10_000:  # bounded while Redis is unreachable
            outbox.append(json.dumps({"candidate": candidate, **asdict(sample)}))

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.watch(), name="rollout-fleet")

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: followers keep their last step
                log.debug("rollout fleet round failed: %s", exc)

    async def _round(self) -> None:
        client = self.fleet.client
        for route, items in list(self._outbox.items()):
            if items:
                self._outbox[route] = []
                pushed: Awaitable[int] = client.rpush(self._key("samples", route), *items)  # type: ignore[assignment]
                await self.fleet.call(pushed)
        controller = self.controller
        for route in controller.routes.models:
            raw = await self.fleet.call(client.get(self._key("state", route)))
            if raw is None:
                continue
            try:
                record = json.loads(raw)
                spec = rollout_spec(record["spec"])
                phase, step = Phase(record["phase"]), int(record["step"])
            except (ValueError, KeyError, TypeError, ValidationError):
                continue
            run_id = str(record.get("run_id", ""))
            owner = await self.fleet.call(client.get(self._key("owner", route)))
            owner_id = owner.decode() if isinstance(owner, bytes) else owner
            if owner_id == self.me:
                continue  # this replica's own run
            own = controller.runs.get(spec.name)
            if own is not None and not own.follower and not own.lost and own.id == run_id:
                continue  # the record is of this replica's own run (running, or ended here)
            if owner_id is None and phase in ACTIVE:
                if await self.claim(route) is None:
                    log.warning("rollout %s: its owner's lease expired; this replica resumes it", spec.name)
                    controller.take_over(spec, phase, step)
                continue
            self._follow(spec, phase, step, run_id)

    def _follow(self, spec: RolloutSpec, phase: Phase, step: int, run_id: str) -> None:
        controller = self.controller
        run = controller.runs.get(spec.name)
        if run is None or not run.follower or run.id != run_id:
            route = controller.routes.models.get(spec.route)
            if route is None:
                return
            from gateway.rollouts import RolloutRun  # a cycle at import time otherwise

            run = RolloutRun(spec, route, controller.control_backends(route))
            run.follower, run.id = True, run_id
            controller.specs.setdefault(spec.name, spec)
            controller.runs[spec.name] = run
        run.rollout.follow(clock.now(), phase, step)
        route_name = spec.route
        if phase in (Phase.SHADOW, Phase.CANARY):
            controller.active[route_name] = run
            controller.promoted.pop(route_name, None)
        elif phase in (Phase.PROMOTED, Phase.COMPLETE):
            controller.promoted[route_name] = run
            controller.active.pop(route_name, None)
        else:
            if controller.active.get(route_name) is run:
                controller.active.pop(route_name, None)
            if controller.promoted.get(route_name) is run:
                controller.promoted.pop(route_name, None)
