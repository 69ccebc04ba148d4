"""Stage 10, settle: charge observed work, teach the estimator, build provenance.

Owns what happens once per request when it ends: the observed charge (backend time
less the time it waited in Triton's own queue, shared with the batch it ran in),
settling its quota reservation with it, the estimator's lesson, the outcome and the
stage times the listener and provenance report; and ``abandon``: a request that failed
or was cancelled settles by what it held, or is refunded. A stream settles once, at
its end or at its cancellation, never per token.

It may write quota and the estimator; it may not place, judge or call a backend.
"""

from __future__ import annotations

from gateway.core import settlement
from gateway.core.dispatch import CoBatch
from gateway.core.estimate import Estimator
from gateway.exchange import Admitted, Settled, StageTimes
from gateway.pools import PoolRegistry
from gateway.state.base import QuotaStore


class Settle:
    """The end of a request: its charge and its outcome."""

    def __init__(self, pools: PoolRegistry, quotas: QuotaStore, estimator: Estimator) -> None:
        self.pools = pools
        self.quotas = quotas
        self.estimator = estimator

    def run(
        self,
        admitted: Admitted,
        *,
        queued_s: float,
        started: float,
        finished: float,
        output_tokens: int = 0,
        learn: bool = True,
        backend_wait_s: float | None = None,
        first_result: float | None = None,
        finished_answer: bool = True,
        co_batch: CoBatch | None = None,
        observed_live_token_ms: float | None = None,
    ) -> Settled:
        """Charge observed work: backend time minus the time the request waited in Triton's
        own queue, and teach the estimator. That wait is ``backend_wait_s`` when the
        dispatch queue knows it (a request bound ahead waits until the device before it
        frees, which the queue observes at release); otherwise the pool's mean from
        Triton's statistics. The device time is shared with the pool's mean batch from those
        statistics, unless the queue co-batches its own work and bound this request: then it
        ran alone, or in the ``co_batch`` it was bound into, whose device time its members
        share by their solo prices.

        The outcome is complete only for a finished answer (``finished_answer``: false for a
        stream request that ended early) whose output limit no rule or ladder step reduced
        (a reduced limit may have cut the answer)."""
        wall_ms = (finished - started) * 1000.0
        queue = admitted.queue
        timing = self.pools.timing.get(queue.name)
        # The pool's mean batch from Triton's statistics; but where the queue co-batches its own
        # work (dispatch rule 6), that mean counts those batches, which are charged by their
        # members below, and a request the queue bound alone (``backend_wait_s``) ran alone.
        batch, solo_factor = (timing.batch if timing else 1.0), 1.0
        if backend_wait_s is not None and queue.co_batch_max >= 2:
            batch = 1.0
        if co_batch is not None and co_batch.cost_ms > 0.0:
            own_ms = admitted.record.demand.accelerator_ms
            batch = co_batch.solo_ms / own_ms if own_ms > 0.0 else 1.0
            solo_factor = co_batch.solo_ms / co_batch.cost_ms
        if backend_wait_s is not None:
            backend_queue_ms = backend_wait_s * 1000.0
        else:
            backend_queue_ms = timing.queue_ms if timing else 0.0
        outcome = settlement.settle(
            admitted.record,
            admitted.decision,
            admitted.reservation,
            admitted.correction_key,
            quotas=self.quotas,
            estimator=self.estimator,
            backend_model=admitted.route.backend_model,
            queue_ms=queued_s * 1000.0,
            wall_ms=wall_ms,
            backend_queue_ms=backend_queue_ms,
            batch=batch,
            solo_factor=solo_factor,
            first_result_ms=wall_ms if first_result is None else (first_result - started) * 1000.0,
            output_tokens=output_tokens,
            learn=learn,
            now=finished,
            observed_live_token_ms=observed_live_token_ms,
            unit_device_ms=queue.layout.device_ms_per_ms,
            complete=finished_answer and admitted.decision.max_output_tokens is None,
        )
        stages = StageTimes(admitted.received_at, admitted.admitted_at, started, finished)
        return Settled(
            admitted.record,
            admitted.decision,
            outcome,
            stages,
            evidence=admitted.evidence,
            features=admitted.features,
        )

    def abandon(self, admitted: Admitted, *, started: float | None, now: float) -> None:
        """A request that failed or was cancelled: settle quota by what it held, or refund."""
        settlement.abandon(self.quotas, admitted.reservation, started=started, now=now)
