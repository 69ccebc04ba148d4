"""Surge benchmark: orchid-gateway against Triton direct (naive FIFO and tuned queue policy).

What it measures
    The seed's "Overload needs an honest quality policy" scenario, scaled down to a
    2-core machine, run side by side against three targets with the *same* arrival
    schedule (same seed), one after the other, each on a fresh Triton:

    * ``triton-fifo``   clients -> Triton on ``examples/orchid/model_repository`` as
                        shipped (dynamic batcher, unbounded FIFO queue, no timeouts);
    * ``triton-tuned``  clients -> Triton on a temporary copy of that repository whose
                        ``full-v18`` / ``compact-v11`` configs get a queue policy
                        (``default_queue_policy { timeout_action: REJECT,
                        default_timeout_microseconds, allow_timeout_override: true,
                        max_queue_size }``); every request also carries Triton's
                        ``timeout`` parameter (microseconds) = its deadline minus its
                        price, i.e. its latest start: the strongest baseline Triton
                        alone offers (ARCHITECTURE §7). ``max_queue_size``
                        (``--tuned-queue-size``) defaults to 4, the best surge goodput
                        of a sweep over 2, 4, 6, 8, 16 and 32;
    * ``gateway``       clients -> ``orchid-gateway serve`` (the repository's tenants,
                        routes and policies) -> Triton on the shipped repository.

    Optionally (``--kill-at``, on by default) a fourth run, ``gateway-kill``: the same
    workload through the gateway, with its Triton SIGKILLed during the surge
    (``LocalTriton.kill()``) and restarted ``--kill-for`` seconds later
    (``LocalTriton.start()``): the loss of a device group (issue 7.5).

Scaling (one consistent rule: the seed's world, on 4 devices, with time compressed by f)
    The emulator holds a Triton instance ("device") for the seed's price times
    ``ORCHID_TIME_FACTOR`` = f (``--time-factor``, default 0.5): a short request
    (256 in / 64 out) occupies 56.8·f device-ms, a long one (4,096 / 128) 467.6·f.
    0.5, not smaller: the emulator adds ~2.5 ms of fixed IPC per request that does not
    scale (measured: a short request takes 16.7 ms at f = 0.25 instead of 14.2, 18 %
    more; at f = 0.5 about 9 %), and half the request rate leaves the two cores to the
    servers rather than to the client.

    * Fleet: full-v18 has 4 instances; the seed's fleet is its arithmetic minimum of 24
      devices (``orchid-gateway capacity examples/orchid/workload.yaml``). Arrival
      rates are the seed's 140 short + 18 long req/s times 4/24 (the fleet share)
      divided by f (time compression): at f = 0.5, 46.7 short + 6.0 long req/s.
      Offered demand is then 16,368.8 · (4/24) = 2,728.1 device-ms/s = 97.43 % of the
      protected envelope 4 × 0.70 × 1,000 = 2,800 ms/s, exactly the seed's ratio; the
      surge (x1.25) is 3,410.2 ms/s = 121.8 % (85 % of the devices' raw time).
    * Fallback devices (``--fallback-devices``): by default ``shared``, as the seed
      models the fallback's saving: ``compact-v11`` gets one instance beside each of
      ``full-v18``'s 4 (a temporary copy of the repository) and the emulator runs both
      models' batches on the same 4 emulated devices (``ORCHID_DEVICE_DIR``, one lock
      per device); the gateway's backend entry says ``shared_devices: true``. The
      direct targets run on the same setup (they never call the fallback). ``own``
      keeps the shipped 2 ``compact-v11`` instances as extra devices (6 in all).
    * Deadlines scale with f: the seed's teaching deadline 200 ms for short interactive
      requests (-> 100 ms at f = 0.5, 3.5x the short price); long requests get
      1,000 ms (-> 500 ms; 2.1x their price: 2 x 467.6 + R_up 12 + R_fail 15 = 962
      rounded up). Both are class ``interactive``: the seed's fallback covers both
      (60 % of short and 50 % of long surge traffic), so both are eligible for it. The
      client's gRPC deadline *is* the request deadline (``client_timeout``): the caller
      gives up then, which is what propagates to the gateway and to Triton.
    * The gateway's class reserves scale the same way (temporary gateway YAML): the
      example config's interactive ``R_up`` 12 ms, ``R_fail`` 15 ms and ``max_dwell``
      20 ms become 12·f, 15·f, 20·f; default deadlines 200·f, batch 30,000·f. Its
      backend entry declares ``time_scale: f`` so it prices requests in device-ms of
      this emulator. Its ladder's controller constants (10 s demand window, 2 s hold)
      are wall-clock and are *not* scaled: the ladder sees a surge after a few seconds.
    * Phases: ``--normal-s`` 20 s at 1x, ``--surge-s`` 30 s at 1.25x arrivals,
      ``--recover-s`` 10 s at 1x. Each target first gets one concurrent request per
      instance and shape (instance warm-up) and 3 s of the workload at 0.5x (not
      measured), then the measured schedule.

Client
    Open loop: Poisson arrivals per class (numpy ``default_rng(--seed)``), sent at their
    scheduled time whatever is outstanding (a closed loop would hide overload), from
    one asyncio process over one ``grpc.aio`` channel with requests serialized once per
    class and target (raw bytes in and out, responses parsed only for the gateway's
    provenance). Send lag (actual - scheduled send time) is reported: the schedule is
    honest only while it stays small. All traffic uses the ``orchid`` demo tenant (the
    tenant entitled to the fallback model, the seed's eligible population) and hints
    ``orchid.class=interactive``, ``orchid.max_output_tokens``; direct targets get
    Triton's ``max_output_tokens`` parameter.

Outcome of a request, from the client
    * ``ok``: a response before the deadline (it cannot be later: the deadline is the
      gRPC deadline). Goodput = ok per second; fallback = ok with provenance
      ``orchid.approximation == fallback`` (served by compact-v11 within its quality
      floor; counted as goodput and shown separately); reduced = ok with
      ``orchid.approximation == reduced_output`` (ladder step 2 capped the output at the
      route's reduced length, within its quality evidence; also goodput, shown
      separately).
    * ``rejected at entry``: the server refused without queueing it: the gateway's
      admission (any ``orchid-rule`` other than ``queue.latest_start``, or "no healthy
      backend serves model"); Triton's ``Exceeds maximum queue size``.
    * ``rejected late``: refused after waiting in a queue: the gateway's
      ``queue.latest_start`` (its latest feasible start passed); Triton's
      ``Request timeout expired`` (checked lazily, when an instance frees).
    * ``missed``: anything else, above all the caller's own deadline expiring (no
      answer in time), or a backend failure after admission.
    ``attain`` = ok / (offered - rejected), as the brief defines it for Triton
    ("everything not rejected counts as admitted"); ``attain*`` = ok / (offered -
    rejected at entry) counts late rejections as admitted work that missed: this is the
    gateway's own meaning of "admitted" (it passed admission) and the issue's target.

Wasted accelerator-ms (device time spent on work whose caller got nothing)
    From Triton's own statistics, sampled at every phase boundary and after the run:
    ``busy`` = sum over both models of ``batch_stats`` compute (input + infer + output)
    time = the time instances were held; ``executed`` = successful inferences. Executed
    requests that did not reach a caller on time = executed - ok (per model; they ran
    after the caller gave up, or finished too late). The busy time is apportioned between
    on-time and not-on-time executions by their batch-of-one prices (not-on-time ones
    priced at the mean price of the phase's missed requests), which accounts for Triton
    batching (a batch shares decode, so batch-of-one prices overstate device time).
    Waste is reported in device-ms per second and as % of the protected capacity of the
    full-v18 pool (2,800 ms/s). Requests cancelled mid-decode count as failures, not
    executions: their partial device time is attributed to the rest (an underestimate
    of waste, small: the emulator stops a cancelled decode within ~10 ms).

Ladder step
    From the gateway's log (``orchid.overload`` "pool ... ladder step -> N" warnings,
    timestamped) for the full-v18 pool; responses' ``orchid.ladder_step`` (per-second
    max) is kept as a cross-check.

Run (about 5 minutes on 2 cores, Triton and gateway startup included)::

    python bench/surge.py                       # 3 targets + the kill run, plot docs/img/surge.png
    python bench/surge.py --kill-at 0           # without the kill run
    python bench/surge.py --normal-s 5 --surge-s 10 --recover-s 5 --kill-at 0   # quick look

Diagnostics (gateway configuration only, never its code)::

    python bench/surge.py --targets gateway --kill-at 0 --gateway-inflight 1
    python bench/surge.py --targets gateway --kill-at 0 \
        --gateway-ladder reject_interactive_at=1.5 --gateway-ladder protect_admitted_at=1.6
    python bench/surge.py --surge-factor 1.8 --kill-at 0   # 1.25x the devices' raw time

Ports ``--base-port`` (default 16100) +1 to +4 (Triton) and +8 (gateway). Everything started
is stopped on exit.
Needs matplotlib for the plot (``pip install matplotlib``; without it the plot is skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from tritonclient.grpc import service_pb2

from gateway.backends.local import LocalTriton
from gateway.capacity import compute_worksheet, workload_from_data
from gateway.config import load_routes
from gateway.overload import DEFAULT_WINDOW_S as DEMAND_WINDOW_S
from gateway.profile import DemandProfile

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "orchid"
INFER = "/inference.GRPCInferenceService/ModelInfer"
STATS = "/inference.GRPCInferenceService/ModelStatistics"
READY = "/inference.GRPCInferenceService/ServerReady"
PRIMARY, FALLBACK = "full-v18", "compact-v11"
DEMO_KEY = "orchid-demo-key-orchid"
CLASSES = ("short", "long")
SHAPES = {"short": (256, 64), "long": (4096, 128)}  # input tokens, output tokens
SEED_DEADLINE_MS = {"short": 200.0, "long": 1000.0}  # at time factor 1
PROTECTED_UTILIZATION = 0.70
TARGETS = ("triton-fifo", "triton-tuned", "gateway")
KILL_TARGET = "gateway-kill"
LADDER_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ orchid\.overload: pool (\S+) ladder step -> (\d+): (.*)$"
)
# Gateway rules that refuse a request after it waited in the dispatch queue.
LATE_RULES = frozenset({"queue.latest_start"})


# --------------------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float
    multiplier: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Scenario:
    time_factor: float
    seed_rates: dict[str, float]  # the seed's req/s per class at its full fleet
    seed_fleet: int  # the seed's fleet (arithmetic minimum devices)
    fleet: int  # full-v18 instances here
    surge_factor: float
    normal_s: float
    surge_s: float
    recover_s: float
    prices: dict[str, dict[str, float]]  # model -> class -> profile ms (batch of one)

    def rate(self, cls: str) -> float:
        """Arrival rate at 1x: the seed's rate times the fleet share, time-compressed by f."""
        return self.seed_rates[cls] * self.fleet / self.seed_fleet / self.time_factor

    def deadline_ms(self, cls: str) -> float:
        return SEED_DEADLINE_MS[cls] * self.time_factor

    def device_ms(self, model: str, cls: str) -> float:
        """Device-ms one request of ``cls`` holds an instance of ``model`` (batch of one)."""
        return self.prices[model][cls] * self.time_factor

    @property
    def protected_ms_per_s(self) -> float:
        return self.fleet * PROTECTED_UTILIZATION * 1000.0

    @property
    def phases(self) -> tuple[Phase, ...]:
        a = self.normal_s
        b = a + self.surge_s
        return (
            Phase("normal", 0.0, a, 1.0),
            Phase("surge", a, b, self.surge_factor),
            Phase("recovery", b, b + self.recover_s, 1.0),
        )

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s


@dataclass(frozen=True, slots=True)
class Arrival:
    t: float  # seconds after the run's start
    cls: str


def poisson_schedule(phases: Sequence[Phase], rates: dict[str, float], seed: int) -> list[Arrival]:
    """Independent Poisson processes per class, piecewise constant rate per phase."""
    rng = np.random.default_rng(seed)
    arrivals: list[Arrival] = []
    for phase in phases:
        for cls in CLASSES:
            count = int(rng.poisson(rates[cls] * phase.multiplier * phase.duration_s))
            times = rng.uniform(phase.start_s, phase.end_s, size=count)
            arrivals.extend(Arrival(float(t), cls) for t in times)
    arrivals.sort(key=lambda a: a.t)
    return arrivals


def load_prices() -> dict[str, dict[str, float]]:
    profiles: dict[str, DemandProfile] = load_routes(REPO / "routes").profiles
    return {
        model: {cls: profiles[model].accelerator_ms(*SHAPES[cls]) for cls in CLASSES}
        for model in (PRIMARY, FALLBACK)
    }


def seed_worksheet_data() -> dict[str, Any]:
    data = yaml.safe_load((EXAMPLES / "workload.yaml").read_text())
    assert isinstance(data, dict)
    return data


def scaled_worksheet(scenario: Scenario) -> dict[str, float]:
    """The seed's worksheet arithmetic for this fleet.

    Rates are given to the worksheet in profile time (rate x f): a device here serves
    1,000 / f profile-ms per second, so the worksheet's accelerator-ms/s are device-ms/s
    of this emulator and its percentages are those of the 4-device protected envelope."""
    data = seed_worksheet_data()
    data["device"]["devices"] = scenario.fleet
    for cls in CLASSES:
        data["classes"][cls]["rate_per_s"] = scenario.rate(cls) * scenario.time_factor
    sheet = compute_worksheet(workload_from_data(data, "scaled"))
    keys = (
        "execution.offered_demand",
        "execution.protected_pct",
        "overload.surge_demand",
        "overload.surge_pct",
        "overload.saving.short",
        "overload.saving.long",
        "overload.fallback_saving",
        "overload.remaining_demand",
        "overload.remaining_pct",
    )
    return {key: sheet.value(key) for key in keys}


def seed_fleet() -> int:
    sheet = compute_worksheet(workload_from_data(seed_worksheet_data(), "seed"))
    return int(sheet.value("execution.fleet"))


# --------------------------------------------------------------------------- requests


def build_request(cls: str, *, target: str, scenario: Scenario) -> bytes:
    tokens, output = SHAPES[cls]
    request = service_pb2.ModelInferRequest(model_name=PRIMARY, id=cls)
    tensor = request.inputs.add()
    tensor.name = "INPUT_IDS"
    tensor.datatype = "INT32"
    tensor.shape.extend([1, tokens])
    request.raw_input_contents.append(np.arange(tokens, dtype="<i4").tobytes())
    request.outputs.add().name = "OUTPUT_IDS"
    if target.startswith("gateway"):
        request.parameters["orchid.class"].string_param = "interactive"
        request.parameters["orchid.max_output_tokens"].int64_param = output
    else:
        request.parameters["max_output_tokens"].int64_param = output
    if target == "triton-tuned":
        request.parameters["timeout"].int64_param = tuned_timeout_us(cls, scenario)
    data: bytes = request.SerializeToString()
    return data


def tuned_timeout_us(cls: str, scenario: Scenario) -> int:
    """Latest start: the deadline minus the request's price, in microseconds."""
    slack_ms = scenario.deadline_ms(cls) - scenario.device_ms(PRIMARY, cls)
    return max(1, int(slack_ms * 1000))


def copy_repository(into: Path) -> Path:
    """A copy of the example repository. The emulator's ``model.py`` imports
    ``../../../emulator``, so the copy keeps that layout."""
    shutil.copytree(EXAMPLES / "model_repository", into / "model_repository")
    shutil.copytree(EXAMPLES / "emulator", into / "emulator", ignore=shutil.ignore_patterns("__pycache__"))
    return into / "model_repository"


def share_devices(repository: Path, devices: int) -> None:
    """``--shared-devices``: one ``compact-v11`` instance beside each ``full-v18`` instance
    (the emulator then runs both models' batches on the same emulated devices)."""
    path = repository / FALLBACK / "config.pbtxt"
    text, count = re.subn(r"count: \d+", f"count: {devices}", path.read_text())
    if count != 1:
        raise RuntimeError(f"{path}: expected one instance_group count")
    path.write_text(text)


def tuned_repository(scenario: Scenario, into: Path, max_queue_size: int) -> Path:
    """A copy of the example repository with a queue policy on full-v18 and compact-v11."""
    copy_repository(into)
    default_us = tuned_timeout_us("short", scenario)
    policy = (
        "dynamic_batching { max_queue_delay_microseconds: 0 default_queue_policy { "
        f"timeout_action: REJECT default_timeout_microseconds: {default_us} "
        f"allow_timeout_override: true max_queue_size: {max_queue_size} }} }}"
    )
    for model in (PRIMARY, FALLBACK):
        path = into / "model_repository" / model / "config.pbtxt"
        text, count = re.subn(r"dynamic_batching \{[^}]*\}", policy, path.read_text())
        if count != 1:
            raise RuntimeError(f"{path}: expected one dynamic_batching block")
        path.write_text(text)
    return into / "model_repository"


def gateway_config(
    scenario: Scenario,
    triton_address: str,
    listen: str,
    inflight: int | None = None,
    ladder: dict[str, float] | None = None,
    shared_devices: bool = False,
) -> dict[str, Any]:
    """The example gateway config with the local Triton as a `backends:` entry and the
    classes' time constants scaled by f."""
    f = scenario.time_factor
    base = yaml.safe_load((EXAMPLES / "gateway.yaml").read_text())
    classes = {
        name: {key: (value * f if key.endswith("_ms") else value) for key, value in settings.items()}
        for name, settings in base["classes"].items()
    }
    local = base["local_triton"]
    config: dict[str, Any] = {
        "listen": listen,
        "tenants_file": str(EXAMPLES / "tenants.yaml"),
        "routes_dir": str(REPO / "routes"),
        "policies_dir": str(REPO / "policies"),
        "backends": [
            {
                "name": "surge",
                "address": triton_address,
                "labels": local["labels"],
                "devices": local["devices"],
                "max_inflight_per_device": inflight or local["max_inflight_per_device"],
                "shared_devices": shared_devices,
                "time_scale": f,
            }
        ],
        "classes": classes,
        "default_class": base["default_class"],
        "limits": {**base.get("limits", {}), "drain_timeout_s": 2},
    }
    if ladder:
        config["ladder"] = ladder
    return config


# --------------------------------------------------------------------------- processes


class GatewayProcess:
    """``python -m gateway serve`` in its own process (its own core, its own GIL)."""

    def __init__(self, config_path: Path, listen: str, log_path: Path, pythonpath: str | None) -> None:
        self.config_path = config_path
        self.listen = listen
        self.log_path = log_path
        self.pythonpath = pythonpath
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        env = dict(os.environ)
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.pythonpath, env.get("PYTHONPATH")) if p)
        args = [sys.executable, "-m", "gateway", "serve", "--config", str(self.config_path)]
        args += ["--listen", self.listen, "--log-level", "WARNING"]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.listen) as channel:
            ready = channel.unary_unary(
                READY,
                request_serializer=service_pb2.ServerReadyRequest.SerializeToString,
                response_deserializer=service_pb2.ServerReadyResponse.FromString,
            )
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(grpc.RpcError):
                    if ready(service_pb2.ServerReadyRequest(), timeout=1.0).ready:
                        return
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gateway not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


# --------------------------------------------------------------------------- client


@dataclass(slots=True)
class Outcome:
    cls: str
    t_sched: float  # scheduled send, seconds after the run's start
    t_sent: float
    t_end: float
    code: str  # gRPC status name
    rule: str = ""  # gateway orchid-rule trailing metadata
    detail: str = ""  # first characters of the error message
    approximation: str = ""
    model: str = ""
    ladder_step: int = -1
    predicted_ms: float = 0.0  # gateway provenance: orchid.predicted_accelerator_ms

    @property
    def latency_ms(self) -> float:
        return (self.t_end - self.t_sent) * 1000.0


@dataclass
class StatsSnapshot:
    t: float
    epoch: int  # Triton restarts so far: counters of different epochs do not subtract
    busy_ms: dict[str, float]  # model -> instance-held ms (batch_stats compute)
    executed: dict[str, int]  # model -> successful inferences
    failed: dict[str, int]
    batches: dict[str, int]  # model -> executions


@dataclass
class RunResult:
    target: str
    outcomes: list[Outcome]
    snapshots: list[StatsSnapshot]
    lags_ms: list[float]
    ladder_log: list[tuple[float, int, str]] = field(default_factory=list)  # full-v18 pool transitions
    events: dict[str, float] = field(default_factory=dict)  # kill / restart times
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ladder(self) -> list[tuple[float, int]]:
        return [(t, step) for t, step, _ in self.ladder_log]


def stats_snapshot(response: service_pb2.ModelStatisticsResponse, t: float, epoch: int) -> StatsSnapshot:
    snap = StatsSnapshot(t, epoch, {}, {}, {}, {})
    for model in response.model_stats:
        busy_ns = sum(
            b.compute_input.ns + b.compute_infer.ns + b.compute_output.ns for b in model.batch_stats
        )
        snap.busy_ms[model.name] = snap.busy_ms.get(model.name, 0.0) + busy_ns / 1e6
        snap.executed[model.name] = snap.executed.get(model.name, 0) + model.inference_stats.success.count
        snap.failed[model.name] = snap.failed.get(model.name, 0) + model.inference_stats.fail.count
        snap.batches[model.name] = snap.batches.get(model.name, 0) + model.execution_count
    return snap


def classify_error(error: grpc.aio.AioRpcError) -> tuple[str, str, str]:
    rule = ""
    for key, value in error.trailing_metadata() or ():
        if key == "orchid-rule":
            rule = value if isinstance(value, str) else value.decode()
    return error.code().name, rule, (error.details() or "")[:80]


async def drive(
    address: str,
    arrivals: Sequence[Arrival],
    payloads: dict[str, bytes],
    deadlines_s: dict[str, float],
    *,
    metadata: tuple[tuple[str, str], ...] | None,
    provenance: bool,
    hooks: Sequence[tuple[float, Callable[[], Awaitable[None]]]] = (),
) -> tuple[list[Outcome], list[float], float]:
    """Send ``arrivals`` open-loop; return outcomes, send lags (ms), and the start (monotonic)."""
    loop = asyncio.get_running_loop()
    outcomes: list[Outcome] = []
    lags: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        await channel.channel_ready()
        t0 = loop.time() + 0.05

        async def one(arrival: Arrival) -> None:
            sent = loop.time()
            outcome = Outcome(arrival.cls, arrival.t, sent - t0, 0.0, "OK")
            try:
                raw = await call(payloads[arrival.cls], timeout=deadlines_s[arrival.cls], metadata=metadata)
                outcome.t_end = loop.time() - t0
                if provenance:
                    params = service_pb2.ModelInferResponse.FromString(raw).parameters
                    outcome.approximation = params["orchid.approximation"].string_param
                    outcome.model = params["orchid.model"].string_param
                    outcome.ladder_step = int(params["orchid.ladder_step"].int64_param)
                    outcome.predicted_ms = float(params["orchid.predicted_accelerator_ms"].double_param)
                else:
                    outcome.model = PRIMARY
            except grpc.aio.AioRpcError as error:
                outcome.t_end = loop.time() - t0
                outcome.code, outcome.rule, outcome.detail = classify_error(error)
            outcomes.append(outcome)

        async def hook_at(t: float, fn: Callable[[], Awaitable[None]]) -> None:
            await asyncio.sleep(max(0.0, t0 + t - loop.time()))
            await fn()

        hook_tasks = [loop.create_task(hook_at(t, fn)) for t, fn in hooks]
        tasks: set[asyncio.Task[None]] = set()
        for arrival in arrivals:
            delay = t0 + arrival.t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append((loop.time() - t0 - arrival.t) * 1000.0)
            task = loop.create_task(one(arrival))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        await asyncio.gather(*hook_tasks)
    return outcomes, lags, t0


async def fetch_stats(address: str, t: float, epoch: int) -> StatsSnapshot | None:
    async with grpc.aio.insecure_channel(address) as channel:
        stats = channel.unary_unary(
            STATS,
            request_serializer=service_pb2.ModelStatisticsRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStatisticsResponse.FromString,
        )
        try:
            reply = await stats(service_pb2.ModelStatisticsRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return None
        return stats_snapshot(reply, t, epoch)


async def warm_instances(address: str, scenario: Scenario) -> None:
    """One concurrent request per instance and shape, on both models: the first execute of an
    instance is slow (~40 ms), and must not land in the measurement."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for model, instances in ((PRIMARY, 4), (FALLBACK, 2)):
            for cls in CLASSES:
                request = service_pb2.ModelInferRequest.FromString(
                    build_request(cls, target="triton-fifo", scenario=scenario)
                )
                request.model_name = model
                raw = request.SerializeToString()
                for _ in range(2):  # a small tuned queue may refuse some: that is fine here
                    await asyncio.gather(
                        *(call(raw, timeout=10.0) for _ in range(instances)), return_exceptions=True
                    )


def parse_ladder(log_path: Path, wall_t0: float) -> list[tuple[float, int, str]]:
    """(seconds after the run's start, step, reason) of every full-v18 pool transition in the log."""
    changes: list[tuple[float, int, str]] = []
    with contextlib.suppress(OSError):
        for line in log_path.read_text(errors="replace").splitlines():
            match = LADDER_LINE.match(line)
            if match and match.group(2).endswith("/" + PRIMARY):
                stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                changes.append((stamp - wall_t0, int(match.group(3)), match.group(4)))
    return changes


# --------------------------------------------------------------------------- one target


@dataclass
class Options:
    scenario: Scenario
    arrivals: list[Arrival]
    warmup: list[Arrival]
    workdir: Path
    base_port: int
    tuned_queue_size: int
    kill_at: float
    kill_for: float
    gateway_pythonpath: str | None
    gateway_inflight: int | None = None
    gateway_ladder: dict[str, float] | None = None
    shared_devices: bool = False


async def run_target(target: str, opts: Options) -> RunResult:
    scenario = opts.scenario
    f = scenario.time_factor
    port = opts.base_port + {"triton-fifo": 1, "triton-tuned": 2, "gateway": 3, KILL_TARGET: 4}[target]
    work = opts.workdir / target
    work.mkdir(parents=True)
    repository = EXAMPLES / "model_repository"
    if target == "triton-tuned":
        repository = tuned_repository(scenario, work, opts.tuned_queue_size)
    if opts.shared_devices:
        # Every target runs on the same emulated devices; only the gateway uses the fallback.
        if target != "triton-tuned":
            repository = copy_repository(work)
        share_devices(repository, scenario.fleet)
        os.environ["ORCHID_DEVICE_DIR"] = str(work / "devices")
        os.environ["ORCHID_DEVICES"] = str(scenario.fleet)
    triton = LocalTriton(repository, work / "triton", grpc_port=port, time_factor=f)
    gateway: GatewayProcess | None = None
    started = time.monotonic()
    await asyncio.to_thread(triton.start)
    try:
        address = triton.address
        await warm_instances(triton.address, scenario)
        if target.startswith("gateway"):
            listen = f"127.0.0.1:{opts.base_port + 8}"
            config_path = work / "gateway.yaml"
            config = gateway_config(
                scenario,
                triton.address,
                listen,
                opts.gateway_inflight,
                opts.gateway_ladder,
                shared_devices=opts.shared_devices,
            )
            config_path.write_text(yaml.safe_dump(config))
            gateway = GatewayProcess(config_path, listen, work / "gateway.log", opts.gateway_pythonpath)
            await asyncio.to_thread(gateway.start)
            address = listen
        payloads = {cls: build_request(cls, target=target, scenario=scenario) for cls in CLASSES}
        deadlines = {cls: scenario.deadline_ms(cls) / 1000.0 for cls in CLASSES}
        metadata = (("authorization", f"Bearer {DEMO_KEY}"),) if gateway else None
        kwargs: dict[str, Any] = {"metadata": metadata, "provenance": gateway is not None}
        await drive(address, opts.warmup, payloads, deadlines, **kwargs)

        snapshots: list[StatsSnapshot] = []
        events: dict[str, float] = {}
        epoch = [0]
        loop = asyncio.get_running_loop()
        t0_box: list[float] = []

        def now() -> float:
            return loop.time() - t0_box[0]

        async def snapshot(t: float | None = None) -> None:
            snap = await fetch_stats(triton.address, now() if t is None else t, epoch[0])
            if snap is not None:
                snapshots.append(snap)

        def snap_at(t: float) -> tuple[float, Callable[[], Awaitable[None]]]:
            async def take() -> None:
                await snapshot(t)

            return t, take

        async def mark() -> None:
            t0_box.append(loop.time())

        async def kill() -> None:
            await snapshot()
            events["killed"] = now()
            await asyncio.to_thread(triton.kill)
            await asyncio.sleep(opts.kill_for)
            events["restarting"] = now()
            await asyncio.to_thread(triton.start)
            events["triton_ready"] = now()
            epoch[0] += 1
            snapshots.append(StatsSnapshot(events["restarting"], epoch[0], {}, {}, {}, {}))

        hooks = [(0.0, mark)] + [snap_at(phase.start_s) for phase in scenario.phases]
        if target == KILL_TARGET:
            hooks.append((opts.kill_at, kill))
        wall_offset = time.time() - loop.time()
        outcomes, lags, t0 = await drive(address, opts.arrivals, payloads, deadlines, hooks=hooks, **kwargs)
        wall_t0 = wall_offset + t0
        await asyncio.sleep(0.3)  # let Triton finish what callers abandoned at the end
        await snapshot(scenario.duration_s)
        ladder = parse_ladder(work / "gateway.log", wall_t0) if gateway else []
        result = RunResult(target, outcomes, sorted(snapshots, key=lambda s: s.t), lags, ladder, events)

        if not triton.running():
            result.notes.append(
                f"Triton was not running at the end of the run; its log:\n{triton.log_tail(15)}"
            )
        if gateway is not None and gateway.process is not None and gateway.process.poll() is not None:
            result.notes.append(f"the gateway exited during the run; its log:\n{gateway.log_tail(15)}")
    finally:
        if gateway is not None:
            await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(triton.stop)
    result.wall_s = time.monotonic() - started
    return result


# --------------------------------------------------------------------------- analysis


def reason(outcome: Outcome) -> str:
    """Short label of a non-OK outcome: the gateway's rule, else the status (and message start)."""
    if outcome.rule:
        return outcome.rule
    if outcome.code == "DEADLINE_EXCEEDED" or not outcome.detail:
        return outcome.code
    return f"{outcome.code}({outcome.detail.removeprefix('[request id: <id_unknown>] ')[:28]})"


def kind(outcome: Outcome) -> str:
    """ok | entry (rejected without queueing) | late (rejected after queueing) | missed."""
    if outcome.code == "OK":
        return "ok"
    if outcome.rule:
        return "late" if outcome.rule in LATE_RULES else "entry"
    detail = outcome.detail
    if "maximum queue size" in detail or "serves model" in detail:
        return "entry"
    if "Request timeout expired" in detail:
        return "late"
    return "missed"


@dataclass
class ClassRow:
    offered: int = 0
    ok: int = 0
    fallback: int = 0
    reduced: int = 0  # on-time answers with ladder step 2's reduced output (orchid.approximation)
    entry: int = 0
    late: int = 0
    missed: int = 0
    caller_timeouts: int = 0
    reject_ms: list[float] = field(default_factory=list)
    entry_ms: list[float] = field(default_factory=list)
    useful_ms: float = 0.0  # batch-of-one device-ms of on-time work
    missed_price_ms: list[float] = field(default_factory=list)
    rules: Counter[str] = field(default_factory=Counter)

    @property
    def rejected(self) -> int:
        return self.entry + self.late

    def attain(self) -> float:
        admitted = self.offered - self.rejected
        return self.ok / admitted if admitted else math.nan

    def attain_strict(self) -> float:
        admitted = self.offered - self.entry
        return self.ok / admitted if admitted else math.nan


def tabulate(
    outcomes: Iterable[Outcome], scenario: Scenario, start_s: float, end_s: float
) -> dict[str, ClassRow]:
    rows = {cls: ClassRow() for cls in CLASSES}
    for o in outcomes:
        if not start_s <= o.t_sched < end_s:
            continue
        row = rows[o.cls]
        row.offered += 1
        k = kind(o)
        if k == "ok":
            row.ok += 1
            fallback = o.approximation == "fallback"
            row.fallback += fallback
            row.reduced += o.approximation == "reduced_output"
            row.useful_ms += scenario.device_ms(FALLBACK if fallback else PRIMARY, o.cls)
            continue
        row.rules[reason(o)] += 1
        if k in ("entry", "late"):
            setattr(row, k, getattr(row, k) + 1)
            row.reject_ms.append(o.latency_ms)
            if k == "entry":
                row.entry_ms.append(o.latency_ms)
        else:
            row.missed += 1
            row.missed_price_ms.append(scenario.device_ms(PRIMARY, o.cls))
            deadline = scenario.deadline_ms(o.cls)
            if o.code == "DEADLINE_EXCEEDED" and o.latency_ms >= deadline - 1.0:
                row.caller_timeouts += 1
    return rows


@dataclass
class Waste:
    busy_ms: dict[str, float]  # model -> instance-held ms in the window
    executed: dict[str, int]
    batches: dict[str, int]
    not_on_time: int  # executed requests that reached no caller in time
    wasted_ms: float

    def mean_batch(self, model: str) -> float:
        return self.executed[model] / self.batches[model] if self.batches.get(model) else 0.0


def device_time(
    snapshots: Sequence[StatsSnapshot], start_s: float, end_s: float
) -> tuple[dict[str, float], dict[str, int], dict[str, int]] | None:
    """Deltas of Triton's counters over [start_s, end_s], summed per epoch (restarts reset them)."""
    inside = [s for s in snapshots if start_s - 1e-6 <= s.t <= end_s + 1e-6]
    if not inside or abs(inside[0].t - start_s) > 1e-6 or abs(inside[-1].t - end_s) > 1e-6:
        return None
    busy: defaultdict[str, float] = defaultdict(float)
    executed: defaultdict[str, int] = defaultdict(int)
    batches: defaultdict[str, int] = defaultdict(int)
    for before, after in itertools.pairwise(inside):
        if before.epoch != after.epoch:
            continue
        for model in (PRIMARY, FALLBACK):
            busy[model] += after.busy_ms.get(model, 0.0) - before.busy_ms.get(model, 0.0)
            executed[model] += after.executed.get(model, 0) - before.executed.get(model, 0)
            batches[model] += after.batches.get(model, 0) - before.batches.get(model, 0)
    return dict(busy), dict(executed), dict(batches)


def waste(
    snapshots: Sequence[StatsSnapshot],
    outcomes: Sequence[Outcome],
    scenario: Scenario,
    start_s: float,
    end_s: float,
) -> Waste | None:
    """Busy device time apportioned between on-time and not-on-time executions by their
    batch-of-one prices (see the module docstring)."""
    counters = device_time(snapshots, start_s, end_s)
    if counters is None:
        return None
    busy, executed, batches = counters
    window = [o for o in outcomes if start_s <= o.t_sched < end_s]
    missed = [o for o in window if kind(o) == "missed"] or window
    wasted, not_on_time = 0.0, 0
    for model in (PRIMARY, FALLBACK):
        on_time = [o for o in window if o.code == "OK" and (o.model or PRIMARY) == model]
        extra = max(0, executed.get(model, 0) - len(on_time))
        not_on_time += extra
        if not busy.get(model):
            continue
        useful_price = sum(scenario.device_ms(model, o.cls) for o in on_time)
        extra_price = (
            extra * statistics.fmean(scenario.device_ms(model, o.cls) for o in missed) if missed else 0.0
        )
        if useful_price + extra_price > 0:
            wasted += busy[model] * extra_price / (useful_price + extra_price)
    return Waste(busy, executed, batches, not_on_time, wasted)


@dataclass
class PhaseReport:
    phase: Phase
    rows: dict[str, ClassRow]
    waste: Waste | None


def analyse(result: RunResult, scenario: Scenario) -> list[PhaseReport]:
    return [
        PhaseReport(
            phase,
            tabulate(result.outcomes, scenario, phase.start_s, phase.end_s),
            waste(result.snapshots, result.outcomes, scenario, phase.start_s, phase.end_s),
        )
        for phase in scenario.phases
    ]


def step_at(ladder: Sequence[tuple[float, int]], t: float) -> int:
    step = 0
    for at, value in ladder:
        if at <= t:
            step = value
    return step


# --------------------------------------------------------------------------- printing


def _pct(x: float) -> str:
    return "  n/a" if math.isnan(x) else f"{100 * x:5.1f}"


def _med(values: Sequence[float]) -> str:
    return f"{statistics.median(values):6.1f}" if values else "     -"


def print_phase_tables(results: dict[str, RunResult], reports: dict[str, list[PhaseReport]]) -> None:
    names = list(results)
    for index, phase in enumerate(next(iter(reports.values()))):
        p = phase.phase
        print(f"\n== {p.name}: {p.start_s:.0f}-{p.end_s:.0f} s, arrivals x{p.multiplier:g} ==")
        print(
            f"{'target':<13} {'class':<5} {'offer/s':>7} {'good/s':>6} {'attain%':>7} {'attain*%':>8} "
            f"{'fallbk%':>7} {'reduc%':>6} {'rej%':>5} {'entry%':>6} {'late%':>5} "
            f"{'rej p50 ms':>10} {'entry p50':>9} "
            f"{'missed%':>7} {'timeout':>7}"
        )
        for name in names:
            rows = reports[name][index].rows
            for cls in CLASSES:
                r = rows[cls]
                n = max(1, r.offered)
                print(
                    f"{name:<13} {cls:<5} {r.offered / p.duration_s:7.1f} {r.ok / p.duration_s:6.1f} "
                    f"{_pct(r.attain()):>7} {_pct(r.attain_strict()):>8} {_pct(r.fallback / n):>7} "
                    f"{_pct(r.reduced / n):>6} "
                    f"{_pct(r.rejected / n):>5} {_pct(r.entry / n):>6} {_pct(r.late / n):>5} "
                    f"{_med(r.reject_ms):>10} {_med(r.entry_ms):>9} {_pct(r.missed / n):>7} "
                    f"{r.caller_timeouts:7d}"
                )
        print(
            f"{'target':<13} {'busy full ms/s':>14} {'busy compact':>12} {'batch full':>10} "
            f"{'executed late':>13} {'wasted ms/s':>11} {'% protected':>11}  rules/statuses of non-ok"
        )
        for name in names:
            report = reports[name][index]
            w = report.waste
            rules: Counter[str] = Counter()
            for r in report.rows.values():
                rules.update(r.rules)
            top = ", ".join(f"{k} {v}" for k, v in rules.most_common(4))
            if w is None:
                print(f"{name:<13} {'(Triton statistics unavailable for this window)':>60}  {top}")
                continue
            d = p.duration_s
            protected = PROTECTED_UTILIZATION * 1000.0 * 4
            print(
                f"{name:<13} {w.busy_ms.get(PRIMARY, 0.0) / d:14.0f} "
                f"{w.busy_ms.get(FALLBACK, 0.0) / d:12.0f} "
                f"{w.mean_batch(PRIMARY):10.2f} {w.not_on_time:13d} {w.wasted_ms / d:11.1f} "
                f"{100 * w.wasted_ms / d / protected:11.2f}  {top}"
            )


def ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}x" if b > 0 else "   inf"


def print_ratios(reports: dict[str, list[PhaseReport]]) -> None:
    if "gateway" not in reports:
        return
    print("\n== goodput ratios: gateway / baseline (on-time completions, fallback included) ==")
    print(f"{'phase':<9} {'class':<11} " + " ".join(f"{'vs ' + b:>16}" for b in TARGETS[:2] if b in reports))
    for index, phase in enumerate(reports["gateway"]):
        for cls in (*CLASSES, "interactive"):

            def ok(name: str, cls: str = cls, index: int = index) -> int:
                rows = reports[name][index].rows
                return sum(rows[c].ok for c in CLASSES) if cls == "interactive" else rows[cls].ok

            cells = [f"{ratio(ok('gateway'), ok(b)):>16}" for b in TARGETS[:2] if b in reports]
            print(f"{phase.phase.name:<9} {cls:<11} " + " ".join(cells))


def print_arithmetic(
    scenario: Scenario, sheet: dict[str, float], reports: dict[str, list[PhaseReport]]
) -> None:
    f = scenario.time_factor
    print("\n== the seed's arithmetic on this fleet (4 x full-v18, time factor f) vs measured ==")
    print(
        f"prices (device-ms, batch of one): short {scenario.device_ms(PRIMARY, 'short'):.1f} on full / "
        f"{scenario.device_ms(FALLBACK, 'short'):.1f} on compact; "
        f"long {scenario.device_ms(PRIMARY, 'long'):.1f} / {scenario.device_ms(FALLBACK, 'long'):.1f}"
        f"  (seed x {f:g})"
    )
    print(
        f"rates at 1x: short {scenario.rate('short'):.2f}/s, long {scenario.rate('long'):.2f}/s "
        f"(seed 140/18 x {scenario.fleet}/{scenario.seed_fleet} devices / f); "
        f"deadlines short {scenario.deadline_ms('short'):.0f} ms, long {scenario.deadline_ms('long'):.0f} ms"
    )
    protected = scenario.protected_ms_per_s
    print(f"protected envelope: {scenario.fleet} x 0.70 x 1000 = {protected:.0f} device-ms/s")
    print(
        f"modeled: normal demand {sheet['execution.offered_demand']:.1f} ms/s = "
        f"{sheet['execution.protected_pct']:.2f} %; surge {sheet['overload.surge_demand']:.1f} ms/s = "
        f"{sheet['overload.surge_pct']:.2f} %; fallback 60 % short / 50 % long saves "
        f"{sheet['overload.fallback_saving']:.1f} ms/s -> {sheet['overload.remaining_demand']:.1f} ms/s = "
        f"{sheet['overload.remaining_pct']:.2f} %"
    )
    for name, phases in reports.items():
        for report in phases:
            p = report.phase
            offered = (
                sum(report.rows[c].offered * scenario.device_ms(PRIMARY, c) for c in CLASSES) / p.duration_s
            )
            line = (
                f"measured {name:<13} {p.name:<8}: "
                f"offered {offered:7.1f} ms/s = {100 * offered / protected:6.2f} %"
            )
            if name.startswith("gateway"):
                rows = report.rows
                shares = " / ".join(
                    f"{c} {_pct(rows[c].fallback / max(1, rows[c].offered)).strip()} %" for c in CLASSES
                )
                saving = (
                    sum(
                        rows[c].fallback * (scenario.device_ms(PRIMARY, c) - scenario.device_ms(FALLBACK, c))
                        for c in CLASSES
                    )
                    / p.duration_s
                )
                line += f"; fallback share {shares}; saving {saving:6.1f} ms/s"
            if report.waste is not None:
                used = sum(report.waste.busy_ms.values()) / p.duration_s
                line += f"; devices busy {used:6.1f} ms/s"
            print(line)


def print_estimates(results: dict[str, RunResult], scenario: Scenario) -> None:
    """The gateway's predictions on its responses over its batch-of-one prices: its learned correction."""
    print("\n== gateway predictions / profile price (orchid.predicted_accelerator_ms on responses) ==")
    for name, result in results.items():
        if not name.startswith("gateway"):
            continue
        for phase in scenario.phases:
            cells = []
            for cls in CLASSES:
                for model in (PRIMARY, FALLBACK):
                    ratios = [
                        o.predicted_ms / scenario.device_ms(model, cls)
                        for o in result.outcomes
                        if o.code == "OK"
                        and o.cls == cls
                        and o.model == model
                        and phase.start_s <= o.t_sched < phase.end_s
                    ]
                    if ratios:
                        cells.append(
                            f"{cls}@{model} x{statistics.median(ratios):.2f} "
                            f"(max x{max(ratios):.2f}, n={len(ratios)})"
                        )
            print(f"{name:<13} {phase.name:<8}: " + ("; ".join(cells) or "no responses"))


def print_targets(scenario: Scenario, reports: dict[str, list[PhaseReport]]) -> None:
    if "gateway" not in reports:
        return
    gw = reports["gateway"]
    surge = 1
    print("\n== the issue's targets (gateway) ==")
    for index, report in enumerate(gw):
        ok = sum(report.rows[c].ok for c in CLASSES)
        strict = ok / max(1, sum(report.rows[c].offered - report.rows[c].entry for c in CLASSES))
        loose = ok / max(1, sum(report.rows[c].offered - report.rows[c].rejected for c in CLASSES))
        mark = "met" if strict >= 0.99 else "NOT met"
        print(
            f"admitted interactive within deadline, {report.phase.name:<8}: {100 * strict:6.2f} % "
            f"(late rejections as misses; {100 * loose:6.2f} % without them) -> target >= 99 %: {mark}"
        )
        del index
    for base in TARGETS[:2]:
        if base not in reports:
            continue
        g = sum(gw[surge].rows[c].ok for c in CLASSES)
        b = sum(reports[base][surge].rows[c].ok for c in CLASSES)
        value = g / b if b else math.inf
        mark = "met" if value >= 1.5 else "NOT met"
        print(f"surge interactive goodput vs {base:<12}: {value:5.2f}x -> target >= 1.5x: {mark}")
    wasted = [r.waste.wasted_ms for r in gw if r.waste is not None]
    if len(wasted) == len(gw):
        total_s = sum(r.phase.duration_s for r in gw)
        pct = 100 * sum(wasted) / (scenario.protected_ms_per_s * total_s)
        mark = "met" if pct <= 1.0 else "NOT met"
        print(
            f"wasted device-ms, whole run: {sum(wasted):.0f} ms = {pct:.2f} % of protected capacity "
            f"-> <= 1 %: {mark}"
        )


def print_kill(result: RunResult, scenario: Scenario) -> None:
    ev = result.events
    if "killed" not in ev:
        print("\n(kill run: the kill did not happen)")
        return
    killed, ready = ev["killed"], ev.get("triton_ready", math.nan)
    print(
        f"\n== {KILL_TARGET}: Triton SIGKILLed at {killed:.1f} s, "
        f"restart began {ev.get('restarting', math.nan):.1f} s, ready {ready:.1f} s =="
    )
    first_ok = min(
        (o.t_end for o in result.outcomes if o.code == "OK" and o.t_sent > ev.get("restarting", killed)),
        default=math.nan,
    )
    print(
        f"first OK answer after the restart at {first_ok:.2f} s "
        f"({first_ok - ready:+.2f} s after Triton ready)"
    )
    before = [o for o in result.outcomes if killed - 5 <= o.t_sched < killed]
    base = sum(o.code == "OK" for o in before) / 5.0
    print(f"goodput in the 5 s before the kill: {base:.1f}/s")
    print(
        f"{'second':>6} {'offer':>5} {'ok':>4} {'fallbk':>6} {'entry':>5} {'late':>4} {'missed':>6} "
        f"{'timeouts':>8} {'step':>4}  non-ok"
    )
    start, end = (
        int(killed) - 3,
        int(min(scenario.duration_s, (ready if not math.isnan(ready) else killed) + 10)),
    )
    recovered = math.nan
    for second in range(start, end):
        window = [o for o in result.outcomes if second <= o.t_sched < second + 1]
        counts = Counter(kind(o) for o in window)
        fallback = sum(o.approximation == "fallback" for o in window if o.code == "OK")
        timeouts = sum(
            o.code == "DEADLINE_EXCEEDED" and not o.rule and o.latency_ms >= scenario.deadline_ms(o.cls) - 1.0
            for o in window
        )
        reasons = Counter(reason(o) for o in window if o.code != "OK")
        top = ", ".join(f"{k} {v}" for k, v in reasons.most_common(3))
        print(
            f"{second:6d} {len(window):5d} {counts['ok']:4d} {fallback:6d} {counts['entry']:5d} "
            f"{counts['late']:4d} {counts['missed']:6d} {timeouts:8d} "
            f"{step_at(result.ladder, second + 1):4d}  {top}"
        )
        if math.isnan(recovered) and not math.isnan(ready) and second >= ready and counts["ok"] >= 0.9 * base:
            recovered = second + 1
    outage = [
        o for o in result.outcomes if killed <= o.t_sched < (ready if not math.isnan(ready) else killed)
    ]
    longest_s = max(scenario.deadline_ms(c) for c in CLASSES) / 1000.0
    around = (killed - longest_s, (ready if not math.isnan(ready) else killed) + 2.0)
    hung = [
        o
        for o in result.outcomes
        if o.code == "DEADLINE_EXCEEDED"
        and not o.rule
        and o.latency_ms >= scenario.deadline_ms(o.cls) - 1.0
        and around[0] <= o.t_sched < around[1]
    ]
    print(
        f"requests sent during the outage: {len(outage)}, answered before their deadline: "
        f"{sum(o.latency_ms < scenario.deadline_ms(o.cls) - 1.0 for o in outage)}; "
        f"answered by the server at all: {sum(o.code != 'DEADLINE_EXCEEDED' or bool(o.rule) for o in outage)}"
    )
    print(
        f"requests sent {around[0]:.1f}-{around[1]:.1f} s (in flight at the kill .. 2 s after Triton was "
        f"ready) that reached their deadline unanswered: {len(hung)}; max ladder step after the kill: "
        f"{max((s for t, s in result.ladder if t >= killed), default=step_at(result.ladder, killed))}"
    )
    print(
        f"goodput back to >= 90 % of pre-kill after: {recovered - ready:.1f} s from Triton ready"
        if not math.isnan(recovered)
        else "goodput did not recover to 90 % of pre-kill in the window"
    )


def implied_correction(result: RunResult, scenario: Scenario, t: float, why: str) -> str:
    """The gateway's offered demand at a ladder change over the same window's arrivals at profile
    prices: how much its learned correction (and the window's noise) moved the reading."""
    match = re.search(r"offered (\d+) ms/s", why)
    if match is None or t < DEMAND_WINDOW_S:
        return ""
    arrived = sum(
        scenario.device_ms(PRIMARY, o.cls) for o in result.outcomes if t - DEMAND_WINDOW_S <= o.t_sent < t
    )
    rate = arrived / DEMAND_WINDOW_S
    pct = 100 * rate / scenario.protected_ms_per_s
    return (
        f" [arrivals at profile prices: {rate:.0f} ms/s = {pct:.1f} %; x{float(match.group(1)) / rate:.2f}]"
    )


def print_client(results: dict[str, RunResult], scenario: Scenario) -> None:
    print("\n== client and runs ==")
    for name, result in results.items():
        lags = sorted(result.lags_ms)
        p99 = lags[int(0.99 * (len(lags) - 1))] if lags else 0.0
        steps = Counter(o.ladder_step for o in result.outcomes if o.ladder_step >= 0)
        ladder = " ".join(f"{t:.1f}s->{s}" for t, s in result.ladder) or "-"
        print(
            f"{name:<13} requests {len(result.outcomes):5d}  "
            f"send lag p99 {p99:5.1f} ms max {lags[-1] if lags else 0:6.1f} ms"
            f"  wall {result.wall_s:5.1f} s"
        )
        for note in result.notes:
            print(f"{'':<13} NOTE: {note}")
        if name.startswith("gateway"):
            print(f"{'':<13} ladder (full-v18 pool, from the log): {ladder}")
            print(f"{'':<13} orchid.ladder_step on responses: {dict(sorted(steps.items()))}")
            for t, step, why in result.ladder_log:
                implied = implied_correction(result, scenario, t, why)
                print(f"{'':<13}   {t:6.1f} s -> {step}: {why[:150]}{implied}")


# --------------------------------------------------------------------------- plot


def goodput_series(result: RunResult, cls: str | None, seconds: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    series = np.zeros(seconds)
    for o in result.outcomes:
        if o.code == "OK" and (cls is None or o.cls == cls) and 0 <= o.t_sched < seconds:
            series[int(o.t_sched)] += 1
    return series


def offered_series(result: RunResult, cls: str | None, seconds: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    series = np.zeros(seconds)
    for o in result.outcomes:
        if (cls is None or o.cls == cls) and 0 <= o.t_sched < seconds:
            series[int(o.t_sched)] += 1
    return series


def plot(results: dict[str, RunResult], scenario: Scenario, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n(matplotlib is not installed: no plot; `pip install matplotlib` for {path})")
        return False
    seconds = math.ceil(scenario.duration_s)
    x = np.arange(seconds) + 0.5
    panels: list[tuple[str, str | None, list[str]]] = [
        (f"short requests (deadline {scenario.deadline_ms('short'):.0f} ms)", "short", list(TARGETS)),
        (f"long requests (deadline {scenario.deadline_ms('long'):.0f} ms)", "long", list(TARGETS)),
    ]
    if KILL_TARGET in results:
        panels.append(("gateway, Triton killed during the surge: all requests", None, [KILL_TARGET]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.4 * len(panels)), sharex=True, squeeze=False)
    colors = {
        "triton-fifo": "#d62728",
        "triton-tuned": "#ff7f0e",
        "gateway": "#1f77b4",
        KILL_TARGET: "#1f77b4",
    }
    surge = scenario.phases[1]
    for ax, (title, cls, names) in zip(axes[:, 0], panels, strict=True):
        ax.axvspan(surge.start_s, surge.end_s, color="0.92", zorder=0)
        reference = results[names[0]] if names[0] in results else next(iter(results.values()))
        ax.plot(x, offered_series(reference, cls, seconds), color="0.45", ls="--", lw=1.2, label="offered")
        ladder_owner = "gateway" if cls is not None else KILL_TARGET
        for name in names:
            if name not in results:
                continue
            ax.plot(x, goodput_series(results[name], cls, seconds), color=colors[name], lw=1.8, label=name)
            if name.startswith("gateway"):
                fallback = np.zeros(seconds)
                for o in results[name].outcomes:
                    wanted = (
                        o.code == "OK" and o.approximation == "fallback" and (cls is None or o.cls == cls)
                    )
                    if wanted and 0 <= o.t_sched < seconds:
                        fallback[int(o.t_sched)] += 1
                ax.fill_between(
                    x, 0, fallback, color=colors[name], alpha=0.18, label=f"{name}: of which fallback"
                )
        events = results[names[0]].events if names[0] in results else {}
        for key, style in (("killed", "-"), ("triton_ready", ":")):
            if key in events:
                ax.axvline(events[key], color="k", ls=style, lw=1.0)
                ax.text(
                    events[key] + 0.2,
                    0.97,
                    key.replace("_", " "),
                    transform=ax.get_xaxis_transform(),
                    va="top",
                    fontsize=8,
                )
        ax.set_ylabel("on-time completions / s")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10, loc="left")
        if ladder_owner in results:
            twin = ax.twinx()
            ladder = results[ladder_owner].ladder
            steps = [step_at(ladder, t) for t in np.arange(0, seconds, 0.1)]
            twin.step(np.arange(0, seconds, 0.1), steps, where="post", color="#2ca02c", lw=1.3, alpha=0.9)
            twin.set_ylim(-0.2, 6.5)
            twin.set_yticks(range(7))
            twin.set_ylabel(f"{ladder_owner} ladder step", color="#2ca02c")
            twin.tick_params(axis="y", colors="#2ca02c")
        ax.legend(loc="lower left", fontsize=8, ncol=3, framealpha=0.9)
    axes[-1, 0].set_xlabel(
        f"seconds (grey: surge x{scenario.surge_factor:g}); bins of 1 s by send time; "
        f"time factor {scenario.time_factor:g}"
    )
    fig.suptitle(
        "orchid-gateway vs Triton direct under a 1.25x surge (seed's Orchid mix, 4 emulated devices)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def parse_setting(item: str) -> tuple[str, float]:
    key, _, value = item.partition("=")
    return key.strip(), float(value)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--time-factor", type=float, default=0.5, help="ORCHID_TIME_FACTOR (default 0.5)")
    parser.add_argument("--normal-s", type=float, default=20.0)
    parser.add_argument("--surge-s", type=float, default=30.0)
    parser.add_argument("--recover-s", type=float, default=10.0)
    parser.add_argument("--surge-factor", type=float, default=1.25)
    parser.add_argument(
        "--seed", type=int, default=20260, help="arrival schedule seed (same for every target)"
    )
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument(
        "--kill-at",
        type=float,
        default=-1.0,
        help="seconds into the run to SIGKILL the gateway's Triton in a 4th run "
        "(default: 1/3 into the surge; 0: no kill run)",
    )
    parser.add_argument(
        "--kill-for", type=float, default=3.0, help="seconds Triton stays down before its restart"
    )
    parser.add_argument(
        "--tuned-queue-size",
        type=int,
        default=4,
        help="max_queue_size of the tuned Triton baseline (default 4: the best of a sweep)",
    )
    parser.add_argument("--base-port", type=int, default=16100, help="ports BASE+1..BASE+8 are used")
    parser.add_argument(
        "--gateway-inflight",
        type=int,
        default=None,
        help="diagnostic: the gateway backend's max_inflight_per_device (default: the example config's)",
    )
    parser.add_argument(
        "--gateway-ladder",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="diagnostic: a `ladder:` setting of the gateway config, e.g. reject_interactive_at=1.5",
    )
    parser.add_argument(
        "--fallback-devices",
        choices=("shared", "own"),
        default="shared",
        help="shared (default): compact-v11 runs on full-v18's 4 emulated devices, one instance of "
        "each per device, as the seed models the fallback, and the gateway is told "
        "(`shared_devices: true`); own: compact-v11 keeps its 2 instances of its own (6 devices)",
    )
    parser.add_argument("--keep", action="store_true", help="keep Triton and gateway logs (prints where)")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "surge.png")
    parser.add_argument(
        "--gateway-pythonpath",
        default=None,
        help="PYTHONPATH for the gateway process (e.g. a `git archive` snapshot); default: this checkout",
    )
    return parser.parse_args(argv)


async def run_all(opts: Options, targets: Sequence[str]) -> dict[str, RunResult]:
    results: dict[str, RunResult] = {}
    for target in targets:
        print(f"running {target} ...", file=sys.stderr, flush=True)
        results[target] = await run_target(target, opts)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prices = load_prices()
    scenario = Scenario(
        time_factor=args.time_factor,
        seed_rates={"short": 140.0, "long": 18.0},
        seed_fleet=seed_fleet(),
        fleet=4,
        surge_factor=args.surge_factor,
        normal_s=args.normal_s,
        surge_s=args.surge_s,
        recover_s=args.recover_s,
        prices=prices,
    )
    rates = {cls: scenario.rate(cls) for cls in CLASSES}
    arrivals = poisson_schedule(scenario.phases, rates, args.seed)
    warmup = poisson_schedule((Phase("warm-up", 0.0, 3.0, 0.5),), rates, args.seed + 1)
    kill_at = args.kill_at if args.kill_at >= 0 else args.normal_s + args.surge_s / 3.0
    targets = list(args.targets) + ([KILL_TARGET] if kill_at > 0 else [])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="orchid-surge-") as tmp:
        if args.keep:
            tmp = tempfile.mkdtemp(prefix="orchid-surge-keep-")
            print(f"work directory (kept): {tmp}", file=sys.stderr)
        opts = Options(
            scenario=scenario,
            arrivals=arrivals,
            warmup=warmup,
            workdir=Path(tmp),
            base_port=args.base_port,
            tuned_queue_size=args.tuned_queue_size,
            kill_at=kill_at,
            kill_for=args.kill_for,
            gateway_pythonpath=args.gateway_pythonpath,
            gateway_inflight=args.gateway_inflight,
            gateway_ladder=dict(parse_setting(item) for item in args.gateway_ladder) or None,
            shared_devices=args.fallback_devices == "shared",
        )
        results = asyncio.run(run_all(opts, targets))
    print(
        f"surge benchmark: time factor {scenario.time_factor:g}, seed {args.seed}, "
        f"{len(arrivals)} requests per target, "
        f"phases {args.normal_s:g}/{args.surge_s:g}/{args.recover_s:g} s, "
        f"tuned max_queue_size {args.tuned_queue_size}, total wall {time.monotonic() - started:.0f} s"
    )
    if args.fallback_devices == "shared":
        print(
            f"shared devices: {FALLBACK} runs on the same {scenario.fleet} emulated devices as "
            f"{PRIMARY} (one instance of each per device); busy ms/s below add up on those devices"
        )
    reports = {name: analyse(result, scenario) for name, result in results.items()}
    main_reports = {k: v for k, v in reports.items() if k != KILL_TARGET}
    print_phase_tables({k: v for k, v in results.items() if k != KILL_TARGET}, main_reports)
    print_ratios(main_reports)
    print_arithmetic(scenario, scaled_worksheet(scenario), main_reports)
    print_estimates(results, scenario)
    print_targets(scenario, main_reports)
    if KILL_TARGET in results:
        print_phase_tables({KILL_TARGET: results[KILL_TARGET]}, {KILL_TARGET: reports[KILL_TARGET]})
        print_kill(results[KILL_TARGET], scenario)
    print_client(results, scenario)
    if plot(results, scenario, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
