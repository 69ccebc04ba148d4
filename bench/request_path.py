"""The gateway's request path alone: CPU per request without gRPC, network or Triton.

What it measures
    ``Gateway.infer`` (authenticate, parse, shape, price, policy, decide, quota, dispatch,
    settle, provenance, and the listeners the server attaches: Prometheus metrics, the decision
    log and the status board) called in-process, N requests, 8 at a time, against
    ``MemoryBackend`` at time factor 0 (every execution returns at once), on the example
    stack's config, tenants, routes and policies. The same request ``bench/overhead.py``
    replays (``full-v18``, ``INPUT_IDS`` ``[1, 256]``, ``orchid.max_output_tokens=1``,
    tenant orchid). It prints process CPU-µs per request (``time.process_time``), and with
    ``--profile`` the top functions by own time (cProfile, which roughly doubles the cost).

    ``bench/overhead.py`` measures the whole process behind gRPC; the difference between its
    gateway figure and this one is grpc.aio's server and client machinery and telemetry.
    MemoryBackend's own bookkeeping (a few tens of µs) is included here.

    python bench/request_path.py              # 4,000 requests after 300 warm-up
    python bench/request_path.py --profile    # plus the 30 functions with the most own time
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import pstats
import sys
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.backends.memory import MemoryBackend, MemoryModel
from gateway.config import hash_api_key, load_gateway_config
from gateway.core.memory import DeviceMemory
from gateway.exchange import BackendHandle, CallContext
from gateway.pipeline import Gateway
from gateway.policy.decision_log import DecisionLog
from gateway.server import assemble_gateway, load_configuration, load_policies
from gateway.statusboard import StatusBoard
from gateway.telemetry import ListenerGroup, Telemetry
from orchid_tools.simulate import minted_key

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "orchid" / "gateway.yaml"
CONCURRENCY = 8


async def build() -> tuple[Gateway, bytes, tuple[tuple[str, str | bytes], ...]]:
    config = load_gateway_config(CONFIG)
    tenants, routes = load_configuration(config)
    # The tenants file holds key digests only: mint a key for orchid as the simulator does.
    orchid = tenants.tenants["orchid"].model_copy(
        update={"key_sha256": (hash_api_key(minted_key("orchid")),)}
    )
    tenants = tenants.model_copy(update={"tenants": {**tenants.tenants, "orchid": orchid}})
    policy = load_policies(config)
    local = config.local_triton
    assert local is not None, "the example config runs a local Triton"
    models = {
        name: MemoryModel(name=name, profile=routes.profiles[route.profile], instances=local.devices)
        for name, route in ((r.backend_model, r) for r in routes.models.values())
        if not route.streaming
    }
    backend = MemoryBackend("local", models, time_factor=0.0)
    handle = BackendHandle(
        backend,
        dict(local.labels),
        local.devices,
        local.max_inflight_per_device,
        0.001,
        False,
        DeviceMemory.from_gib(local.device_memory_gib, local.runtime_reserve_gib),
    )
    # The listeners GatewayServer attaches (the decision log to a logger, as with no file set).
    telemetry = Telemetry(config.telemetry, decision_log=DecisionLog(logging.getLogger("orchid.decisions")))
    board = StatusBoard()
    gateway = await assemble_gateway(
        config, tenants, routes, {"local": handle}, policy, listener=ListenerGroup(telemetry, board)
    )
    telemetry.bind(gateway)
    board.bind(gateway)
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    request.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, 256])
    request.raw_input_contents.append(np.arange(256, dtype=np.int32).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = 1
    metadata: tuple[tuple[str, str | bytes], ...] = (("authorization", f"Bearer {minted_key('orchid')}"),)
    return gateway, request.SerializeToString(), metadata


async def run(requests: int, warmup: int, profile: bool) -> int:
    gateway, raw, metadata = await build()

    async def one() -> None:
        await gateway.infer(
            raw, CallContext(metadata=metadata, time_remaining_s=None, received_at=clock.now())
        )

    async def batch(n: int) -> None:
        for _ in range(n // CONCURRENCY):
            await asyncio.gather(*(one() for _ in range(CONCURRENCY)))

    await batch(warmup)
    profiler = cProfile.Profile() if profile else None
    started = time.process_time()
    if profiler is not None:
        profiler.enable()
    await batch(requests)
    if profiler is not None:
        profiler.disable()
    cpu_us = (time.process_time() - started) / requests * 1e6
    note = " (under cProfile)" if profiler is not None else ""
    print(f"request path: {requests} requests, {CONCURRENCY} at a time: {cpu_us:.0f} CPU-us/request{note}")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", "--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="also print the top functions (cProfile)")
    args = parser.parse_args(argv)
    return asyncio.run(run(args.requests, args.warmup, args.profile))


if __name__ == "__main__":
    sys.exit(main())
