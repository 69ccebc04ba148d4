"""Surge benchmark: orchid-gateway against Triton direct (FIFO, tuned, tuned + client fallback).

What it measures
    The seed's "Overload needs an honest quality policy" scenario, scaled down to a
    2-core machine, run side by side against four targets with the *same* arrival
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
                        alone offers (ARCHITECTURE §7). Its ``max_queue_size`` and
                        batching are the best of a sweep run first (below);
    * ``triton-tuned-fallback``  the same tuned Triton, plus the client's own fallback:
                        when Triton refuses a request with its queue policy ("Exceeds
                        maximum queue size", or "Request timeout expired") and the
                        deadline still leaves compact-v11's price, the client resends it
                        at once to ``compact-v11`` (same tokens; gRPC deadline = the time
                        left; Triton's ``timeout`` = the time left minus compact-v11's
                        price). An answer from compact-v11 is a fallback answer. The
                        strongest client-side baseline: it needs no gateway, only a
                        client that knows the prices and the fallback. (With shared
                        devices, Triton's ``timeout`` covers its own queue only: a
                        resend Triton starts may still wait inside the emulator for a
                        device held by full-v18, and then miss its deadline rather
                        than be refused; ``retry%`` vs ``fallbk%`` shows how many);
    * ``gateway``       clients -> ``orchid-gateway serve`` (the repository's tenants,
                        routes and policies) -> Triton on the shipped repository.

    Optionally (``--kill-at``, on by default) one more run, ``gateway-kill``: the same
    workload through the gateway, with its Triton SIGKILLed during the surge
    (``LocalTriton.kill()``) and restarted ``--kill-for`` seconds later
    (``LocalTriton.start()``): the loss of a device group (issue 7.5).

Tuned Triton's configuration (the sweep)
    Before the targets, each configuration of a grid gets a short surge-only run on a
    fresh Triton (the usual warm-up, then ``--sweep-s`` 12 s at the surge multiplier x
    the load factor, its own arrival schedule from ``--seed`` + 2), driven by the
    ``triton-tuned`` client (``--sweep-client triton-tuned-fallback`` to sweep with the
    fallback client instead). The grid: ``max_queue_size`` in ``--sweep-sizes`` (2 4 8
    16) x batching ``on`` (the dynamic batcher, batches of up to 8) and ``off`` (the
    same dynamic batcher and queue policy with ``max_batch_size: 1``: every request
    runs alone), plus one run with batching ``none`` (the ``dynamic_batching`` block
    removed: Triton's default scheduler, no batches, but no queue policy either:
    Triton's queue policy and its ``timeout`` parameter live in the dynamic batcher, so
    ``max_queue_size`` means nothing there). The table shows per configuration the
    on-time, full-quality and quality-weighted goodput, the headline ON-TIME % and the
    refusals; the best on-time goodput (the first of equals, in the grid's order) is
    used for ``triton-tuned`` and ``triton-tuned-fallback``, and the report says which.
    ``--tuned-queue-size N`` and ``--tuned-batching on|off|none`` each fix their
    dimension of the grid; both together fix the configuration and skip the sweep.
    ``--sweep-s 0`` skips it too (``max_queue_size`` 4, batching on, unless fixed).
    Every configuration sees the same schedule, but 12 s is short (about 770 requests at
    1.25x): differences of a few % between configurations may be noise.

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
      ``--recover-s`` 10 s at 1x. ``--load-factor X`` (default 1) multiplies every
      phase's multiplier: ``--load-factor 0.893 --surge-s 0 --recover-s 0`` is a
      normal phase alone at 87 % of the protected envelope. A phase of zero length is
      left out (tables, ratios, plot). Each target first gets one concurrent request per
      instance and shape (instance warm-up) and 3 s of the workload at 0.5x (not
      measured, not scaled by the load factor), then the measured schedule.

Client
    Open loop: Poisson arrivals per class (numpy ``default_rng(--seed)``), sent at their
    scheduled time whatever is outstanding (a closed loop would hide overload), from
    one asyncio process over one ``grpc.aio`` channel with requests serialized once per
    class and target (raw bytes in and out, responses parsed only for the gateway's
    provenance). Send lag (actual - scheduled send time) is reported: the schedule is
    honest only while it stays small. All traffic uses the ``orchid`` demo tenant (the
    tenant entitled to the fallback model, the seed's eligible population) and hints
    ``orchid.class=interactive``, ``orchid.max_output_tokens``; direct targets get
    Triton's ``max_output_tokens`` parameter. The fallback client's resend is part of
    the same request: one outcome, from the first send to the last answer.

Outcome of a request, from the client
    * ``ok``: a response before the deadline (it cannot be later: the deadline is the
      gRPC deadline). Goodput = ok per second; fallback = ok with provenance
      ``orchid.approximation == fallback`` (served by compact-v11 within its quality
      floor; counted as goodput and shown separately; for the fallback client: answered
      by its resend to compact-v11); reduced = ok with
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
    The headline is ``ON-TIME %`` = ok / ALL offered requests (refusals count against
    it). ``attain`` = ok / (offered - rejected), as the brief defines it for Triton
    ("everything not rejected counts as admitted"); ``attain*`` = ok / (offered -
    rejected at entry) counts late rejections as admitted work that missed: this is the
    gateway's own meaning of "admitted" (it passed admission) and the issue's target.
    For the fallback client, a request Triton refused and compact-v11 answered is ok;
    one whose resend failed is classified by the resend's outcome.

Goodput, per phase and target, side by side (per second of the phase, by send time)
    * on-time goodput: ok answers;
    * full-quality goodput: ok answers with ``orchid.approximation == none`` (direct
      targets: every full-v18 answer is full quality, every compact-v11 answer of the
      fallback client a fallback);
    * quality-weighted goodput: the sum over ok answers of their modeled quality, read
      from the routes (``routes/*.yaml``, never hard-coded): full-v18's
      ``quality.score`` for full answers, its ``reduced_output.quality.score`` for
      reduced ones, compact-v11's ``quality.score`` for fallback answers;
    * degraded share: (fallback + reduced) / ok.
    The ratios: gateway / each baseline (on-time), and gateway / the BEST baseline (the
    max over ``triton-fifo``, ``triton-tuned``, ``triton-tuned-fallback``, per phase,
    class and goodput kind, named in brackets).

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
    max) is kept as a cross-check. Per gateway run and phase: the share of the phase's
    time the ladder was at step 0, and the degraded share; then the same over the last
    10 s of the recovery phase (the whole phase if shorter): is it back to full quality.

Run (about 11 minutes on 2 cores by estimate, of which the sweep's 9 runs about 4; Triton
and gateway startup included)::

    python bench/surge.py                       # sweep, 4 targets + the kill run, plot docs/img/surge.png
    python bench/surge.py --kill-at 0           # without the kill run
    python bench/surge.py --tuned-queue-size 4 --tuned-batching on   # no sweep
    python bench/surge.py --normal-s 5 --surge-s 10 --recover-s 5 --kill-at 0 --sweep-s 4  # quick look
    python bench/surge.py --load-factor 0.893 --surge-s 0 --recover-s 0 --kill-at 0  # 87 % of protected

Diagnostics (gateway configuration only, never its code)::

    python bench/surge.py --targets gateway --kill-at 0 --gateway-inflight 1
    python bench/surge.py --targets gateway --kill-at 0 \
        --gateway-ladder reject_interactive_at=1.5 --gateway-ladder protect_admitted_at=1.6
    python bench/surge.py --surge-factor 1.8 --kill-at 0   # 1.25x the devices' raw time

Ports ``--base-port`` (default 16100) +1 to +6 (Triton; +6 for the sweep) and +8 (gateway).
Everything started is stopped on exit.
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
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from tritonclient.grpc import service_pb2

from gateway.backends.local import LocalTriton
from gateway.config import load_routes
from gateway.core.overload import DEFAULT_WINDOW_S as DEMAND_WINDOW_S
from gateway.core.profile import DemandProfile
from orchid_tools.capacity import compute_worksheet, workload_from_data
from orchid_tools.harness import (
    GatewayProcess,
    example_backend,
    example_config,
    example_settings,
    scaled_classes,
    send_open_loop,
)
from orchid_tools.simulate import PhaseWindow as Phase  # name, start_s, end_s, multiplier
from orchid_tools.simulate import degradation  # "fallback,reduced_output" counts as fallback

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "orchid"
INFER = "/inference.GRPCInferenceService/ModelInfer"
STATS = "/inference.GRPCInferenceService/ModelStatistics"
PRIMARY, FALLBACK = "full-v18", "compact-v11"
DEMO_KEY = "orchid-demo-key-orchid"
CLASSES = ("short", "long")
SHAPES = {"short": (256, 64), "long": (4096, 128)}  # input tokens, output tokens
SEED_DEADLINE_MS = {"short": 200.0, "long": 1000.0}  # at time factor 1
PROTECTED_UTILIZATION = 0.70
FALLBACK_TARGET = "triton-tuned-fallback"
BASELINES = ("triton-fifo", "triton-tuned", FALLBACK_TARGET)
TARGETS = (*BASELINES, "gateway")
KILL_TARGET = "gateway-kill"
SWEEP_TARGET = "triton-tuned (sweep)"  # work directories and port of the sweep's runs
# Triton's port is --base-port + this; the gateway listens on --base-port + 8.
PORT_OFFSETS = {
    "triton-fifo": 1,
    "triton-tuned": 2,
    "gateway": 3,
    KILL_TARGET: 4,
    FALLBACK_TARGET: 5,
    SWEEP_TARGET: 6,
}
NAME_W = len(FALLBACK_TARGET)  # width of the target column
# Details of Triton's own refusals (its queue policy): the fallback client retries these.
TRITON_QUEUE_FULL = "maximum queue size"
TRITON_TIMEOUT = "Request timeout expired"
# Answers on time, by what answered them (orchid.approximation; direct targets: set by the client).
FULL, REDUCED, DEGRADED_FALLBACK = "none", "reduced_output", "fallback"
LADDER_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ orchid\.overload: pool (\S+) ladder step -> (\d+): (.*)$"
)
# Gateway rules that refuse a request after it waited in the dispatch queue.
LATE_RULES = frozenset({"queue.latest_start"})


# --------------------------------------------------------------------------- scenario


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
    load_factor: float = 1.0  # multiplies every phase's arrival multiplier

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
        """The measured phases, times the load factor; phases of zero length are left out."""
        a = self.normal_s
        b = a + self.surge_s
        phases = (
            Phase("normal", 0.0, a, self.load_factor),
            Phase("surge", a, b, self.surge_factor * self.load_factor),
            Phase("recovery", b, b + self.recover_s, self.load_factor),
        )
        return tuple(p for p in phases if p.duration_s > 0)

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s if self.phases else 0.0


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


@dataclass(frozen=True)
class Quality:
    """Modeled quality of an on-time answer by what answered it (``orchid.approximation``),
    from the routes' quality evidence: full-v18 ``quality.score`` (``none``), its
    ``reduced_output.quality.score`` (``reduced_output``) and its fallback's (compact-v11)
    ``quality.score`` (``fallback``)."""

    scores: dict[str, float]

    def of(self, approximation: str) -> float:
        """An answer degraded several ways (``fallback,reduced_output``) counts the lowest."""
        return min(self.scores[part] for part in (approximation or FULL).split(","))


def load_quality(directory: Path = REPO / "routes") -> Quality:
    models = load_routes(directory).models
    route = models[PRIMARY]
    fallback = models.get(route.fallback or "")
    if route.fallback != FALLBACK or fallback is None:
        raise RuntimeError(f"{directory}: {PRIMARY}'s fallback is {route.fallback!r}, not {FALLBACK!r}")
    missing = [
        what
        for what, evidence in (
            (f"{PRIMARY}.quality", route.quality),
            (f"{PRIMARY}.reduced_output", route.reduced_output),
            (f"{FALLBACK}.quality", fallback.quality),
        )
        if evidence is None
    ]
    if missing or route.quality is None or route.reduced_output is None or fallback.quality is None:
        raise RuntimeError(f"{directory}: no quality evidence for {', '.join(missing)}")
    return Quality(
        {
            FULL: route.quality.score,
            REDUCED: route.reduced_output.quality.score,
            DEGRADED_FALLBACK: fallback.quality.score,
        }
    )


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


def build_request(cls: str, *, target: str, scenario: Scenario, model: str = PRIMARY) -> bytes:
    """The serialized ModelInfer request of ``cls`` for ``target``. The tuned targets' requests
    to ``full-v18`` carry Triton's ``timeout`` (their latest start); ``compact-v11`` requests
    (the fallback client's retries) get theirs when resent (:class:`Retry`)."""
    tokens, output = SHAPES[cls]
    request = service_pb2.ModelInferRequest(model_name=model, id=cls)
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
    if target in ("triton-tuned", FALLBACK_TARGET) and model == PRIMARY:
        request.parameters["timeout"].int64_param = tuned_timeout_us(cls, scenario)
    data: bytes = request.SerializeToString()
    return data


@dataclass(frozen=True)
class Retry:
    """``triton-tuned-fallback``: the client's own fallback. A request Triton refused with its
    queue policy (queue full, or its ``timeout`` expired in the queue) is resent at once to
    ``compact-v11``, same tokens, if its deadline still leaves time to run it there: the gRPC
    deadline is the time left, Triton's ``timeout`` that time minus compact-v11's price (its
    latest start there), as the tuned target sets it for full-v18."""

    payloads: dict[str, bytes]  # class -> compact-v11 request without ``timeout``
    price_s: dict[str, float]  # class -> compact-v11 device time, batch of one

    @classmethod
    def build(cls, target: str, scenario: Scenario) -> Retry:
        return cls(
            {c: build_request(c, target=target, scenario=scenario, model=FALLBACK) for c in CLASSES},
            {c: scenario.device_ms(FALLBACK, c) / 1000.0 for c in CLASSES},
        )

    @staticmethod
    def wanted(detail: str) -> bool:
        return TRITON_QUEUE_FULL in detail or TRITON_TIMEOUT in detail

    def payload(self, cls: str, remaining_s: float) -> bytes | None:
        """The retry for ``remaining_s`` left before the deadline; ``None``: no time to run it."""
        slack_s = remaining_s - self.price_s[cls]
        if slack_s <= 0:
            return None
        timeout = service_pb2.ModelInferRequest()
        timeout.parameters["timeout"].int64_param = max(1, int(slack_s * 1e6))
        # Serialized protobuf messages concatenate as a merge: this adds the map entry.
        extra: bytes = timeout.SerializeToString()
        return self.payloads[cls] + extra


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


@dataclass(frozen=True)
class TunedConfig:
    """Tuned Triton's configuration of full-v18 and compact-v11.

    ``batching``: ``on`` = the dynamic batcher (batches of up to 8) with the queue policy;
    ``off`` = the same dynamic batcher and queue policy with ``max_batch_size: 1`` (every
    request runs alone); ``none`` = no ``dynamic_batching`` block at all: Triton's default
    scheduler, which runs requests one at a time but has no queue policy (no
    ``max_queue_size``, and Triton honours the ``timeout`` parameter only in the dynamic
    batcher), so ``queue_size`` means nothing there."""

    queue_size: int
    batching: str  # on | off | none

    @property
    def label(self) -> str:
        if self.batching == "none":
            return "no dynamic_batching block (no queue policy)"
        return f"max_queue_size {self.queue_size}, batching {self.batching}"


def tuned_repository(scenario: Scenario, into: Path, tuned: TunedConfig | int) -> Path:
    """A copy of the example repository with ``tuned`` applied to full-v18 and compact-v11
    (an ``int``: that ``max_queue_size`` with batching on)."""
    if isinstance(tuned, int):
        tuned = TunedConfig(tuned, "on")
    copy_repository(into)
    default_us = tuned_timeout_us("short", scenario)
    policy = (
        "dynamic_batching { max_queue_delay_microseconds: 0 default_queue_policy { "
        f"timeout_action: REJECT default_timeout_microseconds: {default_us} "
        f"allow_timeout_override: true max_queue_size: {tuned.queue_size} }} }}"
    )
    for model in (PRIMARY, FALLBACK):
        path = into / "model_repository" / model / "config.pbtxt"
        replacement = "" if tuned.batching == "none" else policy
        text, count = re.subn(r"dynamic_batching \{[^}]*\}", replacement, path.read_text())
        if count != 1:
            raise RuntimeError(f"{path}: expected one dynamic_batching block")
        if tuned.batching == "off":
            text, count = re.subn(r"max_batch_size: \d+", "max_batch_size: 1", text)
            if count != 1:
                raise RuntimeError(f"{path}: expected one max_batch_size")
        path.write_text(text)
    return into / "model_repository"


def gateway_config(
    scenario: Scenario,
    triton_address: str,
    listen: str,
    inflight: int | None = None,
    ladder: dict[str, float] | None = None,
    shared_devices: bool = False,
    limits: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The example gateway config with the local Triton as a `backends:` entry and the
    classes' time constants scaled by f."""
    f = scenario.time_factor
    changes: dict[str, Any] = {"shared_devices": shared_devices}
    if inflight:
        changes["max_inflight_per_device"] = inflight
    config = example_config(
        [example_backend("surge", triton_address, f, **changes)],
        without=("jobs",),
        listen=listen,
        classes=scaled_classes(f),
        limits={**example_settings().get("limits", {}), "drain_timeout_s": 2, **(limits or {})},
    )
    if ladder:
        config["ladder"] = ladder
    return config


# --------------------------------------------------------------------------- processes


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
    retried: bool = False  # triton-tuned-fallback: resent to compact-v11 after Triton refused it

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
    retry: Retry | None = None,
) -> tuple[list[Outcome], list[float], float]:
    """Send ``arrivals`` open-loop; return outcomes, send lags (ms), and the start (monotonic).
    With ``retry``, Triton's queue-policy refusals are resent to compact-v11 (:class:`Retry`)."""
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
                    outcome.approximation = degradation(params["orchid.approximation"].string_param)
                    outcome.model = params["orchid.model"].string_param
                    outcome.ladder_step = int(params["orchid.ladder_step"].int64_param)
                    outcome.predicted_ms = float(params["orchid.predicted_accelerator_ms"].double_param)
                else:
                    outcome.model, outcome.approximation = PRIMARY, FULL
            except grpc.aio.AioRpcError as error:
                outcome.t_end = loop.time() - t0
                outcome.code, outcome.rule, outcome.detail = classify_error(error)
            if retry is not None and outcome.code != "OK" and Retry.wanted(outcome.detail):
                remaining_s = deadlines_s[arrival.cls] - (loop.time() - sent)
                payload = retry.payload(arrival.cls, remaining_s)
                if payload is not None:
                    outcome.retried = True
                    try:
                        await call(payload, timeout=remaining_s, metadata=metadata)
                        outcome.code, outcome.rule, outcome.detail = "OK", "", ""
                        outcome.model, outcome.approximation = FALLBACK, DEGRADED_FALLBACK
                    except grpc.aio.AioRpcError as error:
                        outcome.code, outcome.rule, outcome.detail = classify_error(error)
                    outcome.t_end = loop.time() - t0
            outcomes.append(outcome)

        await send_open_loop(arrivals, one, hooks, t0, lags)
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


async def warm_instances(address: str, scenario: Scenario, fallback_instances: int = 2) -> None:
    """One concurrent request per instance and shape, on both models: nothing a target meets
    first (an instance's first execution, ~20-25 ms slower where a model declares no
    ``model_warmup``; the gateway's first requests) may land in the measurement."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for model, instances in ((PRIMARY, scenario.fleet), (FALLBACK, fallback_instances)):
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
    tuned: TunedConfig
    kill_at: float
    kill_for: float
    gateway_pythonpath: str | None
    gateway_inflight: int | None = None
    gateway_ladder: dict[str, float] | None = None
    gateway_limits: dict[str, float] | None = None
    shared_devices: bool = False
    seed: int = 0  # the run's --seed (the sweep draws its own schedule from seed + 2)


async def run_target(target: str, opts: Options, run: str | None = None) -> RunResult:
    """One run of ``target`` on a fresh Triton (and gateway). ``run`` names the run's work
    directory and port (default: the target's); the sweep's runs are ``triton-tuned`` runs
    with their own ``opts`` (scenario, arrivals, tuned configuration)."""
    scenario = opts.scenario
    f = scenario.time_factor
    port = opts.base_port + PORT_OFFSETS[SWEEP_TARGET if run else target]
    work = opts.workdir / (run or target)
    work.mkdir(parents=True)
    repository = EXAMPLES / "model_repository"
    tuned = target in ("triton-tuned", FALLBACK_TARGET)
    if tuned:
        repository = tuned_repository(scenario, work, opts.tuned)
    if opts.shared_devices:
        # Every target runs on the same emulated devices; only the gateway and the fallback
        # client use the fallback.
        if not tuned:
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
        await warm_instances(triton.address, scenario, scenario.fleet if opts.shared_devices else 2)
        if target.startswith("gateway"):
            listen = f"127.0.0.1:{opts.base_port + 8}"
            config = gateway_config(
                scenario,
                triton.address,
                listen,
                opts.gateway_inflight,
                opts.gateway_ladder,
                shared_devices=opts.shared_devices,
                limits=opts.gateway_limits,
            )
            gateway = GatewayProcess(config, work, listen=listen, pythonpath=opts.gateway_pythonpath)
            await asyncio.to_thread(gateway.start)
            address = listen
        payloads = {cls: build_request(cls, target=target, scenario=scenario) for cls in CLASSES}
        deadlines = {cls: scenario.deadline_ms(cls) / 1000.0 for cls in CLASSES}
        metadata = (("authorization", f"Bearer {DEMO_KEY}"),) if gateway else None
        kwargs: dict[str, Any] = {
            "metadata": metadata,
            "provenance": gateway is not None,
            "retry": Retry.build(target, scenario) if target == FALLBACK_TARGET else None,
        }
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
            # The new server's counters as it became ready: they already hold its models'
            # model_warmup (one execution per instance, before it reported ready), no request
            # of the run's. From zero only if they cannot be read.
            baseline = await fetch_stats(triton.address, events["restarting"], epoch[0])
            snapshots.append(baseline or StatsSnapshot(events["restarting"], epoch[0], {}, {}, {}, {}))

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
    full: int = 0  # on-time answers of full quality (orchid.approximation == none)
    quality: float = 0.0  # sum of the modeled quality of on-time answers
    retried: int = 0  # triton-tuned-fallback: resent to compact-v11 after Triton refused them
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

    @property
    def degraded(self) -> int:
        return self.fallback + self.reduced

    def on_time(self) -> float:
        """The headline: on-time answers over all offered requests."""
        return self.ok / self.offered if self.offered else math.nan

    def attain(self) -> float:
        admitted = self.offered - self.rejected
        return self.ok / admitted if admitted else math.nan

    def attain_strict(self) -> float:
        admitted = self.offered - self.entry
        return self.ok / admitted if admitted else math.nan


def degraded_share(row: ClassRow) -> float:
    """(fallback + reduced) / on-time answers."""
    return row.degraded / row.ok if row.ok else math.nan


def total(rows: dict[str, ClassRow]) -> ClassRow:
    """Both classes together (the counters; not the latency lists)."""
    row = ClassRow()
    for r in rows.values():
        for name in ("offered", "ok", "fallback", "reduced", "full", "retried", "entry", "late", "missed"):
            setattr(row, name, getattr(row, name) + getattr(r, name))
        row.quality += r.quality
        row.caller_timeouts += r.caller_timeouts
        row.rules.update(r.rules)
    return row


def tabulate(
    outcomes: Iterable[Outcome], scenario: Scenario, quality: Quality, start_s: float, end_s: float
) -> dict[str, ClassRow]:
    rows = {cls: ClassRow() for cls in CLASSES}
    for o in outcomes:
        if not start_s <= o.t_sched < end_s:
            continue
        row = rows[o.cls]
        row.offered += 1
        row.retried += o.retried
        k = kind(o)
        if k == "ok":
            row.ok += 1
            fallback = o.approximation == DEGRADED_FALLBACK
            row.fallback += fallback
            row.reduced += o.approximation == REDUCED
            row.full += (o.approximation or FULL) == FULL
            row.quality += quality.of(o.approximation)
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


def analyse(result: RunResult, scenario: Scenario, quality: Quality) -> list[PhaseReport]:
    return [
        PhaseReport(
            phase,
            tabulate(result.outcomes, scenario, quality, phase.start_s, phase.end_s),
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


def step0_share(ladder: Sequence[tuple[float, int]], start_s: float, end_s: float) -> float:
    """Share of [start_s, end_s) during which the ladder was at step 0."""
    if end_s <= start_s:
        return math.nan
    bounds = [start_s, *sorted(t for t, _ in ladder if start_s < t < end_s), end_s]
    at_zero = sum(b - a for a, b in itertools.pairwise(bounds) if step_at(ladder, a) == 0)
    return at_zero / (end_s - start_s)


# --------------------------------------------------------------------------- printing


def _pct(x: float) -> str:
    return "  n/a" if math.isnan(x) else f"{100 * x:5.1f}"


def _med(values: Sequence[float]) -> str:
    return f"{statistics.median(values):6.1f}" if values else "     -"


GOODPUTS: tuple[tuple[str, Callable[[ClassRow], float]], ...] = (
    ("on-time", lambda r: float(r.ok)),
    ("full-quality", lambda r: float(r.full)),
    ("quality-weighted", lambda r: r.quality),
)


def print_phase_tables(results: dict[str, RunResult], reports: dict[str, list[PhaseReport]]) -> None:
    names = list(results)
    w = NAME_W
    for index, phase in enumerate(next(iter(reports.values()))):
        p = phase.phase
        d = p.duration_s
        print(f"\n== {p.name}: {p.start_s:.0f}-{p.end_s:.0f} s, arrivals x{p.multiplier:g} ==")
        print(
            "goodput per second of the phase: good = on time; full = on time at full quality "
            "(approximation none); qual = sum of the modeled quality of on-time answers; "
            "degr% = (fallback + reduced) / on time; ON-TIME% = on time / ALL offered (headline)"
        )
        print(
            f"{'target':<{w}} {'class':<5} {'offer/s':>7} {'ON-TIME%':>8} {'good/s':>6} {'full/s':>6} "
            f"{'qual/s':>6} {'degr%':>5}"
        )
        for name in names:
            rows = reports[name][index].rows
            for cls, r in (*rows.items(), ("all", total(rows))):
                print(
                    f"{name:<{w}} {cls:<5} {r.offered / d:7.1f} {_pct(r.on_time()):>8} {r.ok / d:6.1f} "
                    f"{r.full / d:6.1f} {r.quality / d:6.2f} {_pct(degraded_share(r)):>5}"
                )
        print(
            "outcomes, % of offered unless said: attain% = ok / (offered - rejected); attain*% = ok / "
            "(offered - rejected at entry); retry% = resent to compact-v11 by the client"
        )
        print(
            f"{'target':<{w}} {'class':<5} {'attain%':>7} {'attain*%':>8} "
            f"{'fallbk%':>7} {'reduc%':>6} {'retry%':>6} {'rej%':>5} {'entry%':>6} {'late%':>5} "
            f"{'rej p50 ms':>10} {'entry p50':>9} "
            f"{'missed%':>7} {'timeout':>7}"
        )
        for name in names:
            rows = reports[name][index].rows
            for cls in CLASSES:
                r = rows[cls]
                n = max(1, r.offered)
                print(
                    f"{name:<{w}} {cls:<5} "
                    f"{_pct(r.attain()):>7} {_pct(r.attain_strict()):>8} {_pct(r.fallback / n):>7} "
                    f"{_pct(r.reduced / n):>6} {_pct(r.retried / n):>6} "
                    f"{_pct(r.rejected / n):>5} {_pct(r.entry / n):>6} {_pct(r.late / n):>5} "
                    f"{_med(r.reject_ms):>10} {_med(r.entry_ms):>9} {_pct(r.missed / n):>7} "
                    f"{r.caller_timeouts:7d}"
                )
        print(
            f"{'target':<{w}} {'busy full ms/s':>14} {'busy compact':>12} {'batch full':>10} "
            f"{'executed late':>13} {'wasted ms/s':>11} {'% protected':>11}  rules/statuses of non-ok"
        )
        for name in names:
            report = reports[name][index]
            waste_ = report.waste
            top = ", ".join(f"{k} {v}" for k, v in total(report.rows).rules.most_common(4))
            if waste_ is None:
                print(f"{name:<{w}} {'(Triton statistics unavailable for this window)':>60}  {top}")
                continue
            protected = PROTECTED_UTILIZATION * 1000.0 * 4
            print(
                f"{name:<{w}} {waste_.busy_ms.get(PRIMARY, 0.0) / d:14.0f} "
                f"{waste_.busy_ms.get(FALLBACK, 0.0) / d:12.0f} "
                f"{waste_.mean_batch(PRIMARY):10.2f} {waste_.not_on_time:13d} {waste_.wasted_ms / d:11.1f} "
                f"{100 * waste_.wasted_ms / d / protected:11.2f}  {top}"
            )


def ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}x" if b > 0 else "   inf"


def class_rows(report: PhaseReport) -> dict[str, ClassRow]:
    return {**report.rows, "all": total(report.rows)}


def print_ratios(reports: dict[str, list[PhaseReport]]) -> None:
    if "gateway" not in reports:
        return
    baselines = [b for b in BASELINES if b in reports]
    if not baselines:
        return
    print("\n== on-time goodput ratios: gateway / each baseline (fallback and reduced answers included) ==")
    print(f"{'phase':<9} {'class':<5} " + " ".join(f"{'vs ' + b:>{NAME_W + 3}}" for b in baselines))
    for index, phase in enumerate(reports["gateway"]):
        gw = class_rows(phase)
        for cls in (*CLASSES, "all"):
            cells = [
                f"{ratio(gw[cls].ok, class_rows(reports[b][index])[cls].ok):>{NAME_W + 3}}" for b in baselines
            ]
            print(f"{phase.phase.name:<9} {cls:<5} " + " ".join(cells))
    print(f"\n== gateway / BEST baseline (the max over {', '.join(baselines)}, per cell; [which one]) ==")
    cell_w = 9 + NAME_W
    print(
        f"{'phase':<9} {'class':<5} " + " ".join(f"{kind_ + ' goodput':>{cell_w}}" for kind_, _ in GOODPUTS)
    )
    for index, phase in enumerate(reports["gateway"]):
        gw = class_rows(phase)
        for cls in (*CLASSES, "all"):
            cells = []
            for _, value in GOODPUTS:
                of = {b: value(class_rows(reports[b][index])[cls]) for b in baselines}
                best = max(baselines, key=of.__getitem__)  # the first of equals
                cells.append(f"{ratio(value(gw[cls]), of[best]) + ' [' + best + ']':>{cell_w}}")
            print(f"{phase.phase.name:<9} {cls:<5} " + " ".join(cells))


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
    if scenario.load_factor != 1.0:
        lf = scenario.load_factor
        print(
            f"load factor {lf:g}: every phase's arrivals x{lf:g}: normal "
            f"{lf * sheet['execution.protected_pct']:.2f} %, surge {lf * sheet['overload.surge_pct']:.2f} % "
            "of protected (modeled)"
        )
    for name, phases in reports.items():
        for report in phases:
            p = report.phase
            offered = (
                sum(report.rows[c].offered * scenario.device_ms(PRIMARY, c) for c in CLASSES) / p.duration_s
            )
            line = (
                f"measured {name:<{NAME_W}} {p.name:<8}: "
                f"offered {offered:7.1f} ms/s = {100 * offered / protected:6.2f} %"
            )
            if name.startswith("gateway") or name == FALLBACK_TARGET:
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
            print(f"{name:<{NAME_W}} {phase.name:<8}: " + ("; ".join(cells) or "no responses"))


def print_targets(scenario: Scenario, reports: dict[str, list[PhaseReport]]) -> None:
    if "gateway" not in reports:
        return
    gw = reports["gateway"]
    print("\n== the issue's targets (gateway) ==")
    for report in gw:
        row = total(report.rows)
        strict, loose = row.attain_strict(), row.attain()
        mark = "met" if strict >= 0.99 else "NOT met"
        print(
            f"{report.phase.name:<8}: ON TIME of ALL offered {_pct(row.on_time())} % (headline); "
            f"admitted interactive within deadline {_pct(strict)} % "
            f"(late rejections as misses; {_pct(loose)} % without them) -> target >= 99 %: {mark}"
        )
    surge = next((i for i, r in enumerate(gw) if r.phase.name == "surge"), None)
    for base in BASELINES:
        if base not in reports or surge is None:
            continue
        g = total(gw[surge].rows).ok
        b = total(reports[base][surge].rows).ok
        value = g / b if b else math.inf
        mark = "met" if value >= 1.5 else "NOT met"
        print(f"surge on-time goodput vs {base:<{NAME_W}}: {value:5.2f}x -> target >= 1.5x: {mark}")
    wasted = [r.waste.wasted_ms for r in gw if r.waste is not None]
    if len(wasted) == len(gw):
        total_s = sum(r.phase.duration_s for r in gw)
        pct = 100 * sum(wasted) / (scenario.protected_ms_per_s * total_s)
        mark = "met" if pct <= 1.0 else "NOT met"
        print(
            f"wasted device-ms, whole run: {sum(wasted):.0f} ms = {pct:.2f} % of protected capacity "
            f"-> <= 1 %: {mark}"
        )


def print_ladder_quality(
    results: dict[str, RunResult], scenario: Scenario, quality: Quality, tail_s: float = 10.0
) -> None:
    """Per gateway run and phase: the share of time the ladder was at step 0 (from the log), and
    the degraded share of on-time answers; then the recovery phase's last ``tail_s`` seconds."""
    runs = {k: v for k, v in results.items() if k.startswith("gateway")}
    if not runs:
        return
    print("\n== gateway: ladder at step 0 (full-v18 pool, from the log) and degraded answers ==")
    for name, result in runs.items():
        for p in scenario.phases:
            row = total(tabulate(result.outcomes, scenario, quality, p.start_s, p.end_s))
            share = step0_share(result.ladder, p.start_s, p.end_s)
            print(
                f"{name:<{NAME_W}} {p.name:<8}: ladder at step 0 {_pct(share)} % of the phase; degraded "
                f"{_pct(degraded_share(row))} % of on-time answers "
                f"(fallback {row.fallback}, reduced {row.reduced} of {row.ok})"
            )
        recovery = scenario.phase("recovery")
        if recovery is None:
            continue
        start = max(recovery.start_s, recovery.end_s - tail_s)
        row = total(tabulate(result.outcomes, scenario, quality, start, recovery.end_s))
        print(
            f"{name:<{NAME_W}} recovery, last {recovery.end_s - start:g} s "
            f"({start:.0f}-{recovery.end_s:.0f} s): degraded {_pct(degraded_share(row))} % of on-time "
            "answers "
            f"(fallback {row.fallback}, reduced {row.reduced} of {row.ok}); ladder at step 0 "
            f"{_pct(step0_share(result.ladder, start, recovery.end_s))} %"
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
            f"{name:<{NAME_W}} requests {len(result.outcomes):5d}  "
            f"send lag p99 {p99:5.1f} ms max {lags[-1] if lags else 0:6.1f} ms"
            f"  wall {result.wall_s:5.1f} s"
        )
        for note in result.notes:
            print(f"{'':<{NAME_W}} NOTE: {note}")
        if name.startswith("gateway"):
            print(f"{'':<{NAME_W}} ladder (full-v18 pool, from the log): {ladder}")
            print(f"{'':<{NAME_W}} orchid.ladder_step on responses: {dict(sorted(steps.items()))}")
            for t, step, why in result.ladder_log:
                implied = implied_correction(result, scenario, t, why)
                print(f"{'':<{NAME_W}}   {t:6.1f} s -> {step}: {why[:150]}{implied}")


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
        FALLBACK_TARGET: "#9467bd",
        "gateway": "#1f77b4",
        KILL_TARGET: "#1f77b4",
    }
    surge = scenario.phase("surge")
    for ax, (title, cls, names) in zip(axes[:, 0], panels, strict=True):
        if surge is not None:
            ax.axvspan(surge.start_s, surge.end_s, color="0.92", zorder=0)
        reference = results[names[0]] if names[0] in results else next(iter(results.values()))
        ax.plot(x, offered_series(reference, cls, seconds), color="0.45", ls="--", lw=1.2, label="offered")
        ladder_owner = "gateway" if cls is not None else KILL_TARGET
        for name in names:
            if name not in results:
                continue
            ax.plot(x, goodput_series(results[name], cls, seconds), color=colors[name], lw=1.8, label=name)
            if name.startswith("gateway") or name == FALLBACK_TARGET:
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
        ax.legend(loc="lower left", fontsize=8, ncol=4, framealpha=0.9)
    load = f", load factor {scenario.load_factor:g}" if scenario.load_factor != 1.0 else ""
    axes[-1, 0].set_xlabel(
        f"seconds (grey: surge x{scenario.surge_factor:g}); bins of 1 s by send time; "
        f"time factor {scenario.time_factor:g}{load}"
    )
    fig.suptitle(
        f"orchid-gateway vs Triton direct under a {scenario.surge_factor:g}x surge{load} "
        "(seed's Orchid mix, 4 emulated devices)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def parse_setting(item: str) -> tuple[str, float]:
    key, _, value = item.partition("=")
    number = float(value)
    return key.strip(), int(number) if number.is_integer() else number


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
        help="seconds into the run to SIGKILL the gateway's Triton in an extra run "
        "(default: 1/3 into the surge; without a surge phase, or 0: no kill run)",
    )
    parser.add_argument(
        "--kill-for", type=float, default=3.0, help="seconds Triton stays down before its restart"
    )
    parser.add_argument(
        "--load-factor",
        type=float,
        default=1.0,
        help="multiplies every phase's arrival multiplier (e.g. 0.893 puts the normal phase at 87 %% "
        "of the protected envelope); the warm-up stays at 0.5x",
    )
    parser.add_argument(
        "--tuned-queue-size",
        type=int,
        default=None,
        help="max_queue_size of tuned Triton (triton-tuned, triton-tuned-fallback): fixes that "
        "dimension of the sweep; with --tuned-batching too, no sweep",
    )
    parser.add_argument(
        "--tuned-batching",
        choices=("on", "off", "none"),
        default=None,
        help="tuned Triton's batching: on (dynamic batcher, batches up to 8), off (dynamic batcher "
        "with max_batch_size 1: the queue policy without batches), none (no dynamic_batching "
        "block: no queue policy either); fixes that dimension of the sweep",
    )
    parser.add_argument(
        "--sweep-sizes",
        type=int,
        nargs="+",
        default=[2, 4, 8, 16],
        help="max_queue_size values of the sweep (default 2 4 8 16)",
    )
    parser.add_argument(
        "--sweep-s",
        type=float,
        default=12.0,
        help="seconds of each sweep run at the surge multiplier (x load factor), after the usual "
        "warm-up; 0: no sweep (max_queue_size 4, batching on unless fixed by the flags above)",
    )
    parser.add_argument(
        "--sweep-client",
        choices=("triton-tuned", FALLBACK_TARGET),
        default="triton-tuned",
        help="the client of the sweep's runs (default triton-tuned: no client fallback)",
    )
    parser.add_argument(
        "--base-port", type=int, default=16100, help="ports BASE+1..BASE+6 (Triton) and BASE+8 are used"
    )
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
        "--gateway-limit",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="diagnostic: a `limits:` setting of the gateway config, e.g. short_lane_devices=2",
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


@dataclass
class SweepRun:
    tuned: TunedConfig
    result: RunResult
    row: ClassRow  # both classes, the sweep's one phase


def sweep_configs(args: argparse.Namespace) -> list[TunedConfig]:
    """The grid: queue sizes x batching on/off, plus one run without a dynamic_batching block
    (queue size meaningless there); a flag fixes its dimension."""
    sizes = [args.tuned_queue_size] if args.tuned_queue_size is not None else list(args.sweep_sizes)
    batchings = [args.tuned_batching] if args.tuned_batching else ["on", "off", "none"]
    grid = [TunedConfig(q, b) for b in batchings if b != "none" for q in sizes]
    if "none" in batchings:
        grid.append(TunedConfig(args.tuned_queue_size or 0, "none"))
    return grid


async def run_sweep(
    opts: Options, configs: Sequence[TunedConfig], client: str, scenario: Scenario, quality: Quality
) -> list[SweepRun]:
    """Each configuration on a fresh Triton: the usual warm-up, then ``scenario``'s one phase."""
    arrivals = poisson_schedule(scenario.phases, {c: scenario.rate(c) for c in CLASSES}, opts.seed + 2)
    runs: list[SweepRun] = []
    for index, tuned in enumerate(configs):
        print(f"sweep {index + 1}/{len(configs)}: {tuned.label} ...", file=sys.stderr, flush=True)
        run_opts = replace(opts, scenario=scenario, arrivals=arrivals, tuned=tuned)
        name = f"sweep-{index}-q{tuned.queue_size}-{tuned.batching}"
        result = await run_target(client, run_opts, run=name)
        phase = scenario.phases[0]
        runs.append(
            SweepRun(tuned, result, total(tabulate(result.outcomes, scenario, quality, 0.0, phase.end_s)))
        )
    return runs


def print_sweep(runs: Sequence[SweepRun], chosen: TunedConfig, client: str, scenario: Scenario) -> None:
    phase = scenario.phases[0]
    d = phase.duration_s
    print(
        f"\n== tuned Triton sweep: client {client}, {d:g} s at x{phase.multiplier:g} (surge x load factor) "
        "after the warm-up, each on a fresh Triton; own arrival schedule (seed + 2) =="
    )
    w = max(len(r.tuned.label) for r in runs)
    print(
        f"{'configuration':<{w}} {'good/s':>6} {'full/s':>6} {'qual/s':>6} {'ON-TIME%':>8} "
        f"{'entry%':>6} {'late%':>5} {'retry%':>6} {'missed%':>7} {'batch':>5}  notes"
    )
    for run in runs:
        r = run.row
        n = max(1, r.offered)
        mark = "  <- chosen" if run.tuned == chosen else ""
        notes = "; ".join(note.splitlines()[0] for note in run.result.notes)
        counters = device_time(run.result.snapshots, phase.start_s, phase.end_s)
        executed, batches = (counters[1], counters[2]) if counters else ({}, {})
        batch = executed.get(PRIMARY, 0) / batches[PRIMARY] if batches.get(PRIMARY) else math.nan
        print(
            f"{run.tuned.label:<{w}} {r.ok / d:6.1f} {r.full / d:6.1f} {r.quality / d:6.2f} "
            f"{_pct(r.on_time()):>8} {_pct(r.entry / n):>6} {_pct(r.late / n):>5} {_pct(r.retried / n):>6} "
            f"{_pct(r.missed / n):>7} {batch:5.2f}{mark}{'  ' + notes if notes else ''}"
        )
    print(f"chosen (best on-time goodput in the sweep): {chosen.label}")


async def run_all(
    opts: Options, targets: Sequence[str], sweep: Callable[[], Awaitable[TunedConfig]] | None = None
) -> dict[str, RunResult]:
    """The sweep first (it picks ``opts.tuned``), then each target; one event loop for all."""
    if sweep is not None:
        opts.tuned = await sweep()
    results: dict[str, RunResult] = {}
    for target in targets:
        print(f"running {target} ...", file=sys.stderr, flush=True)
        results[target] = await run_target(target, opts)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prices = load_prices()
    quality = load_quality()
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
        load_factor=args.load_factor,
    )
    if not scenario.phases:
        print("every phase has zero length: nothing to measure", file=sys.stderr)
        return 2
    rates = {cls: scenario.rate(cls) for cls in CLASSES}
    arrivals = poisson_schedule(scenario.phases, rates, args.seed)
    warmup = poisson_schedule((Phase("warm-up", 0.0, 3.0, 0.5),), rates, args.seed + 1)
    if args.kill_at >= 0:
        kill_at = args.kill_at
    else:
        kill_at = args.normal_s + args.surge_s / 3.0 if args.surge_s > 0 else 0.0
    targets = list(args.targets) + ([KILL_TARGET] if kill_at > 0 else [])
    configs = sweep_configs(args)
    sweeping = (
        len(configs) > 1 and args.sweep_s > 0 and any(t in targets for t in ("triton-tuned", FALLBACK_TARGET))
    )
    if len(configs) == 1:
        tuned, how = configs[0], "fixed by --tuned-queue-size/--tuned-batching"
    else:
        tuned = TunedConfig(args.tuned_queue_size or 4, args.tuned_batching or "on")
        how = "chosen by the sweep" if sweeping else "default, not swept"
    sweep_scenario = replace(scenario, normal_s=0.0, surge_s=args.sweep_s, recover_s=0.0)
    sweep: list[SweepRun] = []
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
            tuned=tuned,
            kill_at=kill_at,
            kill_for=args.kill_for,
            gateway_pythonpath=args.gateway_pythonpath,
            gateway_inflight=args.gateway_inflight,
            gateway_ladder=dict(parse_setting(item) for item in args.gateway_ladder) or None,
            gateway_limits=dict(parse_setting(item) for item in args.gateway_limit) or None,
            shared_devices=args.fallback_devices == "shared",
            seed=args.seed,
        )

        async def do_sweep() -> TunedConfig:
            sweep.extend(await run_sweep(opts, configs, args.sweep_client, sweep_scenario, quality))
            return max(sweep, key=lambda run: run.row.ok).tuned  # the first of equals: the grid's order

        results = asyncio.run(run_all(opts, targets, do_sweep if sweeping else None))
        tuned = opts.tuned
    phases = "/".join(f"{s:g}" for s in (args.normal_s, args.surge_s, args.recover_s))
    print(
        f"surge benchmark: time factor {scenario.time_factor:g}, seed {args.seed}, "
        f"{len(arrivals)} requests per target, phases {phases} s (normal/surge/recovery; zero-length "
        f"ones left out), load factor {args.load_factor:g}, total wall {time.monotonic() - started:.0f} s"
    )
    if any(t in targets for t in ("triton-tuned", FALLBACK_TARGET)):
        print(f"tuned Triton (triton-tuned, {FALLBACK_TARGET}): {tuned.label} ({how})")
    print(
        "modeled quality (routes/*.yaml): "
        + ", ".join(f"{k} {v:g}" for k, v in quality.scores.items())
        + f" (none: {PRIMARY}; reduced_output: {PRIMARY} capped; fallback: {FALLBACK})"
    )
    if sweep:
        print_sweep(sweep, tuned, args.sweep_client, sweep_scenario)
    if args.fallback_devices == "shared":
        print(
            f"shared devices: {FALLBACK} runs on the same {scenario.fleet} emulated devices as "
            f"{PRIMARY} (one instance of each per device); busy ms/s below add up on those devices"
        )
    reports = {name: analyse(result, scenario, quality) for name, result in results.items()}
    main_reports = {k: v for k, v in reports.items() if k != KILL_TARGET}
    print_phase_tables({k: v for k, v in results.items() if k != KILL_TARGET}, main_reports)
    print_ratios(main_reports)
    print_arithmetic(scenario, scaled_worksheet(scenario), main_reports)
    print_estimates(results, scenario)
    print_targets(scenario, main_reports)
    print_ladder_quality(results, scenario, quality)
    if KILL_TARGET in results:
        print_phase_tables({KILL_TARGET: results[KILL_TARGET]}, {KILL_TARGET: reports[KILL_TARGET]})
        print_kill(results[KILL_TARGET], scenario)
    print_client(results, scenario)
    if plot(results, scenario, args.plot):
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
