"""A TCP proxy that delays what the server sends back: an upstream incident on demand.

Tests and the feature backpressure benchmark put it between the gateway and the Feast feature
server: every chunk the server sends is held ``delay_ms`` (settable while running) before it
is forwarded, so each HTTP answer arrives that much later while the server itself is healthy.
``fail`` makes it close new connections at once (a source that is down). It runs its own
event loop in a thread; ``stop`` closes every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit


class SlowProxy:
    """``url`` forwards to ``upstream`` (``http://host:port``), answers delayed ``delay_ms``."""

    def __init__(self, upstream: str, *, delay_ms: float = 0.0) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.delay_ms = delay_ms
        self.fail = False
        self.requests = 0  # HTTP requests forwarded (``POST`` request lines seen)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SlowProxy:
        self._thread.start()
        if not self._ready.wait(10.0):
            raise RuntimeError("the slow proxy did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.fail:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delayed: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if not delayed:
                        self.requests += data.count(b"POST /")
                    if delayed and self.delay_ms > 0:
                        await asyncio.sleep(self.delay_ms / 1000.0)
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)

    def __enter__(self) -> SlowProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
