"""A feature source over HTTP: Feast's feature server, read with httpx.

Owns the I/O of one source: a pooled async client (one connection per read in flight, at most
``max_concurrency``, the rest wait for a connection within the read's own timeout), one
batched ``POST /get-online-features`` per request (the contract's feature service, every
entity in one call, full feature names), and parsing the reply into the columns
``gateway.core.upstream.judge`` reads. Every read is timed into the source's
``UpstreamHealth`` (failures and timeouts included), which the stage reads for the upstream
reserve and backpressure.
"""

from __future__ import annotations

import asyncio
import math
from datetime import datetime
from typing import Any

import httpx

from gateway import clock
from gateway.config import FeatureSourceConfig
from gateway.core.upstream import FeatureContract, UpstreamHealth

Columns = list[tuple[list[object], list[str], list[float | None]]]


class SourceError(Exception):
    """A read failed: the source answered an error, something unreadable, or not in time."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _event_time(text: object) -> float | None:
    """Feast's event timestamp (RFC 3339, ``Z``); its epoch (1970-01-01) means none."""
    if not isinstance(text, str):
        return None
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    return value if value > 0 else None


def parse_reply(body: Any) -> tuple[list[str], Columns]:
    """Feature names and per-name (values, statuses, event times) of a get-online-features reply."""
    try:
        names = [str(name) for name in body["metadata"]["feature_names"]]
        columns: Columns = [
            (
                list(r["values"]),
                [str(s) for s in r["statuses"]],
                [_event_time(t) for t in r["event_timestamps"]],
            )
            for r in body["results"]
        ]
    except (KeyError, TypeError) as error:
        raise SourceError(
            f"the feature source's reply is not a get-online-features answer ({error})"
        ) from None
    if len(names) != len(columns):
        raise SourceError("the feature source's reply names a different number of features than it answers")
    return names, columns


class FeatureSource:
    """One configured source: its client, its health."""

    def __init__(self, name: str, config: FeatureSourceConfig) -> None:
        self.name = name
        self.config = config
        self.health = UpstreamHealth(
            budget_ms=config.budget_ms,
            window_s=config.window_s,
            quantile=config.latency_quantile,
            min_samples=config.min_samples,
            probe_interval_s=config.probe_interval_s,
        )
        self._client: httpx.AsyncClient | None = None
        self.reads = 0

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # created on the serving loop, on first use
            limits = httpx.Limits(
                max_connections=self.config.max_concurrency,
                max_keepalive_connections=self.config.max_concurrency,
            )
            self._client = httpx.AsyncClient(base_url=self.config.url, limits=limits)
        return self._client

    async def read(
        self, contract: FeatureContract, entities: dict[str, list[int | str]], timeout_s: float
    ) -> tuple[list[str], Columns]:
        """One batched read of the contract's feature service for ``entities`` (join key ->
        values), within ``timeout_s`` (connection wait included)."""
        if timeout_s <= 0 or not math.isfinite(timeout_s):  # the request's, not the source's
            raise SourceError("no time left to read features", timed_out=True)
        started = clock.now()
        ok = False
        try:
            body = {
                "feature_service": contract.feature_service,
                "entities": entities,
                "full_feature_names": True,
            }
            try:
                reply = await self._http().post(
                    "/get-online-features", json=body, timeout=httpx.Timeout(timeout_s, pool=timeout_s)
                )
            except httpx.TimeoutException:
                raise SourceError(
                    f"the feature source did not answer within {timeout_s * 1000:.0f} ms", timed_out=True
                ) from None
            except httpx.HTTPError as error:
                raise SourceError(f"the feature source is unreachable ({type(error).__name__})") from None
            if reply.status_code != 200:
                raise SourceError(f"the feature source answered HTTP {reply.status_code}")
            try:
                parsed = parse_reply(reply.json())
            except ValueError:
                raise SourceError("the feature source's reply is not JSON") from None
            ok = True
            return parsed
        finally:
            self.reads += 1
            self.health.record(clock.now(), (clock.now() - started) * 1000.0, ok=ok)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await asyncio.shield(client.aclose())
