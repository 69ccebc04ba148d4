"""Demand estimation: shape + profile -> predicted ``Demand``, corrected by observed work.

Pure arithmetic and a small state machine; no clocks (``now`` is handed in) and
no I/O.

Prediction: ``DemandProfile.phases`` on the request's shape, times the backend's
``time_scale`` (1.0 for real devices; the emulator's time factor otherwise),
times a learned correction.

Correction (the seed: "age estimates and penalize chronic underprediction
rather than trusting callers"):

* per (model, version, shape bucket): an exponentially weighted mean, in log
  space, of observed / predicted accelerator-ms. Each observation moves the mean
  by at least ``alpha`` = 0.3, so it converges fast (after n observations the
  initial error has shrunk to 0.7^n: under 3 % of it after 10). History's weight
  halves every ``half_life_s``; against it stands the profile itself as a prior
  with a small fixed weight, so the correction *ages out* back towards 1.0
  when observations stop, and a stale burst cannot bend predictions forever;
* per (tenant, model): the residual after the model correction, clamped to at
  least 1.0. A tenant whose requests chronically cost more than the shape they
  declare (for example by understating output length) is predicted — and so
  admitted, queued and quota-reserved — by what it really uses. It never lowers
  a prediction: callers are not trusted to be cheap. It applies only from
  ``TENANT_PENALTY_FROM`` (1.5x) up: below that a residual is indistinguishable
  from timing noise on a busy machine, and since the clamp is one-sided, noise
  alone would otherwise penalize whichever tenant happened to be measured
  slower (seen as a 2 : 1 weight share delivering 2.5 : 1 completions).

Both factors are bounded to [``MIN_FACTOR``, ``MAX_FACTOR``], and one
observation may move an estimate by at most 2x (a robust, Huber-like step), so
one absurd observation (a stalled backend, a cold start) cannot poison
admission; a real change still converges, a factor of 2 per observation.

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
from typing import Literal, TypeVar

from gateway.core.profile import DemandProfile
from gateway.core.record import Demand, Shape

# A tenant is priced above the model only when it costs at least this much more than its
# declared shape predicts; smaller residuals are timing noise (see the module docstring).
TENANT_PENALTY_FROM = 1.5

# One observation may be wild (a backend stall, a cold model); bound what it can do.
MIN_FACTOR = 0.1
MAX_FACTOR = 10.0

_K = TypeVar("_K")
# Weight of the profile's own prediction against observed history (1 per observation).
_PRIOR_WEIGHT = 0.05
# How far (log space) one observation may pull an estimate: at most 2x per observation.
_MAX_STEP = math.log(2.0)


def predict(
    profile: DemandProfile, shape: Shape, *, time_scale: float = 1.0, correction: float = 1.0
) -> Demand:
    scale = time_scale * correction
    prefill, decode = profile.phases(shape.input_tokens, shape.max_output_tokens, batch=shape.items)
    return Demand(
        prefill_ms=prefill * scale,
        decode_ms=decode * scale,
        host_cpu_ms=profile.host_cpu_ms,
        transfer_bytes=profile.transfer_bytes(shape.input_tokens, shape.max_output_tokens) * shape.items,
        peak_memory_bytes=profile.peak_memory_bytes(shape.input_tokens, shape.max_output_tokens)
        * shape.items,
        live_token_ms=profile.live_token_ms(shape.input_tokens, shape.max_output_tokens)
        * shape.items
        * scale,
        correction=correction,
    )


@dataclass(frozen=True, slots=True)
class CorrectionKey:
    model: str
    version: str
    bucket: str


@dataclass(slots=True)
class _Ewma:
    """A time-weighted mean of log(observed / predicted) against a prior of 0 (the profile)."""

    log_mean: float
    weight: float
    updated_at: float
    samples: int


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
    """Learned corrections from observed work. Bounded state: one entry per configured
    (model, version, bucket) and per (tenant, model) actually seen."""

    def __init__(self, *, alpha: float = 0.3, half_life_s: float = 300.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.half_life_s = half_life_s
        self._models: dict[CorrectionKey, _Ewma] = {}
        self._tenants: dict[tuple[str, str], _Ewma] = {}
        # Other replicas' means (``merge_fleet``): (log_mean, weight, as of), per key.
        self._fleet_models: dict[CorrectionKey, list[tuple[float, float, float]]] = {}
        self._fleet_tenants: dict[tuple[str, str], list[tuple[float, float, float]]] = {}

    def _weight(self, entry: _Ewma, now: float) -> float:
        return entry.weight * math.pow(0.5, max(0.0, now - entry.updated_at) / self.half_life_s)

    def _aged(self, entry: _Ewma | None, now: float) -> float:
        # The prior (the profile, log ratio 0) has a small fixed weight: negligible while
        # observations keep coming, dominant once they have aged out.
        if entry is None:
            return 0.0
        weight = self._weight(entry, now)
        return entry.log_mean * weight / (weight + _PRIOR_WEIGHT)

    def _combined(
        self, entry: _Ewma | None, fleet: list[tuple[float, float, float]] | None, now: float
    ) -> float:
        """Own and the fleet's means, each aged, against the prior (``_aged`` when alone)."""
        if not fleet:
            return self._aged(entry, now)
        total, weights = 0.0, _PRIOR_WEIGHT
        if entry is not None:
            weight = self._weight(entry, now)
            total, weights = entry.log_mean * weight, weights + weight
        for log_mean, weight, at in fleet:
            aged = weight * math.pow(0.5, max(0.0, now - at) / self.half_life_s)
            total, weights = total + log_mean * aged, weights + aged
        return total / weights

    def model_correction(self, key: CorrectionKey, now: float) -> float:
        return _clamp(math.exp(self._combined(self._models.get(key), self._fleet_models.get(key), now)))

    def tenant_factor(self, tenant: str, model: str, now: float) -> float:
        key = (tenant, model)
        factor = _clamp(math.exp(self._combined(self._tenants.get(key), self._fleet_tenants.get(key), now)))
        return factor if factor >= TENANT_PENALTY_FROM else 1.0

    def correction(self, key: CorrectionKey, tenant: str, now: float) -> float:
        return self.model_correction(key, now) * self.tenant_factor(tenant, key.model, now)

    def samples(self, key: CorrectionKey) -> int:
        entry = self._models.get(key)
        return entry.samples if entry else 0

    def observe(
        self, key: CorrectionKey, tenant: str, *, base_ms: float, observed_ms: float, now: float
    ) -> None:
        """``base_ms``: the uncorrected (profile x time_scale) prediction of this request."""
        if base_ms <= 0 or observed_ms <= 0 or not math.isfinite(observed_ms):
            return
        self._update(self._models, key, math.log(_clamp(observed_ms / base_ms)), now)
        # The tenant's residual is what the (updated) model correction does not explain: a
        # tenant alone on a model teaches the model, not itself; a tenant costlier than the
        # others sharing the model keeps a factor above 1.
        residual = observed_ms / (base_ms * self.model_correction(key, now))
        self._update(self._tenants, (tenant, key.model), math.log(_clamp(residual)), now)

    def learned(self, now: float) -> list[LearnedCorrection]:
        """This replica's own means, their weights aged to ``now`` (for the fleet)."""
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

    def _update(self, table: dict[_K, _Ewma], key: _K, log_ratio: float, now: float) -> None:
        entry = table.get(key)
        # Robust step: one observation may pull the estimate at most MAX_STEP (in log space)
        # away from where it is, so a cold-start or a stall cannot swing it to the bounds.
        current = self._aged(entry, now)
        log_ratio = min(current + _MAX_STEP, max(current - _MAX_STEP, log_ratio))
        if entry is None:
            table[key] = _Ewma(log_ratio, 1.0, now, 1)
            return
        # Cap the history's weight so a new observation always moves the mean by >= alpha.
        weight = min(self._weight(entry, now), 1.0 / self.alpha - 1.0)
        entry.log_mean = (weight * entry.log_mean + log_ratio) / (weight + 1.0)
        entry.weight = weight + 1.0
        entry.updated_at = now
        entry.samples += 1


def charged_live_token_ms(demand: Demand, observed_ms: float) -> float:
    """Live-token-ms by observed lifetime: the predicted occupancy stretched or shrunk to
    the observed execution time."""
    if demand.accelerator_ms <= 0:
        return 0.0
    return demand.live_token_ms * observed_ms / demand.accelerator_ms
