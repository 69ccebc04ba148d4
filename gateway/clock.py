"""The runtime's one clock: the running event loop's.

asyncio's own loops read ``time.monotonic()``, so live timestamps are monotonic
seconds. The simulator (``orchid_tools.simulate``) runs the same runtime on a
loop whose clock is virtual; every timestamp the request path takes comes from
here, so it follows. The decision core never reads a clock: it is handed ``now``.
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
