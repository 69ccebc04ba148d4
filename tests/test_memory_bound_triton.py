"""The live-memory bound end to end, against the real Triton: concurrent long-context
requests through the gateway never reach the capacity emulator's allocation failure (they
wait for the device, or are refused with the bound's rule), while the same requests sent
directly to Triton do hit it.

The emulator models device memory from its model config (``device_memory_gib``,
``runtime_reserve_gib``, ``weights_bytes``, ``live_cache_bytes_per_token``) and fails a batch
whose live state does not fit with ``CUDA out of memory``. At the tests' scale the device is
small: this module's own Triton serves full-v18 on one instance (one device) with the numbers
in ``DEVICE`` and ``MODEL``, and the gateway's bound is built from the same numbers, written
once from here into the model config, the route's profile and the backend's config. The
device holds 6,144 live tokens: one 4,096-in / 128-out request (4,224) fits, two do not; a
6,144-in / 128-out request (6,272) never fits.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.backends.local import LocalTriton
from gateway.config import BackendConfig
from gateway.core.memory import DEVICE_LIMIT_RULE
from tests.conftest import MODEL_REPOSITORY, ORCHID_KEY, ROOT, ThreadedGateway, gateway_config

TIME_FACTOR = 0.1  # a 4,096 / 128 request holds the device ~47 ms: the burst piles up behind it
DEVICE = {"device_memory_gib": 2.0, "runtime_reserve_gib": 0.25}
MODEL = {"weights_bytes": 1024**3, "live_cache_bytes_per_token": 128 * 1024}
FITS = (4096, 128)  # 4,224 live tokens of the 6,144 a device holds
NEVER = (6144, 128)  # 6,272: more than an idle device holds
BURST = [FITS] * 4 + [NEVER] * 2
INFER = "/inference.GRPCInferenceService/ModelInfer"
OOM = "CUDA out of memory"


@dataclass
class Stack:
    triton: LocalTriton
    routes_dir: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("memory")
    repository = root / "repo" / "model_repository"
    shutil.copytree(MODEL_REPOSITORY / "full-v18", repository / "full-v18")
    shutil.copytree(
        MODEL_REPOSITORY.parent / "emulator",
        root / "repo" / "emulator",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    config = repository / "full-v18" / "config.pbtxt"
    text, count = re.subn(r"count: \d+", "count: 1", config.read_text())
    assert count == 1
    for key, value in {**DEVICE, **MODEL}.items():
        text, count = re.subn(rf'(key: "{key}", value: {{ string_value: )"[^"]*"', rf'\g<1>"{value}"', text)
        assert count == 1, key
    config.write_text(text)
    routes = yaml.safe_load((ROOT / "routes" / "orchid.yaml").read_text())
    routes["profiles"]["full-v18"].update(MODEL)
    for name, profile in routes["profiles"].items():  # the others are not served here: fit them
        if name != "full-v18":
            profile["weights_bytes"] = MODEL["weights_bytes"]
    routes["models"]["full-v18"].pop("shadow")
    routes_dir = root / "routes"
    routes_dir.mkdir()
    (routes_dir / "orchid.yaml").write_text(yaml.safe_dump(routes))
    triton = LocalTriton(repository, root / "triton", time_factor=TIME_FACTOR)
    triton.start()
    try:
        yield Stack(triton, routes_dir)
    finally:
        triton.kill()  # disposable: see conftest.own_triton


def _request(shape: tuple[int, int], *, through_gateway: bool) -> bytes:
    tokens, output = shape
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, tokens])
    request.raw_input_contents.append(np.arange(tokens, dtype=np.int32).tobytes())
    limit = "orchid.max_output_tokens" if through_gateway else "max_output_tokens"
    request.parameters[limit].int64_param = output
    return request.SerializeToString()


@dataclass(frozen=True)
class Answer:
    shape: tuple[int, int]
    code: grpc.StatusCode
    details: str = ""
    rule: str = ""


async def _burst(address: str, *, through_gateway: bool) -> list[Answer]:
    """Every request of BURST at once, each on its own call."""
    metadata = (("authorization", f"Bearer {ORCHID_KEY}"),) if through_gateway else None
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)

        async def one(shape: tuple[int, int]) -> Answer:
            try:
                await call(_request(shape, through_gateway=through_gateway), metadata=metadata, timeout=30)
            except grpc.aio.AioRpcError as error:
                trailing = dict(error.trailing_metadata() or ())
                return Answer(
                    shape, error.code(), error.details() or "", str(trailing.get("orchid-rule", ""))
                )
            return Answer(shape, grpc.StatusCode.OK)

        return await asyncio.gather(*(one(shape) for shape in BURST))


def _executed(address: str) -> int:
    """Triton's count of full-v18's inferences (an error response counts too)."""
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name="full-v18"), timeout=10)
    return int(reply.model_stats[0].inference_count)


def _allocation_failures(triton: LocalTriton) -> int:
    """The emulator's allocation failures so far, as it logs them (one line per failed batch)."""
    return triton.log_path.read_text(errors="replace").count(OOM)


def test_through_the_gateway_the_burst_never_reaches_the_allocation_failure(stack: Stack) -> None:
    backend = BackendConfig(
        name="local",
        address=stack.triton.address,
        labels={"cell": "eu-restricted", "device_group": "local-a"},
        devices=1,
        max_inflight_per_device=2,
        time_scale=TIME_FACTOR,
        **DEVICE,
    )
    running = ThreadedGateway(
        gateway_config(stack.triton.address, backends=(backend,), routes_dir=stack.routes_dir)
    )
    running.start()
    try:
        before = (_executed(stack.triton.address), _allocation_failures(stack.triton))
        answers = asyncio.run(_burst(running.address, through_gateway=True))
        after = (_executed(stack.triton.address), _allocation_failures(stack.triton))
    finally:
        running.stop()
    # The requests that fit a device waited for it, one at a time, and all completed.
    assert [a.code for a in answers if a.shape == FITS] == [grpc.StatusCode.OK] * 4, answers
    # The ones no device can hold were refused at admission with the bound's rule and limit.
    for refused in (a for a in answers if a.shape == NEVER):
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT, refused
        assert refused.rule == DEVICE_LIMIT_RULE
        assert "6,272 live tokens; a device holds at most 6,144" in refused.details
    assert not any(OOM in a.details for a in answers)
    # Triton ran the four, and the emulator never failed an allocation.
    assert (after[0] - before[0], after[1] - before[1]) == (4, 0)


def test_sent_directly_to_triton_the_same_burst_hits_the_allocation_failure(stack: Stack) -> None:
    before = _allocation_failures(stack.triton)
    answers = asyncio.run(_burst(stack.triton.address, through_gateway=False))
    # Alone a request that no device holds fails; and the ones that fit a device alone were
    # co-batched by Triton's dynamic batcher while the device was busy, which no device holds.
    assert all(OOM in a.details for a in answers if a.shape == NEVER), answers
    assert any(OOM in a.details for a in answers if a.shape == FITS), answers
    assert _allocation_failures(stack.triton) > before  # the emulator logged them
