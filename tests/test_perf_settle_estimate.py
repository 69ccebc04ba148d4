"""The estimator's per-request fast path (``gateway.core.estimate``, perf issue 31) against
the estimator as it was: ``ReferenceEstimator`` below is ``Estimator`` verbatim from before each
entry's decay was computed once per request instead of per lookup. On random histories of
observations, corrections and fleet merges (times that repeat, go backwards, jump), every
correction, factor, learned mean and internal table must be the same floats, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.estimate import (
    _BOUND,
    _K,
    _MAX_STEP,
    _OWN_BOUND,
    _PRIOR_WEIGHT,
    MAX_FACTOR,
    MIN_FACTOR,
    CorrectionKey,
    Estimator,
    LearnedCorrection,
    _clamp,
    _Ewma,
    predict,
)
from gateway.core.profile import DemandProfile
from gateway.core.record import Demand, Shape

# --------------------------------------------------------------------------- the reference


class ReferenceEstimator:
    """Learned corrections from observed work (the module docstring). Bounded state: one
    entry per configured (model, version, bucket), per (tenant, model) and per (tenant,
    model, version, bucket) actually seen."""

    def __init__(self, *, alpha: float = 0.3, half_life_s: float = 300.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.half_life_s = half_life_s
        # The shared correction per key: ``log_mean`` the traffic-weighted mean of the tenants'
        # own means, ``volume`` their summed volumes (kept in step with ``_own``).
        self._models: dict[CorrectionKey, _Ewma] = {}
        self._tenants: dict[tuple[str, str], _Ewma] = {}  # residual against the shared mean
        self._own: dict[tuple[str, CorrectionKey], _Ewma] = {}  # a tenant's own mean per key
        # Other replicas' means (``merge_fleet``): (log_mean, weight, as of), per key.
        self._fleet_models: dict[CorrectionKey, list[tuple[float, float, float]]] = {}
        self._fleet_tenants: dict[tuple[str, str], list[tuple[float, float, float]]] = {}

    def _decay(self, since: float, now: float) -> float:
        return math.pow(0.5, max(0.0, now - since) / self.half_life_s)

    def _weight(self, entry: _Ewma, now: float) -> float:
        return entry.weight * self._decay(entry.updated_at, now)

    def _history(self, weight: float) -> float:
        # A history counts against the prior with at most one full mean's weight (what an
        # observation-by-observation mean reaches), so heavy traffic does not slow its ageing.
        return min(weight, 1.0 / self.alpha)

    def _aged(self, entry: _Ewma | None, now: float, prior: float = 0.0) -> float:
        # The prior has a small fixed weight: negligible while observations keep coming,
        # dominant once they have aged out.
        if entry is None:
            return prior
        weight = self._history(self._weight(entry, now))
        return (entry.log_mean * weight + prior * _PRIOR_WEIGHT) / (weight + _PRIOR_WEIGHT)

    def _combined(
        self, entry: _Ewma | None, fleet: list[tuple[float, float, float]] | None, now: float
    ) -> float:
        """Own and the fleet's means, each aged, against the prior (``_aged`` when alone)."""
        if not fleet:
            return self._aged(entry, now)
        total, weights = 0.0, _PRIOR_WEIGHT
        if entry is not None:
            weight = self._history(self._weight(entry, now))
            total, weights = entry.log_mean * weight, weights + weight
        for log_mean, weight, at in fleet:
            aged = self._history(weight * self._decay(at, now))
            total, weights = total + log_mean * aged, weights + aged
        return total / weights

    def _shared_log(self, key: CorrectionKey, now: float) -> float:
        shared = self._combined(self._models.get(key), self._fleet_models.get(key), now)
        return min(_BOUND, max(-_BOUND, shared))

    def _residual_log(self, tenant: str, model: str, now: float) -> float:
        key = (tenant, model)
        return self._combined(self._tenants.get(key), self._fleet_tenants.get(key), now)

    def _tenant_log(self, key: CorrectionKey, tenant: str, now: float) -> float:
        """log of the correction of ``tenant``'s requests on ``key``: its own mean there, against
        the prior of the shared correction times its residual."""
        prior = self._shared_log(key, now) + self._residual_log(tenant, key.model, now)
        return self._aged(self._own.get((tenant, key)), now, prior)

    def model_correction(self, key: CorrectionKey, now: float) -> float:
        """The shared correction: a tenant new to ``key`` is priced by it."""
        return _clamp(math.exp(self._shared_log(key, now)))

    def tenant_factor(self, tenant: str, model: str, now: float) -> float:
        """The tenant's residual on ``model`` against the shared corrections (below 1: it costs
        less than the traffic's blend; above: more)."""
        return _clamp(math.exp(self._residual_log(tenant, model, now)))

    def correction(self, key: CorrectionKey, tenant: str, now: float) -> float:
        return math.exp(min(_OWN_BOUND, max(-_OWN_BOUND, self._tenant_log(key, tenant, now))))

    def samples(self, key: CorrectionKey) -> int:
        entry = self._models.get(key)
        return entry.samples if entry else 0

    def observe(
        self, key: CorrectionKey, tenant: str, *, base_ms: float, observed_ms: float, now: float
    ) -> None:
        """``base_ms``: the uncorrected (profile x time_scale) prediction of this request."""
        if base_ms <= 0 or observed_ms <= 0 or not math.isfinite(observed_ms):
            return
        log_ratio = min(_OWN_BOUND, max(-_OWN_BOUND, math.log(observed_ms / base_ms)))
        own_key = (tenant, key)
        own = self._own.get(own_key)
        # The tenant's share of the shared mean, before this observation (aged to now).
        before = own.volume * self._decay(own.updated_at, now) if own is not None else 0.0
        before_mean = own.log_mean if own is not None else 0.0
        start = self._tenant_log(key, tenant, now)
        self._update(self._own, own_key, log_ratio, now, start=start, bound=_OWN_BOUND)
        own = self._own[own_key]
        own.volume = before + 1.0
        self._reweigh(key, tenant_volume=(before, before_mean), own=own, now=now)
        # The residual is what the (updated) shared correction does not explain, either way.
        residual = log_ratio - self._shared_log(key, now)
        self._update(self._tenants, (tenant, key.model), residual, now)

    def _reweigh(
        self, key: CorrectionKey, *, tenant_volume: tuple[float, float], own: _Ewma, now: float
    ) -> None:
        """Keep the shared mean the traffic-weighted mean of the tenants' own means: every
        volume decays at the same rate, so only the observing tenant's term changes."""
        shared = self._models.get(key)
        if shared is None:
            shared = self._models[key] = _Ewma(0.0, 0.0, now, 0)
        decay = self._decay(shared.updated_at, now)
        volume = shared.volume * decay
        total = shared.log_mean * volume
        old_volume, old_mean = tenant_volume
        total += own.volume * own.log_mean - old_volume * old_mean
        volume += own.volume - old_volume
        if volume <= 1e-9:  # rounding only: the observing tenant's own volume is at least 1
            total, volume = own.volume * own.log_mean, own.volume
        shared.log_mean = total / volume  # unbounded here, so the sums stay exact; read bounded
        shared.volume = volume
        # Against the prior (ageing) and in the fleet it weighs as one mean, like the others.
        shared.weight = self._history(volume)
        shared.updated_at = now
        shared.samples += 1

    def learned(self, now: float) -> list[LearnedCorrection]:
        """This replica's own shared and residual means, their weights aged to ``now`` (for
        the fleet)."""
        out = [
            LearnedCorrection(
                "model", (k.model, k.version, k.bucket), e.log_mean, self._weight(e, now), now, e.samples
            )
            for k, e in self._models.items()
        ]
        out += [
            LearnedCorrection("tenant", k, e.log_mean, self._weight(e, now), now, e.samples)
            for k, e in self._tenants.items()
        ]
        return out

    def merge_fleet(self, corrections: Iterable[LearnedCorrection]) -> None:
        """Replace the other replicas' means with ``corrections`` (``at`` on this replica's clock).
        Bounded like the own tables: keys come from configuration and tenants seen."""
        models: dict[CorrectionKey, list[tuple[float, float, float]]] = {}
        tenants: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for c in corrections:
            if not (math.isfinite(c.log_mean) and math.isfinite(c.weight) and c.weight > 0):
                continue
            log_mean = min(math.log(MAX_FACTOR), max(math.log(MIN_FACTOR), c.log_mean))
            value = (log_mean, c.weight, c.at)
            if c.kind == "model" and len(c.key) == 3:
                models.setdefault(CorrectionKey(*c.key), []).append(value)
            elif c.kind == "tenant" and len(c.key) == 2:
                tenants.setdefault((c.key[0], c.key[1]), []).append(value)
        self._fleet_models, self._fleet_tenants = models, tenants

    def _update(
        self,
        table: dict[_K, _Ewma],
        key: _K,
        log_ratio: float,
        now: float,
        *,
        start: float = 0.0,
        bound: float = _BOUND,
    ) -> None:
        """Move ``table[key]``'s mean towards ``log_ratio`` (within +-``bound``). ``start``: the
        prior it ages towards, and where a new entry's first step is measured from."""
        entry = table.get(key)
        # Robust step: one observation may pull the estimate at most MAX_STEP (in log space)
        # away from where it is, so a cold-start or a stall cannot swing it to the bounds.
        current = self._aged(entry, now, start)
        log_ratio = min(current + _MAX_STEP, max(current - _MAX_STEP, log_ratio))
        log_ratio = min(bound, max(-bound, log_ratio))
        if entry is None:
            table[key] = _Ewma(log_ratio, 1.0, now, 1)
            return
        # Cap the history's weight so a new observation always moves the mean by >= alpha.
        weight = min(self._weight(entry, now), 1.0 / self.alpha - 1.0)
        entry.log_mean = (weight * entry.log_mean + log_ratio) / (weight + 1.0)
        entry.weight = weight + 1.0
        entry.updated_at = now
        entry.samples += 1


# --------------------------------------------------------------------------- the property

KEYS = [
    CorrectionKey("full-v18", "18", "short"),
    CorrectionKey("full-v18", "18", "long"),
    CorrectionKey("full-v18", "19", "short"),
    CorrectionKey("lite", "1", "short"),
]
TENANTS = ["orchid", "acme", "zeta"]

_time_step = st.one_of(
    st.just(0.0),
    st.floats(min_value=-5.0, max_value=5.0, allow_nan=False),
    st.floats(min_value=0.0, max_value=3000.0, allow_nan=False),
)
_positive = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False)
_observe = st.tuples(
    st.just("observe"),
    st.sampled_from(KEYS),
    st.sampled_from(TENANTS),
    st.one_of(_positive, st.just(0.0)),
    st.one_of(_positive, st.just(0.0), st.just(math.inf)),
    _time_step,
)
_read = st.tuples(st.just("read"), st.sampled_from(KEYS), st.sampled_from(TENANTS), _time_step)
_fleet_entry = st.builds(
    LearnedCorrection,
    kind=st.sampled_from(["model", "tenant"]),
    key=st.one_of(
        st.sampled_from([(k.model, k.version, k.bucket) for k in KEYS]),
        st.tuples(st.sampled_from(TENANTS), st.sampled_from([k.model for k in KEYS])),
    ),
    log_mean=st.floats(min_value=-4.0, max_value=4.0, allow_nan=False),
    weight=st.floats(min_value=0.0, max_value=20.0, allow_nan=False),
    at=st.floats(min_value=-100.0, max_value=5000.0, allow_nan=False),
    samples=st.integers(min_value=0, max_value=100),
)
_merge = st.tuples(st.just("merge"), st.lists(_fleet_entry, max_size=6))
_steps = st.lists(st.one_of(_observe, _observe, _read, _merge), min_size=1, max_size=60)


def _bits(value: float) -> tuple[float, bool]:
    """A float as compared here: its value and sign, NaN equal to NaN."""
    return (value if value == value else 0.0, math.copysign(1.0, value) < 0 if value == value else True)


def _same_table(new: dict[Any, _Ewma], old: dict[Any, _Ewma]) -> None:
    assert new.keys() == old.keys()
    for key, entry in new.items():
        ref = old[key]
        assert (entry.samples, _bits(entry.log_mean), _bits(entry.weight), _bits(entry.volume)) == (
            ref.samples, _bits(ref.log_mean), _bits(ref.weight), _bits(ref.volume)
        )  # fmt: skip
        assert entry.updated_at == ref.updated_at


def _same_reads(new: Estimator, old: ReferenceEstimator, key: CorrectionKey, tenant: str, now: float) -> None:
    assert _bits(new.correction(key, tenant, now)) == _bits(old.correction(key, tenant, now))
    assert _bits(new.model_correction(key, now)) == _bits(old.model_correction(key, now))
    assert _bits(new.tenant_factor(tenant, key.model, now)) == _bits(
        old.tenant_factor(tenant, key.model, now)
    )
    assert new.samples(key) == old.samples(key)


@settings(max_examples=400, deadline=None)
@given(
    steps=_steps,
    alpha=st.sampled_from([0.3, 1.0, 0.05, 0.7]),
    half_life_s=st.sampled_from([300.0, 10.0, 0.5]),
)
def test_the_estimator_computes_what_it_computed_before(
    steps: list[tuple[Any, ...]], alpha: float, half_life_s: float
) -> None:
    new, old = (
        Estimator(alpha=alpha, half_life_s=half_life_s),
        ReferenceEstimator(alpha=alpha, half_life_s=half_life_s),
    )
    now = 1000.0
    for step in steps:
        if step[0] == "observe":
            _, key, tenant, base_ms, observed_ms, dt = step
            now += dt
            new.observe(key, tenant, base_ms=base_ms, observed_ms=observed_ms, now=now)
            old.observe(key, tenant, base_ms=base_ms, observed_ms=observed_ms, now=now)
        elif step[0] == "read":
            _, key, tenant, dt = step
            now += dt
            _same_reads(new, old, key, tenant, now)
        else:
            _, corrections = step
            new.merge_fleet(corrections)
            old.merge_fleet(corrections)
        _same_table(new._own, old._own)
        _same_table(new._models, old._models)
        _same_table(new._tenants, old._tenants)
    for key in KEYS:
        for tenant in TENANTS:
            _same_reads(new, old, key, tenant, now)
            _same_reads(new, old, key, tenant, now + 7.5)
    assert new.learned(now + 1.0) == old.learned(now + 1.0)


def reference_predict(
    profile: DemandProfile,
    shape: Shape,
    *,
    time_scale: float = 1.0,
    correction: float = 1.0,
    cached_tokens: int = 0,
) -> Demand:
    """``predict`` as it was, before it reused its phases for the live-token-ms."""
    scale = time_scale * correction
    prefill, decode = profile.phases(
        shape.input_tokens - cached_tokens if cached_tokens > 0 else shape.input_tokens,
        shape.max_output_tokens,
        batch=shape.items,
    )
    return Demand(
        prefill_ms=prefill * scale,
        decode_ms=decode * scale,
        host_cpu_ms=profile.host_cpu_ms,
        peak_memory_bytes=profile.peak_memory_bytes(shape.input_tokens, shape.max_output_tokens)
        * shape.items,
        live_token_ms=profile.live_token_ms(shape.input_tokens, shape.max_output_tokens)
        * shape.items
        * scale,
        correction=correction,
    )


_ms = st.floats(min_value=0.0, max_value=100.0)


@settings(max_examples=500, deadline=None)
@given(
    profile=st.builds(
        DemandProfile,
        fixed_ms=_ms,
        prefill_ms_per_token=_ms,
        decode_ms_per_token=_ms,
        live_cache_bytes_per_token=st.integers(min_value=0, max_value=1 << 20),
        host_cpu_ms=_ms,
    ),
    items=st.sampled_from([1, 1, 2, 8]),
    input_tokens=st.integers(min_value=1, max_value=32768),
    output_tokens=st.integers(min_value=0, max_value=4096),
    cached_tokens=st.one_of(st.just(0), st.integers(min_value=-3, max_value=32768)),
    time_scale=st.floats(min_value=0.0, max_value=2.0),
    correction=st.floats(min_value=0.01, max_value=100.0),
)
def test_predict_computes_what_it_computed_before(
    profile: DemandProfile,
    items: int,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    time_scale: float,
    correction: float,
) -> None:
    shape = Shape(items=items, input_tokens=input_tokens, max_output_tokens=output_tokens)
    arguments: dict[str, Any] = {
        "time_scale": time_scale,
        "correction": correction,
        "cached_tokens": min(cached_tokens, input_tokens - 1),
    }
    new, old = predict(profile, shape, **arguments), reference_predict(profile, shape, **arguments)
    assert [_bits(getattr(new, f)) for f in _DEMAND] == [_bits(getattr(old, f)) for f in _DEMAND]


_DEMAND = ("prefill_ms", "decode_ms", "host_cpu_ms", "peak_memory_bytes", "live_token_ms", "correction")


@settings(max_examples=300, deadline=None)
@given(
    fixed_ms=st.one_of(_ms, st.integers(0, 100), st.sampled_from([math.nan, math.inf, -0.0])),
    per_token=st.one_of(_ms, st.integers(0, 100), st.sampled_from([math.nan, math.inf, -0.0])),
    decode=st.one_of(_ms, st.integers(0, 100)),
    input_tokens=st.integers(min_value=0, max_value=1 << 20),
    output_tokens=st.integers(min_value=0, max_value=1 << 16),
)
def test_a_profiles_accelerator_ms_is_the_sum_of_its_phases(
    fixed_ms: float, per_token: float, decode: float, input_tokens: int, output_tokens: int
) -> None:
    """``DemandProfile.accelerator_ms`` spells out ``phases`` (batch of one): the same float."""
    profile = DemandProfile(fixed_ms=fixed_ms, prefill_ms_per_token=per_token, decode_ms_per_token=decode)
    prefill, decode_ms = profile.phases(input_tokens, output_tokens)
    assert _bits(profile.accelerator_ms(input_tokens, output_tokens)) == _bits(prefill + decode_ms)
