"""Shared learning: estimator corrections merged across replicas, through a real Redis.

The merge rule is the core's (``Estimator.merge_fleet``: weighted means, each aged by the
half-life); ``EstimatorSync`` carries the means. A replica that never observed a model
predicts with what another learned, and so does one started after it (a restart).
"""

from __future__ import annotations

import math
import uuid

import pytest

from gateway import clock
from gateway.config import StateConfig
from gateway.core.estimate import CorrectionKey, Estimator
from gateway.state.estimator_sync import EstimatorSync
from gateway.state.redis_store import RedisFleet
from tests.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

KEY = CorrectionKey("full-v18", "18", "short")


def _taught(ratio: float, observations: int = 12, now: float = 0.0) -> Estimator:
    estimator = Estimator()
    for i in range(observations):
        estimator.observe(KEY, "orchid", base_ms=10.0, observed_ms=10.0 * ratio, now=now + i * 0.01)
    return estimator


def test_alone_a_replica_predicts_exactly_as_before() -> None:
    taught = _taught(3.0)
    alone = _taught(3.0)
    alone.merge_fleet([])
    assert alone.model_correction(KEY, 1.0) == taught.model_correction(KEY, 1.0)


def test_the_fleet_mean_is_weighted_by_each_replicas_history() -> None:
    slow, fast = _taught(4.0), _taught(1.0)
    now = 1.0
    merged = Estimator()
    merged.merge_fleet(slow.learned(now) + fast.learned(now))
    # Equal histories: the geometric mean of the two corrections (less the prior's pull).
    expected = math.sqrt(slow.model_correction(KEY, now) * fast.model_correction(KEY, now))
    assert merged.model_correction(KEY, now) == pytest.approx(expected, rel=0.02)
    # Ageing: long after, the fleet's learning fades back to the profile like one's own.
    assert merged.model_correction(KEY, now + 100 * merged.half_life_s) == pytest.approx(1.0, abs=1e-3)


async def _sync(server: RedisServer, prefix: str, estimator: Estimator, name: str) -> EstimatorSync:
    fleet = RedisFleet(
        StateConfig(backend="redis", url=server.url, key_prefix=prefix, call_timeout_ms=200), replica_id=name
    )
    assert await fleet.beat()
    return EstimatorSync(estimator, fleet)


async def test_corrections_reach_other_replicas_and_survive_a_restart(redis_server: RedisServer) -> None:
    prefix = f"est-{uuid.uuid4().hex[:8]}:"
    start = clock.now()  # the runtime's clock: what the pipeline hands the estimator
    teacher = await _sync(redis_server, prefix, _taught(3.0, now=start), "teacher")
    learner = await _sync(redis_server, prefix, Estimator(), "learner")
    assert learner.estimator.model_correction(KEY, start) == 1.0  # never observed the model
    assert await teacher.exchange()
    assert await learner.exchange()
    now = clock.now()
    taught = teacher.estimator.model_correction(KEY, now)
    assert taught > 2.5
    assert learner.merged >= 1
    assert learner.estimator.model_correction(KEY, now) == pytest.approx(taught, rel=0.05)
    # Every replica gone, one started fresh (a restart: a new replica id, an empty estimator).
    await teacher.fleet.client.aclose()
    await learner.fleet.client.aclose()
    restarted = await _sync(redis_server, prefix, Estimator(), "restarted")
    assert await restarted.exchange()
    assert restarted.estimator.model_correction(KEY, now) == pytest.approx(taught, rel=0.05)
    await restarted.fleet.client.aclose()
