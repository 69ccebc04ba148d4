"""Telemetry: metrics, traces and the decision log, fed by the request path's typed events.

The pipeline emits ``decided`` (every admission decision) and ``settled``
(every completed request, with observed work), and the stream code ``stream_settled`` (a
stream request's end, with its ``GapTracker`` summary), to a ``GatewayListener``;
``Telemetry`` is the listener that turns them into

* Prometheus metrics (scraped from ``telemetry.metrics_listen``, the
  ecosystem's convention): decisions by outcome and rule, queue dwell,
  completion latency, deadline misses, predicted vs observed demand, charged
  accelerator-ms, the ladder step per pool; streams' first result and inter-result gaps
  (``orchid_stream_*``);
* OpenTelemetry spans, one trace per request with a span per stage
  (``admission`` = authenticate + shape + estimate + policy, ``queue``,
  ``backend``), built after the fact from stage timestamps so the request path
  carries no tracing calls; sampled (``trace_sample_ratio``);
* decision-log lines (``gateway.policy.decision_log``: whitelisted fields only);
* gauges read at scrape time from the bound ``Gateway`` (``GatewayCollector``): each
  pool's offered demand, protected envelope, healthy devices and queue depth, and each
  backend's readiness (what the status page and the alert rules read).

``ListenerGroup`` fans the request path's events out to several listeners (telemetry
and the status page's ``gateway.statusboard.StatusBoard``).

What never leaves through here: tensors, outputs, prompts, request parameter
values, metadata values. Labels carry model, class, rule, outcome; a tenant id
only when ``tenant_labels`` is configured (cardinality and privacy).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client import metrics as _prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gateway import clock
from gateway.config import TelemetryConfig
from gateway.core.record import Decision, RequestRecord, Verdict
from gateway.core.streaming import StreamSummary
from gateway.exchange import GatewayListener, Settled, StageTimes
from gateway.features import AGE_BUCKETS_S, Features
from gateway.pipeline import Gateway
from gateway.policy.decision_log import DecisionLog
from gateway.policy.snapshot import PolicyResult
from gateway.prefix_affinity import PrefixAffinity

log = logging.getLogger("orchid.telemetry")

# Latency buckets (seconds) around the seed's 200 ms interactive objective.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 30.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


class CounterSeries:
    """One counter's series: label values -> a one-element cell (``[value]``) the request path
    adds to, and the wall time each series was first fed (the ``_created`` sample). Read by
    ``Metrics.collect`` at scrape time: no lock, no allocation per increment (prometheus_client's
    ``labels(...).inc()`` validates, locks and, for a new child, allocates on every call)."""

    __slots__ = ("created", "doc", "labelnames", "name", "values")

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self.values: dict[tuple[str, ...], list[float]] = {}
        self.created: dict[tuple[str, ...], float] = {}

    def cell(self, labels: tuple[str, ...]) -> list[float]:
        """The series of ``labels`` (created at zero on first use: it shows from then on)."""
        cell = self.values.get(labels)
        if cell is None:
            self.created[labels] = time.time()
            cell = self.values[labels] = [0.0]
        return cell

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.cell(labels)[0] += amount

    def family(self, use_created: bool) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.doc, labels=list(self.labelnames))
        created = self.created
        for labels, cell in list(self.values.items()):
            family.add_metric(labels, cell[0], created[labels] if use_created else None)
        return family


class HistogramSeries:
    """One histogram's series: label values -> a cell of per-bucket counts (not cumulative, as
    prometheus_client keeps them) followed by the sum; ``observe`` finds the bucket by bisection
    (the first upper bound ``>=`` the value, as prometheus_client's scan)."""

    __slots__ = ("bounds", "created", "doc", "labelnames", "les", "name", "values")

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self.bounds = (*buckets, float("inf"))
        # The ``le`` labels as prometheus_client writes them (``floatToGoString``: "0.001", "+Inf").
        self.les: tuple[str, ...] = tuple(
            str(floatToGoString(bound))  # type: ignore[no-untyped-call]
            for bound in self.bounds
        )
        self.values: dict[tuple[str, ...], list[float]] = {}
        self.created: dict[tuple[str, ...], float] = {}

    def cell(self, labels: tuple[str, ...]) -> list[float]:
        """Bucket counts then the sum (``len(bounds) + 1`` entries), zero on first use."""
        cell = self.values.get(labels)
        if cell is None:
            self.created[labels] = time.time()
            cell = self.values[labels] = [0.0] * (len(self.bounds) + 1)
        return cell

    def observe_into(self, cell: list[float], value: float) -> None:
        if value == value:  # NaN falls in no bucket (prometheus_client: ``value <= bound`` never holds)
            cell[bisect_left(self.bounds, value)] += 1.0
        cell[-1] += value

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        self.observe_into(self.cell(labels), value)

    def family(self, use_created: bool) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labelnames))
        created, les, names = self.created, self.les, self.labelnames
        for labels, cell in list(self.values.items()):
            counts = list(cell)  # one copy: the request path may add while the scrape reads
            cumulative, buckets = 0.0, []
            for le, count in zip(les, counts, strict=False):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(labels, buckets, counts[-1])
            if use_created:
                family.samples.append(
                    Sample(
                        self.name + "_created", dict(zip(names, labels, strict=True)), created[labels], None
                    )
                )
        return family


class GaugeSeries:
    """A gauge's series: label values -> value (set, not added)."""

    __slots__ = ("doc", "labelnames", "name", "values")

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = float(value)

    def family(self, use_created: bool) -> GaugeMetricFamily:
        family = GaugeMetricFamily(self.name, self.doc, labels=list(self.labelnames))
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value)
        return family


class Metrics:
    """The gateway's Prometheus metrics, in their own registry (tests create many).

    Plain accumulators (``CounterSeries``, ``HistogramSeries``, ``GaugeSeries``) that the
    request path feeds and this collector reads when scraped: the same names, help texts,
    labels, buckets and samples (``_created`` included) the prometheus_client metrics they
    replace exposed (``tests/test_metrics_golden.py``)."""

    def __init__(self, registry: CollectorRegistry, *, include_process_registry: bool = True) -> None:
        self.registry = registry
        if include_process_registry:
            # The policy store's metrics (reloads, evaluation latency, rule errors, fail-open)
            # and the process collectors live in the process-wide registry: scrape them too.
            registry.register(REGISTRY)
        self.decisions = CounterSeries(
            "orchid_decisions",
            "Admission decisions by outcome and deciding rule",
            ("model", "request_class", "outcome", "rule", "tenant"),
        )
        self.failures = CounterSeries(
            "orchid_failed_responses",
            "Calls answered with an error status (rejections included), by status and rule",
            ("status", "rule"),
        )
        self.queue_dwell = HistogramSeries(
            "orchid_queue_dwell_seconds",
            "Time from arrival to dispatch",
            ("request_class",),
            _LATENCY_BUCKETS,
        )
        self.first_result = HistogramSeries(
            "orchid_first_result_seconds",
            "Time from arrival to the first result (a stream's first token; unary: the response)",
            ("request_class", "model"),
            _LATENCY_BUCKETS,
        )
        self.completion = HistogramSeries(
            "orchid_completion_seconds",
            "Time from arrival to the last result",
            ("request_class", "model"),
            _LATENCY_BUCKETS,
        )
        self.deadline_misses = CounterSeries(
            "orchid_deadline_misses",
            "Admitted requests that completed after their deadline",
            ("request_class", "model"),
        )
        self.predicted_ms = CounterSeries(
            "orchid_predicted_accelerator_ms", "Predicted accelerator-ms of completed work", ("model",)
        )
        self.charged_ms = CounterSeries(
            "orchid_charged_accelerator_ms",
            "Observed (charged) accelerator-ms of completed work",
            ("model", "tenant"),
        )
        self.prediction_ratio = HistogramSeries(
            "orchid_observed_over_predicted",
            "Observed / predicted accelerator-ms per request (1.0 = exact)",
            ("model", "bucket"),
            _RATIO_BUCKETS,
        )
        self.useful_tokens = CounterSeries(
            "orchid_input_tokens", "Useful input tokens of completed work", ("model",)
        )
        self.successes = CounterSeries(
            "orchid_validated_successes",
            "Completed responses delivered within deadline (denominator of cost per validated success)",
            ("model",),
        )
        self.ladder_step = GaugeSeries("orchid_ladder_step", "Overload ladder step (0-6)", ("pool",))
        # Streams (``stream_settled``): the first result and the gaps between results.
        self.stream_first_result = HistogramSeries(
            "orchid_stream_first_result_seconds",
            "A stream's time from arrival to its first result",
            ("request_class", "model"),
            _LATENCY_BUCKETS,
        )
        self.stream_gap = HistogramSeries(
            "orchid_stream_gap_seconds",
            "Time between two consecutive results of a stream",
            ("request_class", "model"),
            _LATENCY_BUCKETS,
        )
        self.stream_gap_misses = CounterSeries(
            "orchid_stream_gap_objective_misses",
            "Gaps between two results of a stream longer than its gap objective",
            ("request_class", "model"),
        )
        self.stream_first_result_misses = CounterSeries(
            "orchid_stream_first_result_misses",
            "Streams whose first result arrived after its deadline (or never)",
            ("request_class", "model"),
        )
        # In the order the scrape shows them (the order the prometheus_client metrics registered).
        self.series: tuple[CounterSeries | HistogramSeries | GaugeSeries, ...] = (
            self.decisions,
            self.failures,
            self.queue_dwell,
            self.first_result,
            self.completion,
            self.deadline_misses,
            self.predicted_ms,
            self.charged_ms,
            self.prediction_ratio,
            self.useful_tokens,
            self.successes,
            self.ladder_step,
            self.stream_first_result,
            self.stream_gap,
            self.stream_gap_misses,
            self.stream_first_result_misses,
        )
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        for series in self.series:
            yield series.family(False)

    def collect(self) -> Iterator[Metric]:
        use_created = bool(_prometheus_metrics._use_created)
        for series in self.series:
            yield series.family(use_created)


# At most this many label combinations are cached per event; a full cache starts over.
MAX_CACHED_LABELS = 4096


class _SettledChildren:
    """The series one settled request of a (class, model, tenant, bucket) feeds, as cells.
    Those a request feeds only sometimes (a miss, a success, a ratio) are created on first
    use, as before: a series shows in the scrape from its first use, even at zero."""

    __slots__ = (
        "_bucket",
        "_deadline_misses",
        "_metrics",
        "_prediction_ratio",
        "_request_class",
        "_successes",
        "charged_ms",
        "completion",
        "first_result",
        "model",
        "predicted_ms",
        "queue_dwell",
        "useful_tokens",
    )

    def __init__(self, m: Metrics, request_class: str, model: str, tenant: str, bucket: str) -> None:
        self._metrics, self._request_class, self.model, self._bucket = m, request_class, model, bucket
        self.queue_dwell = m.queue_dwell.cell((request_class,))
        self.first_result = m.first_result.cell((request_class, model))
        self.completion = m.completion.cell((request_class, model))
        self.predicted_ms = m.predicted_ms.cell((model,))
        self.charged_ms = m.charged_ms.cell((model, tenant))
        self.useful_tokens = m.useful_tokens.cell((model,))
        self._deadline_misses: list[float] | None = None
        self._successes: list[float] | None = None
        self._prediction_ratio: list[float] | None = None

    @property
    def deadline_misses(self) -> list[float]:
        if self._deadline_misses is None:
            self._deadline_misses = self._metrics.deadline_misses.cell((self._request_class, self.model))
        return self._deadline_misses

    @property
    def successes(self) -> list[float]:
        if self._successes is None:
            self._successes = self._metrics.successes.cell((self.model,))
        return self._successes

    @property
    def prediction_ratio(self) -> list[float]:
        if self._prediction_ratio is None:
            self._prediction_ratio = self._metrics.prediction_ratio.cell((self.model, self._bucket))
        return self._prediction_ratio


class ListenerGroup(GatewayListener):
    """Every event to each listener, in order (the gateway holds one listener)."""

    def __init__(self, *listeners: GatewayListener) -> None:
        self.listeners = listeners

    def decided(self, record: RequestRecord, decision: Decision, policy: PolicyResult) -> None:
        for listener in self.listeners:
            listener.decided(record, decision, policy)

    def settled(self, settled: Settled) -> None:
        for listener in self.listeners:
            listener.settled(settled)

    def failed(self, status: str, rule: str) -> None:
        for listener in self.listeners:
            listener.failed(status, rule)

    def ladder(self, pool: str, step: int) -> None:
        for listener in self.listeners:
            listener.ladder(pool, step)

    def stream_settled(self, settled: Settled, stream: StreamSummary) -> None:
        for listener in self.listeners:
            listener.stream_settled(settled, stream)


# Gauges the collector reads from the gateway at scrape time (name -> help, labels).
GATEWAY_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "orchid_pool_offered_accelerator_ms_per_second": (
        "Offered (admissible) accelerator-ms per second, the ladder's recent point estimate",
        ("pool",),
    ),
    "orchid_pool_protected_accelerator_ms_per_second": (
        "The pool's protected envelope: healthy devices x protected utilization x 1000 ms/s",
        ("pool",),
    ),
    "orchid_pool_utilization": ("Offered demand over the protected envelope (1.0 = the envelope)", ("pool",)),
    "orchid_pool_healthy_devices": ("Devices of the pool on a healthy backend", ("pool",)),
    "orchid_pool_devices": ("Devices configured for the pool", ("pool",)),
    "orchid_pool_queue_depth": ("Requests waiting in the pool's dispatch queue", ("pool",)),
    "orchid_pool_queued_accelerator_ms": ("Predicted accelerator-ms waiting in the pool's queue", ("pool",)),
    "orchid_pool_queue_dwell_p95_seconds": ("Queue dwell p95 over the ladder's window", ("pool",)),
    "orchid_backend_ready": ("1 when the backend's server answers ready to the health probe", ("backend",)),
    "orchid_backend_model_ready": (
        "1 when a watched model is loaded and ready on the backend (warm)",
        ("backend", "model"),
    ),
}


# Counters the collector reads from the pools' dispatch queues at scrape time.
CO_BATCHED = "orchid_pool_co_batched_requests"
CO_BATCHED_HELP = (
    "Requests the pool's dispatch queue bound into a batch already waiting in the backend's queue "
    "(co-batching, limits.co_batch_max)"
)


class GatewayCollector:
    """Pool and backend gauges (and the pools' co-batching counter), read from the bound
    ``Gateway`` when scraped (no sampling loop: the values are the ones the ladder and the
    status page read)."""

    def __init__(self) -> None:
        self.gateway: Gateway | None = None

    def describe(self) -> Iterator[Metric]:
        for name, (doc, labels) in GATEWAY_GAUGES.items():
            yield GaugeMetricFamily(name, doc, labels=list(labels))
        yield CounterMetricFamily(CO_BATCHED, CO_BATCHED_HELP, labels=["pool"])
        yield from _feature_families(None)
        yield from _prefix_families(None)

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(name, doc, labels=list(labels))
            for name, (doc, labels) in GATEWAY_GAUGES.items()
        }
        co_batched = CounterMetricFamily(CO_BATCHED, CO_BATCHED_HELP, labels=["pool"])
        gateway = self.gateway
        if gateway is not None:
            queues = {queue.name: queue for queue in gateway.pools.queues()}
            for pool, dispatch in queues.items():
                co_batched.add_metric([pool], float(dispatch.co_batched))
            for name, load in list(gateway.loads.items()):
                evidence = load.evidence
                queue = queues.get(name)
                values = {
                    "orchid_pool_devices": float(load.devices),
                    "orchid_pool_queue_depth": float(queue.queued) if queue is not None else 0.0,
                    "orchid_pool_queued_accelerator_ms": queue.queued_ms if queue is not None else 0.0,
                }
                if evidence is not None:
                    values.update(
                        {
                            "orchid_pool_offered_accelerator_ms_per_second": evidence.offered_ms_per_s,
                            "orchid_pool_protected_accelerator_ms_per_second": (
                                evidence.protected_capacity_ms_per_s
                            ),
                            "orchid_pool_utilization": evidence.utilization,
                            "orchid_pool_healthy_devices": float(evidence.healthy_devices),
                            "orchid_pool_queue_dwell_p95_seconds": evidence.queue_dwell_p95_ms / 1000.0,
                        }
                    )
                for metric, value in values.items():
                    families[metric].add_metric([name], value)
            for backend, handle in list(gateway.backends.items()):
                client = handle.client
                families["orchid_backend_ready"].add_metric([backend], 1.0 if client.healthy else 0.0)
                for model in sorted(client.watched_models):
                    families["orchid_backend_model_ready"].add_metric(
                        [backend, model], 1.0 if client.is_warm(model) else 0.0
                    )
        yield from families.values()
        yield co_batched
        yield from _feature_families(gateway.features if gateway is not None else None)
        yield from _prefix_families(gateway.pools.prefix if gateway is not None else None)


# Per route (the logical model), from gateway.prefix_affinity's counters at scrape time.
PREFIX_COUNTERS = {
    "orchid_prefix_requests": ("Answered requests to a model with a prefix cache", "requests"),
    "orchid_prefix_expected_hits": (
        "Of them, requests placed where the gateway's prefix index expected a cache hit",
        "expected_hits",
    ),
    "orchid_prefix_hits": ("Of them, answers whose backend reported a prefix-cache hit", "reported_hits"),
    "orchid_prefix_prompt_tokens": ("Their prompt tokens", "prompt_tokens"),
    "orchid_prefix_cached_tokens": (
        "The prompt tokens their backends reported served from the prefix cache",
        "cached_tokens",
    ),
    "orchid_prefix_saved_accelerator_ms": (
        "Prefill accelerator-ms the reported cache hits saved (the route profile's price per token)",
        "saved_accelerator_ms",
    ),
    "orchid_prefix_spills": (
        "Requests placed off the backend with the best expected hit because its predicted wait was "
        "beyond the route's prefix_affinity.max_extra_wait_ms",
        "spills",
    ),
}


def _prefix_families(prefix: PrefixAffinity | None) -> Iterator[Metric]:
    """Each prefix-cache route's requests, hits, cached tokens, saved accelerator-ms and spills
    (``gateway.prefix_affinity``), and the largest extra predicted wait affinity chose."""
    families = {
        name: (CounterMetricFamily(name, doc, labels=["model"]), field)
        for name, (doc, field) in PREFIX_COUNTERS.items()
    }
    extra = GaugeMetricFamily(
        "orchid_prefix_extra_wait_ms_max",
        "The largest predicted wait above the least-loaded backend's that prefix affinity chose",
        labels=["model"],
    )
    if prefix is not None:
        for route, counters in sorted(prefix.counters.items()):
            for family, field in families.values():
                family.add_metric([route], float(getattr(counters, field)))
            extra.add_metric([route], counters.extra_wait_ms_max)
    for family, _ in families.values():
        yield family
    yield extra


def _feature_families(features: Features | None) -> Iterator[Metric]:
    """Each feature source's reads by outcome, its cache's hits and misses, the age of the
    oldest value each request used, its upstream reserve and state (``gateway.features``)."""
    reads = CounterMetricFamily(
        "orchid_feature_reads",
        "Feature reads by outcome: read, cache_hit, refused (the contract), failed, timeout, "
        "backpressure, incompatible, definitions_unavailable",
        labels=["source", "outcome"],
    )
    hits = CounterMetricFamily(
        "orchid_feature_cache_hits", "Feature reads the scoped cache answered", labels=["source"]
    )
    misses = CounterMetricFamily(
        "orchid_feature_cache_misses", "Feature reads the cache did not answer", labels=["source"]
    )
    entries = GaugeMetricFamily(
        "orchid_feature_cache_entries", "Entries in the feature cache", labels=["source"]
    )
    reserve = GaugeMetricFamily(
        "orchid_feature_upstream_reserve_ms",
        "The upstream reserve a request's slack sets aside: the source's recent read latency quantile",
        labels=["source"],
    )
    state = GaugeMetricFamily(
        "orchid_feature_source_state",
        "1 for the source's state (ok, late, failing)",
        labels=["source", "state"],
    )
    age = HistogramMetricFamily(
        "orchid_feature_value_age_seconds",
        "Age (event time to use) of the oldest feature value each request used",
        labels=["source"],
    )
    if features is not None:
        now = clock.now()
        for name, source in features.sources.items():
            for outcome, count in sorted(source.outcomes.items()):
                reads.add_metric([name, outcome], float(count))
            hits.add_metric([name], float(source.cache.hits))
            misses.add_metric([name], float(source.cache.misses))
            entries.add_metric([name], float(len(source.cache)))
            health = source.source.health
            reserve.add_metric([name], health.reserve_ms(now))
            current = health.state(now)
            for each in ("ok", "late", "failing"):
                state.add_metric([name, each], 1.0 if each == current else 0.0)
            cumulative, buckets = 0, []
            for bound, count in zip(AGE_BUCKETS_S, source.age_counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", float(cumulative)))
            age.add_metric([name], buckets, source.age_sum_s)
    yield from (reads, hits, misses, entries, reserve, state, age)


class Telemetry(GatewayListener):
    def __init__(
        self,
        config: TelemetryConfig,
        *,
        registry: CollectorRegistry | None = None,
        span_exporter: SpanExporter | None = None,
        decision_log: DecisionLog | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics(registry or CollectorRegistry())
        self.collector = GatewayCollector()
        self.metrics.registry.register(self.collector)
        self.decision_log = decision_log or DecisionLog(logging.getLogger("orchid.decisions"))
        provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.trace_sample_ratio)))
        if span_exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        self.provider = provider
        self.tracer = provider.get_tracer("orchid-gateway")
        # Monotonic -> wall clock, for span timestamps (OTel wants epoch nanoseconds).
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        # The series' cells, looked up once per label values (a request settles into eight
        # of them). Bounded: the labels come from configuration (classes, models, tenants,
        # buckets, rules).
        self._settled_cache: dict[tuple[str, str, str, str], _SettledChildren] = {}
        self._decision_cache: dict[tuple[str, str, Verdict, str, str], list[float]] = {}

    def bind(self, gateway: Gateway) -> None:
        """Read pool and backend gauges from ``gateway`` at scrape time."""
        self.collector.gateway = gateway

    def _tenant(self, tenant: str) -> str:
        return tenant if self.config.tenant_labels else "-"

    # ------------------------------------------------------------ events

    def decided(self, record: RequestRecord, decision: Decision, policy: PolicyResult) -> None:
        identity = record.identity
        rule = decision.rules[0] if decision.verdict is Verdict.REJECT and decision.rules else ""
        key = (identity.model, identity.request_class, decision.verdict, rule, identity.tenant)
        cell = self._decision_cache.get(key)
        if cell is None:
            if len(self._decision_cache) >= MAX_CACHED_LABELS:
                self._decision_cache.clear()
            cell = self._decision_cache[key] = self.metrics.decisions.cell(
                (
                    identity.model,
                    identity.request_class,
                    str(decision.verdict),
                    rule,
                    self._tenant(identity.tenant),
                )
            )
        cell[0] += 1.0
        if not self.decision_log.records(policy):
            return
        self.decision_log.record(
            decision_id=identity.request_id,
            at_unix_s=time.time(),
            record=record,
            result=policy,
            outcome=f"{decision.verdict}:{decision.route_reason}"
            if decision.rules or policy.allowed
            else None,
            fallback_refused=decision.fallback_refused,
        )

    def failed(self, status: str, rule: str) -> None:
        self.metrics.failures.inc((status, rule))

    def settled(self, settled: Settled) -> None:
        record, decision, outcome = settled.record, settled.decision, settled.outcome
        identity = record.identity
        c = self._settled_cache.get(
            (identity.request_class, decision.target_model, identity.tenant, record.shape.bucket)
        )  # ``_settled_children``'s cache, read here first (its hit is every request but the first)
        if c is None:
            c = self._settled_children(identity.request_class, decision.target_model, identity.tenant, record)
        m = self.metrics
        m.queue_dwell.observe_into(c.queue_dwell, outcome.queue_ms / 1000.0)
        total_s = (outcome.queue_ms + outcome.completion_ms) / 1000.0
        m.first_result.observe_into(c.first_result, (outcome.queue_ms + outcome.first_result_ms) / 1000.0)
        m.completion.observe_into(c.completion, total_s)
        if total_s * 1000.0 > record.budget.deadline_ms:
            c.deadline_misses[0] += 1.0
        else:
            c.successes[0] += 1.0
        predicted_ms = record.demand.accelerator_ms
        c.predicted_ms[0] += predicted_ms
        c.charged_ms[0] += outcome.charged_accelerator_ms
        if predicted_ms > 0:
            m.prediction_ratio.observe_into(
                c.prediction_ratio, outcome.observed_accelerator_ms / predicted_ms
            )
        c.useful_tokens[0] += record.shape.input_tokens * record.shape.items
        if settled.stages is not None and self.config.trace_sample_ratio > 0:
            self._spans(settled, settled.stages)

    def stream_settled(self, settled: Settled, stream: StreamSummary) -> None:
        """A stream ended: its first result and every gap it kept (``MAX_KEPT_GAPS``; the miss
        counter counts them all), by class and the model that answered."""
        m = self.metrics
        labels = (settled.record.identity.request_class, settled.decision.target_model)
        if stream.first_result_ms is not None:
            m.stream_first_result.observe(labels, stream.first_result_ms / 1000.0)
        if not stream.first_result_met:
            m.stream_first_result_misses.inc(labels)
        if stream.gaps_ms:
            gap = m.stream_gap.cell(labels)
            for gap_ms in stream.gaps_ms:
                m.stream_gap.observe_into(gap, gap_ms / 1000.0)
        if stream.gaps_over_objective:
            m.stream_gap_misses.inc(labels, stream.gaps_over_objective)

    def _settled_children(
        self, request_class: str, model: str, tenant: str, record: RequestRecord
    ) -> _SettledChildren:
        key = (request_class, model, tenant, record.shape.bucket)
        children = self._settled_cache.get(key)
        if children is None:
            if len(self._settled_cache) >= MAX_CACHED_LABELS:
                self._settled_cache.clear()
            children = self._settled_cache[key] = _SettledChildren(
                self.metrics, request_class, model, self._tenant(tenant), record.shape.bucket
            )
        return children

    def ladder(self, pool: str, step: int) -> None:
        self.metrics.ladder_step.set((pool,), step)

    # ------------------------------------------------------------ traces

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    def _spans(self, settled: Settled, stages: StageTimes) -> None:
        record, decision = settled.record, settled.decision
        attributes: dict[str, str | int | float] = {
            "orchid.request_id": record.identity.request_id,
            "orchid.model": decision.target_model,
            "orchid.class": record.identity.request_class,
            "orchid.bucket": record.shape.bucket,
            "orchid.route_reason": decision.route_reason,
            "orchid.ladder_step": decision.ladder_step,
            "orchid.policy_version": decision.policy_version,
            "orchid.predicted_accelerator_ms": record.demand.accelerator_ms,
            "orchid.charged_accelerator_ms": settled.outcome.charged_accelerator_ms,
        }
        root = self.tracer.start_span(
            "orchid.request", start_time=self._ns(stages.received_at), attributes=attributes
        )
        if not root.is_recording():
            return
        context = trace.set_span_in_context(root)
        for name, start, end in (
            ("admission", stages.received_at, stages.admitted_at),
            ("queue", stages.admitted_at, stages.dispatched_at),
            ("backend", stages.dispatched_at, stages.finished_at),
        ):
            span = self.tracer.start_span(
                name,
                context=context,
                start_time=self._ns(start),
                attributes={"orchid.request_id": record.identity.request_id},
            )
            span.end(end_time=self._ns(end))
        root.end(end_time=self._ns(stages.finished_at))
