"""Feature sources in the simulator (orchid_tools.simulate_features): the shipped scenario
``feature-latency-batch-dwell.yaml`` through the simulator's Python API, and a property over
incident timings: backpressure (the runtime's ``UpstreamHealth``) clears after the source recovers."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import FeatureSourceConfig
from orchid_tools.simulate import simulate
from orchid_tools.simulate_features import Incident, SourceModel, bound_s, clearance
from tests.conftest import ROOT

SCENARIO = ROOT / "examples" / "orchid" / "simulate" / "feature-latency-batch-dwell.yaml"


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return simulate(SCENARIO)


def _totals(document: dict[str, Any], run: str, phase: str, scope: str = "totals") -> dict[str, Any]:
    phases = {p["name"]: p for p in document["runs"][run]["phases"]}
    return phases[phase]["totals"] if scope == "totals" else phases[phase]["classes"][scope]


def test_the_shipped_scenario_holds_its_expectations(document: dict[str, Any]) -> None:
    failed = [e for e in document["expectations"] if not e["held"]]
    assert not failed, failed
    assert len(document["expectations"]) >= 10


def test_backpressure_refuses_early_during_the_incident_and_reads_less(document: dict[str, Any]) -> None:
    on = _totals(document, "backpressure=true", "incident", "rank")
    off = _totals(document, "backpressure=false", "incident", "rank")
    assert on["backpressure_refusals"] > 0 and off["backpressure_refusals"] == 0
    assert on["rejected_early"] >= on["backpressure_refusals"]
    assert on["refusals"]["rejected_early:features.upstream_backpressure"] == on["backpressure_refusals"]
    assert on["feature_reads"] * 10 < off["feature_reads"]
    # Expired work: the comparison does not waste less with backpressure, because neither run
    # wastes any (the runtime reads features before the dispatch queue, within the deadline).
    assert on["expired_device_ms"] <= off["expired_device_ms"]


def test_refusals_stop_within_the_bound_after_recovery(document: dict[str, Any]) -> None:
    source = document["feature_sources"]["feast"]
    bound = source["window_s"] + source["probe_interval_s"] + source["timeout_ms"] / 1000.0  # 5.55 s
    recovered = _totals(document, "backpressure=true", "recovered")
    assert 0 < recovered["backpressure_last_refusal_s"] <= bound
    assert _totals(document, "backpressure=true", "settled")["backpressure_refusals"] == 0


def test_cache_hits_come_from_entity_cardinality(document: dict[str, Any]) -> None:
    normal = _totals(document, "backpressure=true", "normal", "rank")
    # 200 req/s x 1 s TTL over 20,000 ids: about 1 % hit; a cache that was not consulted has 0.
    assert 0.2 <= normal["feature_cache_hit_pct"] <= 3.0
    assert normal["feature_reads"] + normal["feature_cache_hits"] == normal["offered"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    start=st.floats(min_value=1.0, max_value=20.0),
    length=st.floats(min_value=0.5, max_value=20.0),
    slow_ms=st.floats(min_value=25.0, max_value=400.0),
    failure=st.sampled_from([0.0, 0.3, 0.9]),
    rate=st.sampled_from([20.0, 100.0, 400.0]),
    window=st.sampled_from([1.0, 5.0]),
    probe=st.sampled_from([0.1, 0.5, 2.0]),
    normal_ms=st.floats(min_value=1.0, max_value=19.0),
)
def test_backpressure_always_clears_after_recovery(
    start: float,
    length: float,
    slow_ms: float,
    failure: float,
    rate: float,
    window: float,
    probe: float,
    normal_ms: float,
) -> None:
    config = FeatureSourceConfig(
        url="http://feast.invalid", budget_ms=20, timeout_ms=50, window_s=window, probe_interval_s=probe
    )
    incident = Incident(
        at_s=start, until_s=start + length, median_ms=slow_ms, p95_ms=slow_ms * 2, failure_rate=failure
    )
    # The recovered source: a constant latency under the budget, no failures.
    model = SourceModel(median_ms=normal_ms, p95_ms=normal_ms, incidents=[incident])
    bound = bound_s(config, rate)
    seen = clearance(model, config, rate_per_s=rate, duration_s=start + length + 3 * bound + 5)
    if seen.last_refusal_s is not None:
        assert seen.last_refusal_s - incident.until_s <= bound + 1e-9
    assert seen.reads > 0
