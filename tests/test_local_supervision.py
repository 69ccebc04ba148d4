"""The embedded Triton is started again after a crash, and never after a stop.

Triton 2.51 (the nvidia-pytriton wheel's) can segfault when a gRPC call is cancelled just as it
completes (triton-inference-server/server#7368). A gateway whose ``local_triton`` crashed used
to serve ``UNAVAILABLE`` until someone restarted the whole gateway. Here a real embedded
Triton gets SIGSEGV while the gateway runs; the gateway answers again without a restart of
its own, on a new server process at the same address, and its log names the crash. The
first calls a restarted server gets meet a deadline warm calls meet (Triton's ``model_warmup``
ran on every instance before it reported ready; the gateway read its models' readiness and
metadata before it marked it healthy). The restart rule (``RestartBackoff``) is checked over
generated crash histories, and a stop always wins over a restart asked for after it."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2_grpc

from gateway.backends.local import LocalTriton, RestartBackoff
from gateway.config import LocalTritonConfig, load_gateway_config
from tests.conftest import (
    EXAMPLE_CONFIG,
    MODEL_REPOSITORY,
    ORCHID_KEY,
    TIME_FACTOR,
    ThreadedGateway,
    gateway_config,
    ladder_steps,
)
from tests.stack import wait_until
from tests.test_ladder_effects import request

AUTH = (("authorization", f"Bearer {ORCHID_KEY}"),)
BACK_WITHIN_S = 90.0  # bound of the poll for the gateway to answer again (a Triton start is ~5-20 s)


def _repository(directory: Path) -> Path:
    """full-v18 and compact-v11 only: the example route's primary and fallback, quick to start."""
    repository = directory / "repo" / "model_repository"
    for model in ("full-v18", "compact-v11"):
        shutil.copytree(MODEL_REPOSITORY / model, repository / model)
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", directory / "repo" / "emulator")
    return repository


def _answers(running: ThreadedGateway) -> bool:
    with grpc.insecure_channel(running.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return stub.ModelInfer(request(), metadata=AUTH, timeout=10).model_name == "full-v18"
        except grpc.RpcError:
            return False


@pytest.mark.triton
def test_a_crashed_embedded_triton_is_started_again_and_the_gateway_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = LocalTritonConfig(model_repository=_repository(tmp_path), time_factor=TIME_FACTOR)
    config = gateway_config("127.0.0.1:1", local_triton=local, backends=())
    running = ThreadedGateway(config)
    running.start()
    try:
        triton = running.server.local_triton
        assert triton is not None and triton.pid is not None
        crashed, address = triton.pid, triton.address
        assert _answers(running)
        with caplog.at_level(logging.WARNING, logger="orchid.local_triton"):
            os.kill(crashed, signal.SIGSEGV)
            assert wait_until(lambda: triton.returncode is not None or triton.pid != crashed, 30.0)
            # The supervisor logs the restart once the new server is ready; the gateway's probe
            # may see it first, so both are waited for.
            assert wait_until(
                lambda: _answers(running) and any("started again" in r.getMessage() for r in caplog.records),
                BACK_WITHIN_S,
            ), triton.log_tail(20)
        assert triton.pid != crashed and triton.address == address and triton.returncode is None
        crash_lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(f"pid {crashed}" in line and "SIGSEGV" in line for line in crash_lines), crash_lines
    finally:
        running.stop()
    assert triton.returncode is not None  # the gateway's stop ended the restarted server too


# A wave: one call for every slot the gateway gives the local backend (4 devices x 2 in flight),
# so every instance of full-v18 gets work at once.
WAVE = 8
# A deadline every call of a wave meets with room to spare on two busy cores once the server is
# warm (the slowest call of a wave: ~15-25 ms through this in-process gateway at time factor
# 0.05), and a wave on a cold server does not: an instance's first execution in Triton's Python
# backend takes ~20-25 ms more, whatever the time factor, and a first wave took 41-82 ms.
WARM_DEADLINE_S = 0.040
ROUTE_MODELS = ("full-v18", "compact-v11")  # the example route's model and its fallback


def _wave(running: ThreadedGateway, timeout_s: float) -> list[str]:
    """The statuses of ``WAVE`` concurrent calls with the gRPC deadline ``timeout_s``."""
    with grpc.insecure_channel(running.address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer.future(request(), metadata=AUTH, timeout=timeout_s) for _ in range(WAVE)]
        codes = []
        for call in calls:
            try:
                call.result()
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(f"{error.code().name}: {error.details()}")
        return codes


def _backend_view(running: ThreadedGateway) -> tuple[bool, bool]:
    """The gateway's local backend at one instant (read on its loop): healthy, and each route
    model READY with its metadata read (what a request's placement reads)."""

    def read() -> tuple[bool, bool]:
        gw = running.server.gateway
        assert gw is not None
        (client,) = [handle.client for handle in gw.backends.values()]
        known = all(client.is_warm(m) and client.known_spec(m) is not None for m in ROUTE_MODELS)
        return client.healthy, known

    healthy, known = running.call_soon(read)
    return bool(healthy), bool(known)


@pytest.mark.triton
def test_a_restarted_embedded_triton_answers_its_first_calls_warm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first calls after the supervisor restarted a killed server, sent as soon as the
    gateway sees it healthy again, meet a deadline warm calls meet. The new server reports
    ready only once every instance of its models ran Triton's warm-up sample (``model_warmup``
    in the models' ``config.pbtxt``), so no call is an instance's cold first execution; and the
    gateway marks it healthy only once it has read its models' readiness and metadata, so the
    first calls do not each read them on their way."""
    base = load_gateway_config(EXAMPLE_CONFIG)
    # The classes' reserves at the time factor, as the benchmarks scale them: admission lets a
    # request with WARM_DEADLINE_S in.
    classes = {
        name: cls.model_copy(
            update={
                "reserve_upstream_ms": cls.reserve_upstream_ms * TIME_FACTOR,
                "reserve_fail_ms": cls.reserve_fail_ms * TIME_FACTOR,
                "max_dwell_ms": cls.max_dwell_ms * TIME_FACTOR,
            }
        )
        for name, cls in base.classes.items()
    }
    local = LocalTritonConfig(model_repository=_repository(tmp_path), time_factor=TIME_FACTOR)
    running = ThreadedGateway(gateway_config("127.0.0.1:1", local_triton=local, backends=(), classes=classes))
    running.start()
    try:
        triton = running.server.local_triton
        assert triton is not None and triton.pid is not None
        for _ in range(3):  # traffic first (a generous deadline): the gateway's own first use
            assert _wave(running, 10.0) == ["OK"] * WAVE
        assert _wave(running, WARM_DEADLINE_S) == ["OK"] * WAVE, "warm calls must meet the deadline"
        crashed = triton.pid
        seen_healthy: list[bool] = []  # at each look while it read healthy: were its models known?

        def back() -> bool:
            healthy, known = _backend_view(running)
            if healthy:
                seen_healthy.append(known)
            return (
                healthy
                and any("started again" in r.getMessage() for r in caplog.records)
                and set(ladder_steps(running).values()) == {0}
            )

        with caplog.at_level(logging.WARNING, logger="orchid.local_triton"):
            os.kill(crashed, signal.SIGKILL)  # lost as bench/surge.py loses it
            # Back: the supervisor's new server ready, the gateway's probe seeing it healthy, the
            # ladder down from the capacity loss. No traffic meanwhile: nothing has run on the
            # new server but what it ran itself before it reported ready.
            assert wait_until(back, BACK_WITHIN_S, poll_s=0.02), triton.log_tail(20)
        assert triton.pid != crashed and triton.returncode is None
        assert all(seen_healthy), "seen healthy before its models' readiness and metadata were read"
        assert _wave(running, WARM_DEADLINE_S) == ["OK"] * WAVE
    finally:
        running.stop()


@pytest.mark.triton
def test_a_stop_wins_over_a_restart_asked_for_after_it(tmp_path: Path) -> None:
    triton = LocalTriton(_repository(tmp_path), tmp_path / "triton", time_factor=TIME_FACTOR)
    triton.start()
    try:
        first = triton.pid
        assert first is not None
        regions = triton.shm_regions()
        assert regions
        assert not triton.restart(first)  # it runs: nothing to restart
        os.kill(first, signal.SIGSEGV)
        assert wait_until(lambda: triton.returncode is not None, 30.0)
        assert triton.returncode == -signal.SIGSEGV
        assert not triton.restart(first + 1)  # not the server that exited
        assert triton.restart(first)
        second = triton.pid
        assert second != first and triton.returncode is None
        # The crashed server's shared memory is gone; the new one has as many regions of its own.
        assert not any(r.exists() for r in regions)
        assert len(triton.shm_regions()) == len(regions)
        triton.stop()
        assert triton.stopped and triton.returncode is not None
        assert triton.shm_regions() == []
        assert not triton.restart(second)  # stopped since: a late restart starts nothing
        assert triton.pid == second and triton.returncode is not None
    finally:
        triton.stop()


def test_restart_delays_from_at_once_to_the_cap_and_back() -> None:
    backoff = RestartBackoff(initial_s=0.0, first_retry_s=1.0, max_s=30.0, stable_s=60.0)
    at = 1000.0
    delays = []
    for _ in range(8):  # each server crashes 5 s after its start
        delays.append(backoff.delay_s(started_at=at, exited_at=at + 5.0))
        at += 5.0 + delays[-1]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.delay_s(started_at=at, exited_at=at + 60.0) == 0.0  # ran a minute: at once again
    assert backoff.delay_s(started_at=at, exited_at=at + 1.0) == 1.0


@given(
    runs=st.lists(st.floats(min_value=0.0, max_value=200.0, allow_nan=False), min_size=1, max_size=40),
    initial=st.floats(min_value=0.0, max_value=2.0),
    first=st.floats(min_value=0.1, max_value=5.0),
    cap=st.floats(min_value=5.0, max_value=120.0),
    stable=st.floats(min_value=1.0, max_value=100.0),
)
def test_restart_delays_double_while_servers_crash_soon_and_reset_after_a_stable_run(
    runs: list[float], initial: float, first: float, cap: float, stable: float
) -> None:
    """``runs``: how long each successive server ran before it crashed."""
    backoff = RestartBackoff(initial_s=initial, first_retry_s=first, max_s=cap, stable_s=stable)
    streak: list[float] = []  # the delays since the last stable run (or the start)
    for ran in runs:
        if ran >= stable:
            streak = []
        delay = backoff.delay_s(started_at=0.0, exited_at=ran)
        if not streak:
            assert delay == initial  # the first crash, or the first after a stable run: at once
        elif len(streak) == 1:
            assert delay == min(first, cap)
        else:
            assert delay == min(streak[-1] * 2, cap)  # doubling up to the cap
        streak.append(delay)
