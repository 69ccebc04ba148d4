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
SIGKILL after a bound. NVML/DCGM warnings in its log are harmless.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc


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
        self._process: subprocess.Popen[bytes] | None = None

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
            *self.extra_args,
        ]
        log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        log.close()
        self._wait_ready()

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
        self.stop()
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

    def stop(self, timeout_s: float = 20.0) -> None:
        if self._process is not None:
            stop_process_group(self._process, timeout_s)
