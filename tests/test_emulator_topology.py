"""The capacity emulator's tensor-parallel units (``tensor_parallel``, the ``devices`` request
parameter, ``device-<d>.lost``), against a real Triton on 4 shared emulated devices
(``ORCHID_DEVICE_DIR``) serving ``full-v18-tp2`` (TP-2: one execution holds 2 devices) beside
``full-v18`` (TP-1).

What each execution held, and when, is read from the emulator's execution log
(``ORCHID_DEVICE_LOG``): one JSON line per execution, ``start`` once all its devices were held,
``end`` before they were released. No assertion bounds a time from above; the one lower bound
(a unit that waits for a device this test holds starts after the test lets it go) cannot flake.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from gateway.backends.local import LocalTriton
from tests.conftest import own_triton

TIME_FACTOR = 0.2
DEVICES = 4
TP2 = "full-v18-tp2"
TP1 = "full-v18"
CALL_TIMEOUT_S = 30.0  # a bound on every call: a hung Triton fails the test, never hangs it
ALIGNED = ({0, 1}, {2, 3})  # the aligned TP-2 units of 4 devices


@dataclass
class Fleet:
    triton: LocalTriton
    devices: Path
    log: Path

    def mark(self) -> int:
        """How many executions the log holds now (entries after it: ``entries(mark)``)."""
        return len(self.entries())

    def entries(self, since: int = 0) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines[since:]]

    def lose(self, device: int) -> None:
        (self.devices / f"device-{device}.lost").touch()

    def infer(self, model: str, devices: str | None = None, tokens: int = 256, out: int = 16) -> None:
        tensor = InferInput("INPUT_IDS", [1, tokens], "INT32")
        tensor.set_data_from_numpy(np.arange(tokens, dtype=np.int32).reshape(1, tokens))
        parameters: dict[str, Any] = {"max_output_tokens": out}
        if devices is not None:
            parameters["devices"] = devices
        client = grpcclient.InferenceServerClient(self.triton.address)
        try:
            result = client.infer(model, [tensor], parameters=parameters, client_timeout=CALL_TIMEOUT_S)
        finally:
            client.close()
        ids = result.as_numpy("OUTPUT_IDS")
        assert ids is not None and ids.shape == (1, out)

    def error(self, model: str, devices: str) -> str:
        """The error message a request naming ``devices`` gets (it must fail)."""
        with pytest.raises(InferenceServerException) as failure:
            self.infer(model, devices)
        return str(failure.value)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("topology")
    devices, log = root / "devices", root / "executions.jsonl"
    with pytest.MonkeyPatch.context() as patch:  # read by the server's environment at start
        patch.setenv("ORCHID_DEVICE_DIR", str(devices))
        patch.setenv("ORCHID_DEVICES", str(DEVICES))
        patch.setenv("ORCHID_DEVICE_LOG", str(log))
        with own_triton(root, time_factor=TIME_FACTOR, models=(TP2, TP1)) as server:
            yield Fleet(server, devices, log)


@pytest.fixture
def topology(fleet: Fleet) -> Iterator[Fleet]:
    """The module's fleet, every device found again after the test."""
    try:
        yield fleet
    finally:
        for path in fleet.devices.glob("device-*.lost"):
            path.unlink()


class HeldDevice:
    """This test holding an emulated device's lock, as an execution elsewhere would."""

    def __init__(self, fleet: Fleet, device: int) -> None:
        fleet.devices.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(fleet.devices / f"device-{device}.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # blocks while an execution holds it

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def _disjoint_in_time(entries: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of executions that held a common device at overlapping times (should be none)."""
    return [
        (a, b)
        for a, b in itertools.combinations(entries, 2)
        if set(a["devices"]) & set(b["devices"]) and a["start"] < b["end"] and b["start"] < a["end"]
    ]


def test_units_are_held_whole_and_never_shared_under_a_concurrent_mix(topology: Fleet) -> None:
    # TP-2 requests naming either aligned unit or none, TP-1 requests naming a device or none.
    kinds: list[tuple[str, str | None]] = [
        (TP2, "0,1"),
        (TP2, "2,3"),
        (TP2, None),
        (TP1, None),
        (TP2, None),
        (TP1, "3"),
        (TP1, None),
        (TP2, "2,3"),
    ]
    calls = kinds * 8
    mark = topology.mark()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(topology.infer, model, devices) for model, devices in calls]
        for future in futures:
            future.result(timeout=2 * CALL_TIMEOUT_S)
    entries = topology.entries(mark)
    assert sum(e["requests"] for e in entries) == len(calls)
    assert {e["model"] for e in entries} == {TP1, TP2}
    for entry in entries:
        held = set(entry["devices"])
        assert len(held) == len(entry["devices"]), entry
        assert entry["start"] <= entry["end"], entry
        if entry["model"] == TP2:
            # A unit named (both named here are aligned), or one the execution chose (aligned);
            # a batch of requests naming both units holds their union.
            assert held in (*ALIGNED, {0, 1, 2, 3}), entry
            if entry["requests"] == 1:
                assert held in ALIGNED, entry
        elif entry["requests"] == 1:
            assert len(held) == 1 and held <= {0, 1, 2, 3}, entry
    assert _disjoint_in_time(entries) == []


def test_a_named_unit_is_the_one_held(topology: Fleet) -> None:
    for model, devices, held in (
        (TP2, "2,3", [2, 3]),
        (TP2, "3, 2", [2, 3]),
        (TP2, "1,2", [1, 2]),
        (TP1, "3", [3]),
    ):
        mark = topology.mark()
        topology.infer(model, devices)
        assert [(e["model"], e["devices"], e["requests"]) for e in topology.entries(mark)] == [
            (model, held, 1)
        ]


def test_a_unit_waits_for_all_its_devices_and_tp1_keeps_pairs_free(topology: Fleet) -> None:
    held = HeldDevice(topology, 3)
    try:
        mark = topology.mark()
        topology.infer(TP1, None)  # best fit: device 2, whose partner 3 is busy
        topology.infer(TP2, None)  # the only whole free unit
        assert [(e["model"], e["devices"]) for e in topology.entries(mark)] == [(TP1, [2]), (TP2, [0, 1])]
        mark = topology.mark()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(topology.infer, TP2, "2,3")
            time.sleep(0.3)  # a lower bound on how long device 3 stays held, not a synchronisation
            assert not waiting.done()  # device 2 alone is free: the unit has not started
            released = time.time()
            held.release()
            waiting.result(timeout=CALL_TIMEOUT_S)
        [entry] = topology.entries(mark)
        assert entry["devices"] == [2, 3] and entry["start"] >= released, (entry, released)
    finally:
        held.release()


def test_a_lost_device_fails_the_unit_naming_it_and_is_skipped_otherwise(topology: Fleet) -> None:
    topology.lose(1)
    mark = topology.mark()
    message = topology.error(TP2, "0,1")
    assert "CUDA error: device 1 is lost" in message, message
    assert "CUDA error: device 1 is lost" in topology.error(TP1, "1")
    assert topology.entries(mark) == []  # nothing ran, nothing held

    (topology.devices / "device-1.lost").unlink()
    topology.lose(0)
    mark = topology.mark()
    topology.infer(TP2, None)  # unit {0,1} has a lost device: {2,3}
    topology.infer(TP1, None)  # best fit: device 1, whose partner 0 is lost
    topology.infer(TP2, "2,3")
    assert [(e["model"], e["devices"]) for e in topology.entries(mark)] == [
        (TP2, [2, 3]),
        (TP1, [1]),
        (TP2, [2, 3]),
    ]

    topology.lose(2)  # every aligned unit has a lost device now
    mark = topology.mark()
    message = topology.error(TP2, "")  # an empty value is a bad one; without it:
    assert "parameter devices" in message, message
    with pytest.raises(InferenceServerException) as failure:
        topology.infer(TP2, None)
    assert "CUDA error: no unit of 2 device(s)" in str(failure.value), failure.value
    assert topology.entries(mark) == []


@pytest.mark.parametrize(
    ("model", "devices", "says"),
    [
        (TP2, "9,9", "parameter devices names device 9, outside the 4 emulated devices 0..3"),
        (TP2, "a", 'parameter devices must be device indices separated by commas, like "2,3"'),
        (
            TP2,
            "2",
            "parameter devices names 1 device(s) ('2') but full-v18-tp2 is tensor-parallel of degree 2",
        ),
        (TP2, "1,1", "parameter devices names device 1 more than once"),
        (TP2, "-1,0", "parameter devices must be device indices"),
        (TP1, "0,1", "but full-v18 is tensor-parallel of degree 1"),
    ],
)
def test_a_bad_devices_parameter_gets_a_clear_error(
    topology: Fleet, model: str, devices: str, says: str
) -> None:
    mark = topology.mark()
    message = topology.error(model, devices)
    assert says in message, message
    assert topology.entries(mark) == []
