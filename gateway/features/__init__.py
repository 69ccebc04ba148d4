"""Upstream features at run time: the sources, their registries, the scoped caches, and the two
places the request chain calls (``gateway.chain.features``).

Owns, per configured source (``feature_sources`` in gateway.yaml): the HTTP reader
(``source.FeatureSource``), its definitions (``registry.read_registry``, re-read when the file
changes, checked at most once a second), its cache (``core.upstream.FeatureCache``), and the
counters ``/metrics`` reads. Per route with a ``features`` contract:

* ``gate`` (before placement, no I/O): the contract's definition version against the source's
  registry (a mismatch refuses with ``features.incompatible_definition``, never a silent read),
  then the source's backpressure (``features.upstream_backpressure`` with ``retry-after-ms``),
  and the upstream reserve the record's slack sets aside: the source's measured latency
  quantile.
* ``fetch`` (after the quota reservation, before the dispatch queue): the entities from the
  request's parameters (bounded), the cache (key: tenant, scope, definition version, data
  generation, entities), else one batched read within the time the request has left beyond
  its predicted compute, judged by the contract; the values become the model input the
  contract names (FP32, ``[1, entities x features]``), and the snapshot goes in provenance.
  With ``as_of`` (an item of a batch that declared a feature snapshot) the values are read
  as of that time through the source's historical retrieval instead (``historical``).

``check_contracts`` is the load-time check: every contract against its source's registry
(when the file is there: a source not yet materialised makes its routes refuse until it is).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.config import FeatureContractConfig, GatewayConfig, RouteConfig, RouteTable, route_error
from gateway.core import upstream
from gateway.core.errors import (
    ConfigError,
    DeadlineInfeasible,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from gateway.core.upstream import (
    FeatureCache,
    FeatureContract,
    FeatureSnapshot,
    FeatureSpec,
    FeatureValues,
    Missing,
)
from gateway.features.historical import HistoricalSource
from gateway.features.registry import Definitions, RegistryError, read_registry
from gateway.features.source import FeatureSource, SourceError

log = logging.getLogger("orchid.features")

# The age of the oldest value a request used (seconds): /metrics histogram buckets.
AGE_BUCKETS_S = (1.0, 10.0, 60.0, 600.0, 3600.0, 6 * 3600.0, 86400.0, math.inf)
REGISTRY_CHECK_S = 1.0


def contract_of(config: FeatureContractConfig) -> FeatureContract:
    return FeatureContract(
        source=config.source,
        feature_service=config.feature_service,
        definition_version=config.definition_version,
        entities=tuple(config.entities.items()),
        features=tuple(
            FeatureSpec(f.ref, f.max_age_s, Missing(f.missing), f.default) for f in config.features
        ),
        input=config.input,
        max_entities=config.max_entities,
    )


class SourceState:
    """One source: reader, definitions, cache and counters."""

    def __init__(self, name: str, source: FeatureSource, registry: Path | None, cache: FeatureCache) -> None:
        self.name = name
        self.source = source
        self.registry = registry
        self.cache = cache
        self.definitions: Definitions | None = None
        self.registry_problem = "" if registry is None else "not read yet"
        self._registry_mtime: float | None = None
        self._checked_at = -math.inf
        self.outcomes: dict[str, int] = {}
        self.age_counts = [0] * len(AGE_BUCKETS_S)
        self.age_sum_s = 0.0

    def refresh(self, now: float) -> None:
        """Re-read the registry if it changed (checked at most every REGISTRY_CHECK_S)."""
        if self.registry is None or now - self._checked_at < REGISTRY_CHECK_S:
            return
        self._checked_at = now
        try:
            mtime = self.registry.stat().st_mtime
        except OSError:
            if not self.registry_problem.endswith("does not exist"):  # logged once per absence
                log.warning("feature source %s: registry %s is not there", self.name, self.registry)
            self.definitions, self._registry_mtime = None, None
            self.registry_problem = f"the feature registry {self.registry} does not exist"
            return
        if mtime == self._registry_mtime:
            return
        try:
            self.definitions = read_registry(self.registry)
            self.registry_problem = ""
        except RegistryError as error:
            self.definitions, self.registry_problem = None, str(error)
            log.warning("feature source %s: %s", self.name, error)
        self._registry_mtime = mtime
        log.info("feature source %s: registry read (generation %s)", self.name, self.generation or "-")

    @property
    def generation(self) -> str:
        return self.definitions.generation if self.definitions is not None else ""

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def served(self, age_s: float) -> None:
        self.age_sum_s += age_s
        for index, bound in enumerate(AGE_BUCKETS_S):
            if age_s <= bound:
                self.age_counts[index] += 1
                break


class Features:
    """Every feature source and every route's contract."""

    def __init__(self, config: GatewayConfig, routes: RouteTable) -> None:
        self.sources = {
            name: SourceState(
                name,
                FeatureSource(name, source),
                source.registry,
                FeatureCache(entries=source.cache_entries, ttl_s=source.cache_ttl_ms / 1000.0),
            )
            for name, source in config.feature_sources.items()
        }
        # Point-in-time reads (batch feature snapshots); Feast is imported only on the first one.
        self.historical = {
            name: HistoricalSource(name, source.repo) for name, source in config.feature_sources.items()
        }
        self.contracts = {
            name: contract_of(route.features)
            for name, route in routes.models.items()
            if route.features is not None
        }
        self._by_config: dict[int, FeatureContract] = {}
        now = clock.now()
        for state in self.sources.values():
            state.refresh(now)

    def contract(self, route: RouteConfig) -> FeatureContract | None:
        """The route's contract (a dedicated tenant's or a candidate's route copy shares it)."""
        if route.features is None:
            return None
        key = id(route.features)
        found = self._by_config.get(key)
        if found is None:
            found = self._by_config[key] = contract_of(route.features)
        return found

    # ------------------------------------------------------------------ gate

    def gate(
        self,
        contract: FeatureContract,
        request: service_pb2.ModelInferRequest,
        *,
        tenant: str,
        scope: str,
        now: float,
        as_of: float | None = None,
    ) -> float | None:
        """Before placement: refuse a request whose features cannot be read as its model was
        trained (definitions), whose entities are malformed, or that should not read the
        source now (backpressure); else the upstream reserve (ms) its slack sets aside: none
        when the cache holds its features now (it needs no read: the source's backpressure
        does not refuse it either), else the source's measured read latency quantile, or with
        the source's ``backpressure`` off (and for a snapshot batch's item, ``as_of``: a
        historical read) None, the class's constant reserve."""
        state = self.sources[contract.source]
        state.refresh(now)
        if state.registry is not None:
            if state.definitions is None:
                state.count("definitions_unavailable")
                raise Unavailable(
                    "the feature source's definitions are unavailable (the operator's log says why)",
                    rule=upstream.RULE_DEFINITIONS_UNAVAILABLE,
                    retry_after_ms=int(REGISTRY_CHECK_S * 1000),
                )
            problem = state.definitions.check(
                contract.feature_service, contract.definition_version, tuple(f.ref for f in contract.features)
            )
            if problem is not None:
                state.count("incompatible")
                raise FailedPrecondition(problem, rule=upstream.RULE_INCOMPATIBLE)
        entities, _ = self.entity_values(contract, request)
        if as_of is not None:
            return None
        if state.cache.ttl_s > 0 and state.cache.holds(
            self._key(state, contract, entities, tenant, scope), now
        ):
            return 0.0
        health = state.source.health
        if not state.source.config.backpressure:
            return None
        refusal = health.backpressure(now)
        if refusal is not None:
            state.count("backpressure")
            raise Unavailable(refusal.message, rule=refusal.rule, retry_after_ms=health.retry_after_ms(now))
        return health.reserve_ms(now)

    # ------------------------------------------------------------------ fetch

    @staticmethod
    def _key(
        state: SourceState,
        contract: FeatureContract,
        entities: dict[str, list[int | str]],
        tenant: str,
        scope: str,
    ) -> upstream.CacheKey:
        return upstream.cache_key(
            tenant,
            scope,
            contract,
            state.generation,
            tuple(f"{k}={','.join(map(str, v))}" for k, v in sorted(entities.items())),
        )

    @staticmethod
    def entity_values(
        contract: FeatureContract, request: service_pb2.ModelInferRequest
    ) -> tuple[dict[str, list[int | str]], int]:
        """Join key -> values from the request's parameters (an int64, or a string of
        comma-separated ids for several entities), all keys the same count, at most
        ``max_entities``. A caller may not send the contract's input itself."""
        if any(tensor.name == contract.input for tensor in request.inputs):
            raise InvalidArgument(
                f"input {contract.input!r} is read from the feature source by the gateway: do not send it"
            )
        out: dict[str, list[int | str]] = {}
        count = -1
        for key, parameter in contract.entities:
            if parameter not in request.parameters:
                raise InvalidArgument(
                    f"this model reads features by request parameter {parameter!r}: set it",
                    rule=upstream.RULE_ENTITIES,
                )
            param = request.parameters[parameter]
            kind = param.WhichOneof("parameter_choice")
            if kind == "int64_param":
                values: list[int | str] = [int(param.int64_param)]
            elif kind == "string_param":
                parts = [p.strip() for p in param.string_param.split(",")]
                if not all(parts) or len(parts) > contract.max_entities:
                    raise InvalidArgument(
                        f"parameter {parameter!r} names 1 to {contract.max_entities} comma-separated ids",
                        rule=upstream.RULE_ENTITIES,
                    )
                values = [int(p) if p.lstrip("-").isdigit() else p for p in parts]
            else:
                raise InvalidArgument(
                    f"parameter {parameter!r} must be an int64 or a string of ids",
                    rule=upstream.RULE_ENTITIES,
                )
            if count not in (-1, len(values)):
                raise InvalidArgument(
                    "every entity parameter must name the same number of ids", rule=upstream.RULE_ENTITIES
                )
            count = len(values)
            out[key] = values
        return out, count

    async def fetch(
        self,
        contract: FeatureContract,
        request: service_pb2.ModelInferRequest,
        *,
        tenant: str,
        scope: str,
        time_left_s: float,
        as_of: float | None = None,
    ) -> tuple[FeatureValues, FeatureSnapshot]:
        """The request's features (cached or read), judged by the contract; a ``GatewayError``
        when they cannot be had as the contract says. ``as_of`` (epoch seconds): as of that
        time, through the source's historical retrieval, ages measured from it."""
        state = self.sources[contract.source]
        entities, count = self.entity_values(contract, request)
        if as_of is not None:
            return await self.historical[contract.source].fetch(
                contract,
                entities,
                count,
                tenant=tenant,
                scope=scope,
                generation=state.generation,
                as_of=as_of,
                time_left_s=time_left_s,
            )
        now = clock.now()
        key = self._key(state, contract, entities, tenant, scope)
        cached = state.cache.get(key, now) if state.cache.ttl_s > 0 else None
        if cached is not None:
            state.count("cache_hit")
            state.served(cached.age_s(clock.wall()))
            return cached, FeatureSnapshot(
                contract.definition_version, cached.oldest_event, cached.defaulted, True
            )
        timeout_s = min(state.source.config.timeout_ms / 1000.0, time_left_s)
        try:
            names, columns = await state.source.read(contract, entities, timeout_s)
        except SourceError as error:
            state.count("timeout" if error.timed_out else "failed")
            if error.timed_out and timeout_s < state.source.config.timeout_ms / 1000.0:
                raise DeadlineInfeasible(
                    f"features: {error} (the request's deadline left {max(0.0, time_left_s) * 1000:.0f} ms)",
                    rule=upstream.RULE_NO_TIME,
                ) from None
            raise Unavailable(
                f"features: {error}",
                rule=upstream.RULE_SOURCE_FAILED,
                retry_after_ms=int(state.source.config.probe_interval_s * 1000),
            ) from None
        wall = clock.wall()
        judged = upstream.judge(contract, names, columns, entities=count, wall=wall)
        if isinstance(judged, upstream.Refusal):
            state.count("refused")
            raise FailedPrecondition(judged.message, rule=judged.rule)
        state.count("read")
        state.served(judged.age_s(wall))
        if state.cache.ttl_s > 0:
            state.cache.put(key, judged, now=clock.now(), wall=wall, max_age_s=contract.max_age_s)
        return judged, FeatureSnapshot(
            contract.definition_version, judged.oldest_event, judged.defaulted, False
        )

    @staticmethod
    def attach(
        request: service_pb2.ModelInferRequest, contract: FeatureContract, values: FeatureValues
    ) -> None:
        """The values as the contract's model input: FP32, ``[1, entities x features]``, raw
        when the request's other inputs are raw, typed otherwise."""
        tensor = request.inputs.add(name=contract.input, datatype="FP32")
        tensor.shape.extend([1, len(values.values)])
        if request.raw_input_contents:
            request.raw_input_contents.append(np.asarray(values.values, dtype=np.float32).tobytes())
        else:
            tensor.contents.fp32_contents.extend(values.values)

    async def close(self) -> None:
        for state in self.sources.values():
            await state.source.close()


def check_contracts(config: GatewayConfig, routes: RouteTable) -> None:
    """Load time: every route's contract against its source's registry, where the file exists
    (a ``ConfigError`` at the route's ``features.definition_version``)."""
    for name, route in routes.models.items():
        if route.features is None:
            continue
        source = config.feature_sources.get(route.features.source)
        if source is None or source.registry is None or not source.registry.exists():
            continue
        try:
            definitions = read_registry(source.registry)
        except RegistryError as error:
            raise _contract_error(config, name, ("source",), str(error)) from None
        contract = contract_of(route.features)
        problem = definitions.check(
            contract.feature_service, contract.definition_version, tuple(f.ref for f in contract.features)
        )
        if problem is not None:
            raise _contract_error(config, name, ("definition_version",), problem)


def _contract_error(config: GatewayConfig, route: str, key: tuple[str, ...], problem: str) -> ConfigError:
    return route_error(config.routes_dir, ("models", route, "features", *key), problem)


__all__ = ["Features", "check_contracts", "contract_of"]
