"""The live quality-evidence store: the latest evaluation per (model, version, population,
output cap), seeded from the route files and replaced by publications (the admin RPC
``PublishEvidence``, ``orchid-gateway evidence publish``).

The store owns state only; what makes evidence valid (present, not past its review date,
at or above the floor) is the pure ``gateway.core.evidence.judge``, handed wall-clock
``now`` (``gateway.clock.wall``). ``route_evidence`` answers, for one route as the request
path resolved it, the verdicts its two degradations rest on:

* **fallback**: the fallback model's evidence, at its version, on the route's population;
* **reduced output**: the route's own model's evidence with its output capped at the
  route's ``reduced_output.max_output_tokens``, on the same population.

The population is the route's ``quality.population``, else its fallback's. A verdict that is
not valid disables that degradation on the next request: policy reads it as
``route.quality.fallback_evidence`` / ``route.quality.reduced_output_evidence``.

Seeded evidence (a route's ``quality`` and ``reduced_output.quality`` blocks) without
``evaluated_at`` is undated: it holds until a publication replaces it or its ``review_by``
passes. ``orchid_evidence_denied_degradation`` counts requests the overload ladder would
have degraded that the evidence kept at full quality (the process-wide registry, which the
gateway's ``/metrics`` serves).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import Counter

from gateway.config import QualityEvidence, RouteConfig, RouteTable, parse_time
from gateway.core.errors import InvalidArgument
from gateway.core.evidence import (
    MISSING,
    Evidence,
    EvidenceKey,
    EvidenceVerdict,
    RouteEvidence,
    is_newer,
    judge,
)
from gateway.policy.metrics import get_or_create

DAY_S = 86400.0

DENIED_DEGRADATION: Counter = get_or_create(
    "orchid_evidence_denied_degradation",
    lambda: Counter(
        "orchid_evidence_denied_degradation",
        "Requests the overload ladder would have degraded but whose route's quality evidence "
        "was missing, expired or below the floor, by model, degradation and evidence status.",
        ["model", "degradation", "status"],
    ),
)


def seeded(model: str, version: str, quality: QualityEvidence, *, output_cap: int = 0) -> Evidence:
    """A route file's ``quality`` block as evidence (dates parsed; see the module docstring)."""
    evaluated_at = parse_time(quality.evaluated_at) if quality.evaluated_at else None
    return Evidence(
        key=EvidenceKey(model, version, quality.population, output_cap),
        score=quality.score,
        sample_size=quality.sample_size,
        owner=quality.owner,
        evaluated_at=evaluated_at,
        review_by=parse_time(quality.review_by) if quality.review_by else None,
        max_age_s=quality.max_age_days * DAY_S if quality.max_age_days is not None else None,
        source="seeded",
    )


def population(route: RouteConfig, fallback: RouteConfig | None) -> str:
    """The population a route's degradations are judged on (its own, else its fallback's)."""
    if route.quality is not None:
        return route.quality.population
    if fallback is not None and fallback.quality is not None:
        return fallback.quality.population
    return ""


MAX_VERDICTS = 1024  # cached route verdicts (route x fallback x floor); cleared when full


class _Verdicts:
    """One route's verdicts, valid until the earliest expiry among the evidence they judged."""

    __slots__ = ("fallback", "route", "since", "until", "verdicts")

    def __init__(
        self,
        route: RouteConfig,
        fallback: RouteConfig | None,
        verdicts: RouteEvidence,
        since: float,
        until: float,
    ) -> None:
        self.route = route  # held, so the ids keying it cannot be reused while the entry lives
        self.fallback = fallback
        self.verdicts = verdicts
        self.since = since  # judged at; an earlier clock (stepped back) judges again
        self.until = until


def _until(verdict: EvidenceVerdict, now: float) -> float:
    """Until when (wall clock) ``verdict`` stays what ``judge`` answers at ``now``: the evidence's
    expiry when it has not passed yet; for ever otherwise (an expired verdict stays expired)."""
    evidence = verdict.evidence
    expires = evidence.expires_at() if evidence is not None else None
    return expires if expires is not None and now < expires else math.inf


class EvidenceStore:
    """The latest evidence per key. One per gateway; the event loop is its only writer.

    ``route_evidence`` answers from a cache of verdicts per route, emptied by every
    publication (which also calls ``on_change``: the gateway's generation) and consulted only
    before the earliest review-by or max-age expiry of the evidence it judged, so a
    publication or an expiry takes effect on the very next request."""

    def __init__(self, routes: RouteTable | None = None) -> None:
        self._latest: dict[EvidenceKey, Evidence] = {}
        self._verdicts: dict[tuple[str, int, int, float], _Verdicts] = {}
        self.on_change: Callable[[str], object] | None = None
        if routes is not None:
            self.seed(routes)

    def seed(self, routes: RouteTable) -> None:
        """Record every route's declared evidence (its model's, and its capped output's)."""
        for name, route in routes.models.items():
            if route.quality is not None:
                self.put(seeded(name, route.version, route.quality))
            if route.reduced_output is not None:
                self.put(
                    seeded(
                        name,
                        route.version,
                        route.reduced_output.quality,
                        output_cap=route.reduced_output.max_output_tokens,
                    )
                )

    def put(self, evidence: Evidence) -> None:
        current = self._latest.get(evidence.key)
        if is_newer(evidence, current):
            self._latest[evidence.key] = evidence
            self._changed()

    def _changed(self) -> None:
        self._verdicts.clear()
        if self.on_change is not None:
            self.on_change("evidence")

    def publish(self, evidence: Evidence) -> Evidence:
        """Record a published evaluation; INVALID_ARGUMENT if it is malformed or older than the
        evidence on record for its key. Returns what is now on record."""
        if not evidence.key.model or not evidence.key.population:
            raise InvalidArgument("evidence needs a model and a population")
        if not 0.0 <= evidence.score <= 1.0:
            raise InvalidArgument(f"score must be within [0, 1], got {evidence.score}")
        if evidence.sample_size < 1:
            raise InvalidArgument("sample_size must be at least 1")
        if not evidence.owner:
            raise InvalidArgument("evidence needs an owner")
        if evidence.evaluated_at is None:
            raise InvalidArgument("published evidence needs evaluated_at")
        if evidence.review_by is None and evidence.max_age_s is None:
            raise InvalidArgument("published evidence needs review_by or max_age")
        if evidence.max_age_s is not None and evidence.max_age_s <= 0:
            raise InvalidArgument("max_age must be positive")
        if not is_newer(evidence, self._latest.get(evidence.key)):
            raise InvalidArgument(
                "evidence evaluated before the evidence on record for this model, version, "
                "population and output cap; publish a newer evaluation"
            )
        self._latest[evidence.key] = evidence
        self._changed()
        return evidence

    def latest(self, key: EvidenceKey) -> Evidence | None:
        return self._latest.get(key)

    def all(self) -> list[Evidence]:
        """Every key's latest evidence, sorted by key."""
        return [self._latest[key] for key in sorted(self._latest, key=_sort_key)]

    def route_evidence(
        self, name: str, route: RouteConfig, fallback: RouteConfig | None, *, floor: float, now: float
    ) -> RouteEvidence:
        """The verdicts for logical route ``name`` (``route`` as the request runs it) and its
        fallback (the route ``route.fallback`` names), at wall-clock ``now``. Derived once per
        publication and expiry (see the class docstring)."""
        key = (name, id(route), id(fallback), floor)
        cached = self._verdicts.get(key)
        if (
            cached is not None
            and cached.route is route
            and cached.fallback is fallback
            and cached.since <= now < cached.until
        ):
            return cached.verdicts
        verdicts = self._judge(name, route, fallback, floor=floor, now=now)
        if len(self._verdicts) >= MAX_VERDICTS:
            self._verdicts.clear()
        until = min(_until(verdicts.fallback, now), _until(verdicts.reduced_output, now))
        self._verdicts[key] = _Verdicts(route, fallback, verdicts, now, until)
        return verdicts

    def _judge(
        self, name: str, route: RouteConfig, fallback: RouteConfig | None, *, floor: float, now: float
    ) -> RouteEvidence:
        pop = population(route, fallback)
        fallback_verdict: EvidenceVerdict = MISSING
        if fallback is not None and route.fallback:
            key = EvidenceKey(route.fallback, fallback.version, pop)
            fallback_verdict = judge(self._latest.get(key), floor=floor, now=now)
        reduced_verdict: EvidenceVerdict = MISSING
        if route.reduced_output is not None:
            key = EvidenceKey(name, route.version, pop, route.reduced_output.max_output_tokens)
            reduced_verdict = judge(self._latest.get(key), floor=floor, now=now)
        return RouteEvidence(fallback=fallback_verdict, reduced_output=reduced_verdict)


def _sort_key(key: EvidenceKey) -> tuple[str, str, str, int]:
    return (key.model, key.version, key.population, key.output_cap)


__all__ = ["DAY_S", "DENIED_DEGRADATION", "EvidenceStore", "population", "seeded"]
