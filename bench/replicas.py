"""Fleet benchmark: 1 replica in memory vs 1 replica on Redis vs 2 replicas on Redis.

What it measures
    Throughput and CPU per request of ``orchid-gateway serve`` replicas in front of ONE
    Triton, in one run, for three set-ups:

    * ``memory x1``  one replica, ``state.backend: memory`` (quotas in the process)
    * ``redis x1``   one replica, ``state.backend: redis`` (the fleet's quota ledger, dispatch
                     slot leases, offered-demand exchange and estimator merge in Redis)
    * ``redis x2``   two replicas on the same Redis (same ``key_prefix``), each sent half

    Every request is metered (tenant ``orchid``: a weighted part of the interactive share).
    On Redis, with the default ``state.quota_slice`` (0.05), a replica reserves a slice of
    the account in Redis (one round trip) and admits the next requests on it locally,
    settling them locally too; each request still needs a dispatch slot lease before it
    binds (one round trip unless a returned lease lingers). ``--quota-slice 0`` measures the
    exact path, one reserve script per request and a background settle. The gateway's
    backend gets ``time_scale`` = the emulator's time factor as in ``bench/overhead.py``
    (time factor 0: the model answers at once, the gateway's own cost dominates and the
    ladder stays at 0).

How
    As ``bench/overhead.py`` (whose helpers it imports): one serialized request framed as
    gRPC, replayed by ``h2load`` (one h2load per replica, run side by side), a warm-up
    run, then a measured run. CPU: ``utime+stime`` of each replica's process tree (and of
    ``redis-server``) before and after the measured run, divided by the requests that
    succeeded (gRPC errors estimated from DATA bytes as there). ``cpu/req`` is the replicas'
    CPU; ``+redis`` adds Redis's. The verdict compares ``redis x1`` with ``memory x1``: the
    issue's budget is 15 % more gateway CPU per request.

Run::

    python bench/replicas.py                 # -n 4000 per set-up (+500 warm-up), -c 8 -m 1
    python bench/replicas.py -n 1000 --warmup 200
    python bench/replicas.py --quota-slice 0    # a reservation in Redis per request

Needs ``h2load`` (``apt-get install -y nghttp2-client``) and ``redis-server`` (Debian's
``redis-server``; ``scripts/bootstrap.sh`` installs it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from overhead import (  # type: ignore[import-not-found]
    _DATA,
    _FINISHED,
    _REQUESTS,
    DEMO_KEY,
    INSTALL_H2LOAD,
    METHOD,
    MIN_TIME_SCALE,
    REPO,
    build_request,
    gateway_config,
    grpc_frame,
    h2load_args,
    tree_cpu_s,
    verify,
)

from gateway.backends.local import LocalTriton
from orchid_tools.fleet_demo import start_redis
from orchid_tools.harness import GatewayProcess

SETUPS = (("memory x1", "memory", 1), ("redis x1", "redis", 1), ("redis x2", "redis", 2))
CPU_BUDGET = 1.15  # redis x1 may cost at most 15 % more gateway CPU per request than memory x1


@dataclass
class Result:
    name: str
    succeeded: int
    failed: int
    req_per_s: float
    cpu_us: float
    redis_us: float


def measure(
    name: str,
    replicas: list[GatewayProcess],
    addresses: list[str],
    args: argparse.Namespace,
    h2load: str,
    frame: Path,
    ok_frame: int,
    redis_pid: int | None,
    work: Path,
) -> Result:
    per = args.requests // len(replicas)
    if args.warmup:
        warm = [
            subprocess.Popen(h2load_args(h2load, f"http://{a}{METHOD}", frame, args, args.warmup, DEMO_KEY),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for a in addresses
        ]  # fmt: skip
        for process in warm:
            process.wait()
    before = [tree_cpu_s(r.pid) for r in replicas]
    redis_before = tree_cpu_s(redis_pid) if redis_pid else 0.0
    began = time.monotonic()
    runs = [
        subprocess.Popen(
            h2load_args(h2load, f"http://{a}{METHOD}", frame, args, per, DEMO_KEY, work / f"{name}-{i}.log"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, a in enumerate(addresses)
    ]
    outputs = [p.communicate()[0] for p in runs]
    elapsed = time.monotonic() - began
    cpu = sum(tree_cpu_s(r.pid) - b for r, b in zip(replicas, before, strict=True))
    redis_cpu = (tree_cpu_s(redis_pid) - redis_before) if redis_pid else 0.0
    succeeded = failed = 0
    for text in outputs:
        counts, traffic, finished = _REQUESTS.search(text), _DATA.search(text), _FINISHED.search(text)
        if not (counts and traffic and finished):
            raise RuntimeError(f"h2load failed:\n{text[-2000:]}")
        ok, http_failed = int(counts.group(4)), int(counts.group(5)) + int(counts.group(6))
        # gRPC errors are HTTP 200 without a message: fewer DATA bytes than OK answers carry.
        data = int(traffic.group(3))
        grpc_errors = max(0, round((ok * ok_frame - data) / ok_frame)) if data < 0.98 * ok * ok_frame else 0
        succeeded += ok - grpc_errors
        failed += http_failed + grpc_errors
    done = max(succeeded, 1)
    return Result(name, succeeded, failed, succeeded / elapsed, cpu * 1e6 / done, redis_cpu * 1e6 / done)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--requests", type=int, default=4000, help="measured requests per set-up")
    parser.add_argument("-w", "--warmup", type=int, default=500, help="warm-up requests per replica")
    parser.add_argument("-c", "--connections", type=int, default=8)
    parser.add_argument("-m", "--streams", type=int, default=1)
    parser.add_argument("-t", "--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--time-factor", type=float, default=0.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument(
        "--quota-slice",
        type=float,
        default=None,
        help="state.quota_slice on Redis",
    )
    args = parser.parse_args()
    h2load = shutil.which("h2load")
    if h2load is None:
        print(f"h2load not found; install it with:\n    {INSTALL_H2LOAD}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="orchid-replicas-"))
    started: list[GatewayProcess] = []
    triton = LocalTriton(
        REPO / "examples/orchid/model_repository", work / "triton", time_factor=args.time_factor
    )
    redis_process, redis_url = start_redis(work)
    results: list[Result] = []
    try:
        triton.start()
        message = build_request(args.tokens, gateway=True)
        frame = work / "request.grpc"
        frame.write_bytes(grpc_frame(message))
        time_scale = args.time_factor if args.time_factor > 0 else MIN_TIME_SCALE
        for index, (name, backend, count) in enumerate(SETUPS):
            replicas, addresses = [], []
            for r in range(count):
                config = gateway_config(triton.address, time_scale)
                if backend == "redis":
                    config["state"] = {"backend": "redis", "url": redis_url, "key_prefix": f"bench{index}:"}
                    if args.quota_slice is not None:
                        config["state"]["quota_slice"] = args.quota_slice
                # Its own directory: the example's jobs.state_dir is relative to the config, and
                # a job store is one gateway's (two replicas in one directory: the second exits).
                child = GatewayProcess(config, work / f"gateway-{index}-{r}", log_level=None)
                started.append(child)
                child.start()
                replicas.append(child)
                addresses.append(child.address)
            ok_frame = min(verify(a, message, [("authorization", f"Bearer {DEMO_KEY}")]) for a in addresses)
            result = measure(
                name, replicas, addresses, args, h2load, frame, ok_frame,
                redis_process.pid if backend == "redis" else None, work,
            )  # fmt: skip
            results.append(result)
            print(f"{name}: {result.req_per_s:.0f} req/s, {result.cpu_us:.0f} CPU-us/req", flush=True)
            for child in replicas:
                child.stop()
                started.remove(child)
    finally:
        for child in started:
            child.stop()
        triton.stop()
        redis_process.terminate()
        redis_process.wait(timeout=10)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    quota_slice = "default" if args.quota_slice is None else f"{args.quota_slice:g}"
    print(f"\nmachine: nproc={os.cpu_count()}; -n {args.requests} per set-up, -c {args.connections} "
          f"-m {args.streams}; time factor {args.time_factor}; quota_slice {quota_slice}")  # fmt: skip
    print(f"{'set-up':<10} {'ok/failed':>12} {'req/s':>8} {'cpu-us/req':>11} {'+redis':>8}")
    for r in results:
        print(f"{r.name:<10} {f'{r.succeeded}/{r.failed}':>12} {r.req_per_s:>8.0f} {r.cpu_us:>11.0f} "
              f"{r.cpu_us + r.redis_us:>8.0f}")  # fmt: skip
    memory, redis = results[0], results[1]
    ratio = redis.cpu_us / memory.cpu_us
    verdict = "within" if ratio <= CPU_BUDGET else "OVER"
    print(f"redis x1 / memory x1 gateway CPU per request: {ratio:.3f} ({verdict} the 15 % budget)")
    return 0 if ratio <= CPU_BUDGET and not any(r.failed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
