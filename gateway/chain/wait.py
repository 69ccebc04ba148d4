"""Stage 8, wait: an admitted request waits for a dispatch slot in its pool, with late rescue.

Owns the wait in the pool's dispatch queue, in the request's class's and tenant's share
(``gateway.scheduler``), what a request brings to a co-batch, and the start of its
execution (quota marks it running; the pool's ladder gets its dwell sample). A request
whose latest start passes in the queue is rescued once: decided again with its primary
counted as too late (``admission.too_late``), it runs on the warm fallback if policy
allows and it can still finish in time; otherwise the caller gets the late refusal. A
request already on its fallback is not decided again. ``undo`` releases the slot.

It may hold slots and start quota; it may not judge policy or call a backend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gateway import clock
from gateway.config import GatewayConfig
from gateway.core.dispatch import BatchShape
from gateway.core.dwell import dwell_sample_ms
from gateway.core.errors import DeadlineExpired, GatewayError
from gateway.core.record import Mode, Verdict
from gateway.exchange import Admitted
from gateway.pools import PoolRegistry
from gateway.scheduler import Slot
from gateway.state.base import QuotaStore

Readmit = Callable[[Admitted], Awaitable[Admitted]]


class Wait:
    """Dispatch slots for admitted requests."""

    def __init__(
        self,
        config: GatewayConfig,
        pools: PoolRegistry,
        quotas: QuotaStore,
        tenants_weight: Callable[[str], float],
    ) -> None:
        self.config = config
        self.pools = pools
        self.quotas = quotas
        self._weight = tenants_weight

    async def acquire(self, admitted: Admitted) -> Slot:
        """Wait for a dispatch slot in the admitted request's pool, in its class's and tenant's share."""
        identity = admitted.record.identity
        request_class = self.config.classes.get(identity.request_class)
        stream = identity.mode is Mode.STREAMING
        return await admitted.queue.acquire(
            latest_start=admitted.received_at + admitted.record.budget.latest_start_ms / 1000.0,
            cost_ms=admitted.record.demand.accelerator_ms,
            request_class=identity.request_class,
            tenant=identity.tenant,
            weight=self._weight(identity.tenant),
            class_weight=request_class.weight if request_class else 1.0,
            long=admitted.record.shape.long,
            # A stream holds its prompt's live state from the start and grows it by its tokens
            # (``Slot.grow_live``); other work holds its peak for its whole run.
            live_bytes=prompt_live_bytes(admitted) if stream else admitted.record.demand.peak_memory_bytes,
            batch=self.batch_shape(admitted),
            stream=stream,
        )

    async def run(self, admitted: Admitted, readmit: Readmit) -> tuple[Admitted, Slot]:
        """A slot for ``admitted``, or for its late rescue (``readmit``); what is returned holds
        its reservation and the slot. On any failure the reservation is refunded."""
        try:
            return admitted, await self.acquire(admitted)
        except DeadlineExpired as late:  # its latest start passed in the queue: the fallback?
            self.quotas.release(admitted.reservation, now=clock.now())
            if admitted.decision.verdict is not Verdict.ADMIT or admitted.route.fallback is None:
                raise
            try:
                rescued = await readmit(admitted)
            except GatewayError:
                raise late from None
        except BaseException:  # never ran (queue full, caller gone): refund all
            self.quotas.release(admitted.reservation, now=clock.now())
            raise
        try:
            return rescued, await self.acquire(rescued)
        except BaseException:
            self.quotas.release(rescued.reservation, now=clock.now())
            raise

    def started(self, admitted: Admitted, *, dwell_ms: float, now: float) -> None:
        """The request leaves the queue and runs: quota marks it running, its pool's ladder
        gets the dwell sample, judged against the request's own class's cap."""
        self.quotas.start(admitted.reservation, now=now)
        load = self.pools.loads.get(admitted.queue.name)
        if load is not None:
            request_class = self.config.classes.get(admitted.record.identity.request_class)
            cap_ms = request_class.max_dwell_ms if request_class is not None else load.dwell_budget_ms
            load.dwell.add(
                now, dwell_sample_ms(dwell_ms, class_cap_ms=cap_ms, budget_ms=load.dwell_budget_ms)
            )

    @staticmethod
    def batch_shape(admitted: Admitted) -> BatchShape | None:
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


def token_live_bytes(admitted: Admitted) -> int:
    """Live state one token of the request holds on its device (its peak over its tokens)."""
    shape = admitted.record.shape
    tokens = shape.input_tokens + shape.max_output_tokens
    return admitted.record.demand.peak_memory_bytes // tokens if tokens > 0 else 0


def prompt_live_bytes(admitted: Admitted) -> int:
    """Live state a stream holds once its prompt is prefilled."""
    return token_live_bytes(admitted) * admitted.record.shape.input_tokens
