"""The gateway's HTTP telemetry listener (``telemetry.metrics_listen``): metrics and status page.

Owns the HTTP side of telemetry, served on the gateway's own event loop (so the status
snapshot reads a consistent state, and nothing here runs on the request path):

    GET /metrics, GET /     Prometheus exposition of the telemetry registry (content
                            negotiated as prometheus_client does: text or OpenMetrics);
                            no credential, as before (Prometheus scrapes it)
    GET /status             the status page (HTML; its script and style at /status.js and
                            /status.css, shipped in the package: no CDN, no build step)
    GET /status.json        the page's data (``gateway.statusboard.StatusBoard.snapshot``)

Access to the status data: an admin credential in ``Authorization: Bearer <key>``,
authenticated by the same ``TenantDirectory`` as gRPC (``tenant.config.admin``). No or an
unknown credential answers 401, a valid non-admin one 403. The page's HTML and script carry
no data: the page asks for the key, keeps it in the tab's ``sessionStorage`` and sends it as
the bearer header when it polls ``/status.json``, never in a URL (URLs end up in history,
logs and ``Referer``). A browser's first load of ``/status`` sends no header: it gets 401 with
the sign-in form as the body; with a non-admin bearer header it gets 403.

The listener binds where ``metrics_listen`` says; with no host it binds 127.0.0.1. It reads
at most ``MAX_HEAD_BYTES`` of request head within ``READ_TIMEOUT_S``, takes GET and HEAD
only, answers one request per connection, and serves at most ``MAX_CONNECTIONS`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from importlib import resources
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gateway.auth import TenantDirectory
from gateway.core.errors import Unauthenticated
from gateway.statusboard import StatusBoard

log = logging.getLogger("orchid.statuspage")

MAX_HEAD_BYTES = 16 * 1024
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
REALM = 'Bearer realm="orchid-status"'

_ASSETS = {
    "/status": ("status.html", "text/html; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}
_SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
)
# Scripts, styles and data only from this origin; no inline script, no frames.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def asset(name: str) -> bytes:
    """A file shipped in ``gateway/assets`` (package data)."""
    return resources.files("gateway").joinpath("assets", name).read_bytes()


@dataclass(slots=True)
class Response:
    status: int
    reason: str
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)


def _json(status: int, reason: str, data: object, *extra: tuple[str, str]) -> Response:
    body = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
    return Response(
        status,
        reason,
        body,
        [("Content-Type", "application/json"), ("Cache-Control", "no-store"), *extra],
    )


class TelemetryListener:
    """``/metrics``, ``/status``, ``/status.json`` over HTTP/1.1 on the running event loop."""

    def __init__(
        self,
        registry: CollectorRegistry,
        tenants: TenantDirectory,
        board: StatusBoard | None,
        *,
        listen: str,
    ) -> None:
        self.registry = registry
        self.tenants = tenants
        self.board = board
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]") or "127.0.0.1"
        self.requested_port = int(port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.requested_port, limit=MAX_HEAD_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("telemetry listener on http://%s:%d (/metrics, /status)", self.host, self.port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=5.0)
            self._server = None

    # ------------------------------------------------------------------ HTTP

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with self._slots:
            try:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
                except asyncio.LimitOverrunError:
                    response, method = Response(431, "Request Header Fields Too Large"), "GET"
                else:
                    method, response = self._parse_and_respond(head)
                writer.write(self._encode(response, head_only=method == "HEAD"))
                await writer.drain()
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                pass
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    def _parse_and_respond(self, head: bytes) -> tuple[str, Response]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "GET", Response(400, "Bad Request")
        method, target, _ = parts
        headers = []
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                return method, Response(400, "Bad Request")
            headers.append((name.strip().lower(), value.strip()))
        return method, self.respond(method, target, headers)

    @staticmethod
    def _encode(response: Response, *, head_only: bool) -> bytes:
        lines = [f"HTTP/1.1 {response.status} {response.reason}"]
        headers = [*response.headers, *_SECURITY_HEADERS]
        if not any(name == "Content-Type" for name, _ in headers):
            headers.append(("Content-Type", "text/plain; charset=utf-8"))
        headers += [("Content-Length", str(len(response.body))), ("Connection", "close")]
        lines += [f"{name}: {value}" for name, value in headers]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return raw if head_only else raw + response.body

    # ------------------------------------------------------------------ routes

    def respond(self, method: str, target: str, headers: list[tuple[str, str]]) -> Response:
        """The answer to one request (``headers``: lower-cased names, in order)."""
        if method not in ("GET", "HEAD"):
            return Response(405, "Method Not Allowed", b"GET or HEAD\n", [("Allow", "GET, HEAD")])
        path = urlsplit(target).path
        if path in ("/", "/metrics"):
            accept = next((value for name, value in headers if name == "accept"), "")
            encoder, content_type = choose_encoder(accept)
            return Response(200, "OK", encoder(self.registry), [("Content-Type", content_type)])
        if self.board is None or not (path in _ASSETS or path == "/status.json"):
            return Response(404, "Not Found", b"not found\n")
        if path in ("/status.js", "/status.css"):
            name, content_type = _ASSETS[path]
            static = [("Content-Type", content_type), ("Cache-Control", "no-cache")]
            return Response(200, "OK", asset(name), static)
        refusal = self._refusal(headers)
        if path == "/status":
            name, content_type = _ASSETS[path]
            page = [
                ("Content-Type", content_type),
                ("Cache-Control", "no-store"),
                ("Content-Security-Policy", _CSP),
            ]
            if refusal is None:
                return Response(200, "OK", asset(name), page)
            if refusal.status == 401:
                # A browser's first load: the sign-in form (no data; the data needs the key).
                return Response(401, "Unauthorized", asset(name), [*page, ("WWW-Authenticate", REALM)])
            return Response(refusal.status, refusal.reason, refusal.body, refusal.headers)
        if refusal is not None:
            return refusal
        return _json(200, "OK", self.board.snapshot())

    def _refusal(self, headers: list[tuple[str, str]]) -> Response | None:
        """None for an admin credential; else the 401 or 403 answer."""
        try:
            tenant = self.tenants.authenticate([(n, v) for n, v in headers if n == "authorization"])
        except Unauthenticated as error:
            return _json(401, "Unauthorized", {"error": str(error)}, ("WWW-Authenticate", REALM))
        if not tenant.config.admin:
            return _json(403, "Forbidden", {"error": "the status page needs an admin credential"})
        return None
