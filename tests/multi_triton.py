"""Helpers for live tests of several real Tritons behind one gateway: each Triton is one device
group (its own emulated devices, ``compact-v11`` beside ``full-v18`` on them), the gateway runs
as its own process (so its CPU can be measured apart from the load generator's), and an
open-loop driver sends a phased workload and records every answer's provenance.

The Tritons are ``gateway.backends.local.LocalTriton`` (``kill()`` is the fault, ``start()``
the restart), each on a free port, on a copy of the example repository whose two models have
one instance per emulated device and run on shared device locks (the emulator's
``ORCHID_DEVICE_DIR`` mode; ``tests/test_emulator_devices.py`` checks that mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from gateway.backends.local import LocalTriton, free_port
from orchid_tools import harness
from tests.conftest import MODEL_REPOSITORY

INFER = "/inference.GRPCInferenceService/ModelInfer"
MODELS = ("full-v18", "compact-v11")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def emulator_repository(into: Path, devices: int) -> Path:
    """full-v18 and compact-v11 with one instance per emulated device each (the emulator's
    ``model.py`` imports ``../../../emulator``, so the copy keeps that layout)."""
    repository = into / "model_repository"
    for model in MODELS:
        shutil.copytree(MODEL_REPOSITORY / model, repository / model)
        path = repository / model / "config.pbtxt"
        text, count = re.subn(r"count: \d+", f"count: {devices}", path.read_text())
        assert count == 1, path
        path.write_text(text)
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", into / "emulator")
    return repository


@dataclass
class DeviceGroup:
    """One Triton standing for one device group of ``devices`` emulated devices."""

    name: str
    devices: int
    triton: LocalTriton

    @classmethod
    def create(
        cls, name: str, repository: Path, workdir: Path, devices: int, time_factor: float
    ) -> DeviceGroup:
        env = {"ORCHID_DEVICE_DIR": str(workdir / "devices"), "ORCHID_DEVICES": str(devices)}
        triton = LocalTriton(repository, workdir / "triton", time_factor=time_factor, env=env)
        return cls(name, devices, triton)

    def backend(self, time_factor: float) -> dict[str, Any]:
        """The gateway's ``backends[]`` entry for this group."""
        return {
            "name": self.name,
            "address": self.triton.address,
            "labels": {"cell": "eu-restricted", "device_group": self.name},
            "devices": self.devices,
            "max_inflight_per_device": 2,
            "shared_devices": True,
            "time_scale": time_factor,
        }


def stop_all(groups: Sequence[DeviceGroup]) -> None:
    """End the groups' Tritons: killed, as ``conftest.own_triton`` ends a test's own server."""
    for group in groups:
        group.triton.kill()


def start_all(groups: Sequence[DeviceGroup]) -> None:
    """Start the groups' Tritons side by side (each waits for its own readiness); on a
    failure, stop the ones that did start."""
    errors: list[BaseException] = []

    def start(group: DeviceGroup) -> None:
        try:
            group.triton.start()
        except BaseException as error:
            errors.append(error)

    import threading

    threads = [threading.Thread(target=start, args=(g,), daemon=True) for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        stop_all(groups)
        raise errors[0]


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of every live process in a process group (a Triton and its Python stubs)."""
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return float(sum(values) - idle), float(sum(values))


class GatewayProcess(harness.GatewayProcess):
    """The harness's ``orchid-gateway serve`` process on a config of the test's own, with
    /metrics on a free port."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.metrics_port = free_port()
        telemetry = {**config.get("telemetry", {}), "metrics_listen": f"127.0.0.1:{self.metrics_port}"}
        super().__init__({**config, "telemetry": telemetry}, workdir)
        self.config = {**config, "listen": self.address, "telemetry": telemetry}

    def cpu_s(self) -> float:
        return proc_cpu_s(self.process.pid) if self.process is not None else 0.0

    def metrics(self) -> dict[tuple[str, str], float]:
        """The gateway's /metrics as {(metric, first label value): value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2.0) as reply:
            text = reply.read().decode()
        out: dict[tuple[str, str], float] = {}
        for line in text.splitlines():
            match = re.match(r'^(\w+)\{\w+="([^"]*)"[^}]*\} (\S+)$', line)
            if match:
                out[(match.group(1), match.group(2))] = float(match.group(3))
        return out


def infer_request(model: str, input_tokens: int, output_tokens: int) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, input_tokens])
    request.raw_input_contents.append(np.arange(input_tokens, dtype=np.int32).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = output_tokens
    return request.SerializeToString()


async def warm_instances(address: str, devices: int, shapes: Sequence[tuple[int, int]]) -> None:
    """One concurrent request per instance and shape on both models, straight to Triton: an
    instance's first execution is slow and must not land in the measurement."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for model in MODELS:
            for input_tokens, output_tokens in shapes:
                request = service_pb2.ModelInferRequest.FromString(
                    infer_request(model, input_tokens, output_tokens)
                )
                request.parameters["max_output_tokens"].int64_param = output_tokens
                raw = request.SerializeToString()
                await asyncio.gather(
                    *(call(raw, timeout=30.0) for _ in range(devices)), return_exceptions=True
                )


@dataclass(frozen=True)
class ArrivalClass:
    name: str
    key: str  # the tenant's API key
    rate_per_s: float
    input_tokens: int
    output_tokens: int
    deadline_s: float


@dataclass(slots=True)
class Answer:
    klass: str
    phase: str
    sent: float  # seconds after the run's start
    lag_ms: float  # send time minus scheduled time
    status: str
    rule: str = ""
    approximation: str = ""
    route_reason: str = ""
    ladder_step: int = -1
    fallback_ladder_step: int = -1

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def degraded(self) -> bool:
        return self.ok and self.approximation not in ("", "none")

    @property
    def degraded_by_ladder(self) -> bool:
        """Degraded because of the overload ladder: diverted to the fallback by the plan
        (``fallback:overload``) or its shedding (``fallback:primary_shed``), or the primary's
        output capped (``reduced_output`` on the primary). Not: a fallback because the primary
        could not finish in time (``fallback:primary_infeasible`` / ``primary_late``), which a
        CPU-starved machine causes at any step."""
        if not self.degraded:
            return False
        return self.route_reason in ("fallback:overload", "fallback:primary_shed") or (
            self.route_reason == "primary" and "reduced_output" in self.approximation
        )


@dataclass
class Sample:
    """One /metrics scrape."""

    t: float  # seconds after the run's start
    steps: dict[str, int]  # pool -> ladder step
    offered: dict[str, float]  # pool -> offered ms/s (its ladder's evidence)
    ready: dict[str, bool]  # backend -> healthy


@dataclass
class Phase:
    """A phase of the workload: every arrival class's rate times ``multiplier``, or times its
    own entry in ``per_class``. ``until`` ends it early (checked once per second of arrivals)
    or late (it runs until both ``duration_s`` and ``until`` are met when ``extend`` is set)."""

    name: str
    duration_s: float
    multiplier: float = 1.0
    per_class: dict[str, float] = field(default_factory=dict)
    until: Callable[[], bool] | None = None  # with extend: the phase lasts until this holds too

    def rate(self, klass: ArrivalClass) -> float:
        return klass.rate_per_s * self.per_class.get(klass.name, self.multiplier)


@dataclass
class Run:
    answers: list[Answer]
    samples: list[Sample]
    phases: list[tuple[str, float, float]]  # name, start, end (seconds after the run's start)
    events: dict[str, float]


async def drive(
    address: str,
    classes: Sequence[ArrivalClass],
    phases: Sequence[Phase],
    *,
    seed: int,
    hooks: Sequence[tuple[str, float, Callable[[], Any]]] = (),
    scrape: Callable[[], dict[tuple[str, str], float]] | None = None,
    scrape_every_s: float = 0.25,
) -> Run:
    """Open loop: Poisson arrivals per class, drawn one second at a time at the current phase's
    rates, each sent at its scheduled time whatever is outstanding. ``hooks``: (phase name,
    seconds into it, blocking function) run in a thread at that time (a fault, a restart);
    each hook's completion time is recorded in ``events`` under the function's name."""
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(seed)
    payloads = {c.name: infer_request("full-v18", c.input_tokens, c.output_tokens) for c in classes}
    answers: list[Answer] = []
    samples: list[Sample] = []
    events: dict[str, float] = {}
    spans: list[tuple[str, float, float]] = []
    tasks: set[asyncio.Task[None]] = set()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        await channel.channel_ready()
        t0 = loop.time() + 0.1

        def now() -> float:
            return loop.time() - t0

        async def one(klass: ArrivalClass, phase: str, at: float) -> None:
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the open-loop schedule, not synchronisation
            answer = Answer(klass.name, phase, at, (now() - at) * 1000.0, "OK")
            try:
                raw = await call(
                    payloads[klass.name],
                    metadata=(("authorization", f"Bearer {klass.key}"),),
                    timeout=klass.deadline_s,
                )
                params = service_pb2.ModelInferResponse.FromString(raw).parameters
                answer.approximation = params["orchid.approximation"].string_param
                answer.route_reason = params["orchid.route_reason"].string_param
                answer.ladder_step = int(params["orchid.ladder_step"].int64_param)
                if "orchid.fallback_ladder_step" in params:
                    answer.fallback_ladder_step = int(params["orchid.fallback_ladder_step"].int64_param)
            except grpc.aio.AioRpcError as error:
                answer.status = error.code().name
                answer.rule = str(dict(error.trailing_metadata() or ()).get("orchid-rule", ""))
            answers.append(answer)

        async def scraper() -> None:
            assert scrape is not None
            while True:
                t = now()
                with contextlib.suppress(OSError):
                    values = await asyncio.to_thread(scrape)
                    samples.append(
                        Sample(
                            t,
                            {p: int(v) for (m, p), v in values.items() if m == "orchid_ladder_step"},
                            {
                                p: v
                                for (m, p), v in values.items()
                                if m == "orchid_pool_offered_accelerator_ms_per_second"
                            },
                            {b: v > 0 for (m, b), v in values.items() if m == "orchid_backend_ready"},
                        )
                    )
                await asyncio.sleep(scrape_every_s)  # the sampling period of an observation

        async def hook(fn: Callable[[], Any], at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))  # the fault's place in the schedule
            events[f"{fn.__name__}_at"] = now()
            await asyncio.to_thread(fn)
            events[f"{fn.__name__}_done"] = now()

        scraping = loop.create_task(scraper()) if scrape is not None else None
        hook_tasks: list[asyncio.Task[None]] = []
        start = 0.0
        for phase in phases:
            for name, offset, fn in hooks:
                if name == phase.name:
                    hook_tasks.append(loop.create_task(hook(fn, start + offset)))
            second = 0.0
            while second < phase.duration_s or (phase.until is not None and not phase.until()):
                width = min(1.0, phase.duration_s - second) if second < phase.duration_s else 1.0
                for klass in classes:
                    count = int(rng.poisson(phase.rate(klass) * width))
                    for at in np.sort(rng.uniform(start + second, start + second + width, size=count)):
                        task = loop.create_task(one(klass, phase.name, float(at)))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                second += width
                # Draw the next second's arrivals shortly before it begins.
                await asyncio.sleep(max(0.0, t0 + start + second - 0.3 - loop.time()))
            spans.append((phase.name, start, start + second))
            start += second
        while tasks:
            await asyncio.wait(set(tasks))
        await asyncio.gather(*hook_tasks)
        if scraping is not None:
            scraping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraping
    return Run(answers, samples, spans, events)
