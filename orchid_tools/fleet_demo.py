"""The demo on a fleet: N gateway replicas sharing one Redis, in front of one local Triton.

``scripts/demo.sh --replicas 2`` (``python -m orchid_tools.fleet_demo --replicas 2``) starts
a ``redis-server`` of its own on a free port (Debian's package; ``scripts/bootstrap.sh``
installs it), the example stack's local Triton once (with the first replica), and N
replicas of the gateway configured with ``state.backend: redis`` on it; drives the demo
workload (``orchid_tools.demo``) split evenly over the replicas; prints each replica's
summary and the fleet's: its membership, and the open reservations left in the shared
ledger once the load is over (0: every reservation settled). Everything stops at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.config import GatewayConfig, StateConfig, load_gateway_config
from gateway.core.errors import ConfigError
from gateway.server import GatewayServer
from orchid_tools.demo import (
    DEFAULT_CONFIG,
    DEMO_KEYS,
    OK,
    WorkloadSettings,
    build_scenarios,
    demo_config,
    drive,
    summarize,
    wait_ready,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server (no persistence) on a free port, once it answers PING."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not found: scripts/bootstrap.sh installs Debian's redis-server")
    port = _free_port()
    process = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # bounded wait for its readiness: PING answers
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise TimeoutError("redis-server did not answer within 10 s")


async def run_fleet_demo(
    config: GatewayConfig, replicas: int, settings: WorkloadSettings, ready_timeout_s: float
) -> int:
    if config.local_triton is None:
        raise ConfigError("--config", "", "the fleet demo needs a config with local_triton")
    workdir = Path(tempfile.mkdtemp(prefix="orchid-fleet-"))
    redis, url = start_redis(workdir)
    # A demo shares one machine with Triton and its load: deadlines for a busy laptop.
    state = StateConfig(backend="redis", url=url, key_prefix="demo:", lease_ttl_ms=3000, call_timeout_ms=500)
    time_factor = config.local_triton.time_factor
    scenarios = build_scenarios(time_factor)
    models = sorted({s.model for s in scenarios if s.expect == OK})
    servers: list[GatewayServer] = []
    try:
        # No jobs on the fleet: SQLite's state directory is one gateway's (replicas share jobs
        # through jobs.store: postgres); this demo shows the shared quotas and slots.
        config = config.model_copy(update={"jobs": None})
        first = GatewayServer(config.model_copy(update={"state": state}))  # starts the local Triton
        servers.append(first)
        await first.start()
        shared = config.model_copy(
            update={"local_triton": None, "backends": tuple(first.backend_configs()), "state": state}
        )
        for _ in range(replicas - 1):
            replica = GatewayServer(shared, listen="127.0.0.1:0")
            servers.append(replica)
            await replica.start()
        for server in servers:
            await wait_ready(server.address, models, DEMO_KEYS["orchid"], ready_timeout_s)
        addresses = [s.address for s in servers]
        print(
            f"orchid-gateway fleet demo: {replicas} replicas on {', '.join(addresses)}; Redis at {url}; "
            f"one local Triton (time factor {time_factor:g})",
            flush=True,
        )
        share = WorkloadSettings(
            duration_s=settings.duration_s,
            rate=settings.rate / replicas,
            workers=max(1, settings.workers // replicas),
            seed=settings.seed,
        )
        print(
            f"driving the demo workload for {settings.duration_s:g} s, split over the replicas ...",
            flush=True,
        )
        results = await asyncio.gather(
            *(
                drive(
                    a,
                    scenarios,
                    WorkloadSettings(share.duration_s, share.rate, share.workers, share.seed + i),
                )
                for i, a in enumerate(addresses)
            )
        )
        for address, result in zip(addresses, results, strict=True):
            print(f"\n=== replica {address} ===", flush=True)
            print(summarize(result, share), flush=True)
        quotas, fleet = first.shared_quotas, first.fleet
        assert quotas is not None and fleet is not None
        for server in servers:
            if server.shared_quotas is not None:
                await server.shared_quotas.drain()
        await fleet.beat()
        # A settlement lost while a replica was degraded closes when its lease expires: wait
        # (at most one lease TTL) for the ledger to reconcile.
        reconcile_by = time.monotonic() + fleet.ttl_s + 1.0
        left = await quotas.fleet_outstanding()
        while left.count and time.monotonic() < reconcile_by:
            await asyncio.sleep(0.1)  # bounded polling of the ledger, the observable state
            left = await quotas.fleet_outstanding()
        print(
            f"\n=== fleet ===\nreplicas in Redis: {fleet.size} ({', '.join(fleet.members)})\n"
            f"open reservations in the shared ledger after the load: {left.count}",
            flush=True,
        )
        admitted = sum(1 for r in results for o in r.outcomes if o.admitted)
        if not admitted:
            print("orchid-gateway fleet demo: no request was admitted", file=sys.stderr)
            return 1
        return 0
    finally:
        for server in reversed(servers):
            with contextlib.suppress(Exception):
                await server.stop()
        redis.terminate()
        redis.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet_demo", description=__doc__)
    parser.add_argument("--replicas", type=int, default=2, help="gateway replicas (default 2)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of offered load (default 15)")
    parser.add_argument("--time-factor", type=float, default=None)
    parser.add_argument("--rate", type=float, default=20.0, help="offered requests/s, all replicas together")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.replicas < 1 or args.duration <= 0 or args.rate <= 0 or args.workers < 1:
        print("fleet demo: --replicas and --workers >= 1, --duration and --rate > 0", file=sys.stderr)
        return 2
    settings = WorkloadSettings(
        duration_s=args.duration, rate=args.rate, workers=args.workers, seed=args.seed
    )
    try:
        config = demo_config(load_gateway_config(args.config), args.time_factor)
        return asyncio.run(run_fleet_demo(config, args.replicas, settings, args.ready_timeout))
    except ConfigError as error:
        print(f"fleet demo: invalid configuration: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, TimeoutError) as error:
        print(f"fleet demo: could not start: {error}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
