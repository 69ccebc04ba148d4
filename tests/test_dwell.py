"""A class's ``max_dwell_ms`` bounds its own requests' queue dwell in the ladder's evidence
(``gateway.core.dwell``): one pool, three classes, one ladder.

The pool's budget is the interactive class's 20 ms. The pool's devices are saturated
(admitted work at their whole raw time), so dwell over budget would force step 3.
"""

from __future__ import annotations

from gateway.core.dwell import dwell_sample_ms
from gateway.core.load import PoolLoad
from gateway.core.overload import LadderConfig, LadderStep
from tests.test_load import FEED_END_S, SEED_CAPACITY, feed_steady, gather, interactive, seed_pool

CAPS_MS = {"interactive": 20.0, "batch": 5000.0, "control": 5.0}  # examples/orchid/gateway.yaml
# The demand steps out of reach, so that only dwell can move the ladder (as in test_load).
DWELL_ONLY = LadderConfig(
    shed_optional_at=2.0,
    reduce_output_at=2.1,
    fallback_at=2.2,
    defer_batch_at=2.3,
    reject_interactive_at=2.4,
    protect_admitted_at=2.5,
)


def saturated_pool(request_class: str, dwell_ms: float, samples: int = 100) -> PoolLoad:
    load = seed_pool(DWELL_ONLY)
    feed_steady(load, interactive(load), SEED_CAPACITY / 0.70, relief=1.0)
    for i in range(samples):
        sample = dwell_sample_ms(
            dwell_ms, class_cap_ms=CAPS_MS[request_class], budget_ms=load.dwell_budget_ms
        )
        load.dwell.add(9.0 + i * 0.01, sample)
    gather(load, FEED_END_S)
    return load


def test_each_class_is_judged_by_its_own_cap() -> None:
    # Batch work waiting 1 s of its 5 s cap is within it: no overload evidence (judged by the
    # interactive 20 ms, it forced step 3).
    assert saturated_pool("batch", 1000.0).step == 0
    assert saturated_pool("batch", 6000.0).step == LadderStep.FALLBACK  # over its own cap
    # Interactive: its own cap is the budget, unchanged.
    assert saturated_pool("interactive", 19.0).step == 0
    assert saturated_pool("interactive", 35.0).step == LadderStep.FALLBACK
    # Control work waiting 10 ms is twice its 5 ms cap: a breach, though under 20 ms.
    assert saturated_pool("control", 10.0).step == LadderStep.FALLBACK
    assert saturated_pool("control", 4.0).step == 0


def test_a_cap_of_zero_admits_no_dwell() -> None:
    assert dwell_sample_ms(0.0, class_cap_ms=0.0, budget_ms=20.0) == 0.0
    assert dwell_sample_ms(0.5, class_cap_ms=0.0, budget_ms=20.0) > 20.0
