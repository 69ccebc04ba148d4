"""Prometheus metrics of the policy core, registered once per process.

Owns the metric names. ``get_or_create`` makes re-imports (``importlib.reload``
in tests, two stores in one process) reuse the registered collectors instead
of failing with "Duplicated timeseries". Only ``store`` records into them:
the snapshot itself stays free of side effects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Histogram

_C = TypeVar("_C")

# Why these buckets: the default engine evaluates the whole default set in
# tens of microseconds; the tail that matters is 50 us .. 5 ms.
EVAL_BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3, 25e-3)


def get_or_create(name: str, factory: Callable[[], _C]) -> _C:
    """The collector registered under ``name`` in the default registry, else a new one."""
    names: dict[str, Any] = getattr(REGISTRY, "_names_to_collectors", {})
    for candidate in (name, f"{name}_total", f"{name}_bucket"):
        existing = names.get(candidate)
        if existing is not None:
            return existing  # type: ignore[no-any-return]
    return factory()


POLICY_RELOADS: Counter = get_or_create(
    "orchid_policy_reloads",
    lambda: Counter("orchid_policy_reloads", "Policy reload attempts by result (ok, failed).", ["result"]),
)
POLICY_EVAL_SECONDS: Histogram = get_or_create(
    "orchid_policy_eval_seconds",
    lambda: Histogram(
        "orchid_policy_eval_seconds",
        "Time to evaluate the policy set for one request.",
        buckets=EVAL_BUCKETS_S,
    ),
)
POLICY_FAIL_OPEN: Counter = get_or_create(
    "orchid_policy_fail_open",
    lambda: Counter(
        "orchid_policy_fail_open",
        "Requests that passed a rule with on_error: allow because the rule erred.",
        ["rule"],
    ),
)
POLICY_RULE_ERRORS: Counter = get_or_create(
    "orchid_policy_rule_errors",
    lambda: Counter("orchid_policy_rule_errors", "CEL runtime errors by rule.", ["rule"]),
)
