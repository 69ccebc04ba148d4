"""Rollouts at runtime: load, warm, shadow, canary, promote or roll back one version change.

This module owns the I/O around the pure state machine ``gateway.core.rollout.Rollout``:

* **Files** (``load_rollouts``, ``parse_rollout``): ``rollouts/*.yaml`` through the one
  located-YAML reader, validated by the core's schema and cross-checked against the routes
  and the gateway config (route, profiles, classes, risk classes, tenants, the route's
  output), every problem a ``ConfigError`` at ``file:line:col``.
* **Two-version memory** (``check_two_versions``): before anything loads, both versions'
  replicas beside the runtime reserve must leave each device the declared live room; if
  not, the rollout is refused with the rollback delay that would imply.
* **Load and warm** (``RolloutController``): the candidate is loaded through Triton's
  repository API (explicit model control), its manifest identity checked in the
  repository index, then every declared warm-up shape is sent to it with its outputs
  validated. Only then does the state machine let it serve.
* **Routing** (``divert``, ``mirror``): the request path asks which version serves a request
  (a canary: privacy-eligible, in a declared cohort, the candidate idle in the request's
  cell); the shadow step mirrors matching requests off the caller's path.
* **Evidence** (``settled``, ``candidate_failed``, ``candidate_answered``, ``quality_drop``):
  every finished request of the route in the step's cohorts is a sample for its version, in
  its shape bucket; the published quality evaluations of both versions are compared.
* **Hedge** (``divert``, ``dispatched``, ``candidate_failed``, ``candidate_answered``): a canary
  runs under a budget that leaves the current version time to answer (``core.rollout.
  hedge_budget_ms``); a timeout, an error or an answer outside the declared outputs
  (``RolloutRun.output_checks``: the route's contract and the rollout's) is a failing sample
  and the request is answered again by the current version (the caller never sees the
  candidate's failure, lateness or invalid answer); the attempt's device time is the
  rollout's (``hedge_device_ms``), refunded to the tenant. An allocation failure rolls back
  at once.
* **Retirement**: after promotion the old version's in-flight and queued work drains, then
  it is unloaded; after a rollback, the candidate's. The measured times are reported.
* **Durable state** (``state_dir``, the config's ``rollouts_state_dir``): a rollout's spec,
  phase and step are written (one JSON file, replaced atomically) at its start and at every
  phase or step change; ``resume`` at startup continues each one a previous process left
  running: a shadow or canary step starts again once the candidate is READY and passes its
  warm-up again (else the rollout rolls back and the candidate is retired), a promoted one
  retires the old version, a complete one keeps serving the candidate; earlier phases
  start over from the load.

Metrics: ``orchid_rollout_requests_total{rollout,version,outcome}``,
``orchid_rollout_latency_seconds{rollout,version,kind}``, ``orchid_rollout_step{rollout}``,
``orchid_rollout_memory_high_water{rollout}``, ``orchid_rollout_hedged_total{rollout,why}``,
``orchid_rollout_hedge_device_seconds_total{rollout}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from pydantic import ValidationError
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.base import Backend, RepositoryControl, infer_streamed
from gateway.config import GatewayConfig, RouteConfig, RouteTable, TenantsFile
from gateway.core import memory as device_memory
from gateway.core.errors import ConfigError, FailedPrecondition, GatewayError, NotFound, Unavailable
from gateway.core.evidence import EvidenceKey, judge
from gateway.core.record import Mode, RequestRecord, Shape, Verdict
from gateway.core.rollout import (
    ACTIVE,
    CANARY_REASON,
    Phase,
    RequestFacts,
    Rollout,
    RolloutSpec,
    Sample,
    hedge_budget_ms,
)
from gateway.evidence import population
from gateway.outputs import INVALID_OUTPUTS, check_outputs, check_result
from gateway.policy.metrics import get_or_create
from gateway.settings import rollout_data, rollout_spec
from gateway.yaml_source import KeyPath, YamlDocument, YamlError, key_path, parse_yaml

if TYPE_CHECKING:
    from gateway.auth import Tenant
    from gateway.core.record import RequestRecord as PricedRecord
    from gateway.evidence import EvidenceStore
    from gateway.exchange import Admitted, BackendHandle, Settled
    from gateway.pools import PoolRegistry
    from gateway.rollout_fleet import FleetRollouts
    from gateway.scheduler import DispatchQueue

    # Prices this request on a route, in a pool: the request path's own pricing.
    Pricer = Callable[[RouteConfig, BackendHandle, DispatchQueue], PricedRecord]

log = logging.getLogger("orchid.rollout")

LOAD_TIMEOUT_S = 120.0
TICK_S = 0.05  # how often the analysis closes intervals and the drain is checked
QUIET_S = 0.05  # a retired version is drained once its pools stayed empty this long
# In a fleet: two of the followers' watcher rounds (``gateway.rollout_fleet.WATCH_S``, 0.2 s), by
# which every live replica follows the switch, and then its own work has drained too.
FLEET_QUIET_S = 0.5
ALLOCATION_FAILURE = "out of memory"  # what an allocation failure's message carries

REQUESTS: Counter = get_or_create(
    "orchid_rollout_requests",
    lambda: Counter(
        "orchid_rollout_requests",
        "Requests of a route under rollout, in the current step's cohorts, by version and outcome "
        "(ok, late, error, invalid_output, fell_back: chosen for the candidate, answered by current)",
        ["rollout", "version", "outcome"],
    ),
)
LATENCY: Histogram = get_or_create(
    "orchid_rollout_latency_seconds",
    lambda: Histogram(
        "orchid_rollout_latency_seconds",
        "First-result and completion latency of a route under rollout, by version",
        ["rollout", "version", "kind"],
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0),
    ),
)
STEP: Gauge = get_or_create(
    "orchid_rollout_step",
    lambda: Gauge(
        "orchid_rollout_step",
        "Step of the rollout (0 loading or warming; -1 rolled back or aborted; steps + 1 complete)",
        ["rollout"],
    ),
)
HEDGED: Counter = get_or_create(
    "orchid_rollout_hedged",
    lambda: Counter(
        "orchid_rollout_hedged",
        "Canaries answered again by the current version, by why (timeout, error, invalid_output)",
        ["rollout", "why"],
    ),
)
HEDGE_DEVICE: Counter = get_or_create(
    "orchid_rollout_hedge_device_seconds",
    lambda: Counter(
        "orchid_rollout_hedge_device_seconds",
        "Device time held by candidate attempts that were answered again (the rollout's cost, "
        "refunded to the tenant)",
        ["rollout"],
    ),
)
MEMORY_HIGH_WATER: Gauge = get_or_create(
    "orchid_rollout_memory_high_water",
    lambda: Gauge(
        "orchid_rollout_memory_high_water",
        "Peak share of the candidate's device live room held by its work",
        ["rollout"],
    ),
)


# --------------------------------------------------------------------------- files


def _at(document: YamlDocument, loc: KeyPath, problem: str) -> ConfigError:
    return ConfigError(document.location(loc), key_path(loc), problem)


def parse_rollout(
    document: YamlDocument, config: GatewayConfig, tenants: TenantsFile, routes: RouteTable
) -> RolloutSpec:
    """One rollout file, validated and cross-checked; ``ConfigError`` at ``file:line:col``."""
    data = document.value()
    if not isinstance(data, dict):
        raise ConfigError(document.location(), "", "expected a mapping at the top level")
    try:
        spec = rollout_spec(data)
    except ValidationError as exc:
        errors = exc.errors()
        problem = errors[0]["msg"]
        if len(errors) > 1:
            problem += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise _at(document, errors[0]["loc"], problem) from exc
    route = routes.models.get(spec.route)
    if route is None:
        raise _at(document, ("route",), f"unknown route {spec.route!r}")
    if spec.current.backend_model != route.backend_model:
        raise _at(
            document,
            ("current", "backend_model"),
            f"route {spec.route!r} runs {route.backend_model!r}, not {spec.current.backend_model!r}",
        )
    if route.version and spec.current.version != route.version:
        raise _at(document, ("current", "version"), f"route {spec.route!r} runs version {route.version!r}")
    for part in ("current", "candidate"):
        ref = getattr(spec, part)
        if ref.profile and ref.profile not in routes.profiles:
            raise _at(document, (part, "profile"), f"unknown profile {ref.profile!r}")
    for name in spec.warmup.outputs:
        if name != "*" and not name:
            raise _at(document, ("warmup", "outputs"), "an output needs a name")
    if not spec.warmup.outputs and not route.outputs:
        raise _at(
            document,
            ("warmup",),
            f"declare the outputs a valid answer has (warmup.outputs), or an outputs contract on "
            f"route {spec.route!r}: a candidate is checked against them before and while it serves",
        )
    for index, shape in enumerate(spec.warmup.shapes):
        long = shape.input_tokens > route.shape.long_input_tokens
        if long != (shape.bucket == "long"):
            raise _at(
                document,
                ("warmup", "shapes", index, "input_tokens"),
                f"{shape.input_tokens} input tokens is not in the {shape.bucket} bucket "
                f"(long: over {route.shape.long_input_tokens})",
            )
        if shape.input_tokens > route.shape.max_input_tokens or shape.items > route.shape.max_items:
            raise _at(document, ("warmup", "shapes", index), "larger than the route accepts")
    for s, step in enumerate(spec.steps):
        for c, cohort in enumerate(step.cohorts):
            for field, known, label in (
                ("classes", config.classes, "class"),
                ("risk_classes", config.risk_classes, "risk class"),
                ("tenants", tenants.tenants, "tenant"),
            ):
                for i, value in enumerate(getattr(cohort, field)):
                    if value not in known:
                        raise _at(
                            document, ("steps", s, "cohorts", c, field, i), f"unknown {label} {value!r}"
                        )
    return spec


def load_rollouts(
    directory: Path, config: GatewayConfig, tenants: TenantsFile, routes: RouteTable
) -> dict[str, RolloutSpec]:
    """Every ``*.yaml`` in ``directory``; names unique."""
    if not directory.is_dir():
        raise ConfigError(str(directory), "", "rollouts directory does not exist")
    specs: dict[str, RolloutSpec] = {}
    for file in sorted(directory.glob("*.yaml")):
        try:
            text = file.read_text(encoding="utf-8")
            document = parse_yaml(str(file), text)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(str(file), "", f"cannot read file: {exc}") from exc
        except YamlError as exc:
            raise ConfigError(exc.location, "", exc.problem) from exc
        spec = parse_rollout(document, config, tenants, routes)
        if spec.name in specs:
            raise _at(document, ("name",), f"rollout {spec.name!r} declared twice")
        specs[spec.name] = spec
    return specs


# --------------------------------------------------------------------------- memory


def check_two_versions(
    pools: PoolRegistry, routes: RouteTable, spec: RolloutSpec, backends: Sequence[str]
) -> None:
    """Refuse (FAILED_PRECONDITION) a rollout whose two versions cannot both be resident on a
    device of a backend beside its runtime reserve with ``memory.min_live_tokens`` of live
    room: rolling back would then need the current version loaded again."""
    route = routes.models[spec.route]
    current = routes.profiles[spec.current.profile or route.profile]
    candidate = routes.profiles[spec.candidate.profile or route.profile]
    need = spec.memory.min_live_tokens * current.live_cache_bytes_per_token
    both = device_memory.resident_bytes(current) + device_memory.resident_bytes(candidate)
    for name in backends:
        handle = pools.backends[name]
        if handle.memory is None:
            continue
        others = 0
        shared = pools.shared_device_set(name) if handle.shared_devices else None
        if shared is not None:
            others = sum(
                b
                for model, b in shared.resident.items()
                if model not in (spec.current.backend_model, spec.candidate.backend_model)
            )
        room = handle.memory.live_room_bytes(both + others)
        if room < need:
            warm_ms = sum(
                current.accelerator_ms(s.input_tokens, s.output_tokens) * s.repeat for s in spec.warmup.shapes
            )
            gib = 1024**3
            raise FailedPrecondition(
                f"rollout {spec.name!r} refused: {spec.current.backend_model} and "
                f"{spec.candidate.backend_model} do not both fit a device of backend {name!r} "
                f"({handle.memory.device_bytes / gib:.2f} GiB - "
                f"{handle.memory.runtime_reserve_bytes / gib:.2f} GiB reserve - {both / gib:.2f} GiB "
                f"of two replicas{' - other models' if others else ''} leaves "
                f"{room / gib:.2f} GiB, under the {need / gib:.2f} GiB of live room declared). Loading the "
                f"candidate would need the current version unloaded first, so a rollback would wait "
                f"for {spec.candidate.backend_model} to unload, {spec.current.backend_model} to load, and "
                f"its warm-up ({sum(s.repeat for s in spec.warmup.shapes)} requests, "
                f"{warm_ms * handle.time_scale:.0f} ms of device time) with no warm version serving "
                f"the route: free memory, or use devices with room for both versions"
            )


# --------------------------------------------------------------------------- runtime


CANARY_MODES = frozenset({Mode.ONLINE, Mode.STREAMING})


@dataclass(frozen=True, slots=True)
class Diverted:
    """Where a request of a route under rollout runs instead of its current version."""

    route: RouteConfig
    handle: BackendHandle
    queue: DispatchQueue
    label: str  # provenance version label
    reason: str  # route reason ("canary"), or "" to keep admission's (promoted)
    budget_ms: float | None = None  # a canary's: how long the candidate may take from pricing


def missed(record: RequestRecord, queue_ms: float, first_result_ms: float, completion_ms: float) -> bool:
    """Whether a version's answer missed its deadline end to end: a stream's first result
    its first-result deadline, any other answer its completion deadline."""
    budget = record.budget
    if budget.first_result_deadline_ms is not None:
        return queue_ms + first_result_ms > budget.first_result_deadline_ms
    return queue_ms + completion_ms > budget.deadline_ms


class RolloutRun:
    """One rollout's runtime: the state machine, its candidate route and its task."""

    def __init__(self, spec: RolloutSpec, route: RouteConfig, backends: list[str]) -> None:
        self.spec = spec
        self.rollout = Rollout(spec)
        self.backends = backends
        self.candidate_route = route.model_copy(
            update={
                "backend_model": spec.candidate.backend_model,
                "version": spec.candidate.version,
                "profile": spec.candidate.profile or route.profile,
                "shadow": None,
            }
        )
        # The one output contract a candidate answer must meet: the route's, with the
        # rollout's declared outputs added (warm-up, canaries and shadows alike).
        self.output_checks = {**route.outputs, **spec.warmup.outputs}
        self.task: asyncio.Task[None] | None = None
        self.canaries: dict[str, float] = {}  # request id -> dispatch time, until its outcome
        # A fleet: this replica follows another's run of this rollout (gateway.rollout_fleet);
        # its samples go to the owner, and it never loads, judges or retires anything.
        self.follower = False
        self.id = uuid.uuid4().hex  # this run's identity in a fleet's record (a follower: the owner's)
        self.lost = False  # the owner's lease passed to another replica while this one ran it
        self.resume_why = "after a gateway restart"  # or a fleet's take-over (``take_over``)
        self.shadow_inflight = 0
        self.mirrors: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        return self.spec.name


class RolloutController:
    """The gateway's rollouts: at most one running per route."""

    def __init__(
        self,
        pools: PoolRegistry,
        routes: RouteTable,
        evidence: EvidenceStore | None = None,
        specs: dict[str, RolloutSpec] | None = None,
    ) -> None:
        self.pools = pools
        self.routes = routes
        self.evidence = evidence  # quality evidence per version (``quality_drop``); None: none
        self.specs: dict[str, RolloutSpec] = dict(specs or {})
        self.runs: dict[str, RolloutRun] = {}  # latest run per rollout name
        self.active: dict[str, RolloutRun] = {}  # route -> running rollout
        self.promoted: dict[str, RolloutRun] = {}  # route -> the rollout whose candidate serves it
        self.state_dir: Path | None = None  # durable state (``_save``, ``resume``); None: memory only
        self.fleet: FleetRollouts | None = None  # a fleet's replicas: one owns each rollout

    # ------------------------------------------------------------------ control

    def start(self, spec: RolloutSpec) -> RolloutRun:
        route = self.routes.models.get(spec.route)
        if route is None:
            raise NotFound(f"rollout {spec.name!r} names unknown route {spec.route!r}")
        running = self.active.get(spec.route)
        if running is not None:
            raise FailedPrecondition(f"route {spec.route!r} is already rolling out ({running.name})")
        if spec.route in self.promoted:
            raise FailedPrecondition(
                f"route {spec.route!r} is served by promoted rollout {self.promoted[spec.route].name}: "
                "update the route file and restart before the next version change"
            )
        backends = self.control_backends(route)
        if not backends:
            raise FailedPrecondition(f"no backend of route {spec.route!r} supports explicit model control")
        check_two_versions(self.pools, self.routes, spec, backends)
        run = RolloutRun(spec, route, backends)
        self.specs[spec.name] = spec
        self.runs[spec.name] = run
        self.active[spec.route] = run
        run.rollout.start(clock.now())
        self.pools.generation.bump("rollout")
        self._save(run)
        STEP.labels(spec.name).set(0)
        run.task = asyncio.get_running_loop().create_task(self._run(run), name=f"rollout-{spec.name}")
        return run

    async def start_owned(self, spec: RolloutSpec) -> RolloutRun:
        """``start``, after taking the route's lease in a fleet (a rollout is owned by one
        replica; another replica's start of it is refused, naming the owner)."""
        if self.fleet is None:
            return self.start(spec)
        holder = await self.fleet.claim(spec.route)
        if holder is not None:
            raise FailedPrecondition(
                f"route {spec.route!r} is rolling out on replica {holder}: start, promote or roll it "
                "back there (or wait for its lease to expire if that replica is gone)"
            )
        try:
            return self.start(spec)
        except BaseException:
            await self.fleet.release(spec.route)
            raise

    def take_over(self, spec: RolloutSpec, phase: Phase, step: int) -> RolloutRun | None:
        """A fleet's rollout whose owner is gone: this replica holds its lease now and
        resumes it from the owner's record (as after a restart)."""
        route = self.routes.models.get(spec.route)
        if route is None:
            return None
        run = RolloutRun(spec, route, self.control_backends(route))
        run.resume_why = "by this replica (its owner replica gone)"
        self.specs.setdefault(spec.name, spec)
        self.runs[spec.name] = run
        self.promoted.pop(spec.route, None)
        self.active[spec.route] = run
        run.task = asyncio.get_running_loop().create_task(
            self._run(run, resume=(phase, step)), name=f"rollout-{spec.name}"
        )
        return run

    def control_backends(self, route: RouteConfig) -> list[str]:
        backends = self.pools.backends
        return [
            name
            for name in (route.backends or tuple(backends))
            if name in backends and isinstance(backends[name].client, RepositoryControl)
        ]

    # ------------------------------------------------------------------ durable state

    @staticmethod
    def _record(run: RolloutRun) -> dict[str, object]:
        rollout = run.rollout
        return {
            "run_id": run.id,
            "spec": rollout_data(run.spec),
            "phase": str(rollout.phase),
            "step": rollout.step,
            "reason": rollout.reason,
            "saved_at": clock.wall(),
        }

    async def _persist(self, run: RolloutRun) -> None:
        """The state where it is kept: the state directory, and a fleet's Redis (followers
        route by it; a replica that takes the lease over resumes from it)."""
        self._save(run)
        if self.fleet is not None and not run.lost:
            try:
                await self.fleet.publish(run.spec.route, self._record(run))
            except Exception as exc:  # Redis away: the followers keep the last step
                log.warning("rollout %s: publishing its state failed: %s", run.name, exc)

    async def _keep_lease(self, run: RolloutRun) -> None:
        """Renew the route's lease while this replica runs the rollout (a third of its TTL)."""
        assert self.fleet is not None
        every = self.fleet.ttl_ms / 3000.0
        while True:
            await asyncio.sleep(every)
            try:
                held = await self.fleet.renew(run.spec.route)
                if not held and await self.fleet.claim(run.spec.route) is not None:
                    run.lost = True  # another replica took it over: stop acting
                    log.warning("rollout %s: the route's lease passed to another replica", run.name)
                    return
            except Exception as exc:  # Redis away: keep going on the last lease
                log.debug("rollout %s: renewing its lease failed: %s", run.name, exc)

    def _save(self, run: RolloutRun) -> None:
        """Write the rollout's spec, phase and step (atomically: a crash leaves the old file)."""
        if self.state_dir is None:
            return
        record = self._record(run)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"{run.name}.json"
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(record, sort_keys=True), encoding="utf-8")
        os.replace(temporary, path)

    def resume(self) -> list[RolloutRun]:
        """Continue the rollouts a previous process left running (``state_dir``); the runs."""
        if self.state_dir is None or not self.state_dir.is_dir():
            return []
        resumed: list[RolloutRun] = []
        for file in sorted(self.state_dir.glob("*.json")):
            try:
                record = json.loads(file.read_text(encoding="utf-8"))
                spec = rollout_spec(record["spec"])
                phase, step = Phase(record["phase"]), int(record["step"])
            except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
                log.warning("rollout state %s is unreadable, not resumed: %s", file, exc)
                continue
            if phase not in ACTIVE and phase is not Phase.COMPLETE:
                continue  # rolled back, aborted or never started: nothing serves differently
            route = self.routes.models.get(spec.route)
            if route is None or spec.route in self.active or spec.route in self.promoted:
                log.warning(
                    "rollout %s (state %s) not resumed: its route is unknown or taken", spec.name, file
                )
                continue
            run = RolloutRun(spec, route, self.control_backends(route))
            self.specs.setdefault(spec.name, spec)
            self.runs[spec.name] = run
            if phase is Phase.COMPLETE:
                run.rollout.resumed(clock.now(), phase, step)
                self.promoted[spec.route] = run
                STEP.labels(spec.name).set(len(spec.steps) + 1)
            else:
                self.active[spec.route] = run
                run.task = asyncio.get_running_loop().create_task(
                    self._run(run, resume=(phase, step)), name=f"rollout-{spec.name}"
                )
            resumed.append(run)
            log.info("rollout %s: resuming (%s, step %d) from %s", spec.name, phase, step + 1, file)
        return resumed

    async def _resume(self, run: RolloutRun, phase: Phase, step: int) -> None:
        """Continue a rollout from its saved phase (see ``resume``)."""
        rollout, spec = run.rollout, run.spec
        if phase not in (Phase.SHADOW, Phase.CANARY, Phase.PROMOTED):
            rollout.start(clock.now())
            await self._load(run)
            if rollout.phase is Phase.WARMING:
                rollout.warmed(clock.now(), await self._warm(run))
            return
        # Wait for the backends' first probes (the process just started), bounded.
        waited = clock.now()
        while not all(self.pools.backends[n].client.healthy for n in run.backends):
            if clock.now() - waited > LOAD_TIMEOUT_S:
                break
            await asyncio.sleep(TICK_S)
        if phase is Phase.PROMOTED:
            rollout.resumed(clock.now(), phase, step, run.resume_why)
            return
        problems: list[str] = []
        for name in run.backends:
            client = self.pools.backends[name].client
            assert isinstance(client, RepositoryControl)
            try:
                states = {(m, v): state for m, v, state in await client.repository_index()}
            except Exception as exc:
                problems.append(f"the repository index of {name!r} could not be read: {exc}")
                continue
            state = states.get((spec.candidate.backend_model, spec.candidate.version))
            if state != "READY":
                problems.append(f"{spec.candidate.backend_model} is {state or 'absent'} on {name!r}")
        if not problems:
            problems = await self._warm(run)  # readiness again: a restart proves nothing about it
        if problems:
            rollout.start(clock.now())
            rollout.load_failed(clock.now(), f"resumed after a gateway restart, but {problems[0]}")
            return
        rollout.resumed(clock.now(), phase, step, run.resume_why)

    def run_named(self, name: str) -> RolloutRun:
        run = self.runs.get(name)
        if run is None:
            raise NotFound(f"no rollout {name[:128]!r} has run on this gateway")
        return run

    def promote(self, name: str) -> RolloutRun:
        run = self.run_named(name)
        self._guard(run, lambda now: run.rollout.promote(now, "operator"))
        return run

    def rollback(self, name: str, reason: str = "rolled back by an operator") -> RolloutRun:
        run = self.run_named(name)
        self._guard(run, lambda now: run.rollout.roll_back(now, reason))
        return run

    def abort(self, name: str) -> RolloutRun:
        run = self.run_named(name)
        self._guard(run, run.rollout.abort)
        return run

    def _guard(self, run: RolloutRun, action: Callable[[float], None]) -> None:
        if run.follower:  # a fleet: only the owner's state machine decides
            raise FailedPrecondition(
                f"rollout {run.name!r} is owned by another replica of the fleet: promote, roll back "
                "or abort it there"
            )
        try:
            action(clock.now())
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
        finally:
            self.pools.generation.bump("rollout")  # a phase or step change: a new generation

    async def close(self) -> None:
        if self.fleet is not None:
            await self.fleet.close()
        for run in list(self.runs.values()):
            for task in [run.task, *run.mirrors]:
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

    # ------------------------------------------------------------------ the run

    async def _run(self, run: RolloutRun, resume: tuple[Phase, int] | None = None) -> None:
        rollout, spec = run.rollout, run.spec
        keeper = (
            asyncio.get_running_loop().create_task(self._keep_lease(run), name=f"rollout-lease-{spec.name}")
            if self.fleet is not None
            else None
        )
        try:
            if resume is not None:
                await self._resume(run, *resume)
            else:
                await self._load(run)
                if rollout.phase is Phase.WARMING:
                    problems = await self._warm(run)
                    rollout.warmed(clock.now(), problems)
            self.pools.generation.bump("rollout")  # loaded and warmed (or resumed): its first step
            await self._persist(run)
            saved = (rollout.phase, rollout.step)
            while rollout.phase in (Phase.SHADOW, Phase.CANARY) and not run.lost:
                await asyncio.sleep(TICK_S)
                self._sample_memory(run)
                run.rollout.quality_drop = self.quality_drop(run.spec)
                if self.fleet is not None:  # the followers' samples, into this interval
                    with contextlib.suppress(Exception):
                        for candidate, sample in await self.fleet.drain(spec.route):
                            rollout.observe(candidate, sample)
                rollout.tick(clock.now(), min(run.canaries.values(), default=None))
                STEP.labels(spec.name).set(rollout.step + 1)
                if (rollout.phase, rollout.step) != saved:
                    self.pools.generation.bump("rollout")  # a phase or step change
                    await self._persist(run)
                    saved = (rollout.phase, rollout.step)
            if run.lost:  # another replica owns it now: it decides, this one follows
                if self.active.get(spec.route) is run:
                    self.active.pop(spec.route, None)
                return
            self.pools.generation.bump("rollout")  # promoted, rolled back or aborted
            if rollout.phase is Phase.PROMOTED:
                self.promoted[spec.route] = run
                self.active.pop(spec.route, None)
                await self._persist(run)
                await self._retire(run, spec.current.backend_model)
                await self._persist(run)
                STEP.labels(spec.name).set(len(spec.steps) + 1)
            else:
                STEP.labels(spec.name).set(-1)
                self.active.pop(spec.route, None)
                await self._persist(run)
                log.warning("rollout %s %s: %s", spec.name, rollout.phase, rollout.reason)
                await self._retire(run, spec.candidate.backend_model)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not leave the route diverted
            log.exception("rollout %s failed", spec.name)
            if rollout.phase in ACTIVE and rollout.phase is not Phase.PROMOTED:
                rollout.roll_back(clock.now(), f"internal error: {type(exc).__name__}")
            self.active.pop(spec.route, None)
            with contextlib.suppress(Exception):
                await self._persist(run)
        finally:
            if keeper is not None:
                keeper.cancel()
                if self.fleet is not None and not run.lost:
                    # Done, or this replica is stopping: another replica may take over at once.
                    await asyncio.shield(self.fleet.release(spec.route))
            for line in rollout.timeline[-1:]:
                log.info("rollout %s: %s", spec.name, line[1])

    async def _load(self, run: RolloutRun) -> None:
        spec, rollout = run.spec, run.rollout
        model = spec.candidate.backend_model
        for name in run.backends:
            client = self.pools.backends[name].client
            assert isinstance(client, RepositoryControl)
            try:
                await client.load_model(model, timeout_s=LOAD_TIMEOUT_S)
                index = await client.repository_index()
            except Exception as exc:  # Triton's reason (an allocation failure at load, ...)
                rollout.load_failed(clock.now(), str(exc))
                # A failed load leaves the model UNAVAILABLE in Triton's repository, and a
                # strict-readiness server reports itself not ready until it is unloaded: clean up.
                with contextlib.suppress(Exception):
                    await client.unload_model(model, timeout_s=LOAD_TIMEOUT_S)
                with contextlib.suppress(Exception):
                    await self.pools.backends[name].client.probe()
                return
            states = {(m, v): state for m, v, state in index}
            state = states.get((model, spec.candidate.version))
            if state != "READY":
                rollout.load_failed(
                    clock.now(),
                    f"Triton reports {model} version {spec.candidate.version} as {state or 'absent'} "
                    f"(manifest identity: the rollout declares that version)",
                )
                return
        rollout.loaded(clock.now())

    def _warmup_request(
        self, run: RolloutRun, shape_index: int, batched: bool
    ) -> service_pb2.ModelInferRequest:
        spec, route = run.spec, run.candidate_route
        shape = spec.warmup.shapes[shape_index]
        request = service_pb2.ModelInferRequest(
            model_name=spec.candidate.backend_model, model_version=spec.candidate.version
        )
        request.id = f"warmup-{spec.name}-{shape_index}"
        tensor = request.inputs.add()
        tensor.name = route.shape.tokens_input
        tensor.datatype = "INT32"
        dims = [shape.items, shape.input_tokens] if batched else [shape.input_tokens]
        tensor.shape.extend(dims)
        values = (np.arange(int(np.prod(dims)), dtype=np.int64) % 30_000).astype(np.int32)
        request.raw_input_contents.append(values.tobytes())
        if route.shape.output_limit_parameter:
            request.parameters[route.shape.output_limit_parameter].int64_param = shape.output_tokens
        return request

    async def _warm(self, run: RolloutRun) -> list[str]:
        """Every declared shape through the candidate on every backend; the problems found."""
        spec = run.spec
        problems: list[str] = []
        for name in run.backends:
            client = self.pools.backends[name].client
            try:
                model_spec = await client.model_spec(spec.candidate.backend_model, logical=spec.route)
            except GatewayError as exc:
                return [f"{spec.candidate.backend_model} on {name}: {exc.message}"]
            batched = model_spec.max_batch_size > 0
            try:
                current = await client.model_spec(spec.current.backend_model, logical=spec.route)
            except GatewayError:
                current = None
            if current is not None and model_spec.instances < current.instances:
                run.rollout.promotion_hold = (
                    f"{spec.candidate.backend_model} has {model_spec.instances} device(s) on backend "
                    f"{name!r}, {spec.current.backend_model} has {current.instances}: promoting it would "
                    "cut the route's capacity"
                )
            for index, shape in enumerate(spec.warmup.shapes):
                for _ in range(shape.repeat):
                    request = self._warmup_request(run, index, batched)
                    try:
                        if run.candidate_route.streaming:  # a decoupled model answers on a stream
                            response = await infer_streamed(client, request, timeout_s=spec.warmup.timeout_s)
                        else:
                            response = await client.infer(
                                request, timeout_s=spec.warmup.timeout_s, logical=spec.route
                            )
                    except GatewayError as exc:
                        return [
                            f"{shape.bucket} shape {shape.input_tokens}/{shape.output_tokens}: {exc.message}"
                        ]
                    found = check_outputs(
                        response,
                        run.output_checks,
                        items=shape.items,
                        input_tokens=shape.input_tokens,
                        output_tokens=shape.output_tokens,
                        batched=batched,
                    )
                    problems.extend(f"{shape.bucket} shape: {p}" for p in found)
            if problems:
                return problems
        return problems

    def _pools(self, backend_model: str) -> list[DispatchQueue]:
        return self.pools.queues_of_model(backend_model)

    def _sample_memory(self, run: RolloutRun) -> None:
        for queue in self._pools(run.spec.candidate.backend_model):
            room = queue.device_set.live_room_bytes * queue.device_set.devices
            if room and room != float("inf"):
                held = sum(slot.live_bytes for slot in queue.device_set.bound)
                run.rollout.observe_memory(held / room)
        MEMORY_HIGH_WATER.labels(run.name).set(run.rollout.memory_high_water)

    def quality_drop(self, spec: RolloutSpec) -> float:
        """The route's quality-evidence score for its current version minus the candidate's
        (published with ``evidence publish --model ROUTE --version LABEL``), on the route's
        population; evidence that is missing or expired scores 0."""
        route = self.routes.models[spec.route]
        fallback = self.routes.models.get(route.fallback) if route.fallback else None
        pop = population(route, fallback)
        now = clock.wall()

        def score(version: str) -> float:
            evidence = self.evidence.latest(EvidenceKey(spec.route, version, pop)) if self.evidence else None
            return judge(evidence, floor=0.0, now=now).score

        return score(route.version) - score(spec.candidate.name)

    def _busy(self, backend_model: str, now: float) -> bool:
        """Work on ``backend_model``'s pools: this replica's in flight or queued, and in a fleet
        the other replicas' bound there (their slot leases, as the last load exchange read them)."""
        for queue in self._pools(backend_model):
            if queue.inflight or queue.queued:
                return True
            if any(end > now for end in queue.device_set.remote_ends.get(queue.name, ())):
                return True
        return False

    async def _retire(self, run: RolloutRun, backend_model: str) -> None:
        """Wait for ``backend_model``'s in-flight and queued work (and mirrors) to drain, then
        unload it: the measured time until it could safely be removed is the report's."""
        rollout = run.rollout
        began = clock.now()
        idle_since: float | None = None
        # Drained: no work in its pools' queues or slots (and no mirror) for QUIET_S on end, so
        # a request admitted just before the switch, on its way to the queue, is counted. The
        # time reported is when that is confirmed: when the version may safely be removed. In a
        # fleet the other replicas switch at their next watcher round (FLEET_QUIET_S), and their
        # bound work counts too: unloaded sooner, a follower still routing to it between the
        # owner's switch and its own found no warm backend (25 requests refused in one run).
        quiet_s = QUIET_S if self.fleet is None else FLEET_QUIET_S
        while True:
            now = clock.now()
            busy = self._busy(backend_model, now) or (
                backend_model == run.spec.candidate.backend_model and bool(run.mirrors)
            )
            if busy:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= quiet_s:
                break
            if now - began > run.spec.drain.max_wait_s:
                rollout.timeline.append(
                    (now, f"{backend_model} still busy after {run.spec.drain.max_wait_s:g} s: left loaded")
                )
                return
            await asyncio.sleep(0.005)
        rollout.retired_drained(clock.now())  # its work ended QUIET_S ago: now it is safe
        started = clock.now()
        for name in run.backends:
            client = self.pools.backends[name].client
            assert isinstance(client, RepositoryControl)
            try:
                await client.unload_model(backend_model, timeout_s=LOAD_TIMEOUT_S)
            except Exception as exc:
                rollout.timeline.append((clock.now(), f"unloading {backend_model} on {name} failed: {exc}"))
                return
        rollout.retired_unloaded(clock.now(), clock.now() - started)

    # ------------------------------------------------------------------ the request path

    def _facts(self, record_class: str, shape: Shape, tenant: str, risk_class: str) -> RequestFacts:
        return RequestFacts(
            request_class=record_class, bucket=shape.bucket, tenant=tenant, risk_class=risk_class
        )

    async def divert(
        self,
        logical: str,
        route: RouteConfig,
        tenant: Tenant,
        *,
        request_class: str,
        shape: Shape,
        risk_class: str,
        cell: str,
        mode: Mode,
        canary: bool,
        current_pool: tuple[BackendHandle, DispatchQueue] | None = None,
        price: Pricer | None = None,
    ) -> Diverted | None:
        """Which version serves this request, if not the route's current one. A canary only when
        the request is privacy-eligible (not a dedicated tenant's, the candidate warm in its
        cell), in a declared cohort and chosen by the step's weight, the candidate has an
        idle device (it never waits behind, or makes the caller wait for, the rollout), and
        the hedge fits: ``price`` prices the request on the current version in
        ``current_pool`` and on the candidate, and the candidate's predicted execution must
        fit the budget that still leaves the current version time to answer
        (``core.rollout.hedge_budget_ms``); the canary runs under that budget."""
        run = self.promoted.get(logical) or self.active.get(logical)
        if run is None:
            return None
        rollout = run.rollout
        if mode not in CANARY_MODES and not rollout.serving:
            return None  # canaries are online calls, unary or streamed (never async or batch work)
        if route.backend_model != (run.spec.candidate if rollout.serving else run.spec.current).backend_model:
            return None
        if not rollout.serving and not (canary and rollout.phase is Phase.CANARY):
            return None
        if tenant.config.dedicated:
            return None
        if not rollout.serving:
            facts = self._facts(request_class, shape, tenant.name, risk_class)
            if not rollout.divert(facts):
                return None
        try:
            handle, _spec, queue = await self.pools.place(run.candidate_route, cell, logical)
        except Unavailable:
            return None
        if not handle.client.is_warm(run.spec.candidate.backend_model):
            return None
        if rollout.serving:
            return Diverted(run.candidate_route, handle, queue, run.spec.candidate.name, "")
        if queue.inflight >= queue.devices or queue.queued:
            return None  # no idle device: the current version serves it
        budget_ms: float | None = None
        if price is not None and current_pool is not None:
            current = price(route, *current_pool)
            candidate = price(run.candidate_route, handle, queue)
            # A stream's hedge covers its first result (its slack is the first result's).
            exec_ms = (
                candidate.budget.reserve_first_result_ms
                if candidate.budget.streaming
                else candidate.budget.reserve_exec_ms
            )
            budget_ms = hedge_budget_ms(current.budget.slack_ms, exec_ms, run.spec.hedge.reserve_ms)
            if budget_ms is None:
                return None  # the current version could not answer after a late candidate
        rollout.diverted += 1
        return Diverted(run.candidate_route, handle, queue, run.spec.candidate.name, CANARY_REASON, budget_ms)

    def promoted_route(self, logical: str, route: RouteConfig) -> RouteConfig:
        """The route as it runs now: a promoted rollout's candidate in place of its current
        version (a dedicated tenant's own backend model is left alone)."""
        run = self.promoted.get(logical) or self.active.get(logical)
        if run is None or not run.rollout.serving or route.backend_model != run.spec.current.backend_model:
            return route
        return run.candidate_route

    def _run_for(self, record: RequestRecord) -> RolloutRun | None:
        return self.active.get(record.identity.model)

    def settled(self, admitted: Admitted, settled: Settled, response: service_pb2.ModelInferResponse) -> None:
        """A finished request: a sample for its version if the step compares its cohort (a
        canary's answer reaches here only once ``candidate_answered`` found it valid)."""
        canary = self._canary_run(admitted)
        if canary is not None:  # a stream's outcome arrives here (a unary canary's already did)
            canary.canaries.pop(admitted.record.identity.request_id, None)
        run = self._run_for(admitted.record)
        if run is None or admitted.decision.verdict is not Verdict.ADMIT:
            return
        record, outcome = admitted.record, settled.outcome
        facts = self._facts(
            record.identity.request_class, record.shape, record.identity.tenant, record.identity.risk_class
        )
        candidate = admitted.route.backend_model == run.spec.candidate.backend_model
        if not candidate and (
            admitted.route.backend_model != run.spec.current.backend_model or not run.rollout.in_cohort(facts)
        ):
            return
        # Latency from dispatch (the gateway's queue is not the version's doing; a canary is only
        # diverted to an idle candidate), the deadline end to end.
        sample = Sample(
            first_result_ms=outcome.first_result_ms,
            completion_ms=outcome.completion_ms,
            missed_deadline=missed(record, outcome.queue_ms, outcome.first_result_ms, outcome.completion_ms),
            bucket=record.shape.bucket,
        )
        self._observe(run, candidate, sample)

    def _observe(self, run: RolloutRun, candidate: bool, sample: Sample) -> None:
        version = run.spec.candidate.name if candidate else run.spec.current.name
        outcome = (
            "error"
            if sample.error
            else "timed_out"
            if sample.timed_out
            else "invalid_output"
            if sample.invalid_output
            else "fell_back"
            if sample.fell_back
            else "late"
            if sample.missed_deadline
            else "ok"
        )
        REQUESTS.labels(run.name, version, outcome).inc()
        if not sample.error:
            LATENCY.labels(run.name, version, "first_result").observe(sample.first_result_ms / 1000.0)
            LATENCY.labels(run.name, version, "completion").observe(sample.completion_ms / 1000.0)
        if run.follower:
            if self.fleet is not None and run.rollout.phase in (Phase.SHADOW, Phase.CANARY):
                self.fleet.report(run.spec.route, candidate, sample)  # the owner judges
            return
        before = (run.rollout.phase, run.rollout.step)
        run.rollout.observe(candidate, sample)
        if (run.rollout.phase, run.rollout.step) != before:
            self.pools.generation.bump("rollout")

    def _canary_run(self, admitted: Admitted) -> RolloutRun | None:
        """The rollout this admitted request is a canary of. Found by the admission's route
        reason, not by the rollout still running: a canary in flight when its rollout rolls
        back (another canary's failure) is still hedged."""
        if admitted.decision.route_reason != CANARY_REASON:
            return None
        logical = admitted.record.identity.model
        for run in reversed(self.runs.values()):
            if run.spec.route == logical and run.spec.candidate.backend_model == admitted.route.backend_model:
                return run
        return None

    def dispatched(self, admitted: Admitted, started: float) -> None:
        """A canary is on its way to the candidate: the step waits for its outcome."""
        run = self._canary_run(admitted)
        if run is not None:
            run.canaries[admitted.record.identity.request_id] = started

    def _hedge(self, run: RolloutRun, why: str, device_ms: float) -> None:
        run.rollout.hedge(why, device_ms)
        HEDGED.labels(run.name, why).inc()
        HEDGE_DEVICE.labels(run.name).inc(max(0.0, device_ms) / 1000.0)

    def candidate_failed(
        self, admitted: Admitted, error: BaseException, *, started: float, now: float
    ) -> bool:
        """A canary's backend call failed or ran out of its budget. True: the request is to be
        answered by the current version instead (the caller never sees the candidate's
        failure; the caller's own deadline still leaves it time, by the hedge's budget).

        A timeout or a cancellation (the candidate's budget passed) is a failing sample
        (``timed_out``) like an error, in the request's shape bucket; an allocation failure
        rolls back at once. A caller that went away (not a ``GatewayError``) is no outcome."""
        run = self._canary_run(admitted)
        if run is None:
            return False
        run.canaries.pop(admitted.record.identity.request_id, None)
        if not isinstance(error, GatewayError):
            return False
        timed_out = error.status in ("CANCELLED", "DEADLINE_EXCEEDED")
        held_ms = (now - started) * 1000.0
        sample = Sample(
            held_ms,
            held_ms,
            missed_deadline=timed_out,
            error=not timed_out,
            timed_out=timed_out,
            fell_back=True,
            bucket=admitted.record.shape.bucket,
        )
        self._observe(run, True, sample)
        self._hedge(run, "timeout" if timed_out else "error", held_ms)
        # The backend's own words (the caller's message is sanitized; the cause keeps them).
        details = getattr(error.__cause__, "details", None)
        detail = str(details() if callable(details) else error.message)
        if ALLOCATION_FAILURE in detail.lower() and run.rollout.phase in (Phase.SHADOW, Phase.CANARY):
            self.pools.generation.bump("rollout")
            run.rollout.roll_back(
                now, f"allocation failure on {run.spec.candidate.backend_model}: {detail[:200]}"
            )
        if now >= admitted.deadline_at:  # no time left for the current version at all
            self.hedge_unanswered(admitted, error)
            return False
        return True

    def hedge_unanswered(self, admitted: Admitted, error: BaseException) -> None:
        """A hedged canary whose current-version answer failed too (its caller got an error:
        the deadline, a refusal at re-admission). Reported and logged; it should stay 0."""
        run = self._canary_run(admitted)
        if run is not None:
            run.rollout.hedge_unanswered += 1
            HEDGED.labels(run.name, "unanswered").inc()
            remaining_ms = (admitted.deadline_at - clock.now()) * 1000.0
            log.warning(
                "rollout %s: a hedged %s canary was not answered by the current version either "
                "(%.0f ms of its deadline left): %s",
                run.name,
                admitted.record.shape.bucket,
                remaining_ms,
                getattr(error, "message", None) or type(error).__name__,
            )

    def candidate_answered(
        self, admitted: Admitted, response: service_pb2.ModelInferResponse, *, started: float, now: float
    ) -> bool:
        """A canary's answer, checked against the rollout's declared outputs (and the route's
        contract) before it may leave. False: it is invalid, a failing sample, and the
        request is to be answered by the current version; the caller never sees it."""
        run = self._canary_run(admitted)
        if run is None:
            return True
        run.canaries.pop(admitted.record.identity.request_id, None)
        record = admitted.record
        problems = check_outputs(
            response,
            run.output_checks,
            items=record.shape.items,
            input_tokens=record.shape.input_tokens,
            output_tokens=admitted.decision.max_output_tokens or record.shape.max_output_tokens,
            batched=admitted.route.shape.items_dim is not None,
        )
        if not problems:
            return True
        held_ms = (now - started) * 1000.0
        self._observe(
            run,
            True,
            Sample(held_ms, held_ms, invalid_output=True, fell_back=True, bucket=record.shape.bucket),
        )
        self._hedge(run, "invalid_output", held_ms)
        INVALID_OUTPUTS.labels(record.identity.model, run.spec.candidate.name, "hedged").inc()
        log.info(
            "rollout %s: invalid canary answer re-answered by the current version: %s", run.name, problems[0]
        )
        return False  # never returned, even when too late for the current version to answer

    def candidate_result(
        self, admitted: Admitted, response: service_pb2.ModelInferResponse, *, started: float, now: float
    ) -> bool:
        """One result of a streaming canary, checked before it may leave: each output's
        datatype and value range against the declared outputs (a partial result is not the
        whole answer's shape). False: it is invalid, a failing sample, and the stream ends for
        the candidate (``gateway.streams`` answers again from the current version when nothing
        was sent yet). True for anything that is not a canary."""
        run = self._canary_run(admitted)
        if run is None or not run.output_checks:
            return True
        problems = check_result(response, run.output_checks)
        if not problems:
            return True
        run.canaries.pop(admitted.record.identity.request_id, None)
        held_ms = (now - started) * 1000.0
        bucket = admitted.record.shape.bucket
        self._observe(run, True, Sample(held_ms, held_ms, invalid_output=True, fell_back=True, bucket=bucket))
        self._hedge(run, "invalid_output", held_ms)
        INVALID_OUTPUTS.labels(admitted.record.identity.model, run.spec.candidate.name, "hedged").inc()
        log.info("rollout %s: invalid streaming canary result withheld: %s", run.name, problems[0])
        return False

    def mirror(self, admitted: Admitted, tenant: Tenant) -> bool:
        """The shadow step: mirror a matching, privacy-eligible request to the warm candidate,
        off the caller's path, at most one at a time; its latency and
        output are samples for the candidate, its answer is discarded. True: a rollout (running
        or promoted) owns this route, so the route's own ``shadow`` stays off."""
        logical = admitted.record.identity.model
        if logical in self.promoted:
            return True
        run = self._run_for(admitted.record)
        if run is None:
            return False
        if run.rollout.phase is not Phase.SHADOW or tenant.config.dedicated:
            return True
        record = admitted.record
        if admitted.route.backend_model != run.spec.current.backend_model:
            return True
        facts = self._facts(
            record.identity.request_class, record.shape, tenant.name, record.identity.risk_class
        )
        cell = record.identity.privacy_cell
        for name in self.pools.candidate_backends(run.candidate_route, cell):
            client = self.pools.backends[name].client
            if client.is_warm(run.spec.candidate.backend_model):
                break
        else:
            return True
        if run.shadow_inflight >= 1 or not run.rollout.shadow(facts):
            return True
        request = service_pb2.ModelInferRequest()
        request.CopyFrom(admitted.backend_request)
        request.model_name = run.spec.candidate.backend_model
        request.model_version = run.spec.candidate.version
        remaining_s = admitted.deadline_at - clock.now()
        if remaining_s <= 0:
            return True
        run.shadow_inflight += 1
        run.rollout.shadowed += 1
        task = asyncio.get_running_loop().create_task(self._shadow(run, client, request, remaining_s, record))
        run.mirrors.add(task)
        task.add_done_callback(run.mirrors.discard)
        return True

    async def _shadow(
        self,
        run: RolloutRun,
        client: object,
        request: service_pb2.ModelInferRequest,
        timeout_s: float,
        record: RequestRecord,
    ) -> None:
        started = clock.now()
        try:
            if run.candidate_route.streaming:  # a decoupled model answers on a stream
                response = await infer_streamed(cast(Backend, client), request, timeout_s=timeout_s)
            else:
                response = await client.infer(request, timeout_s=timeout_s, logical=record.identity.model)  # type: ignore[attr-defined]
        except GatewayError as exc:
            ms = (clock.now() - started) * 1000.0
            timed_out = exc.status in ("CANCELLED", "DEADLINE_EXCEEDED")
            self._observe(
                run,
                True,
                Sample(ms, ms, error=not timed_out, timed_out=timed_out, bucket=record.shape.bucket),
            )
            return
        finally:
            run.shadow_inflight -= 1
        ms = (clock.now() - started) * 1000.0
        invalid = bool(
            check_outputs(
                response,
                run.output_checks,
                items=record.shape.items,
                input_tokens=record.shape.input_tokens,
                output_tokens=record.shape.max_output_tokens,
                batched=run.candidate_route.shape.items_dim is not None,
            )
        )
        # The mirror starts when the caller's request is dispatched: its backend time compares
        # with the current version's dispatch-to-completion samples.
        if invalid:
            INVALID_OUTPUTS.labels(record.identity.model, run.spec.candidate.name, "discarded").inc()
        self._observe(
            run,
            True,
            Sample(
                ms,
                ms,
                missed_deadline=ms > record.budget.deadline_ms,
                invalid_output=invalid,
                bucket=record.shape.bucket,
            ),
        )

    # ------------------------------------------------------------------ status

    def report(self, name: str) -> dict[str, object]:
        return self.run_named(name).rollout.report()
