"""A real PostgreSQL (Debian's ``postgresql``) for the shared job-store tests: a fresh cluster
made with ``initdb`` in a temporary directory, started with ``pg_ctl`` on a free port,
listening on 127.0.0.1 only, stopped (``pg_ctl stop -m immediate``) at the end.

PostgreSQL refuses to run as root: when the tests run as root the cluster belongs to the
``postgres`` system user (created by the Debian package) and the commands run as it via
``runuser``. Tests that need it skip, saying why, when the binaries are missing
(``scripts/bootstrap.sh`` installs the package).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


INITDB = _binary("initdb")
PG_CTL = _binary("pg_ctl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.data = workdir / "data"
        self.log = workdir / "postgres.log"
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(workdir, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        assert INITDB is not None and PG_CTL is not None
        self._run(INITDB, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"
        # -w: pg_ctl itself waits until the server accepts connections (bounded by -t)
        self._run(PG_CTL, "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        self._run(PG_CTL, "-D", str(self.data), "-m", "immediate", "stop")


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    if INITDB is None or PG_CTL is None:
        pytest.skip("PostgreSQL not installed (scripts/bootstrap.sh installs Debian's postgresql)")
    # Not under pytest's tmp directories: their parents are private to the user running the
    # tests, and the cluster may belong to the postgres user.
    workdir = Path(tempfile.mkdtemp(prefix="orchid-pg-"))
    server = PostgresServer(workdir)
    try:
        server.start()
        yield server
        server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
