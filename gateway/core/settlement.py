"""Settlement: charging a request's observed work and teaching the estimator.

After a request ran, ``settle`` turns what was observed (wall time on the backend, the
part of it spent waiting in the backend's own queue, the batch it shared) into the
accelerator-ms it held, settles its quota reservation with that charge (and the
live-token-ms derived from it), teaches the estimator the ratio of observed to predicted
work, and returns the request's ``Outcome``. A request the gateway co-batched with others
(dispatch rule 6) is charged its share of the batch's device time, in proportion to the
members' solo prices; the estimator learns what it would have held alone (its share scaled
back by the batch's saving), so co-batching never teaches it that single requests got cheaper.
``abandon`` settles a request that failed or was cancelled: by what it held if it started,
a full refund if it never did.
"""

from __future__ import annotations

from gateway.core.estimate import CorrectionKey, Estimator, charged_live_token_ms
from gateway.core.quota import QuotaAccounts, Reservation
from gateway.core.record import Decision, Outcome, RequestRecord

# A stream also settles how its results met its objectives (first result, gaps): the summary
# its ``GapTracker`` finished with (``gateway.core.streaming``), beside its ``Outcome``.
from gateway.core.streaming import StreamSummary as StreamSummary


def observed_accelerator_ms(wall_ms: float, backend_queue_ms: float, batch: float) -> float:
    """Device time held: backend time less the backend's own queueing, shared with its batch."""
    return max(wall_ms - backend_queue_ms, 0.0) / max(batch, 1e-9)


def settle(
    record: RequestRecord,
    decision: Decision,
    reservation: Reservation,
    correction_key: CorrectionKey,
    *,
    quotas: QuotaAccounts,
    estimator: Estimator,
    backend_model: str,
    queue_ms: float,
    wall_ms: float,
    backend_queue_ms: float,
    batch: float,
    first_result_ms: float,
    output_tokens: int,
    learn: bool,
    now: float,
    solo_factor: float = 1.0,
    observed_live_token_ms: float | None = None,
    unit_device_ms: float = 1.0,
    complete: bool = True,
) -> Outcome:
    """Charge observed work and (with ``learn``: a final answer) settle its quota and teach
    the estimator; without ``learn`` only the outcome is built (a request that ended early
    settles its quota by what it held: ``abandon``).
    ``solo_factor``: what the request would have held alone per ms of its share of a
    co-batch (the members' solo prices over the batch's predicted cost; 1 when not co-batched).
    ``observed_live_token_ms``: the live state it was observed to hold (a stream's, which grows
    with its tokens); otherwise its predicted live-token-ms stretched to the observed time.
    ``unit_device_ms``: accelerator-ms per ms the request held its unit (its layout's devices x
    a pipeline's cadence factor, ``gateway.core.topology``; 1 for one device).
    ``complete``: the outcome's ``complete`` (false for a partial answer)."""
    observed_ms = observed_accelerator_ms(wall_ms, backend_queue_ms, batch) * unit_device_ms
    demand = record.demand
    predicted_ms = demand.accelerator_ms
    live_token_ms = (
        observed_live_token_ms
        if observed_live_token_ms is not None
        else charged_live_token_ms(demand, observed_ms)
    )
    if learn:
        quotas.settle(reservation, charged_ms=observed_ms, charged_live_token_ms=live_token_ms, now=now)
        correction = demand.correction
        base_ms = predicted_ms / correction if correction > 0 else predicted_ms
        estimator.observe(
            correction_key,
            record.identity.tenant,
            base_ms=base_ms,
            observed_ms=observed_ms * solo_factor,
            now=now,
        )
    return Outcome(
        admitted=True,
        status="OK",
        backend_model=backend_model,
        approximation=decision.approximation,
        complete=complete,
        queue_ms=queue_ms,
        first_result_ms=first_result_ms,
        completion_ms=wall_ms,
        observed_accelerator_ms=observed_ms,
        charged_accelerator_ms=observed_ms,
        charged_live_token_ms=live_token_ms,
        output_tokens=output_tokens,
    )


def abandon(quotas: QuotaAccounts, reservation: Reservation, *, started: float | None, now: float) -> None:
    """A request that failed or was cancelled: settle quota by what it held, or refund all."""
    if started is None:
        quotas.release(reservation, now=now)
    else:
        quotas.settle(reservation, charged_ms=(now - started) * 1000.0, now=now)
