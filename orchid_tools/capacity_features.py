"""The worksheet's "Upstream/downstream" section (``orchid-gateway capacity FILE --gateway CONFIG``).

The seed's worksheet heading "Upstream/downstream: features/vector reads/preprocessing;
freshness/version; fan-out; caches", computed from a gateway config's ``feature_sources`` and its
routes' ``features:`` contracts (``gateway.config``): per route with a contract, the source, the
features per request, the entities bound, the reads (per second at the workload's rate for a class
calling that route, else per 1,000 requests), the upstream reserve the record holds before any
measurement (the source's ``budget_ms``: ``UpstreamHealth.reserve_ms`` with no sample), the cache's
TTL bound (``cache_ttl_ms`` and the contract's smallest ``max_age_s``, as ``FeatureCache.put``
bounds an entry), and the source's ``max_concurrency`` against the reads in flight Little's law
predicts (rate x budget), with a warning figure when they exceed it.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.config import GatewayConfig, RouteTable
from gateway.core.upstream import UpstreamHealth
from gateway.features import contract_of
from orchid_tools.capacity import Figure, Section

TITLE = "Upstream/downstream"


def _n(value: float) -> str:
    text = f"{value:,.3f}".rstrip("0").rstrip(".")
    return text or "0"


def upstream_section(
    config: GatewayConfig, routes: RouteTable, rates: Mapping[str, float] | None = None
) -> Section | None:
    """The section, or None when no route reads features. ``rates``: requests/s per route."""
    rates = rates or {}
    figures: list[Figure] = []
    for name, route in sorted(routes.models.items()):
        if route.features is None:
            continue
        contract = contract_of(route.features)
        source = config.feature_sources[contract.source]
        health = UpstreamHealth(budget_ms=source.budget_ms, quantile=source.latency_quantile)
        reserve_ms = health.reserve_ms(0.0)  # no sample yet: the budget
        count = len(contract.features)
        key = f"upstream.{name}"
        figures.append(
            Figure(
                f"{key}.features",
                f"{name}: features per request",
                count,
                "",
                f"source {contract.source} ({source.url}), feature service {contract.feature_service} "
                f"at definition {contract.definition_version}: "
                + ", ".join(f.ref for f in contract.features)
                + "; one batched read per request",
            )
        )
        figures.append(
            Figure(
                f"{key}.max_entities",
                f"{name}: entities per request, at most",
                contract.max_entities,
                "",
                f"max_entities: one read carries at most {contract.max_entities} x {count} = "
                f"{contract.max_entities * count} values (the fan-out bound)",
            )
        )
        rate = rates.get(name)
        if rate is not None:
            figures.append(
                Figure(
                    f"{key}.reads_per_s",
                    f"{name}: reads at the planned rate",
                    rate,
                    "reads/s",
                    f"{_n(rate)} req/s x 1 batched read, before cache hits",
                    decimals=1,
                )
            )
        else:
            figures.append(
                Figure(
                    f"{key}.reads_per_1000",
                    f"{name}: reads per 1,000 requests",
                    1000,
                    "reads",
                    "no workload class calls this route: 1 batched read per request, before cache hits",
                )
            )
        figures.append(
            Figure(
                f"{key}.reserve_ms",
                f"{name}: upstream reserve",
                reserve_ms,
                "ms",
                f"{contract.source}'s budget_ms before any read is measured; then the "
                f"p{source.latency_quantile * 100:g} of its reads over {_n(source.window_s)} s; over the "
                f"budget (>= {source.min_samples} reads) new requests are refused early"
                + ("" if source.backpressure else " (backpressure is off for this source)"),
                decimals=1,
            )
        )
        ttl_s = min(source.cache_ttl_ms / 1000.0, contract.max_age_s)
        figures.append(
            Figure(
                f"{key}.cache_ttl_s",
                f"{name}: cached values live at most",
                ttl_s,
                "s",
                f"min(cache_ttl_ms {_n(source.cache_ttl_ms)} ms, "
                f"smallest max_age_s {_n(contract.max_age_s)} s)"
                + ("; cache off" if source.cache_ttl_ms <= 0 else ""),
                decimals=3,
            )
        )
        figures.append(
            Figure(
                f"{key}.max_concurrency",
                f"{name}: {contract.source} reads in flight, at most",
                source.max_concurrency,
                "",
                f"max_concurrency (one connection each): at the {_n(source.budget_ms)} ms budget it carries "
                f"{_n(source.max_concurrency / (source.budget_ms / 1000.0))} reads/s",
            )
        )
        if rate is not None:
            inflight = rate * source.budget_ms / 1000.0
            figures.append(
                Figure(
                    f"{key}.inflight",
                    f"{name}: reads in flight (Little's law)",
                    inflight,
                    "",
                    f"{_n(rate)} reads/s x {_n(source.budget_ms)} ms budget, before cache hits",
                    decimals=2,
                )
            )
            if inflight > source.max_concurrency:
                figures.append(
                    Figure(
                        f"{key}.warning",
                        f"{name}: WARNING reads in flight over max_concurrency",
                        inflight / source.max_concurrency,
                        "×",
                        f"{_n(inflight)} > {source.max_concurrency}: reads wait for a connection within "
                        f"their {_n(source.timeout_ms)} ms timeout; raise max_concurrency or cache more",
                        decimals=2,
                    )
                )
    return Section(TITLE, tuple(figures)) if figures else None


def route_rates(classes: Mapping[str, tuple[str, float]]) -> dict[str, float]:
    """Requests/s per route from the workload's classes (name -> (model, rate))."""
    out: dict[str, float] = {}
    for model, rate in classes.values():
        out[model] = out.get(model, 0.0) + rate
    return out
