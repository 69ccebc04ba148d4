"""Supervise a local Triton Inference Server from the ``nvidia-pytriton`` wheel.

The wheel ships a ``tritonserver`` binary (server 2.51) and the Python backend.
On a CPU-only machine it needs three things (ARCHITECTURE §6):

* a backend directory holding ``python/libtriton_python.so`` *and* the Python
  backend stub built for this interpreter's version, copied beside it;
* ``LD_LIBRARY_PATH`` pointing at ``site-packages/nvidia_pytriton.libs`` (the
  stub needs its bundled libcudart, even on CPU);
* this virtual environment's ``bin/`` first on ``PATH``, or models fail with
  ``No module named 'numpy'``.

``LocalTriton`` prepares that, starts the server on free ports, waits until it
reports ready (or fails with the tail of its log), and stops it: SIGTERM, then
SIGKILL after a bound. NVML/DCGM warnings in its log are harmless. Unless the caller's ``env``
names one, the server's ``ORCHID_PREFIX_CACHE_DIR`` (the emulator's prefix cache) is
``<workdir>/prefix-cache``, emptied at each start: each server's cache is its own and starts cold.

**No orphans.** The server runs in a session of its own (its process group holds the Python
backend stubs it forks), so stopping it kills the whole group. A process that dies without
stopping it (``kill -9``, an OOM kill, a crash) cannot do that itself, so every started server
is guarded by a *reaper*: a small process (``GroupReaper``) in a session of its own that
blocks reading a pipe only the starting process holds open. When that process ends, however
it ends, the kernel closes the pipe; the reaper reads end-of-file and SIGKILLs the server's
process group, stubs included, then exits. A clean stop tells the reaper first, so it exits
without killing. The stubs do not notice a killed server by themselves (they ran on for
minutes in our check), so the reaper also kills the rest of the group within a second of the
server's own death. (Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that forked the child
exits, and the gateway starts Triton from a worker thread; a pipe belongs to the process.)

**No shared memory left behind.** The Python backend keeps its regions in ``/dev/shm`` and
removes them only on a clean exit; each server here names them with a prefix of its own
(``shm_prefix``), and a kill, a crash, a failed start and the reaper remove what is left.

**Restarted after a crash.** The gateway's embedded server is watched (``supervise``): a server
that exits while nobody stopped it (Triton 2.51 can segfault on a gRPC call cancelled just as it
completes) is logged with its exit status and the tail of its log, and started again on the
same port, at once the first time and then after a doubling delay while it keeps crashing soon
after its start (``RestartBackoff``). A stop wins over a restart under way (``restart``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway import clock

log = logging.getLogger("orchid.local_triton")
SUPERVISE_INTERVAL_S = 0.5  # how often the supervisor looks at the embedded server (the probe's period)
LOG_TAIL_LINES = 30  # of a crashed server's log, in the gateway's log
SHM_DIR = Path("/dev/shm")


class TritonStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstallation:
    binary: Path
    python_backend: Path
    stub: Path
    libs: Path

    @classmethod
    def find(cls) -> TritonInstallation:
        site = Path(sysconfig.get_paths()["purelib"])
        root = site / "pytriton" / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        found = cls(
            binary=root / "bin" / "tritonserver",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
            libs=site / "nvidia_pytriton.libs",
        )
        for path in (found.binary, found.python_backend, found.stub, found.libs):
            if not path.exists():
                raise TritonStartError(
                    f"{path} is missing: install the Triton wheel with `pip install nvidia-pytriton==0.7.0`"
                )
        return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The reaper: reads the process group to guard and the name prefix of its shared-memory regions
# (one line), then waits on its stdin. "stopped"
# means a clean stop (nothing to do); end-of-file alone means the process that started the
# group is gone: SIGKILL the group. Meanwhile, once a second, it checks the group's leader (the
# server): dead (gone, a zombie, or its pid now someone else's), the rest of the group (the
# Python backend stubs, which outlive a killed server) is killed at once, and the group is not
# touched again. Whenever it kills the group it also removes the group's regions from /dev/shm
# (Triton's Python backend leaves them behind when it does not exit cleanly, 1 MiB or more per
# model instance, in memory). -I -S: no site, no environment; Linux's /proc for the check.
_REAPER_SOURCE = """
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
PROC = os.path.isdir("/proc/self")
SHM = "/dev/shm"

def leader_alive(pgid):
    try:
        with open("/proc/%d/stat" % pgid) as f:
            text = f.read()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2:].split()
    return fields[0] != "Z" and int(fields[2]) == pgid

def kill(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

data = b""
while b"\\n" not in data:
    chunk = os.read(0, 64)
    if not chunk:
        sys.exit(0)
    data += chunk
def clean(prefix):
    if not prefix:
        return
    try:
        names = os.listdir(SHM)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM, name))
            except OSError:
                pass

head, data = data.split(b"\\n", 1)
if not head.strip():
    sys.exit(0)
fields = head.decode().split()
pgid, prefix, done = int(fields[0]), fields[1] if len(fields) > 1 else "", False
while not data.startswith(b"stopped"):
    if select.select([0], [], [], 1.0)[0]:
        chunk = os.read(0, 64)
        if not chunk:
            if not done:
                kill(pgid)
                clean(prefix)
            break
        data += chunk
    elif PROC and not done and not leader_alive(pgid):
        kill(pgid)
        clean(prefix)
        done = True
"""
_STOPPED = b"stopped\n"


class GroupReaper:
    """Kills a process group when this process ends without releasing it (see the module
    docstring). ``guard(pgid)`` arms it; ``release()`` (a clean stop) disarms it and waits for
    the reaper to exit. The pipe's write end is close-on-exec and never inherited."""

    def __init__(self) -> None:
        read_end, self._write_end = os.pipe()  # both non-inheritable (PEP 446)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _REAPER_SOURCE],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's ^C or a group kill of the gateway spares it
            )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        self._armed = False

    def guard(self, pgid: int, shm_prefix: str = "") -> None:
        """Guard process group ``pgid``; when it kills the group it also removes the files in
        /dev/shm whose names start with ``shm_prefix`` (none if empty)."""
        if any(c.isspace() for c in shm_prefix) or "/" in shm_prefix:
            raise ValueError(f"not a shared-memory name prefix: {shm_prefix!r}")
        os.write(self._write_end, f"{pgid} {shm_prefix}\n".encode())
        self._armed = True

    def release(self, timeout_s: float = 10.0) -> None:
        """The group was stopped on purpose: the reaper exits without killing anything."""
        if self._write_end < 0:
            return
        with contextlib.suppress(OSError):  # a reaper killed by someone else: nothing to tell
            os.write(self._write_end, _STOPPED if self._armed else b"\n")
        os.close(self._write_end)
        self._write_end = -1
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout_s)


def stop_process_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM a process started with ``start_new_session``, SIGKILL it after ``timeout_s``,
    then SIGKILL whatever is left in its session: Triton's Python backend stubs live there
    and must not outlive the server, even when the server itself already exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class LocalTriton:
    """One supervised ``tritonserver`` process. Synchronous on purpose: it is used at
    startup/shutdown and from pytest fixtures, never on the request path."""

    def __init__(
        self,
        model_repository: Path,
        workdir: Path,
        *,
        grpc_port: int = 0,
        time_factor: float = 1.0,
        startup_timeout_s: float = 90.0,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_repository = model_repository
        self.workdir = workdir
        self.grpc_port = grpc_port or free_port()
        self.time_factor = time_factor
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = extra_args
        self.env = dict(env or {})  # added to the server's environment (e.g. ORCHID_FAULT_DIR)
        self.log_path = workdir / "tritonserver.log"
        # Its Python backend's shared-memory regions are named with this prefix (unique to this
        # object), so what a server that did not exit cleanly left in /dev/shm can be removed.
        self.shm_prefix = f"orchid_triton_{uuid.uuid4().hex[:16]}_"
        self._process: subprocess.Popen[bytes] | None = None
        self._reaper: GroupReaper | None = None
        # Serialises launching with stopping: a restart from the supervisor's worker thread
        # must not start a server after (or while) the owner stops this one.
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _prepare_backends(self, install: TritonInstallation) -> Path:
        backends = self.workdir / "backends"
        python_dir = backends / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        copies = [
            (item, python_dir / item.name) for item in install.python_backend.iterdir() if item.is_file()
        ]
        copies.append((install.stub, python_dir / "triton_python_backend_stub"))
        for source, target in copies:
            # On restart the old stubs may still be exiting ("text file busy"): keep a prepared copy.
            if not target.exists() or target.stat().st_size != source.stat().st_size:
                shutil.copy2(source, target)
        return backends

    def start(self) -> None:
        with self._lock:
            self._stopped = False
            self._launch()
        self._wait_ready()

    def restart(self, exited_pid: int) -> bool:
        """Start the server again after the server ``exited_pid`` exited, unless it was stopped
        since or another server was started in its place; whether it started one (ready, or
        ``TritonStartError`` as ``start``)."""
        with self._lock:
            process = self._process
            if self._stopped or process is None or process.pid != exited_pid or process.poll() is None:
                return False
            self._launch()
        self._wait_ready()
        return True

    def _launch(self) -> None:
        if self._process is not None:  # a server before this one: its whole group is gone first
            stop_process_group(self._process, 20.0)
        if not self.model_repository.is_dir():
            raise TritonStartError(f"model repository {self.model_repository} does not exist")
        install = TritonInstallation.find()
        self.workdir.mkdir(parents=True, exist_ok=True)
        backends = self._prepare_backends(install)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p
        )
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env["ORCHID_TIME_FACTOR"] = repr(self.time_factor)
        if "ORCHID_PREFIX_CACHE_DIR" not in self.env:
            # Each server its own prefix cache (the emulator's chat-v1), cold at every start.
            prefix_cache = self.workdir / "prefix-cache"
            shutil.rmtree(prefix_cache, ignore_errors=True)
            prefix_cache.mkdir(parents=True, exist_ok=True)
            env["ORCHID_PREFIX_CACHE_DIR"] = str(prefix_cache)
        env.update(self.env)
        args = [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--grpc-port={self.grpc_port}",
            "--grpc-address=127.0.0.1",
            "--allow-http=false",
            "--allow-metrics=false",
            "--log-verbose=0",
            "--exit-timeout-secs=10",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]
        self._release_reaper()  # a restart: the previous server's reaper has nothing left to guard
        self._remove_shm_regions()  # what a previous server that crashed left behind
        self._reaper = GroupReaper()  # before the server: it is guarded from its first moment
        log = self.log_path.open("wb")
        try:
            self._process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: the server and its stubs
            )
        except BaseException:
            self._release_reaper()
            raise
        finally:
            log.close()
        try:
            self._reaper.guard(self._process.pid, self.shm_prefix)
        except OSError as error:  # the reaper is gone: never run an unguarded server
            self._end(20.0)
            raise TritonStartError(f"the process that guards tritonserver exited: {error}") from None

    @property
    def pid(self) -> int | None:
        """The server's pid (also its process group's id), while it was started."""
        return self._process.pid if self._process is not None else None

    @property
    def stopped(self) -> bool:
        """Stopped by its owner (``stop``), and not started since."""
        return self._stopped

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it has exited (negative: the signal that ended it),
        ``None`` while it runs or before it was started."""
        return self._process.poll() if self._process is not None else None

    @property
    def reaper_pid(self) -> int | None:
        return self._reaper.process.pid if self._reaper is not None else None

    def _release_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    raise TritonStartError(
                        f"tritonserver exited with {self._process.returncode}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(grpc.RpcError):
                    if stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=1.0).ready:
                        return
                time.sleep(0.2)
        self._end(20.0)  # not a stop: a supervisor may still start it again
        raise TritonStartError(
            f"tritonserver not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """Abrupt loss (fault injection): SIGKILL the server and its stubs."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=10)
        self._release_reaper()
        self._remove_shm_regions()

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server for good: a restart under way or asked for later starts nothing."""
        with self._lock:
            self._stopped = True
        self._end(timeout_s)

    def _end(self, timeout_s: float) -> None:
        process = self._process
        if process is not None:
            stop_process_group(process, timeout_s)
        self._release_reaper()
        self._remove_shm_regions()

    def shm_regions(self) -> list[Path]:
        """The shared-memory regions in /dev/shm named with this server's prefix."""
        try:
            return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))
        except OSError:
            return []

    def _remove_shm_regions(self) -> None:
        """Once its process group is gone: a server that exits cleanly removes its regions
        itself; one that was killed or crashed leaves them (memory, in tmpfs)."""
        for region in self.shm_regions():
            with contextlib.suppress(OSError):
                region.unlink()


def _signal_name(status: int) -> str:
    try:
        return f" ({signal.Signals(-status).name})" if status < 0 else ""
    except ValueError:
        return ""


class RestartBackoff:
    """How long to wait before starting a crashed server again: ``initial_s`` the first time,
    then ``first_retry_s`` doubling up to ``max_s`` while each restarted server exits within
    ``stable_s`` of its start; a server that ran ``stable_s`` or longer starts the count again.
    Times are passed in (no clock)."""

    def __init__(
        self,
        *,
        initial_s: float = 0.0,
        first_retry_s: float = 1.0,
        max_s: float = 30.0,
        stable_s: float = 60.0,
    ) -> None:
        self.initial_s = initial_s
        self.first_retry_s = first_retry_s
        self.max_s = max_s
        self.stable_s = stable_s
        self._retries = 0

    def delay_s(self, *, started_at: float, exited_at: float) -> float:
        """The wait before the next start, for a server that ran from ``started_at`` until it
        exited at ``exited_at``."""
        if exited_at - started_at >= self.stable_s:
            self._retries = 0
        if self._retries == 0:
            delay = self.initial_s
        else:
            delay = min(self.first_retry_s * 2 ** (self._retries - 1), self.max_s)
        self._retries += 1
        return delay


async def supervise(
    triton: LocalTriton, *, interval_s: float = SUPERVISE_INTERVAL_S, backoff: RestartBackoff | None = None
) -> None:
    """Run until cancelled: every ``interval_s``, if ``triton`` exited without being stopped,
    log its exit status and log tail and start it again on its port after ``backoff``'s delay.
    A start that fails is logged and tried again after the next, longer delay."""
    backoff = backoff if backoff is not None else RestartBackoff()
    started_at = clock.now()
    while True:
        await asyncio.sleep(interval_s)
        pid, status = triton.pid, triton.returncode
        if triton.stopped:
            return
        if pid is None or status is None:
            continue
        delay = backoff.delay_s(started_at=started_at, exited_at=clock.now())
        log.error(
            "local Triton (pid %d) exited with status %d%s; starting it again on %s in %.1f s. "
            "The end of its log:\n%s",
            pid,
            status,
            _signal_name(status),
            triton.address,
            delay,
            triton.log_tail(LOG_TAIL_LINES),
        )
        await asyncio.sleep(delay)
        try:
            if await asyncio.to_thread(triton.restart, pid):
                log.warning("local Triton started again on %s (pid %s)", triton.address, triton.pid)
        except TritonStartError as error:
            log.error("local Triton did not start again: %s", error)
        started_at = clock.now()
