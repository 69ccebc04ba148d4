"""The shared job store on a real PostgreSQL: replicas claim with ``FOR UPDATE SKIP LOCKED``
(never the same item twice), a dead replica's running item goes back to the queue when its
lease runs out (and its late answer is dropped), and two gateways on one database serve
one batch: submitted to one, followed and read through the other."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import grpc
import pytest

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.backends.local import LocalTriton
from gateway.config import JobsConfig
from gateway.core.jobs import JobLimits, Kind
from gateway.jobs.store import NewOperation, PostgresJobStore
from tests.conftest import ThreadedGateway, gateway_config
from tests.postgres_server import PostgresServer, postgres  # noqa: F401  (fixture)
from tests.test_jobs import ORCHID, jsonl

LIMITS = JobLimits()


def new_operation(op_id: str) -> NewOperation:
    return NewOperation(
        id=op_id,
        tenant="orchid",
        idempotency_key=None,
        request_hash="h",
        input_sha256="i",
        kind=Kind.BATCH,
        request_class="batch",
        model="full-v18",
        model_version="18",
        created_at=1000.0,
        complete_by=10_000.0,
    )


@pytest.fixture
def stores(postgres: PostgresServer) -> Iterator[tuple[PostgresJobStore, PostgresJobStore]]:  # noqa: F811
    a, b = PostgresJobStore(postgres.dsn, LIMITS), PostgresJobStore(postgres.dsn, LIMITS)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_concurrent_claims_never_take_the_same_item(
    stores: tuple[PostgresJobStore, PostgresJobStore],
) -> None:
    a, b = stores
    op, _ = a.insert(new_operation("op-skip-locked"), [(f"c{i}", b"x") for i in range(60)])
    taken: dict[str, list[int]] = {"a": [], "b": []}

    def drain(name: str, store: PostgresJobStore) -> None:
        while True:
            item = store.claim(
                tenant="orchid",
                model="full-v18",
                claim=f"{name}:{len(taken[name])}",
                now=1001.0,
                lease_until=2000.0,
            )
            if item is None:
                return
            taken[name].append(item.idx)

    threads = [threading.Thread(target=drain, args=(n, s)) for n, s in (("a", a), ("b", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not set(taken["a"]) & set(taken["b"])
    assert sorted(taken["a"] + taken["b"]) == list(range(60))
    assert b.by_seq(op.seq).counts.running == 60  # type: ignore[union-attr]


def test_dead_replicas_item_returns_to_the_queue_after_its_lease(
    stores: tuple[PostgresJobStore, PostgresJobStore],
) -> None:
    a, b = stores
    op, _ = a.insert(new_operation("op-lease"), [("only", b"x")])
    dead = a.claim(tenant="orchid", model="full-v18", claim="dead:1", now=1001.0, lease_until=1031.0)
    assert dead is not None and dead.op_seq == op.seq
    assert b.claim(tenant="orchid", model="full-v18", claim="live:1", now=1002.0, lease_until=1032.0) is None
    assert b.reclaim_lost(now=1030.0) == 0  # the lease still holds
    assert b.reclaim_lost(now=1031.5) == 1  # run out: back to the queue, the lost attempt counted
    again = b.claim(tenant="orchid", model="full-v18", claim="live:2", now=1032.0, lease_until=1062.0)
    assert again is not None and again.idx == dead.idx and again.attempts == 1
    assert b.complete(
        again, response=b"r", provenance={"orchid.policy_version": "p"}, charged_ms=5.0, now=1033.0
    )
    # The dead replica's late answer changes nothing: its claim is gone.
    assert not a.complete(dead, response=b"late", provenance={}, charged_ms=9.0, now=1034.0)
    final = b.by_seq(op.seq)
    assert final is not None and final.status == "completed" and final.charged_ms == 5.0
    assert [i.charges for i in b.items(op.seq, after_idx=-1, limit=10)] == [1]


def test_two_gateways_share_one_batch(
    triton: LocalTriton,
    postgres: PostgresServer,  # noqa: F811
) -> None:
    config = gateway_config(
        triton.address, jobs=JobsConfig(store="postgres", postgres_dsn=postgres.dsn, poll_s=0.01)
    )
    first, second = ThreadedGateway(config), ThreadedGateway(config)
    first.start()
    second.start()
    try:
        with grpc.insecure_channel(first.address) as one, grpc.insecure_channel(second.address) as two:
            submitted = jobs_pb2_grpc.OperationsStub(one).SubmitBatch(
                jobs_pb2.SubmitBatchRequest(jsonl=jsonl(30, prefix="pg"), model="full-v18"),
                metadata=ORCHID,
                timeout=30,
            )
            other = jobs_pb2_grpc.OperationsStub(two)
            final = list(other.Wait(jobs_pb2.GetRequest(id=submitted.id), metadata=ORCHID, timeout=120))[-1]
            assert final.status == "completed" and final.counts.completed == 30
            page = other.ReadBatchOutput(
                jobs_pb2.ReadBatchOutputRequest(id=submitted.id), metadata=ORCHID, timeout=30
            )
            assert sorted(i.custom_id for i in page.items) == sorted(f"pg-{i}" for i in range(30))
            assert json.loads(page.manifest_json)["completed"] == 30
    finally:
        first.stop()
        second.stop()
