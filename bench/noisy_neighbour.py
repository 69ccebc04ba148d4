"""Noisy-neighbour benchmark: one tenant floods the shared pool, does the other keep its service?

What it measures
    Two tenants of the example stack share ``full-v18``'s pool of 4 instances (= 4 emulated
    devices). ``orchid`` (weight 2) sends a steady stream well inside the pool's capacity for
    the whole run; ``lumen`` (weight 1) floods the same model at several times the pool's
    raw capacity for a while. The same arrival schedule (same seed) is run against two
    targets, one after the other, each on a fresh Triton:

    * ``gateway``       clients -> ``orchid-gateway serve`` (the example config's classes and
                        limits, the repository's tenants, routes and policies, as
                        bench/surge.py configures it) -> Triton on ``examples/orchid/model_repository``
                        as shipped (``compact-v11``, the fallback, on its own 2 instances);
    * ``triton-tuned``  both tenants' requests straight to Triton on a copy of that
                        repository with a queue policy (``max_queue_size``
                        ``--tuned-queue-size``, default 4, and every request's ``timeout``
                        = its latest start = deadline - price; surge.py's tuned target):
                        the strongest isolation Triton alone offers (it has no tenants).

    Per target, tenant and phase (``before`` the flood, ``flood``, ``after``): requests
    offered, answered on time, on time at full quality, degraded, rejected early (with the
    median time-to-refusal and the share of those refusals carrying ``retry-after-ms``),
    rejected late, missed; the accelerator-ms each tenant was served against its weighted
    share of the pool; then the issue's targets with PASS/FAIL, and a plot.

Scenario (``--time-factor`` f, default 1.0: the seed's own time)
    * Pool: ``full-v18``, 4 instances, raw capacity 4 x 1,000 device-ms/s. A request is
      256 input / 64 output tokens, priced from the route's demand profile
      (``routes/orchid.yaml`` via ``gateway.config.load_routes``: 56.8 accelerator-ms); the
      emulator holds a device for price x f, so the pool's raw capacity in these requests is
      4,000 / (56.8 f) req/s (70.4 at f = 1).
    * ``orchid`` (key ``orchid-demo-key-orchid``): Poisson arrivals at ``--orchid-load``
      (35 %) of that raw capacity, class ``interactive``, the whole run.
    * ``lumen`` (key ``orchid-demo-key-lumen``): Poisson arrivals at ``--flood-factor``
      (2.75x) the raw capacity, same shape and class, for ``--flood-s`` (30 s) after a quiet
      lead-in of ``--before-s`` (5 s), followed by ``--after-s`` (10 s) of orchid alone.
    * Deadline: 200 ms x f for both tenants; the gRPC deadline (``client_timeout``) *is* the
      request deadline, what the caller waits and what propagates to the gateway and Triton.
    * Scaling as in ``bench/surge.py``: rates are divided by f, deadlines, prices and the
      gateway's class reserves (``R_up``, ``R_fail``, ``max_dwell``, default deadlines) are
      multiplied by f, the gateway's backend declares ``time_scale: f``. Phase lengths are
      wall-clock seconds and are not scaled (nor are the ladder's 10 s window and 2 s hold).
      Tenant quotas (``tenants.yaml``, accelerator-ms/s) are not scaled: at f != 1 they are
      f times looser or tighter than at f = 1.
    * Weights (2 : 1) are read from ``examples/orchid/tenants.yaml``. Weighted share of a
      tenant = its weight / the sum of both weights x the pool's raw capacity.
    * Each target first gets two rounds of one concurrent request per instance directly at
      Triton (the first execute of an instance is slow) and ``--warmup-s`` (2 s) of orchid's
      stream through the target (not measured).

Client
    Open loop, as in ``bench/surge.py``: every request is sent at its scheduled time
    (numpy ``default_rng(--seed)``: Poisson counts, uniform times per phase) whatever is
    outstanding, from one asyncio process, one ``grpc.aio`` channel per tenant, requests
    serialized once (raw bytes in and out; the gateway's responses are parsed for
    provenance). Gateway requests carry ``authorization: Bearer <key>``, ``orchid.class =
    interactive`` and ``orchid.max_output_tokens = 64``; direct requests Triton's
    ``max_output_tokens`` and ``timeout``. Send lag (actual - scheduled) is reported.

Outcome of a request (``bench/surge.py``'s classification, its ``kind``)
    * ``on time``: an answer before the deadline (it cannot come later: the deadline is the
      gRPC deadline). ``full quality``: on time with provenance ``orchid.approximation ==
      none`` (every Triton-direct answer is full quality). ``degraded``: on time with
      ``fallback`` (answered by ``compact-v11``) or ``reduced_output`` (ladder step 2 capped
      the output at the route's reduced length).
    * ``rejected early``: refused without queueing: any gateway refusal whose ``orchid-rule``
      is not ``queue.latest_start`` (admission, quota, shedding, infeasible slack), "no
      healthy backend serves model"; Triton's ``Exceeds maximum queue size``. Its time to
      refusal is send -> error; ``retry-after`` = the share of them whose trailing metadata
      held ``retry-after-ms``.
    * ``rejected late``: refused after waiting in a queue: the gateway's
      ``queue.latest_start``; Triton's ``Request timeout expired``.
    * ``missed``: anything else, above all the caller's own deadline expiring unanswered.

Accelerator-ms served (per phase, shown per second)
    Each on-time answer is charged its profile price (batch of one) x f on the model that
    answered: ``full-v18`` at the output it produced (64 tokens, or the route's reduced
    output for ``reduced_output``) counts against the pool; ``fallback`` answers ran on
    ``compact-v11``'s own instances, outside the pool, and are shown separately. This is
    the unit of the pool's capacity above (4,000 ms/s = 4 devices' raw time at these
    prices) and of the tenants' quotas. Work whose caller got nothing is not "served".
    Where Triton's dynamic batcher runs several requests in one batch (they share the
    decode) the priced work served can exceed the devices' wall time: Triton's own
    ``batch_stats`` busy time of the pool is printed beside it, and ``lumen busy~`` = that
    busy time x lumen's part of the priced work served (an upper bound on lumen's device
    time). The flooder's allowance is its weighted share plus idle capacity: the part of
    orchid's weighted share that orchid did not use (served), i.e. while orchid stays under
    its share, the capacity not used by orchid. A stricter variant, counting all of
    orchid's *offered* demand as used (refused orchid work was not idle capacity), and the
    same rule applied to the ladder's protected envelope (70 % of the raw capacity) instead
    of the raw capacity are printed beside it in the targets block.

Targets (flood phase; printed per target with the measured values)
    orchid on time >= 95 % of its requests; orchid on time at full quality >= 90 %;
    lumen's early refusals: median time to refusal <= 10 ms, and every one carries
    ``retry-after-ms``; lumen served (pool) <= its share + idle capacity.

Ladder step
    From the gateway's log (``orchid.overload`` "pool ... ladder step -> N" warnings) for
    the ``full-v18`` pool, as ``bench/surge.py`` parses it.

Run (about 2.5 minutes on 2 cores, Triton and gateway startup included)::

    python bench/noisy_neighbour.py                          # plot docs/img/noisy-neighbour.png
    python bench/noisy_neighbour.py --before-s 2 --flood-s 6 --after-s 2   # quick look
    python bench/noisy_neighbour.py --targets gateway --keep  # keep configs and logs

Ports ``--base-port`` (default 16500) +1 (tuned Triton), +2 (the gateway's Triton) and +8
(gateway). Everything started is stopped on exit (Ctrl-C and SIGTERM included).
Needs matplotlib for the plot (without it the plot is skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from tritonclient.grpc import service_pb2

# bench/surge.py (beside this file) provides the gateway process, the outcome classification,
# Triton's statistics and the ladder log parser; the rest is local because surge.py evolves.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from surge import (
    EXAMPLES,
    FALLBACK,
    INFER,
    PRIMARY,
    PROTECTED_UTILIZATION,
    REPO,
    SEED_DEADLINE_MS,
    SHAPES,
    Outcome,
    StatsSnapshot,
    classify_error,
    copy_repository,
    device_time,
    fetch_stats,
    kind,
    parse_ladder,
    reason,
    step_at,
)

from gateway.backends.local import LocalTriton
from gateway.config import load_routes
from orchid_tools.harness import (
    GatewayProcess,
    example_backend,
    example_config,
    example_settings,
    scaled_classes,
    send_open_loop,
)
from orchid_tools.simulate import degradation  # "fallback,reduced_output" counts as fallback

SHAPE = "short"  # bench/surge.py's SHAPES key: 256 input / 64 output tokens
TENANTS = ("orchid", "lumen")
KEYS = {"orchid": "orchid-demo-key-orchid", "lumen": "orchid-demo-key-lumen"}
TARGETS = ("gateway", "triton-tuned")
PORT_OFFSET = {"triton-tuned": 1, "gateway": 2}
GATEWAY_PORT_OFFSET = 8
# The thresholds.
ORCHID_ON_TIME = 0.95
ORCHID_FULL_QUALITY = 0.90
LUMEN_REFUSAL_MEDIAN_MS = 10.0


# --------------------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Scenario:
    time_factor: float
    devices: int  # full-v18 instances in the shipped repository = emulated devices of the pool
    price_ms: float  # profile price of one 256/64 request on full-v18 (time factor 1)
    reduced_price_ms: float  # the same with the route's reduced output (ladder step 2)
    fallback_price_ms: float  # on compact-v11
    weights: dict[str, float]
    orchid_load: float  # share of the pool's raw capacity
    flood_factor: float  # multiple of the pool's raw capacity
    before_s: float
    flood_s: float
    after_s: float

    @property
    def capacity_ms_per_s(self) -> float:
        """The pool's raw device time: devices x 1,000 ms/s (whatever f: f scales prices)."""
        return self.devices * 1000.0

    def device_ms(self, price_ms: float) -> float:
        return price_ms * self.time_factor

    @property
    def capacity_rps(self) -> float:
        """The pool's raw capacity in 256/64 requests per second."""
        return self.capacity_ms_per_s / self.device_ms(self.price_ms)

    def rate(self, tenant: str) -> float:
        return self.capacity_rps * (self.orchid_load if tenant == "orchid" else self.flood_factor)

    @property
    def deadline_ms(self) -> float:
        return SEED_DEADLINE_MS[SHAPE] * self.time_factor

    def share_ms_per_s(self, tenant: str) -> float:
        return self.capacity_ms_per_s * self.weights[tenant] / sum(self.weights.values())

    @property
    def phases(self) -> tuple[Phase, ...]:
        a, b = self.before_s, self.before_s + self.flood_s
        phases = (Phase("before", 0.0, a), Phase("flood", a, b), Phase("after", b, b + self.after_s))
        return tuple(p for p in phases if p.duration_s > 0)

    @property
    def flood(self) -> Phase:
        return Phase("flood", self.before_s, self.before_s + self.flood_s)

    @property
    def duration_s(self) -> float:
        return self.before_s + self.flood_s + self.after_s

    @property
    def latest_start_us(self) -> int:
        """Triton's ``timeout`` for triton-tuned: the deadline minus the price, in microseconds."""
        return max(1, int((self.deadline_ms - self.device_ms(self.price_ms)) * 1000))


def build_scenario(args: argparse.Namespace) -> Scenario:
    routes = load_routes(REPO / "routes")
    route = routes.models[PRIMARY]
    tokens, output = SHAPES[SHAPE]
    primary = routes.profiles[route.profile]
    fallback_route = routes.models[route.fallback] if route.fallback else routes.models[FALLBACK]
    reduced = route.reduced_output.max_output_tokens if route.reduced_output else output
    tenants = yaml.safe_load((EXAMPLES / "tenants.yaml").read_text())["tenants"]
    return Scenario(
        time_factor=args.time_factor,
        devices=instance_counts(EXAMPLES / "model_repository")[PRIMARY],
        price_ms=primary.accelerator_ms(tokens, output),
        reduced_price_ms=primary.accelerator_ms(tokens, min(reduced, output)),
        fallback_price_ms=routes.profiles[fallback_route.profile].accelerator_ms(tokens, output),
        weights={t: float(tenants[t].get("weight", 1)) for t in TENANTS},
        orchid_load=args.orchid_load,
        flood_factor=args.flood_factor,
        before_s=args.before_s,
        flood_s=args.flood_s,
        after_s=args.after_s,
    )


@dataclass(frozen=True, slots=True)
class Arrival:
    t: float  # seconds after the run's start
    tenant: str


def schedule(scenario: Scenario, seed: int, *, warmup_s: float = 0.0) -> list[Arrival]:
    """Poisson arrivals: orchid over the whole run, lumen during the flood (or, for the
    warm-up, orchid alone for ``warmup_s``)."""
    rng = np.random.default_rng(seed)
    windows = (
        [("orchid", 0.0, warmup_s)]
        if warmup_s
        else [("orchid", 0.0, scenario.duration_s), ("lumen", scenario.flood.start_s, scenario.flood.end_s)]
    )
    arrivals: list[Arrival] = []
    for tenant, start, end in windows:
        count = int(rng.poisson(scenario.rate(tenant) * (end - start)))
        arrivals.extend(Arrival(float(t), tenant) for t in rng.uniform(start, end, size=count))
    arrivals.sort(key=lambda a: a.t)
    return arrivals


# --------------------------------------------------------------------------- requests and stacks


def build_request(target: str, scenario: Scenario, model: str = PRIMARY) -> bytes:
    """One 256/64 ModelInfer request, serialized: the gateway's hints, or Triton's own
    parameters (triton-tuned: ``timeout`` = the latest start)."""
    tokens, output = SHAPES[SHAPE]
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "INPUT_IDS", "INT32"
    tensor.shape.extend([1, tokens])
    request.raw_input_contents.append(np.arange(tokens, dtype="<i4").tobytes())
    request.outputs.add().name = "OUTPUT_IDS"
    if target == "gateway":
        request.parameters["orchid.class"].string_param = "interactive"
        request.parameters["orchid.max_output_tokens"].int64_param = output
    else:
        request.parameters["max_output_tokens"].int64_param = output
    if target == "triton-tuned" and model == PRIMARY:
        request.parameters["timeout"].int64_param = scenario.latest_start_us
    data: bytes = request.SerializeToString()
    return data


def tuned_repository(scenario: Scenario, into: Path, max_queue_size: int) -> Path:
    """A copy of the example repository with a queue policy on full-v18 and compact-v11
    (bench/surge.py's tuned target: reject on timeout, per-request timeout allowed)."""
    copy_repository(into)
    policy = (
        "dynamic_batching { max_queue_delay_microseconds: 0 default_queue_policy { "
        f"timeout_action: REJECT default_timeout_microseconds: {scenario.latest_start_us} "
        f"allow_timeout_override: true max_queue_size: {max_queue_size} }} }}"
    )
    for model in (PRIMARY, FALLBACK):
        path = into / "model_repository" / model / "config.pbtxt"
        text, count = re.subn(r"dynamic_batching \{[^}]*\}", policy, path.read_text())
        if count != 1:
            raise RuntimeError(f"{path}: expected one dynamic_batching block")
        path.write_text(text)
    return into / "model_repository"


def gateway_config(scenario: Scenario, triton_address: str, listen: str) -> dict[str, Any]:
    """The example gateway config (classes, limits) with the repository's tenants, routes and
    policies, the local Triton as a ``backends:`` entry (time_scale f) and the classes' time
    constants scaled by f (as bench/surge.py builds it)."""
    f = scenario.time_factor
    return example_config(
        [example_backend("noisy", triton_address, f)],
        without=("jobs",),
        listen=listen,
        classes=scaled_classes(f),
        limits={**example_settings().get("limits", {}), "drain_timeout_s": 2},
    )


def instance_counts(repository: Path) -> dict[str, int]:
    counts = {}
    for model in (PRIMARY, FALLBACK):
        match = re.search(r"count: (\d+)", (repository / model / "config.pbtxt").read_text())
        counts[model] = int(match.group(1)) if match else 1
    return counts


async def warm_instances(address: str, scenario: Scenario, repository: Path) -> None:
    """Two rounds of one concurrent request per instance, on both models, straight at Triton:
    the first execute of an instance is slow (~40 ms) and must not land in the measurement."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for model, instances in instance_counts(repository).items():
            raw = build_request("triton-fifo", scenario, model)
            for _ in range(2):  # a small tuned queue may refuse some: that is fine here
                await asyncio.gather(
                    *(call(raw, timeout=10.0) for _ in range(instances)), return_exceptions=True
                )


# --------------------------------------------------------------------------- client


@dataclass(slots=True)
class TenantOutcome(Outcome):
    """bench/surge.py's Outcome with ``cls`` = the tenant, plus the refusal's ``retry-after-ms``."""

    retry_after_ms: int = -1  # -1: none in the trailing metadata


def retry_after(error: grpc.aio.AioRpcError) -> int:
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            with contextlib.suppress(ValueError):
                return int(value if isinstance(value, str) else value.decode())
            return 0
    return -1


async def drive(
    address: str,
    arrivals: Sequence[Arrival],
    payload: bytes,
    deadline_s: float,
    *,
    gateway: bool,
    hooks: Sequence[tuple[float, Callable[[], Awaitable[None]]]] = (),
) -> tuple[list[TenantOutcome], list[float], float]:
    """Send ``arrivals`` open-loop, one channel per tenant; outcomes, send lags (ms), start."""
    loop = asyncio.get_running_loop()
    outcomes: list[TenantOutcome] = []
    lags: list[float] = []
    channels = {tenant: grpc.aio.insecure_channel(address) for tenant in TENANTS}
    try:
        calls = {tenant: channel.unary_unary(INFER) for tenant, channel in channels.items()}
        metadata = {t: (("authorization", f"Bearer {KEYS[t]}"),) if gateway else None for t in TENANTS}
        await asyncio.gather(*(channel.channel_ready() for channel in channels.values()))
        t0 = loop.time() + 0.05

        async def one(arrival: Arrival) -> None:
            sent = loop.time()
            outcome = TenantOutcome(arrival.tenant, arrival.t, sent - t0, 0.0, "OK")
            try:
                raw = await calls[arrival.tenant](
                    payload, timeout=deadline_s, metadata=metadata[arrival.tenant]
                )
                outcome.t_end = loop.time() - t0
                if gateway:
                    params = service_pb2.ModelInferResponse.FromString(raw).parameters
                    outcome.approximation = degradation(params["orchid.approximation"].string_param)
                    outcome.model = params["orchid.model"].string_param
                    outcome.ladder_step = int(params["orchid.ladder_step"].int64_param)
                    outcome.predicted_ms = float(params["orchid.predicted_accelerator_ms"].double_param)
                else:
                    outcome.approximation, outcome.model = "none", PRIMARY
            except grpc.aio.AioRpcError as error:
                outcome.t_end = loop.time() - t0
                outcome.code, outcome.rule, outcome.detail = classify_error(error)
                outcome.retry_after_ms = retry_after(error)
            outcomes.append(outcome)

        await send_open_loop(arrivals, one, hooks, t0, lags)
    finally:
        await asyncio.gather(*(channel.close() for channel in channels.values()))
    return outcomes, lags, t0


# --------------------------------------------------------------------------- one target

# Every Triton and gateway created, stopped again after the run whatever happened: a start
# still running in a worker thread when the run is cancelled finishes after its finally.
STARTED: list[LocalTriton | GatewayProcess] = []


@dataclass
class RunResult:
    target: str
    outcomes: list[TenantOutcome]
    snapshots: list[StatsSnapshot]
    lags_ms: list[float]
    ladder_log: list[tuple[float, int, str]] = field(default_factory=list)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ladder(self) -> list[tuple[float, int]]:
        return [(t, step) for t, step, _ in self.ladder_log]


@dataclass
class Options:
    scenario: Scenario
    arrivals: list[Arrival]
    warmup: list[Arrival]
    workdir: Path
    base_port: int
    tuned_queue_size: int


async def run_target(target: str, opts: Options) -> RunResult:
    scenario = opts.scenario
    work = opts.workdir / target
    work.mkdir(parents=True)
    repository = EXAMPLES / "model_repository"
    if target == "triton-tuned":
        repository = tuned_repository(scenario, work, opts.tuned_queue_size)
    triton = LocalTriton(
        repository,
        work / "triton",
        grpc_port=opts.base_port + PORT_OFFSET[target],
        time_factor=scenario.time_factor,
    )
    STARTED.append(triton)
    gateway: GatewayProcess | None = None
    started = time.monotonic()
    try:
        await asyncio.to_thread(triton.start)
        await warm_instances(triton.address, scenario, repository)
        address = triton.address
        if target == "gateway":
            listen = f"127.0.0.1:{opts.base_port + GATEWAY_PORT_OFFSET}"
            gateway = GatewayProcess(gateway_config(scenario, triton.address, listen), work, listen=listen)
            STARTED.append(gateway)
            await asyncio.to_thread(gateway.start)
            address = listen
        payload = build_request(target, scenario)
        deadline_s = scenario.deadline_ms / 1000.0
        await drive(address, opts.warmup, payload, deadline_s, gateway=gateway is not None)

        loop = asyncio.get_running_loop()
        snapshots: list[StatsSnapshot] = []

        def snap_at(t: float) -> tuple[float, Callable[[], Awaitable[None]]]:
            async def take() -> None:
                snap = await fetch_stats(triton.address, t, 0)
                if snap is not None:
                    snapshots.append(snap)

            return t, take

        hooks = [snap_at(phase.start_s) for phase in scenario.phases]
        wall_offset = time.time() - loop.time()
        outcomes, lags, t0 = await drive(
            address, opts.arrivals, payload, deadline_s, gateway=gateway is not None, hooks=hooks
        )
        await asyncio.sleep(0.3)  # let Triton finish what callers abandoned at the end
        await snap_at(scenario.duration_s)[1]()
        ladder = parse_ladder(work / "gateway.log", wall_offset + t0) if gateway else []
        result = RunResult(target, outcomes, sorted(snapshots, key=lambda s: s.t), lags, ladder)
        if not triton.running():
            result.notes.append(f"Triton was not running at the end of the run:\n{triton.log_tail(15)}")
        if gateway is not None and gateway.process is not None and gateway.process.poll() is not None:
            result.notes.append(f"the gateway exited during the run:\n{gateway.log_tail(15)}")
    finally:
        if gateway is not None:
            await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(triton.stop)
    result.wall_s = time.monotonic() - started
    return result


# --------------------------------------------------------------------------- analysis


@dataclass
class TenantRow:
    offered: int = 0
    on_time: int = 0
    full: int = 0  # on time, orchid.approximation == none
    fallback: int = 0
    reduced: int = 0
    early: int = 0
    early_ms: list[float] = field(default_factory=list)
    early_retry_after: int = 0
    late: int = 0
    missed: int = 0
    caller_timeouts: int = 0
    served_pool_ms: float = 0.0  # device-ms of on-time answers on full-v18
    served_fallback_ms: float = 0.0  # device-ms of on-time answers on compact-v11
    offered_ms: float = 0.0  # device-ms of everything offered, at the full price
    rules: Counter[str] = field(default_factory=Counter)

    @property
    def degraded(self) -> int:
        return self.fallback + self.reduced

    def share(self, count: int) -> float:
        return count / self.offered if self.offered else math.nan

    @property
    def early_median_ms(self) -> float:
        return statistics.median(self.early_ms) if self.early_ms else math.nan

    @property
    def retry_after_share(self) -> float:
        return self.early_retry_after / self.early if self.early else math.nan


def tabulate(outcomes: Sequence[TenantOutcome], scenario: Scenario, phase: Phase) -> dict[str, TenantRow]:
    rows = {tenant: TenantRow() for tenant in TENANTS}
    full_ms = scenario.device_ms(scenario.price_ms)
    for o in outcomes:
        if not phase.start_s <= o.t_sched < phase.end_s:
            continue
        row = rows[o.cls]
        row.offered += 1
        row.offered_ms += full_ms
        k = kind(o)
        if k == "ok":
            row.on_time += 1
            if o.approximation == "fallback":
                row.fallback += 1
                row.served_fallback_ms += scenario.device_ms(scenario.fallback_price_ms)
            elif o.approximation == "reduced_output":
                row.reduced += 1
                row.served_pool_ms += scenario.device_ms(scenario.reduced_price_ms)
            else:
                row.full += o.approximation == "none"
                row.served_pool_ms += full_ms
            continue
        row.rules[reason(o)] += 1
        if k == "entry":
            row.early += 1
            row.early_ms.append(o.latency_ms)
            row.early_retry_after += o.retry_after_ms >= 0
        elif k == "late":
            row.late += 1
        else:
            row.missed += 1
            if o.code == "DEADLINE_EXCEEDED" and not o.rule and o.latency_ms >= scenario.deadline_ms - 1.0:
                row.caller_timeouts += 1
    return rows


@dataclass
class Allowance:
    """The flooder's served device time against its weighted share plus idle capacity (ms/s)."""

    capacity: float
    lumen_share: float
    orchid_share: float
    orchid_served: float
    orchid_offered: float
    lumen_served: float
    pool_busy: float | None  # Triton's batch_stats busy time of full-v18, ms/s
    fallback_busy: float | None

    @property
    def idle(self) -> float:
        """The part of orchid's weighted share that orchid did not use."""
        return max(0.0, self.orchid_share - self.orchid_served)

    @property
    def allowance(self) -> float:
        return self.lumen_share + self.idle

    @property
    def strict_allowance(self) -> float:
        """Counting all of orchid's offered demand (up to its share) as not idle."""
        return self.lumen_share + max(0.0, self.orchid_share - max(self.orchid_served, self.orchid_offered))

    @property
    def protected_allowance(self) -> float:
        """The same rule on the ladder's protected envelope (70 % of the raw capacity) instead
        of the raw capacity: lumen's share of it plus what orchid left unused of its share."""
        scale = PROTECTED_UTILIZATION
        return scale * self.lumen_share + max(0.0, scale * self.orchid_share - self.orchid_served)

    @property
    def lumen_busy(self) -> float | None:
        """The pool's measured busy time apportioned to lumen by the priced work served: an
        upper bound on lumen's device time (it includes executions nobody got on time)."""
        served = self.orchid_served + self.lumen_served
        if self.pool_busy is None or served <= 0:
            return None
        return self.pool_busy * self.lumen_served / served


@dataclass
class PhaseReport:
    phase: Phase
    rows: dict[str, TenantRow]
    allowance: Allowance


def analyse(result: RunResult, scenario: Scenario) -> list[PhaseReport]:
    reports = []
    for phase in scenario.phases:
        rows = tabulate(result.outcomes, scenario, phase)
        d = phase.duration_s
        busy = device_time(result.snapshots, phase.start_s, phase.end_s)
        reports.append(
            PhaseReport(
                phase,
                rows,
                Allowance(
                    capacity=scenario.capacity_ms_per_s,
                    lumen_share=scenario.share_ms_per_s("lumen"),
                    orchid_share=scenario.share_ms_per_s("orchid"),
                    orchid_served=rows["orchid"].served_pool_ms / d,
                    orchid_offered=rows["orchid"].offered_ms / d,
                    lumen_served=rows["lumen"].served_pool_ms / d,
                    pool_busy=busy[0].get(PRIMARY, 0.0) / d if busy else None,
                    fallback_busy=busy[0].get(FALLBACK, 0.0) / d if busy else None,
                ),
            )
        )
    return reports


# --------------------------------------------------------------------------- printing


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}"


def _cell(count: int, row: TenantRow) -> str:
    return f"{count} ({_pct(row.share(count))})"


def print_header(scenario: Scenario, args: argparse.Namespace, arrivals: Sequence[Arrival]) -> None:
    f = scenario.time_factor
    counts = Counter(a.tenant for a in arrivals)
    print(
        f"noisy-neighbour benchmark: time factor {f:g}, seed {args.seed}, phases "
        f"before {scenario.before_s:g} / flood {scenario.flood_s:g} / after {scenario.after_s:g} s, "
        f"tuned max_queue_size {args.tuned_queue_size}"
    )
    print(
        f"pool {PRIMARY}: {scenario.devices} instances x 1000 ms/s = "
        f"{scenario.capacity_ms_per_s:.0f} device-ms/s; "
        f"a {SHAPES[SHAPE][0]}/{SHAPES[SHAPE][1]} request costs {scenario.price_ms:.1f} x {f:g} = "
        f"{scenario.device_ms(scenario.price_ms):.1f} device-ms -> raw capacity "
        f"{scenario.capacity_rps:.2f} req/s"
    )
    for tenant in TENANTS:
        load = scenario.orchid_load if tenant == "orchid" else scenario.flood_factor
        when = "whole run" if tenant == "orchid" else f"{scenario.flood.start_s:g}-{scenario.flood.end_s:g} s"
        print(
            f"  {tenant:<6} weight {scenario.weights[tenant]:g}: {load:g} x capacity = "
            f"{scenario.rate(tenant):.2f} req/s ({when}; {counts[tenant]} requests), deadline "
            f"{scenario.deadline_ms:.0f} ms; weighted share {scenario.share_ms_per_s(tenant):.0f} ms/s"
        )


def print_phase_tables(reports: dict[str, list[PhaseReport]]) -> None:
    names = list(reports)
    for index, first in enumerate(reports[names[0]]):
        p = first.phase
        print(f"\n== {p.name}: {p.start_s:g}-{p.end_s:g} s ==")
        print(
            f"{'target':<13} {'tenant':<6} {'offered':>7} {'on time (%)':>13} {'full qual (%)':>13} "
            f"{'degraded (%)':>13} {'rej early (%)':>13} {'early p50 ms':>12} {'retry-aft%':>10} "
            f"{'rej late (%)':>12} {'missed (%)':>11} {'timeouts':>8}"
        )
        for name in names:
            rows = reports[name][index].rows
            for tenant in TENANTS:
                r = rows[tenant]
                p50 = "-" if math.isnan(r.early_median_ms) else f"{r.early_median_ms:.1f}"
                print(
                    f"{name:<13} {tenant:<6} {r.offered:7d} {_cell(r.on_time, r):>13} {_cell(r.full, r):>13} "
                    f"{_cell(r.degraded, r):>13} {_cell(r.early, r):>13} {p50:>12} "
                    f"{_pct(r.retry_after_share):>10} {_cell(r.late, r):>12} {_cell(r.missed, r):>11} "
                    f"{r.caller_timeouts:8d}"
                )
        print(f"{'target':<13} {'tenant':<6} degraded split, rules/statuses of the rest")
        for name in names:
            rows = reports[name][index].rows
            for tenant in TENANTS:
                r = rows[tenant]
                if not r.offered:
                    continue
                top = ", ".join(f"{k} {v}" for k, v in r.rules.most_common(4)) or "-"
                print(f"{name:<13} {tenant:<6} fallback {r.fallback}, reduced {r.reduced}; {top}")


def print_accelerator(reports: dict[str, list[PhaseReport]]) -> None:
    print("\n== accelerator-ms served (on-time answers x profile price x f), ms/s of the pool ==")
    print(
        f"{'target':<13} {'phase':<6} {'capacity':>8} {'orchid':>7} {'(share)':>7} "
        f"{'lumen':>7} {'(share)':>7} {'idle':>6} {'allow':>6} {'lumen/allow':>11} "
        f"{'strict allow':>12} {'fallbk':>6} "
        f"{'pool busy':>9} {'lumen busy~':>11} {'compact busy':>12}"
    )
    for name, phases in reports.items():
        for report in phases:
            a = report.allowance
            fallback = sum(r.served_fallback_ms for r in report.rows.values()) / report.phase.duration_s
            busy = "-" if a.pool_busy is None else f"{a.pool_busy:.0f}"
            compact = "-" if a.fallback_busy is None else f"{a.fallback_busy:.0f}"
            lumen_busy = "-" if a.lumen_busy is None else f"{a.lumen_busy:.0f}"
            print(
                f"{name:<13} {report.phase.name:<6} {a.capacity:8.0f} {a.orchid_served:7.0f} "
                f"{a.orchid_share:7.0f} {a.lumen_served:7.0f} {a.lumen_share:7.0f} {a.idle:6.0f} "
                f"{a.allowance:6.0f} {_pct(a.lumen_served / a.allowance):>10}% {a.strict_allowance:12.0f} "
                f"{fallback:6.0f} {busy:>9} {lumen_busy:>11} {compact:>12}"
            )
    print(
        "idle = orchid's share minus what orchid was served; allow = lumen's share + idle; strict allow\n"
        "counts orchid's offered demand as used; fallbk: served on compact-v11's own instances, outside\n"
        "the pool; pool/compact busy: Triton's batch_stats compute time (all work, on time or not);\n"
        "lumen busy~: pool busy x lumen's part of the priced work served. Priced work can exceed the\n"
        "capacity where Triton's dynamic batcher runs several requests at once (a batch shares its decode)"
    )


@dataclass
class Verdict:
    what: str
    value: str
    ok: bool


def verdicts(report: PhaseReport) -> list[Verdict]:
    orchid, lumen, a = report.rows["orchid"], report.rows["lumen"], report.allowance
    on_time, full = orchid.share(orchid.on_time), orchid.share(orchid.full)
    median, carried = lumen.early_median_ms, lumen.retry_after_share
    return [
        Verdict(
            f"orchid on time >= {100 * ORCHID_ON_TIME:.0f} % of its flood requests",
            f"{_pct(on_time)} % ({orchid.on_time}/{orchid.offered})",
            on_time >= ORCHID_ON_TIME,
        ),
        Verdict(
            f"orchid on time at full quality >= {100 * ORCHID_FULL_QUALITY:.0f} %",
            f"{_pct(full)} % ({orchid.full}/{orchid.offered})",
            full >= ORCHID_FULL_QUALITY,
        ),
        Verdict(
            f"lumen early refusals: median time to refusal <= {LUMEN_REFUSAL_MEDIAN_MS:g} ms",
            "no early refusals" if not lumen.early else f"{median:.1f} ms (n={lumen.early})",
            lumen.early > 0 and median <= LUMEN_REFUSAL_MEDIAN_MS,
        ),
        Verdict(
            "lumen early refusals carry retry-after-ms (all)",
            "no early refusals"
            if not lumen.early
            else f"{_pct(carried)} % ({lumen.early_retry_after}/{lumen.early})",
            lumen.early > 0 and lumen.early_retry_after == lumen.early,
        ),
        Verdict(
            "lumen served <= its share + idle capacity",
            f"{a.lumen_served:.0f} ms/s vs {a.lumen_share:.0f} + {a.idle:.0f} = {a.allowance:.0f} ms/s "
            f"(strict {a.strict_allowance:.0f}; on the protected envelope {a.protected_allowance:.0f})",
            a.lumen_served <= a.allowance,
        ),
    ]


def print_targets(reports: dict[str, list[PhaseReport]]) -> None:
    print("\n== targets (flood phase) ==")
    for name, phases in reports.items():
        flood = next(r for r in phases if r.phase.name == "flood")
        for v in verdicts(flood):
            print(f"{name:<13} {'PASS' if v.ok else 'FAIL'}  {v.what:<58} {v.value}")


def print_client(results: dict[str, RunResult]) -> None:
    print("\n== client and runs ==")
    for name, result in results.items():
        lags = sorted(result.lags_ms)
        p99 = lags[int(0.99 * (len(lags) - 1))] if lags else 0.0
        print(
            f"{name:<13} requests {len(result.outcomes):5d}  send lag p99 {p99:5.1f} ms "
            f"max {lags[-1] if lags else 0.0:6.1f} ms  wall {result.wall_s:5.1f} s"
        )
        for note in result.notes:
            print(f"{'':<13} NOTE: {note}")
        if name == "gateway":
            steps = Counter(o.ladder_step for o in result.outcomes if o.ladder_step >= 0)
            ladder = " ".join(f"{t:.1f}s->{s}" for t, s in result.ladder) or "-"
            print(f"{'':<13} ladder ({PRIMARY} pool, from the log): {ladder}")
            print(f"{'':<13} orchid.ladder_step on responses: {dict(sorted(steps.items()))}")
            for t, step, why in result.ladder_log:
                print(f"{'':<13}   {t:6.1f} s -> {step}: {why[:150]}")


# --------------------------------------------------------------------------- plot


def share_series(
    result: RunResult, tenant: str, seconds: int, wanted: Callable[[TenantOutcome], bool]
) -> np.ndarray[Any, np.dtype[np.float64]]:
    offered, hits = np.zeros(seconds), np.zeros(seconds)
    for o in result.outcomes:
        if o.cls == tenant and 0 <= o.t_sched < seconds:
            offered[int(o.t_sched)] += 1
            hits[int(o.t_sched)] += wanted(o)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(offered > 0, hits / np.maximum(offered, 1), np.nan)


def plot(results: dict[str, RunResult], scenario: Scenario, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print(f"\n(matplotlib is not installed: no plot; `pip install matplotlib` for {path})")
        return False
    seconds = math.ceil(scenario.duration_s)
    x = np.arange(seconds) + 0.5
    colors = {"orchid": "#1f77b4", "lumen": "#d62728"}
    flood = scenario.flood
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.6 * len(results)), sharex=True, squeeze=False)
    for ax, (name, result) in zip(axes[:, 0], results.items(), strict=True):
        ax.axvspan(flood.start_s, flood.end_s, color="0.92", zorder=0)
        for tenant in TENANTS:
            on_time = share_series(result, tenant, seconds, lambda o: o.code == "OK")
            degraded = share_series(
                result,
                tenant,
                seconds,
                lambda o: o.code == "OK" and o.approximation in ("fallback", "reduced_output"),
            )
            ax.plot(x, on_time, color=colors[tenant], lw=1.8, marker=".", label=f"{tenant}: on time")
            ax.plot(x, degraded, color=colors[tenant], lw=1.2, ls="--", label=f"{tenant}: degraded")
        ax.set_ylim(-0.03, 1.05)
        ax.set_ylabel("share of requests sent")
        ax.set_title(
            f"{name}: orchid {scenario.rate('orchid'):.1f} req/s throughout; lumen "
            f"{scenario.rate('lumen'):.1f} req/s in the grey window (deadline {scenario.deadline_ms:.0f} ms)",
            fontsize=10,
            loc="left",
        )
        twin = ax.twinx() if name == "gateway" else None
        if twin is not None:
            grid = np.arange(0, seconds, 0.1)
            twin.step(grid, [step_at(result.ladder, t) for t in grid], where="post", color="#2ca02c", lw=1.3)
            twin.set_ylim(-0.2, 6.5)
            twin.set_yticks(range(7))
            twin.set_ylabel("gateway ladder step", color="#2ca02c")
            twin.tick_params(axis="y", colors="#2ca02c")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if "gateway" in results:
        handles.append(Line2D([], [], color="#2ca02c", lw=1.3))
        labels.append("gateway ladder step (right axis)")
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    axes[-1, 0].set_xlabel(
        f"seconds (grey: lumen floods at {scenario.flood_factor:g}x the pool's raw capacity); "
        f"bins of 1 s by send time; time factor {scenario.time_factor:g}"
    )
    fig.suptitle(
        f"noisy neighbour: orchid (weight {scenario.weights['orchid']:g}) beside a flooding lumen "
        f"(weight {scenario.weights['lumen']:g}) on {scenario.devices} emulated devices"
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--time-factor", type=float, default=1.0, help="ORCHID_TIME_FACTOR (default 1.0)")
    parser.add_argument("--before-s", type=float, default=5.0, help="orchid alone before the flood")
    parser.add_argument("--flood-s", type=float, default=30.0, help="lumen's flood")
    parser.add_argument("--after-s", type=float, default=10.0, help="orchid alone after the flood")
    parser.add_argument("--orchid-load", type=float, default=0.35, help="orchid's share of raw capacity")
    parser.add_argument("--flood-factor", type=float, default=2.75, help="lumen's multiple of raw capacity")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="orchid's stream before measuring")
    parser.add_argument(
        "--seed", type=int, default=20261, help="arrival schedule seed (same for every target)"
    )
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--tuned-queue-size", type=int, default=4, help="max_queue_size of triton-tuned")
    parser.add_argument("--base-port", type=int, default=16500, help="ports BASE+1, +2 and +8 are used")
    parser.add_argument("--keep", action="store_true", help="keep Triton and gateway logs (prints where)")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "noisy-neighbour.png")
    args = parser.parse_args(argv)
    if min(args.before_s, args.after_s) < 0 or args.flood_s <= 0 or args.time_factor <= 0:
        parser.error("phase lengths must be >= 0 (flood > 0) and the time factor > 0")
    return args


async def run_all(opts: Options, targets: Sequence[str]) -> dict[str, RunResult]:
    # SIGTERM cancels the run like Ctrl-C: every target's finally stops its gateway and Triton.
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    results: dict[str, RunResult] = {}
    for target in targets:
        print(f"running {target} ...", file=sys.stderr, flush=True)
        results[target] = await run_target(target, opts)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # The stack as shipped: compact-v11 on its own instances, not the emulator's shared devices.
    for name in ("ORCHID_DEVICE_DIR", "ORCHID_DEVICES"):
        os.environ.pop(name, None)
    scenario = build_scenario(args)
    arrivals = schedule(scenario, args.seed)
    warmup = schedule(scenario, args.seed + 1, warmup_s=args.warmup_s) if args.warmup_s > 0 else []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="orchid-noisy-") as tmp:
        workdir = Path(tempfile.mkdtemp(prefix="orchid-noisy-keep-")) if args.keep else Path(tmp)
        if args.keep:
            print(f"work directory (kept): {workdir}", file=sys.stderr)
        opts = Options(scenario, arrivals, warmup, workdir, args.base_port, args.tuned_queue_size)
        try:
            results = asyncio.run(run_all(opts, args.targets))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted: everything started was stopped", file=sys.stderr)
            return 130
        finally:
            for process in STARTED:
                process.stop()
    print_header(scenario, args, arrivals)
    print(f"total wall {time.monotonic() - started:.0f} s")
    reports = {name: analyse(result, scenario) for name, result in results.items()}
    print_phase_tables(reports)
    print_accelerator(reports)
    print_targets(reports)
    print_client(results)
    if plot(results, scenario, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
