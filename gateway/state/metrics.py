"""Prometheus view of the shared state: degraded mode, membership, Redis errors, resyncs.

Owns the ``orchid_state_*`` metrics, read from a ``RedisFleet`` when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.state.redis_store import RedisFleet

__all__ = ["StateCollector"]


class StateCollector(Collector):
    """``orchid_state_degraded`` (1 while Redis is unreachable), ``orchid_state_replicas``,
    ``orchid_state_redis_errors_total``, ``orchid_state_resyncs_total``."""

    def __init__(self, fleet: RedisFleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        fleet = self.fleet
        yield GaugeMetricFamily(
            "orchid_state_degraded",
            "1 while this replica cannot reach the fleet's Redis (fail_mode applies)",
            value=1.0 if fleet.degraded else 0.0,
        )
        yield GaugeMetricFamily(
            "orchid_state_replicas", "replicas in the last membership read", value=float(fleet.size)
        )
        yield CounterMetricFamily(
            "orchid_state_redis_errors",
            "Redis calls that failed or passed their deadline",
            value=fleet.errors,
        )
        yield CounterMetricFamily(
            "orchid_state_resyncs", "returns from degraded mode to the shared state", value=fleet.resyncs
        )
