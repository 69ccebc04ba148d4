"""Units of a topology through the gateway, against a real Triton (issue 30): ``full-v18-tp2``
(TP-2: every execution holds a pair of devices) beside ``full-v18`` (TP-1) on the capacity
emulator's 4 shared devices, the gateway's backend declaring hosts of 2 devices.

Two views are compared. The gateway's: every unit it reserves (``UnitDeviceSet.assign``,
recorded with the devices bound work held and the devices lost at that moment). The
backend's: the emulator's execution log (``ORCHID_DEVICE_LOG``: each execution's devices,
from when it held all of them to when it let them go). What must hold:

* a TP-2 request never starts while only one of its devices is free: the gateway never
  reserves a unit with a device held or lost, and the execution of a TP-2 request that had to
  wait for a TP-1 request on its pair starts after that one ended;
* the TP-1 model never takes a device of a bound TP-2 unit: no two reservations share a device
  at once, and every execution held exactly a unit the gateway reserved;
* with one device of a unit marked lost (admin ``SetDevicesLost``), that unit takes no work, the
  TP-2 pool's protected capacity drops by the whole unit (2 devices) and the TP-1 pool's by one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import InferInput

from gateway import clock
from gateway._proto import admin_pb2, admin_pb2_grpc
from gateway.backends.local import LocalTriton
from gateway.config import BackendConfig, TopologyConfig
from gateway.core.dispatch import DispatchQueue, Slot
from gateway.core.overload import protected_capacity_ms_per_s
from gateway.core.units import UnitDeviceSet
from orchid_tools.cli import main as cli_main
from tests.conftest import OPS_KEY, ORCHID_KEY, ThreadedGateway, bearer, gateway_config, own_triton

TIME_FACTOR = 0.2
DEVICES = 4
TP2, TP1 = "full-v18-tp2", "full-v18"
CALL_TIMEOUT_S = 30.0
pytestmark = pytest.mark.triton


class Reservations:
    """Every unit the gateway reserved: (queue, devices, devices held then, devices lost then)."""

    def __init__(self) -> None:
        self.made: list[tuple[str, tuple[int, ...], frozenset[int], frozenset[int], float]] = []
        self.ended: dict[int, float] = {}  # id(slot) -> released at
        self.slots: list[tuple[Slot, tuple[int, ...], float]] = []

    def install(self, patch: pytest.MonkeyPatch) -> None:
        assign, release = UnitDeviceSet.assign, DispatchQueue._release

        def recorded_assign(devices: UnitDeviceSet, queue: DispatchQueue, slot: Slot) -> None:
            held, lost = frozenset(devices.held()), devices.lost
            assign(devices, queue, slot)
            assert slot.unit is not None
            now = clock.now()
            self.made.append((queue.name, slot.unit.devices, held, lost, now))
            self.slots.append((slot, slot.unit.devices, now))

        def recorded_release(queue: DispatchQueue, slot: Slot, now: float) -> None:
            self.ended[id(slot)] = now
            release(queue, slot, now)

        patch.setattr(UnitDeviceSet, "assign", recorded_assign)
        patch.setattr(DispatchQueue, "_release", recorded_release)

    def intervals(self) -> list[tuple[tuple[int, ...], float, float]]:
        return [
            (devices, start, self.ended.get(id(slot), float("inf"))) for slot, devices, start in self.slots
        ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadedGateway, Path, Path]]:
    root = tmp_path_factory.mktemp("topology-gateway")
    devices, log = root / "devices", root / "executions.jsonl"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ORCHID_DEVICE_DIR", str(devices))
        env.setenv("ORCHID_DEVICES", str(DEVICES))
        env.setenv("ORCHID_DEVICE_LOG", str(log))
        with own_triton(root, time_factor=TIME_FACTOR, models=(TP2, TP1)) as triton:
            running = _gateway(triton)
            running.start()
            try:
                yield running, devices, log
            finally:
                running.stop()


def _gateway(triton: LocalTriton) -> ThreadedGateway:
    topology = TopologyConfig.model_validate(
        {
            "domains": {"host": {"host-a": "0-1", "host-b": "2-3"}},
            "models": {TP2: {"tensor_parallel": 2}},
        }
    )
    backend = BackendConfig(
        name="local",
        address=triton.address,
        labels={"cell": "eu-restricted", "device_group": "local-a"},
        devices=DEVICES,
        time_scale=TIME_FACTOR,
        topology=topology,
    )
    return ThreadedGateway(gateway_config(triton.address, backends=(backend,)))


@pytest.fixture
def gateway(
    stack: tuple[ThreadedGateway, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ThreadedGateway, Reservations, Path, Path]]:
    """The module's gateway, every reservation it makes during the test recorded; every device
    found again after it."""
    running, devices, log = stack
    reservations = Reservations()
    reservations.install(monkeypatch)
    try:
        yield running, reservations, devices, log
    finally:
        for path in devices.glob("device-*.lost"):
            path.unlink()


def infer(address: str, model: str, *, tokens: int = 256, out: int = 16, timeout_s: float = 10.0) -> None:
    tensor = InferInput("INPUT_IDS", [1, tokens], "INT32")
    tensor.set_data_from_numpy(np.arange(tokens, dtype=np.int32).reshape(1, tokens))
    client = grpcclient.InferenceServerClient(address)
    try:
        result = client.infer(
            model,
            [tensor],
            headers=bearer(ORCHID_KEY),
            parameters={"orchid.max_output_tokens": out},
            client_timeout=timeout_s,
        )
    finally:
        client.close()
    assert result.as_numpy("OUTPUT_IDS").shape == (1, out)


def executions(log: Path, since: int = 0) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()[since:]]


def admin(address: str) -> admin_pb2_grpc.GatewayAdminStub:
    return admin_pb2_grpc.GatewayAdminStub(grpc.insecure_channel(address))


def check_reservations(reservations: Reservations) -> None:
    """The gateway's invariants: no unit reserved with a device held or lost, none shared."""
    assert reservations.made
    for name, devices, held, lost, _ in reservations.made:
        assert not set(devices) & held, f"{name} reserved {devices} while {sorted(held)} were held"
        assert not set(devices) & lost, f"{name} reserved {devices} with {sorted(lost)} lost"
        assert len(devices) == (2 if name.endswith(TP2) else 1), (name, devices)
    spans = reservations.intervals()
    for i, (a, a0, a1) in enumerate(spans):
        for b, b0, b1 in spans[i + 1 :]:
            if set(a) & set(b):
                assert a1 <= b0 or b1 <= a0, f"{a} and {b} held at once"


def test_a_mixed_load_never_shares_or_splits_a_unit(
    gateway: tuple[ThreadedGateway, Reservations, Path, Path],
) -> None:
    running, reservations, _, log = gateway
    mark = len(executions(log))
    models = [TP2 if k % 2 else TP1 for k in range(24)]
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda m: infer(running.address, m), models, timeout=4 * CALL_TIMEOUT_S))
    check_reservations(reservations)
    reserved = {devices for _, devices, *_ in reservations.made}
    ran = executions(log, mark)
    assert sum(entry["requests"] for entry in ran) == 24
    for entry in ran:  # every execution held what the gateway reserved, whole pairs for TP-2
        held = tuple(entry["devices"])
        if entry["model"] == TP2:
            # One request holds one pair. Triton's batcher may run two TP-2 requests the gateway
            # bound to the two pairs at once as one execution, which then holds both whole pairs.
            assert held in {(0, 1), (2, 3)} or (held == (0, 1, 2, 3) and entry["requests"] > 1), entry
        assert held in reserved or (entry["requests"] > 1 and set(held) <= {d for u in reserved for d in u})


def test_a_tp2_request_waits_while_only_one_device_of_its_pair_is_free(
    gateway: tuple[ThreadedGateway, Reservations, Path, Path],
) -> None:
    """Three long TP-1 requests hold devices 0, 1 and 2 (best fit packs them: a whole pair, then
    one device of the other); a TP-2 request sent meanwhile must wait for device 2's request to
    end, and runs on (2, 3) only after it."""
    running, reservations, _, log = gateway
    mark = len(executions(log))
    with ThreadPoolExecutor(4) as pool:
        longs = [pool.submit(infer, running.address, TP1, tokens=4000, out=500) for _ in range(3)]
        held = _wait_until(lambda: len(_bound(running, TP1)) == 3)
        assert held
        pair = pool.submit(infer, running.address, TP2, out=8)
        pair.result(CALL_TIMEOUT_S)
        for future in longs:
            future.result(CALL_TIMEOUT_S)
    check_reservations(reservations)
    ran = executions(log, mark)
    tp2 = [e for e in ran if e["model"] == TP2]
    tp1 = [e for e in ran if e["model"] == TP1]
    # Triton's batcher may run two of the TP-1 requests as one execution (on both their devices).
    assert len(tp2) == 1 and sum(e["requests"] for e in tp1) == 3
    pair_devices = set(tp2[0]["devices"])
    blocking = [e for e in tp1 if set(e["devices"]) & pair_devices]
    assert blocking, "the TP-1 work left a whole pair free: the scenario did not exercise the wait"
    assert all(tp2[0]["start"] >= e["end"] for e in blocking)


def test_a_lost_device_takes_its_whole_unit_and_its_capacity(
    gateway: tuple[ThreadedGateway, Reservations, Path, Path],
) -> None:
    running, reservations, devices, log = gateway
    infer(running.address, TP2)  # both pools exist
    infer(running.address, TP1)
    stub = admin(running.address)
    (devices / "device-3.lost").touch()  # the emulator's device fails ...
    status = stub.SetDevicesLost(lose(3), metadata=_ops())  # ... and the operator says so
    (backend,) = status.backends
    assert list(backend.lost) == [3]
    pools = {p.pool: p for p in backend.pools}
    tp2 = pools[f"local/{TP2}"]
    assert [(u.name, tuple(u.devices), u.available) for u in tp2.units] == [
        (f"{TP2}/u0", (0, 1), True),
        (f"{TP2}/u1", (2, 3), False),
    ]
    assert (tp2.capacity_devices, pools[f"local/{TP1}"].capacity_devices) == (2, 3)

    def capacity(model: str) -> float:
        load = running.server.gateway.pools.loads[f"local/{model}"]
        return load.evidence.protected_capacity_ms_per_s if load.evidence is not None else -1.0

    protected = running.server.gateway.config.protected_utilization
    assert _wait_until(lambda: capacity(TP2) == protected_capacity_ms_per_s(2, protected))
    assert _wait_until(lambda: capacity(TP1) == protected_capacity_ms_per_s(3, protected))

    mark = len(executions(log))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda m: infer(running.address, m), [TP2, TP1] * 6, timeout=4 * CALL_TIMEOUT_S))
    check_reservations(reservations)
    ran = executions(log, mark)
    assert sum(e["requests"] for e in ran) == 12  # nothing failed on the lost device
    assert all(3 not in e["devices"] for e in ran)
    assert all(tuple(e["devices"]) == (0, 1) for e in ran if e["model"] == TP2)

    with pytest.raises(grpc.RpcError) as bad:
        stub.SetDevicesLost(
            admin_pb2.SetDevicesLostRequest(backend="local", devices=[9], lost=True), metadata=_ops()
        )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in (
        bad.value.details() or ""
    )
    with pytest.raises(grpc.RpcError) as denied:
        stub.TopologyStatus(admin_pb2.TopologyStatusRequest(), metadata=bearer_metadata(ORCHID_KEY))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

    stub.SetDevicesLost(
        admin_pb2.SetDevicesLostRequest(backend="local", devices=[3], lost=False), metadata=_ops()
    )
    (devices / "device-3.lost").unlink()
    assert _wait_until(lambda: capacity(TP2) == protected_capacity_ms_per_s(4, protected))


def lose(device: int, *, lost: bool = True) -> admin_pb2.SetDevicesLostRequest:
    return admin_pb2.SetDevicesLostRequest(backend="local", devices=[device], lost=lost)


def _ops() -> tuple[tuple[str, str], ...]:
    return bearer_metadata(OPS_KEY)


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _bound(running: ThreadedGateway, model: str) -> list[Slot]:
    def read() -> list[Slot]:
        units = running.server.gateway.pools.unit_set("local")
        return [s for s in units.bound if s.queue.name == f"local/{model}"]

    result: list[Slot] = running.call_soon(read)
    return result


def _wait_until(condition: Any, timeout_s: float = 20.0) -> bool:
    """Poll a condition (no sleep as synchronisation: the condition decides, the bound fails)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


def test_the_devices_command_marks_and_shows_units(
    gateway: tuple[ThreadedGateway, Reservations, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    running, _, _, _ = gateway
    infer(running.address, TP2)
    common = ["--address", running.address, "--key", OPS_KEY]
    assert cli_main(["devices", "lost", "2", *common]) == 0
    shown = capsys.readouterr().out
    assert "backend local: 4 devices; lost: 2" in shown
    assert f"local/{TP2}: width 2, capacity 2 devices: u0 [0, 1]; u1 [2, 3] LOST" in shown
    assert cli_main(["devices", "back", "2", *common]) == 0
    capsys.readouterr()
    assert cli_main(["devices", "status", "--json", *common]) == 0
    status = json.loads(capsys.readouterr().out)
    (backend,) = status["backends"]
    assert backend["lost"] == [] and all(u["available"] for p in backend["pools"] for u in p["units"])
    assert cli_main(["devices", "lost", "x", *common]) == 2  # a usage error, said so
    assert "name the devices" in capsys.readouterr().err
    assert cli_main(["devices", "lost", "1", "--backend", "nowhere", *common]) == 1
    assert "INVALID_ARGUMENT: backend 'nowhere' has no topology" in capsys.readouterr().err
