"""A request class's queue-dwell cap (``max_dwell_ms``) as overload evidence.

The overload ladder judges a pool's gateway-queue dwell p95 against one budget
(``PoolLoad.dwell_budget_ms``; ``gateway.core.overload`` rule 5: over it, on a saturated
backend, at least step 3). One pool serves classes whose caps differ by orders of magnitude
(the example: control 5 ms, interactive 20 ms, batch 5 s), so each request's dwell enters
the window in the budget's units: its dwell as a share of its own class's cap, times the
budget. A batch request that waited 1 s of its 5 s is then 4 ms against an interactive
20 ms budget, not a breach; a control request that waited 10 ms of its 5 ms is 40 ms, a
breach. Without this, the pool judged every class by the cap of whichever class created
it, and the other classes' caps bounded nothing.

A cap of 0 means no dwell at all is within it: any positive dwell is a breach.
"""

from __future__ import annotations

# What a dwell under a cap of 0 counts as, in budgets: a breach by far, and still finite (the
# dwell window refuses infinities).
_ZERO_CAP_BREACH = 1000.0


def dwell_sample_ms(dwell_ms: float, *, class_cap_ms: float, budget_ms: float) -> float:
    """``dwell_ms`` of a request whose class caps dwell at ``class_cap_ms``, expressed against
    the pool's ``budget_ms`` (equal caps: unchanged)."""
    if budget_ms <= 0.0 or class_cap_ms == budget_ms:
        return dwell_ms
    if class_cap_ms <= 0.0:
        return budget_ms * _ZERO_CAP_BREACH if dwell_ms > 0.0 else 0.0
    return dwell_ms * budget_ms / class_cap_ms
