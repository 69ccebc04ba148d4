"""Quality evidence and its verdict: is this evidence good enough to degrade a route now?

A degraded answer (the route's fallback model, or its own output capped at the reduced
length) is allowed only on *valid* evidence: an evaluation of that model, version and
output cap on the route's population that is present, not past its review date, and
scores at or above the population's floor. This module owns the record (``Evidence``)
and the verdict (``judge``); it reads no clock: callers pass ``now`` as wall-clock Unix
seconds. The store that keeps the latest evidence lives in ``gateway.evidence``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class EvidenceStatus(StrEnum):
    """The verdict on a route's evidence, as policy reads it (``route.quality.*_evidence``)."""

    VALID = "valid"
    MISSING = "missing"  # no evaluation on record for this model, version, population and cap
    EXPIRED = "expired"  # past its review-by date or its maximum age
    BELOW_FLOOR = "below_floor"  # evaluated, but scores under the population's floor


@dataclass(frozen=True, slots=True)
class EvidenceKey:
    """What one evaluation is of: a logical model at a version, on a population, with its
    output capped at ``output_cap`` tokens (0: the full output)."""

    model: str
    version: str
    population: str
    output_cap: int = 0


@dataclass(frozen=True, slots=True)
class Evidence:
    """One evaluation result. Times are wall-clock Unix seconds.

    ``evaluated_at`` None: undated (seeded from a route file without a date). It expires at
    ``review_by`` or at ``evaluated_at + max_age_s``, whichever is first; neither: never
    (until newer evidence replaces it)."""

    key: EvidenceKey
    score: float
    sample_size: int
    owner: str
    evaluated_at: float | None = None
    review_by: float | None = None
    max_age_s: float | None = None
    source: str = "published"  # "published" (admin RPC) or "seeded" (a route file)

    def expires_at(self) -> float | None:
        """When this evidence stops counting; None: it does not expire."""
        limits = [self.review_by] if self.review_by is not None else []
        if self.max_age_s is not None and self.evaluated_at is not None:
            limits.append(self.evaluated_at + self.max_age_s)
        return min(limits) if limits else None


@dataclass(frozen=True, slots=True)
class EvidenceVerdict:
    """The verdict on the latest evidence for one degradation of one route."""

    status: EvidenceStatus
    evidence: Evidence | None = None

    @property
    def valid(self) -> bool:
        return self.status is EvidenceStatus.VALID

    @property
    def score(self) -> float:
        """The score policy sees: the evidence's while it is current (even below the floor),
        0.0 when it is missing or expired."""
        if self.evidence is None or self.status in (EvidenceStatus.MISSING, EvidenceStatus.EXPIRED):
            return 0.0
        return self.evidence.score


MISSING = EvidenceVerdict(EvidenceStatus.MISSING)


def judge(evidence: Evidence | None, *, floor: float, now: float) -> EvidenceVerdict:
    """Is ``evidence`` valid for a route with quality floor ``floor`` at wall-clock ``now``?

    Missing, then expired (``now`` at or past ``expires_at``), then below the floor; else valid."""
    if evidence is None:
        return MISSING
    expires = evidence.expires_at()
    if expires is not None and now >= expires:
        return EvidenceVerdict(EvidenceStatus.EXPIRED, evidence)
    if not math.isfinite(evidence.score) or evidence.score < floor:
        return EvidenceVerdict(EvidenceStatus.BELOW_FLOOR, evidence)
    return EvidenceVerdict(EvidenceStatus.VALID, evidence)


@dataclass(frozen=True, slots=True)
class RouteEvidence:
    """The verdicts a route's degradations rest on: its fallback's evidence and its reduced
    output's. A route with no fallback or no reduced output has MISSING there."""

    fallback: EvidenceVerdict = MISSING
    reduced_output: EvidenceVerdict = MISSING


def is_newer(candidate: Evidence, current: Evidence | None) -> bool:
    """Whether ``candidate`` replaces ``current`` as the latest evidence for its key: an
    evaluation at least as recent (undated evidence counts as oldest)."""
    if current is None:
        return True
    if candidate.evaluated_at is None:
        return current.evaluated_at is None
    return current.evaluated_at is None or candidate.evaluated_at >= current.evaluated_at


__all__ = [
    "MISSING",
    "Evidence",
    "EvidenceKey",
    "EvidenceStatus",
    "EvidenceVerdict",
    "RouteEvidence",
    "is_newer",
    "judge",
]
