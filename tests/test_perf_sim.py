"""The simulator's fast paths equal what they replace (issue 31): the in-memory backend's
input sums and a stream's last token, computed without the row before it, and the
virtual-time loop's own turn and timer heap, which fire the same timers in the same order at the
same times as asyncio's."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from gateway.backends import memory
from gateway.backends.memory import VOCAB
from orchid_tools.virtual_time import VirtualTimeLoop

ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64)


@given(ids)
def test_raw_sum_is_numpys(values: list[int]) -> None:
    raw = np.array(values, dtype=np.int32).tobytes()
    expected = int(np.frombuffer(raw, dtype=np.int32).sum(dtype=np.int64))
    assert memory._raw_sum(raw) == expected


@given(ids, ids)
def test_input_sum_reads_the_last_tensor_named(first: list[int], last: list[int]) -> None:
    request = service_pb2.ModelInferRequest()
    for values in (first, last):
        request.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, len(values)])
        request.raw_input_contents.append(np.array(values, dtype=np.int32).tobytes())
    request.inputs.add(name="OTHER", datatype="INT32", shape=[1])
    assert memory._input_sum(request, "INPUT_IDS") == sum(last)


@given(st.integers(0, VOCAB - 1), st.integers(-2, 5000))
def test_last_token_is_the_rows_last(seed: int, count: int) -> None:
    row = memory._tokens(seed, max(count, 0))
    assert memory._last_token_bytes(seed, count) == row[-1:].tobytes()


class _AsyncioHeapLoop(asyncio.SelectorEventLoop):
    """The virtual-time loop as it was: asyncio's own turn and heap of ``TimerHandle``s, the
    clock jumped to the heap's head before each turn that has nothing ready."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        ready: Any = self._ready  # type: ignore[attr-defined]
        scheduled: Any = self._scheduled  # type: ignore[attr-defined]
        if not ready and scheduled:
            self._virtual_now = max(self._virtual_now, scheduled[0].when())
        super()._run_once()  # type: ignore[misc]


# A timer program: each step arms a timer ``delay`` after now (few distinct delays: many ties),
# which when it fires arms its ``children`` and cancels the timer ``cancel`` steps back (if any)
# or, ``sweep``, three in four of the last 200 (asyncio then rebuilds its heap); ``soon``: a
# call_soon instead.
steps = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.0, 0.001, 0.5, 1.0, 1.0, 2.5, 1e-10]),
        st.integers(0, 3),
        st.integers(0, 6),
        st.booleans(),
        st.integers(0, 30).map(lambda n: n == 0),
    ),
    min_size=150,
    max_size=400,
)


def _trace(
    loop: asyncio.AbstractEventLoop, program: list[tuple[float, int, int, bool, bool]]
) -> list[tuple[int, float]]:
    fired: list[tuple[int, float]] = []
    handles: list[asyncio.Handle] = []
    position = [0]

    def arm() -> None:
        if position[0] >= len(program):
            return
        k = position[0]
        position[0] += 1
        delay, _, _, soon, _ = program[k]
        if soon:
            handles.append(loop.call_soon(fire, k))
        else:
            handles.append(loop.call_at(loop.time() + delay, fire, k))

    def fire(k: int) -> None:
        fired.append((k, loop.time()))
        _, children, cancel, _, sweep = program[k]
        if cancel and len(handles) > cancel:
            handles[-cancel].cancel()
        if sweep:
            for i, handle in enumerate(handles[-200:]):
                if i % 4:
                    handle.cancel()
        for _ in range(children):
            arm()

    async def main() -> None:
        for _ in range(min(len(program), 250)):  # many pending at once: the heap's clean-up runs
            arm()
        while position[0] < len(program):
            await asyncio.sleep(0.25)
            arm()
        await asyncio.sleep(5.0)  # past the last timer (no delay exceeds 2.5)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return fired


def _no_wait(loop: asyncio.SelectorEventLoop) -> asyncio.SelectorEventLoop:
    """``loop`` polling its selector without waiting. Both turns wait for the next timer in
    *real* time when the heap's head was a cancelled timer (it is dropped, then the wait is for
    the next live one), which only spent this test's time (~0.5 s per example): the virtual clock
    does not move while they wait, and they watch nothing but their wake-up pipe, so no wait
    changes what fires when."""
    selector: Any = loop._selector  # type: ignore[attr-defined]
    poll = selector.select
    selector.select = lambda timeout=None: poll(0)
    return loop


@settings(max_examples=40, deadline=None)
@given(steps)
def test_virtual_time_loop_fires_as_asyncios_heap(program: list[tuple[float, int, int, bool, bool]]) -> None:
    assert _trace(_no_wait(VirtualTimeLoop()), program) == _trace(_no_wait(_AsyncioHeapLoop()), program)
