"""Shared fixtures: one real Triton per test session, one gateway in front of it.

Triton is the real ``tritonserver`` from the nvidia-pytriton wheel serving the
example capacity-emulator repository with the time factor scaled down (0.05:
a 56.8 ms request holds an instance for ~2.8 ms), so integration tests run
fast on two cores. The gateway runs in-process on its own event loop thread so
tests can drive it with unmodified synchronous ``tritonclient`` as well as
``tritonclient.grpc.aio``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from _pytest.runner import runtestprotocol
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.backends.local import LocalTriton
from gateway.config import BackendConfig, GatewayConfig, load_gateway_config
from gateway.server import GatewayServer
from orchid_tools.capacity_prefix import model_parameters
from orchid_tools.harness import GatewayProcess
from tests.feast_server import feast_server  # noqa: F401  (one session Feast server for every module)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = ROOT / "examples" / "orchid" / "gateway.yaml"
MODEL_REPOSITORY = ROOT / "examples" / "orchid" / "model_repository"
TIME_FACTOR = 0.05

ORCHID_KEY = "orchid-demo-key-orchid"
LUMEN_KEY = "orchid-demo-key-lumen"
OPS_KEY = "orchid-demo-key-ops"

T = TypeVar("T")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class ThreadedGateway:
    """A GatewayServer on a private event loop thread."""

    def __init__(self, config: GatewayConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self.thread.start()
        self.server = GatewayServer(config, listen="127.0.0.1:0")

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def call_soon(self, fn: Any) -> Any:
        """Run a plain function on the gateway's loop (to read its state consistently)."""

        async def wrapper() -> Any:
            return fn()

        return self.call(wrapper())

    def start(self) -> None:
        self.call(self.server.start())
        RUNNING_GATEWAYS.add(self)

    @property
    def address(self) -> str:
        return self.server.address

    def backends_healthy(self, address: str) -> bool:
        """Do this gateway's backends at ``address`` read healthy (their probe saw the server)?"""

        def read() -> bool:
            handles = self.server.gateway.backends.values()
            return all(h.client.healthy for h in handles if getattr(h.client, "address", None) == address)

        return bool(self.call_soon(read))

    def stop(self) -> None:
        RUNNING_GATEWAYS.discard(self)
        try:
            self.call(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def gateway_config(triton_address: str, **changes: Any) -> GatewayConfig:
    base = load_gateway_config(EXAMPLE_CONFIG)
    backend = BackendConfig(
        name="local",
        address=triton_address,
        labels={"cell": "eu-restricted", "device_group": "local-a"},
        devices=4,
        max_inflight_per_device=2,
        time_scale=TIME_FACTOR,
    )
    # No job store unless a test asks for one (jobs=JobsConfig(state_dir=tmp)): the example's
    # state directory is one gateway's at a time, and tests run many gateways.
    update: dict[str, Any] = {"local_triton": None, "backends": (backend,), "jobs": None}
    update.update(changes)
    return base.model_copy(update=update)


# Gateways a test has started and not stopped (``_restart_and_settle`` waits for them).
RUNNING_GATEWAYS: weakref.WeakSet[ThreadedGateway] = weakref.WeakSet()
RESTART_SETTLE_S = 15.0  # how long the gateways' health probes get to see a restarted Triton


@pytest.fixture(autouse=True)
def _session_triton_running(request: pytest.FixtureRequest) -> None:
    """The session Triton is up for every test that uses it: a session server that exited
    between tests (a crash a passing test did not notice, a kill) is started again on its port,
    with a warning naming the test about to run, and the test waits until the running gateways
    see it (``_restart_and_settle``). A crash *during* a test: ``pytest_runtest_protocol``."""
    if "triton" not in request.fixturenames:
        return
    server: LocalTriton = request.getfixturevalue("triton")
    if server.running() or server.pid is None:
        return
    warnings.warn(
        f"the session Triton had exited before {request.node.nodeid}; restarted. Its log:\n"
        f"{server.log_tail(8)}",
        stacklevel=1,
    )
    _restart_and_settle({(server, server.pid)})


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    server = LocalTriton(MODEL_REPOSITORY, tmp_path_factory.mktemp("triton"), time_factor=TIME_FACTOR)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# How tritonserver ends when it crashes (not when a test or the harness stops or kills it).
CRASH_STATUSES = frozenset({-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS})

# Every Triton and every gateway process this session created (``_crashes``): recorded
# as they are built, so a server a test or a fixture of any scope started is seen too.
SERVERS: weakref.WeakSet[LocalTriton] = weakref.WeakSet()
GATEWAY_PROCESSES: weakref.WeakSet[GatewayProcess] = weakref.WeakSet()


def _recorded(cls: type[Any], into: weakref.WeakSet[Any]) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        into.add(self)

    setattr(cls, "__init__", recording_init)  # noqa: B010  (mypy: no assignment to a method)


_recorded(LocalTriton, SERVERS)
_recorded(GatewayProcess, GATEWAY_PROCESSES)


def _crashes() -> set[tuple[LocalTriton, int]]:
    """The servers found ended by a crash, with the pid that crashed."""
    return {
        (server, server.pid)
        for server in list(SERVERS)
        if server.pid is not None and server.returncode in CRASH_STATUSES
    }


def _restart_and_settle(crashed: set[tuple[LocalTriton, int]]) -> None:
    """Start the exited servers again (those nobody stopped meanwhile, and no gateway's
    supervisor restarted), then wait until every running gateway sees them: a threaded
    gateway's probe of each one's address, a gateway process's ``ServerReady``."""
    for server, pid in crashed:
        server.restart(pid)
    addresses = {server.address for server, _ in crashed if server.returncode is None}
    deadline = time.monotonic() + RESTART_SETTLE_S

    def settled() -> bool:
        threaded = all(g.backends_healthy(address) for g in list(RUNNING_GATEWAYS) for address in addresses)
        return threaded and all(_ready(g.address) for g in list(GATEWAY_PROCESSES) if g.running())

    while not settled():
        if time.monotonic() > deadline:
            raise RuntimeError("gateways did not see the restarted Tritons")
        time.sleep(0.05)


def _ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return bool(stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=1.0).ready)
        except grpc.RpcError:
            return False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """A test that failed while a Triton crashed under it runs once more.

    Triton 2.51 (the nvidia-pytriton wheel's) has a known race in its gRPC handler: a request
    cancelled just as it completes can segfault the server (triton-inference-server/server
    #7368, fixed in 24.12 by #7840). The gateway cancels backend calls whose caller left or
    whose deadline passed, and tests cancel on purpose (a stream's request, a caller that
    leaves); in some full runs a server segfaulted (the session's, a module's), and the test
    running at that moment found no healthy backend. Such a test (it failed, and a Triton that
    ran when it started is found ended by SIGSEGV, SIGABRT or SIGBUS) runs again once, after
    the crashed servers are started again on their ports and the running gateways see them; the
    first attempt's failure is kept as a section of the report, with each crashed server's log.
    Any other failure, and a second failure, is reported as it is."""
    if not isinstance(item, pytest.Function):
        return None
    hooks = item.ihook
    hooks.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    before = _crashes()
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    crashed = _crashes() - before
    if crashed and any(report.failed for report in reports):
        first = "\n".join(str(report.longrepr) for report in reports if report.failed)
        logs = "\n".join(f"{server.address} (pid {pid}):\n{server.log_tail(12)}" for server, pid in crashed)
        _restart_and_settle(crashed)
        warnings.warn(  # in the run's warnings summary, whether or not the second attempt passes
            f"a Triton crashed under {item.nodeid} ({', '.join(s.address for s, _ in crashed)}): "
            "restarted, and the test run once more",
            stacklevel=1,
        )
        item._initrequest()
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        for report in reports:
            report.sections.append(("first attempt: a Triton crashed under it", first[-4000:]))
            report.sections.append(("the crashed Tritons' logs", logs[-4000:]))
    for report in reports:
        hooks.pytest_runtest_logreport(report=report)
    hooks.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def emulator_parameters(model: str) -> dict[str, str]:
    """An example model's ``config.pbtxt`` parameters: what the capacity emulator itself runs
    on (its cost model and device memory), read independently of the gateway's routes."""
    return model_parameters(MODEL_REPOSITORY, model)


@contextlib.contextmanager
def own_triton(
    directory: Path, *, time_factor: float, models: tuple[str, ...] = ("full-v18", "compact-v11")
) -> Iterator[LocalTriton]:
    """A Triton of a test's own at ``time_factor``: ``models`` only (by default full-v18 and
    compact-v11: faster to start), beside the session's. Killed at the end, not stopped: a
    graceful stop spends ~5 s finalising the Python models, which no test here checks (the
    session server's stop and the gateway's own stop of its embedded server do), and a kill
    leaves nothing behind (the process group and its shared memory go with it). Tests that
    start a ``LocalTriton`` of their own end it the same way."""
    repository = directory / "repo" / "model_repository"
    for model in models:
        shutil.copytree(MODEL_REPOSITORY / model, repository / model)
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", directory / "repo" / "emulator")
    server = LocalTriton(repository, directory / "triton", time_factor=time_factor)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def triton_real_time(tmp_path: Path) -> Iterator[LocalTriton]:
    """A Triton of the test's own at time factor 1 (request times as the benchmarks see them:
    the emulator's per-call overhead small beside them)."""
    with own_triton(tmp_path, time_factor=1.0) as server:
        yield server


@pytest.fixture(scope="session")
def gateway(triton: LocalTriton) -> Iterator[ThreadedGateway]:
    running = ThreadedGateway(gateway_config(triton.address))
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def pinned(triton: LocalTriton) -> Iterator[ThreadedGateway]:
    """A gateway of the module's own whose ladder the test sets by hand: the background
    update is disabled, so a step set with ``test_ladder_effects.pin`` stays put."""
    yield from pinned_gateway(gateway_config(triton.address))


def pinned_gateway(config: dict[str, Any]) -> Iterator[ThreadedGateway]:
    """``pinned`` on a config of the caller's (a fixture of its own yields from it)."""
    running = ThreadedGateway(config)
    running.start()
    gw = running.server.gateway
    assert gw is not None
    gw.update_ladders = lambda now: None  # type: ignore[method-assign]  # the test pins the step
    try:
        yield running
    finally:
        running.stop()


def ladder_steps(running: ThreadedGateway) -> dict[str, int]:
    gw = running.server.gateway
    assert gw is not None
    return running.call_soon(lambda: {name: load.step for name, load in gw.loads.items()})
