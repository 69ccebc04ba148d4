"""Prefix affinity at run time: the per-pool prefix indexes, the learned hit rates and the
per-route counters (the decisions themselves are ``gateway.core.prefix``'s).

One ``PrefixAffinity`` belongs to the pool registry. For a request to a route whose backend
model declares a prefix cache (``ModelSpec.prefix_cache``), placement asks it for the
request's scope and block keys (``query``), ranks the candidate pools by expected saving
inside the route's load bound (``core.prefix.choose``) and hands the chosen pool's match
to pricing (``PrefixMatch.priced_tokens``: the index's expectation times the learned rate).
When the request is sent, its blocks are recorded in that pool's index (``sent``); when it
is answered, the backend's reported cached tokens teach the rate and the counters
(``observe``), which ``/metrics``, the status page and the simulator read.

It reads request bytes and response parameters; it reserves nothing and decides nothing
beyond what the pure core returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tritonclient.grpc import service_pb2

from gateway.core.prefix import (
    CACHED_TOKENS_OUTPUT,
    CACHED_TOKENS_PARAMETER,
    TOKEN_BYTES,
    HitRate,
    PrefixCacheSpec,
    PrefixIndex,
    PrefixMatch,
    PrefixQuery,
    block_keys,
    scope_for,
)
from gateway.shape import prompt_bytes


@dataclass(slots=True)
class RouteCounters:
    """One route's prefix-cache figures since start (monotonic)."""

    requests: int = 0  # answered requests to a backend model with a prefix cache
    expected_hits: int = 0  # of them, placed where the index expected a hit
    reported_hits: int = 0  # of them, answered with a hit the backend reported
    prompt_tokens: int = 0  # their prompt tokens
    cached_tokens: int = 0  # the prompt tokens the backend reported its cache served
    saved_accelerator_ms: float = 0.0  # the prefill those tokens did not cost (the profile's price)
    spills: int = 0  # requests sent elsewhere because the best saving was outside the bound
    extra_wait_ms_max: float = 0.0  # the largest predicted wait affinity added over the least

    @property
    def hit_rate(self) -> float:
        return self.reported_hits / self.requests if self.requests else 0.0


def reported_tokens(response: service_pb2.ModelInferResponse) -> int:
    """The prompt tokens the backend reported its prefix cache served (0: none reported):
    the response parameter, else the first row of the INT32 output (``core.prefix``)."""
    if CACHED_TOKENS_PARAMETER in response.parameters:
        return max(0, int(response.parameters[CACHED_TOKENS_PARAMETER].int64_param))
    for i, output in enumerate(response.outputs):
        if output.name != CACHED_TOKENS_OUTPUT:
            continue
        if i < len(response.raw_output_contents) and len(response.raw_output_contents[i]) >= TOKEN_BYTES:
            return max(
                0, int.from_bytes(response.raw_output_contents[i][:TOKEN_BYTES], "little", signed=True)
            )
        if output.contents.int_contents:
            return max(0, int(output.contents.int_contents[0]))
    return 0


class PrefixAffinity:
    """The indexes, rates and counters of every prefix-cache pool."""

    def __init__(self) -> None:
        self.indexes: dict[str, PrefixIndex] = {}
        self.rates = HitRate()
        self.counters: dict[str, RouteCounters] = {}
        # Called with each observed match and its reported tokens, on the answered request's
        # task (the simulator attributes placements to its arrivals with it); None: nobody.
        self.on_observed: Callable[[PrefixMatch, int], None] | None = None

    def index(self, pool: str, spec: PrefixCacheSpec) -> PrefixIndex:
        index = self.indexes.get(pool)
        if index is None:
            index = self.indexes[pool] = PrefixIndex(spec.capacity_blocks)
        return index

    def route(self, name: str) -> RouteCounters:
        counters = self.counters.get(name)
        if counters is None:
            counters = self.counters[name] = RouteCounters()
        return counters

    @staticmethod
    def query(
        request: service_pb2.ModelInferRequest,
        input_name: str,
        spec: PrefixCacheSpec,
        *,
        tenant: str,
        cell: str,
        model: str,
        version: str,
    ) -> PrefixQuery:
        raw = prompt_bytes(request, input_name)
        scope = scope_for(tenant, cell, model, version)
        return PrefixQuery(
            block_keys(scope, raw, spec.block_tokens), len(raw) // TOKEN_BYTES, spec.block_tokens
        )

    def match(
        self,
        query: PrefixQuery,
        pool: str,
        spec: PrefixCacheSpec,
        *,
        route: str,
        tenant: str,
        prefill_ms_per_token: float = 0.0,
        spilled: bool = False,
        extra_wait_ms: float = 0.0,
    ) -> PrefixMatch:
        """The match of ``query`` on ``pool``, priced by the learned rate."""
        index_tokens = query.tokens(self.index(pool, spec).match(query.keys))
        return PrefixMatch(
            query,
            pool,
            index_tokens,
            self.rates.expected_tokens(route, tenant, index_tokens),
            prefill_ms_per_token,
            spilled,
            extra_wait_ms,
        )

    def sent(self, match: PrefixMatch) -> None:
        """The request was sent to its pool: the backend's cache now holds its blocks."""
        index = self.indexes.get(match.pool)
        if index is not None:  # created when the match was made
            index.record(match.query.keys)

    def observe(
        self,
        match: PrefixMatch,
        response: service_pb2.ModelInferResponse | None,
        *,
        route: str,
        tenant: str,
    ) -> int:
        """An answer: learn from the backend's reported cached tokens (absent: 0) and count.
        Returns the reported tokens."""
        reported = reported_tokens(response) if response is not None else 0
        self.rates.observe(route, tenant, match.index_tokens, reported)
        counters = self.route(route)
        counters.requests += 1
        counters.prompt_tokens += match.query.input_tokens
        if match.index_tokens > 0:
            counters.expected_hits += 1
        if reported > 0:
            counters.reported_hits += 1
            counters.cached_tokens += reported
            counters.saved_accelerator_ms += reported * match.prefill_ms_per_token
        if match.spilled:
            counters.spills += 1
        counters.extra_wait_ms_max = max(counters.extra_wait_ms_max, match.extra_wait_ms)
        if self.on_observed is not None:
            self.on_observed(match, reported)
        return reported
