"""Demand estimation: shape + profile -> predicted ``Demand``, corrected by observed work.

Pure arithmetic and a small state machine; no clocks (``now`` is handed in) and
no I/O.

Prediction: ``DemandProfile.phases`` on the request's shape, times the backend's
``time_scale`` (1.0 for real devices; the emulator's time factor otherwise),
times a learned correction.

Correction (the seed: "age estimates and penalize chronic underprediction
rather than trusting callers"), in log space, three tables:

* per (tenant, model, version, shape bucket), the tenant's *own* mean: an exponentially
  weighted mean of log(observed / predicted) of that tenant's requests. Each observation
  moves it by at least ``alpha`` = 0.3, so it converges fast (after n observations the
  initial error has shrunk to 0.7^n: under 3 % of it after 10). History's weight halves
  every ``half_life_s``; against it stands a prior with a small fixed weight, so the
  correction *ages out* when observations stop and a stale burst cannot bend
  predictions forever. A tenant with history on a key is predicted by its own mean, in
  both directions and from any excess: a tenant whose requests cost 3x the shape they
  declare is priced (admitted, queued, quota-reserved) at 3x, and a neighbour whose
  shapes are honest is priced at what it uses, not at the blend;
* per (model, version, shape bucket), the *shared* correction: the tenants' own means
  weighted by each tenant's share of the recent traffic on the key (a decayed count of
  observations, same half-life). One tenant's outliers move it by no more than that
  tenant's share of the traffic times its own deviation, however they are bunched in
  time (an exponentially weighted mean of all observations let a burst take it over).
  It prices a tenant new to the key, and is the prior its own mean starts from;
* per (tenant, model), the tenant's residual against the shared correction, in both
  directions: what carries a tenant's habit (understating its output, say) to a bucket
  or version where it has no own history yet.

The shared and residual factors are bounded to [``MIN_FACTOR``, ``MAX_FACTOR``] (a tenant's
own, standing for both, to their squares), and one observation may move
an estimate by at most 2x (a robust, Huber-like step), so one absurd observation (a
stalled backend, a cold start) cannot poison admission; a real change still converges,
a factor of 2 per observation. State is bounded by the configured (model, version,
bucket) keys times the tenants actually seen.

A fleet of replicas learns together (``gateway/state/estimator_sync.py``): each replica's
own means (``learned``) are exchanged, and ``merge_fleet`` hands a replica the others'. A
correction is then the weighted mean of its own history and every other replica's, each
aged by the same half-life, against the same prior: with no other replica it is exactly
the replica's own. Only a replica's own observations move its own means (no echo).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

from gateway.core.profile import DemandProfile
from gateway.core.record import Demand, Shape

# One observation may be wild (a backend stall, a cold model); bound what it can do.
MIN_FACTOR = 0.1
MAX_FACTOR = 10.0
# A tenant's own correction is a shared and a residual factor in one: bounded by their product.
_OWN_BOUND = 2.0 * math.log(MAX_FACTOR)
_BOUND = math.log(MAX_FACTOR)  # MIN_FACTOR is its inverse

_K = TypeVar("_K")
# Weight of the profile's own prediction against observed history (1 per observation).
_PRIOR_WEIGHT = 0.05
# How far (log space) one observation may pull an estimate: at most 2x per observation.
_MAX_STEP = math.log(2.0)


def predict(
    profile: DemandProfile,
    shape: Shape,
    *,
    time_scale: float = 1.0,
    correction: float = 1.0,
    cached_tokens: int = 0,
) -> Demand:
    """Predicted demand of ``shape`` on ``profile``. ``cached_tokens``: prompt tokens a prefix
    cache is expected to serve (``gateway.core.prefix``): prefill is priced on the rest, while
    memory and live state still count the whole prompt (the cached blocks are live too)."""
    scale = time_scale * correction
    input_tokens, output_tokens, items = shape.input_tokens, shape.max_output_tokens, shape.items
    prefill, decode = profile.phases(
        input_tokens - cached_tokens if cached_tokens > 0 else input_tokens, output_tokens, batch=items
    )
    if items == 1 and cached_tokens <= 0:
        # The phases just computed are ``live_token_ms``'s own (one item, the whole prompt).
        live_token_ms = profile.live_token_ms_of(input_tokens, output_tokens, prefill, decode)
    else:
        live_token_ms = profile.live_token_ms(input_tokens, output_tokens)
    return Demand(
        prefill_ms=prefill * scale,
        decode_ms=decode * scale,
        host_cpu_ms=profile.host_cpu_ms,
        peak_memory_bytes=profile.peak_memory_bytes(input_tokens, output_tokens) * items,
        live_token_ms=live_token_ms * items * scale,
        correction=correction,
    )


class CorrectionKey(NamedTuple):
    """(model, version, shape bucket): what one shared correction is learned per.

    A named tuple rather than a frozen dataclass: the estimator hashes and compares it on
    every lookup (several per request), which a tuple does in C; a dataclass's generated
    ``__hash__``/``__eq__`` are Python calls."""

    model: str
    version: str
    bucket: str


@dataclass(slots=True)
class _Ewma:
    """A time-weighted mean of log(observed / predicted) against a prior.

    ``weight``: the history's weight against the prior (capped, so that a new observation
    always moves the mean by at least ``alpha``); ``volume``: the decayed count of the
    observations (uncapped: a tenant's share of a key's traffic). Both halve every
    half-life from ``updated_at``."""

    log_mean: float
    weight: float
    updated_at: float
    samples: int
    volume: float = 0.0


@dataclass(frozen=True, slots=True)
class LearnedCorrection:
    """One learned mean as replicas exchange it: ``log_mean`` with ``weight`` as of ``at``.

    ``kind`` ``model``: ``key`` is (model, version, bucket); ``tenant``: (tenant, model)."""

    kind: Literal["model", "tenant"]
    key: tuple[str, ...]
    log_mean: float
    weight: float
    at: float
    samples: int


def _clamp(value: float) -> float:
    return min(MAX_FACTOR, max(MIN_FACTOR, value))


class Estimator:
    """Learned corrections from observed work (the module docstring). Bounded state: one
    entry per configured (model, version, bucket), per (tenant, model) and per (tenant,
    model, version, bucket) actually seen."""

    def __init__(self, *, alpha: float = 0.3, half_life_s: float = 300.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self._alpha = alpha
        # The history caps, computed once (``alpha`` is read-only, so they cannot go stale):
        # the weight a history counts with against the prior (``_history``), and the weight it
        # keeps against a new observation (``_update``).
        self._history_cap = 1.0 / alpha
        self._update_cap = 1.0 / alpha - 1.0
        self.half_life_s = half_life_s
        # The shared correction per key: ``log_mean`` the traffic-weighted mean of the tenants'
        # own means, ``volume`` their summed volumes (kept in step with ``_own``).
        self._models: dict[CorrectionKey, _Ewma] = {}
        self._tenants: dict[tuple[str, str], _Ewma] = {}  # residual against the shared mean
        self._own: dict[tuple[str, CorrectionKey], _Ewma] = {}  # a tenant's own mean per key
        # Other replicas' means (``merge_fleet``): (log_mean, weight, as of), per key.
        self._fleet_models: dict[CorrectionKey, list[tuple[float, float, float]]] = {}
        self._fleet_tenants: dict[tuple[str, str], list[tuple[float, float, float]]] = {}

    @property
    def alpha(self) -> float:
        return self._alpha

    # Every read below ages an entry by ``_decay(entry.updated_at, now)``. A request reads the
    # same three entries (its own mean, the shared mean, its residual) several times at one
    # ``now``, so ``correction`` and ``observe`` compute each entry's decay once and hand it
    # down (``decay`` arguments) instead of recomputing it per lookup: the same function of the
    # same two floats, so the same float, and every sum and product keeps its operands and
    # order (tests/test_perf_settle_estimate.py checks old against new on random histories).

    def _decay(self, since: float, now: float) -> float:
        elapsed = now - since
        # ``max(0.0, elapsed)`` is ``elapsed`` only when ``elapsed > 0.0``; otherwise (no time
        # passed, an earlier ``now``, NaN) the decay is 0.5 ** 0.0, exactly 1.0.
        if not elapsed > 0.0:
            return 1.0
        return math.pow(0.5, elapsed / self.half_life_s)

    def _entry_decay(self, entry: _Ewma | None, now: float) -> float:
        """``entry``'s decay to ``now`` (1.0 for no entry: it is not read)."""
        return 1.0 if entry is None else self._decay(entry.updated_at, now)

    def _weight(self, entry: _Ewma, now: float) -> float:
        return entry.weight * self._decay(entry.updated_at, now)

    def _history(self, weight: float) -> float:
        # A history counts against the prior with at most one full mean's weight (what an
        # observation-by-observation mean reaches), so heavy traffic does not slow its ageing.
        return min(weight, self._history_cap)

    def _aged(self, entry: _Ewma | None, decay: float, prior: float = 0.0) -> float:
        """``entry``'s mean, its weight aged by ``decay`` (its ``_entry_decay``), against ``prior``.
        The prior has a small fixed weight: negligible while observations keep coming,
        dominant once they have aged out."""
        if entry is None:
            return prior
        weight = self._history(entry.weight * decay)
        return (entry.log_mean * weight + prior * _PRIOR_WEIGHT) / (weight + _PRIOR_WEIGHT)

    def _combined(
        self,
        entry: _Ewma | None,
        decay: float,
        fleet: list[tuple[float, float, float]] | None,
        now: float,
    ) -> float:
        """Own and the fleet's means, each aged, against the prior (``_aged`` when alone)."""
        if not fleet:
            return self._aged(entry, decay)
        total, weights = 0.0, _PRIOR_WEIGHT
        if entry is not None:
            weight = self._history(entry.weight * decay)
            total, weights = entry.log_mean * weight, weights + weight
        for log_mean, weight, at in fleet:
            aged = self._history(weight * self._decay(at, now))
            total, weights = total + log_mean * aged, weights + aged
        return total / weights

    def _shared_log(self, key: CorrectionKey, now: float, decay: float | None = None) -> float:
        """The shared mean, bounded (``decay``: the shared entry's, when the caller has it)."""
        entry = self._models.get(key)
        if decay is None:
            decay = self._entry_decay(entry, now)
        shared = self._combined(entry, decay, self._fleet_models.get(key), now)
        return min(_BOUND, max(-_BOUND, shared))

    def _residual_log(self, tenant: str, model: str, now: float) -> float:
        key = (tenant, model)
        entry = self._tenants.get(key)
        return self._combined(entry, self._entry_decay(entry, now), self._fleet_tenants.get(key), now)

    def _tenant_log(self, key: CorrectionKey, tenant: str, now: float) -> float:
        """log of the correction of ``tenant``'s requests on ``key``: its own mean there, against
        the prior of the shared correction times its residual."""
        prior = self._shared_log(key, now) + self._residual_log(tenant, key.model, now)
        own = self._own.get((tenant, key))
        return self._aged(own, self._entry_decay(own, now), prior)

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
        residual_key = (tenant, key.model)
        own = self._own.get(own_key)
        shared = self._models.get(key)
        residual = self._tenants.get(residual_key)
        # Each entry's decay to now, once: until each is updated below, every read of it ages
        # it by this same factor.
        own_decay = self._entry_decay(own, now)
        shared_decay = self._entry_decay(shared, now)
        residual_decay = self._entry_decay(residual, now)
        # The tenant's share of the shared mean, before this observation (aged to now).
        before = own.volume * own_decay if own is not None else 0.0
        before_mean = own.log_mean if own is not None else 0.0
        # ``_tenant_log`` at now, from the decays above.
        residual_log = self._combined(residual, residual_decay, self._fleet_tenants.get(residual_key), now)
        prior = self._shared_log(key, now, shared_decay) + residual_log
        start = self._aged(own, own_decay, prior)
        own = self._update(self._own, own_key, own, own_decay, log_ratio, now, start=start, bound=_OWN_BOUND)
        own.volume = before + 1.0
        shared = self._reweigh(
            key, shared, shared_decay, tenant_volume=(before, before_mean), own=own, now=now
        )
        # The residual is what the (updated) shared correction does not explain, either way.
        # The shared entry was updated at ``now``: its decay is 0.5 ** 0.0, exactly 1.0.
        residual_ratio = log_ratio - self._shared_log(key, now, 1.0)
        self._update(self._tenants, residual_key, residual, residual_decay, residual_ratio, now)

    def _reweigh(
        self,
        key: CorrectionKey,
        shared: _Ewma | None,
        decay: float,
        *,
        tenant_volume: tuple[float, float],
        own: _Ewma,
        now: float,
    ) -> _Ewma:
        """Keep the shared mean (``shared``, aged by ``decay``) the traffic-weighted mean of
        the tenants' own means: every volume decays at the same rate, so only the observing
        tenant's term changes."""
        if shared is None:
            shared = self._models[key] = _Ewma(0.0, 0.0, now, 0)
            decay = 1.0  # updated at now
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
        return shared

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
        entry: _Ewma | None,
        decay: float,
        log_ratio: float,
        now: float,
        *,
        start: float = 0.0,
        bound: float = _BOUND,
    ) -> _Ewma:
        """Move ``entry`` (``table[key]``, aged by ``decay``; None: none yet)'s mean towards
        ``log_ratio`` (within +-``bound``). ``start``: the prior it ages towards, and where a new
        entry's first step is measured from. Returns the entry."""
        # Robust step: one observation may pull the estimate at most MAX_STEP (in log space)
        # away from where it is, so a cold-start or a stall cannot swing it to the bounds.
        current = self._aged(entry, decay, start)
        log_ratio = min(current + _MAX_STEP, max(current - _MAX_STEP, log_ratio))
        log_ratio = min(bound, max(-bound, log_ratio))
        if entry is None:
            entry = table[key] = _Ewma(log_ratio, 1.0, now, 1)
            return entry
        # Cap the history's weight so a new observation always moves the mean by >= alpha.
        weight = min(entry.weight * decay, self._update_cap)
        entry.log_mean = (weight * entry.log_mean + log_ratio) / (weight + 1.0)
        entry.weight = weight + 1.0
        entry.updated_at = now
        entry.samples += 1
        return entry


def charged_live_token_ms(demand: Demand, observed_ms: float) -> float:
    """Live-token-ms by observed lifetime: the predicted occupancy stretched or shrunk to
    the observed execution time."""
    accelerator_ms = demand.accelerator_ms
    if accelerator_ms <= 0:
        return 0.0
    return demand.live_token_ms * observed_ms / accelerator_ms
