"""The capacity emulator's shared devices (``ORCHID_DEVICE_DIR``), against a real Triton:
with one emulated device, a full-v18 batch and a compact-v11 batch sent at once take turns
on it (the surge benchmark relies on this to put the fallback on the primary's devices).

Only a lower bound on elapsed time is asserted: a sleep never ends early, so it cannot
flake on a slow machine; without the shared device the pair overlaps and stays well under it.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import InferInput

from gateway.backends.local import LocalTriton
from tests.conftest import MODEL_REPOSITORY

TIME_FACTOR = 0.5
# 4,096 input / 128 output tokens: 467.6 device-ms on full-v18, 239.2 on compact-v11.
FULL_MS = 467.6 * TIME_FACTOR
COMPACT_MS = 239.2 * TIME_FACTOR
CALL_TIMEOUT_S = 30.0  # a bound on every call: a hung Triton fails the test, never hangs it


def _long_request() -> list[InferInput]:
    tensor = InferInput("INPUT_IDS", [1, 4096], "INT32")
    tensor.set_data_from_numpy(np.zeros((1, 4096), dtype=np.int32))
    return [tensor]


def _both_at_once(address: str) -> float:
    def call(model: str) -> None:
        client = grpcclient.InferenceServerClient(address)
        try:
            client.infer(
                model, _long_request(), parameters={"max_output_tokens": 128}, client_timeout=CALL_TIMEOUT_S
            )
        finally:
            client.close()

    with ThreadPoolExecutor(2) as pool:
        for model in ("full-v18", "compact-v11"):  # warm both instances' first call
            pool.submit(call, model).result(timeout=CALL_TIMEOUT_S)
        started = time.monotonic()
        list(pool.map(call, ("full-v18", "compact-v11"), timeout=2 * CALL_TIMEOUT_S))
    return (time.monotonic() - started) * 1000.0


def test_models_on_one_shared_device_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHID_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.setenv("ORCHID_DEVICES", "1")
    # Only the two models (faster to start); model.py imports ../../../emulator.
    repository = tmp_path / "repo" / "model_repository"
    for model in ("full-v18", "compact-v11"):
        shutil.copytree(MODEL_REPOSITORY / model, repository / model)
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", tmp_path / "repo" / "emulator")
    triton = LocalTriton(repository, tmp_path / "triton", time_factor=TIME_FACTOR)
    triton.start()
    try:
        elapsed_ms = _both_at_once(triton.address)
    finally:
        triton.kill()  # disposable: see conftest.own_triton
    # Each model has instances of its own; only the shared device keeps them from overlapping
    # (overlapping, the pair would take about FULL_MS, 234 ms).
    assert elapsed_ms >= 0.97 * (FULL_MS + COMPACT_MS), elapsed_ms
