"""The live-memory bound (dispatch rule 8, ``gateway.core.memory``): the core driven by hand
with explicit times, its agreement with the capacity worksheet on the seed's fixture, the
configuration that declares it, and the example emulator declaring the same numbers.

Against the real Triton: ``tests/test_memory_bound_triton.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway.config import check_memory, load_gateway_config, load_routes
from gateway.core.dispatch import DeviceSet, Slot, Waiter
from gateway.core.dispatch import DispatchQueue as CoreQueue
from gateway.core.errors import ConfigError, InvalidArgument, ResourceExhausted
from gateway.core.memory import (
    DEVICE_LIMIT_RULE,
    LIVE_TOKENS_RULE,
    DeviceMemory,
    live_tokens,
    resident_bytes,
)
from gateway.core.profile import GIB
from gateway.scheduler import DispatchQueue
from orchid_tools.capacity import compute_worksheet, load_workload
from orchid_tools.virtual_time import now, virtual_time
from tests.conftest import EXAMPLE_CONFIG, MODEL_REPOSITORY, ROOT, emulator_parameters

WORKLOAD = ROOT / "examples" / "orchid" / "workload.yaml"

# A small device for the core's tests: 2 GiB, a 0.25 GiB reserve, 1 GiB of weights, 128 KiB per
# token: 0.75 GiB = 6,144 live tokens. A 4,096-in / 128-out request holds 4,224 of them.
PER_TOKEN = 128 * 1024
SMALL = DeviceMemory.from_gib(2.0, 0.25)
WEIGHTS = GIB
ROOM_TOKENS = 6144
LONG = 4224 * PER_TOKEN


def _queue(devices: int = 1, slots: int = 2) -> CoreQueue:
    device_set = DeviceSet(devices, memory=SMALL)
    device_set.place("full-v18", WEIGHTS)
    return CoreQueue("q", devices=devices, slots=slots, max_queued=10, device_set=device_set)


# ---------------------------------------------------------------- the worksheet and the live bound


def test_the_worksheet_and_the_live_bound_agree_on_the_seeds_392584_tokens() -> None:
    """Both from the shipped fixtures: the worksheet from examples/orchid/workload.yaml, the
    bound from the gateway's example configuration (the local backend's device memory) and
    the route's profile (routes/orchid.yaml), as the gateway builds a pool's device set."""
    sheet = compute_worksheet(load_workload(WORKLOAD), source=str(WORKLOAD))
    worksheet_tokens = sheet.value("memory.full-v18.live_tokens")

    config = load_gateway_config(EXAMPLE_CONFIG)
    assert config.local_triton is not None
    routes = load_routes(config.routes_dir)
    profile = routes.profiles[routes.models["full-v18"].profile]
    device_set = DeviceSet(
        1,
        memory=DeviceMemory.from_gib(
            config.local_triton.device_memory_gib, config.local_triton.runtime_reserve_gib
        ),
    )
    device_set.place("full-v18", resident_bytes(profile))
    queue = CoreQueue("local/full-v18", devices=1, slots=2, max_queued=4, device_set=device_set)
    bound_tokens = live_tokens(device_set.live_room_bytes, profile.live_cache_bytes_per_token)

    assert bound_tokens == worksheet_tokens == 392_584  # the seed's figure
    # ... and the queue binds exactly that many live tokens on an idle device, not one more.
    per_token = profile.live_cache_bytes_per_token
    slot = queue.request(0.0, latest_start=1.0, cost_ms=1.0, live_bytes=worksheet_tokens * per_token)
    assert isinstance(slot, Slot)
    slot.release(0.001)
    with pytest.raises(InvalidArgument) as refused:
        queue.request(0.002, latest_start=1.0, cost_ms=1.0, live_bytes=(worksheet_tokens + 1) * per_token)
    assert refused.value.rule == DEVICE_LIMIT_RULE


# ---------------------------------------------------------------- the core, driven by hand


def test_core_work_that_cannot_fit_an_idle_device_is_refused_at_once_holding_nothing() -> None:
    queue = _queue()
    with pytest.raises(InvalidArgument) as refused:
        queue.request(0.0, latest_start=1.0, cost_ms=10, live_bytes=(ROOM_TOKENS + 1) * PER_TOKEN)
    assert refused.value.rule == DEVICE_LIMIT_RULE
    assert (queue.inflight, queue.queued) == (0, 0)
    exact = queue.request(0.0, latest_start=1.0, cost_ms=10, live_bytes=ROOM_TOKENS * PER_TOKEN)
    assert isinstance(exact, Slot)  # exactly the room fits


def test_core_binds_ahead_only_beside_work_it_fits_with() -> None:
    queue = _queue()
    running = queue.request(0.0, latest_start=1.0, cost_ms=100, live_bytes=LONG)
    assert isinstance(running, Slot)
    # 1,000 more tokens fit beside the running 4,224: bound ahead into the backend's queue.
    beside = queue.request(0.01, latest_start=1.0, cost_ms=5, live_bytes=1000 * PER_TOKEN)
    assert isinstance(beside, Slot) and beside.predicted_start == pytest.approx(0.1)

    queue = _queue()
    running = queue.request(0.0, latest_start=1.0, cost_ms=100, live_bytes=LONG)
    assert isinstance(running, Slot)
    # 2,000 do not (6,224 > 6,144): it waits here, not bound, holding nothing on the device.
    held = queue.request(0.01, latest_start=1.0, cost_ms=5, live_bytes=2000 * PER_TOKEN)
    assert isinstance(held, Waiter) and held.memory_held and queue.memory_held == 1
    assert queue.device_set.take_changes() == [] and len(queue.device_set.bound) == 1
    running.release(0.1)  # the release frees the running work's live state: now it binds
    assert queue.device_set.take_changes() == [held]
    assert held.slot is not None and held.slot.started_at == held.slot.predicted_start == 0.1


def test_core_work_held_for_memory_past_its_latest_start_leaves_with_the_memory_rule() -> None:
    queue = _queue()
    running = queue.request(0.0, latest_start=1.0, cost_ms=100, live_bytes=LONG)
    assert isinstance(running, Slot)
    held = queue.request(0.01, latest_start=0.3, cost_ms=5, live_bytes=2000 * PER_TOKEN)
    assert isinstance(held, Waiter) and held.memory_held
    # The running request overruns its prediction (100 ms) and still holds its state at 0.3.
    refusal = queue.refusal(held, 0.3)
    assert isinstance(refusal, ResourceExhausted) and refusal.rule == LIVE_TOKENS_RULE
    assert refusal.retry_after_ms is not None and refusal.retry_after_ms >= 1
    assert queue.withdraw(held, 0.3) is None
    running.release(0.4)
    assert queue.device_set.take_changes() == [] and queue.queued == 0 and queue.inflight == 0


def test_core_the_memory_retry_after_is_when_bound_work_is_predicted_to_free_it() -> None:
    queue = _queue()
    running = queue.request(0.0, latest_start=1.0, cost_ms=250, live_bytes=LONG)
    assert isinstance(running, Slot)
    # A waiter held for memory fits once the running 250 ms end.
    assert queue.device_set.memory_free_at(0.05, 2000 * PER_TOKEN) == pytest.approx(0.25)
    held = queue.request(0.05, latest_start=0.9, cost_ms=5, live_bytes=2000 * PER_TOKEN)
    assert isinstance(held, Waiter) and held.memory_held
    refusal = queue.refusal(held, 0.05)
    assert refusal.retry_after_ms == 200 and refusal.rule == LIVE_TOKENS_RULE


def test_core_a_waiter_held_for_a_device_leaves_late_not_for_memory() -> None:
    queue = _queue()
    running = queue.request(0.0, latest_start=1.0, cost_ms=100, live_bytes=LONG)
    assert isinstance(running, Slot)
    late = queue.request(0.0, latest_start=0.05, cost_ms=5, live_bytes=PER_TOKEN)  # starts at 0.1
    assert isinstance(late, Waiter) and not late.memory_held
    assert queue.refusal(late, 0.05).rule == "queue.latest_start"


def test_core_work_bound_now_goes_to_the_idle_device_not_beside_an_overrun() -> None:
    queue = _queue(devices=2, slots=4)
    overrun = queue.request(0.0, latest_start=1.0, cost_ms=100, live_bytes=LONG)
    assert isinstance(overrun, Slot)
    # At 0.5 the first request has overrun its 100 ms: its device is predicted free "now" and so
    # is the idle one; the new long request is placed on the idle one, where it fits.
    second = queue.request(0.5, latest_start=1.0, cost_ms=100, live_bytes=LONG)
    assert isinstance(second, Slot)


def test_core_a_shared_device_set_leaves_room_beside_every_resident_model() -> None:
    device_set = DeviceSet(1, memory=SMALL)
    primary = CoreQueue("b/full", devices=1, slots=2, max_queued=4, device_set=device_set)
    fallback = CoreQueue("b/compact", devices=1, slots=2, max_queued=4, device_set=device_set)
    device_set.place("full", WEIGHTS)
    alone = device_set.live_room_bytes
    device_set.place("compact", GIB // 16)  # the fallback's replica beside the primary's
    assert device_set.live_room_bytes == alone - GIB // 16
    with pytest.raises(InvalidArgument):  # fits a device holding the primary alone, not this one
        primary.request(0.0, latest_start=1.0, cost_ms=10, live_bytes=ROOM_TOKENS * PER_TOKEN)
    slot = fallback.request(0.0, latest_start=1.0, cost_ms=10, live_bytes=LONG)
    assert isinstance(slot, Slot)
    # The other pool's work holds the device's memory too.
    waiter = primary.request(0.0, latest_start=1.0, cost_ms=10, live_bytes=2000 * PER_TOKEN)
    assert isinstance(waiter, Waiter) and waiter.memory_held
    slot.release(0.01)
    assert device_set.take_changes() == [waiter]


@virtual_time
async def test_the_driver_refuses_a_waiter_still_held_for_memory_at_its_latest_start() -> None:
    device_set = DeviceSet(1, memory=SMALL)
    device_set.place("full-v18", WEIGHTS)
    queue = DispatchQueue("q", devices=1, slots=2, max_queued=4, device_set=device_set)
    t0 = now()
    running = await queue.acquire(latest_start=t0 + 5, cost_ms=100, live_bytes=LONG)  # overruns
    with pytest.raises(ResourceExhausted) as refused:
        await queue.acquire(latest_start=t0 + 0.3, cost_ms=5, live_bytes=2000 * PER_TOKEN)
    assert refused.value.rule == LIVE_TOKENS_RULE and refused.value.retry_after_ms is not None
    assert now() == pytest.approx(t0 + 0.3) and queue.queued == 0
    running.release()
    assert queue.inflight == 0 and not device_set.bound


# ---------------------------------------------------------------- configuration


def test_backends_declare_device_memory_with_the_seeds_defaults(tmp_path: Path) -> None:
    head = (
        "tenants_file: t.yaml\nroutes_dir: r\npolicies_dir: p\n"
        "classes: {interactive: {default_deadline_ms: 5}}\n"
    )
    path = tmp_path / "gateway.yaml"
    path.write_text(
        head + "backends:\n"
        "  - {name: a, address: 'x:1', labels: {cell: c, device_group: g}, devices: 1}\n"
        "  - {name: b, address: 'x:2', labels: {cell: c, device_group: g}, devices: 1,\n"
        "     device_memory_gib: 2, runtime_reserve_gib: 0.25}\n"
    )
    a, b = load_gateway_config(path).backends
    assert a.memory == DeviceMemory.from_gib(80, 6)
    assert b.memory == SMALL
    path.write_text(
        head + "backends:\n  - {name: a, address: 'x:1', labels: {cell: c, device_group: g}, "
        "devices: 1, device_memory_gib: 0}\n"
    )
    with pytest.raises(ConfigError) as bad:
        load_gateway_config(path)
    assert bad.value.key == "backends.0.device_memory_gib"


def test_a_model_that_cannot_fit_its_backends_devices_fails_to_load_at_its_line(tmp_path: Path) -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    routes_dir = tmp_path / "routes"
    routes_dir.mkdir()
    text = (ROOT / "routes" / "orchid.yaml").read_text()
    text, count = re.subn(r"weights_bytes: 28000000000(\s+# 14e9)", r"weights_bytes: 90000000000\1", text)
    assert count == 1  # full-v18's (full-v18-tp2 declares the same model)
    (routes_dir / "orchid.yaml").write_text(text)
    config = config.model_copy(update={"routes_dir": routes_dir})
    with pytest.raises(ConfigError) as error:
        check_memory(config, load_routes(routes_dir))
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "90000000000" in row)
    assert f"orchid.yaml:{line}:" in error.value.location
    assert error.value.key == "profiles.full-v18.weights_bytes"
    assert "exceed its device memory (80 GiB)" in error.value.problem


# ---------------------------------------------------------------- the emulator's declared numbers


def test_the_example_emulator_declares_the_gateways_memory_numbers() -> None:
    """One truth, checked: every example model's device memory parameters are the route
    profile's and the example gateway's local backend's."""
    config = load_gateway_config(EXAMPLE_CONFIG)
    assert config.local_triton is not None
    routes = load_routes(config.routes_dir)
    backend_models = {route.backend_model: route.profile for route in routes.models.values()}
    backend_models |= {"full-v18-kestrel": "full-v18", "full-v19": "full-v18"}  # dedicated, shadow
    data = yaml.safe_load((ROOT / "examples" / "orchid" / "tenants.yaml").read_text())
    assert data["tenants"]["kestrel"]["dedicated_models"] == {"full-v18": "full-v18-kestrel"}
    assert (
        routes.models["full-v18"].shadow is not None
        and routes.models["full-v18"].shadow.backend_model == "full-v19"
    )
    for model in sorted(p.name for p in MODEL_REPOSITORY.iterdir() if (p / "config.pbtxt").exists()):
        profile = routes.profiles[backend_models[model]]
        declared = emulator_parameters(model)
        assert float(declared["device_memory_gib"]) == config.local_triton.device_memory_gib, model
        assert float(declared["runtime_reserve_gib"]) == config.local_triton.runtime_reserve_gib, model
        # A tensor-parallel model's emulator declares one device's share (each holds 1/tp).
        tp = int(declared.get("tensor_parallel", "1"))
        assert int(declared["weights_bytes"]) * tp == resident_bytes(profile), model
        assert int(declared["live_cache_bytes_per_token"]) * tp == profile.live_cache_bytes_per_token, model
