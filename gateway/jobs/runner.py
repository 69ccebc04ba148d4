"""The job runner: queued items through the gateway's own request path, in capacity troughs.

Owns the loop that turns stored items into inference: it claims ready items from the store
(with a lease, renewed while they run), paces them per pool so job work fills only the
capacity interactive work leaves under the protected envelope
(``gateway.core.jobs.TroughPacer``), runs each through ``Gateway.infer_request`` - the same
record, policy, quota, dispatch queue and charge as online work, in the job's class and
with mode ``async``/``batch`` - validates the output, and records it (and its charge) once.

Step 4 of a pool's ladder (``defer_batch``) *defers* job work: nothing new starts, and an
attempt the ladder refused between the check and admission goes back to the queue without
counting as an attempt. It resumes when the step comes down. Cancellation stops running
attempts at the backend (the request path releases their slot and quota reservation).
The runner also expires operations past their complete-by time and deletes results past
retention. It logs operation ids and counts only, never requests, outputs or custom ids.

It polls only while there is work: every ``jobs.poll_s`` while items run or wait ready (paced
out, deferred: a load dip or the step coming down must start them soon). With nothing ready
or running it sleeps until the store's next due time (``JobStore.next_due``: a backoff
ending, a lost lease, an expiry or purge), at most ``jobs.idle_poll_s`` (work another replica
submitted to a shared store), and this gateway's submissions wake it at once (``wake``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from dataclasses import dataclass

from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.config import JobsConfig
from gateway.core.errors import GatewayError, PermissionDenied
from gateway.core.jobs import (
    AttemptAction,
    DeclaredOutput,
    JobLimits,
    Kind,
    TroughPacer,
    after_attempt,
    classify,
    validate_outputs,
)
from gateway.core.load import PoolLoad
from gateway.core.overload import DEFAULT_PLAN_SPAN_S
from gateway.core.overload import effects as overload_effects
from gateway.core.record import Mode
from gateway.exchange import CallContext
from gateway.features.historical import AS_OF_PARAMETER
from gateway.jobs.batch import output_facts, provenance
from gateway.jobs.store import Claimed, JobStore
from gateway.pipeline import Gateway
from gateway.status import domain_error

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 0.5  # busy: expiry, purge, lost leases and cancels checked this often
ERROR_BOUND = 512  # characters of an attempt's error kept with the item


def limits_of(config: JobsConfig) -> JobLimits:
    return JobLimits(
        max_queued_per_tenant=config.max_queued_per_tenant,
        max_payload_bytes=config.max_payload_bytes,
        max_batch_items=config.max_batch_items,
        default_complete_within_s=config.default_complete_within_s,
        max_complete_within_s=config.max_complete_within_s,
        max_attempts=config.max_attempts,
        backoff_base_s=config.backoff_base_s,
        backoff_max_s=config.backoff_max_s,
        result_retention_s=config.result_retention_s,
    )


class Changes:
    """Wakes ``Wait`` streams when any operation may have changed."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def bump(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)


@dataclass(slots=True)
class _Running:
    item: Claimed
    pool: str
    task: asyncio.Task[None] | None = None
    cancel_reason: str = ""  # "cancel": the operation was cancelled; "stop": the runner stops
    estimate_ms: float = 0.0


@dataclass(slots=True)
class _PoolPacing:
    pacer: TroughPacer
    mean_ms: float = 0.0  # running mean of an item's charged accelerator-ms on this pool
    running: int = 0


class JobRunner:
    def __init__(self, gateway: Gateway, store: JobStore, config: JobsConfig) -> None:
        self.gateway = gateway
        self.store = store
        self.config = config
        self.limits = limits_of(config)
        self.changes = Changes()
        self.wake = asyncio.Event()
        self.replica = uuid.uuid4().hex[:12]
        self._running: dict[str, _Running] = {}  # by claim
        self._pacing: dict[str, _PoolPacing] = {}
        self._declared: dict[str, tuple[DeclaredOutput, ...]] = {}
        self._task: asyncio.Task[None] | None = None
        self._housekept_at = 0.0
        # Wall time the store's housekeeping is next due, set by an idle pass (0.0: every
        # HOUSEKEEPING_S, as while busy; inf: nothing stored will fall due).
        self._housekeeping_due_at = 0.0
        self.next_wait_s = 0.0  # the wait the last pass chose (poll_s, or up to idle_poll_s)
        self._turn = 0  # launches so far: which (tenant, model) goes first next
        self._renewed_at = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="jobs-runner")

    async def stop(self) -> None:
        """Stop taking items; running attempts are cancelled and their items released to the
        queue (not counted: the gateway stopped, not the item)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        running = list(self._running.values())
        for entry in running:
            entry.cancel_reason = "stop"
            if entry.task is not None:
                entry.task.cancel()
        await asyncio.gather(*(e.task for e in running if e.task is not None), return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            # Cleared before the pass reads the store: a submission stored during the pass
            # (its wake set after the read) ends the wait that follows instead of being lost.
            self.wake.clear()
            wait_s = self.config.poll_s
            try:
                wait_s = await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the loop must survive; the store or a bug said no
                domain_error(error, where="jobs runner")
            self.next_wait_s = wait_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), wait_s)

    async def _tick(self) -> float:
        """One pass: housekeeping when due, lease renewal, starting what may start. Returns the
        seconds to wait before the next pass (``wake`` cuts it short): ``poll_s`` while items
        run or wait ready, else until the store next has something due (``_idle_wait_s``)."""
        wall, now = clock.wall(), clock.now()
        due_at, self._housekeeping_due_at = self._housekeeping_due_at, 0.0
        if now - self._housekept_at >= HOUSEKEEPING_S and wall >= due_at:
            self._housekept_at = now
            changed = await asyncio.to_thread(self.store.reclaim_lost, now=wall)
            expired = await asyncio.to_thread(self.store.expire_due, now=wall)
            purged = await asyncio.to_thread(self.store.purge_due, now=wall)
            for op_id in expired:
                log.info("operation %s expired: complete-by passed", op_id)
            for op_id in purged:
                log.info("operation %s: results deleted after retention", op_id)
            if changed or expired or purged:
                self.changes.bump()
            await self._check_cancels()
        if self._running and now - self._renewed_at >= self.config.lease_s / 3:
            self._renewed_at = now
            await asyncio.to_thread(
                self.store.renew, list(self._running), lease_until=wall + self.config.lease_s
            )
        if len(self._running) >= self.config.max_inflight:
            return self.config.poll_s
        ready = await asyncio.to_thread(self.store.ready_models, now=wall)
        held = bool(ready)  # ready now: what is not started here waits for the pacer, briefly
        if ready:  # round robin: one item per (tenant, model) per pass, the next one first
            turn = self._turn % len(ready)
            ready = ready[turn:] + ready[:turn]
        while ready and len(self._running) < self.config.max_inflight:
            for tenant, model in list(ready):
                if len(self._running) >= self.config.max_inflight:
                    break
                pool = self._may_start(tenant, model, now)
                item = None
                if pool is not None:
                    item = await asyncio.to_thread(
                        self.store.claim,
                        tenant=tenant,
                        model=model,
                        claim=f"{self.replica}:{uuid.uuid4().hex}",
                        now=clock.wall(),
                        lease_until=clock.wall() + self.config.lease_s,
                    )
                if pool is None or item is None:
                    ready.remove((tenant, model))  # paced out or nothing left: not this tick
                    continue
                self._launch(item, pool)
                self._turn += 1
        if held or self._running:
            return self.config.poll_s
        return await self._idle_wait_s()

    async def _idle_wait_s(self) -> float:
        """Nothing ready, nothing running: the wait until the store's next due time (a backoff
        ending; housekeeping's work, no sooner than its period allows), at most
        ``idle_poll_s``, at least ``poll_s``. Until that time housekeeping is skipped."""
        due = await asyncio.to_thread(self.store.next_due)
        wall, now = clock.wall(), clock.now()
        wait_s = self.config.idle_poll_s
        if due.ready_at is not None:
            wait_s = min(wait_s, due.ready_at - wall)
        if due.housekeeping_at is None:
            self._housekeeping_due_at = math.inf
        else:
            self._housekeeping_due_at = due.housekeeping_at
            period_left_s = self._housekept_at + HOUSEKEEPING_S - now
            wait_s = min(wait_s, max(due.housekeeping_at - wall, period_left_s))
        return max(wait_s, self.config.poll_s)

    # ------------------------------------------------------------------ pacing

    def _pool_load(self, tenant: str, model: str) -> PoolLoad | None:
        who = self.gateway.tenants.tenants.get(tenant)
        if who is None:
            return None
        try:
            route = self.gateway.tenant_route(who, model)
        except GatewayError:
            return None
        loads = [
            load
            for name, load in self.gateway.loads.items()
            if name.rsplit("/", 1)[-1] == route.backend_model
        ]
        return min(loads, key=lambda load: load.utilization()) if loads else None

    def _may_start(self, tenant: str, model: str, now: float) -> str | None:
        """The pool an item of (tenant, model) may start on now, or None to wait. Before the
        pool has evidence (its first requests) items go one at a time."""
        load = self._pool_load(tenant, model)
        name = load.name if load is not None else f"?{tenant}/{model}"
        pacing = self._pacing.get(name)
        if pacing is None:
            pacing = self._pacing[name] = _PoolPacing(TroughPacer(fill=self.config.trough_fill))
        if load is not None and overload_effects(load.step).defer_batch:
            return None  # ladder step 4+: deferred, stays queued
        if load is None or load.evidence is None:
            return name if pacing.running == 0 else None
        other = sum(
            flow.demand.reading(now, DEFAULT_PLAN_SPAN_S).offered_ms_per_s
            for key, flow in load.flows.items()
            if key[0] not in self.config.classes
        )
        pacing.pacer.refill(
            now, protected_ms_per_s=load.evidence.protected_capacity_ms_per_s, other_ms_per_s=other
        )
        queue = self.gateway.queue_named(load.name)
        idle = queue is None or (queue.queued == 0 and queue.inflight < queue.devices)
        return (
            name if pacing.pacer.may_start(deferred=False, running=pacing.running, device_idle=idle) else None
        )

    def _launch(self, item: Claimed, pool: str) -> None:
        pacing = self._pacing[pool]
        entry = _Running(item, pool, estimate_ms=pacing.mean_ms)
        pacing.pacer.spend(pacing.mean_ms)
        pacing.running += 1
        self._running[item.claim] = entry
        entry.task = asyncio.get_running_loop().create_task(self._attempt(entry), name="jobs-item")
        self.changes.bump()

    def _settle_pacing(self, entry: _Running, used_ms: float | None) -> None:
        pacing = self._pacing[entry.pool]
        pacing.running -= 1
        if used_ms is None:
            pacing.pacer.spend(-entry.estimate_ms)  # it never ran: give the estimate back
            return
        pacing.pacer.spend(used_ms - entry.estimate_ms)
        pacing.mean_ms = used_ms if pacing.mean_ms == 0.0 else 0.8 * pacing.mean_ms + 0.2 * used_ms

    # ------------------------------------------------------------------ one attempt

    async def _declared_outputs(self, model: str) -> tuple[DeclaredOutput, ...] | None:
        """The outputs the answering model's metadata declares (None: no backend told us;
        the response is then checked for consistency only)."""
        known = self._declared.get(model)
        if known is not None:
            return known
        route = self.gateway.routes.models.get(model)
        if route is None:
            return None
        for handle in self.gateway.backends.values():
            if not handle.client.healthy:
                continue
            try:
                metadata = await handle.client.metadata(route.backend_model, route.version)
            except Exception:  # another backend may know it; none: consistency checks only
                continue
            outputs = tuple(DeclaredOutput(o.name, o.datatype, tuple(o.shape)) for o in metadata.outputs)
            self._declared[model] = outputs
            return outputs
        return None

    async def _attempt(self, entry: _Running) -> None:
        item = entry.item
        used: float | None = None
        try:
            try:
                response = await self._infer(item)
            except asyncio.CancelledError:
                if entry.cancel_reason == "cancel":
                    await asyncio.to_thread(self.store.cancelled_attempt, item, now=clock.wall())
                elif entry.cancel_reason == "stop":
                    await asyncio.to_thread(self._release, item)
                raise
            except Exception as exc:
                error = domain_error(exc, where="jobs item")
                action = classify(error.status, error.rule or "")
                result = after_attempt(
                    action,
                    item.attempts,
                    self.limits,
                    now=clock.wall(),
                    retry_after_s=(error.retry_after_ms or 0) / 1000.0,
                )
                await asyncio.to_thread(
                    self.store.failed_attempt,
                    item,
                    result,
                    error=f"{error.status}: {error.message}"[:ERROR_BOUND],
                    now=clock.wall(),
                )
                return
            facts = provenance(response)
            # The pacer is spent by the work the item did (its charge: observed device time),
            # which is what the interactive work it shares the pool with is measured in too.
            used = _float(facts.get("orchid.charged_accelerator_ms"))
            declared = await self._declared_outputs(response.model_name or item.model)
            problem = validate_outputs(output_facts(response), declared or ())
            if problem is not None:
                result = after_attempt(AttemptAction.RETRY, item.attempts, self.limits, now=clock.wall())
                await asyncio.to_thread(
                    self.store.failed_attempt,
                    item,
                    result,
                    error=f"invalid output: {problem}"[:ERROR_BOUND],
                    now=clock.wall(),
                )
                return
            await asyncio.to_thread(
                self.store.complete,
                item,
                response=response.SerializeToString(),
                provenance=facts,
                charged_ms=_float(facts.get("orchid.charged_accelerator_ms")) or 0.0,
                now=clock.wall(),
            )
        finally:
            self._running.pop(item.claim, None)
            self._settle_pacing(entry, used)
            self.changes.bump()
            self.wake.set()

    def _release(self, item: Claimed) -> None:
        """Back to the queue, not counted (the runner is stopping)."""
        self.store.release(item, now=clock.wall())

    async def _infer(self, item: Claimed) -> service_pb2.ModelInferResponse:
        tenant = self.gateway.tenants.tenants.get(item.tenant)
        if tenant is None:
            raise PermissionDenied("the operation's credential is no longer configured")
        request = service_pb2.ModelInferRequest.FromString(item.request)
        request.parameters["orchid.class"].string_param = item.request_class
        request.parameters["orchid.operation_id"].string_param = item.op_id
        if item.feature_as_of is not None:  # a snapshot batch: features as of its time
            request.parameters[AS_OF_PARAMETER].double_param = item.feature_as_of
        call = CallContext(metadata=(), time_remaining_s=self.config.item_deadline_s, received_at=clock.now())
        mode = Mode.BATCH if item.kind is Kind.BATCH else Mode.ASYNC
        return await self.gateway.infer_request(request, tenant, call, mode=mode)

    # ------------------------------------------------------------------ cancellation

    async def cancel_running(self, op_seq: int) -> None:
        """Stop this operation's running attempts (the store already marked it cancelled)."""
        for entry in list(self._running.values()):
            if entry.item.op_seq == op_seq and entry.task is not None:
                entry.cancel_reason = "cancel"
                entry.task.cancel()

    async def _check_cancels(self) -> None:
        seqs = sorted({e.item.op_seq for e in self._running.values()})
        if not seqs:
            return
        for seq in await asyncio.to_thread(self.store.cancel_requested, seqs):
            await self.cancel_running(seq)


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
