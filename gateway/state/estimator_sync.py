"""Shared learning: the estimator's corrections, merged through Redis.

Owns the exchange of ``gateway.core.estimate.Estimator`` means between replicas. Every
``interval_s`` (1 s) a replica, in one round trip, writes its own learned means (model
corrections and tenant factors, weight aged to Redis's clock) into one Redis hash, field
per (replica, kind, key), and reads the whole hash back; the other fields become the
estimator's fleet view (``Estimator.merge_fleet``). The merge rule (weighted means, each
aged by the half-life) is the core's.

Restarts: a replica's fields outlive it, so a replica started later (a restart has a new
replica id) reads the fleet's learning at its first exchange and predicts with it from
then on; its own stale fields age out by the half-life like any other, and fields older
than ``_FORGET_HALF_LIVES`` half-lives are deleted by whichever replica reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Final

from gateway import clock
from gateway.core.estimate import Estimator, LearnedCorrection
from gateway.state.redis_store import REDIS_FAILURES, RedisFleet

__all__ = ["EstimatorSync"]

_FORGET_HALF_LIVES: Final = 10.0


class EstimatorSync:
    """One replica's side of the estimator exchange."""

    def __init__(self, estimator: Estimator, fleet: RedisFleet) -> None:
        self.estimator = estimator
        self.fleet = fleet
        self.key = f"{fleet.config.key_prefix}estimator"
        self.merged = 0  # other replicas' means in the last merge

    async def exchange(self) -> bool:
        """Publish own means, merge the others'. False: Redis unreachable (nothing changes)."""
        if self.fleet.degraded:
            return False
        me = self.fleet.replica_id
        before = clock.now()
        try:
            seconds, micros = await self.fleet.call(self.fleet.client.time())
            after = clock.now()
            offset = float(seconds) + float(micros) / 1e6 - (before + after) / 2.0
            fields = {
                json.dumps([me, c.kind, *c.key]): json.dumps([c.log_mean, c.weight, c.at + offset, c.samples])
                for c in self.estimator.learned(after)
            }
            pipe = self.fleet.client.pipeline(transaction=False)
            if fields:
                pipe.hset(self.key, mapping=fields)
            pipe.hgetall(self.key)
            answers = await self.fleet.call(pipe.execute())
        except REDIS_FAILURES:
            return False
        now = clock.now()
        forget_after = _FORGET_HALF_LIVES * self.estimator.half_life_s
        others: list[LearnedCorrection] = []
        stale: list[bytes] = []
        for field, value in answers[-1].items():
            replica, kind, *key = json.loads(field)
            log_mean, weight, at_redis, samples = json.loads(value)
            at = float(at_redis) - offset
            if now - at > forget_after:
                stale.append(field)
                continue
            if replica == me or kind not in ("model", "tenant"):
                continue
            others.append(
                LearnedCorrection(kind, tuple(key), float(log_mean), float(weight), at, int(samples))
            )
        self.estimator.merge_fleet(others)
        self.merged = len(others)
        if stale:
            pipe = self.fleet.client.pipeline(transaction=False)
            pipe.hdel(self.key, *(f.decode() for f in stale))
            with contextlib.suppress(*REDIS_FAILURES):
                await self.fleet.call(pipe.execute())
        return True

    async def run(self, interval_s: float) -> None:
        """Exchange every ``interval_s`` until cancelled (first at once: learn at start)."""
        while True:
            await self.exchange()
            await asyncio.sleep(interval_s)
