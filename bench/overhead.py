"""Gateway overhead benchmark: Triton direct vs. a bare pass-through vs. orchid-gateway.

What it measures
    The cost the gateway adds to one unary ``ModelInfer`` call, side by side with
    three references, all in one run against ONE Triton server:

    * ``direct``       h2load -> Triton
    * ``passthrough``  h2load -> ``bench/passthrough.py`` (bare ``grpc.aio`` proxy that
                       forwards raw bytes, no parsing) -> Triton. The floor any Python
                       ``grpc.aio`` gateway is measured against (ARCHITECTURE §7).
    * ``parsing``      h2load -> ``bench/passthrough.py --parse`` (the same proxy, but it
                       parses both messages and serializes them again, as any gateway
                       that reads the tensors must) -> Triton. The floor of a *reading*
                       proxy: what the gateway costs above it is its own decisions.
    * ``gateway``      h2load -> ``orchid-gateway serve`` (authentication, shape
                       extraction, estimate, admission, dispatch queue, settle) -> Triton
    * ``features-cached``  the same gateway on the example ``ranker`` route (model
                       ranker-v3), whose contract reads three features of the request's
                       user from a Feast feature server (started here, over the example
                       feature repository): the scoped cache answers every read but the
                       first. The cost of a cached feature read is this row less ``gateway``.
    * ``features-read``    the same with the cache off (``cache_ttl_ms: 0``): every request
                       makes one batched HTTP read of Feast. The cost of an uncached read
                       (Feast's own work on the same cores included) is this row less
                       ``gateway``. (Both need Feast: the ``features`` extra.)

    Triton runs the example repository's capacity emulator with time factor 0 by
    default, so the model itself returns at once and the proxies' own cost dominates.
    The gateway is told so: its backend entry gets ``time_scale`` = the time factor
    (0.001 for factor 0, the smallest sensible value), otherwise it would price each
    call at the full profile (~30 accelerator-ms for 256 tokens, ~130 req/s for 4
    devices) and, correctly, climb its overload ladder (fallback, then rejection):
    that would measure overload policy, not overhead. ``--gateway-time-scale 1``
    shows exactly that.

How
    One ``ModelInferRequest`` (model ``full-v18``, ``INPUT_IDS`` INT32 ``[1, N]`` in
    ``raw_input_contents``; ``max_output_tokens=1`` for direct/passthrough, the
    gateway's hint ``orchid.max_output_tokens=1`` for the gateway) is serialized
    once and framed as gRPC (flag byte 0, 4-byte big-endian length, message) into a
    file. ``h2load`` replays that frame as HTTP/2 POSTs with ``content-type:
    application/grpc`` and ``te: trailers`` (plus ``authorization: Bearer ...`` for the
    gateway), so there is no Python client in the measured path. Per target: a
    warm-up run, then a measured run with ``--log-file``; p50/p99 come from the
    per-request log, req/s and succeeded/failed from h2load's summary.

    CPU cost: ``utime+stime`` from ``/proc/PID/stat`` of the proxy process (and any
    descendants) before and after the measured run, divided by the requests that
    succeeded. Triton's CPU (server plus its Python-backend stubs, i.e. its whole
    session) and the h2load client's CPU are reported the same way, for context:
    on a small machine all three compete for the same cores. ``other load`` is the
    machine's busy CPU (``/proc/stat``) not accounted for by those three, in cores:
    other users of a shared machine. Throughput is only comparable between runs
    whose other load is near 0; CPU per request is much less sensitive to it.

    gRPC status: h2load only sees HTTP status, and gRPC errors arrive as HTTP 200
    with ``grpc-status`` in trailers and no message. So each target is first checked
    with real gRPC calls (status OK, the expected output), the smallest OK answer is
    noted (again after each warm-up), and after each run the DATA bytes h2load
    received are compared with what its "succeeded" answers would carry: a shortfall
    of more than 2 % is counted as gRPC errors (an estimate, shown in the
    succeeded/failed column; ``B/resp (OK)`` shows mean DATA bytes per answer and the
    OK answer's size). Whenever the mean differs from the OK answer by more than 2 %,
    the script calls the target for real at the same concurrency and prints the
    status codes (and, for OK, the answering model), e.g. a gateway fallback.

Output contract: before the runs, the script times the check a route's ``outputs`` adds to
each answer (``gateway.outputs.check_outputs`` on an INT32 ``[1, N]`` answer, N = 64 and 1,024
output tokens: decode, datatype, shape, range), in process, and prints microseconds per
answer; ``--output-check-only`` prints just that (no Triton, no h2load).

Diagnostic: ``--ablate policy,telemetry,provenance`` (or ``decisions``) starts the gateway
through ``bench/ablate.py`` with those parts of its request path taken out, to measure what
they cost in the live process; the gateway row is then not a gateway.

Run (defaults sized for a 2-core machine, well under two minutes)::

    python bench/overhead.py                  # 3 rounds x (500 warm-up + 4000) per target, -c 8 -m 1
    python bench/overhead.py --rounds 1 -n 1000   # quick look

Needs ``h2load`` (Debian: ``apt-get update && apt-get install -y nghttp2-client``);
exits 2 with that command if it is missing. Ports: ``--base-port`` (default 19410)
and the next five. Everything started is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from gateway.backends.local import LocalTriton, stop_process_group
from gateway.core.outputs import OutputCheck
from gateway.outputs import check_outputs
from orchid_tools.featurestore import FeastServer
from orchid_tools.harness import GatewayProcess, example_config

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "orchid"
METHOD = "/inference.GRPCInferenceService/ModelInfer"
MODEL = "full-v18"
DEMO_KEY = "orchid-demo-key-orchid"
INSTALL_H2LOAD = "apt-get update && apt-get install -y nghttp2-client"
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGETS = ("direct", "passthrough", "parsing", "gateway", "features-cached", "features-read")
# The feature targets: the gateway on the example ``ranker`` route (ranker-v3), which reads
# its features from a Feast feature server (orchid_tools.featurestore, started here) for the
# request's user: every request the same user, answered by the scoped cache after the first
# (``features-cached``), or read from Feast each time (``features-read``: cache_ttl_ms 0).
FEATURE_TARGETS = ("features-cached", "features-read")
FEATURE_MODEL = "ranker"
GATEWAY_TARGETS = ("gateway", *FEATURE_TARGETS)
# The gateway's backend time_scale must be > 0; at time factor 0 the emulator costs ~nothing.
MIN_TIME_SCALE = 0.001


# --------------------------------------------------------------------------- request


def build_request(tokens: int, *, gateway: bool, model: str = MODEL, user: int | None = None) -> bytes:
    """One serialized ModelInferRequest for ``model`` (default ``full-v18``) with ``tokens``
    input ids; ``user``: the ``user_id`` parameter a feature route reads its entities from."""
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name = "INPUT_IDS"
    tensor.datatype = "INT32"
    tensor.shape.extend([1, tokens])
    request.raw_input_contents.append(np.arange(tokens, dtype="<i4").tobytes())
    request.outputs.add().name = "OUTPUT_IDS"
    param = "orchid.max_output_tokens" if gateway else "max_output_tokens"
    request.parameters[param].int64_param = 1
    if user is not None:
        request.parameters["user_id"].int64_param = user
    serialized: bytes = request.SerializeToString()
    return serialized


def grpc_frame(message: bytes) -> bytes:
    """Length-prefixed gRPC message: compressed flag 0, 4-byte big-endian length, bytes."""
    return struct.pack(">BI", 0, len(message)) + message


def verify(address: str, message: bytes, metadata: Sequence[tuple[str, str]], calls: int = 10) -> int:
    """Real gRPC calls; fails unless each is status OK with the one output.

    Returns the smallest response frame seen (5-byte prefix included): the gateway's
    responses carry per-request parameters, so their size varies by a few bytes."""
    sizes = []
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)
        for _ in range(calls):
            try:
                raw: bytes = call(message, metadata=tuple(metadata), timeout=10.0)
            except grpc.RpcError as error:
                raise RuntimeError(f"{address}: {error.code().name}: {error.details()}") from error
            response = service_pb2.ModelInferResponse.FromString(raw)
            if [o.name for o in response.outputs] != ["OUTPUT_IDS"] or not response.raw_output_contents:
                raise RuntimeError(f"{address}: unexpected response {response}")
            sizes.append(len(raw) + 5)
    return min(sizes)


def sample_outcomes(
    address: str, message: bytes, metadata: Sequence[tuple[str, str]], concurrency: int, waves: int = 10
) -> tuple[Counter[str], int | None]:
    """Diagnosis when a run's answers differ from the verified one: the status codes (and, for
    OK, the answering model and frame size) of ``waves`` x ``concurrency`` real calls, and the
    smallest OK frame among them."""

    async def sample() -> tuple[Counter[str], int | None]:
        seen: Counter[str] = Counter()
        ok_frames: list[int] = []
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD)

            async def one() -> None:
                try:
                    raw: bytes = await call(message, metadata=tuple(metadata), timeout=10.0)
                except grpc.aio.AioRpcError as error:
                    seen[f"{error.code().name}: {error.details()}"] += 1
                    return
                response = service_pb2.ModelInferResponse.FromString(raw)
                ok_frames.append(len(raw) + 5)
                seen[f"OK model={response.model_name} frame={len(raw) + 5}B"] += 1

            for _ in range(waves):
                await asyncio.gather(*(one() for _ in range(concurrency)))
        return seen, min(ok_frames, default=None)

    return asyncio.run(sample())


def code_fingerprint() -> str:
    """Which gateway code was measured: the commit, and whether gateway/ differs from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "gateway", "routes", "examples"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    if not dirty:
        return head
    digest = hashlib.sha256()
    for path in sorted((REPO / "gateway").rglob("*.py")):
        digest.update(path.read_bytes())
    return f"{head} + uncommitted changes (gateway/*.py sha256 {digest.hexdigest()[:12]})"


# --------------------------------------------------------------------------- processes


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from field 3 (state) on; None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def all_stats() -> dict[int, list[str]]:
    stats = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if fields is not None:
                stats[int(entry.name)] = fields
    return stats


def tree_cpu_s(root: int) -> float:
    """utime+stime (all threads) of ``root`` and its live descendants, plus reaped children."""
    stats = all_stats()
    children: dict[int, list[int]] = {}
    for child, child_fields in stats.items():
        children.setdefault(int(child_fields[1]), []).append(child)
    total = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        fields = stats.get(pid)
        if fields is None:
            continue
        # utime(14) stime(15) cutime(16) cstime(17): list index = field - 3
        total += sum(int(v) for v in fields[11:15])
        stack.extend(children.get(pid, ()))
    return total / CLK_TCK


def machine_busy_s() -> tuple[float, float]:
    """(CPU seconds the machine spent in processes, wall seconds) from /proc/stat and a clock.

    user + nice + system only: interrupt and softirq time (loopback networking, mostly this
    benchmark's own traffic) is not charged to any process, so it is left out on both sides."""
    user, nice, system = (int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4])
    return (user + nice + system) / CLK_TCK, time.monotonic()


def session_cpu_s(sid: int) -> float:
    """utime+stime of every live process in session ``sid`` (Triton and its backend stubs)."""
    total = 0
    for fields in all_stats().values():
        if int(fields[3]) == sid:
            total += sum(int(v) for v in fields[11:13])
    return total / CLK_TCK


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Child:
    """A proxy subprocess in its own session, with its output in a log file."""

    name: str
    args: list[str]
    log_path: Path
    ready_text: str
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=REPO,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.ready_text in self.log_path.read_text(errors="replace"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is not None:
            stop_process_group(self.process, timeout_s)


class Stoppable(Protocol):
    def stop(self) -> None: ...


# --------------------------------------------------------------------------- h2load


@dataclass
class Run:
    """One measured h2load run; per-request figures are derived so a better ``ok_frame``
    (learnt when diagnosing) corrects them."""

    target: str
    requests: int
    http_ok: int  # h2load "succeeded": HTTP 2xx, whatever the grpc-status
    http_failed: int  # h2load "failed" + "errored"
    data_bytes: int  # DATA bytes received (gRPC messages incl. their 5-byte prefixes)
    ok_frame: int  # smallest OK answer seen with real gRPC calls (prefix included)
    req_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    proxy_cpu_s: float | None
    triton_cpu_s: float
    client_cpu_s: float
    other_cores: float  # machine CPU not spent by the target, Triton or h2load, in cores
    raw: str = field(repr=False, default="")

    @property
    def data_per_response(self) -> float:
        return self.data_bytes / max(self.http_ok, 1)

    @property
    def answers_differ(self) -> bool:
        """DATA per response is not what the verified OK answer carries: errors (no message)
        or other answers (another size, e.g. the gateway's fallback model) were mixed in."""
        return abs(self.data_per_response - self.ok_frame) > 0.02 * self.ok_frame

    @property
    def grpc_errors(self) -> int:
        """Estimate. gRPC errors are HTTP 200 with trailers only and no message, so they show as
        a shortfall of DATA bytes against ``http_ok`` answers of at least ``ok_frame`` bytes."""
        if self.data_bytes >= 0.98 * self.http_ok * self.ok_frame:
            return 0
        return self.http_ok - min(self.http_ok, round(self.data_bytes / self.ok_frame))

    @property
    def succeeded(self) -> int:
        return self.http_ok - self.grpc_errors

    @property
    def failed(self) -> int:
        return self.http_failed + self.grpc_errors

    def per_request_us(self, cpu_s: float | None) -> float | None:
        return None if cpu_s is None else cpu_s * 1e6 / max(self.succeeded, 1)


_FINISHED = re.compile(r"finished in ([\d.]+)(\w+), ([\d.]+) req/s")
_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored"
)
_DATA = re.compile(r"traffic: .*?\((\d+)\) total, .*?\((\d+)\) headers.*?\((\d+)\) data")
_MEAN = re.compile(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)\b")


def _to_ms(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def h2load_args(
    h2load: str,
    url: str,
    frame_file: Path,
    args: argparse.Namespace,
    n: int,
    auth: str | None,
    log_file: Path | None = None,
) -> list[str]:
    cmd = [
        h2load,
        "-n",
        str(n),
        "-c",
        str(args.connections),
        "-m",
        str(args.streams),
        "-t",
        str(args.threads),
        "--header",
        "content-type: application/grpc",
        "--header",
        "te: trailers",
    ]
    if auth:
        cmd += ["--header", f"authorization: Bearer {auth}"]
    if log_file is not None:
        cmd += ["--log-file", str(log_file)]
    return [*cmd, "-d", str(frame_file), url]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, round(q / 100.0 * len(sorted_values) + 0.5 - 1e-9))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def run_h2load(
    target: str,
    cmd: list[str],
    log_file: Path,
    ok_frame: int,
    proxy_pid: int | None,
    triton_sid: int,
) -> Run:
    proxy_before = tree_cpu_s(proxy_pid) if proxy_pid else 0.0
    triton_before = session_cpu_s(triton_sid)
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, wall_before = machine_busy_s()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    busy_after, wall_after = machine_busy_s()
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    triton_after = session_cpu_s(triton_sid)
    proxy_after = tree_cpu_s(proxy_pid) if proxy_pid else 0.0
    text = out.stdout + out.stderr
    finished, counts, traffic = _FINISHED.search(text), _REQUESTS.search(text), _DATA.search(text)
    if out.returncode != 0 or not (finished and counts and traffic):
        raise RuntimeError(f"h2load failed for {target} (exit {out.returncode}):\n{text[-3000:]}")
    total, succeeded, failed, errored = (int(counts.group(i)) for i in (1, 4, 5, 6))
    durations = []
    for line in log_file.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[1].startswith("2"):
            durations.append(int(parts[2]) / 1000.0)
    durations.sort()
    mean = _MEAN.search(text)
    client_cpu = (client_after.ru_utime + client_after.ru_stime) - (
        client_before.ru_utime + client_before.ru_stime
    )
    ours = (proxy_after - proxy_before) + (triton_after - triton_before) + client_cpu
    other_cores = max(0.0, (busy_after - busy_before) - ours) / max(wall_after - wall_before, 1e-9)
    return Run(
        target=target,
        requests=total,
        http_ok=succeeded,
        http_failed=failed + errored,
        data_bytes=int(traffic.group(3)),
        ok_frame=ok_frame,
        req_per_s=float(finished.group(3)),
        p50_ms=percentile(durations, 50),
        p99_ms=percentile(durations, 99),
        mean_ms=_to_ms(mean.group(1), mean.group(2)) if mean else float("nan"),
        proxy_cpu_s=proxy_after - proxy_before if proxy_pid else None,
        triton_cpu_s=triton_after - triton_before,
        client_cpu_s=client_cpu,
        other_cores=other_cores,
        raw=text,
    )


@dataclass
class Row:
    """One table row: a target's runs summarized (medians; counts summed)."""

    target: str
    req_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    proxy_cpu_us: float | None
    triton_cpu_us: float
    client_cpu_us: float
    succeeded: int
    failed: int
    data_per_response: float
    ok_frame: int
    other_cores: float

    @classmethod
    def of(cls, runs: list[Run]) -> Row:
        def med(values: list[float | None]) -> float:
            return float(statistics.median(v for v in values if v is not None))

        proxy = [r.per_request_us(r.proxy_cpu_s) for r in runs]
        return cls(
            target=runs[0].target,
            req_per_s=med([r.req_per_s for r in runs]),
            p50_ms=med([r.p50_ms for r in runs]),
            p99_ms=med([r.p99_ms for r in runs]),
            mean_ms=med([r.mean_ms for r in runs]),
            proxy_cpu_us=med(proxy) if any(v is not None for v in proxy) else None,
            triton_cpu_us=med([r.per_request_us(r.triton_cpu_s) for r in runs]),
            client_cpu_us=med([r.per_request_us(r.client_cpu_s) for r in runs]),
            succeeded=sum(r.succeeded for r in runs),
            failed=sum(r.failed for r in runs),
            data_per_response=med([r.data_per_response for r in runs]),
            ok_frame=min(r.ok_frame for r in runs),
            other_cores=max(r.other_cores for r in runs),
        )


# --------------------------------------------------------------------------- report


def render(rows: list[Row]) -> str:
    header = (
        f"{'target':<15} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} "
        f"{'proxy CPU-us/req':>17} {'triton CPU-us/req':>18} {'h2load CPU-us/req':>18} "
        f"{'succeeded/failed':>17} {'B/resp (OK)':>12} {'other load':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        proxy = f"{r.proxy_cpu_us:.0f}" if r.proxy_cpu_us is not None else "-"
        lines.append(
            f"{r.target:<15} {r.req_per_s:>8.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.mean_ms:>8.2f} "
            f"{proxy:>17} {r.triton_cpu_us:>18.0f} {r.client_cpu_us:>18.0f} "
            f"{f'{r.succeeded}/{r.failed}':>17} {f'{r.data_per_response:.0f} ({r.ok_frame})':>12}"
            f" {r.other_cores:>10.2f}"
        )
    by = {r.target: r for r in rows}
    gw = by.get("gateway")
    if gw is not None:
        lines.append("")
        for base in ("direct", "passthrough", "parsing"):
            ref = by.get(base)
            if ref is None:
                continue
            line = f"gateway/{base:<12} req/s x{gw.req_per_s / ref.req_per_s:.2f}"
            line += f"   p50 x{gw.p50_ms / ref.p50_ms:.2f}   p99 x{gw.p99_ms / ref.p99_ms:.2f}"
            if gw.proxy_cpu_us and ref.proxy_cpu_us:
                line += f"   proxy CPU/req x{gw.proxy_cpu_us / ref.proxy_cpu_us:.2f}"
            lines.append(line)
    if gw is not None:
        for target in FEATURE_TARGETS:
            row = by.get(target)
            if row is None:
                continue
            line = f"{target}/gateway  req/s x{row.req_per_s / gw.req_per_s:.2f}"
            line += f"   p50 x{row.p50_ms / gw.p50_ms:.2f} ({row.p50_ms - gw.p50_ms:+.2f} ms)"
            if row.proxy_cpu_us and gw.proxy_cpu_us:
                line += (
                    f"   gateway CPU/req x{row.proxy_cpu_us / gw.proxy_cpu_us:.2f}"
                    f" ({row.proxy_cpu_us - gw.proxy_cpu_us:+.0f} us: the feature read)"
                )
            lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def gateway_config(triton_address: str, time_scale: float | None) -> dict[str, Any]:
    """The example stack's settings (classes, limits, policies, ...) with one external backend:
    :func:`orchid_tools.harness.example_config` (every key of examples/orchid/gateway.yaml but
    ``local_triton`` and ``listen``, tenants, routes and policies the repository's own).
    ``time_scale`` tells the gateway that the backend's devices run ``time_scale`` x the
    profiles' milliseconds (the emulator's time factor); ``None`` leaves the key out (real
    devices)."""
    backend = {
        "name": "bench",
        "address": triton_address,
        "labels": {"cell": "eu-restricted", "device_group": "bench"},
        "devices": 4,
        **({"time_scale": time_scale} if time_scale is not None else {}),
    }
    return example_config([backend])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--requests", type=int, default=4000, help="measured requests per target")
    parser.add_argument(
        "-w", "--warmup", type=int, default=500, help="warm-up requests per target (not measured)"
    )
    parser.add_argument("-c", "--connections", type=int, default=8, help="h2load -c")
    parser.add_argument(
        "-m", "--streams", type=int, default=1, help="h2load -m (concurrent streams per connection)"
    )
    parser.add_argument("-t", "--threads", type=int, default=1, help="h2load -t")
    parser.add_argument("--tokens", type=int, default=256, help="INPUT_IDS length")
    parser.add_argument(
        "--time-factor", type=float, default=0.0, help="emulator sleep multiplier (0 = no model cost)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternate the targets this many times; report medians"
    )
    parser.add_argument(
        "--base-port", type=int, default=19410, help="Triton; +1 passthrough; +2 gateway; +3 parsing"
    )
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help="comma-separated subset of " + ",".join(TARGETS)
    )
    parser.add_argument("--model-repository", type=Path, default=EXAMPLES / "model_repository")
    parser.add_argument(
        "--gateway-time-scale",
        type=float,
        default=None,
        help="backend time_scale in the gateway's config (default: the time factor, or "
        f"{MIN_TIME_SCALE} for time factor 0; 0 leaves it unset, i.e. real-device cost 1.0)",
    )
    parser.add_argument("--gateway-log-level", default="WARNING", help="orchid-gateway serve --log-level")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, h2load logs)")
    parser.add_argument(
        "--output-check-only",
        action="store_true",
        help="print the output contract check's cost per answer and exit (no Triton, no h2load)",
    )
    parser.add_argument(
        "--ablate",
        default="",
        help="diagnostic: start the gateway through bench/ablate.py with these parts of its request "
        "path taken out (comma-separated: policy, telemetry, provenance, decisions); not a gateway",
    )
    args = parser.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(args.targets) - set(TARGETS)
    if unknown or not args.targets:
        parser.error(f"--targets: unknown {sorted(unknown)}; choose from {', '.join(TARGETS)}")
    return args


def output_check_us(output_tokens: int, repeat: int = 20_000) -> float:
    """Microseconds per answer of a route's output contract check (the best of 5 runs)."""
    reply = service_pb2.ModelInferResponse()
    out = reply.outputs.add()
    out.name, out.datatype = "OUTPUT_IDS", "INT32"
    out.shape.extend([1, output_tokens])
    reply.raw_output_contents.append((np.arange(output_tokens, dtype=np.int32) % 32_000).tobytes())
    checks = {
        "OUTPUT_IDS": OutputCheck(
            datatype="INT32", shape=("items", "output_tokens"), min_value=0, max_value=31_999
        )
    }
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(repeat):
            problems = check_outputs(
                reply, checks, items=1, input_tokens=256, output_tokens=output_tokens, batched=True
            )
        best = min(best, (time.perf_counter() - began) / repeat)
        assert not problems
    return best * 1e6


def print_output_check_cost() -> None:
    costs = ", ".join(f"{n} output tokens {output_check_us(n):.1f} us" for n in (64, 1024))
    print(f"output contract check (route outputs), per answer: {costs}", flush=True)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="orchid-overhead-"))
    try:
        yield path
    finally:
        if keep:
            print(f"work directory kept: {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def bench(
    args: argparse.Namespace, h2load: str, ports: dict[str, int], work: Path, started: list[Stoppable]
) -> int:
    """Start Triton and the proxies (appending each to ``started``), verify, measure, print."""
    repository = args.model_repository.resolve()
    if any(t in FEATURE_TARGETS for t in args.targets):
        # ranker-v3 gets full-v18's 4 instances (devices) in a copy of the repository: the
        # feature rows then differ from the gateway row by the feature read alone, not by a
        # pool of one device that its overload ladder (rightly) protects at these rates.
        copy = work / "repo"
        shutil.copytree(repository, copy / "model_repository")
        shutil.copytree(repository.parent / "emulator", copy / "emulator")
        ranker = copy / "model_repository" / "ranker-v3" / "config.pbtxt"
        ranker.write_text(ranker.read_text().replace("count: 1, kind: KIND_CPU", "count: 4, kind: KIND_CPU"))
        repository = copy / "model_repository"
    triton = LocalTriton(
        repository,
        work / "triton",
        grpc_port=ports["triton"],
        time_factor=args.time_factor,
    )
    started.append(triton)
    began = time.monotonic()
    triton.start()
    print(f"triton ready on {triton.address} ({time.monotonic() - began:.1f}s)", flush=True)
    triton_process = triton._process  # the server's pid is also its session id (start_new_session)
    assert triton_process is not None
    triton_sid = triton_process.pid

    plain, hinted = build_request(args.tokens, gateway=False), build_request(args.tokens, gateway=True)
    ranked = build_request(args.tokens, gateway=True, model=FEATURE_MODEL, user=1)
    messages = {target: plain for target in args.targets}
    messages.update({"gateway": hinted, **dict.fromkeys(FEATURE_TARGETS, ranked)})
    frames = {target: work / f"request-{target}.grpc" for target in args.targets}
    for target, frame_path in frames.items():
        frame_path.write_bytes(grpc_frame(messages[target]))
    models = {target: FEATURE_MODEL if target in FEATURE_TARGETS else MODEL for target in args.targets}

    proxies: dict[str, Child | GatewayProcess] = {}
    if "passthrough" in args.targets:
        proxies["passthrough"] = Child(
            "passthrough",
            [
                sys.executable,
                str(REPO / "bench" / "passthrough.py"),
                f"--listen=127.0.0.1:{ports['passthrough']}",
                f"--upstream={triton.address}",
            ],
            work / "passthrough.log",
            "passthrough ready on",
        )
    if "parsing" in args.targets:
        proxies["parsing"] = Child(
            "parsing",
            [
                sys.executable,
                str(REPO / "bench" / "passthrough.py"),
                f"--listen=127.0.0.1:{ports['parsing']}",
                f"--upstream={triton.address}",
                "--parse",
            ],
            work / "parsing.log",
            "passthrough ready on",
        )
    feast: FeastServer | None = None
    if any(t in FEATURE_TARGETS for t in args.targets):
        feast = FeastServer(work / "feast")
        started.append(feast)
        feast.start()
        print(f"feast feature server ready on {feast.url} ({sum(feast.timings.values()):.1f}s)", flush=True)
    for target in (t for t in args.targets if t in GATEWAY_TARGETS):
        time_scale = args.gateway_time_scale
        if time_scale is None:
            time_scale = args.time_factor if args.time_factor > 0 else MIN_TIME_SCALE
        config = gateway_config(triton.address, time_scale or None)
        if target in FEATURE_TARGETS:
            assert feast is not None
            # What a read costs, not when to refuse one: no backpressure (the class's constant
            # upstream reserve) and a timeout no read under this load reaches.
            config["feature_sources"] = {
                "feast": {
                    "url": feast.url,
                    "registry": str(feast.registry_path),
                    "timeout_ms": 5000,
                    "backpressure": False,
                    "cache_ttl_ms": 60_000 if target == "features-cached" else 0,
                }
            }
        print(f"{target} backend time_scale: {time_scale or 'unset (1.0)'}", flush=True)
        command = None
        if args.ablate and target == "gateway":  # a diagnostic: what the ablated parts cost
            command = [sys.executable, str(REPO / "bench" / "ablate.py"), "--ablate", args.ablate]
            print(f"gateway ABLATED (diagnostic, not a gateway): without {args.ablate}", flush=True)
        proxies[target] = GatewayProcess(
            config,
            work / target,
            name=target,
            listen=f"127.0.0.1:{ports[target]}",
            command=command,
            log_level=args.gateway_log_level,
        )
    for child in proxies.values():
        started.append(child)
        child.start()
        print(f"{child.name} ready (pid {child.pid})", flush=True)

    auth = dict.fromkeys(GATEWAY_TARGETS, DEMO_KEY)
    addresses = {"direct": triton.address, **{name: f"127.0.0.1:{ports[name]}" for name in proxies}}
    frame_sizes: dict[str, int] = {}
    for target in args.targets:
        message = messages[target]
        metadata = [("authorization", f"Bearer {auth[target]}")] if target in auth else []
        frame_sizes[target] = verify(addresses[target], message, metadata)
        print(f"verified {target}: grpc-status 0, response frame {frame_sizes[target]} bytes", flush=True)

    runs: dict[str, list[Run]] = {t: [] for t in args.targets}
    for round_no in range(1, args.rounds + 1):
        for target in args.targets:
            url = f"http://{addresses[target]}{METHOD}"
            frame = frames[target]
            message = messages[target]
            metadata = [("authorization", f"Bearer {auth[target]}")] if target in auth else []
            if args.warmup:
                warm = h2load_args(h2load, url, frame, args, args.warmup, auth.get(target))
                subprocess.run(warm, capture_output=True, check=False)
                # A warm gateway's OK answers can be smaller than a cold one's (fewer provenance
                # parameters): keep the smallest OK answer seen as the yardstick for errors.
                seen, smallest = sample_outcomes(addresses[target], message, metadata, 1, waves=5)
                if smallest is not None:
                    frame_sizes[target] = min(frame_sizes[target], smallest)
                if any(not outcome.startswith(f"OK model={models[target]} ") for outcome in seen):
                    print(f"{target} after warm-up answers otherwise than when verified:", flush=True)
                    for outcome, count in seen.most_common():
                        print(f"  {count:6d}  {outcome}", flush=True)
            log_file = work / f"h2load-{target}-{round_no}.log"
            cmd = h2load_args(h2load, url, frame, args, args.requests, auth.get(target), log_file)
            if round_no == 1:
                print("  $ " + " ".join(f"'{a}'" if " " in a else a for a in cmd), flush=True)
            proxy_pid = proxies[target].pid if target in proxies else None
            run = run_h2load(target, cmd, log_file, frame_sizes[target], proxy_pid, triton_sid)
            runs[target].append(run)
            print(
                f"round {round_no} {target}: {run.req_per_s:.0f} req/s, p50 {run.p50_ms:.2f} ms, "
                f"{run.succeeded}/{run.failed} ok/failed, other load {run.other_cores:.2f} cores",
                flush=True,
            )
            if run.failed or run.answers_differ:
                if run.http_failed:
                    print(run.raw[-1500:], flush=True)
                print(
                    f"{target}: {run.data_per_response:.0f} DATA bytes per response, "
                    f"the verified OK answer is {run.ok_frame}",
                    flush=True,
                )
                if run.answers_differ:
                    concurrency = args.connections * args.streams
                    seen, smallest = sample_outcomes(addresses[target], message, metadata, concurrency)
                    print(
                        f"gRPC outcomes of {concurrency * 10} calls at concurrency {concurrency}:", flush=True
                    )
                    for outcome, count in seen.most_common():
                        print(f"  {count:6d}  {outcome}", flush=True)
                    if smallest is not None and smallest < run.ok_frame:
                        # Smaller OK answers exist: re-estimate errors against them, here and later.
                        frame_sizes[target] = run.ok_frame = smallest
                        print(f"{target}: now {run.succeeded}/{run.failed} ok/failed (estimate)", flush=True)
                if target in proxies:
                    print(f"--- {target} log tail ---\n{proxies[target].log_tail()}", flush=True)

    rows = [Row.of(runs[t]) for t in args.targets]
    print()
    print("load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.rounds > 1:
        print(f"medians over {args.rounds} rounds; succeeded/failed summed; other load: the worst round")
    print(
        "other load: cores busy with anything but this target, Triton and h2load during the run "
        "(other users of the machine); above ~0.2 the throughput figures are contaminated"
    )
    print(render(rows))
    if args.ablate:
        print(f"(the gateway row is ABLATED, a diagnostic: without {args.ablate}; see bench/ablate.py)")
    return 1 if any(r.failed for r in rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.output_check_only:
        print_output_check_cost()
        return 0
    h2load = shutil.which("h2load")
    if h2load is None:
        print(f"h2load not found; install it with:\n    {INSTALL_H2LOAD}", file=sys.stderr)
        return 2
    ports = {
        "triton": args.base_port,
        "passthrough": args.base_port + 1,
        "gateway": args.base_port + 2,
        "parsing": args.base_port + 3,
        "features-cached": args.base_port + 4,
        "features-read": args.base_port + 5,
    }
    busy = [f"{name}={port}" for name, port in ports.items() if not port_free(port)]
    if busy:
        print(f"ports in use: {', '.join(busy)}; pick another --base-port", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    version = subprocess.run(
        [h2load, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"machine: nproc={os.cpu_count()} python={platform.python_version()} {platform.machine()}"
        f" | {version}\n"
        f"code: {code_fingerprint()}\n"
        f"load: -n {args.requests} (+{args.warmup} warm-up) -c {args.connections} -m {args.streams} "
        f"-t {args.threads}, rounds {args.rounds}; model {MODEL} INPUT_IDS [1,{args.tokens}], "
        f"time factor {args.time_factor}\n"
        "load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
        flush=True,
    )
    print_output_check_cost()
    started: list[Stoppable] = []
    try:
        with workdir(args.keep) as work:
            try:
                return bench(args, h2load, ports, work, started)
            finally:
                # Stop everything before the work directory goes; a second Ctrl-C or a
                # SIGTERM must not cut the cleanup short.
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                for process in reversed(started):
                    process.stop()
    except KeyboardInterrupt:
        print("\ninterrupted; everything started was stopped", file=sys.stderr)
        return 130
    except RuntimeError as error:
        print(f"overhead: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
