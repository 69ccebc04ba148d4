"""The simulator on a parallel topology: units in the fleet, ``devices_lost`` faults, and the
in-memory backend holding exactly the devices of a request's unit.

Figures are read from the simulation's JSON report (the scenario's own expectations, the
units its fault takes); the backend's rules from its executions in virtual time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.backends.memory import Execution, MemoryBackend, MemoryModel
from gateway.core.errors import GatewayError
from gateway.core.profile import DemandProfile
from orchid_tools.cli import main
from orchid_tools.simulate import render_text, simulate
from orchid_tools.virtual_time import VirtualTimeLoop
from tests.conftest import ROOT

SCENARIOS = ROOT / "examples" / "orchid" / "simulate"
HOST_LOSS = SCENARIOS / "topology-host-loss.yaml"


# --------------------------------------------------------------------------- the scenario


@pytest.fixture(scope="module")
def host_loss() -> dict[str, Any]:
    return simulate(HOST_LOSS)


def test_host_loss_takes_host_b_units_and_gives_them_back(host_loss: dict[str, Any]) -> None:
    (fault,) = host_loss["faults"]
    assert fault["kind"] == "devices_lost"
    assert fault["domain"] == {"kind": "host", "name": "host-b"}
    assert fault["devices"] == [4, 5, 6, 7]
    units = fault["units"]
    # The TP-2 pairs on devices 4-7, and each TP-1 unit on 4..7.
    assert units["node-pair/full-v18-tp2"]["units_lost"] == ["full-v18-tp2/u2", "full-v18-tp2/u3"]
    assert units["node-pair/full-v18-tp2"]["units_left"] == 2
    assert units["node-pair/full-v18"]["units_lost"] == [f"full-v18/u{d}" for d in range(4, 8)]
    assert units["node-pair/full-v18"]["units_left"] == 4
    phases = {p["name"]: p for p in host_loss["phases"]}
    lost = phases["surge-fault"]["units"]["node-pair"]
    assert lost["lost_devices"] == [4, 5, 6, 7]
    assert lost["available_units"]["node-pair/full-v18-tp2"] == 2
    assert lost["available_units"]["node-pair/full-v18"] == 4
    for name in ("normal", "surge-after", "recovered"):  # before the loss, and back after until_s
        back = phases[name]["units"]["node-pair"]
        assert back["lost_devices"] == []
        assert back["available_units"]["node-pair/full-v18-tp2"] == 4
        assert back["available_units"]["node-pair/full-v18"] == 8


def test_host_loss_expectations(host_loss: dict[str, Any]) -> None:
    """Normal load steady, admitted work on time while host-b is lost (refused early instead),
    and back to the normal phase's behaviour within 20 s of the surge's end (the recovery bound
    of the fault-recovery work)."""
    failed = [e for e in host_loss["expectations"] if not e["held"]]
    assert not failed, failed


def test_host_loss_text_names_the_units_taken(host_loss: dict[str, Any]) -> None:
    out = render_text(host_loss)
    assert "Fault: devices_lost node-pair devices 4-7 (host host-b) at 30" in out
    assert (
        "units taken: node-pair/compact-v11 4 of 8, node-pair/full-v18 4 of 8, node-pair/full-v18-tp2 2 of 4"
        in out
    )


# --------------------------------------------------------------------------- scenario errors


def _bad(tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str) -> tuple[str, str]:
    text = HOST_LOSS.read_text()
    assert old in text
    text = text.replace(old, new)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if new.splitlines()[0] in row)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code = main(["simulate", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    return f"{path}:{line}:", err


def test_a_devices_lost_fault_on_an_unknown_domain_is_located(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where, err = _bad(tmp_path, capsys, "name: host-b}, at_s", "name: host-z}, at_s")
    assert where in err and "faults.0.domain.name" in err and "host-z" in err, err


def test_a_devices_lost_fault_on_a_backend_without_topology_is_located(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad2.yaml"
    lines = HOST_LOSS.read_text().splitlines()
    start = lines.index("    topology:")
    kept = lines[:start] + [row for row in lines[start + 1 :] if not row.startswith("      ")]
    path.write_text("\n".join(kept) + "\n")
    line = next(i for i, row in enumerate(kept, 1) if "kind: devices_lost" in row)
    code = main(["simulate", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"{path}:{line}:" in err and "faults.0.backend" in err and "declares no topology" in err, err


# --------------------------------------------------------------------------- the backend

PROFILE = DemandProfile(fixed_ms=10.0, prefill_ms_per_token=0.0, decode_ms_per_token=1.0)


def _request(
    model: str, rid: str, output_tokens: int, devices: str | None = None
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=rid)
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 4])
    request.raw_input_contents.append(np.arange(4, dtype=np.int32).tobytes())
    request.parameters["max_output_tokens"].int64_param = output_tokens
    if devices is not None:
        request.parameters["devices"].string_param = devices
    return request


def _backend(executions: list[Execution]) -> MemoryBackend:
    return MemoryBackend(
        "b",
        [MemoryModel("tp1", PROFILE, instances=4), MemoryModel("tp2", PROFILE, instances=4)],
        devices=4,
        units={"tp2": [(0, 1), (2, 3)]},
        on_execution=executions.append,
    )


def _run(body: Coroutine[Any, Any, None]) -> None:
    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(body)
    finally:
        loop.close()


async def _call(
    backend: MemoryBackend, request: service_pb2.ModelInferRequest, spans: dict[str, tuple[float, float]]
) -> GatewayError | None:
    loop = asyncio.get_running_loop()
    try:
        await backend.infer(request, timeout_s=60.0, logical=request.model_name)
    except GatewayError as error:
        return error
    started = next(e.started_at for e in executions_of(backend) if e.request_id == request.id)
    spans[request.id] = (started, loop.time())
    return None


def executions_of(backend: MemoryBackend) -> list[Execution]:
    return backend._test_executions  # type: ignore[attr-defined,no-any-return]


def test_executions_naming_overlapping_devices_never_overlap() -> None:
    async def body() -> None:
        executions: list[Execution] = []
        backend = _backend(executions)
        backend._test_executions = executions  # type: ignore[attr-defined]
        spans: dict[str, tuple[float, float]] = {}
        calls = [
            ("a", "tp2", "0,1", 50),
            ("b", "tp1", "1", 20),
            ("c", "tp2", "2,3", 30),
            ("d", "tp1", "0", 10),
            ("e", "tp2", "0,1", 5),
            ("f", "tp1", "3", 40),
        ]
        errors = await asyncio.gather(
            *(_call(backend, _request(m, rid, n, d), spans) for rid, m, d, n in calls)
        )
        assert errors == [None] * len(calls)
        named = {rid: set(int(x) for x in d.split(",")) for rid, _m, d, _n in calls}
        for x in named:
            for y in named:
                if x < y and named[x] & named[y]:
                    (s1, e1), (s2, e2) = spans[x], spans[y]
                    assert e1 <= s2 + 1e-9 or e2 <= s1 + 1e-9, (x, y, spans[x], spans[y])
        # "c" shares no device with "a": they ran together; a TP-2 execution counts both devices.
        assert spans["c"][0] == spans["a"][0] == 0.0
        by_id = {e.request_id: e for e in executions}
        assert by_id["a"].device_ms == pytest.approx(2 * 60.0)

    _run(body())


def test_a_tp2_execution_waits_for_both_devices_of_its_unit() -> None:
    async def body() -> None:
        executions: list[Execution] = []
        backend = _backend(executions)
        backend._test_executions = executions  # type: ignore[attr-defined]
        spans: dict[str, tuple[float, float]] = {}
        hold_0 = asyncio.ensure_future(_call(backend, _request("tp1", "h0", 90, "0"), spans))
        hold_2 = asyncio.ensure_future(_call(backend, _request("tp1", "h2", 40, "2"), spans))
        await asyncio.sleep(0.001)
        # Devices 1 and 3 are free, but no whole unit is: the TP-2 execution takes the first
        # unit that is wholly free (2-3 once h2 ends), never half of one.
        assert await _call(backend, _request("tp2", "t", 10), spans) is None
        await asyncio.gather(hold_0, hold_2)
        assert spans["t"][0] == pytest.approx(spans["h2"][1])
        assert spans["t"][0] >= 0.05 - 1e-9

    _run(body())


def test_an_execution_on_a_lost_device_fails() -> None:
    async def body() -> None:
        executions: list[Execution] = []
        backend = _backend(executions)
        backend._test_executions = executions  # type: ignore[attr-defined]
        spans: dict[str, tuple[float, float]] = {}
        running = asyncio.ensure_future(_call(backend, _request("tp2", "r", 100, "2,3"), spans))
        await asyncio.sleep(0.02)
        backend.set_devices_lost([3])
        error = await running
        assert error is not None and "device 3 is lost" in error.message, error
        error = await _call(backend, _request("tp1", "n", 5, "3"), spans)
        assert error is not None and "device 3 is lost" in error.message, error
        assert await _call(backend, _request("tp1", "ok", 5, "2"), spans) is None  # its pair is not lost
        lost = next(e for e in executions if e.request_id == "r")
        assert not lost.answered and lost.device_ms == pytest.approx(2 * 20.0)
        backend.set_devices_lost([3], lost=False)
        assert await _call(backend, _request("tp2", "back", 5, "2,3"), spans) is None

    _run(body())
