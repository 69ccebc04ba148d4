"""The pure core of upstream features (``gateway.core.upstream``): judging a source's answer by
the contract, the source's health (reserve, backpressure, recovery) and the scoped cache."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import upstream
from gateway.core.upstream import (
    FeatureCache,
    FeatureContract,
    FeatureSpec,
    FeatureValues,
    Missing,
    Refusal,
    UpstreamHealth,
    cache_key,
    judge,
)

WALL = 1_800_000_000.0


def contract(*specs: FeatureSpec) -> FeatureContract:
    return FeatureContract(
        source="feast",
        feature_service="ranker_v12",
        definition_version="v12",
        entities=(("user_id", "user_id"),),
        features=specs
        or (FeatureSpec("user_stats_v12:score", 3600.0), FeatureSpec("user_stats_v12:clicks", 3600.0)),
        input="FEATURES",
    )


def answer(
    score: list[tuple[object, str, float | None]], clicks: list[tuple[object, str, float | None]]
) -> tuple[list[str], list[tuple[list[object], list[str], list[float | None]]]]:
    def column(
        cells: list[tuple[object, str, float | None]],
    ) -> tuple[list[object], list[str], list[float | None]]:
        return [c[0] for c in cells], [c[1] for c in cells], [c[2] for c in cells]

    names = ["user_id", "user_stats_v12__score", "user_stats_v12__clicks"]
    ids = ([1] * len(score), ["PRESENT"] * len(score), [None] * len(score))
    return names, [ids, column(score), column(clicks)]


def test_present_fresh_values_become_the_tensor_in_contract_order_with_the_oldest_event() -> None:
    names, columns = answer(
        [(11.0, "PRESENT", WALL - 100), (21.0, "PRESENT", WALL - 50)],
        [(101, "PRESENT", WALL - 300), (201, "PRESENT", WALL - 10)],
    )
    judged = judge(contract(), names, columns, entities=2, wall=WALL)
    assert judged == FeatureValues((11.0, 101.0, 21.0, 201.0), WALL - 300, ())


def test_a_value_older_than_its_maximum_age_follows_its_policy() -> None:
    names, columns = answer([(11.0, "PRESENT", WALL - 7200)], [(101, "PRESENT", WALL - 10)])
    refused = judge(contract(), names, columns, entities=1, wall=WALL)
    assert isinstance(refused, Refusal) and refused.rule == upstream.RULE_STALE
    assert "7200 s old" in refused.message and "3600" in refused.message
    defaulted = judge(
        contract(
            FeatureSpec("user_stats_v12:score", 3600.0, Missing.DEFAULT, -1.0),
            FeatureSpec("user_stats_v12:clicks", 3600.0),
        ),
        names,
        columns,
        entities=1,
        wall=WALL,
    )
    # The stale value is replaced and named; the oldest event is of the values used.
    assert defaulted == FeatureValues((-1.0, 101.0), WALL - 10, ("user_stats_v12__score",))


def test_missing_values_refuse_default_or_pass_as_nan() -> None:
    names, columns = answer([(None, "NOT_FOUND", None)], [(None, "NOT_FOUND", None)])
    refused = judge(contract(), names, columns, entities=1, wall=WALL)
    assert isinstance(refused, Refusal) and refused.rule == upstream.RULE_MISSING
    allowed = judge(
        contract(
            FeatureSpec("user_stats_v12:score", 60.0, Missing.ALLOW),
            FeatureSpec("user_stats_v12:clicks", 60.0, Missing.DEFAULT, 0.0),
        ),
        names,
        columns,
        entities=1,
        wall=WALL,
    )
    assert isinstance(allowed, FeatureValues)
    assert math.isnan(allowed.values[0]) and allowed.values[1] == 0.0
    assert allowed.oldest_event is None and allowed.defaulted == (
        "user_stats_v12__score",
        "user_stats_v12__clicks",
    )


def test_a_feature_the_source_does_not_serve_is_refused_whatever_its_policy() -> None:
    names, columns = answer([(11.0, "PRESENT", WALL)], [(101, "PRESENT", WALL)])
    spec = FeatureSpec("user_stats_v13:score", 60.0, Missing.ALLOW)
    refused = judge(contract(spec), names, columns, entities=1, wall=WALL)
    assert isinstance(refused, Refusal) and refused.rule == upstream.RULE_INCOMPATIBLE


def test_health_reserves_the_measured_quantile_and_the_budget_before_any_read() -> None:
    health = UpstreamHealth(budget_ms=20.0, quantile=0.95)
    assert health.reserve_ms(0.0) == 20.0
    for i in range(100):
        health.record(i * 0.01, float(i + 1), ok=True)  # 1..100 ms
    assert health.reserve_ms(1.0) == 95.0
    assert health.reserve_ms(100.0) == 20.0  # the window passed: the budget again


def test_a_late_source_backpressures_with_one_probe_per_interval_and_clears_when_it_recovers() -> None:
    health = UpstreamHealth(budget_ms=20.0, window_s=2.0, min_samples=4, probe_interval_s=0.5)
    for i in range(8):
        health.record(i * 0.05, 80.0, ok=True)
    now = 0.5
    assert health.state(now) == "late"
    assert health.backpressure(now) is None  # the first is a probe
    assert health.reserve_ms(now) == 20.0  # reserving its slow past would refuse the probe itself
    refusal = health.backpressure(now + 0.1)
    assert refusal is not None and refusal.rule == upstream.RULE_BACKPRESSURE
    assert "80 ms" in refusal.message and health.retry_after_ms(now + 0.1) == 400
    assert health.backpressure(now + 0.5) is None  # the next probe
    health.record(now + 0.58, 80.0, ok=True)  # still slow: still late, whatever the window says
    assert health.state(now + 5.0) == "late"
    # The source recovered: two good probes in a row clear it (never stuck, and not only once
    # the slow reads have left the window).
    t = now + 5.0
    while health.state(t) != "ok":
        if health.backpressure(t) is None:
            health.record(t + 0.005, 5.0, ok=True)
        t += 0.05
        assert t < 20.0, "still backpressured long after the source recovered"
    assert t <= now + 5.0 + 2 * health.probe_interval_s + 0.05
    assert health.reserve_ms(t) == 5.0  # the good probes are the evidence now
    # Slow again: it takes min_samples reads to trip again.
    for i in range(4):
        health.record(t + 0.01 * i, 80.0, ok=True)
    assert health.state(t + 0.05) == "late"


def test_a_failing_source_backpressures() -> None:
    health = UpstreamHealth(budget_ms=20.0, min_samples=4)
    for i in range(6):
        health.record(i * 0.01, 1.0, ok=i == 0)
    assert health.state(0.1) == "failing"
    assert health.backpressure(0.1) is None and health.backpressure(0.2) is not None


def test_a_cache_entry_lives_its_ttl_and_never_past_its_oldest_values_maximum_age() -> None:
    cache = FeatureCache(entries=8, ttl_s=1.0)
    c = contract()
    key = cache_key("orchid", "eu/standard", c, "gen1", ("user_id=1",))
    fresh = FeatureValues((1.0,), WALL - 10, ())
    cache.put(key, fresh, now=0.0, wall=WALL, max_age_s=3600.0)
    assert cache.get(key, 0.9) == fresh and cache.get(key, 1.0) is None
    old = FeatureValues((1.0,), WALL - 3599.5, ())
    cache.put(key, old, now=0.0, wall=WALL, max_age_s=3600.0)
    assert cache.get(key, 0.4) == old and cache.get(key, 0.5) is None  # aged out at 3600 s
    cache.put(key, FeatureValues((1.0,), WALL - 4000, ()), now=0.0, wall=WALL, max_age_s=3600.0)
    assert cache.get(key, 0.0) is None  # already too old: not kept
    assert (cache.hits, cache.misses) == (2, 3)


def test_the_cache_is_bounded() -> None:
    cache = FeatureCache(entries=3, ttl_s=10.0)
    c = contract()
    for i in range(10):
        cache.put(
            cache_key("t", "s", c, "g", (str(i),)),
            FeatureValues((float(i),), None),
            now=0.0,
            wall=WALL,
            max_age_s=60,
        )
    assert len(cache) == 3
    assert cache.get(cache_key("t", "s", c, "g", ("9",)), 1.0) is not None
    assert cache.get(cache_key("t", "s", c, "g", ("0",)), 1.0) is None


keys = st.tuples(
    st.sampled_from(["orchid", "lumen", "kestrel"]),
    st.sampled_from(["eu/standard", "us/standard", "eu/restricted"]),
    st.sampled_from(["v12", "v13"]),
    st.sampled_from(["gen1", "gen2"]),
    st.sampled_from(["1", "2"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(keys, st.integers(0, 1000)), min_size=1, max_size=40), keys)
def test_the_cache_answers_only_the_exact_tenant_scope_version_generation_and_entities(
    writes: list[tuple[tuple[str, str, str, str, str], int]], read: tuple[str, str, str, str, str]
) -> None:
    """Whatever was written, a read gets the last value written under its own tenant, scope,
    definition version, generation and entities, or nothing: never another tenant's."""
    cache = FeatureCache(entries=1000, ttl_s=10.0)

    def key(k: tuple[str, str, str, str, str]) -> upstream.CacheKey:
        tenant, scope, version, generation, entity = k
        return cache_key(
            tenant, scope, FeatureContract("s", "svc", version, (), (), "F"), generation, (entity,)
        )

    last: dict[tuple[str, str, str, str, str], int] = {}
    for k, value in writes:
        cache.put(key(k), FeatureValues((float(value),), None), now=0.0, wall=WALL, max_age_s=60.0)
        last[k] = value
    got = cache.get(key(read), 1.0)
    if read in last:
        assert got is not None and got.values == (float(last[read]),)
    else:
        assert got is None
