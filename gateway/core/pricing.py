"""Pricing: the resource-and-outcome record of one request as it would run on one pool.

``price`` turns a request's identity and shape into its record: predicted demand from the
route's profile (scaled to the backend's devices and corrected by what the estimator has
observed), and the deadline budget with its reserves and the queue wait the pool's
dispatch queue predicts for it (fair-share aware). Admission prices a request on its
primary route and, when it may need one, on its fallback; a capped output is priced again
as the shorter output that will run.

A stream (``Mode.STREAMING``) is judged by its first result (``gateway.core.streaming``):
its predicted first result is its predicted wait plus its prefill and one decode step
(``first_result_reserve_ms``), against its first-result deadline (``Reserves.first_result_ms``,
default and at most the deadline); the record's slack and latest start are the first
result's, and its budget keeps the completion deadline (``deadline_ms``) and the gap
objective for settlement and reporting. Unary work is priced as before, to the bit.

On a pool whose model has a parallel layout (``gateway.core.topology``; ``queue.layout``),
the profile's milliseconds become accelerator-ms of the whole unit (``Layout.profile_scale``:
x its devices, x a pipeline's cadence factor, unless the profile is measured in unit
device-ms already), and the execution reserve is the unit's wall time (``latency_ms``): a
tensor-parallel request holds two devices for half the time, and is priced and charged for
both.
"""

from __future__ import annotations

import msgspec

from gateway.core.dispatch import DispatchQueue
from gateway.core.estimate import CorrectionKey, Estimator, predict
from gateway.core.profile import DemandProfile
from gateway.core.record import Budget, Identity, Mode, RequestRecord, Shape
from gateway.core.streaming import first_result_reserve_ms


class Reserves(msgspec.Struct, frozen=True, gc=False):
    """The class's reserves and the request's deadline, in milliseconds."""

    deadline_ms: float
    upstream_ms: float
    fail_ms: float
    # A stream's objectives (ignored for unary work): its first result's deadline (None: the
    # deadline; never later than it) and its inter-result gap objective (None: none).
    first_result_ms: float | None = None
    gap_ms: float | None = None

    def first_result_deadline_ms(self) -> float:
        """A stream's first-result deadline: its objective, at most the completion deadline."""
        if self.first_result_ms is None:
            return self.deadline_ms
        return min(self.first_result_ms, self.deadline_ms)


def latest_start(received_at: float, reserves: Reserves, reserve_exec_ms: float) -> float:
    """The last moment execution may start and still leave the failure reserve before the
    deadline (seconds, on the caller's clock)."""
    return received_at + (reserves.deadline_ms - reserve_exec_ms - reserves.fail_ms) / 1000.0


def first_result_latest_start(received_at: float, reserves: Reserves, reserve_first_ms: float) -> float:
    """A stream's latest start: the last moment it may start and still leave the failure
    reserve before its first-result deadline (seconds, on the caller's clock)."""
    return received_at + (reserves.first_result_deadline_ms() - reserve_first_ms - reserves.fail_ms) / 1000.0


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
    cached_tokens: int = 0,
) -> tuple[RequestRecord, CorrectionKey]:
    """The record of this request as it would run on ``backend_model`` in ``queue`` at ``now``,
    and the key its observed work will correct the estimator under. ``cached_tokens``: the
    prompt tokens the pool's prefix cache is expected to serve (their prefill is not priced)."""
    correction_key = CorrectionKey(backend_model, version, shape.bucket)
    demand = predict(
        profile,
        shape,
        time_scale=time_scale,
        correction=estimator.correction(correction_key, identity.tenant, now),
        cached_tokens=cached_tokens,
    )
    layout = queue.layout
    wall_per_ms = 1.0  # wall ms per accelerator-ms
    if not layout.trivial:  # device-ms of the whole unit; its wall time is what a deadline sees
        scale = layout.profile_scale()
        demand = msgspec.structs.replace(
            demand,
            prefill_ms=demand.prefill_ms * scale,
            decode_ms=demand.decode_ms * scale,
            live_token_ms=demand.live_token_ms * scale / layout.device_ms_per_ms,
        )
        wall_per_ms = 1.0 / layout.device_ms_per_ms
    accelerator_ms = demand.accelerator_ms
    reserve_exec_ms = accelerator_ms * wall_per_ms + demand.host_cpu_ms
    streaming = identity.mode is Mode.STREAMING
    reserve_first_ms = 0.0
    start_by = latest_start(received_at, reserves, reserve_exec_ms)
    if streaming:
        reserve_first_ms = first_result_reserve_ms(
            demand.prefill_ms * wall_per_ms,
            demand.decode_ms * wall_per_ms,
            shape.max_output_tokens,
            demand.host_cpu_ms,
        )
        start_by = first_result_latest_start(received_at, reserves, reserve_first_ms)
    budget = Budget(
        deadline_ms=reserves.deadline_ms,
        elapsed_ms=(now - received_at) * 1000.0,
        reserve_upstream_ms=reserves.upstream_ms,
        reserve_exec_ms=reserve_exec_ms,
        reserve_fail_ms=reserves.fail_ms,
        queue_wait_ms=queue.predicted_wait_ms(
            now,
            latest_start=start_by,
            flow=(identity.request_class, identity.tenant),
            weight=weight,
            cost_ms=accelerator_ms,
            long=shape.long,
            stream=streaming,
        ),
        first_result_deadline_ms=reserves.first_result_deadline_ms() if streaming else None,
        reserve_first_result_ms=reserve_first_ms,
        gap_objective_ms=reserves.gap_ms if streaming else None,
    )
    record = RequestRecord(
        identity=identity, shape=shape, demand=demand, budget=budget, ladder_step=ladder_step
    )
    return record, correction_key
