"""Virtual time for asyncio: the simulator's clock, and the core's tests'.

``VirtualTimeLoop`` is an event loop whose clock (``loop.time()``) starts at 0 and moves only
when nothing is ready to run: it then jumps straight to the next scheduled timer. A timeout,
``asyncio.sleep`` or ``wait_for`` deadline therefore fires after exactly its virtual duration,
at once in wall time, and a test's timings are deterministic whatever the machine's load.
Code under test must read ``loop.time()`` (the scheduler does), not ``time.monotonic()``.

``@virtual_time`` turns an ``async def`` test into a plain test run on a fresh such loop.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import selectors
from asyncio.base_events import (  # type: ignore[attr-defined]
    _MIN_CANCELLED_TIMER_HANDLES_FRACTION,
    _MIN_SCHEDULED_TIMER_HANDLES,
    MAXIMUM_SELECT_TIMEOUT,
)
from asyncio.log import logger as asyncio_logger
from collections import deque
from collections.abc import Callable, Coroutine
from contextvars import Context
from typing import Any, TypeVarTuple, Unpack

_Ts = TypeVarTuple("_Ts")


class _Due(float):
    """A timer's place in the loop's heap: its due time (a float, compared in C), carrying the
    timer. asyncio's heap holds the ``TimerHandle`` itself, whose ``__lt__`` (Python) compares
    ``_when``; this key compares the same values with ``<``, the only operator ``heapq`` uses,
    so every comparison, hence every push, pop and heapify, comes out exactly as asyncio's (equal
    times included: neither is less). Loop times are floats (an int time beyond 2**53 would
    round)."""

    __slots__ = ("handle",)
    handle: asyncio.TimerHandle


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector loop on a virtual clock. ``call_at`` and ``_run_once`` are CPython 3.11's
    ``BaseEventLoop`` ones step for step (the same timers fire in the same turns, in the same
    order), with three differences of cost only: the heap holds ``_Due`` keys, a turn first
    jumps the clock to the earliest timer when nothing is ready, and a turn that must not wait
    polls the selector only when it watches more than its own wake-up pipe (a callback another
    thread or a signal schedules is in ``_ready`` already: the pipe only wakes a waiting loop)."""

    # BaseEventLoop's state that this loop's turn drives (CPython 3.11's private attributes).
    _ready: deque[asyncio.Handle]
    _scheduled: list[_Due]
    _timer_cancelled_count: int
    _stopping: bool
    _clock_resolution: float
    _debug: bool
    _current_handle: asyncio.Handle | None
    _selector: selectors.BaseSelector

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        if self._debug:
            self._check_thread()  # type: ignore[attr-defined]
            self._check_callback(callback, "call_at")  # type: ignore[attr-defined]
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        if timer._source_traceback:  # type: ignore[attr-defined]
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        due = _Due(when)
        due.handle = timer
        heapq.heappush(self._scheduled, due)
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _run_once(self) -> None:
        ready = self._ready
        scheduled = self._scheduled
        # Nothing ready: jump to the earliest timer, so the selector is polled without waiting
        # and that timer is due. If it was cancelled, it is dropped below and the next turn
        # jumps again (time never passes a live timer).
        if not ready and scheduled:
            self._virtual_now = max(self._virtual_now, scheduled[0].handle.when())

        # From here on, BaseEventLoop._run_once (CPython 3.11) on the heap of _Due keys.
        sched_count = len(scheduled)
        if (
            sched_count > _MIN_SCHEDULED_TIMER_HANDLES
            and self._timer_cancelled_count / sched_count > _MIN_CANCELLED_TIMER_HANDLES_FRACTION
        ):
            # Remove delayed calls that were cancelled if their number is too high.
            kept: list[_Due] = []
            for due in scheduled:
                if due.handle._cancelled:
                    due.handle._scheduled = False  # type: ignore[attr-defined]
                else:
                    kept.append(due)
            heapq.heapify(kept)
            self._scheduled = scheduled = kept
            self._timer_cancelled_count = 0
        else:
            # Remove delayed calls that were cancelled from the head of the heap.
            while scheduled and scheduled[0].handle._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled).handle._scheduled = False  # type: ignore[attr-defined]

        timeout: float | None = None
        if ready or self._stopping:
            timeout = 0
        elif scheduled:
            timeout = min(max(0, scheduled[0] - self._virtual_now), MAXIMUM_SELECT_TIMEOUT)
        selector = self._selector
        if timeout != 0 or len(selector.get_map()) > 1:  # more than the self-pipe to watch
            self._process_events(selector.select(timeout))  # type: ignore[attr-defined]

        # Handle 'later' callbacks that are ready.
        end_time = self._virtual_now + self._clock_resolution
        while scheduled:
            if scheduled[0] >= end_time:
                break
            timer = heapq.heappop(scheduled).handle
            timer._scheduled = False  # type: ignore[attr-defined]
            ready.append(timer)

        # Run the callbacks ready now, not those they schedule (they run in the next turn).
        for _ in range(len(ready)):
            handle = ready.popleft()
            if handle._cancelled:
                continue
            if self._debug:
                try:
                    self._current_handle = handle
                    t0 = self.time()
                    handle._run()
                    dt = self.time() - t0
                    if dt >= self.slow_callback_duration:
                        asyncio_logger.warning("Executing %s took %.3f seconds", handle, dt)
                finally:
                    self._current_handle = None
            else:
                handle._run()
        handle = None  # type: ignore[assignment]  # break cycles when an exception occurs


def virtual_time(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def run() -> None:
        loop = VirtualTimeLoop()
        try:
            loop.run_until_complete(test())
        finally:
            loop.close()

    return run


def now() -> float:
    """The running loop's (virtual) time."""
    return asyncio.get_running_loop().time()


async def run_ready() -> None:
    """Let every task that is ready now run until it next waits, then come back; no time
    passes (a test's way to let a task it just created reach its first ``await``)."""
    loop = asyncio.get_running_loop()
    turn: asyncio.Future[None] = loop.create_future()
    loop.call_soon(turn.set_result, None)
    await turn
