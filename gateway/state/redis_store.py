"""Quota ledgers and fleet membership in Redis (``state.backend: redis``).

Owns the client side of the shared state: ``RedisFleet`` (the connection, this replica's
heartbeat, the membership it reads back, degraded mode) and ``RedisQuotaStore`` (the
``QuotaStore`` the pipeline uses: the core's quota rules applied by ``gateway.state.lua``'s
scripts, one round trip per reserve, start, settle or release, or per quota slice).

Quota slices (``state.quota_slice``, a share of the account's burst, of its live-token-ms
burst and of its ``max_concurrent``): a replica reserves a *slice* of an account in Redis
(one reservation, debited in full from both buckets, holding ``ceil(share x max_concurrent)``
of its concurrency) and admits its own requests on it with no round trip, each spending both
buckets' shares locally, settling them locally; a retired slice (either share spent, a
heartbeat interval old, or the store draining) closes in Redis, once its last request has
settled, charged what its requests were charged of both: the unused rest of both goes back
to the buckets. Every token a slice admits (accelerator-ms or live-token-ms) was debited in
Redis first, so slices cannot overshoot a quota; what they cost is under-use (a replica's
unused slice is unavailable to the others until it returns, at most about a heartbeat
interval). A request larger than a slice (in either bucket), a refused slice, and accounts
with a queued-work limit (it reads each request's start) reserve one request per call as
before; borrowing from the class share is per request only.

Rules of the edge:

* Every Redis call has a deadline (``state.call_timeout_ms``): a slow or unreachable Redis
  costs a request at most that, never a hang.
* A failed call puts the replica in *degraded* mode (log line, ``orchid_state_degraded``
  gauge): ``fail_mode: local`` reserves on a local ``QuotaLedger`` holding 1/N of every
  quota (N: the membership last read, this replica included; its requests still open on
  reservations in Redis count against the share's concurrency limit), so N replicas
  together grant at most the fleet's quota; ``fail_mode: closed`` refuses with ``UNAVAILABLE``
  (rule ``state.unavailable``). While degraded no request waits on Redis; the heartbeat
  loop probes it, and when a heartbeat succeeds the replica resynchronises: it reads the
  membership again and reserves in Redis from the next request (reservations opened
  locally settle locally).
* Hot-path scripts (reserve, start, settle, slot leases) go through one channel that
  sends everything asked for in the same event-loop turn as one pipeline (one round trip,
  one deadline), and holds calls nobody awaits up to ``COALESCE_S`` (2 ms) for company:
  under load many requests share a round trip. With quota slices most requests need no
  quota round trip at all, which is what keeps the Redis path's CPU per request near the
  in-memory one (``bench/replicas.py``).
* Starting, settling and releasing are sent in the background (they are called from
  synchronous code). A lost one costs nothing permanent: the reservation's lease expires
  and closes it as settled at its prediction.
* This replica renews the leases of its open reservations and slices with its heartbeat,
  every ``lease_ttl_ms / 3``; a replica that dies stops renewing, so its reservations,
  slices, queued work and borrowing return within ``lease_ttl_ms`` (a dead replica's slice
  closes charged in full: its requests may have run).
* Degraded, slices are dropped: their open requests settle locally, their leases expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from gateway import clock
from gateway.config import StateConfig
from gateway.core.errors import Unavailable
from gateway.core.quota import (
    AccountTerms,
    Outstanding,
    QuotaLedger,
    QuotaSettings,
    QuotaView,
    Reservation,
    Settlement,
    quota_refusal,
)
from gateway.core.record import RequestRecord
from gateway.state import lua

__all__ = [
    "REDIS_FAILURES",
    "RULE_STATE_UNAVAILABLE",
    "FleetOutstanding",
    "RedisFleet",
    "RedisQuotaStore",
    "still_cancelled",
]

log = logging.getLogger("orchid.state")

RULE_STATE_UNAVAILABLE: Final = "state.unavailable"
# Settlements, starts and slot returns (nobody awaits them) wait at most this long to share a
# round trip with others: refunds reach the ledger a few ms later, for far fewer round trips.
COALESCE_S: Final = 0.002
REDIS_FAILURES: Final = (RedisError, OSError, asyncio.TimeoutError)
_EPSILON_MS: Final = 1e-6


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _opt(value: float | int | None) -> str:
    return "" if value is None else str(value)


def still_cancelled(exc: BaseException) -> None:
    """Re-raise a cancellation that ``asyncio.wait_for`` (3.11) reported as a timeout.

    When the calling task is cancelled just as the inner call times out or finishes, 3.11's
    ``wait_for`` may raise ``TimeoutError``: caught as a Redis failure, the cancellation would
    be lost and a background loop would never stop (seen as a hung shutdown)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc


@dataclass(frozen=True, slots=True)
class FleetOutstanding:
    """Open reservations in Redis, all accounts, all replicas (expired leases reaped first)."""

    count: int
    accelerator_ms: float
    by_owner: dict[str, int]


class RedisFleet:
    """This replica's connection to the fleet's Redis: heartbeat, membership, degraded mode."""

    def __init__(self, config: StateConfig, *, replica_id: str | None = None) -> None:
        if config.url is None:
            raise ValueError("state.url is required with backend redis")
        self.config = config
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.timeout_s = config.call_timeout_ms / 1000.0
        self.ttl_s = config.lease_ttl_ms / 1000.0
        # No socket_timeout: every call here carries its own deadline (``call``, and each
        # awaited script's timer), and redis-py's per-read timeout would cost a task per read.
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            config.url, socket_connect_timeout=self.timeout_s, retry_on_timeout=False
        )
        self._members_key = f"{config.key_prefix}members"
        self._heartbeat = self.client.register_script(lua.HEARTBEAT)
        self.members: tuple[str, ...] = (self.replica_id,)
        self.degraded = True  # until the first heartbeat answers
        self.degraded_since: float | None = clock.now()
        self.errors = 0
        self.resyncs = 0
        self._on_beat: list[Callable[[], Awaitable[None]]] = []
        self._on_degraded: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._batch: list[tuple[AsyncScript, list[str], list[str], asyncio.Future[Any] | None]] = []
        self._flush_handle: asyncio.Handle | None = None
        self._flush_at: float | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def script(self, text: str) -> AsyncScript:
        """A Lua script this replica sends through ``run_script`` / ``send_script``."""
        return self.client.register_script(text)

    def run_script(self, script: AsyncScript, keys: list[str], args: list[str]) -> asyncio.Future[Any]:
        """Queue one script call for this turn's pipeline; the future is its answer (or the
        failure). Await it under ``call``'s deadline."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        # Its own deadline too (twice the batch's: connect + answer), whatever becomes of the batch.
        timer = loop.call_later(self.timeout_s * 2, self._expire, future)
        future.add_done_callback(lambda _: timer.cancel())
        self._queue(script, keys, args, future)
        return future

    def _expire(self, future: asyncio.Future[Any]) -> None:
        if not future.done():
            error = TimeoutError("no answer from Redis within the deadline")
            self.failed(error)
            future.set_exception(error)

    def send_script(self, script: AsyncScript, keys: list[str], args: list[str]) -> None:
        """Queue one script call whose answer nobody waits for (start, settle, release)."""
        self._queue(script, keys, args, None)

    def _queue(
        self, script: AsyncScript, keys: list[str], args: list[str], future: asyncio.Future[Any] | None
    ) -> None:
        """A call someone awaits goes with this turn's pipeline; calls nobody awaits wait up
        to ``COALESCE_S`` for company (or ride along with the next awaited one)."""
        self._batch.append((script, keys, args, future))
        loop = asyncio.get_running_loop()
        if future is not None:
            if self._flush_at is None or self._flush_at > loop.time():
                if self._flush_handle is not None:
                    self._flush_handle.cancel()
                self._flush_handle = loop.call_soon(self._flush)
                self._flush_at = loop.time()
        elif self._flush_handle is None:
            self._flush_handle = loop.call_later(COALESCE_S, self._flush)
            self._flush_at = loop.time() + COALESCE_S

    def _flush(self) -> None:
        self._flush_handle, self._flush_at = None, None
        batch, self._batch = self._batch, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send_batch(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_batch(
        self, batch: list[tuple[AsyncScript, list[str], list[str], asyncio.Future[Any] | None]]
    ) -> None:
        try:
            answers = await self.call(self._pipeline(batch))
            missing = [i for i, a in enumerate(answers) if isinstance(a, NoScriptError)]
            if missing:  # Redis restarted empty: load the scripts again, resend those calls
                for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                    await self.call(self.client.script_load(script.script))
                again = await self.call(self._pipeline([batch[i] for i in missing]))
                for i, answer in zip(missing, again, strict=True):
                    answers[i] = answer
        except BaseException as exc:  # whatever ends the batch, no caller is left waiting
            for *_, future in batch:
                if future is not None and not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else ConnectionError("cancelled"))
            if not isinstance(exc, REDIS_FAILURES):
                raise
            return
        for (*_, future), answer in zip(batch, answers, strict=True):
            if future is None or future.done():
                continue
            if isinstance(answer, Exception):
                future.set_exception(answer)
            else:
                future.set_result(answer)

    async def _pipeline(
        self, batch: list[tuple[AsyncScript, list[str], list[str], asyncio.Future[Any] | None]]
    ) -> list[Any]:
        """The batch's EVALSHAs written at once on one pooled connection, the answers read in
        order (an error reply is that call's answer). A connection interrupted mid-batch (the
        deadline) is closed, never reused half-read."""
        pool = self.client.connection_pool
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            commands = [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args, _ in batch]
            await connection.send_packed_command(connection.pack_commands(commands))
            answers: list[Any] = []
            for _ in commands:
                try:
                    answers.append(await connection.read_response())
                except ResponseError as error:
                    answers.append(error)
            return answers
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)

    async def drain(self) -> None:
        """Wait (bounded by the deadline) for queued and in-flight script calls."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush()
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=self.timeout_s * 2)

    @property
    def size(self) -> int:
        """Replicas in the last membership read (at least this one)."""
        return max(1, len(self.members))

    def on_beat(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` after every successful heartbeat (lease renewal)."""
        self._on_beat.append(callback)

    def on_degraded(self, callback: Callable[[], None]) -> None:
        self._on_degraded.append(callback)

    async def call(self, awaitable: Awaitable[Any]) -> Any:
        """One Redis call under the deadline; a failure marks the replica degraded and re-raises."""
        try:
            return await asyncio.wait_for(awaitable, self.timeout_s)
        except REDIS_FAILURES as exc:
            still_cancelled(exc)
            self.failed(exc)
            raise

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        if not self.degraded:
            self.degraded = True
            self.degraded_since = clock.now()
            log.warning(
                "shared state degraded: Redis unreachable (%s); fail_mode %s with %d known replicas",
                type(exc).__name__,
                self.config.fail_mode,
                self.size,
            )
            for callback in self._on_degraded:
                callback()

    async def beat(self) -> bool:
        """One heartbeat: publish this replica, read the membership. False: Redis unreachable."""
        try:
            members = await self.call(
                self._heartbeat(keys=[self._members_key], args=[self.replica_id, repr(self.ttl_s)])
            )
        except REDIS_FAILURES:
            return False
        self.members = tuple(sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members))
        if self.degraded:
            self.degraded = False
            self.degraded_since = None
            self.resyncs += 1
            log.warning("shared state resynchronised: Redis reachable, %d replicas", self.size)
        for callback in self._on_beat:
            try:
                await callback()
            except REDIS_FAILURES:
                return False
        return True

    async def start(self) -> None:
        if not await self.beat():
            log.warning("shared state: Redis unreachable at start; fail_mode %s", self.config.fail_mode)
        self._task = asyncio.get_running_loop().create_task(self._beat_forever(), name="state-heartbeat")

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3.0)
            await self.beat()

    async def stop(self) -> None:
        """Leave the membership and close; every step bounded (Redis may be gone)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.timeout_s * 2)
        if not self.degraded:
            with contextlib.suppress(*REDIS_FAILURES):
                await self.call(self.client.zrem(self._members_key, self.replica_id))
        with contextlib.suppress(*REDIS_FAILURES):
            await asyncio.wait_for(self.client.aclose(), self.timeout_s * 2)


@dataclass(slots=True, eq=False)
class _Slice:
    """A quota slice: one reservation in Redis (``size_ms``, ``live_size_ms`` live-token-ms,
    ``units`` of concurrency) that this replica admits its own requests on without a round
    trip, and closes in Redis with their summed charges once retired and empty (the unused
    rest of both goes back to the buckets)."""

    terms: AccountTerms
    rid: int  # the reservation's id in Redis
    size_ms: float
    units: int | None  # concurrent requests it may hold (None: the account has no limit)
    claimed_at: float  # this replica's clock
    left_ms: float  # size less what its open requests reserved and its closed ones were charged
    live_size_ms: float | None = None  # its share of the live-token bucket (None: the account has none)
    live_left_ms: float = 0.0  # as left_ms, of live_size_ms
    charged_ms: float = 0.0  # observed charges of its closed requests
    charged_live_token_ms: float = 0.0  # and their observed live-token-ms
    inflight: int = 0
    retired: bool = False  # admits no more; closes in Redis when its last request settles
    closed: bool = False


@dataclass(slots=True)
class _Cached:
    """The last account state Redis reported, for ``available`` between reservations."""

    level_ms: float | None
    class_level_ms: float | None
    borrowed_ms: float
    open_count: int
    queued_ms: float
    at: float  # this replica's clock when it was read
    live_level_ms: float | None = None  # the live-token bucket's (None: none or not reported)


class RedisQuotaStore:
    """The quota ledger of a fleet, in Redis; a ``QuotaStore`` for the pipeline."""

    def __init__(self, settings: QuotaSettings, fleet: RedisFleet) -> None:
        self._settings = settings
        self._terms = QuotaLedger(settings)  # resolves accounts and length caps; holds no traffic
        self.fleet = fleet
        prefix = fleet.config.key_prefix
        self._prefix = prefix
        self._reserve = fleet.script(lua.RESERVE)
        self._settle = fleet.script(lua.SETTLE)
        self._start = fleet.script(lua.START)
        self._renew = fleet.script(lua.RENEW)
        self._outstanding = fleet.script(lua.OUTSTANDING)
        self._open: dict[tuple[str, int], tuple[Reservation, AccountTerms]] = {}
        self._cache: dict[tuple[str, str], _Cached] = {}
        self._local: QuotaLedger | None = None  # the 1/N share while degraded (fail_mode local)
        self._unmetered_tenants: tuple[str, ...] = ()
        self._slice_share = fleet.config.quota_slice
        # Slices last between a half and one and a half heartbeat intervals (ttl/3) before
        # retiring: what a replica holds unused goes back within about a second (default TTL).
        self._slice_hold_s = fleet.ttl_s / 6.0
        self._slices: dict[tuple[str, str], list[_Slice]] = {}  # account -> its live slices
        self._on_slice: dict[tuple[str, int], tuple[Reservation, _Slice]] = {}
        self._claims: dict[tuple[str, str], asyncio.Task[_Slice | None]] = {}
        self._slice_ids = itertools.count(-1, -1)  # requests admitted on a slice: negative ids
        self.remote_reservations = 0  # reservations opened in Redis: slices and single requests
        self.slices_claimed = 0
        fleet.on_beat(self._beat)
        fleet.on_degraded(self._degrade)

    # ------------------------------------------------------------------ protocol

    @property
    def settings(self) -> QuotaSettings:
        return self._settings

    @property
    def degraded(self) -> bool:
        return self.fleet.degraded

    def accounts(self) -> tuple[tuple[str, str], ...]:
        return self._terms.accounts()

    def terms(self, tenant: str, request_class: str) -> AccountTerms:
        return self._terms.terms(tenant, request_class)

    def keys(self, terms: AccountTerms) -> list[str]:
        """acct, open, leases, class, ids: one class's hash tag."""
        tag = f"{self._prefix}{{q:{terms.request_class}}}"
        name = terms.tenant
        return [f"{tag}:a:{name}", f"{tag}:o:{name}", f"{tag}:l:{name}", f"{tag}:c", f"{tag}:ids"]

    def available(self, tenant: str, request_class: str, *, now: float) -> QuotaView:
        """The account as last reported by Redis, refilled to ``now`` on this replica's clock.

        Other replicas' reservations since then are not seen; the reservation script decides,
        so a view that is too generous costs a refused reservation, never an overshoot."""
        if self.degraded and self._local is not None:
            return self._local.available(tenant, request_class, now=now)
        view = self._terms.available(tenant, request_class, now=now)  # untouched: full buckets
        terms = self._terms.terms(tenant, request_class)
        cached = self._cache.get((terms.tenant, request_class))
        if not view.metered or cached is None:
            return view
        elapsed = max(0.0, now - cached.at)
        level = (
            min(terms.capacity_ms, cached.level_ms + terms.rate_ms_per_s * elapsed)
            if cached.level_ms is not None
            else view.available_accelerator_ms
        )
        # What this replica's slices still hold is its to spend (already debited in Redis).
        held = [s for s in self._slices.get((terms.tenant, request_class), ()) if not s.retired]
        level += sum(s.left_ms for s in held)
        live_level = view.available_live_token_ms
        live_rate, live_capacity = terms.live_token_rate_ms_per_s, terms.live_token_capacity_ms
        if cached.live_level_ms is not None and live_rate is not None and live_capacity is not None:
            live_level = min(live_capacity, cached.live_level_ms + live_rate * elapsed)
            live_level += sum(s.live_left_ms for s in held)
        borrowable = 0.0
        if terms.class_rate_ms_per_s is not None and terms.class_capacity_ms is not None and level >= 0:
            class_level = (
                min(terms.class_capacity_ms, cached.class_level_ms + terms.class_rate_ms_per_s * elapsed)
                if cached.class_level_ms is not None
                else terms.class_capacity_ms
            )
            borrowable = max(0.0, min(terms.borrow_limit_ms - cached.borrowed_ms, class_level))
        return QuotaView(
            tenant=view.tenant,
            request_class=view.request_class,
            metered=True,
            pooled=view.pooled,
            available_accelerator_ms=level,
            refill_ms_per_s=view.refill_ms_per_s,
            burst_ms=view.burst_ms,
            borrowable_ms=borrowable,
            available_live_token_ms=live_level,
            live_token_refill_ms_per_s=view.live_token_refill_ms_per_s,
            concurrent=cached.open_count,
            max_concurrent=view.max_concurrent,
            queued_ms=cached.queued_ms,
            max_queued_ms=view.max_queued_ms,
            max_input_tokens=view.max_input_tokens,
            max_output_tokens=view.max_output_tokens,
        )

    def outstanding(self) -> Outstanding:
        remote = [r for r, _ in self._open.values()] + [r for r, _ in self._on_slice.values()]
        local = self._local.outstanding() if self._local is not None else Outstanding(0, 0.0, 0.0, 0.0)
        return Outstanding(
            count=len(remote) + local.count,
            accelerator_ms=sum(r.demand_ms for r in remote) + local.accelerator_ms,
            live_token_ms=sum(r.live_token_ms for r in remote) + local.live_token_ms,
            borrowed_ms=sum(r.borrowed_ms for r in remote) + local.borrowed_ms,
        )

    async def reserve_admitted(self, record: RequestRecord, *, now: float) -> Reservation:
        return await self.reserve(
            record.identity.tenant,
            record.identity.request_class,
            demand_ms=record.demand.accelerator_ms,
            live_token_ms=record.demand.live_token_ms,
            input_tokens=record.shape.input_tokens,
            output_tokens=record.shape.max_output_tokens,
            now=now,
        )

    async def reserve(
        self,
        tenant: str,
        request_class: str,
        *,
        demand_ms: float,
        live_token_ms: float = 0.0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        now: float,
        redis_now: float | None = None,
    ) -> Reservation:
        """``QuotaLedger.reserve`` on the fleet's ledger. ``redis_now`` (tests): the script's
        clock instead of Redis's ``TIME``."""
        terms = self._terms.terms(tenant, request_class)
        if not terms.metered and terms.class_rate_ms_per_s is None:
            # Unmetered and no class share: nothing is shared, nothing to ask Redis.
            return self._local_ledger().reserve(
                tenant, request_class, demand_ms=demand_ms, live_token_ms=live_token_ms, now=now
            )
        self._terms.check_lengths(tenant, request_class, input_tokens, output_tokens)
        if self.degraded:
            return self._reserve_degraded(tenant, request_class, demand_ms, live_token_ms, now)
        if self._slice_size(terms, demand_ms, live_token_ms) is not None:
            on_slice = self._admit_on_slice(terms, tenant, demand_ms, live_token_ms, now)
            if on_slice is None and await self._claim_slice(terms, demand_ms, live_token_ms, now, redis_now):
                on_slice = self._admit_on_slice(terms, tenant, demand_ms, live_token_ms, now)
            if on_slice is not None:
                return on_slice
            if self.degraded:  # the claim failed: Redis is unreachable
                return self._reserve_degraded(tenant, request_class, demand_ms, live_token_ms, now)
        args = [
            _num(redis_now),
            repr(self.fleet.ttl_s),
            "1" if terms.metered else "0",
            _num(terms.rate_ms_per_s),
            _num(terms.capacity_ms),
            _num(terms.live_token_rate_ms_per_s),
            _num(terms.live_token_capacity_ms),
            _num(terms.borrow_limit_ms),
            _opt(terms.max_concurrent),
            _num(terms.max_queued_ms),
            _num(terms.class_rate_ms_per_s),
            _num(terms.class_capacity_ms),
            _num(demand_ms),
            _num(live_token_ms),
            self.fleet.replica_id,
            "",
        ]
        try:
            # The batch's deadline bounds this answer (and marks the replica degraded on failure).
            answer = await self.fleet.run_script(self._reserve, self.keys(terms), args)
        except REDIS_FAILURES:
            return self._reserve_degraded(tenant, request_class, demand_ms, live_token_ms, now)
        fields = [a.decode() if isinstance(a, bytes) else str(a) for a in answer]
        if fields[0] == "refused":
            _, rule, wait, need, level, open_count, queued = fields[:7]
            self._remember_refused(terms, fields)
            raise quota_refusal(
                terms,
                rule,
                int(wait),
                need=float(need),
                level=float(level),
                open_count=int(open_count),
                queued_ms=float(queued),
            )
        rid, borrowed = self._granted(terms, fields, remember=terms.metered)
        self.remote_reservations += 1
        reservation = Reservation(
            id=rid,
            tenant=tenant,
            request_class=request_class,
            demand_ms=demand_ms,
            live_token_ms=live_token_ms,
            borrowed_ms=borrowed,
            reserved_at=now,
            metered=terms.metered,
            pooled=terms.pooled,
        )
        self._open[(request_class, reservation.id)] = (reservation, terms)
        return reservation

    def start(self, reservation: Reservation, *, now: float) -> bool:
        if self._sliced(reservation) is not None:
            return True  # sliced accounts have no queued-work limit: nothing reads the start
        entry = self._remote(reservation)
        if entry is None:
            return self._local is not None and self._local.start(reservation, now=now)
        # Only the queued-work limit reads whether a reservation started; elsewhere the round
        # trip is saved (a concurrency refusal's retry hint then counts it as still queued:
        # a full execution, the upper bound). Degraded: it stays queued until it closes.
        if entry[1].max_queued_ms is not None and not self.degraded:
            keys = self.keys(entry[1])
            self.fleet.send_script(self._start, keys[:2], ["", str(reservation.id)])
        return True

    def settle(
        self,
        reservation: Reservation,
        *,
        charged_ms: float,
        charged_live_token_ms: float | None = None,
        now: float,
    ) -> Settlement | None:
        live = reservation.live_token_ms if charged_live_token_ms is None else charged_live_token_ms
        return self._close(reservation, charged_ms, live, now, "settled")

    def release(self, reservation: Reservation, *, now: float) -> Settlement | None:
        return self._close(reservation, 0.0, 0.0, now, "released")

    async def fleet_outstanding(self, *, redis_now: float | None = None) -> FleetOutstanding:
        """Every replica's open reservations in Redis, after reaping expired leases."""
        calls = [
            self.fleet.run_script(
                self._outstanding, self.keys(self._terms.terms(t, c))[:3], [_num(redis_now)]
            )
            for t, c in self._every_account()
        ]
        answers = await self.fleet.call(asyncio.gather(*calls))  # one pipeline: asked in one turn
        count, demand, owners = 0, 0.0, dict[str, int]()
        for answer in answers:
            fields = [a.decode() if isinstance(a, bytes) else str(a) for a in answer]
            count += int(fields[0])
            demand += float(fields[1])
            for owner, n in zip(fields[4::2], fields[5::2], strict=True):
                owners[owner] = owners.get(owner, 0) + int(n)
        return FleetOutstanding(count, demand, owners)

    async def level(self, tenant: str, request_class: str) -> float:
        """The account's accelerator-ms balance in Redis now (negative: owed)."""
        terms = self._terms.terms(tenant, request_class)
        pipe = self.fleet.client.pipeline(transaction=False)
        pipe.hmget(self.keys(terms)[0], ["alvl", "aupd"])
        pipe.time()
        (level, updated), (seconds, micros) = await self.fleet.call(pipe.execute())
        if level is None:
            return terms.capacity_ms
        elapsed = max(0.0, float(seconds) + float(micros) / 1e6 - float(updated))
        return min(terms.capacity_ms, float(level) + terms.rate_ms_per_s * elapsed)

    async def renew(self) -> None:
        """Push back the leases of this replica's open reservations and slices (one call per
        account)."""
        by_leases: dict[str, list[str]] = {}
        for (_, rid), (_, terms) in list(self._open.items()):
            by_leases.setdefault(self.keys(terms)[2], []).append(str(rid))
        for slices in self._slices.values():
            for piece in slices:
                by_leases.setdefault(self.keys(piece.terms)[2], []).append(str(piece.rid))
        if not by_leases:
            return
        ttl = repr(self.fleet.ttl_s)
        calls = [self._renew(keys=[k], args=["", ttl, *ids]) for k, ids in by_leases.items()]
        await self.fleet.call(asyncio.gather(*calls))

    async def drain(self) -> None:
        """Return every slice not in use, then wait (bounded by the call deadline) for
        background starts and settlements."""
        self.retire_slices(older_than_s=0.0)
        await self.fleet.drain()

    def retire_slices(self, *, older_than_s: float) -> None:
        """Retire the slices claimed at least ``older_than_s`` ago; the empty ones close now,
        the others when their last request settles."""
        now = clock.now()
        for slices in list(self._slices.values()):
            for piece in list(slices):
                if now - piece.claimed_at >= older_than_s:
                    self._retire(piece)

    async def _beat(self) -> None:
        self.retire_slices(older_than_s=self._slice_hold_s)
        await self.renew()

    # ------------------------------------------------------------------ internals

    def _every_account(self) -> Iterator[tuple[str, str]]:
        yield from self._terms.accounts()
        metered = set(self._terms.accounts())
        for request_class in self._settings.classes:  # unmetered tenants' reservations on a class share
            for tenant in self._unmetered_tenants:
                if (tenant, request_class) not in metered:
                    yield tenant, request_class

    def watch_unmetered(self, tenants: tuple[str, ...]) -> None:
        """Tenants without a quota whose class-share reservations ``fleet_outstanding`` reads."""
        self._unmetered_tenants = tenants

    # ------------------------------------------------------------------ quota slices

    def _slice_size(
        self, terms: AccountTerms, demand_ms: float, live_token_ms: float = 0.0
    ) -> tuple[float, float | None] | None:
        """The slice this account's requests are admitted on: its accelerator-ms and its
        live-token-ms (``None``: the account has no live-token bucket); ``None``: one
        reservation each.

        Only a metered account whose limits a slice can carry: accelerator-ms, live-token-ms
        and concurrency, each a ``quota_slice`` share of the account's, which the slice's
        requests spend locally as ``QuotaLedger`` spends the buckets (a request on a slice
        needs both shares to cover its prediction). The queued-work limit reads each
        request's start, so such an account (and a request larger than a slice in either
        bucket) reserves in Redis one by one."""
        if self._slice_share <= 0.0 or not terms.metered or terms.max_queued_ms is not None:
            return None
        size = self._slice_share * terms.capacity_ms
        if demand_ms > size:
            return None
        live_size: float | None = None
        if terms.live_token_rate_ms_per_s is not None and terms.live_token_capacity_ms is not None:
            live_size = self._slice_share * terms.live_token_capacity_ms
            if live_token_ms > live_size:
                return None
        return size, live_size

    def _slice_units(self, terms: AccountTerms) -> int | None:
        if terms.max_concurrent is None:
            return None
        return max(1, math.ceil(self._slice_share * terms.max_concurrent))

    def _sliced(self, reservation: Reservation) -> _Slice | None:
        entry = self._on_slice.get((reservation.request_class, reservation.id))
        if entry is None or entry[0] is not reservation:
            return None
        return entry[1]

    def _admit_on_slice(
        self, terms: AccountTerms, tenant: str, demand_ms: float, live_token_ms: float, now: float
    ) -> Reservation | None:
        """A reservation on one of this replica's slices of the account, without a round trip."""
        for piece in self._slices.get((terms.tenant, terms.request_class), ()):
            if piece.retired or (piece.units is not None and piece.inflight >= piece.units):
                continue
            if piece.left_ms < demand_ms - _EPSILON_MS or (
                piece.live_size_ms is not None and piece.live_left_ms < live_token_ms - _EPSILON_MS
            ):
                self._retire(piece)  # spent: the rest goes back when its requests have settled
                continue
            piece.left_ms -= demand_ms
            if piece.live_size_ms is not None:
                piece.live_left_ms -= live_token_ms
            piece.inflight += 1
            reservation = Reservation(
                id=next(self._slice_ids),
                tenant=tenant,
                request_class=terms.request_class,
                demand_ms=demand_ms,
                live_token_ms=live_token_ms,
                borrowed_ms=0.0,
                reserved_at=now,
                metered=True,
                pooled=terms.pooled,
            )
            self._on_slice[(terms.request_class, reservation.id)] = (reservation, piece)
            return reservation
        return None

    async def _claim_slice(
        self, terms: AccountTerms, demand_ms: float, live_token_ms: float, now: float, redis_now: float | None
    ) -> bool:
        """Claim a new slice of the account (one per account at a time: a request arriving
        while one is being claimed waits for that claim). False: none was granted."""
        key = (terms.tenant, terms.request_class)
        claim = self._claims.get(key)
        if claim is None:
            sizes, units = self._slice_size(terms, demand_ms, live_token_ms), self._slice_units(terms)
            assert sizes is not None
            size, live_size = sizes
            cached = self._cache.get(key)
            if cached is not None and cached.level_ms is not None:
                # The last answer says the slice would be refused: reserve this request alone.
                elapsed = max(0.0, clock.now() - cached.at)
                level = min(terms.capacity_ms, cached.level_ms + terms.rate_ms_per_s * elapsed)
                limit = terms.max_concurrent
                if level < size or (limit is not None and cached.open_count + (units or 1) > limit):
                    return False
                live_rate, live_capacity = terms.live_token_rate_ms_per_s, terms.live_token_capacity_ms
                if (
                    live_size is not None
                    and cached.live_level_ms is not None
                    and live_rate is not None
                    and live_capacity is not None
                    and min(live_capacity, cached.live_level_ms + live_rate * elapsed) < live_size
                ):
                    return False
            # A task of its own: a caller cancelled meanwhile does not lose the granted slice.
            claim = asyncio.get_running_loop().create_task(
                self._claim(terms, size, live_size, units, now, redis_now)
            )
            self._claims[key] = claim
            claim.add_done_callback(lambda done: self._claim_done(key, done))
        return await asyncio.shield(claim) is not None

    def _claim_done(self, key: tuple[str, str], done: asyncio.Task[_Slice | None]) -> None:
        if self._claims.get(key) is done:
            del self._claims[key]

    async def _claim(
        self,
        terms: AccountTerms,
        size: float,
        live_size: float | None,
        units: int | None,
        now: float,
        redis_now: float | None,
    ) -> _Slice | None:
        """One reservation in Redis of ``size`` accelerator-ms, ``live_size`` live-token-ms
        (when the account has that bucket) and ``units`` of concurrency, in one script call:
        both buckets are checked and debited atomically, as for one request."""
        live = live_size is not None
        args = [
            _num(redis_now),
            repr(self.fleet.ttl_s),
            "1",
            _num(terms.rate_ms_per_s),
            _num(terms.capacity_ms),
            _num(terms.live_token_rate_ms_per_s) if live else "",
            _num(terms.live_token_capacity_ms) if live else "",
            "0",  # a slice is paid from the account's own bucket: borrowing stays per request
            _opt(terms.max_concurrent),
            "",
            _num(terms.class_rate_ms_per_s),
            _num(terms.class_capacity_ms),
            _num(size),
            _num(live_size) if live else "0",
            self.fleet.replica_id,
            _opt(units),
        ]
        try:
            answer = await self.fleet.run_script(self._reserve, self.keys(terms), args)
        except REDIS_FAILURES:
            return None
        fields = [a.decode() if isinstance(a, bytes) else str(a) for a in answer]
        if fields[0] == "refused":
            self._remember_refused(terms, fields)
            return None
        rid, _borrowed = self._granted(terms, fields)
        self.remote_reservations += 1
        self.slices_claimed += 1
        piece = _Slice(
            terms=terms,
            rid=rid,
            size_ms=size,
            units=units,
            claimed_at=now,
            left_ms=size,
            live_size_ms=live_size,
            live_left_ms=live_size or 0.0,
        )
        if self.degraded:  # failed meanwhile: its lease expires in Redis
            piece.retired = piece.closed = True
        else:
            self._slices.setdefault((terms.tenant, terms.request_class), []).append(piece)
        return piece

    def _retire(self, piece: _Slice) -> None:
        piece.retired = True
        if piece.inflight == 0:
            self._close_slice(piece)

    def _close_slice(self, piece: _Slice) -> None:
        """Close the slice in Redis at what its requests were charged (in the background)."""
        if piece.closed:
            return
        piece.closed = True
        slices = self._slices.get((piece.terms.tenant, piece.terms.request_class))
        if slices is not None and piece in slices:
            slices.remove(piece)
        if not self.degraded:  # degraded: its lease expires and closes it at its whole size
            keys, args = self._settle_keys_args(
                piece.terms, piece.rid, piece.charged_ms, piece.charged_live_token_ms, None
            )
            self.fleet.send_script(self._settle, keys, args)

    def _remote(self, reservation: Reservation) -> tuple[Reservation, AccountTerms] | None:
        entry = self._open.get((reservation.request_class, reservation.id))
        if entry is None or entry[0] is not reservation:
            return None
        return entry

    def _granted(self, terms: AccountTerms, fields: list[str], *, remember: bool = True) -> tuple[int, float]:
        """A granted reserve script's answer: the reservation's id and its borrowed ms; the
        account's levels it reports go to the cache (``remember``)."""
        _, rid, borrowed, _at, level, class_level, acct_borrowed, open_count, queued, live_level = fields
        if remember:
            self._remember(
                terms,
                level=float(level),
                class_level=float(class_level) if class_level else None,
                borrowed_ms=float(acct_borrowed),
                open_count=int(open_count),
                queued_ms=float(queued),
                live_level=float(live_level) if live_level else None,
            )
        return int(rid), float(borrowed)

    def _remember_refused(self, terms: AccountTerms, fields: list[str]) -> None:
        """A refused reserve script's answer: the account's levels it reports go to the cache."""
        _, _rule, _wait, _need, _level, open_count, queued, level, live_level = fields
        self._remember(
            terms,
            level=float(level),
            open_count=int(open_count),
            queued_ms=float(queued),
            live_level=float(live_level) if live_level else None,
        )

    def _remember(
        self,
        terms: AccountTerms,
        *,
        level: float | None,
        class_level: float | None = None,
        borrowed_ms: float = 0.0,
        open_count: int,
        queued_ms: float,
        live_level: float | None = None,
    ) -> None:
        key = (terms.tenant, terms.request_class)
        before = self._cache.get(key)
        if class_level is None and before is not None:
            class_level = before.class_level_ms
        self._cache[key] = _Cached(
            level, class_level, borrowed_ms, open_count, queued_ms, clock.now(), live_level
        )

    def _local_ledger(self) -> QuotaLedger:
        if self._local is None:
            self._local = QuotaLedger(self._settings.scaled(1.0 / self.fleet.size))
        return self._local

    def _degrade(self) -> None:
        """Entering degraded mode: a fresh local share of 1/N from the last membership.

        Slices are dropped: their requests still settle here, nothing more is admitted on
        them, and their leases in Redis expire (closing as charged in full)."""
        for slices in self._slices.values():
            for piece in slices:
                piece.retired = piece.closed = True
        self._slices.clear()
        previous = self._local
        if previous is None or previous.outstanding().count == 0:
            self._local = QuotaLedger(self._settings.scaled(1.0 / self.fleet.size))

    def _reserve_degraded(
        self, tenant: str, request_class: str, demand_ms: float, live_token_ms: float, now: float
    ) -> Reservation:
        if self.fleet.config.fail_mode == "closed":
            raise Unavailable(
                "the fleet's shared quota state is unreachable (fail_mode closed)",
                rule=RULE_STATE_UNAVAILABLE,
                retry_after_ms=math.ceil(self.fleet.ttl_s * 1000 / 3),
            )
        return self._local_ledger().reserve(
            tenant,
            request_class,
            demand_ms=demand_ms,
            live_token_ms=live_token_ms,
            now=now,
            open_elsewhere=self._open_in_redis(tenant, request_class),
        )

    def _open_in_redis(self, tenant: str, request_class: str) -> tuple[float, ...]:
        """The predicted demands of the account's requests this replica still has open on
        reservations in Redis (alone or on a slice), which its degraded share counts against
        the concurrency limit: they hold the tenant's concurrency until they close."""
        account = self._terms.terms(tenant, request_class)

        def same(terms: AccountTerms) -> bool:
            return terms.tenant == account.tenant and terms.request_class == request_class

        return tuple(r.demand_ms for r, terms in self._open.values() if same(terms)) + tuple(
            r.demand_ms for r, piece in self._on_slice.values() if same(piece.terms)
        )

    def _settle_keys_args(
        self,
        terms: AccountTerms,
        reservation: Reservation | int,
        charged_ms: float,
        charged_live_token_ms: float,
        redis_now: float | None,
    ) -> tuple[list[str], list[str]]:
        rid = reservation if isinstance(reservation, int) else reservation.id
        args = [
            _num(redis_now),
            str(rid),
            _num(charged_ms),
            _num(charged_live_token_ms),
            _num(terms.rate_ms_per_s),
            _num(terms.capacity_ms),
            _num(terms.live_token_rate_ms_per_s),
            _num(terms.live_token_capacity_ms),
            _num(terms.class_rate_ms_per_s),
            _num(terms.class_capacity_ms),
        ]
        return self.keys(terms)[:4], args

    def _close(
        self,
        reservation: Reservation,
        charged_ms: float,
        charged_live_token_ms: float,
        now: float,
        kind: str,
    ) -> Settlement | None:
        sliced = self._sliced(reservation)
        if sliced is not None:
            del self._on_slice[(reservation.request_class, reservation.id)]
            sliced.inflight -= 1
            sliced.left_ms += reservation.demand_ms - charged_ms
            sliced.charged_ms += charged_ms
            if sliced.live_size_ms is not None:
                sliced.live_left_ms += reservation.live_token_ms - charged_live_token_ms
                sliced.charged_live_token_ms += charged_live_token_ms
            if sliced.retired:
                if sliced.inflight == 0:
                    self._close_slice(sliced)
            elif sliced.left_ms < 0.0 or sliced.live_left_ms < 0.0:
                self._retire(sliced)  # observed work beyond the slice: settle the debt now
            return self._settlement(reservation, charged_ms, charged_live_token_ms, kind)
        entry = self._remote(reservation)
        if entry is None:
            if self._local is None:
                return None
            if kind == "released":
                return self._local.release(reservation, now=now)
            return self._local.settle(
                reservation, charged_ms=charged_ms, charged_live_token_ms=charged_live_token_ms, now=now
            )
        del self._open[(reservation.request_class, reservation.id)]
        if not self.degraded:  # degraded: the lease expires and closes it at its prediction
            self.fleet.send_script(
                self._settle,
                *self._settle_keys_args(entry[1], reservation, charged_ms, charged_live_token_ms, None),
            )
        return self._settlement(reservation, charged_ms, charged_live_token_ms, kind)

    @staticmethod
    def _settlement(
        reservation: Reservation, charged_ms: float, charged_live_token_ms: float, kind: str
    ) -> Settlement:
        delta = charged_ms - reservation.demand_ms
        return Settlement(
            reservation_id=reservation.id,
            kind="released" if kind == "released" else "settled",
            predicted_ms=reservation.demand_ms,
            charged_ms=charged_ms,
            refunded_ms=max(0.0, -delta),
            extra_ms=max(0.0, delta),
            predicted_live_token_ms=reservation.live_token_ms,
            charged_live_token_ms=charged_live_token_ms,
        )
