"""Triton per-model statistics, turned into per-request queue and compute estimates.

Triton reports cumulative counters per model (``inference_stats.queue``,
``compute_input``, ``compute_infer``, ``compute_output``: count and total ns).
The difference between two samples says how long requests that finished in
between waited in *Triton's* queue and how long they computed. The gateway
subtracts the mean Triton queue time from the backend time it measured per
request, so a request is charged for compute, not for waiting behind others;
and it divides by the mean batch size (inferences per execution), because the
members of one batch share its device time.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import service_pb2


@dataclass(frozen=True, slots=True)
class StatsSample:
    successes: int
    queue_ns: int
    compute_ns: int
    inferences: int = 0  # requests executed (Triton's inference_count)
    executions: int = 0  # model executions (batches) that ran them (execution_count)

    @classmethod
    def from_response(cls, response: service_pb2.ModelStatisticsResponse) -> StatsSample:
        successes = queue_ns = compute_ns = inferences = executions = 0
        for model in response.model_stats:
            inferences += int(model.inference_count)
            executions += int(model.execution_count)
            stats = model.inference_stats
            successes += int(stats.success.count)
            queue_ns += int(stats.queue.ns)
            compute_ns += (
                int(stats.compute_input.ns) + int(stats.compute_infer.ns) + int(stats.compute_output.ns)
            )
        return cls(successes, queue_ns, compute_ns, inferences, executions)


@dataclass(frozen=True, slots=True)
class PoolTiming:
    """Mean Triton queue and compute time per request over the last sampling interval."""

    queue_ms: float = 0.0
    compute_ms: float = 0.0
    requests: int = 0
    batch: float = 1.0  # mean requests per execution: a batch's device time is shared by its members


def timing_between(before: StatsSample, after: StatsSample) -> PoolTiming | None:
    """None when nothing finished in between (or counters went backwards: a restart)."""
    count = after.successes - before.successes
    if count <= 0 or after.queue_ns < before.queue_ns or after.compute_ns < before.compute_ns:
        return None
    executions = after.executions - before.executions
    inferences = after.inferences - before.inferences
    return PoolTiming(
        queue_ms=(after.queue_ns - before.queue_ns) / count / 1e6,
        compute_ms=(after.compute_ns - before.compute_ns) / count / 1e6,
        requests=count,
        batch=max(1.0, inferences / executions) if executions > 0 else 1.0,
    )
