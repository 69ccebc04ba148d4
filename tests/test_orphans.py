"""No orphans: the embedded Triton (and its Python backend stubs) dies with the gateway that
started it, even on ``kill -9``.

The real case: ``orchid-gateway serve`` on the example config (embedded Triton) in a process
of its own; every process below it is recorded from ``/proc`` (Triton, its stubs, the
reaper); the gateway is SIGKILLed; none of them may still run (a bounded poll of the process
table). Without the reaper, Triton and its stubs are reparented and keep running.

The stubs do not outlive Triton either: Triton killed alone (the gateway alive), its stubs
are gone within the bound. Neither leaves the Python backend's shared-memory regions in
/dev/shm (memory) behind. And the reaper itself (``gateway.backends.local.GroupReaper``) on
a process group of ``sleep``s: the owner's death kills the group, the leader's death kills
the rest of it, a clean release kills nothing."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway.backends.local import GroupReaper, LocalTriton
from orchid_tools.harness import GatewayProcess
from tests.conftest import MODEL_REPOSITORY
from tests.stack import Proc, alive, cmdline, descendants, example_config, kill_all, wait_until

GONE_WITHIN_S = 30.0  # bound of the poll for the processes to leave the table
SHM = Path("/dev/shm")


def _sleep_group() -> subprocess.Popen[bytes]:
    """A process group of two: a shell (the leader, in a session of its own) and its sleep."""
    return subprocess.Popen(
        ["sh", "-c", "sleep 600 & wait"], start_new_session=True, stdin=subprocess.DEVNULL
    )


def test_the_reaper_kills_the_group_when_its_owner_dies(tmp_path: Path) -> None:
    owner_script = textwrap.dedent(
        """
        import os, signal, subprocess, sys
        from gateway.backends.local import GroupReaper
        reaper = GroupReaper()
        group = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True,
                                 stdin=subprocess.DEVNULL)
        reaper.guard(group.pid)
        print(group.pid, reaper.process.pid, flush=True)
        sys.stdin.readline()  # until the test has recorded the processes
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
    )
    started: set[Proc] = set()
    try:
        assert owner.stdout is not None and owner.stdin is not None
        group_pid, reaper_pid = (int(v) for v in owner.stdout.readline().split())
        assert wait_until(lambda: len(descendants(owner.pid)) == 3, GONE_WITHIN_S)  # sh, sleep, reaper
        started = descendants(owner.pid)
        assert {group_pid, reaper_pid} <= {pid for pid, _ in started}
        owner.stdin.write(b"go\n")
        owner.stdin.close()
        assert owner.wait(timeout=30) == -signal.SIGKILL
        assert wait_until(lambda: not alive(started), GONE_WITHIN_S), [
            cmdline(pid) for pid, _ in alive(started)
        ]
    finally:
        owner.kill()
        owner.wait(timeout=30)
        kill_all(started)


def test_a_released_reaper_exits_and_kills_nothing() -> None:
    reaper = GroupReaper()
    group = _sleep_group()
    try:
        reaper.guard(group.pid)
        assert wait_until(lambda: len(descendants(group.pid)) == 1, GONE_WITHIN_S)  # its sleep
        members = descendants(group.pid)
        reaper.release()
        assert reaper.process.returncode == 0
        assert group.poll() is None and alive(members) == members
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        group.wait(timeout=30)
    unarmed = GroupReaper()  # a server that never started: nothing to guard, a clean exit
    unarmed.release()
    assert unarmed.process.returncode == 0


def test_the_rest_of_the_group_dies_with_its_leader() -> None:
    """The owner lives on; the group's leader (the server) is killed: its children (the stubs)
    must not run on without it."""
    reaper = GroupReaper()
    group = _sleep_group()
    members: set[Proc] = set()
    try:
        reaper.guard(group.pid)
        assert wait_until(lambda: len(descendants(group.pid)) == 1, GONE_WITHIN_S)
        members = descendants(group.pid)
        group.kill()  # the leader alone
        group.wait(timeout=30)
        assert wait_until(lambda: not alive(members), GONE_WITHIN_S)
        assert reaper.process.poll() is None  # still guarding, until released
    finally:
        reaper.release()
        kill_all(members)
    assert reaper.process.returncode == 0


@pytest.mark.triton
def test_the_stubs_die_with_triton(tmp_path: Path) -> None:
    repository = tmp_path / "repo" / "model_repository"
    shutil.copytree(MODEL_REPOSITORY / "compact-v11", repository / "compact-v11")
    shutil.copytree(MODEL_REPOSITORY.parent / "emulator", tmp_path / "repo" / "emulator")
    triton = LocalTriton(repository, tmp_path / "triton", time_factor=0.05)
    started: set[Proc] = set()
    # What already ran below this process (the session Triton and its stubs, other tests'
    # servers) is not this test's to clean up: only what its own start added.
    before = descendants(os.getpid())
    try:
        triton.start()
        assert triton.pid is not None
        stubs = descendants(triton.pid)
        assert stubs and all("triton_python_backend_stub" in cmdline(pid) for pid, _ in stubs)
        started = stubs | (descendants(os.getpid()) - before)
        regions = triton.shm_regions()
        assert regions  # one or more per stub, named with this server's prefix
        os.kill(triton.pid, signal.SIGKILL)  # the server alone; this process (its owner) lives on
        assert wait_until(lambda: not alive(stubs), GONE_WITHIN_S), [cmdline(p) for p, _ in alive(stubs)]
        # The reaper removed the shared memory a killed server cannot remove itself.
        assert wait_until(lambda: not any(r.exists() for r in regions), GONE_WITHIN_S), regions
    finally:
        triton.stop()
        kill_all(started)


@pytest.mark.triton
def test_kill_9_of_the_gateway_leaves_no_triton(tmp_path: Path) -> None:
    config = example_config(tmp_path, state_dir=tmp_path / "state", time_factor=0.05)
    gateway = GatewayProcess(config, tmp_path)
    started: set[Proc] = set()
    try:
        gateway.start(timeout_s=180.0)
        assert gateway.process is not None
        started = descendants(gateway.process.pid)
        commands = {proc: cmdline(proc[0]) for proc in started}
        tritons = [p for p, c in commands.items() if "tritonserver" in c]
        stubs = [p for p, c in commands.items() if "triton_python_backend_stub" in c]
        # Otherwise the test proves nothing: one server, and the stubs of its model instances.
        assert len(tritons) == 1 and len(stubs) >= 4, commands
        prefix = re.search(r"shm-region-prefix-name=(\S+)", commands[tritons[0]])
        assert prefix is not None, commands[tritons[0]]
        regions = sorted(SHM.glob(f"{prefix.group(1)}*"))
        assert len(regions) >= len(stubs), regions  # the stubs' shared memory, in tmpfs
        gateway.kill(session=False)
        assert gateway.process.returncode == -signal.SIGKILL
        assert wait_until(lambda: not alive(started), GONE_WITHIN_S), {p: commands[p] for p in alive(started)}
        assert wait_until(lambda: not any(r.exists() for r in regions), GONE_WITHIN_S), regions
    finally:
        gateway.kill(session=False)
        kill_all(started)
