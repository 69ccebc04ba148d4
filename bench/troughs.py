"""Batch work in the troughs: what a large batch costs interactive traffic, and what it gets.

Starts one Triton (the example emulator repository, ``--time-factor`` 1.0: a 256/64-token
request holds a device for 56.8 ms) and ``orchid-gateway serve`` with jobs enabled (a
fresh state directory), then runs three scenarios against the same gateway process:

* ``interactive``: open-loop Poisson interactive traffic (tenant ``orchid``, 256/64 tokens,
  the class's 200 ms deadline) at ``--load`` (0.8) of the protected envelope (4 devices x
  70 % x 1,000 ms/s = 2,800 accelerator-ms/s) for ``--seconds``;
* ``interactive+batch``: the same arrivals (same seed) with a batch of ``--batch-items``
  256/64-token items submitted at the start through ``orchid.jobs.v1.Operations``;
* ``surge``: the batch again, interactive at ``--load`` then ``--surge`` (1.25) x the
  envelope for the middle third, then ``--load`` again; after the traffic stops the batch
  drains, and the run waits for it to complete.

Reported: interactive on-time attainment (OK within the deadline) with and without the
batch; the batch's accelerator-ms/s (its items' charges, finished inside the window)
against the idle protected capacity (2,800 minus the interactive work charged per second);
for the surge, the ladder step over time (admin ``LadderStatus``, sampled every 0.2 s),
batch items *started* while the pool was at step 4 or above (from the job store), and at
the end: manifest counts against the input, duplicate custom ids, items charged other than
exactly once.

    python bench/troughs.py                 # ~2.5 min on 2 cores
    python bench/troughs.py --seconds 10    # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gateway._proto import admin_pb2, jobs_pb2  # noqa: E402
from gateway.backends.local import LocalTriton  # noqa: E402
from orchid_tools.harness import (  # noqa: E402
    GatewayProcess,
    example_backend,
    example_config,
    send_open_loop,
)

EXAMPLE = REPO / "examples" / "orchid"
INFER = "/inference.GRPCInferenceService/ModelInfer"
JOBS = "/orchid.jobs.v1.Operations/"
LADDER = "/orchid.admin.v1.GatewayAdmin/LadderStatus"
ORCHID = (("authorization", "Bearer orchid-demo-key-orchid"),)
OPS = (("authorization", "Bearer orchid-demo-key-ops"),)
PROTECTED_MS_PER_S = 4 * 0.70 * 1000.0
REQUEST_MS = 56.8  # full-v18 at 256 input / 64 output tokens (profile ms)
DEADLINE_S = 0.200
POOL = "local/full-v18"


def interactive_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 256])
    request.raw_input_contents.append(np.arange(256, dtype=np.int32).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = 64
    return bytes(request.SerializeToString())


def batch_jsonl(n: int, tag: str) -> bytes:
    lines = []
    for i in range(n):
        body = {
            "custom_id": f"{tag}-{i}",
            "inputs": [
                {"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 256], "data": list(range(256))}
            ],
            "parameters": {"orchid.max_output_tokens": 64},
        }
        lines.append(json.dumps(body))
    return ("\n".join(lines) + "\n").encode()


def troughs_gateway(work: Path, triton_address: str, time_factor: float) -> GatewayProcess:
    """``orchid-gateway serve`` with jobs (a fresh state directory, ``work/jobs``) in front of
    the bench's Triton."""
    backend = example_backend("local", triton_address, time_factor)
    config = example_config([backend], jobs={"state_dir": str(work / "jobs"), "poll_s": 0.01})
    return GatewayProcess(config, work, stop_timeout_s=30.0)


@dataclass
class Run:
    name: str
    window_s: float
    outcomes: list[tuple[float, str, float, float]] = field(default_factory=list)  # t, code, latency, charged
    ladder: list[tuple[float, int]] = field(default_factory=list)  # wall time, step
    batch_id: str = ""
    wall_start: float = 0.0
    wall_end: float = 0.0

    def interactive(self) -> dict[str, float]:
        n = len(self.outcomes)
        on_time = sum(1 for _, code, latency, _ in self.outcomes if code == "OK" and latency <= DEADLINE_S)
        charged = sum(c for *_, c in self.outcomes)
        misses: dict[str, float] = {}
        for _, code, latency, _ in self.outcomes:
            if code != "OK" or latency > DEADLINE_S:
                key = f"missed_{code if code != 'OK' else 'late'}"
                misses[key] = misses.get(key, 0) + 1
        return {
            **misses,
            "sent": n,
            "on_time": on_time / n if n else 0.0,
            "charged_ms_per_s": charged / self.window_s,
        }


def arrivals(phases: list[tuple[float, float]], seed: int) -> list[float]:
    """Poisson arrival times for (duration_s, load) phases, load as a share of the envelope."""
    rng = random.Random(seed)
    times, start = [], 0.0
    for duration, load in phases:
        rate = load * PROTECTED_MS_PER_S / REQUEST_MS
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + duration:
                break
            times.append(t)
        start += duration
    return times


async def drive(address: str, times: list[float], run: Run, batch: bytes | None) -> None:
    payload = interactive_request()
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(address) as channel:
        infer = channel.unary_unary(INFER)
        submit = channel.unary_unary(
            JOBS + "SubmitBatch",
            request_serializer=jobs_pb2.SubmitBatchRequest.SerializeToString,
            response_deserializer=jobs_pb2.Operation.FromString,
        )
        ladder = channel.unary_unary(
            LADDER,
            request_serializer=admin_pb2.LadderStatusRequest.SerializeToString,
            response_deserializer=admin_pb2.LadderStatusResponse.FromString,
        )
        await channel.channel_ready()
        if batch is not None:
            op = await submit(jobs_pb2.SubmitBatchRequest(jsonl=batch, model="full-v18"), metadata=ORCHID)
            run.batch_id = op.id
        t0 = loop.time()
        run.wall_start = time.time()

        async def one(at: float) -> None:
            sent = loop.time()
            try:
                raw = await infer(payload, timeout=DEADLINE_S, metadata=ORCHID)
                params = service_pb2.ModelInferResponse.FromString(raw).parameters
                charged = params["orchid.charged_accelerator_ms"].double_param
                run.outcomes.append((at, "OK", loop.time() - sent, charged))
            except grpc.aio.AioRpcError as error:
                run.outcomes.append((at, error.code().name, loop.time() - sent, 0.0))

        async def sample() -> None:
            while loop.time() < t0 + run.window_s:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    status = await ladder(admin_pb2.LadderStatusRequest(), metadata=OPS, timeout=1.0)
                    for pool in status.pools:
                        if pool.pool == POOL:
                            run.ladder.append((time.time(), pool.step))
                await asyncio.sleep(0.2)

        await asyncio.gather(sample(), send_open_loop(times, one, t0=t0, at=float, lead_s=math.inf))
        run.wall_end = time.time()


def wait_done(address: str, op_id: str) -> jobs_pb2.Operation:
    with grpc.insecure_channel(address) as channel:
        wait = channel.unary_stream(
            JOBS + "Wait",
            request_serializer=jobs_pb2.GetRequest.SerializeToString,
            response_deserializer=jobs_pb2.Operation.FromString,
        )
        last = None
        for update in wait(jobs_pb2.GetRequest(id=op_id), metadata=ORCHID, timeout=600):
            last = update
        assert last is not None
        return last


def cancel(address: str, op_id: str) -> None:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            JOBS + "Cancel",
            request_serializer=jobs_pb2.GetRequest.SerializeToString,
            response_deserializer=jobs_pb2.Operation.FromString,
        )
        call(jobs_pb2.GetRequest(id=op_id), metadata=ORCHID, timeout=30)


Item = tuple[str, str, float, float, float, int, int]


def batch_items(state: Path, op_id: str) -> list[Item]:
    """(custom_id, status, started_at, finished_at, charged_ms, charges, ladder step at
    admission from the item's provenance; -1 without one) of a batch's items."""
    with contextlib.closing(sqlite3.connect(f"file:{state / 'jobs.sqlite3'}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT custom_id, i.status, i.started_at, i.finished_at, charged_ms, charges, provenance "
            "FROM items i JOIN operations o ON o.seq = i.op_seq WHERE o.id = ?",
            (op_id,),
        ).fetchall()
    return [
        (*row[:6], int(json.loads(row[6]).get("orchid.ladder_step", -1)) if row[6] else -1) for row in rows
    ]


def batch_rate(items: list[Item], run: Run) -> float:
    """The batch's charged accelerator-ms per second for items finished inside the window."""
    inside = [
        c
        for _, status, _, fin, c, *_ in items
        if status == "succeeded" and run.wall_start <= fin <= run.wall_end
    ]
    return sum(inside) / (run.wall_end - run.wall_start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=30.0, help="each scenario's traffic window")
    parser.add_argument("--load", type=float, default=0.8, help="interactive load, share of the envelope")
    parser.add_argument("--surge", type=float, default=1.25, help="surge load, share of the envelope")
    parser.add_argument("--batch-items", type=int, default=600)
    parser.add_argument("--time-factor", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="orchid-troughs-") as tmp:
        work = Path(tmp)
        triton = LocalTriton(EXAMPLE / "model_repository", work / "triton", time_factor=args.time_factor)
        (work / "triton").mkdir()
        triton.start()
        gateway = troughs_gateway(work, triton.address, args.time_factor)
        try:
            gateway.start()
            steady = arrivals([(args.seconds, args.load)], args.seed)
            third = args.seconds / 3
            surge = arrivals([(third, args.load), (third, args.surge), (third, args.load)], args.seed + 1)
            # Warm-up: the estimator and the ladder's windows see the load before measuring.
            asyncio.run(drive(gateway.listen, arrivals([(5.0, args.load)], 99), Run("warm", 5.0), None))
            alone = Run("interactive", args.seconds)
            asyncio.run(drive(gateway.listen, steady, alone, None))
            mixed = Run("interactive+batch", args.seconds)
            asyncio.run(drive(gateway.listen, steady, mixed, batch_jsonl(args.batch_items, "mixed")))
            mixed_items = batch_items(work / "jobs", mixed.batch_id)
            cancel(gateway.listen, mixed.batch_id)  # the surge run starts with its own batch
            wait_done(gateway.listen, mixed.batch_id)
            surged = Run("surge", args.seconds)
            asyncio.run(drive(gateway.listen, surge, surged, batch_jsonl(args.batch_items, "surge")))
            final = wait_done(gateway.listen, surged.batch_id)
            surge_items = batch_items(work / "jobs", surged.batch_id)
        finally:
            gateway.stop()
            triton.stop()

    a, b = alone.interactive(), mixed.interactive()
    idle = PROTECTED_MS_PER_S - b["charged_ms_per_s"]
    batch_ms = batch_rate(mixed_items, mixed)
    step4 = [t for t, step in surged.ladder if step >= 4]
    started_at_4 = 0
    if step4:
        # An item counts as started at step 4+ if it started between two samples at step 4+.
        spans = [
            (t, t2) for (t, s), (t2, _s2) in zip(surged.ladder, surged.ladder[1:], strict=False) if s >= 4
        ]
        started_at_4 = sum(1 for _, _, start, *_ in surge_items if any(lo <= start < hi for lo, hi in spans))
    ids = [c for c, *_ in surge_items]
    third_wall = (surged.wall_end - surged.wall_start) / 3
    phase_starts = [0, 0, 0, 0]  # before, during the surge, after it (window), after the window
    for _, _, start, *_ in surge_items:
        k = int((start - surged.wall_start) // third_wall) if start >= surged.wall_start else 0
        phase_starts[min(max(k, 0), 3)] += 1
    summary: dict[str, Any] = {
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # >2 on 2 cores: contaminated
        "interactive_alone": a,
        "interactive_with_batch": b,
        "on_time_delta_points": round((b["on_time"] - a["on_time"]) * 100, 2),
        "batch_ms_per_s": round(batch_ms, 1),
        "idle_ms_per_s": round(idle, 1),
        "batch_share_of_idle": round(batch_ms / idle, 3) if idle > 0 else None,
        "batch_items_done_in_window": sum(
            1
            for _, s, _, f, *_ in mixed_items
            if s == "succeeded" and mixed.wall_start <= f <= mixed.wall_end
        ),
        "surge": {
            "max_step": max((s for _, s in surged.ladder), default=0),
            "seconds_at_step_4_plus": round(len(step4) * 0.2, 1),
            "items_started_at_step_4_plus_sampled": started_at_4,
            "items_admitted_at_step_4_plus": sum(1 for *_, step in surge_items if step >= 4),
            "max_step_at_admission": max((step for *_, step in surge_items), default=-1),
            "items_started_before_during_after_surge_and_drain": phase_starts,
            "interactive": surged.interactive(),
            "final_status": final.status,
            "total": final.counts.total,
            "completed": final.counts.completed,
            "failed": final.counts.failed,
            "duplicate_custom_ids": len(ids) - len(set(ids)),
            "items_not_charged_once": sum(1 for item in surge_items if item[5] != 1),
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"interactive alone:      on-time {a['on_time']:.2%} of {a['sent']:.0f}")
        print(
            f"interactive + batch:    on-time {b['on_time']:.2%} of {b['sent']:.0f}  "
            f"(delta {summary['on_time_delta_points']:+.2f} points)"
        )
        print(f"misses alone: { {k: v for k, v in a.items() if k.startswith('missed')} }")
        print(f"misses with batch: { {k: v for k, v in b.items() if k.startswith('missed')} }")
        print(
            f"batch throughput:       {batch_ms:.0f} accelerator-ms/s of {idle:.0f} idle protected "
            f"({summary['batch_share_of_idle']:.0%}); "
            f"{summary['batch_items_done_in_window']} items in the window"
        )
        s = summary["surge"]
        print(
            f"surge x{args.surge}: max step {s['max_step']}, {s['seconds_at_step_4_plus']} s at step 4+, "
            f"{s['items_admitted_at_step_4_plus']} batch items admitted at step 4+ (max step at admission "
            f"{s['max_step_at_admission']}; {s['items_started_at_step_4_plus_sampled']} claimed between two "
            f"samples at 4+); interactive on-time "
            f"{s['interactive']['on_time']:.2%}"
        )
        print(
            "surge batch items started (last attempt) before / during / after the surge / in the drain: "
            + " / ".join(str(n) for n in s["items_started_before_during_after_surge_and_drain"])
        )
        print(
            f"surge batch: {s['final_status']} {s['completed']}/{s['total']} completed, "
            f"{s['failed']} failed, {s['duplicate_custom_ids']} duplicate custom ids, "
            f"{s['items_not_charged_once']} items not charged once"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
