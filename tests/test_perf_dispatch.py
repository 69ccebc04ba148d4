"""What the bound work keeps incrementally equals what a re-read of the slots gives (issue 31).

``_Bound`` keeps the list schedule's inputs (each occupant's predicted start and run, in
binding order), the latest predicted start and the count of long work as slots are bound and
released; ``DispatchQueue.inflight_remaining_ms`` keeps its last answer per (version of the
bound work, ``now``). On random traces (as tests/test_dispatch_incremental.py's, plus releases
before a slot's predicted start: bound-ahead work whose caller left or whose backend failed at
once, and slots bound straight into the set as a shadow candidate's are), at every step every
kept figure equals the one read again from the slots, every schedule answer equals the
re-simulated one (``DeviceSet.incremental = False``), and the kept remaining work equals the
sum written as before.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.dispatch import DispatchQueue, _Bound
from tests.test_dispatch_incremental import Trace, answers, pools_on, reference, request


def reread(bound: _Bound) -> tuple[list[tuple[float, float]], float, int]:
    """The kept figures, read again from the slots."""
    occupancy = [(slot.predicted_start, slot.run_ms) for slot in bound if slot.occupant]
    latest = max((slot.predicted_start for slot in bound), default=-math.inf)
    return occupancy, latest, sum(1 for slot in bound if slot.long)


def remaining_as_before(queue: DispatchQueue, now: float) -> float:
    """``inflight_remaining_ms`` as it was written before it was kept (the reference)."""
    return sum(max(0.0, s.cost_ms - max(0.0, now - s.predicted_start) * 1000.0) for s in queue._inflight)


step = st.one_of(
    request,
    request,
    request,
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.001, 0.003, 0.01, 0.03, 0.06, 0.5])),
    # Released at its predicted end (0), overrunning it (1, 2 more runs), or now, whatever its
    # predicted start (None: bound-ahead work may leave before it starts).
    st.tuples(st.just("release"), st.integers(0, 50), st.sampled_from([None, 0.0, 1.0, 2.0])),
    st.tuples(st.just("withdraw"), st.integers(0, 50)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("shadow"), st.sampled_from([1.0, 28.4, 470.0])),
    st.tuples(st.just("remote"), st.sampled_from([(), (0.004,), (-0.01, 0.02)])),
)


@settings(max_examples=300, deadline=None)
@given(
    devices=st.integers(1, 4),
    per_device=st.integers(1, 4),
    co_batch=st.sampled_from([1, 2, 3]),
    pools=st.integers(1, 2),
    short_lane=st.integers(0, 2),
    memory=st.booleans(),
    steps=st.lists(step, min_size=10, max_size=80),
)
def test_kept_figures_equal_the_slots_read_again(
    devices: int,
    per_device: int,
    co_batch: int,
    pools: int,
    short_lane: int,
    memory: bool,
    steps: list[tuple[object, ...]],
) -> None:
    device_set, queues = pools_on(devices, per_device, co_batch, pools, short_lane, memory)
    bound = device_set.bound
    assert isinstance(bound, _Bound)
    trace = Trace(device_set, queues)
    for action in steps:
        trace.step(action)
        now = trace.now
        occupancy, latest, longs = reread(bound)
        assert list(bound.occupancy().values()) == occupancy
        assert bound.latest() == latest
        assert bound.longs() == longs
        assert device_set.occupants() == len(occupancy)
        for queue in queues:
            expected = remaining_as_before(queue, now)
            assert queue.inflight_remaining_ms(now) == expected
            assert queue.inflight_remaining_ms(now) == expected  # the kept answer
        assert answers(device_set, queues, now) == reference(device_set, queues, now)
