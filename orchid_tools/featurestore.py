"""A real Feast feature server for tests and the demo: ``FeastServer``.

It owns one work directory: a copy of the example feature repository
(``examples/orchid/features``: ``feature_store.yaml``, ``features.py``, ``generate.py``), the
data ``generate.py`` writes there for a given ``now`` (``data/users.parquet``), the registry and
online store ``feast apply`` and ``feast materialize`` build from it (``data/registry.db``,
``data/online.db``), one ``feast serve`` process group (gunicorn and its workers) on
127.0.0.1, and the log of all of them (``feast.log``). The repository itself is never
written to.

Feast is the ``features`` extra (pyproject.toml); this module runs its ``feast`` command (the
one beside ``sys.executable``) and never imports it. The gateway reads the feature server over
HTTP and the registry file itself; it never imports this module.

Start time on the development machine (2 CPU cores, Feast 0.49.0, three starts): generate
0.42-0.43 s, ``feast apply`` 3.1-3.2 s, ``feast materialize`` 3.1 s, ``feast serve`` until
``/health`` answers 2.8 s: 9.4-9.6 s in all (``FeastServer.timings`` holds each start's
figures). ``stop()`` takes 0.7-0.8 s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType

import httpx

from gateway.backends.local import GroupReaper, free_port, stop_process_group

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_FEATURES = ROOT / "examples" / "orchid" / "features"


class FeastStartError(RuntimeError):
    pass


def feast_executable() -> Path:
    """The ``feast`` command of this interpreter's environment (the ``features`` extra)."""
    return Path(sys.executable).parent / "feast"


class FeastServer:
    """``feast serve`` over a fresh copy of the example feature repository in ``workdir``.

    ``start()`` (or ``with FeastServer(...) as server``) copies the repository to
    ``workdir / "repo"``, runs ``generate.py`` for ``now`` (default: the current UTC time, whole
    seconds), ``feast apply``, ``feast materialize <now - materialize_window> <now>`` (the online
    store then holds each user's latest row, user 7's 3-day-old one included), then starts
    ``feast serve -h 127.0.0.1 -p <port> --no-access-log`` in a process group of its own and
    waits (bounded by ``startup_timeout_s``) until ``GET /health`` answers 200. A failed step
    raises ``FeastStartError`` with the tail of ``log_path``. ``stop()`` SIGTERMs the group,
    SIGKILLs it after a bound; a reaper (``gateway.backends.local.GroupReaper``) kills it should
    this process die first.

    Attributes: ``url`` (``http://127.0.0.1:PORT``), ``port``, ``repo_path``, ``registry_path``
    (``data/registry.db``), ``online_store_path``, ``log_path``, ``now``, ``timings`` (seconds
    per step of the last start).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        now: datetime | None = None,
        port: int | None = None,
        source: Path = EXAMPLE_FEATURES,
        feast: Path | None = None,
        materialize_window: timedelta = timedelta(days=7),
        startup_timeout_s: float = 60.0,
        step_timeout_s: float = 180.0,
    ) -> None:
        if now is not None and now.tzinfo is None:
            raise ValueError("now must be timezone-aware (UTC)")
        self.workdir = workdir
        self.now = (now or datetime.now(UTC).replace(microsecond=0)).astimezone(UTC)
        self.port = port or free_port()
        self.source = source
        self.feast = feast or feast_executable()
        self.materialize_window = materialize_window
        self.startup_timeout_s = startup_timeout_s
        self.step_timeout_s = step_timeout_s
        self.repo_path = workdir / "repo"
        self.registry_path = self.repo_path / "data" / "registry.db"
        self.online_store_path = self.repo_path / "data" / "online.db"
        self.log_path = workdir / "feast.log"
        self.timings: dict[str, float] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._reaper: GroupReaper | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FeastServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env["FEAST_USAGE"] = "False"  # no usage telemetry (older releases sent it)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _run(self, step: str, args: list[str]) -> None:
        began = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"\n$ {' '.join(args)}\n".encode())
            log.flush()
            try:
                done = subprocess.run(
                    args,
                    cwd=self.repo_path,
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=self.step_timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise FeastStartError(
                    f"{step} did not finish in {self.step_timeout_s:.0f}s:\n{self.log_tail()}"
                ) from None
        if done.returncode != 0:
            raise FeastStartError(f"{step} exited with {done.returncode}:\n{self.log_tail()}")
        self.timings[step] = time.monotonic() - began

    def prepare(self) -> None:
        """Copy the repository, generate its data, ``feast apply`` and ``feast materialize``."""
        if not self.feast.exists():
            raise FeastStartError(
                f"{self.feast} is missing: install the features extra (pip install -e '.[features]')"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.repo_path.exists():
            shutil.rmtree(self.repo_path)
        shutil.copytree(
            self.source, self.repo_path, ignore=shutil.ignore_patterns("data", "__pycache__", ".*")
        )
        self.timings = {}
        stamp = self.now.isoformat()
        self._run("generate", [sys.executable, "generate.py", "--now", stamp, "--out", "data"])
        self._run("apply", [str(self.feast), "apply"])
        start = (self.now - self.materialize_window).isoformat()
        self._run("materialize", [str(self.feast), "materialize", start, stamp])

    def start(self) -> None:
        began = time.monotonic()
        self.prepare()
        self.serve()
        self.timings["total"] = time.monotonic() - began

    def serve(self) -> None:
        """Start ``feast serve`` on the prepared repository; wait for ``GET /health``."""
        began = time.monotonic()
        self._release_reaper()
        self._reaper = GroupReaper()  # before the server: guarded from its first moment
        args = [str(self.feast), "serve", "-h", "127.0.0.1", "-p", str(self.port), "--no-access-log"]
        with self.log_path.open("ab") as log:
            log.write(f"\n$ {' '.join(args)}\n".encode())
            log.flush()
            try:
                self._process = subprocess.Popen(
                    args,
                    cwd=self.repo_path,
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: gunicorn and its workers
                )
            except BaseException:
                self._release_reaper()
                raise
        try:
            self._reaper.guard(self._process.pid)
        except OSError as error:
            self.stop()
            raise FeastStartError(f"the process that guards feast serve exited: {error}") from None
        self._wait_healthy()
        self.timings["serve"] = time.monotonic() - began

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    code = self._process.returncode
                    self.stop()
                    raise FeastStartError(f"feast serve exited with {code}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(0.1)
        self.stop()
        raise FeastStartError(
            f"feast serve not healthy after {self.startup_timeout_s:.0f}s on {self.url}:\n{self.log_tail()}"
        )

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s`` (idempotent)."""
        if self._process is not None:
            stop_process_group(self._process, timeout_s)
            self._process = None
        self._release_reaper()

    def _release_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
