"""Feature sources in a simulation (``orchid-gateway simulate``, scenario key ``feature_sources``).

The gateway's feature stage is the runtime's own (``gateway.features.Features``: the gate before
placement with ``UpstreamHealth``'s backpressure and upstream reserve, the runtime's scoped
``FeatureCache``, the batched read after the quota reservation, ``judge``): this module replaces
only the HTTP read of each configured source with a virtual-time one whose latency and failures
follow the scenario, so simulation and runtime cannot disagree on a decision.

A scenario's ``feature_sources.<name>`` (a source of the gateway config's ``feature_sources``):

* ``median_ms``, ``p95_ms``: a lognormal read latency (``p95_ms == median_ms``: constant);
* ``failure_rate``: the probability that a read fails (HTTP 500 after its latency);
* ``incidents[]``: windows (``at_s``, ``until_s``) with their own ``median_ms``/``p95_ms``/
  ``failure_rate`` (a read takes the latency of the window it *starts* in);
* ``value_age_s``: how old the values it answers are (the contract's max ages judge them).

Which requests read features is the route's business (its ``features:`` contract), as at run
time; an arrival class on such a route names its entities (``entities: {population, per_request}``):
each request reads ``per_request`` ids drawn uniformly from ``population``, so cache hits come from
the runtime's cache by entity cardinality and the source's ``cache_ttl_ms`` (none are assumed).

``clearance`` is the same source model against ``UpstreamHealth`` alone (no gateway), in virtual
time: the property test's fast path for "backpressure clears after the source recovers".
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.config import FeatureSourceConfig
from gateway.core.upstream import PRESENT, FeatureCache, FeatureContract
from gateway.features.source import Columns, FeatureSource, SourceError

Z95 = 1.6448536269514722  # the standard normal's 95th percentile


class _Keyed(ValueError):
    """A cross-field problem that knows the key (relative to the validated object) it is about
    (``orchid_tools.simulate`` locates it; one class for both modules' models)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key
        self.problem = problem


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Latency(_Strict):
    """A read latency distribution: lognormal by its median and p95, and a failure rate."""

    median_ms: float = Field(gt=0)
    p95_ms: float = Field(gt=0)
    failure_rate: float = Field(default=0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _order(self) -> Latency:
        if self.p95_ms < self.median_ms:
            raise _Keyed("p95_ms", "p95_ms must be at least median_ms")
        return self

    @property
    def sigma(self) -> float:
        return math.log(self.p95_ms / self.median_ms) / Z95

    def draw(self, rng: np.random.Generator) -> tuple[float, bool]:
        """(latency ms, failed). Two draws per read, whatever the parameters (reproducible)."""
        z = float(rng.standard_normal())
        failed = float(rng.random()) < self.failure_rate
        return self.median_ms * math.exp(self.sigma * z), failed


class Incident(Latency):
    at_s: float = Field(ge=0)
    until_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _window(self) -> Incident:
        if self.until_s <= self.at_s:
            raise _Keyed("until_s", "until_s must be after at_s")
        return self


class SourceModel(Latency):
    """A scenario's feature source: its normal latency, its incidents, the values' age."""

    incidents: list[Incident] = []
    value_age_s: float = Field(default=60.0, ge=0, description="age of the values it answers")

    def at(self, t_s: float) -> Latency:
        for incident in self.incidents:
            if incident.at_s <= t_s < incident.until_s:
                return incident
        return self

    def recovered_at_s(self) -> float:
        return max((i.until_s for i in self.incidents), default=0.0)


class Entities(_Strict):
    """The entities an arrival class's requests read: ``per_request`` ids drawn uniformly from
    ``population`` (the cache's hit rate follows from it)."""

    population: int = Field(default=100_000, ge=1)
    per_request: int = Field(default=1, ge=1)


class Compare(_Strict):
    """Run the same arrivals once per value: ``backpressure: [true, false]``. The report is the
    first value's; the others are under ``runs`` (``backpressure=false``) for ``expect:``."""

    backpressure: list[bool] = Field(min_length=2, max_length=2)

    @model_validator(mode="after")
    def _distinct(self) -> Compare:
        if len(set(self.backpressure)) != len(self.backpressure):
            raise _Keyed("backpressure", "two different values: [true, false]")
        return self

    def labels(self) -> list[str]:
        return [run_label(v) for v in self.backpressure]


def run_label(backpressure: bool) -> str:
    return f"backpressure={'true' if backpressure else 'false'}"


def with_backpressure(sources: dict[str, FeatureSourceConfig], value: bool) -> dict[str, FeatureSourceConfig]:
    return {name: s.model_copy(update={"backpressure": value}) for name, s in sources.items()}


# --------------------------------------------------------------------------- in the gateway


@dataclass
class FeatureLog:
    """Per arrival index: ``read``, ``read_failed`` (failed or timed out) or ``cache_hit``."""

    outcome: dict[int, str] = field(default_factory=dict)


class SimulatedSource(FeatureSource):
    """``FeatureSource`` whose read sleeps (virtual time) for the scenario's latency: the runtime's
    own timeout (connection wait included: at most ``max_concurrency`` reads in flight), failure,
    health recording and reply shape; no HTTP."""

    def __init__(
        self,
        name: str,
        config: FeatureSourceConfig,
        model: SourceModel,
        rng: np.random.Generator,
        t0: float,
        caller: Callable[[], int | None],
        log: FeatureLog,
    ) -> None:
        super().__init__(name, config)
        self.model = model
        self.rng = rng
        self.t0 = t0
        self.caller = caller
        self.log = log
        self.slots = asyncio.Semaphore(config.max_concurrency)

    async def read(
        self, contract: FeatureContract, entities: dict[str, list[int | str]], timeout_s: float
    ) -> tuple[list[str], Columns]:
        if timeout_s <= 0 or not math.isfinite(timeout_s):  # as the runtime's read
            raise SourceError("no time left to read features", timed_out=True)
        started = clock.now()
        latency_ms, failed = self.model.at(started - self.t0).draw(self.rng)
        index = self.caller()
        ok = False
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    async with self.slots:
                        await asyncio.sleep(latency_ms / 1000.0)
            except TimeoutError:
                raise SourceError(
                    f"the feature source did not answer within {timeout_s * 1000:.0f} ms", timed_out=True
                ) from None
            if failed:
                raise SourceError("the feature source answered HTTP 500")
            ok = True
            count = len(next(iter(entities.values()), []))
            event = clock.wall() - self.model.value_age_s
            names = [f.full_name for f in contract.features]
            columns: Columns = [([1.0] * count, [PRESENT] * count, [event] * count) for _ in names]
            return names, columns
        finally:
            self.reads += 1
            self.health.record(clock.now(), (clock.now() - started) * 1000.0, ok=ok)
            if index is not None:
                self.log.outcome[index] = "read" if ok else "read_failed"


class RecordingCache(FeatureCache):
    """The runtime's cache, noting which arrival it answered."""

    def __init__(self, entries: int, ttl_s: float, caller: Callable[[], int | None], log: FeatureLog) -> None:
        super().__init__(entries=entries, ttl_s=ttl_s)
        self._caller = caller
        self._log = log

    def get(self, key: Any, now: float) -> Any:
        found = super().get(key, now)
        if found is not None:
            index = self._caller()
            if index is not None:
                self._log.outcome[index] = "cache_hit"
        return found


def install(
    features: Any,
    models: dict[str, SourceModel],
    *,
    seed: int,
    t0: float,
    caller: Callable[[], int | None],
    log: FeatureLog,
) -> None:
    """Replace each modelled source's reader (and cache, to note hits) in the runtime's
    ``gateway.features.Features``; everything else stays the runtime's."""
    for index, (name, model) in enumerate(sorted(models.items())):
        state = features.sources[name]
        config = state.source.config
        state.source = SimulatedSource(
            name, config, model, np.random.default_rng([seed, 1000 + index]), t0, caller, log
        )
        state.cache = RecordingCache(config.cache_entries, config.cache_ttl_ms / 1000.0, caller, log)


def entity_bytes(contract: FeatureContract, spec: Entities, rng: np.random.Generator) -> bytes:
    """A request's entity parameters (appended to its serialized request: protobuf merges)."""
    request = service_pb2.ModelInferRequest()
    ids = rng.integers(0, spec.population, size=spec.per_request)
    for _, parameter in contract.entities:
        if spec.per_request == 1:
            request.parameters[parameter].int64_param = int(ids[0])
        else:
            request.parameters[parameter].string_param = ",".join(str(int(i)) for i in ids)
    raw: bytes = request.SerializeToString()
    return raw


# --------------------------------------------------------------------------- clearance


@dataclass(frozen=True)
class Clearance:
    """What ``clearance`` saw: refusals by backpressure, the last one's time, reads."""

    refused: int
    last_refusal_s: float | None
    reads: int
    refused_after_recovery: int


def clearance(
    model: SourceModel,
    config: FeatureSourceConfig,
    *,
    rate_per_s: float,
    duration_s: float,
    seed: int = 0,
) -> Clearance:
    """The source model against the runtime's ``UpstreamHealth`` alone, in virtual time:
    requests every ``1 / rate_per_s`` s ask ``backpressure(now)`` (the gateway's gate); those let
    through read, timing out at ``timeout_ms``, and ``record`` when the read ends."""
    health = FeatureSource("clearance", config).health  # as the runtime builds it
    rng = np.random.default_rng(seed)
    pending: list[tuple[float, float, bool]] = []  # (ends at, latency ms, ok)
    recovered = model.recovered_at_s()
    refused = reads = after = 0
    last: float | None = None
    timeout_ms = config.timeout_ms
    for k in range(math.floor(rate_per_s * duration_s)):
        now = k / rate_per_s
        while pending and pending[0][0] <= now:
            ends, ms, ok = heapq.heappop(pending)
            health.record(ends, ms, ok=ok)
        if config.backpressure and health.backpressure(now) is not None:
            refused += 1
            last = now
            after += now >= recovered
            continue
        reads += 1
        ms, failed = model.at(now).draw(rng)
        ok = not failed and ms <= timeout_ms
        ms = min(ms, timeout_ms)
        heapq.heappush(pending, (now + ms / 1000.0, ms, ok))
    return Clearance(refused, last, reads, after)


def bound_s(config: FeatureSourceConfig, rate_per_s: float = math.inf) -> float:
    """How long after the source recovers backpressure may still refuse: the last slow read
    started before the recovery ends within ``timeout_ms`` (one read); then either its sample
    leaves the window (``window_s``, and the next probe within ``probe_interval_s``) or, with a
    core that latches the state until ``recover_probes`` good probes in a row, those probes come
    one per ``probe_interval_s``; a probe is the first request after its interval (``1 / rate``)."""
    health = FeatureSource("bound", config).health
    probes = getattr(health, "recover_probes", 1)
    gap = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
    wait = max(config.window_s + config.probe_interval_s, probes * config.probe_interval_s)
    return wait + config.timeout_ms / 1000.0 + gap


def last_refusal_after(times: Sequence[float], start_s: float) -> float:
    """Seconds from ``start_s`` to the last of ``times`` (0: none)."""
    return max((t - start_s for t in times if t >= start_s), default=0.0)
