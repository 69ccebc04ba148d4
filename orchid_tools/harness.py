"""The live harness shared by ``bench/`` and ``tests/``: one way to run the gateway as its own
process in front of Triton(s) a test or benchmark started, and one open-loop sender.

It owns:

* :func:`example_config`: the example stack's ``gateway.yaml`` minus ``local_triton`` (the
  caller starts its own Tritons), every relative ``*_file`` / ``*_dir`` path made absolute (the
  config is written elsewhere), with the caller's ``backends`` and overrides;
  :func:`example_backend` (a backend entry like the example's local Triton) and
  :func:`scaled_classes` (the classes' ``*_ms`` times the emulator's time factor) to go in it.
* :class:`GatewayProcess`: ``orchid-gateway serve --config`` (``python -m orchid_tools``) on such
  a config, in its own session (its own GIL, its CPU measurable apart from the load
  generator's, and ``kill -9`` takes all of it), output to a log file, ready when
  ``ServerReady`` says so (a bounded wait), stopped with SIGTERM then SIGKILL; a context
  manager.
* :func:`send_open_loop`: start one coroutine per arrival at its scheduled time whatever is
  still outstanding (an open loop), run hooks at their times, and wait for all.
* :func:`memory_example`: the example config's local Triton as an in-process ``MemoryBackend``
  and its ``BackendHandle``, for what runs the request path without a Triton
  (``bench/request_path.py``, in-process tests).

The scenario, phase and arrival models of a simulated run are :mod:`orchid_tools.simulate`'s.
The runtime never imports this module (import-linter: ``gateway`` does not import
``orchid_tools``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import yaml
from tritonclient.grpc import service_pb2

from gateway.backends.local import free_port, stop_process_group
from gateway.backends.memory import MemoryBackend, MemoryModel
from gateway.config import GatewayConfig, RouteTable
from gateway.core.memory import DeviceMemory
from gateway.exchange import BackendHandle
from gateway.yaml_source import read_yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "orchid"
EXAMPLE_CONFIG = EXAMPLES / "gateway.yaml"
READY = "/inference.GRPCInferenceService/ServerReady"


def example_settings() -> dict[str, Any]:
    """``examples/orchid/gateway.yaml`` as written (its paths relative to it)."""
    settings: dict[str, Any] = read_yaml(EXAMPLE_CONFIG).value()
    return settings


def scaled_classes(time_factor: float) -> dict[str, Any]:
    """The example's classes with every ``*_ms`` constant times ``time_factor`` (the
    emulator's: the seed's world with time stretched by f)."""
    return {
        name: {key: (v * time_factor if key.endswith("_ms") else v) for key, v in settings.items()}
        for name, settings in example_settings()["classes"].items()
    }


def example_backend(
    name: str, address: str, time_scale: float | None = None, **changes: Any
) -> dict[str, Any]:
    """A ``backends:`` entry for a Triton at ``address`` standing for the example's local one:
    its labels, devices and ``max_inflight_per_device``, then ``time_scale`` (the emulator's
    time factor; None: left out) and ``changes``."""
    local = example_settings()["local_triton"]
    backend: dict[str, Any] = {
        "name": name,
        "address": address,
        "labels": local["labels"],
        "devices": local["devices"],
        "max_inflight_per_device": local["max_inflight_per_device"],
    }
    if time_scale is not None:
        backend["time_scale"] = time_scale
    return {**backend, **changes}


def memory_example(
    config: GatewayConfig, routes: RouteTable, *, extra: Iterable[MemoryModel] = (), time_factor: float = 0.0
) -> tuple[MemoryBackend, BackendHandle]:
    """The example config's local Triton as an in-process ``MemoryBackend`` named ``local``:
    every non-streaming route's backend model with as many instances as the local Triton's
    devices (and ``extra`` models), at ``time_factor`` (0: every execution returns at once);
    and its ``BackendHandle`` with the local Triton's labels, devices and device memory."""
    local = config.local_triton
    if local is None:
        raise ValueError("the config runs no local Triton to stand in for")
    models = {
        route.backend_model: MemoryModel(
            name=route.backend_model, profile=routes.profiles[route.profile], instances=local.devices
        )
        for route in routes.models.values()
        if not route.streaming
    }
    models.update({model.name: model for model in extra})
    backend = MemoryBackend("local", models, time_factor=time_factor)
    handle = BackendHandle(
        backend,
        dict(local.labels),
        local.devices,
        local.max_inflight_per_device,
        0.001 if time_factor == 0 else time_factor,
        False,
        DeviceMemory.from_gib(local.device_memory_gib, local.runtime_reserve_gib),
    )
    return backend, handle


def example_config(
    backends: Iterable[Mapping[str, Any]] | None = None,
    *,
    without: Iterable[str] = (),
    **overrides: Any,
) -> dict[str, Any]:
    """The example stack's gateway config for a gateway in front of Tritons of the caller's:
    every key of ``examples/orchid/gateway.yaml`` but ``local_triton``, ``listen`` (a
    :class:`GatewayProcess` takes a free port unless told) and ``without``, its
    relative ``*_file`` / ``*_dir`` paths made absolute (tenants, routes and policies are the
    repository's own wherever the config is written), then ``backends`` and ``overrides``."""
    base = example_settings()
    skip = {"local_triton", "listen", *without}
    config: dict[str, Any] = {}
    for key, value in base.items():
        if key in skip:
            continue
        if (key.endswith("_file") or key.endswith("_dir")) and isinstance(value, str):
            value = str((EXAMPLES / value).resolve())
        config[key] = value
    if backends is not None:
        config["backends"] = [dict(backend) for backend in backends]
    config.update(overrides)
    return config


class GatewayProcess:
    """``python -m orchid_tools serve --config`` in its own process and session.

    ``config`` is a config (written to ``<workdir>/<name>.yaml``) or the path of one; the
    address is ``listen``, else a free port (passed as ``--listen``: the config's is not
    used). ``command`` replaces ``python -m orchid_tools`` (a diagnostic variant of the
    gateway); ``log_level`` None leaves the gateway's default; ``env`` is added to this
    process's environment (the repository and ``pythonpath`` go first on ``PYTHONPATH``). The
    log is ``<workdir>/<name>.log``, appended to across restarts."""

    def __init__(
        self,
        config: Mapping[str, Any] | Path,
        workdir: Path,
        *,
        name: str = "gateway",
        listen: str | None = None,
        command: Sequence[str] | None = None,
        log_level: str | None = "WARNING",
        env: Mapping[str, str] | None = None,
        pythonpath: str | None = None,
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 15.0,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.listen = listen or f"127.0.0.1:{free_port()}"
        if isinstance(config, Path):
            self.config_path = config
        else:
            self.config_path = workdir / f"{name}.yaml"
            self.config_path.write_text(yaml.safe_dump({**config, "listen": self.listen}))
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self.command = list(command) if command is not None else [sys.executable, "-m", "orchid_tools"]
        self.log_level = log_level
        self.env = dict(env or {})
        self.pythonpath = pythonpath
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return self.listen

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} not started"
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float | None = None) -> None:
        """Start the process and wait (at most ``timeout_s``, default the constructor's) until
        ``ServerReady`` answers ready; on failure stop it and raise ``RuntimeError`` with the
        log's tail."""
        env = {**os.environ, **self.env}
        paths = (self.pythonpath, str(REPO), env.get("PYTHONPATH"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        args = [*self.command, "serve", "--config", str(self.config_path), "--listen", self.listen]
        if self.log_level is not None:
            args += ["--log-level", self.log_level]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.wait_ready(self.ready_timeout_s if timeout_s is None else timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        process = self.process
        assert process is not None
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.listen) as channel:
            ready = channel.unary_unary(
                READY,
                request_serializer=service_pb2.ServerReadyRequest.SerializeToString,
                response_deserializer=service_pb2.ServerReadyResponse.FromString,
            )
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(grpc.RpcError):
                    if ready(service_pb2.ServerReadyRequest(), timeout=1.0).ready:
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")
                time.sleep(0.2)  # polling a condition (readiness), with a bound

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self, timeout_s: float | None = None, *, session: bool = True) -> None:
        """SIGTERM (the gateway drains), SIGKILL after ``timeout_s`` (default the
        constructor's), then SIGKILL whatever is left in its session; ``session=False``: the
        gateway alone, nothing after it exits (a test of what it stops itself). ``process``
        stays (its ``returncode``); stopping again does nothing."""
        process = self.process
        if process is None:
            return
        wait_s = self.stop_timeout_s if timeout_s is None else timeout_s
        if session:
            stop_process_group(process, wait_s)
        elif process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def kill(self, *, session: bool = True) -> None:
        """SIGKILL the whole session at once (a crash, not a stop); ``session=False``: the
        gateway process alone (a test that what it started does not outlive it)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        if session:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait(timeout=10)

    def __enter__(self) -> GatewayProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


T = TypeVar("T")


def _scheduled_t(arrival: Any) -> float:
    return float(arrival.t)


async def send_open_loop(
    arrivals: Iterable[T],
    one: Callable[[T], Coroutine[Any, Any, None]],
    hooks: Sequence[tuple[float, Callable[[], Awaitable[None]]]] = (),
    t0: float | None = None,
    lags: list[float] | None = None,
    *,
    at: Callable[[T], float] = _scheduled_t,
    lead_s: float = 0.0,
) -> None:
    """Open loop: start ``one(arrival)`` at each arrival's scheduled time (``t0 + at(arrival)``,
    loop time; ``at`` default the arrival's ``t``; ``t0`` default now) whatever is still
    outstanding, run each hook at its time, and wait for all. The send lag (actual minus
    scheduled, ms) of every arrival goes into ``lags``.

    ``arrivals`` are in time order and drawn lazily (a generator may end the schedule). With
    ``lead_s`` 0 one sender sleeps to each time and starts the arrival's task there; with
    ``lead_s`` > 0 each arrival's task is started up to ``lead_s`` ahead and sleeps to its own
    time (``math.inf``: every task at once, each on its own timer). An exception ``one`` lets
    out is raised once every arrival is done."""
    loop = asyncio.get_running_loop()
    start = loop.time() if t0 is None else t0

    async def hook_at(t: float, fn: Callable[[], Awaitable[None]]) -> None:
        await asyncio.sleep(max(0.0, start + t - loop.time()))  # the hook's place in the schedule
        await fn()

    def sent(scheduled: float) -> None:
        if lags is not None:
            lags.append((loop.time() - start - scheduled) * 1000.0)

    async def on_time(arrival: T, scheduled: float) -> None:
        delay = start + scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the open-loop schedule, not synchronisation
        sent(scheduled)
        await one(arrival)

    hook_tasks = [loop.create_task(hook_at(t, fn)) for t, fn in hooks]
    tasks: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []

    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            errors.append(error)

    for arrival in arrivals:
        scheduled = at(arrival)
        delay = start + scheduled - lead_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the open-loop schedule, not synchronisation
        if lead_s > 0:
            task = loop.create_task(on_time(arrival, scheduled))
        else:
            sent(scheduled)
            task = loop.create_task(one(arrival))
        tasks.add(task)
        task.add_done_callback(done)
    if tasks:
        await asyncio.wait(tasks)
    await asyncio.gather(*hook_tasks)
    if errors:
        raise errors[0]  # what ``one`` did not handle is the caller's, not lost
