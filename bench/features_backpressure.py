"""Backpressure from a late feature source, side by side with the same run without it.

What it measures
    A route reads its features from a Feast feature server (the example ``ranker`` route,
    ``ranker_v12``), through ``orchid_tools.slowproxy.SlowProxy``, which holds every answer
    ``--delay-ms`` during an incident: the feature service is late while the model is not.
    Open-loop requests at ``--rate`` for ``--seconds``, the incident from ``--incident-start``
    to ``--incident-end``; each request has ``--deadline-ms`` (the client's gRPC deadline)
    and reads one user's features (no cache: every request reads, as with many distinct
    users). The same schedule runs twice, each on a fresh gateway:

    * ``backpressure``: the source's ``backpressure: true`` (the default): the record's
      upstream reserve is the source's measured p95 read latency, and while that p95 is
      over the source's budget new requests are refused before placement
      (``UNAVAILABLE``, rule ``features.upstream_backpressure``, ``retry-after-ms``), one
      probe per interval reading on;
    * ``no backpressure``: ``backpressure: false``: the class's constant upstream reserve,
      every request reads, then queues for the model.

    Reported per run, for the incident window and overall: answers on time, refusals by
    rule (early = before the model ran), answers the client no longer waited for, and the
    model's executions and device-ms from Triton's own statistics (an independent ruler):
    device-ms *wasted* = device time of executions whose answer did not reach the client in
    time (executions beyond the on-time answers, at Triton's mean compute per execution).

How
    ``python bench/features_backpressure.py`` (defaults: 40 req/s of 512-token requests,
    16 s, incident 4-12 s at +90 ms, deadline 120 ms; ranker-v3 on its own Triton at time
    factor 1, one instance: ~13.8 device-ms a request, ~55 % busy).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.backends.local import LocalTriton  # noqa: E402
from orchid_tools.featurestore import FeastServer  # noqa: E402
from orchid_tools.harness import GatewayProcess, example_backend, example_config, send_open_loop  # noqa: E402
from orchid_tools.slowproxy import SlowProxy  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"
ORCHID_KEY = "orchid-demo-key-orchid"
MODEL_REPOSITORY = ROOT / "examples" / "orchid" / "model_repository"
NAMED = ("on time", "DEADLINE_EXCEEDED", "UNAVAILABLE features.upstream_backpressure")


@dataclass
class Run:
    label: str
    outcomes: Counter[str] = field(default_factory=Counter)
    incident: Counter[str] = field(default_factory=Counter)
    after: Counter[str] = field(default_factory=Counter)  # arrivals after the incident
    after_refused_at: list[float] = field(default_factory=list)  # when those refused arrived (s)
    executions: int = 0
    device_ms: float = 0.0
    on_time: int = 0
    feature_reads: int = 0  # HTTP reads the feature source received (the proxy's count)
    refusal_ms: list[float] = field(default_factory=list)  # how long a refused caller waited

    @property
    def wasted_executions(self) -> int:
        return max(0, self.executions - self.on_time)

    @property
    def wasted_device_ms(self) -> float:
        return self.device_ms / self.executions * self.wasted_executions if self.executions else 0.0


def request_bytes(input_tokens: int, user: int) -> bytes:
    request = service_pb2.ModelInferRequest(model_name="ranker")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, input_tokens])
    request.raw_input_contents.append(np.arange(input_tokens, dtype=np.int32).tobytes())
    request.parameters["user_id"].int64_param = user
    request.parameters["orchid.max_output_tokens"].int64_param = 16
    return request.SerializeToString()


def model_statistics(address: str) -> tuple[int, float]:
    """ranker-v3's executions and compute device-ms so far (Triton's statistics)."""
    client = grpcclient.InferenceServerClient(address)
    try:
        stats = client.get_inference_statistics(model_name="ranker-v3").model_stats[0]
    finally:
        client.close()
    inference = stats.inference_stats
    ns = inference.compute_input.ns + inference.compute_infer.ns + inference.compute_output.ns
    return int(stats.execution_count), ns / 1e6


async def drive(address: str, args: argparse.Namespace, run: Run) -> None:
    channel = grpc.aio.insecure_channel(address)
    call = channel.unary_unary(INFER)
    bodies = [request_bytes(args.input_tokens, user) for user in range(1, 51) if user not in (7, 8)]
    n = int(args.rate * args.seconds)
    arrivals = [(i / args.rate, bodies[i % len(bodies)]) for i in range(n)]

    async def one(arrival: tuple[float, bytes]) -> None:
        at, body = arrival
        sent = time.monotonic()
        try:
            await call(
                body, metadata=(("authorization", f"Bearer {ORCHID_KEY}"),), timeout=args.deadline_ms / 1000
            )
            outcome = "on time"
        except grpc.aio.AioRpcError as error:
            rule = dict(error.trailing_metadata() or ()).get("orchid-rule", "")
            outcome = f"{error.code().name} {rule}".strip()
            run.refusal_ms.append((time.monotonic() - sent) * 1000.0)
        run.outcomes[outcome] += 1
        if args.incident_start <= at < args.incident_end:
            run.incident[outcome] += 1
        elif at >= args.incident_end:
            run.after[outcome] += 1
            if outcome != "on time":
                run.after_refused_at.append(at)

    try:
        await send_open_loop(arrivals, one, at=lambda a: a[0], lead_s=0.05)
    finally:
        await channel.close()
    run.on_time = run.outcomes["on time"]


def one_run(
    label: str,
    backpressure: bool,
    args: argparse.Namespace,
    triton: LocalTriton,
    feast: FeastServer,
    workdir: Path,
) -> Run:
    run = Run(label)
    with SlowProxy(feast.url) as proxy:
        source = {
            "url": proxy.url,
            "registry": str(feast.registry_path),
            "timeout_ms": args.timeout_ms,
            "budget_ms": args.budget_ms,
            "cache_ttl_ms": 0,
            "backpressure": backpressure,
            "window_s": 2.0,
        }
        config = example_config([example_backend("local", triton.address, time_scale=1.0)])
        config["feature_sources"] = {"feast": source}
        gateway = GatewayProcess(config, workdir / label.replace(" ", "-"), name="gateway")
        gateway.start()
        try:
            warm = argparse.Namespace(
                **{**vars(args), "rate": 10.0, "seconds": 1.0, "incident_start": -1, "incident_end": -1}
            )
            asyncio.run(drive(gateway.listen, warm, Run("warm")))
            # The warm-up's first reads are slow (a new server's first answers): both runs start
            # once they have left the source's window, as a gateway running for a while would.
            time.sleep(source["window_s"] + 0.5)
            executions0, device0 = model_statistics(triton.address)
            reads0 = proxy.requests

            async def incident() -> None:
                await asyncio.sleep(args.incident_start)
                proxy.delay_ms = args.delay_ms
                await asyncio.sleep(args.incident_end - args.incident_start)
                proxy.delay_ms = 0.0

            async def both() -> None:
                await asyncio.gather(drive(gateway.listen, args, run), incident())

            asyncio.run(both())
            time.sleep(0.5)  # executions still on the model finish (their answers were already late)
            executions1, device1 = model_statistics(triton.address)
            run.executions, run.device_ms = executions1 - executions0, device1 - device0
            run.feature_reads = proxy.requests - reads0
        finally:
            gateway.stop()
    return run


def report(runs: list[Run], args: argparse.Namespace) -> None:
    print(
        f"\nfeature backpressure: {args.rate:g} req/s x {args.seconds:g} s of {args.input_tokens}-token "
        f"ranker requests, deadline {args.deadline_ms:g} ms; the feature source +{args.delay_ms:g} ms from "
        f"{args.incident_start:g} s to {args.incident_end:g} s (budget {args.budget_ms:g} ms)\n"
    )
    header = f"{'':34}" + "".join(f"{r.label:>18}" for r in runs)
    print(header)
    rows = [
        ("answers on time", lambda r: f"{r.outcomes['on time']}"),
        ("  during the incident", lambda r: f"{r.incident['on time']}"),
        ("  after it", lambda r: f"{r.after['on time']} of {sum(r.after.values())}"),
        (
            "  last refusal after it ends, s",
            lambda r: f"{max(r.after_refused_at) - args.incident_end:.2f}" if r.after_refused_at else "none",
        ),
        (
            "refused early (backpressure)",
            lambda r: f"{r.outcomes['UNAVAILABLE features.upstream_backpressure']}",
        ),
        ("client gave up (DEADLINE_EXCEEDED)", lambda r: f"{r.outcomes['DEADLINE_EXCEEDED']}"),
        ("other refusals", lambda r: f"{sum(c for k, c in r.outcomes.items() if k not in NAMED)}"),
        ("refused caller's wait, median ms", lambda r: f"{statistics.median(r.refusal_ms or [0]):.1f}"),
        ("feature reads (source received)", lambda r: f"{r.feature_reads}"),
        ("model executions (Triton)", lambda r: f"{r.executions}"),
        ("model device-ms (Triton)", lambda r: f"{r.device_ms:.0f}"),
        ("executions wasted (late answers)", lambda r: f"{r.wasted_executions}"),
        ("device-ms wasted", lambda r: f"{r.wasted_device_ms:.0f}"),
    ]
    for name, cell in rows:
        print(f"{name:34}" + "".join(f"{cell(r):>18}" for r in runs))
    for r in runs:
        print(f"\n{r.label}: every outcome {dict(r.outcomes.most_common())}")
    with_bp, without = runs
    if without.wasted_device_ms > 0:
        print(
            f"\nwasted device-ms with backpressure / without: {with_bp.wasted_device_ms:.0f} / "
            f"{without.wasted_device_ms:.0f} = x{with_bp.wasted_device_ms / without.wasted_device_ms:.2f}"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--seconds", type=float, default=16.0)
    parser.add_argument("--incident-start", type=float, default=4.0)
    parser.add_argument("--incident-end", type=float, default=12.0)
    parser.add_argument("--delay-ms", type=float, default=90.0)
    parser.add_argument("--deadline-ms", type=float, default=120.0)
    parser.add_argument("--input-tokens", type=int, default=512)
    parser.add_argument("--timeout-ms", type=float, default=200.0)
    parser.add_argument("--budget-ms", type=float, default=20.0)
    return parser.parse_args(argv)


def start_triton(workdir: Path) -> LocalTriton:
    repository = workdir / "repo" / "model_repository"
    shutil.copytree(MODEL_REPOSITORY / "ranker-v3", repository / "ranker-v3")
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", workdir / "repo" / "emulator")
    triton = LocalTriton(repository, workdir / "triton", time_factor=1.0)
    triton.start()
    return triton


def main(argv: list[str] | None = None) -> list[Run]:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="orchid-features-bp-") as tmp:
        workdir = Path(tmp)
        triton = start_triton(workdir)
        try:
            with FeastServer(workdir / "feast") as feast:
                runs = [
                    one_run("backpressure", True, args, triton, feast, workdir),
                    one_run("no backpressure", False, args, triton, feast, workdir),
                ]
        finally:
            triton.stop()
    report(runs, args)
    return runs


if __name__ == "__main__":
    main()


__all__: list[Any] = ["Run", "main"]
