"""Durability of jobs across a hard kill: the gateway runs as its own process
(``python -m orchid_tools serve``) against the session's real Triton, is killed with
SIGKILL, and is started again on the same state directory.

* An acknowledged Submit survives a kill right after the acknowledgement and completes (the
  store the killed process left shows jobs that had not run yet, so the restart ran them).
* A 1,000-item batch killed midway completes after the restart: the manifest's counts equal
  the input's, no custom_id is duplicated, every item was charged exactly once, and the
  items finished before the kill were not run again (their request ids are unchanged)."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.backends.local import LocalTriton
from gateway.config import JobsConfig
from gateway.jobs.store import DB_NAME
from orchid_tools.harness import GatewayProcess
from tests.conftest import gateway_config
from tests.test_jobs import ORCHID, infer_request, jsonl


@pytest.fixture
def process_config(triton: LocalTriton, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    state = tmp_path / "state"
    config = gateway_config(triton.address, jobs=JobsConfig(state_dir=state, poll_s=0.01))
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    yield path, state


@contextlib.contextmanager
def running(config: Path) -> Iterator[GatewayProcess]:
    """The gateway on ``config`` (its log beside it, appended across restarts), killed at the end."""
    gateway = GatewayProcess(config, config.parent)
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.kill()


def wait_done(address: str, op_id: str) -> jobs_pb2.Operation:
    with grpc.insecure_channel(address) as channel:
        stub = jobs_pb2_grpc.OperationsStub(channel)
        updates = list(stub.Wait(jobs_pb2.GetRequest(id=op_id), metadata=ORCHID, timeout=120))
        assert updates
        return updates[-1]


@pytest.mark.slow
def test_submit_ack_survives_kill_9(process_config: tuple[Path, Path]) -> None:
    config, state = process_config
    ids = []
    with running(config) as gateway:
        with grpc.insecure_channel(gateway.listen) as channel:
            stub = jobs_pb2_grpc.OperationsStub(channel)
            # Long-bucket jobs (4,096 tokens: ~23 ms of device time each at the session's time
            # factor, a few at a time in the troughs), so the tail is still unfinished at the kill.
            for seed in range(40):
                job = infer_request(n=4096, seed=seed)
                request = jobs_pb2.SubmitRequest(infer_request=job.SerializeToString())
                ids.append(stub.Submit(request, metadata=ORCHID, timeout=10).id)
        gateway.kill()  # SIGKILL right after the last acknowledgement
    # What the killed process left: every acknowledged job is stored, and some had not run yet.
    with sqlite3.connect(state / DB_NAME) as db:
        stored = dict(db.execute("SELECT id, status FROM operations"))
    assert set(ids) <= set(stored)
    unfinished = [op_id for op_id in ids if stored[op_id] != "completed"]
    assert unfinished, "every job had finished before the kill: the test proves nothing"
    with running(config) as gateway:
        for op_id in ids:
            done = wait_done(gateway.listen, op_id)
            assert done.status == "completed", (op_id, done.status, done.error)
            assert done.counts.completed == 1 and done.infer_response


@pytest.mark.slow
def test_batch_of_1000_killed_midway_completes_once(
    process_config: tuple[Path, Path],
) -> None:
    config, state = process_config
    n = 1000
    data = jsonl(n, prefix="row")
    before_kill: dict[str, str] = {}
    with (
        running(config) as gateway,
        grpc.insecure_channel(gateway.listen) as channel,
    ):
        stub = jobs_pb2_grpc.OperationsStub(channel)
        op = stub.SubmitBatch(
            jobs_pb2.SubmitBatchRequest(jsonl=data, model="full-v18"), metadata=ORCHID, timeout=30
        )
        for update in stub.Wait(jobs_pb2.GetRequest(id=op.id), metadata=ORCHID, timeout=120):
            if update.counts.completed >= n // 3:
                break
        gateway.kill()  # midway: SIGKILL while items run
        assert gateway.process is not None and gateway.process.returncode == -signal.SIGKILL
    # What had finished at the kill, read from the store the killed process left.
    with sqlite3.connect(state / DB_NAME) as db:
        for custom_id, prov in db.execute(
            "SELECT custom_id, provenance FROM items WHERE status = 'succeeded'"
        ):
            before_kill[custom_id] = json.loads(prov)["orchid.request_id"]
    assert n // 3 <= len(before_kill) < n, "the kill did not land midway"
    with running(config) as gateway:
        done = wait_done(gateway.listen, op.id)
        assert done.status == "completed", done.error
        with grpc.insecure_channel(gateway.listen) as channel:
            stub = jobs_pb2_grpc.OperationsStub(channel)
            items, token, manifest = [], "", None
            while True:
                page = stub.ReadBatchOutput(
                    jobs_pb2.ReadBatchOutputRequest(id=op.id, page_size=1000, page_token=token),
                    metadata=ORCHID,
                    timeout=30,
                )
                manifest = manifest or json.loads(page.manifest_json)
                items.extend(page.items)
                token = page.next_page_token
                if not token:
                    break
        gateway.stop(timeout_s=30)
    assert manifest is not None
    assert (manifest["total"], manifest["completed"], manifest["failed"]) == (n, n, 0)
    custom_ids = [i.custom_id for i in items]
    assert len(custom_ids) == n and len(set(custom_ids)) == n
    assert set(custom_ids) == {f"row-{i}" for i in range(n)}
    with sqlite3.connect(state / DB_NAME) as db:
        charges = dict(db.execute("SELECT custom_id, charges FROM items"))
        after = {
            c: json.loads(p)["orchid.request_id"]
            for c, p in db.execute("SELECT custom_id, provenance FROM items")
        }
        kept_requests = db.execute("SELECT COUNT(*) FROM items WHERE request IS NOT NULL").fetchone()[0]
    assert set(charges.values()) == {1}, "every item charged exactly once"
    assert kept_requests == 0, "a finished item's request bytes are deleted"
    assert all(i.charged_accelerator_ms > 0 for i in items)
    assert manifest["charged_accelerator_ms"] == pytest.approx(
        sum(i.charged_accelerator_ms for i in items), abs=0.05
    )
    # Items finished before the kill were not run again: their answers are the same ones.
    assert {c: after[c] for c in before_kill} == before_kill
