"""Batch feature snapshots (issue 29 item 6): a batch with ``feature_snapshot`` T reads each
item's features as of T through Feast's historical retrieval, not the online values, and the
manifest records the snapshot. Against the real Feast repository the session fixture prepared
(``tests.feast_server``: users 1..50 but 7 and 8 have rows 3 h, 2 h and 1 h before its
``now``, ``score = user * 10 + hours_ago``, ``clicks = user * 100 + hours_ago``) and the session
Triton's ``ranker-v3``, which echoes the FEATURES input it received as FEATURES_SEEN.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.backends.local import LocalTriton
from gateway.config import FeatureSourceConfig, JobsConfig
from gateway.core.errors import InvalidArgument
from gateway.core.jobs import JobLimits, Kind
from gateway.features.historical import AS_OF_PARAMETER, parse_snapshot
from gateway.jobs.store import _SCHEMA, DB_NAME, NewOperation, PostgresJobStore, SqliteJobStore
from orchid_tools.featurestore import FeastServer
from tests.conftest import ORCHID_KEY, ThreadedGateway, gateway_config
from tests.postgres_server import PostgresServer, postgres

__all__ = ["postgres"]

ORCHID = (("authorization", f"Bearer {ORCHID_KEY}"),)


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def start(triton: LocalTriton, feast: FeastServer, tmp_path: Path, *, repo: Path | None) -> ThreadedGateway:
    registry = tmp_path / "registry.db"
    shutil.copy(feast.registry_path, registry)
    source = FeatureSourceConfig(url=feast.url, registry=registry, repo=repo)
    running = ThreadedGateway(
        gateway_config(
            triton.address,
            feature_sources={"feast": source},
            jobs=JobsConfig(state_dir=tmp_path / "state", poll_s=0.01),
        )
    )
    running.start()
    return running


@pytest.fixture(scope="module")
def served(
    triton: LocalTriton, feast_server: FeastServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadedGateway]:
    running = start(triton, feast_server, tmp_path_factory.mktemp("snapshots"), repo=feast_server.repo_path)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def stub(served: ThreadedGateway) -> Iterator[jobs_pb2_grpc.OperationsStub]:
    with grpc.insecure_channel(served.address) as channel:
        yield jobs_pb2_grpc.OperationsStub(channel)


def lines(users: list[int], **parameters: Any) -> bytes:
    out = []
    for i, user in enumerate(users):
        body = {
            "custom_id": f"user-{user}-{i}",
            "inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}],
            "parameters": {"user_id": user, **parameters},
        }
        out.append(json.dumps(body))
    return ("\n".join(out) + "\n").encode()


def submit(
    stub: jobs_pb2_grpc.OperationsStub, users: list[int], snapshot: str, *, model: str = "ranker"
) -> jobs_pb2.Operation:
    reply: jobs_pb2.Operation = stub.SubmitBatch(
        jobs_pb2.SubmitBatchRequest(jsonl=lines(users), model=model, feature_snapshot=snapshot),
        metadata=ORCHID,
        timeout=30,
    )
    return reply


def refused(
    stub: jobs_pb2_grpc.OperationsStub, users: list[int], snapshot: str, **kwargs: Any
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        submit(stub, users, snapshot, **kwargs)
    return caught.value


def finished(
    stub: jobs_pb2_grpc.OperationsStub, op_id: str
) -> tuple[jobs_pb2.Operation, list[Any], dict[str, Any]]:
    updates = list(stub.Wait(jobs_pb2.GetRequest(id=op_id), metadata=ORCHID, timeout=90))
    assert updates and updates[-1].status in {"completed", "failed", "expired", "cancelled"}, updates[-1:]
    page = stub.ReadBatchOutput(jobs_pb2.ReadBatchOutputRequest(id=op_id), metadata=ORCHID, timeout=10)
    return updates[-1], list(page.items), json.loads(page.manifest_json)


def seen(item: Any) -> list[float]:
    body = json.loads(item.response_json)
    [features] = [o for o in body["outputs"] if o["name"] == "FEATURES_SEEN"]
    return [float(v) for v in features["data"]]


def test_a_batch_with_a_snapshot_reads_point_in_time_values_and_the_manifest_records_it(
    stub: jobs_pb2_grpc.OperationsStub, feast_server: FeastServer
) -> None:
    # Between the 3 h and the 2 h rows: the 3 h-old values, not the online (1 h) ones.
    as_of = feast_server.now - timedelta(hours=2, minutes=30)
    accepted = submit(stub, [1, 2, 1], iso(as_of))
    assert accepted.feature_snapshot == iso(as_of)
    op, items, manifest = finished(stub, accepted.id)
    assert op.status == "completed", [i.error for i in items]
    assert [seen(i) for i in items] == [
        [13.0, 103.0, 0.015625],
        [23.0, 203.0, 0.03125],
        [13.0, 103.0, 0.015625],
    ]
    for item in items:
        provenance = json.loads(item.response_json)["parameters"]
        assert provenance["orchid.feature_snapshot"] == f"v12@{iso(as_of)}"  # as-of semantics
    assert manifest["feature_snapshot"] == {
        "as_of": iso(as_of),
        "source": "feast",
        "feature_service": "ranker_v12",
        "definition_version": "v12",
    }
    # Without a snapshot the same batch reads the online store: the latest (1 h old) values.
    online = stub.SubmitBatch(
        jobs_pb2.SubmitBatchRequest(jsonl=lines([1]), model="ranker"), metadata=ORCHID, timeout=30
    )
    assert online.feature_snapshot == ""
    op, items, manifest = finished(stub, online.id)
    assert op.status == "completed" and [seen(i) for i in items] == [[11.0, 101.0, 0.015625]]
    assert "feature_snapshot" not in manifest


def test_a_snapshot_before_any_value_fails_its_items_as_the_contract_says(
    stub: jobs_pb2_grpc.OperationsStub, feast_server: FeastServer
) -> None:
    as_of = feast_server.now - timedelta(hours=4)  # before every row: nothing as of then
    accepted = submit(stub, [1, 2], iso(as_of))
    op, items, manifest = finished(stub, accepted.id)
    # A batch is done when every item is (completed); its items failed, each saying why.
    assert op.status == "completed" and op.counts.failed == 2
    assert [i.status for i in items] == ["failed", "failed"]
    for item in items:
        assert item.error.startswith("FAILED_PRECONDITION"), item.error
        assert f"as of {iso(as_of)}" in item.error and "user_stats_v12:score is missing" in item.error
        assert item.attempts == 1 and not item.response_json  # failed, not retried, no other values read
    assert manifest["feature_snapshot"]["as_of"] == iso(as_of)


def test_a_malformed_future_or_unbacked_snapshot_is_refused_at_submit(
    stub: jobs_pb2_grpc.OperationsStub, feast_server: FeastServer
) -> None:
    for text, says in [
        ("yesterday", "not an RFC 3339 time"),
        ("2026-01-02T03:04:05", "no UTC offset"),
        (iso(datetime.now(UTC) + timedelta(hours=1)), "in the future"),
    ]:
        error = refused(stub, [1], text)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and says in str(error.details()), text
    past = iso(feast_server.now - timedelta(hours=2))
    no_contract = refused(stub, [1], past, model="full-v18")
    assert no_contract.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reads no features" in str(no_contract.details())
    # A batch line may not carry the runner's own parameter.
    with pytest.raises(grpc.RpcError) as caught:
        stub.SubmitBatch(
            jobs_pb2.SubmitBatchRequest(jsonl=lines([1], **{AS_OF_PARAMETER: 1.0}), model="ranker"),
            metadata=ORCHID,
            timeout=30,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_source_without_historical_retrieval_refuses_a_snapshot_batch(
    triton: LocalTriton, feast_server: FeastServer, tmp_path: Path
) -> None:
    running = start(triton, feast_server, tmp_path, repo=None)
    try:
        with grpc.insecure_channel(running.address) as channel:
            error = refused(
                jobs_pb2_grpc.OperationsStub(channel), [1], iso(feast_server.now - timedelta(hours=2))
            )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "feature_sources.feast.repo" in str(error.details())
    finally:
        running.stop()


def test_an_online_request_carrying_the_runners_as_of_parameter_is_refused(served: ThreadedGateway) -> None:
    client = grpcclient.InferenceServerClient(served.address)
    try:
        tensor = grpcclient.InferInput("INPUT_IDS", [1, 16], "INT32")
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        with pytest.raises(InferenceServerException) as caught:
            client.infer(
                "ranker",
                [tensor],
                parameters={"user_id": 1, AS_OF_PARAMETER: 1.0},
                headers={"authorization": f"Bearer {ORCHID_KEY}"},
            )
    finally:
        client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert AS_OF_PARAMETER in str(caught.value.message())


def test_parse_snapshot() -> None:
    now = datetime(2026, 1, 2, 12, tzinfo=UTC).timestamp()
    assert (
        parse_snapshot("2026-01-02T03:04:05Z", now=now)
        == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    )
    assert parse_snapshot("2026-01-02T04:04:05+01:00", now=now) == parse_snapshot(
        "2026-01-02T03:04:05Z", now=now
    )
    for text in ("", "2026-13-01T00:00:00Z", "2026-01-02 03:04", "2026-01-03T00:00:00Z"):
        with pytest.raises(InvalidArgument):
            parse_snapshot(text, now=now)


SNAPSHOT = {"as_of": "2026-01-02T03:04:05Z", "source": "feast"}


def _insert_and_claim(store: Any, op_id: str) -> Any:
    """A snapshot batch of one item, inserted and claimed: the snapshot is stored with the
    operation, and its item is claimed with the snapshot's time."""
    op, inserted = store.insert(
        NewOperation(
            id=op_id,
            tenant="t",
            idempotency_key=None,
            request_hash="h",
            input_sha256="s",
            kind=Kind.BATCH,
            request_class="batch",
            model="ranker",
            model_version="1",
            created_at=1.0,
            complete_by=100.0,
            feature_snapshot=SNAPSHOT,
        ),
        [("a", b"")],
    )
    assert inserted and op.feature_snapshot == SNAPSHOT
    claimed = store.claim(tenant="t", model="ranker", claim="c", now=2.0, lease_until=10.0)
    assert claimed is not None
    assert claimed.feature_as_of == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    return claimed


def test_an_existing_job_database_gains_the_snapshot_column(tmp_path: Path) -> None:
    # A database from before feature snapshots: the operations table without the column.
    old = _SCHEMA.replace("  feature_snapshot TEXT,\n", "")
    assert old != _SCHEMA
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.executescript(old)
    db.close()
    limits = JobLimits()
    store = SqliteJobStore(tmp_path, limits)
    try:
        claimed = _insert_and_claim(store, "op-1")
        assert store.complete(claimed, response=b"", provenance={}, charged_ms=0.0, now=3.0)
        sealed = store.get("t", "op-1")
        assert sealed is not None and sealed.manifest is not None
        assert sealed.manifest["feature_snapshot"] == SNAPSHOT
    finally:
        store.close()


def test_an_existing_postgres_job_database_gains_the_snapshot_column(postgres: PostgresServer) -> None:
    import psycopg

    old = (
        _SCHEMA.replace("  feature_snapshot TEXT,\n", "")
        .replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY")
        .replace(" BLOB", " BYTEA")
        .replace(" REAL ", " DOUBLE PRECISION ")
    )
    with psycopg.connect(postgres.dsn, autocommit=True) as db:
        for statement in old.split(";"):
            if statement.strip():
                db.execute(statement)
    store = PostgresJobStore(postgres.dsn, JobLimits())
    try:
        _insert_and_claim(store, "op-pg")
    finally:
        store.close()
