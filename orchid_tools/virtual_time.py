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
from collections.abc import Callable, Coroutine
from typing import Any


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        # Nothing ready: jump to the earliest live timer, so the selector is polled without
        # waiting and that timer is due. (CPython's BaseEventLoop keeps ready callbacks in
        # ``_ready`` and timers in the heap ``_scheduled``.)
        ready: Any = self._ready  # type: ignore[attr-defined]
        scheduled: Any = self._scheduled  # type: ignore[attr-defined]
        if not ready and scheduled:
            # The heap's head is the earliest timer; if it was cancelled, the loop drops it
            # in this turn and the next turn jumps again (time never passes a live timer).
            self._virtual_now = max(self._virtual_now, scheduled[0].when())
        super()._run_once()  # type: ignore[misc]


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
