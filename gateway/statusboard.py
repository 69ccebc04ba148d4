"""The status page's data: what an operator sees at ``/status`` and reads at ``/status.json``.

``StatusBoard`` is a ``GatewayListener`` (it subscribes to the request path's events
through ``telemetry.ListenerGroup``; the request path does not know it exists) bound to the
running ``Gateway``, whose state it reads when a snapshot is asked for. It owns the
bounded histories the live state does not keep:

* per pool, offered demand vs the protected envelope (one sample a second, the last
  ``HISTORY_SAMPLES``), and the ladder's step changes with the evidence behind each
  (``LadderState.reason``, the line ``gateway.core.load`` logs: "offered ... % of
  protected ...; climb 2 -> 3"), the last ``STEP_CHANGES``;
* the last ``RECENT_DECISIONS`` admission decisions: tenant, class, model, verdict, rule,
  ladder step. Only whitelisted fields of the record are copied: no tensor, parameter
  value, metadata value or request id ever enters the board;
* per tenant, charged accelerator-ms (since start and over the last ``WINDOW_S``) and
  rejections by rule; per pool, the shares of decisions served by the fallback or with a
  reduced output over ``WINDOW_S``;
* policy: fail-opens by rule, and the last reload seen (version or failure count changed);
* per streaming model (``stream_settled``), the last ``STREAM_SAMPLES`` streams' first
  results and the last ``GAP_SAMPLES`` gaps between results: first-result p50/p95, gap p95
  and the shares of streams that met their first-result and gap objectives.

Everything is bounded by configuration (tenants, pools, rules) or by a ring's length.
``snapshot`` is called on the gateway's event loop (``gateway.statuspage`` serves it
there), so it reads a consistent state; it returns plain JSON-able data.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway import clock
from gateway.core.record import Decision, RequestRecord, Verdict
from gateway.core.streaming import StreamSummary
from gateway.exchange import GatewayListener, Settled
from gateway.pipeline import Gateway
from gateway.policy.snapshot import PolicyResult

HISTORY_SAMPLES = 300  # one a second: the last five minutes of demand per pool
HISTORY_PERIOD_S = 1.0
STEP_CHANGES = 50  # ladder step changes kept per pool
RECENT_DECISIONS = 100
WINDOW_S = 60.0  # recent shares (accelerator-ms, fallback, reduced output)
_WINDOW_EVENTS = 20_000  # bound on the events behind the recent shares
_MAX_PRIMARY_MODELS = 4096  # bound on the (tenant, model) -> backend model lookups kept
STREAM_SAMPLES = 1000  # streams kept per streaming model (first result, objectives met)
GAP_SAMPLES = 5000  # gaps between results kept per streaming model

JSON = dict[str, Any]


def _num(value: float, digits: int = 3) -> float | None:
    """JSON has no infinity: an unbounded or unreadable figure is ``null``."""
    return round(value, digits) if math.isfinite(value) else None


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(slots=True)
class _StreamHistory:
    streams: deque[tuple[float | None, bool, bool]]  # first result ms, first met, gap met
    gaps: deque[float]
    total: int = 0


@dataclass(slots=True)
class _PoolHistory:
    samples: deque[tuple[float, float, float, int]]  # wall time, offered, protected, step
    steps: deque[JSON]
    last_step: int = 0
    last_sample_at: float = -math.inf


class StatusBoard(GatewayListener):
    """Bounded histories for the status page, and its snapshot of the live gateway."""

    def __init__(self, *, wall: Callable[[], float] = time.time) -> None:
        self.gateway: Gateway | None = None
        self._wall = wall
        self.started_at = wall()
        self._pools: dict[str, _PoolHistory] = {}
        # The recent decisions' whitelisted fields as tuples, newest first: ``decisions`` (what a
        # snapshot shows) turns them into the page's dicts, so an admission appends one tuple
        # and builds no dict that may never be read.
        self._decisions: deque[tuple[Any, ...]] = deque(maxlen=RECENT_DECISIONS)
        self._charged: defaultdict[str, float] = defaultdict(float)
        self._recent_charges: deque[tuple[float, str, float]] = deque(maxlen=_WINDOW_EVENTS)
        self._recent_admissions: deque[tuple[float, str, bool, bool]] = deque(maxlen=_WINDOW_EVENTS)
        self._rejections: dict[str, Counter[str]] = {}
        self._failures: Counter[tuple[str, str]] = Counter()
        self._fail_opens: Counter[str] = Counter()
        self._policy_seen: tuple[str, int] | None = None
        self.last_reload: JSON | None = None
        self._primary_models: dict[tuple[str, str], str] = {}  # (tenant, model) -> backend model
        self._streams: dict[str, _StreamHistory] = {}  # answering model -> its recent streams

    def bind(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._primary_models.clear()
        self._watch_policy()

    # ------------------------------------------------------------------ events

    def decided(self, record: RequestRecord, decision: Decision, policy: PolicyResult) -> None:
        identity = record.identity
        now = self._wall()
        rule = decision.rules[0] if decision.rules else ""
        self._decisions.appendleft(
            (
                now,
                identity.tenant,
                identity.request_class,
                identity.model,
                decision.target_model,
                decision.verdict,
                rule,
                decision.route_reason,
                decision.ladder_step,
            )
        )
        if decision.verdict is Verdict.REJECT:
            self._rejections.setdefault(identity.tenant, Counter())[rule or decision.status] += 1
        else:
            self._recent_admissions.append(
                (
                    now,
                    self._primary_backend_model(identity.tenant, identity.model),
                    decision.verdict is Verdict.FALLBACK,
                    decision.max_output_tokens is not None,
                )
            )
        for event in policy.fail_open:
            self._fail_opens[event.rule] += 1

    def settled(self, settled: Settled) -> None:
        tenant = settled.record.identity.tenant
        charged = settled.outcome.charged_accelerator_ms
        self._charged[tenant] += charged
        self._recent_charges.append((self._wall(), tenant, charged))

    def failed(self, status: str, rule: str) -> None:
        self._failures[(status, rule)] += 1

    def stream_settled(self, settled: Settled, stream: StreamSummary) -> None:
        model = settled.decision.target_model
        history = self._streams.get(model)
        if history is None:
            history = self._streams[model] = _StreamHistory(
                streams=deque(maxlen=STREAM_SAMPLES), gaps=deque(maxlen=GAP_SAMPLES)
            )
        history.total += 1
        history.streams.append((stream.first_result_ms, stream.first_result_met, stream.gap_objective_met))
        history.gaps.extend(stream.gaps_ms)

    def ladder(self, pool: str, step: int) -> None:
        gateway = self.gateway
        now = self._wall()
        history = self._pools.get(pool)
        if history is None:
            history = self._pools[pool] = _PoolHistory(
                samples=deque(maxlen=HISTORY_SAMPLES), steps=deque(maxlen=STEP_CHANGES)
            )
        load = gateway.loads.get(pool) if gateway is not None else None
        if step != history.last_step:
            history.steps.appendleft(
                {
                    "at": round(now, 3),
                    "from": history.last_step,
                    "to": step,
                    "evidence": load.ladder.state.reason if load is not None else "",
                }
            )
            history.last_step = step
        evidence = load.evidence if load is not None else None
        if evidence is not None and now - history.last_sample_at >= HISTORY_PERIOD_S:
            history.samples.append(
                (now, evidence.offered_ms_per_s, evidence.protected_capacity_ms_per_s, step)
            )
            history.last_sample_at = now
        self._watch_policy()

    @property
    def decisions(self) -> list[JSON]:
        """The last ``RECENT_DECISIONS`` admission decisions, newest first, as the page shows them."""
        return [
            {
                "at": round(at, 3),
                "tenant": tenant,
                "class": request_class,
                "model": model,
                "target": target,
                "verdict": str(verdict),
                "rule": rule,
                "route_reason": route_reason,
                "ladder_step": ladder_step,
            }
            for at, tenant, request_class, model, target, verdict, rule, route_reason, ladder_step in (
                self._decisions
            )
        ]

    # ------------------------------------------------------------------ helpers

    def _primary_backend_model(self, tenant: str, model: str) -> str:
        gateway = self.gateway
        if gateway is None:
            return model
        # Configuration alone decides it (a gateway's tenants and routes do not change):
        # derived once per (tenant, model), for every admission.
        key = (tenant, model)
        known_model = self._primary_models.get(key)
        if known_model is None:
            known = gateway.tenants.tenants.get(tenant)
            dedicated = known.config.dedicated_models.get(model) if known is not None else None
            route = gateway.routes.models.get(model)
            known_model = dedicated or (route.backend_model if route is not None else model)
            if len(self._primary_models) >= _MAX_PRIMARY_MODELS:
                self._primary_models.clear()
            self._primary_models[key] = known_model
        return known_model

    def _watch_policy(self) -> None:
        """A reload shows as a new version (ok) or one more rejected reload (failed)."""
        gateway = self.gateway
        if gateway is None:
            return
        store = gateway.policy
        seen = (store.version, store.failures)
        if seen == self._policy_seen:
            return
        failed = self._policy_seen is not None and store.failures > self._policy_seen[1]
        self._policy_seen = seen
        self.last_reload = {
            "at": round(self._wall(), 3),
            "outcome": "failed" if failed else "ok",
            "version": store.snapshot.display_version if store.snapshot is not None else "",
            "diagnostics": [d.headline() for d in store.last_diagnostics] if failed else [],
        }

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> JSON:
        """Everything the page shows, as JSON-able data (call on the gateway's event loop)."""
        gateway = self.gateway
        now = self._wall()
        if gateway is None:
            return {"generated_at": now, "ready": False}
        since = now - WINDOW_S
        return {
            "generated_at": round(now, 3),
            "started_at": round(self.started_at, 3),
            "accepting": gateway.accepting,
            "window_s": WINDOW_S,
            "pools": self._pools_view(gateway, since),
            "tenants": self._tenants_view(gateway, since),
            "refusals": [
                {"status": status, "rule": rule, "count": count}
                for (status, rule), count in self._failures.most_common()
            ],
            "policy": self._policy_view(gateway),
            "decisions": self.decisions,
            "backends": self._backends_view(gateway),
            "streams": self._streams_view(),
            "prefix": self._prefix_view(gateway),
            "rollouts": [  # each rollout's latest run (gateway.rollouts): phase and why
                {
                    "name": name,
                    "route": run.spec.route,
                    "candidate": run.spec.candidate.name,
                    "phase": str(run.rollout.phase),
                    "step": run.rollout.step + 1,
                    "steps": len(run.spec.steps),
                    "reason": run.rollout.reason,
                }
                for name, run in sorted(gateway.rollouts.runs.items())
            ],
        }

    def _pools_view(self, gateway: Gateway, since: float) -> list[JSON]:
        queues = {queue.name: queue for queue in gateway.pools.queues()}
        admissions = [a for a in self._recent_admissions if a[0] >= since]
        pools = []
        for name, load in sorted(gateway.loads.items()):
            evidence = load.evidence
            queue = queues.get(name)
            backend, _, backend_model = name.partition("/")
            mine = [a for a in admissions if a[1] == backend_model]
            history = self._pools.get(name)
            state = load.ladder.state
            pools.append(
                {
                    "name": name,
                    "backend": backend,
                    "model": backend_model,
                    "step": load.step,
                    "stale": state.stale,
                    "reason": state.reason,
                    "devices": load.devices,
                    "healthy_devices": evidence.healthy_devices if evidence is not None else None,
                    "offered_ms_per_s": _num(evidence.offered_ms_per_s) if evidence is not None else 0.0,
                    "protected_ms_per_s": (
                        _num(evidence.protected_capacity_ms_per_s) if evidence is not None else None
                    ),
                    "utilization": _num(evidence.utilization, 4) if evidence is not None else 0.0,
                    "queue": {
                        "depth": queue.queued if queue is not None else 0,
                        "inflight": queue.inflight if queue is not None else 0,
                        "queued_ms": _num(queue.queued_ms) if queue is not None else 0.0,
                        "dwell_p95_ms": _num(evidence.queue_dwell_p95_ms) if evidence is not None else None,
                        "dwell_budget_ms": load.dwell_budget_ms,
                    },
                    "admitted": len(mine),
                    "fallback_share": _num(sum(a[2] for a in mine) / len(mine), 4) if mine else 0.0,
                    "reduced_share": _num(sum(a[3] for a in mine) / len(mine), 4) if mine else 0.0,
                    "history": [
                        [round(t, 3), _num(offered), _num(protected), step]
                        for t, offered, protected, step in (history.samples if history else ())
                    ],
                    "steps": list(history.steps) if history else [],
                }
            )
        return pools

    @staticmethod
    def _prefix_view(gateway: Gateway) -> list[JSON]:
        """Per route with a prefix cache (``gateway.prefix_affinity``): answers, the share the
        backend reported a hit for, cached prompt tokens' share, saved accelerator-ms, spills."""
        return [
            {
                "model": route,
                "requests": c.requests,
                "hit_share": _num(c.hit_rate, 4),
                "cached_token_share": _num(c.cached_tokens / c.prompt_tokens, 4) if c.prompt_tokens else None,
                "saved_accelerator_ms": _num(c.saved_accelerator_ms, 1),
                "spills": c.spills,
                "extra_wait_ms_max": _num(c.extra_wait_ms_max, 1),
            }
            for route, c in sorted(gateway.pools.prefix.counters.items())
        ]

    def _streams_view(self) -> list[JSON]:
        """Per streaming model: its recent streams' first result (p50, p95), gaps (p95) and the
        shares that met their objectives (null: no sample)."""
        views = []
        for model, history in sorted(self._streams.items()):
            firsts = [first for first, _, _ in history.streams if first is not None]
            kept = len(history.streams)
            gaps = list(history.gaps)
            views.append(
                {
                    "model": model,
                    "streams": history.total,
                    "first_result_p50_ms": _num(_quantile(firsts, 0.5), 1) if firsts else None,
                    "first_result_p95_ms": _num(_quantile(firsts, 0.95), 1) if firsts else None,
                    "gap_p95_ms": _num(_quantile(gaps, 0.95), 1) if gaps else None,
                    "first_result_met_share": (
                        _num(sum(met for _, met, _ in history.streams) / kept, 4) if kept else None
                    ),
                    "gap_met_share": (
                        _num(sum(met for _, _, met in history.streams) / kept, 4) if kept else None
                    ),
                }
            )
        return views

    def _tenants_view(self, gateway: Gateway, since: float) -> list[JSON]:
        recent: defaultdict[str, float] = defaultdict(float)
        for at, who, charged in self._recent_charges:
            if at >= since:
                recent[who] += charged
        recent_total = sum(recent.values())
        active = [t for t in gateway.tenants.tenants.values() if recent[t.name] > 0]
        active_weight = sum(t.config.weight for t in active)
        mono = clock.now()
        tenants = []
        for name, tenant in sorted(gateway.tenants.tenants.items()):
            quotas = []
            for request_class in tenant.config.classes:
                view = gateway.quotas.available(name, request_class, now=mono)
                quotas.append(
                    {
                        "class": request_class,
                        "metered": view.metered,
                        "pooled": view.pooled,
                        "available_ms": _num(view.available_accelerator_ms, 1),
                        "burst_ms": _num(view.burst_ms, 1),
                        "refill_ms_per_s": _num(view.refill_ms_per_s, 1),
                        "borrowable_ms": _num(view.borrowable_ms, 1),
                        "concurrent": view.concurrent,
                        "max_concurrent": view.max_concurrent,
                    }
                )
            tenants.append(
                {
                    "name": name,
                    "admin": tenant.config.admin,
                    "weight": tenant.config.weight,
                    "charged_ms": _num(self._charged[name]),
                    "recent_ms": _num(recent[name]),
                    "share": _num(recent[name] / recent_total, 4) if recent_total > 0 else 0.0,
                    "weight_share": (
                        _num(tenant.config.weight / active_weight, 4) if recent[name] > 0 else None
                    ),
                    "quotas": quotas,
                    "rejections": dict(self._rejections.get(name, Counter()).most_common()),
                }
            )
        return tenants

    def _policy_view(self, gateway: Gateway) -> JSON:
        store = gateway.policy
        snapshot = store.snapshot
        return {
            "ready": store.ready,
            "version": snapshot.display_version if snapshot is not None else "",
            "engine": snapshot.engine_name if snapshot is not None else "",
            "rules": len(snapshot.rules) if snapshot is not None else 0,
            "failed_reloads": store.failures,
            "last_reload": self.last_reload,
            "fail_opens": dict(self._fail_opens.most_common()),
        }

    @staticmethod
    def _backends_view(gateway: Gateway) -> list[JSON]:
        backends = []
        for name, handle in sorted(gateway.backends.items()):
            client = handle.client
            backends.append(
                {
                    "name": name,
                    "healthy": client.healthy,
                    "cell": handle.labels.get("cell", ""),
                    "devices": handle.devices,
                    "models": {model: client.is_warm(model) for model in sorted(client.watched_models)},
                }
            )
        return backends
