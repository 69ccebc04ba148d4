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

    ``--stages`` samples the run with pyinstrument (0.1 ms interval) and attributes every
    sample to the innermost request-path stage on its stack (``STAGES``), then prints the
    per-stage CPU table docs/benchmarks.md "Where a request's CPU goes" shows; ``--census``
    counts Python calls, C calls and dataclass constructions per request with a profile hook
    (generated ``__init__``s share one label in cProfile, so constructions are counted by
    class here; the request path's msgspec Structs are built in C, with no Python frame, and
    are not counted). Both slow the run; the table's µs are the samples' shares of the plain
    run's CPU-µs per request, which is measured first.

    python bench/request_path.py              # 4,000 requests after 300 warm-up
    python bench/request_path.py --profile    # plus the 30 functions with the most own time
    python bench/request_path.py --stages --census   # the per-stage table and the call census
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import pstats
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.config import hash_api_key, load_gateway_config
from gateway.exchange import CallContext
from gateway.pipeline import Gateway
from gateway.policy.decision_log import DecisionLog
from gateway.server import assemble_gateway, load_configuration, load_policies
from gateway.statusboard import StatusBoard
from gateway.telemetry import ListenerGroup, Telemetry
from orchid_tools.harness import memory_example
from orchid_tools.simulate import minted_key

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "orchid" / "gateway.yaml"
CONCURRENCY = 8

# (file path suffix, function name or "*") -> stage; a sample goes to the innermost match on
# its stack, so a helper shared by stages (the core, the dispatch queue) counts for its caller.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("gateway/auth.py", "*", "auth"),
    ("gateway/messages.py", "parse_infer_request", "edge/parse"),
    ("gateway/messages.py", "attach_provenance", "provenance"),
    ("gateway/messages.py", "*", "provenance"),
    ("gateway/chain/__init__.py", "backend_request", "provenance (backend request copy)"),
    ("gateway/chain/resolve.py", "*", "resolve"),
    ("gateway/chain/place.py", "*", "place"),
    ("gateway/pools.py", "place", "place"),
    ("gateway/pools.py", "warm", "place"),
    ("gateway/chain/shaping.py", "*", "shape"),
    ("gateway/chain/price.py", "*", "price"),
    ("gateway/evidence.py", "route_evidence", "judge/policy: evidence verdicts"),
    ("gateway/chain/judge.py", "context", "judge/policy: context"),
    ("gateway/chain/judge.py", "on_pool", "judge/policy: context"),
    ("gateway/chain/judge.py", "shed", "judge/policy: context"),
    ("gateway/chain/judge.py", "judge", "judge/policy: evaluate"),
    ("gateway/core/quota.py", "available", "judge/policy: quota view"),
    ("gateway/state/memory.py", "available", "judge/policy: quota view"),
    ("gateway/chain/decide.py", "*", "decide"),
    ("gateway/chain/reserve.py", "*", "quota reserve"),
    ("gateway/chain/wait.py", "*", "dispatch acquire"),
    ("gateway/scheduler.py", "release", "dispatch release"),
    ("gateway/chain/__init__.py", "_count_evidence_denials", "telemetry"),
    ("gateway/chain/execute.py", "*", "execute hooks"),
    ("gateway/backends/memory.py", "*", "backend (MemoryBackend)"),
    ("gateway/chain/settle.py", "*", "settle"),
    ("gateway/telemetry.py", "*", "telemetry"),
    ("prometheus_client/", "*", "telemetry"),
    ("gateway/policy/decision_log.py", "*", "listeners (decision log)"),
    ("gateway/statusboard.py", "*", "listeners (status board)"),
    ("gateway/rollouts.py", "settled", "rollout hooks"),
    ("gateway/chain/__init__.py", "admit", "admit (chain's own lines)"),
    ("gateway/chain/__init__.py", "unary", "unary (chain's own lines)"),
    ("gateway/pipeline.py", "infer", "edge/parse"),
)


def stage_of(stack: list[str]) -> str:
    """The innermost stage on a pyinstrument stack (identifiers ``name\\0file\\0line...``)."""
    for identifier in reversed(stack):
        name, path = identifier.split("\x00")[:2]
        for suffix, function, stage in STAGES:
            if (function == "*" or function == name) and (path.endswith(suffix) or suffix in path):
                return stage
    return "event loop, gather, bench harness"


def stage_table(frame_records: list[tuple[list[str], float]], requests: int, cpu_us: float) -> str:
    totals: Counter[str] = Counter()
    for stack, seconds in frame_records:
        totals[stage_of(stack)] += seconds
    whole = sum(totals.values()) or 1.0
    lines = ["| stage | share | CPU-µs per request |", "|---|---:|---:|"]
    for stage, seconds in totals.most_common():
        lines.append(f"| {stage} | {seconds / whole:.1%} | {cpu_us * seconds / whole:.0f} |")
    lines.append(f"| **total** (the plain run) | 100% | {cpu_us:.0f} |")
    return "\n".join(lines)


class Census:
    """Calls and dataclass constructions, counted by a profile hook (``sys.setprofile``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.c_calls = 0
        self.constructed: Counter[str] = Counter()
        self.functions: Counter[str] = Counter()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1
            code = frame.f_code
            if code.co_name == "__init__" and code.co_filename == "<string>":
                owner = frame.f_locals.get("self")
                self.constructed[type(owner).__qualname__] += 1
            else:
                self.functions[f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"] += 1
        elif event == "c_call":
            self.c_calls += 1

    def report(self, requests: int) -> str:
        made = sum(self.constructed.values())
        lines = [
            f"per request: {self.calls / requests:.0f} Python calls, {self.c_calls / requests:.0f} C calls, "
            f"{made / requests:.1f} dataclass constructions (generated __init__; msgspec Structs uncounted)",
            "constructions per request, by class:",
        ]
        lines += [f"  {n / requests:6.2f}  {name}" for name, n in self.constructed.most_common(40)]
        lines.append("Python calls per request, the 40 most called functions:")
        lines += [f"  {n / requests:6.2f}  {name}" for name, n in self.functions.most_common(40)]
        return "\n".join(lines)


async def build() -> tuple[Gateway, bytes, tuple[tuple[str, str | bytes], ...]]:
    config = load_gateway_config(CONFIG)
    tenants, routes = load_configuration(config)
    # The tenants file holds key digests only: mint a key for orchid as the simulator does.
    orchid = tenants.tenants["orchid"].model_copy(
        update={"key_sha256": (hash_api_key(minted_key("orchid")),)}
    )
    tenants = tenants.model_copy(update={"tenants": {**tenants.tenants, "orchid": orchid}})
    policy = load_policies(config)
    _, handle = memory_example(config, routes)  # the example's local Triton, in memory
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


async def run(requests: int, warmup: int, profile: bool, stages: bool = False, census: bool = False) -> int:
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
    if stages:
        from pyinstrument import Profiler  # a dev dependency: only this option needs it

        sampler = Profiler(interval=0.0001, async_mode="disabled")
        sampler.start()
        await batch(requests)
        session = sampler.stop()
        samples = len(session.frame_records)
        print(f"\nper-stage CPU (pyinstrument, {samples} samples, shares scaled to the plain run):")
        print(stage_table(session.frame_records, requests, cpu_us))
    if census:
        counter = Census()
        await _hooked(counter.hook, lambda: batch(requests))
        print("\ncall census (sys.setprofile):")
        print(counter.report(requests))
    return 0


async def _hooked(hook: Callable[[FrameType, str, Any], None], body: Callable[[], Awaitable[None]]) -> None:
    sys.setprofile(hook)
    try:
        await body()
    finally:
        sys.setprofile(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", "--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="also print the top functions (cProfile)")
    parser.add_argument("--stages", action="store_true", help="also the per-stage CPU table (pyinstrument)")
    parser.add_argument("--census", action="store_true", help="also calls and constructions per request")
    args = parser.parse_args(argv)
    return asyncio.run(run(args.requests, args.warmup, args.profile, args.stages, args.census))


if __name__ == "__main__":
    sys.exit(main())
