"""Upstream features: a route's feature contract, judging what the source answered, the source's
health (its measured latency as the record's upstream reserve, and backpressure), and the
scoped cache of feature values. Pure: times are passed in (``now`` on the monotonic clock for
windows and the cache, ``wall`` in epoch seconds for event times), no I/O.

The seed's contracts: each feature names its authority (the source and the definition version
the model was trained on), its maximum age, its missing-value policy and how it reaches the
model (one input tensor); a model trained on definition v12 never silently consumes v13; one
inference makes one batched read over a bounded number of entities; cache keys carry the
tenant, the authorization scope, the definition version and the data generation; and when the
source is late, new requests that need it are refused before any accelerator time is spent
("backpressure should reach admission").

``judge`` turns one batched answer (per feature: values, statuses, event times, the shape of
Feast's ``get-online-features`` reply) into the tensor's values, or the contract's refusal.
``UpstreamHealth`` keeps the source's recent fetch latencies and failures: its reserve is their
high quantile; it backpressures while that quantile exceeds the source's budget or most recent
fetches failed, letting one probe through per ``probe_interval_s`` so that a recovered source
is seen (otherwise no request would ever measure it again). ``FeatureCache`` is a bounded LRU
whose entries live at most ``ttl_s`` and never past the maximum age of the oldest value in them.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum

# Feast's per-value statuses (``FieldStatus``): only PRESENT carries a value.
PRESENT = "PRESENT"

RULE_STALE = "features.stale"
RULE_MISSING = "features.missing"
RULE_INCOMPATIBLE = "features.incompatible_definition"
RULE_DEFINITIONS_UNAVAILABLE = "features.definitions_unavailable"
RULE_BACKPRESSURE = "features.upstream_backpressure"
RULE_SOURCE_FAILED = "features.source_failed"
RULE_NO_TIME = "features.no_time_left"
RULE_ENTITIES = "features.entities"


class Missing(Enum):
    """What a feature's missing (or too old) value does to the request."""

    REFUSE = "refuse"  # the request is refused (FAILED_PRECONDITION)
    DEFAULT = "default"  # the declared default is used, and the answer says so
    ALLOW = "allow"  # NaN goes to the model (it was trained to handle absence), and it is said


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """One feature of a contract: its reference on the source (``view:feature``), its maximum age
    and what a missing or too old value does."""

    ref: str
    max_age_s: float
    missing: Missing = Missing.REFUSE
    default: float = 0.0

    @property
    def view(self) -> str:
        return self.ref.partition(":")[0]

    @property
    def name(self) -> str:
        return self.ref.partition(":")[2]

    @property
    def full_name(self) -> str:
        """The name the source answers it under with full feature names (``view__feature``)."""
        return f"{self.view}__{self.name}"


@dataclass(frozen=True, slots=True)
class FeatureContract:
    """A route's features: the source, the feature service and the definition version the model
    was trained on, the entity keys (join key -> request parameter), the features in tensor
    order, and the model input they reach it as (``[items, entities x features]``, FP32)."""

    source: str
    feature_service: str
    definition_version: str
    entities: tuple[tuple[str, str], ...]  # (join key, request parameter)
    features: tuple[FeatureSpec, ...]
    input: str
    max_entities: int = 16

    @property
    def max_age_s(self) -> float:
        return min((f.max_age_s for f in self.features), default=math.inf)


@dataclass(frozen=True, slots=True)
class FeatureValues:
    """What a request's features came to: the tensor's values (entity-major), the oldest event
    time among the values used (epoch seconds; None when none was present), and the features
    defaulted or passed as missing (by full name)."""

    values: tuple[float, ...]
    oldest_event: float | None
    defaulted: tuple[str, ...] = ()

    def age_s(self, wall: float) -> float:
        return 0.0 if self.oldest_event is None else max(0.0, wall - self.oldest_event)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The contract refused the answer: the rule and a message for the caller."""

    rule: str
    message: str


def judge(
    contract: FeatureContract,
    feature_names: list[str],
    columns: list[tuple[list[object], list[str], list[float | None]]],
    *,
    entities: int,
    wall: float,
) -> FeatureValues | Refusal:
    """The tensor's values from one batched answer: ``feature_names`` and, per name, its values,
    statuses and event times (epoch seconds, None when absent), one per entity. A feature the
    answer lacks is a refusal whatever its policy (the source does not serve the contract); a
    value not PRESENT, or older than its maximum age, follows its policy."""
    index = {name: i for i, name in enumerate(feature_names)}
    out: list[float] = []
    defaulted: list[str] = []
    oldest: float | None = None
    for entity in range(entities):
        for spec in contract.features:
            column = index.get(spec.full_name, index.get(spec.name))
            if column is None:
                return Refusal(RULE_INCOMPATIBLE, f"the feature source does not serve {spec.ref}")
            values, statuses, events = columns[column]
            if entity >= len(values) or entity >= len(statuses):
                return Refusal(RULE_MISSING, f"the feature source answered no value of {spec.ref}")
            status = statuses[entity]
            event = events[entity] if entity < len(events) else None
            value = values[entity]
            problem = ""
            if status != PRESENT or not isinstance(value, (int, float)) or isinstance(value, bool):
                problem = f"{spec.ref} is missing ({status})"
            elif event is not None and wall - event > spec.max_age_s:
                problem = f"{spec.ref} is {wall - event:.0f} s old (its maximum age is {spec.max_age_s:g} s)"
            if not problem:
                out.append(float(value))  # type: ignore[arg-type]  # int or float, checked above
                if event is not None:
                    oldest = event if oldest is None else min(oldest, event)
                continue
            if spec.missing is Missing.REFUSE:
                return Refusal(RULE_STALE if "old" in problem else RULE_MISSING, problem)
            out.append(spec.default if spec.missing is Missing.DEFAULT else math.nan)
            if spec.full_name not in defaulted:
                defaulted.append(spec.full_name)
    return FeatureValues(tuple(out), oldest, tuple(defaulted))


@dataclass(frozen=True, slots=True)
class FeatureSnapshot:
    """What a request's features were, for provenance: definition version, the oldest event
    time used, the features defaulted or passed as missing, and whether the cache answered."""

    definition_version: str
    oldest_event: float | None
    defaulted: tuple[str, ...]
    cached: bool

    def provenance(self) -> dict[str, str | int | float | bool]:
        oldest = (
            datetime.fromtimestamp(self.oldest_event, UTC).isoformat().replace("+00:00", "Z")
            if self.oldest_event is not None
            else "none"
        )
        out: dict[str, str | int | float | bool] = {
            "orchid.feature_snapshot": f"{self.definition_version}@{oldest}",
            "orchid.feature_cached": self.cached,
        }
        if self.defaulted:
            out["orchid.features_defaulted"] = ",".join(self.defaulted)
        return out


# --------------------------------------------------------------------------- source health


@dataclass
class UpstreamHealth:
    """One feature source's recent reads: latency samples and failures over ``window_s``.

    ``reserve_ms``: the ``quantile`` of recent latencies (the budget before any sample): what a
    request's slack sets aside for its features. The source turns ``late`` when that quantile
    exceeds ``budget_ms``, or ``failing`` when most recent reads failed (either with at least
    ``min_samples`` in the window); from then on new requests are refused (``backpressure``)
    but for one probe per ``probe_interval_s``, and it stays so, whatever the window says,
    until ``recover_probes`` probes in a row came back within the budget: then the evidence
    from before them is dropped and it is ``ok`` again. Recovery is thus seen within a few
    probe intervals of the source's, not when the slow samples age out of the window (before,
    a 2 s window refused the first two seconds of a recovered source's traffic), and a
    source that stays slow is never read by more than the probes."""

    budget_ms: float
    window_s: float = 5.0
    quantile: float = 0.95
    min_samples: int = 20
    probe_interval_s: float = 0.5
    recover_probes: int = 2
    capacity: int = 512
    _samples: deque[tuple[float, float, bool]] = field(default_factory=deque)  # (at, ms, ok)
    _last_probe: float = -math.inf
    _tripped: str = ""  # "late" or "failing" while backpressuring, else ""
    _good_probes: int = 0
    refused: int = 0

    def record(self, now: float, latency_ms: float, *, ok: bool) -> None:
        """A read ended ``now`` after ``latency_ms`` (``ok``: answered). While backpressuring,
        reads are probes: enough good ones in a row clear the state."""
        self._samples.append((now, latency_ms, ok))
        while len(self._samples) > self.capacity:
            self._samples.popleft()
        if not self._tripped:
            return
        if ok and latency_ms <= self.budget_ms:
            self._good_probes += 1
            if self._good_probes >= self.recover_probes:
                self._tripped, self._good_probes = "", 0
                # Only the good probes remain as evidence: the source recovered.
                keep = [s for s in self._samples if s[1] <= self.budget_ms and s[2]][-self.recover_probes :]
                self._samples = deque(keep)
        else:
            self._good_probes = 0

    def _recent(self, now: float) -> list[tuple[float, float, bool]]:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return list(self._samples)

    def latency_quantile_ms(self, now: float) -> float | None:
        recent = sorted(ms for _, ms, _ in self._recent(now))
        if not recent:
            return None
        return recent[max(0, min(len(recent), math.ceil(self.quantile * len(recent))) - 1)]

    def reserve_ms(self, now: float) -> float:
        """The upstream reserve of a request admitted now: the measured quantile (the budget
        before any sample). While backpressuring, the budget: the requests let through then
        are probes, there to measure the source; reserving its slow past would refuse them on
        their slack before they read, and the state would never clear."""
        measured = self.latency_quantile_ms(now)
        return self.budget_ms if measured is None or self._tripped else measured

    def state(self, now: float) -> str:
        """``ok``, ``late`` or ``failing``."""
        if self._tripped:
            return self._tripped
        recent = self._recent(now)
        if len(recent) < self.min_samples:
            return "ok"
        failed = sum(1 for _, _, ok in recent if not ok)
        measured = self.latency_quantile_ms(now)
        if failed * 2 > len(recent):
            self._tripped = "failing"
        elif measured is not None and measured > self.budget_ms:
            self._tripped = "late"
        self._good_probes = 0
        return self._tripped or "ok"

    def backpressure(self, now: float) -> Refusal | None:
        """None: the request may read the source (always, for one probe per interval); else the
        refusal, with the time to the next probe as the caller's retry-after."""
        state = self.state(now)
        if state == "ok":
            return None
        if now - self._last_probe >= self.probe_interval_s:
            self._last_probe = now
            return None
        self.refused += 1
        measured = self.latency_quantile_ms(now)
        why = (
            "most recent reads failed"
            if state == "failing"
            else f"its p{self.quantile * 100:g} read latency is {measured or 0:.0f} ms, "
            f"over its {self.budget_ms:g} ms budget"
        )
        return Refusal(RULE_BACKPRESSURE, f"the feature source is {state}: {why}")

    def retry_after_ms(self, now: float) -> int:
        return max(1, math.ceil((self._last_probe + self.probe_interval_s - now) * 1000.0))


# --------------------------------------------------------------------------- cache


CacheKey = tuple[str, str, str, str, tuple[str, ...]]  # tenant, scope, version, generation, entities


def cache_key(
    tenant: str, scope: str, contract: FeatureContract, generation: str, entity_values: tuple[str, ...]
) -> CacheKey:
    """The seed's cache key: tenant, authorization scope, definition version (the contract's
    service and version) and data generation, then the entities."""
    return (
        tenant,
        scope,
        f"{contract.feature_service}@{contract.definition_version}",
        generation,
        entity_values,
    )


@dataclass
class FeatureCache:
    """A bounded LRU of feature values; an entry lives ``ttl_s`` at most, and never past the
    point where its oldest value passes the contract's maximum age (``expires``)."""

    entries: int = 4096
    ttl_s: float = 1.0
    hits: int = 0
    misses: int = 0
    _data: OrderedDict[CacheKey, tuple[float, FeatureValues]] = field(default_factory=OrderedDict)

    def get(self, key: CacheKey, now: float) -> FeatureValues | None:
        found = self._data.get(key)
        if found is None or found[0] <= now:
            if found is not None:
                del self._data[key]
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return found[1]

    def holds(self, key: CacheKey, now: float) -> bool:
        """Is a live entry there (no hit or miss counted, no LRU move): admission's question
        whether the request will need a read at all."""
        found = self._data.get(key)
        return found is not None and found[0] > now

    def put(self, key: CacheKey, values: FeatureValues, *, now: float, wall: float, max_age_s: float) -> None:
        """Keep ``values`` until ``ttl_s`` from now, or until its oldest value ages past
        ``max_age_s`` if sooner (a value already too old is not kept)."""
        expires = now + self.ttl_s
        if values.oldest_event is not None:
            expires = min(expires, now + (values.oldest_event + max_age_s - wall))
        if expires <= now or self.entries <= 0:
            return
        self._data[key] = (expires, values)
        self._data.move_to_end(key)
        while len(self._data) > self.entries:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
