"""The example stack as a user runs it (and a second one beside it: refused, exit 3, before it
starts a Triton): ``orchid-gateway serve`` on ``examples/orchid/gateway.yaml``
(a copy with its own port, job state directory and a fast emulator: ``tests.stack``), the
embedded Triton it starts, the jobs it serves, and the CLI.

``batch submit`` of the demo's batch works; the gateway is killed with SIGKILL mid-batch; the
Triton it started (server and stubs) is gone; a gateway restarted on the same config completes
the batch with one answer per item: every item charged once, and the items finished before the
kill not run again (their request ids are unchanged); stopped with SIGTERM, it exits 0 and
leaves nothing it started running."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gateway._proto import jobs_pb2, jobs_pb2_grpc
from gateway.core.jobs import JobLimits
from gateway.jobs.store import DB_NAME, SqliteJobStore
from orchid_tools import cli, demo
from orchid_tools.harness import GatewayProcess
from tests.conftest import ORCHID_KEY, ROOT
from tests.stack import Proc, alive, cmdline, descendants, example_config, kill_all, wait_until
from tests.test_jobs_restart import wait_done

ITEMS = 300
METADATA = (("authorization", f"Bearer {ORCHID_KEY}"),)


def test_a_second_gateway_on_the_state_directory_exits_3_before_starting_triton(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder = SqliteJobStore(state, JobLimits())  # this process holds the directory
    try:
        config = example_config(tmp_path, state_dir=state, time_factor=0.05)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        serve = [sys.executable, "-m", "orchid_tools", "serve", "--config", str(config)]
        serve += ["--log-level", "INFO"]
        done = subprocess.run(serve, capture_output=True, text=True, env=env, timeout=120, check=False)
    finally:
        holder.close()
    assert done.returncode == 3, done.stderr
    assert f"job state directory {state} is in use by another gateway (pid {os.getpid()})" in done.stderr
    assert "starting local Triton" not in done.stderr  # the store is opened first


def _succeeded(state: Path) -> dict[str, str]:
    """custom_id -> the request id of its answer, for the items the store holds as succeeded."""
    with sqlite3.connect(state / DB_NAME) as db:
        rows = db.execute("SELECT custom_id, provenance FROM items WHERE status = 'succeeded'")
        return {custom_id: json.loads(prov)["orchid.request_id"] for custom_id, prov in rows}


@pytest.mark.slow
@pytest.mark.triton
def test_batch_on_the_example_stack_survives_kill_9_once_per_item(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    config = example_config(tmp_path, state_dir=state, time_factor=0.05)
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(demo.batch_jsonl(ITEMS, "row"))
    monkeypatch.setenv("ORCHID_API_KEY", ORCHID_KEY)
    first = GatewayProcess(config, tmp_path)
    started: set[Proc] = set()
    try:
        first.start(timeout_s=180.0)
        assert first.process is not None
        started = descendants(first.process.pid)
        assert any("tritonserver" in cmdline(pid) for pid, _ in started)  # the embedded one
        submit = ["batch", "submit", str(rows), "--model", "full-v18", "--target", first.listen]
        assert cli.main(submit) == 0, capsys.readouterr().err
        op_id = capsys.readouterr().out.strip()
        with grpc.insecure_channel(first.listen) as channel:
            stub = jobs_pb2_grpc.OperationsStub(channel)  # type: ignore[no-untyped-call]
            for update in stub.Wait(jobs_pb2.GetRequest(id=op_id), metadata=METADATA, timeout=120):
                if update.counts.completed >= ITEMS // 3:
                    break
        first.kill(session=False)  # mid-batch
        # Nothing the killed gateway started runs on: Triton, its stubs, the reaper.
        assert wait_until(lambda: not alive(started), 30.0), [cmdline(p) for p, _ in alive(started)]
    finally:
        first.kill(session=False)
        kill_all(started)
    before_kill = _succeeded(state)
    assert ITEMS // 3 <= len(before_kill) < ITEMS, "the kill did not land mid-batch"

    second = GatewayProcess(config, tmp_path)
    restarted: set[Proc] = set()
    try:
        second.start(timeout_s=180.0)
        assert second.process is not None
        restarted = descendants(second.process.pid)
        done = wait_done(second.listen, op_id)
        assert done.status == "completed", done.error
        assert cli.main(["batch", "get", op_id, "--json", "--target", second.listen]) == 0
        manifest = json.loads(capsys.readouterr().out)
        # A clean stop (SIGTERM): exit 0, and it stopped what it started.
        second.stop(timeout_s=30, session=False)
        assert second.process.returncode == 0
        assert wait_until(lambda: not alive(restarted), 30.0), [cmdline(p) for p, _ in alive(restarted)]
    finally:
        second.kill(session=False)
        kill_all(restarted)
    assert (manifest["total"], manifest["completed"], manifest["failed"]) == (ITEMS, ITEMS, 0)
    with sqlite3.connect(state / DB_NAME) as db:
        charges = dict(db.execute("SELECT custom_id, charges FROM items"))
    assert sorted(charges) == sorted(f"row-{i}" for i in range(ITEMS))
    assert set(charges.values()) == {1}, "every item charged exactly once"
    after = _succeeded(state)
    assert len(after) == ITEMS
    assert {c: after[c] for c in before_kill} == before_kill, "an item finished before the kill ran again"
