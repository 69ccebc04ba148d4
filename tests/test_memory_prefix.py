"""The in-memory backend's prefix cache: the capacity emulator's, in virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import numpy.typing as npt
import pytest
from tritonclient.grpc import service_pb2

from gateway.backends.memory import Execution, MemoryBackend, MemoryModel
from gateway.core.prefix import CACHED_TOKENS_PARAMETER, SCOPE_PARAMETER, PrefixCacheSpec
from gateway.core.profile import DemandProfile
from orchid_tools.virtual_time import now, virtual_time

Tokens = npt.NDArray[np.int32]

# full-v18's cost (fixed 4.4 ms, 0.1 ms per prefill token, 0.41875 ms per decode token).
PROFILE = DemandProfile(fixed_ms=4.4, prefill_ms_per_token=0.1, decode_ms_per_token=0.41875)
CACHE = PrefixCacheSpec(block_tokens=16, capacity_blocks=64)


def chat(**changes: object) -> MemoryModel:
    fields: dict[str, object] = {"prefix_cache": CACHE, "max_batch_size": 8}
    fields.update(changes)
    return MemoryModel("chat", PROFILE, **fields)  # type: ignore[arg-type]


def request(
    tokens: Tokens, out: int = 8, *, scope: str | None = None, rows: int = 1, request_id: str = ""
) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="chat", id=request_id)
    tensor = message.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([rows, len(tokens)])
    message.raw_input_contents.append(np.tile(tokens.astype("<i4"), rows).tobytes())
    message.parameters["max_output_tokens"].int64_param = out
    if scope is not None:
        message.parameters[SCOPE_PARAMETER].string_param = scope
    return message


def prompt(n: int, start: int = 0) -> Tokens:
    tokens: Tokens = np.arange(start, start + n, dtype=np.int32)
    return tokens


async def ask(backend: MemoryBackend, message: service_pb2.ModelInferRequest) -> tuple[int, float]:
    """(cached tokens the response reports, ms the request took)."""
    t0 = now()
    response = await backend.infer(message, timeout_s=10, logical="chat")
    return int(response.parameters[CACHED_TOKENS_PARAMETER].int64_param), (now() - t0) * 1000.0


@virtual_time
async def test_a_later_turn_hits_the_blocks_of_the_turns_before_it() -> None:
    backend = MemoryBackend("a", [chat()])
    system = prompt(100)
    first = np.concatenate([system, prompt(30, 1000)])  # 130 tokens: 8 full blocks
    cached, ms = await ask(backend, request(first, scope="t1"))
    assert cached == 0
    assert ms == pytest.approx(4.4 + 0.1 * 130 + 0.41875 * 8)
    second = np.concatenate([first, prompt(40, 5000)])  # 170 tokens: its first 8 blocks are cached
    cached, ms = await ask(backend, request(second, scope="t1"))
    assert cached == 128
    assert ms == pytest.approx(4.4 + 0.1 * (170 - 128) + 0.41875 * 8)
    # The same prompt again: every full block is cached, one token is always computed.
    exact = prompt(64, 50_000)
    await ask(backend, request(exact, scope="t1"))
    cached, _ = await ask(backend, request(exact, scope="t1"))
    assert cached == 63
    assert backend.prefix_stats("chat") == {
        "lookups": 4,
        "hits": 2,
        "hit_blocks": 8 + 4,
        "miss_blocks": 8 + (10 - 8) + 4,
        "inserted": 8 + 2 + 4,
        "evictions": 0,
        "held_blocks": 14,
    }


@virtual_time
async def test_the_same_prompt_in_another_scope_never_hits() -> None:
    backend = MemoryBackend("a", [chat()])
    tokens = prompt(96)
    assert (await ask(backend, request(tokens, scope="tenant-a|cell|chat@1")))[0] == 0
    assert (await ask(backend, request(tokens, scope="tenant-b|cell|chat@1")))[0] == 0
    assert (await ask(backend, request(tokens)))[0] == 0  # no scope: "" (a direct client's)
    assert (await ask(backend, request(tokens, scope="tenant-a|cell|chat@1")))[0] == 95
    assert (await ask(backend, request(tokens, scope="")))[0] == 95
    stats = backend.prefix_stats("chat")
    assert stats is not None and stats["hits"] == 2 and stats["held_blocks"] == 18


@virtual_time
async def test_the_least_recently_used_blocks_are_evicted_deepest_first() -> None:
    backend = MemoryBackend("a", [chat(prefix_cache=PrefixCacheSpec(block_tokens=16, capacity_blocks=6))])
    a, b = prompt(64), prompt(64, 10_000)  # 4 blocks each
    await ask(backend, request(a, scope="s"))
    await ask(backend, request(b, scope="s"))  # 8 blocks > 6: a's two deepest go
    stats = backend.prefix_stats("chat")
    assert stats is not None and stats["evictions"] == 2 and stats["held_blocks"] == 6
    cached, _ = await ask(backend, request(a, scope="s"))
    assert cached == 32  # its first two blocks are still there
    # Looking a up touched (and reinserted) its blocks: now b's deepest were evicted.
    cached, _ = await ask(backend, request(b, scope="s"))
    assert cached == 16 * 2


@virtual_time
async def test_a_batch_is_charged_its_longest_uncached_input() -> None:
    """Padded prefill on the uncached tokens: fixed + per token x rows x max(input - cached)."""
    executions: list[Execution] = []
    backend = MemoryBackend("a", [chat(instances=1)], on_execution=executions.append)
    warm = prompt(200)
    await ask(backend, request(warm, scope="s"))  # 12 blocks cached (192 tokens)
    executions.clear()
    hit = np.concatenate([warm, prompt(10, 7000)])  # 210 tokens, 192 cached: 18 uncached
    miss = prompt(50, 20_000)  # 50 tokens, none cached
    blocker = backend.infer(request(prompt(16, 90_000), out=1, scope="x"), timeout_s=10, logical="chat")
    task0 = asyncio.ensure_future(blocker)  # holds the one instance so the two batch together
    await asyncio.sleep(0)
    task1 = asyncio.ensure_future(backend.infer(request(hit, out=4, scope="s"), timeout_s=10, logical="chat"))
    task2 = asyncio.ensure_future(
        backend.infer(request(miss, out=4, scope="s"), timeout_s=10, logical="chat")
    )
    await task0
    started = now()
    r1, r2 = await asyncio.gather(task1, task2)
    assert r1.parameters[CACHED_TOKENS_PARAMETER].int64_param == 192
    assert r2.parameters[CACHED_TOKENS_PARAMETER].int64_param == 0
    batch_ms = 4.4 + 0.1 * 2 * max(210 - 192, 50) + 0.41875 * 4
    assert (now() - started) * 1000.0 == pytest.approx(batch_ms)
    pair = [e for e in executions if e.started_at >= started - 1e-12]
    assert len(pair) == 2
    assert sum(e.device_ms for e in pair) == pytest.approx(batch_ms)
    # Each member's share weighs its own uncached price: the miss pays more of the batch.
    by_model = sorted(e.device_ms for e in pair)
    assert by_model[0] < by_model[1]


@virtual_time
async def test_streamed_responses_report_the_cached_tokens() -> None:
    backend = MemoryBackend("a", [chat(decoupled=True, max_batch_size=0)])

    def unbatched(tokens: Tokens) -> service_pb2.ModelInferRequest:
        message = service_pb2.ModelInferRequest(model_name="chat")
        tensor = message.inputs.add(name="INPUT_IDS", datatype="INT32")
        tensor.shape.append(len(tokens))
        message.raw_input_contents.append(tokens.astype("<i4").tobytes())
        message.parameters["max_output_tokens"].int64_param = 3
        message.parameters[SCOPE_PARAMETER].string_param = "s"
        return message

    async def one(tokens: Tokens) -> list[int]:
        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield unbatched(tokens)

        stream = backend.stream(requests(), timeout_s=10)
        return [
            int(reply.infer_response.parameters[CACHED_TOKENS_PARAMETER].int64_param)
            async for reply in stream
        ]

    assert await one(prompt(40)) == [0, 0, 0, 0]
    assert await one(prompt(40)) == [32, 32, 32, 32]  # three tokens, then the final response


@virtual_time
async def test_a_model_without_a_cache_runs_and_answers_exactly_as_before() -> None:
    executions: list[Execution] = []
    plain = MemoryModel("chat", PROFILE, max_batch_size=8)
    backend = MemoryBackend("a", [plain], on_execution=executions.append)
    tokens = prompt(128)
    first = await backend.infer(request(tokens, scope="s"), timeout_s=10, logical="chat")
    t0 = now()
    second = await backend.infer(request(tokens, scope="s"), timeout_s=10, logical="chat")
    assert (now() - t0) * 1000.0 == pytest.approx(4.4 + 0.1 * 128 + 0.41875 * 8)
    assert CACHED_TOKENS_PARAMETER not in first.parameters
    assert second.SerializeToString() == first.SerializeToString()
    assert backend.prefix_stats("chat") is None
    assert plain.spec().prefix_cache is None
    assert chat().spec().prefix_cache == CACHE
    assert [e.device_ms for e in executions] == pytest.approx([4.4 + 12.8 + 0.41875 * 8] * 2)


@virtual_time
async def test_a_cold_restart_empties_the_cache() -> None:
    backend = MemoryBackend("a", [chat()])
    tokens = prompt(64)
    await ask(backend, request(tokens, scope="s"))
    backend.set_healthy(False)
    backend.set_healthy(True)  # warm: the server kept its cache
    assert (await ask(backend, request(tokens, scope="s")))[0] == 63
    backend.set_healthy(False)
    backend.set_healthy(True, cold=True)
    await asyncio.sleep(0.01)
    assert (await ask(backend, request(tokens, scope="s")))[0] == 0
    assert backend.prefix_stats("chat") == {
        "lookups": 1,
        "hits": 0,
        "hit_blocks": 0,
        "miss_blocks": 4,
        "inserted": 4,
        "evictions": 0,
        "held_blocks": 4,
    }
