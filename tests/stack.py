"""For tests that kill the example stack: a copy of ``examples/orchid/gateway.yaml`` to serve
(embedded Triton, jobs on; the process itself is ``tests.test_jobs_restart.GatewayProcess``),
and the process table (``/proc``) to find what a gateway started and whether any of it
outlived it.

``example_config`` writes the copy: every path the example names made absolute, the
emulator's time factor and the job state directory the test gives. A process is named by
(pid, start time), so a recycled pid is never taken for one that survived."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import EXAMPLE_CONFIG

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a live pid, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> set[Proc]:
    """Every live process below ``root`` (children, their children, ...)."""
    children: dict[int, list[Proc]] = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append((pid, stat[2]))
    found: set[Proc] = set()
    frontier = [root]
    while frontier:
        for proc in children.get(frontier.pop(), []):
            if proc not in found:
                found.add(proc)
                frontier.append(proc[0])
    return found


def alive(procs: Iterable[Proc]) -> set[Proc]:
    """Those still running: same pid *and* start time, and not a zombie (it runs nothing)."""
    left = set()
    for pid, started in procs:
        stat = _stat(pid)
        if stat is not None and stat[2] == started and stat[0] != "Z":
            left.add((pid, started))
    return left


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def kill_all(procs: Iterable[Proc]) -> None:
    """Clean up after a failed test: SIGKILL what is still running of ``procs``."""
    for pid, _ in alive(procs):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def example_config(
    work: Path, *, state_dir: Path, time_factor: float, model_repository: Path | None = None
) -> Path:
    """A copy of the example config in ``work`` (``GatewayProcess`` gives it a free port)."""
    data: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    base = EXAMPLE_CONFIG.parent
    for key in ("tenants_file", "routes_dir", "policies_dir"):
        data[key] = str((base / data[key]).resolve())
    local = data["local_triton"]
    local["model_repository"] = str(model_repository or (base / local["model_repository"]).resolve())
    local["time_factor"] = time_factor
    assert data["jobs"]["state_dir"], "the example serves jobs"
    data["jobs"]["state_dir"] = str(state_dir)
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
