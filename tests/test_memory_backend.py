"""The in-memory backend: the example emulator's capacity rules, in virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.backends.memory import Execution, MemoryBackend, MemoryModel
from gateway.backends.stats import StatsSample, timing_between
from gateway.backends.triton import spec_from
from gateway.config import load_routes
from gateway.core.errors import DeadlineExpired, InvalidArgument, Unavailable
from gateway.core.profile import DemandProfile
from orchid_tools.virtual_time import now, run_ready, virtual_time
from tests.conftest import ROOT

ROUTES = load_routes(ROOT / "routes")
FULL = ROUTES.profiles["full-v18"]
COMPACT = ROUTES.profiles["compact-v11"]


def request(
    tokens: int, out: int | None = 64, *, model: str = "full-v18", request_id: str = "", rows: int = 1
) -> service_pb2.ModelInferRequest:
    """As the gateway forwards it: [rows, tokens] INT32 and the backend's output limit."""
    message = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    tensor = message.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([rows, tokens])
    message.raw_input_contents.append(np.arange(rows * tokens, dtype=np.int32).tobytes())
    if out is not None:
        message.parameters["max_output_tokens"].int64_param = out
    return message


def full(instances: int = 1, **changes: object) -> MemoryModel:
    return MemoryModel("full-v18", FULL, instances=instances, **changes)  # type: ignore[arg-type]


def emulator_tokens(tokens: int, count: int) -> np.ndarray:
    """examples/orchid/emulator/orchid_emulator.py's output_tokens, restated."""
    seed = int(np.arange(tokens, dtype=np.int64).sum() % 32_000)
    return ((seed + 7919 * np.arange(count, dtype=np.int64) + 17) % 32_000).astype(np.int32)


async def timed(
    backend: MemoryBackend, message: service_pb2.ModelInferRequest, timeout_s: float = 10.0
) -> float:
    t0 = now()
    await backend.infer(message, timeout_s=timeout_s, logical=message.model_name)
    return (now() - t0) * 1000.0


@virtual_time
async def test_a_batch_of_one_holds_its_device_for_the_profile_price() -> None:
    backend = MemoryBackend("a", [full()])
    assert await timed(backend, request(256, 64)) == pytest.approx(56.8)
    assert await timed(backend, request(4096, 128)) == pytest.approx(467.6)
    response = await backend.infer(request(256, 5, request_id="r1"), timeout_s=1, logical="full-v18")
    assert (response.model_name, response.model_version, response.id) == ("full-v18", "1", "r1")
    assert list(response.outputs[0].shape) == [1, 5]
    tokens = np.frombuffer(response.raw_output_contents[0], dtype=np.int32)
    assert tokens.tolist() == emulator_tokens(256, 5).tolist()


@virtual_time
async def test_time_factor_scales_device_time() -> None:
    backend = MemoryBackend("a", [full()], time_factor=0.5)
    assert await timed(backend, request(256, 64)) == pytest.approx(28.4)


@virtual_time
async def test_call_overhead_adds_a_fixed_unscaled_time_per_execution() -> None:
    backend = MemoryBackend("a", [full()], time_factor=0.5, call_overhead_ms=3.5)
    assert await timed(backend, request(256, 64)) == pytest.approx(28.4 + 3.5)
    with pytest.raises(ValueError, match="call_overhead_ms"):
        MemoryBackend("a", [full()], call_overhead_ms=-1.0)


@virtual_time
async def test_waiting_requests_are_batched_and_padded_to_the_longest() -> None:
    executions: list[Execution] = []
    backend = MemoryBackend("a", [full()], on_execution=executions.append)
    first = asyncio.create_task(timed(backend, request(256, 64, request_id="first")))
    await asyncio.sleep(0)  # it takes the only instance
    short = asyncio.create_task(timed(backend, request(256, 64, request_id="short")))
    long = asyncio.create_task(timed(backend, request(4096, 128, request_id="long")))
    assert await first == pytest.approx(56.8)
    # The two that waited run as one batch: prefill over 2 x 4,096 padded tokens, decode in
    # lockstep to the longer output; both answers leave when the batch ends.
    batch_ms = FULL.fixed_ms + FULL.prefill_ms_per_token * 2 * 4096 + FULL.decode_ms_per_token * 128
    assert await short == pytest.approx(56.8 + batch_ms)
    assert await long == pytest.approx(56.8 + batch_ms)
    shares = {e.request_id: e.device_ms for e in executions}
    assert shares["short"] + shares["long"] == pytest.approx(batch_ms)
    assert shares["long"] / shares["short"] == pytest.approx(467.6 / 56.8)  # by batch-of-one price
    stats = StatsSample.from_response(await backend.statistics("full-v18"))
    assert (stats.successes, stats.inferences, stats.executions) == (3, 3, 2)


@virtual_time
async def test_a_batch_never_exceeds_max_batch_size() -> None:
    backend = MemoryBackend("a", [full(max_batch_size=2)])
    holder = asyncio.create_task(timed(backend, request(256, 64)))
    await run_ready()
    waiting = [asyncio.create_task(timed(backend, request(256, 64))) for _ in range(3)]
    await holder
    done = await asyncio.gather(*waiting)
    pair_ms = FULL.fixed_ms + FULL.prefill_ms_per_token * 2 * 256 + FULL.decode_ms_per_token * 64
    assert done[0] == done[1] == pytest.approx(56.8 + pair_ms)
    assert done[2] == pytest.approx(56.8 + pair_ms + 56.8)


@virtual_time
async def test_instances_of_own_devices_run_in_parallel() -> None:
    backend = MemoryBackend("a", [full(instances=2, max_batch_size=0)])
    took = await asyncio.gather(*(timed(backend, request(256, 64, rows=1)) for _ in range(3)))
    assert sorted(took) == pytest.approx([56.8, 56.8, 113.6])


@virtual_time
async def test_shared_devices_make_models_take_turns() -> None:
    compact = MemoryModel("compact-v11", COMPACT, instances=1)
    backend = MemoryBackend("a", [full(), compact], devices=1)
    primary = asyncio.create_task(timed(backend, request(256, 64)))
    await run_ready()
    fallback = asyncio.create_task(timed(backend, request(256, 64, model="compact-v11")))
    assert await primary == pytest.approx(56.8)
    assert await fallback == pytest.approx(56.8 + 32.0)  # its instance was free, the device was not
    own = MemoryBackend("b", [full(), MemoryModel("compact-v11", COMPACT, instances=1)])
    took = await asyncio.gather(
        timed(own, request(256, 64)), timed(own, request(256, 64, model="compact-v11"))
    )
    assert took == pytest.approx([56.8, 32.0])  # without sharing, each model has its own device


@virtual_time
async def test_a_cancelled_request_stops_decoding_and_frees_its_device_early() -> None:
    executions: list[Execution] = []
    backend = MemoryBackend("a", [full()], on_execution=executions.append)
    running = asyncio.create_task(
        backend.infer(request(256, 64, request_id="gone"), timeout_s=1, logical="m")
    )
    await asyncio.sleep(0.040)  # prefill (30 ms) done, decoding
    queued = asyncio.create_task(timed(backend, request(256, 64, request_id="next")))
    await run_ready()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert await queued == pytest.approx(56.8)  # started at once: the device freed at 40 ms
    gone = next(e for e in executions if e.request_id == "gone")
    assert (gone.answered, gone.device_ms) == (False, pytest.approx(40.0))


@virtual_time
async def test_the_server_side_deadline_fails_and_cancels_the_request() -> None:
    backend = MemoryBackend("a", [full()])
    t0 = now()
    with pytest.raises(DeadlineExpired):
        await backend.infer(request(4096, 128), timeout_s=0.1, logical="full-v18")
    assert now() - t0 == pytest.approx(0.1)
    # The long request stopped at its deadline (its prefill, 414 ms, cannot be interrupted).
    assert await timed(backend, request(256, 64)) == pytest.approx(414.0 - 100.0 + 56.8)


@virtual_time
async def test_a_request_cancelled_while_queued_never_runs() -> None:
    executions: list[Execution] = []
    backend = MemoryBackend("a", [full()], on_execution=executions.append)
    holder = asyncio.create_task(timed(backend, request(256, 64, request_id="holder")))
    await run_ready()
    waiting = asyncio.create_task(backend.infer(request(256, 64, request_id="w"), timeout_s=1, logical="m"))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await holder
    assert [e.request_id for e in executions] == ["holder"]


@virtual_time
async def test_losing_the_device_group_fails_everything_on_it() -> None:
    executions: list[Execution] = []
    backend = MemoryBackend("a", [full()], on_execution=executions.append)
    running = asyncio.create_task(backend.infer(request(256, 64, request_id="r"), timeout_s=1, logical="m"))
    queued = asyncio.create_task(backend.infer(request(256, 64, request_id="q"), timeout_s=1, logical="m"))
    await asyncio.sleep(0.02)
    assert backend.healthy and backend.is_warm("full-v18") and await backend.probe()
    backend.set_healthy(False)
    lost_at = now()
    for task in (running, queued):
        with pytest.raises(Unavailable):
            await task
    assert [(e.request_id, e.answered, round(e.device_ms, 6)) for e in executions] == [("r", False, 20.0)]
    assert not backend.is_warm("full-v18") and not await backend.model_ready("full-v18")
    with pytest.raises(Unavailable):
        await backend.infer(request(256, 64), timeout_s=1, logical="m")
    with pytest.raises(Unavailable):
        await backend.model_spec("full-v18", logical="m")
    await asyncio.sleep(1.0)
    assert backend.healthy_at == lost_at  # evidence goes stale while it is down
    backend.set_healthy(True)
    assert backend.healthy_at == now()
    assert await timed(backend, request(256, 64)) == pytest.approx(56.8)


@virtual_time
async def test_underprediction_slows_only_the_long_requests() -> None:
    backend = MemoryBackend("a", [full()])
    backend.slow_down("full-v18", 3.0, longer_than=1024)
    assert await timed(backend, request(4096, 128)) == pytest.approx(3 * 467.6)
    assert await timed(backend, request(256, 64)) == pytest.approx(56.8)
    backend.slow_down("full-v18", 1.0)
    assert await timed(backend, request(4096, 128)) == pytest.approx(467.6)


@virtual_time
async def test_statistics_give_triton_queue_and_compute_time() -> None:
    backend = MemoryBackend("a", [full()])
    before = StatsSample.from_response(await backend.statistics("full-v18"))
    await asyncio.gather(timed(backend, request(256, 64)), timed(backend, request(256, 64)))
    after = StatsSample.from_response(await backend.statistics("full-v18"))
    timing = timing_between(before, after)
    assert timing is not None
    assert timing.requests == 2
    assert timing.queue_ms == pytest.approx(56.8 / 2)  # the second waited one execution
    assert timing.compute_ms == pytest.approx(56.8)


@virtual_time
async def test_metadata_and_config_describe_the_model_as_triton_would() -> None:
    backend = MemoryBackend(
        "a", [full(instances=3), MemoryModel("s", FULL, max_batch_size=0, decoupled=True)]
    )
    for name in ("full-v18", "s"):
        spec = await backend.model_spec(name, logical=name)
        metadata = await backend.metadata(name, "")
        config = await backend.config(name, "")
        assert spec_from(metadata, config.config) == spec  # what TritonBackend would derive
    assert (await backend.model_spec("full-v18", logical="x")).instances == 3
    with pytest.raises(Unavailable):
        await backend.model_spec("missing", logical="missing")


@virtual_time
async def test_bad_output_limits_are_refused() -> None:
    backend = MemoryBackend("a", [full()])
    with pytest.raises(InvalidArgument):
        await backend.infer(request(256, 0), timeout_s=1, logical="full-v18")
    # Without the parameter, the model's default output length.
    assert await timed(backend, request(256, None)) == pytest.approx(56.8)


@virtual_time
async def test_a_decoupled_model_streams_one_response_per_token_then_a_final_one() -> None:
    profile = DemandProfile(fixed_ms=4.0, prefill_ms_per_token=0.0, decode_ms_per_token=1.0)
    backend = MemoryBackend("a", [MemoryModel("s", profile, max_batch_size=0, decoupled=True)])

    async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
        message = request(16, 3, model="s", request_id="x")
        del message.inputs[0].shape[:]
        message.inputs[0].shape.append(16)
        yield message

    t0 = now()
    seen: list[tuple[float, int, bool]] = []
    async for reply in backend.stream(requests(), timeout_s=None):
        response = reply.infer_response
        final = response.parameters["triton_final_response"].bool_param
        seen.append((round((now() - t0) * 1000.0, 6), len(response.outputs), final))
    assert seen == [(5.0, 1, False), (6.0, 1, False), (7.0, 1, False), (7.0, 0, True)]


@virtual_time
async def test_a_stream_breaks_when_its_device_group_is_lost() -> None:
    backend = MemoryBackend("a", [MemoryModel("s", FULL, max_batch_size=0, decoupled=True)])
    stop = asyncio.Event()

    async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
        message = request(256, 64, model="s", request_id="x")
        del message.inputs[0].shape[:]
        message.inputs[0].shape.append(256)
        yield message
        await stop.wait()

    asyncio.get_running_loop().call_later(0.05, backend.set_healthy, False)
    call = backend.stream(requests(), timeout_s=None)
    with pytest.raises(Unavailable):
        async for _ in call:
            pass
    assert call.cancel() is False
