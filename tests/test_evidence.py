"""The pure evidence verdict (``gateway.core.evidence``), the store's latest-wins rule and
seeding (``gateway.evidence``), and the route-file schema for seeded evidence."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.config import QualityEvidence, parse_time
from gateway.core.errors import InvalidArgument
from gateway.core.evidence import Evidence, EvidenceKey, EvidenceStatus, judge
from gateway.evidence import EvidenceStore, seeded

KEY = EvidenceKey("compact-v11", "1", "pop")


def ev(score: float = 0.9, **kw: float | None) -> Evidence:
    return Evidence(key=KEY, score=score, sample_size=10, owner="o", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("evidence", "now", "status", "score"),
    [
        (None, 0.0, EvidenceStatus.MISSING, 0.0),
        (ev(), 1e12, EvidenceStatus.VALID, 0.9),  # undated, no review date: never expires
        (ev(evaluated_at=100.0, max_age_s=50.0), 149.9, EvidenceStatus.VALID, 0.9),
        (ev(evaluated_at=100.0, max_age_s=50.0), 150.0, EvidenceStatus.EXPIRED, 0.0),
        (ev(evaluated_at=100.0, review_by=120.0, max_age_s=50.0), 120.0, EvidenceStatus.EXPIRED, 0.0),
        (ev(0.80, evaluated_at=100.0, review_by=200.0), 150.0, EvidenceStatus.BELOW_FLOOR, 0.80),
        (ev(float("nan")), 0.0, EvidenceStatus.BELOW_FLOOR, pytest.approx(float("nan"), nan_ok=True)),
    ],
)
def test_judge(evidence: Evidence | None, now: float, status: EvidenceStatus, score: object) -> None:
    verdict = judge(evidence, floor=0.84, now=now)
    assert verdict.status is status
    assert verdict.valid is (status is EvidenceStatus.VALID)
    assert verdict.score == score


def test_store_keeps_the_latest_and_refuses_older_or_malformed() -> None:
    store = EvidenceStore()
    store.put(seeded("compact-v11", "1", QualityEvidence(population="pop", score=0.86)))
    newer = store.publish(ev(0.7, evaluated_at=200.0, max_age_s=10.0))
    assert store.latest(KEY) == newer
    with pytest.raises(InvalidArgument, match="evaluated before"):
        store.publish(ev(0.9, evaluated_at=100.0, max_age_s=10.0))
    with pytest.raises(InvalidArgument, match="review_by or max_age"):
        store.publish(ev(0.9, evaluated_at=300.0))
    with pytest.raises(InvalidArgument, match="score"):
        store.publish(ev(1.2, evaluated_at=300.0, max_age_s=1.0))
    assert store.all() == [newer]


def test_seeded_evidence_schema_and_dates() -> None:
    q = QualityEvidence(population="p", score=0.9, evaluated_at="2026-07-01", max_age_days=2, owner="me")
    e = seeded("m", "1", q)
    assert e.evaluated_at == parse_time("2026-07-01T00:00:00+00:00")
    assert e.expires_at() == e.evaluated_at + 2 * 86400  # type: ignore[operator]
    assert e.source == "seeded" and e.owner == "me"
    with pytest.raises(ValidationError, match="max_age_days needs evaluated_at"):
        QualityEvidence(population="p", score=0.9, max_age_days=2)
    with pytest.raises(ValidationError, match="ISO 8601"):
        QualityEvidence(population="p", score=0.9, review_by="next tuesday")
