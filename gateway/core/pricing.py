"""Pricing: the resource-and-outcome record of one request as it would run on one pool.

``price`` turns a request's identity and shape into its record: predicted demand from the
route's profile (scaled to the backend's devices and corrected by what the estimator has
observed), and the deadline budget with its reserves and the queue wait the pool's
dispatch queue predicts for it (fair-share aware). Admission prices a request on its
primary route and, when it may need one, on its fallback; a capped output is priced again
as the shorter output that will run.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.dispatch import DispatchQueue
from gateway.core.estimate import CorrectionKey, Estimator, predict
from gateway.core.profile import DemandProfile
from gateway.core.record import Budget, Identity, RequestRecord, Shape


@dataclass(frozen=True, slots=True)
class Reserves:
    """The class's reserves and the request's deadline, in milliseconds."""

    deadline_ms: float
    upstream_ms: float
    fail_ms: float


def latest_start(received_at: float, reserves: Reserves, reserve_exec_ms: float) -> float:
    """The last moment execution may start and still leave the failure reserve before the
    deadline (seconds, on the caller's clock)."""
    return received_at + (reserves.deadline_ms - reserve_exec_ms - reserves.fail_ms) / 1000.0


def price(
    identity: Identity,
    shape: Shape,
    *,
    profile: DemandProfile,
    backend_model: str,
    version: str,
    time_scale: float,
    estimator: Estimator,
    queue: DispatchQueue,
    reserves: Reserves,
    weight: float,
    received_at: float,
    ladder_step: int,
    now: float,
) -> tuple[RequestRecord, CorrectionKey]:
    """The record of this request as it would run on ``backend_model`` in ``queue`` at ``now``,
    and the key its observed work will correct the estimator under."""
    correction_key = CorrectionKey(backend_model, version, shape.bucket)
    demand = predict(
        profile,
        shape,
        time_scale=time_scale,
        correction=estimator.correction(correction_key, identity.tenant, now),
    )
    reserve_exec_ms = demand.accelerator_ms + demand.host_cpu_ms
    budget = Budget(
        deadline_ms=reserves.deadline_ms,
        elapsed_ms=(now - received_at) * 1000.0,
        reserve_upstream_ms=reserves.upstream_ms,
        reserve_exec_ms=reserve_exec_ms,
        reserve_fail_ms=reserves.fail_ms,
        queue_wait_ms=queue.predicted_wait_ms(
            now,
            latest_start=latest_start(received_at, reserves, reserve_exec_ms),
            flow=(identity.request_class, identity.tenant),
            weight=weight,
            cost_ms=demand.accelerator_ms,
            long=shape.long,
        ),
    )
    record = RequestRecord(
        identity=identity, shape=shape, demand=demand, budget=budget, ladder_step=ladder_step
    )
    return record, correction_key
