"""Parallel topology (``gateway.core.topology``) and the dispatch queue's units (rule 10,
``gateway.core.units``), in virtual time: units planned packed inside hosts and link groups,
failure domains, layout arithmetic, and a property over generated scenarios: a TP-2 pool and
a TP-1 pool on the same 8 devices never hold one device twice, a TP-2 request never binds
while only one device of a unit is free, a unit with a lost device takes no work, and the
ladder's counted capacity follows the units left."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import load_gateway_config
from gateway.core.dispatch import DispatchQueue, Slot, Waiter
from gateway.core.errors import ConfigError
from gateway.core.topology import Layout, Topology, TopologyError, available, domain_losses, plan_units
from gateway.core.units import UnitDeviceSet
from tests.conftest import EXAMPLE_CONFIG

HOSTS = Topology(8, domains={"host": {"host-a": (0, 1, 2, 3), "host-b": (4, 5, 6, 7)}})
TP2 = Layout(tensor_parallel=2)
TP1 = Layout()


# ---------------------------------------------------------------- planning


def test_units_are_packed_inside_hosts_and_never_span_two() -> None:
    units = plan_units(HOSTS, TP2, "big")
    assert [u.devices for u in units] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    odd = Topology(6, domains={"host": {"a": (0, 1, 2), "b": (3, 4, 5)}})
    assert [u.devices for u in plan_units(odd, TP2, "big")] == [(0, 1), (3, 4)]  # 2 and 5 left over
    with pytest.raises(TopologyError, match="no unit of 4 devices fits inside one host"):
        plan_units(odd, Layout(tensor_parallel=4), "huge")


def test_link_groups_decide_packing_before_hosts() -> None:
    linked = Topology(
        8, domains={"host": {"h": tuple(range(8))}}, links={"nv-a": (0, 2, 4, 6), "nv-b": (1, 3, 5, 7)}
    )
    assert [u.devices for u in plan_units(linked, TP2, "big")] == [(0, 2), (4, 6), (1, 3), (5, 7)]


def test_a_pipeline_unit_lists_its_stages_and_explicit_units_are_checked() -> None:
    pipe = Layout(tensor_parallel=2, stage_shares=(0.5, 0.5))
    (first, second) = plan_units(HOSTS, pipe, "pp")
    assert first.stages == ((0, 1), (2, 3)) and second.stages == ((4, 5), (6, 7))
    with pytest.raises(TopologyError, match="unit 0 has 1 devices; the layout needs 2"):
        plan_units(HOSTS, Layout(tensor_parallel=2, units=((0,),)), "big")
    with pytest.raises(TopologyError, match="device 1 is in units 0 and 1"):
        plan_units(HOSTS, Layout(tensor_parallel=2, units=((0, 1), (1, 2))), "big")
    with pytest.raises(TopologyError, match="data_parallel 5 needs 5 units"):
        plan_units(HOSTS, Layout(tensor_parallel=2, data_parallel=5), "big")


def test_a_host_loss_takes_every_unit_spanning_it() -> None:
    placements = {"big": plan_units(HOSTS, TP2, "big"), "small": plan_units(HOSTS, TP1, "small")}
    losses = {loss.name: loss for loss in domain_losses(HOSTS, placements)}
    a = losses["host-a"]
    assert a.units_lost["big"] == ("big/u0", "big/u1") and a.units_left == {"big": 2, "small": 4}
    assert a.stranded == ()  # packed inside hosts: no unit strands a device of the other host
    spread = {"big": plan_units(HOSTS, Layout(tensor_parallel=2, units=((3, 4), (0, 1))), "big")}
    loss = next(x for x in domain_losses(HOSTS, spread) if x.name == "host-a")
    assert loss.units_lost["big"] == ("big/u0", "big/u1") and loss.stranded == (4,)
    assert [u.devices for u in available(placements["big"], {5})] == [(0, 1), (2, 3), (6, 7)]


def test_layout_arithmetic_tensor_and_pipeline() -> None:
    # TP-2: a request of 10 wall-ms holds 2 devices for 10 ms: 20 accelerator-ms.
    assert TP2.profile_scale() == 2.0
    assert (TP2.occupancy_ms(20.0), TP2.latency_ms(20.0)) == (10.0, 10.0)
    # Two stages 60/40 with a 10 % bubble: a new request every 0.6 x 1.1 of the latency.
    pipe = Layout(tensor_parallel=1, stage_shares=(0.6, 0.4), bubble_fraction=0.1)
    assert pipe.cadence_factor == pytest.approx(0.66)
    accel = 100.0 * pipe.profile_scale()  # 100 wall-ms of latency
    assert pipe.latency_ms(accel) == pytest.approx(100.0)
    assert pipe.occupancy_ms(accel) == pytest.approx(66.0)
    assert pipe.stage_ms(accel) == pytest.approx((60.0, 40.0))
    measured = Layout(tensor_parallel=2, measured_as="unit_device_ms")
    assert measured.profile_scale() == 1.0 and measured.latency_ms(20.0) == 10.0
    with pytest.raises(TopologyError, match="sum to 1"):
        Layout(stage_shares=(0.5, 0.6))


# ---------------------------------------------------------------- the queue's units


def pools(lost: tuple[int, ...] = ()) -> tuple[UnitDeviceSet, DispatchQueue, DispatchQueue]:
    devices = UnitDeviceSet(HOSTS, lost=lost)
    big = DispatchQueue("b/big", devices=4, slots=8, max_queued=1000, device_set=devices)
    small = DispatchQueue("b/small", devices=8, slots=16, max_queued=1000, device_set=devices)
    devices.attach(big, TP2, plan_units(HOSTS, TP2, "big"))
    devices.attach(small, TP1, plan_units(HOSTS, TP1, "small"))
    return devices, big, small


def ask(queue: DispatchQueue, t: float, cost_ms: float = 20.0, tenant: str = "t") -> Slot | Waiter:
    return queue.request(t, latest_start=t + 60.0, cost_ms=cost_ms, request_class="c", tenant=tenant)


def test_a_tp2_request_waits_while_only_one_device_of_each_unit_is_free() -> None:
    devices, big, small = pools()
    held = [ask(small, 0.0) for _ in range(4)]
    assert all(isinstance(s, Slot) for s in held)
    # Best fit packs the TP-1 work: the four requests take two whole pairs, two pairs stay free.
    taken = sorted(d for s in held if isinstance(s, Slot) and s.unit for d in s.unit.devices)
    assert len(devices.free_units(big)) == 2 and len(set(taken)) == 4
    more = [ask(small, 0.0) for _ in range(3)]  # one device of each of the other pairs, then one more
    assert all(isinstance(s, Slot) for s in more)
    assert len(devices.free_units(big)) == 0  # 7 of 8 devices held: no pair is whole
    waiting = ask(big, 0.0, cost_ms=40.0)
    assert isinstance(waiting, Waiter) and waiting.slot is None
    slots = [s for s in held + more if isinstance(s, Slot) and s.unit is not None]
    busy = {s.unit.devices[0] for s in slots if s.unit is not None}
    # A release that leaves half a pair held grants nothing ...
    half = next(s for s in slots if s.unit is not None and s.unit.devices[0] ^ 1 in busy)
    half.release(0.01)
    assert waiting.slot is None
    # ... one that frees a whole pair grants it (an occupancy of 40 / 2 = 20 ms).
    busy.discard(half.unit.devices[0])  # type: ignore[union-attr]
    whole = next(
        s for s in slots if s.unit is not None and not s.released and s.unit.devices[0] ^ 1 not in busy
    )
    whole.release(0.02)
    assert waiting.slot is not None and waiting.slot.unit is not None
    assert waiting.slot.cost_ms == pytest.approx(20.0)
    first = whole.unit.devices[0]
    assert set(waiting.slot.unit.devices) == {first, first ^ 1}


def test_a_waiting_tp2_request_claims_a_pair_and_tp1_work_only_backfills_it() -> None:
    """Gang scheduling's reservation: without it a freed device goes to the next TP-1 request
    and the pair is never whole while TP-1 work keeps coming."""
    topology = Topology(4, domains={"host": {"a": (0, 1), "b": (2, 3)}})
    devices = UnitDeviceSet(topology)
    big = DispatchQueue("b/big", devices=2, slots=4, max_queued=100, device_set=devices)
    small = DispatchQueue("b/small", devices=4, slots=8, max_queued=100, device_set=devices)
    devices.attach(big, TP2, plan_units(topology, TP2, "big"))
    devices.attach(small, TP1, plan_units(topology, TP1, "small"))
    held = [small.request(0.0, latest_start=5.0, cost_ms=c, tenant="t") for c in (10.0, 20.0, 30.0, 40.0)]
    assert all(isinstance(s, Slot) for s in held)
    pair = big.request(0.001, latest_start=1.0, cost_ms=20.0, tenant="t")  # the most urgent waiter
    assert isinstance(pair, Waiter)
    held[0].release(0.010)  # type: ignore[union-attr]
    # The pair predicted whole first (devices 0 and 1: whole at 20 ms) is claimed for it.
    claim = devices.claim(0.011)
    assert claim is not None and claim[0] is big and claim[1].devices == (0, 1)
    assert claim[2] == pytest.approx(0.020)
    late = small.request(0.011, latest_start=5.0, cost_ms=30.0, tenant="t")
    assert isinstance(late, Waiter) and late.slot is None  # would end after 20 ms: not on device 0
    short = small.request(0.011, latest_start=5.0, cost_ms=5.0, tenant="u")
    assert isinstance(short, Waiter)  # queued behind the waiter of its own pool...
    small.withdraw(late, 0.011)  # ... until that one leaves: then it backfills device 0
    assert short.slot is not None and short.slot.unit is not None and short.slot.unit.devices == (0,)
    short.slot.release(0.016)
    held[1].release(0.020)  # type: ignore[union-attr]
    assert pair.slot is not None and pair.slot.unit is not None and pair.slot.unit.devices == (0, 1)


def test_a_bound_tp2_unit_is_taken_from_the_tp1_pool() -> None:
    devices, big, small = pools()
    pairs = [ask(big, 0.0) for _ in range(4)]
    assert all(isinstance(s, Slot) for s in pairs)
    assert isinstance(ask(small, 0.0), Waiter)  # every device held by a TP-2 unit
    assert devices.free_times(0.0, queue=small)[0] == pytest.approx(0.010)  # 20 accel-ms / 2


def test_a_lost_device_takes_its_whole_unit_and_the_counted_capacity() -> None:
    devices, big, small = pools()
    assert (big.capacity_devices, small.capacity_devices) == (8, 8)
    devices.mark_lost({5})
    assert (big.capacity_devices, small.capacity_devices) == (6, 7)  # the whole pair; one device
    assert len(devices.available_units(big)) == 3
    granted = [ask(big, 0.0) for _ in range(4)]
    units = [s.unit.devices for s in granted if isinstance(s, Slot) and s.unit]
    assert sorted(units) == [(0, 1), (2, 3), (6, 7)] and isinstance(granted[3], Waiter)
    # Device 4, the lost device's healthy partner, is not lent to TP-2 work; TP-1 work may use it.
    slot = ask(small, 0.0)
    assert isinstance(slot, Slot) and slot.unit is not None and slot.unit.devices == (4,)
    devices.mark_lost({5}, lost=False, now=0.0)
    assert big.capacity_devices == 8


def test_with_every_unit_lost_the_predicted_wait_is_unbounded() -> None:
    _, big, _ = pools(lost=(0, 2, 4, 6))
    assert big.capacity_devices == 0
    assert math.isinf(big.predicted_wait_ms(0.0, cost_ms=20.0))


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("ask"), st.sampled_from(["big", "small"]), st.floats(2.0, 60.0)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(0.0)),
        st.tuples(st.just("lose"), st.integers(0, 7), st.just(0.0)),
        st.tuples(st.just("restore"), st.integers(0, 7), st.just(0.0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_units_never_overlap_never_split_and_never_run_on_a_lost_device(
    ops: list[tuple[str, object, float]],
) -> None:
    devices, big, small = pools()
    queues = {"big": big, "small": small}
    live: list[Slot] = []
    waiters: list[Waiter] = []
    t = 0.0
    for op, arg, cost in ops:
        t += 0.001
        if op == "ask":
            got = ask(queues[str(arg)], t, cost_ms=cost)
            if isinstance(got, Slot):
                live.append(got)
            else:
                waiters.append(got)
        elif op == "release" and live:
            live.pop(int(arg) % len(live)).release(t)  # type: ignore[call-overload]
        elif op == "lose":
            devices.mark_lost({int(arg)}, now=t)  # type: ignore[call-overload]
        elif op == "restore":
            devices.mark_lost({int(arg)}, lost=False, now=t)  # type: ignore[call-overload]
        for change in devices.take_changes():
            if change.slot is not None:
                live.append(change.slot)
                # Granted now: its unit was whole and healthy at this moment.
                assert change.slot.unit is not None and not change.slot.unit.spans(devices.lost)
        live = [s for s in live if not s.released]
        held = [d for s in live if s.unit for d in s.unit.devices]
        assert len(held) == len(set(held)), "a device held twice"
        for s in live:
            assert s.unit is not None
            assert s.unit in devices.units[s.queue], "a slot holds something other than one of its units"
        for q in (big, small):
            assert q.capacity_devices == len(devices.available_units(q)) * q.layout.width
            # A waiter is left waiting only while its pool has no free unit.
            if q.queued and devices.free_units(q):
                pytest.fail(f"{q.name}: waiters while a unit is free")


# ---------------------------------------------------------------- config


def test_a_layout_that_cannot_be_placed_is_an_error_at_its_line(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    for key in ("tenants_file", "routes_dir", "policies_dir"):
        data[key] = str((EXAMPLE_CONFIG.parent / data[key]).resolve())
    data.pop("jobs", None)
    data.pop("rollouts_dir", None)
    data.pop("rollouts_state_dir", None)
    data.pop("feature_sources", None)
    data["local_triton"]["model_repository"] = str(EXAMPLE_CONFIG.parent / "model_repository")
    data["local_triton"]["topology"] = {
        "domains": {"host": {"a": "0-1", "b": "2-3"}},
        "models": {"full-v18-tp2": {"tensor_parallel": 4}},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as error:
        load_gateway_config(path)
    assert "full-v18-tp2: no unit of 4 devices fits inside one host" in error.value.problem
    assert error.value.location.startswith(str(path)) and error.value.location.count(":") >= 2


def test_work_that_takes_only_an_idle_unit_never_takes_a_held_or_claimed_one() -> None:
    """A shadow candidate's slot (``free_unit_among``): a unit wholly idle, not lost, not claimed."""
    devices, big, small = pools(lost=(7,))
    candidate = plan_units(HOSTS, TP1, "shadow")
    held = [ask(small, 0.0) for _ in range(2)]  # best fit: 0, then 6 (its pair is broken: 7 lost)
    assert {s.unit.devices for s in held if isinstance(s, Slot) and s.unit} == {(0,), (6,)}
    assert devices.free_unit_among(0.0, candidate) == candidate[1]
    assert devices.free_unit_among(0.0, candidate[6:]) is None  # 6 held, 7 lost
    pairs = [ask(big, 0.0, cost_ms=60.0) for _ in range(3)]  # (2, 3) and (4, 5); the third waits
    assert [p.unit.devices for p in pairs if isinstance(p, Slot) and p.unit] == [(2, 3), (4, 5)]
    assert isinstance(pairs[2], Waiter)
    # The waiter claims (0, 1): whole when device 0's 20 ms end, before the pairs' 30 ms. Device 1
    # is idle, but claimed: work that takes only an idle unit may not take it.
    claimed = devices.claim(0.001)
    assert claimed is not None and claimed[1].devices == (0, 1)
    assert devices.free_unit_among(0.001, [candidate[1]]) is None
    assert devices.free_unit_among(0.001, candidate) is None  # nothing else is idle
