"""The runtime's one clock: the running event loop's.

asyncio's own loops read ``time.monotonic()``, so live timestamps are monotonic
seconds. The simulator (``orchid_tools.simulate``) runs the same runtime on a
loop whose clock is virtual; every timestamp the request path takes comes from
here, so it follows. The decision core never reads a clock: it is handed ``now``.

``wall()`` is the calendar clock (Unix seconds), for what is dated in the world rather than
timed on the loop: quality evidence's evaluation and review dates (``gateway.evidence``).
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    """The event loop's time, or the monotonic clock outside a loop."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def wall() -> float:
    """Wall-clock Unix seconds: for calendar dates (evidence review-by), never for timing."""
    return time.time()
