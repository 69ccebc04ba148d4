"""The job runner waits for work instead of polling (``gateway.jobs.runner``): with nothing
ready or running it sleeps until the store's next due time (``JobStore.next_due``), at most
``jobs.idle_poll_s``, and a submission's ``wake`` ends the sleep at once.

The runner runs here over a real job store (SQLite; PostgreSQL for two replicas) and a
stand-in for the gateway's request path that records each attempt. Every test waits on
events (the stand-in's attempts, the runner entering its wait), never on the clock: the idle
cap is an hour wherever reaching the item some other way is what is shown, so only the
wake-up under test can have started it. The computed waits are read from ``_tick`` itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, cast

import pytest
from tritonclient.grpc import service_pb2

from gateway.config import JobsConfig
from gateway.core.errors import GatewayError, NotFound, Unavailable
from gateway.core.jobs import AttemptResult, ItemStatus, Kind
from gateway.jobs.runner import JobRunner, limits_of
from gateway.jobs.store import JobStore, NewOperation, PostgresJobStore, SqliteJobStore
from gateway.pipeline import Gateway
from tests.postgres_server import PostgresServer, postgres  # noqa: F401  (fixture)

HOUR_S = 3600.0
GUARD_S = 30.0  # a failure bound for an event that must come, never a timing under test
TENANT, MODEL = "t", "m"


class RequestPath:
    """Stands in for ``Gateway``: one tenant, no routes or pools (items run one at a time),
    and an ``infer_request`` that records each attempt's operation id and answers with one
    valid output, or raises the next of ``failures``."""

    def __init__(self) -> None:
        self.tenants = SimpleNamespace(tenants={TENANT: SimpleNamespace(name=TENANT)})
        self.routes = SimpleNamespace(models={})
        self.backends: dict[str, Any] = {}
        self.loads: dict[str, Any] = {}
        self.failures: list[GatewayError] = []
        self.attempts: asyncio.Queue[str] = asyncio.Queue()

    def tenant_route(self, tenant: Any, model: str) -> Any:
        raise NotFound("no routes here")

    def queue_named(self, name: str) -> None:
        return None

    async def infer_request(
        self, request: service_pb2.ModelInferRequest, tenant: Any, call: Any, *, mode: Any
    ) -> service_pb2.ModelInferResponse:
        self.attempts.put_nowait(request.parameters["orchid.operation_id"].string_param)
        if self.failures:
            raise self.failures.pop(0)
        response = service_pb2.ModelInferResponse(model_name=MODEL)
        response.outputs.add(name="OUT", datatype="INT32", shape=[1])
        response.raw_output_contents.append(b"\0\0\0\0")
        return response


class WatchedWake(asyncio.Event):
    """The runner's ``wake``, reporting the wait the runner chose each time it starts waiting."""

    def __init__(self, runner: JobRunner) -> None:
        super().__init__()
        self.runner = runner
        self.waits: asyncio.Queue[float] = asyncio.Queue()

    async def wait(self) -> Literal[True]:
        self.waits.put_nowait(self.runner.next_wait_s)
        return await super().wait()

    async def idle(self) -> None:
        """Until the runner waits its whole idle cap (the store has nothing due)."""
        async with asyncio.timeout(GUARD_S):
            while await self.waits.get() != self.runner.config.idle_poll_s:
                pass


def jobs_config(state: Path, **changes: Any) -> JobsConfig:
    settings: dict[str, Any] = {"poll_s": 0.01, "idle_poll_s": HOUR_S, "backoff_base_s": 0.2}
    return JobsConfig(state_dir=state, **(settings | changes))


def runner_on(store: JobStore, config: JobsConfig) -> tuple[JobRunner, RequestPath, WatchedWake]:
    path = RequestPath()
    runner = JobRunner(cast(Gateway, path), store, config)
    wake = WatchedWake(runner)
    runner.wake = wake
    return runner, path, wake


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteJobStore]:
    opened = SqliteJobStore(tmp_path / "state", limits_of(jobs_config(tmp_path)))
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
async def stopping() -> AsyncIterator[list[JobRunner]]:
    """Runners a test started, stopped at its end."""
    started: list[JobRunner] = []
    try:
        yield started
    finally:
        for runner in started:
            await runner.stop()


def submit(store: JobStore, op_id: str, *, complete_within_s: float = HOUR_S) -> int:
    """Store a one-item async operation as ``OperationsServicer.submit`` does (no wake)."""
    now = time.time()
    op, inserted = store.insert(
        NewOperation(
            id=op_id,
            tenant=TENANT,
            idempotency_key=None,
            request_hash="h",
            input_sha256="i",
            kind=Kind.ASYNC,
            request_class="batch",
            model=MODEL,
            model_version="1",
            created_at=now,
            complete_by=now + complete_within_s,
        ),
        [("only", service_pb2.ModelInferRequest(model_name=MODEL).SerializeToString())],
    )
    assert inserted
    return op.seq


async def done(runner: JobRunner, store: JobStore, seq: int) -> str:
    """The operation's status once the runner's attempts in flight have stored their outcome
    (called after an attempt was seen: the attempt is in flight or already recorded)."""
    await asyncio.gather(*(entry.task for entry in runner._running.values() if entry.task is not None))
    op = await asyncio.to_thread(store.by_seq, seq)
    assert op is not None
    return str(op.status)


async def test_a_submission_wakes_the_runner_from_its_idle_wait(
    store: SqliteJobStore, tmp_path: Path, stopping: list[JobRunner]
) -> None:
    runner, path, wake = runner_on(store, jobs_config(tmp_path))
    runner.start()
    stopping.append(runner)
    await wake.idle()  # nothing stored: it sleeps for the whole hour
    seq = await asyncio.to_thread(submit, store, "op-woken")
    wake.set()  # what the service does after the insert committed
    async with asyncio.timeout(GUARD_S):
        assert await path.attempts.get() == "op-woken"
    assert await done(runner, store, seq) == "completed"


async def test_a_retry_starts_when_its_backoff_ends_without_a_wake(
    store: SqliteJobStore, tmp_path: Path, stopping: list[JobRunner]
) -> None:
    runner, path, wake = runner_on(store, jobs_config(tmp_path))
    path.failures.append(Unavailable("backend unavailable"))  # the first attempt: retried
    seq = await asyncio.to_thread(submit, store, "op-retry")
    runner.start()
    stopping.append(runner)
    async with asyncio.timeout(GUARD_S):
        assert await path.attempts.get() == "op-retry"
        # After the failed attempt the runner sleeps until the backoff ends, not for the hour.
        while (waited := await wake.waits.get()) == runner.config.poll_s:
            pass
        assert waited < runner.config.idle_poll_s
        assert await path.attempts.get() == "op-retry"  # nothing set the wake: the due time did
    assert await done(runner, store, seq) == "completed"
    item = (await asyncio.to_thread(store.items, seq, after_idx=-1, limit=1))[0]
    assert item.attempts == 1 and item.status is ItemStatus.SUCCEEDED


async def test_a_lost_replicas_item_is_reclaimed_when_its_lease_runs_out(
    store: SqliteJobStore, tmp_path: Path, stopping: list[JobRunner]
) -> None:
    seq = await asyncio.to_thread(submit, store, "op-lost")
    wall = time.time()
    lost = await asyncio.to_thread(
        store.claim, tenant=TENANT, model=MODEL, claim="lost:1", now=wall, lease_until=wall + 0.3
    )
    assert lost is not None
    runner, path, _ = runner_on(store, jobs_config(tmp_path))
    runner.start()
    stopping.append(runner)
    async with asyncio.timeout(GUARD_S):
        assert await path.attempts.get() == "op-lost"
    assert await done(runner, store, seq) == "completed"
    item = (await asyncio.to_thread(store.items, seq, after_idx=-1, limit=1))[0]
    assert item.attempts == 1  # the lost attempt counted


async def test_the_idle_wait_is_the_next_due_time_capped(store: SqliteJobStore, tmp_path: Path) -> None:
    """The wait ``_tick`` chooses, driven directly (no loop running): the idle cap with nothing
    stored; the time until a backoff ends; ``poll_s`` while an item waits ready but may not
    start; the time until an operation's complete-by."""
    config = jobs_config(tmp_path, idle_poll_s=1000.0)
    runner, _, _ = runner_on(store, config)
    assert await runner._tick() == 1000.0
    submit(store, "op-backoff")
    wall = time.time()
    claimed = store.claim(tenant=TENANT, model=MODEL, claim="x:1", now=wall, lease_until=wall + 5000.0)
    assert claimed is not None
    later = AttemptResult(ItemStatus.QUEUED, 1, wall + 100.0)
    assert store.failed_attempt(claimed, later, error="UNAVAILABLE: test", now=wall)
    assert 99.0 <= await runner._tick() <= 100.0  # the backoff ends in 100 s: sooner than the cap
    # A ready item the pacer holds back (a pool without evidence runs one item at a time,
    # and one is running): the short interval, so that it starts soon after it may.
    submit(store, "op-held")
    pool = runner._may_start(TENANT, MODEL, 0.0)
    assert pool is not None
    runner._pacing[pool].running = 1
    assert await runner._tick() == config.poll_s
    runner._pacing[pool].running = 0
    store.request_cancel(TENANT, "op-held", now=wall)
    # An item running elsewhere (leased for 5000 s) whose operation must complete within 50 s:
    # its expiry is housekeeping's next work.
    seq = submit(store, "op-expiring", complete_within_s=50.0)
    claimed = store.claim(tenant=TENANT, model=MODEL, claim="y:1", now=wall, lease_until=wall + 5000.0)
    assert claimed is not None and claimed.op_seq == seq
    assert 49.0 <= await runner._tick() <= 50.0


async def test_a_second_replica_runs_what_the_first_stored(
    store: SqliteJobStore, tmp_path: Path, stopping: list[JobRunner]
) -> None:
    """Two runners on one store: an item stored through A (whose wake reaches only A, which is
    not running) is started by B at its next idle pass."""
    config = jobs_config(tmp_path, idle_poll_s=0.2)
    a, _, _ = runner_on(store, config)
    b, path, wake = runner_on(store, config)
    b.start()
    stopping.append(b)
    await wake.idle()
    seq = await asyncio.to_thread(submit, store, "op-via-a")
    a.wake.set()
    async with asyncio.timeout(GUARD_S):
        assert await path.attempts.get() == "op-via-a"
    assert await done(b, store, seq) == "completed"


async def test_postgres_replicas_see_each_others_submissions(
    postgres: PostgresServer,  # noqa: F811
    tmp_path: Path,
    stopping: list[JobRunner],
) -> None:
    """The same on PostgreSQL, each replica on its own connection: B, idle, runs an item
    submitted through A; A, idle in turn, runs one submitted through B."""
    config = JobsConfig(store="postgres", postgres_dsn=postgres.dsn, poll_s=0.01, idle_poll_s=0.2)
    limits = limits_of(config)
    store_a = await asyncio.to_thread(PostgresJobStore, postgres.dsn, limits)
    store_b = await asyncio.to_thread(PostgresJobStore, postgres.dsn, limits)
    try:
        a, path_a, wake_a = runner_on(store_a, config)
        b, path_b, wake_b = runner_on(store_b, config)
        # (the idle runner, its path and wake, the other replica's store, the operation)
        for runner, path, wake, other, op in (
            (b, path_b, wake_b, store_a, "op-pg-via-a"),
            (a, path_a, wake_a, store_b, "op-pg-via-b"),
        ):
            runner.start()
            stopping.append(runner)
            await wake.idle()
            seq = await asyncio.to_thread(submit, other, op)
            async with asyncio.timeout(GUARD_S):
                assert await path.attempts.get() == op
            assert await done(runner, other, seq) == "completed"
            await runner.stop()
        assert path_a.attempts.empty() and path_b.attempts.empty()  # each item ran once
    finally:
        for runner in stopping:
            await runner.stop()
        stopping.clear()
        store_a.close()
        store_b.close()
