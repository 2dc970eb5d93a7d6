"""A PostgreSQL cluster of a test's own (``initdb`` and ``pg_ctl`` on a free port under a temporary folder), which
the test may stop, start, freeze and thaw: a fault test never touches the machine's shared server at 5432.

As root (CI), the cluster runs as the ``postgres`` user, since PostgreSQL refuses to run as root; its folder is
made outside pytest's temporary folders, which only root may enter.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None)
    if found is None:
        raise RuntimeError(f"{name} not found: install PostgreSQL's server (apt-get install postgresql)")
    return str(found)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresCluster:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="proxima-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self._user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self._run(_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self._frozen: list[int] = []

    def url(self, database: str = "postgres", **params: str) -> str:
        """A plain ``postgresql://`` URL (as a provider prints it), with these libpq parameters."""
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}" + (f"?{query}" if query else "")

    def _run(self, *command: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self._user is not None else []
        subprocess.run([*prefix, *command], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-o", options, "start")

    def stop(self) -> None:
        self.thaw()
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self, name: str) -> None:
        import psycopg2  # type: ignore[import-untyped]

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        conn.close()

    def processes(self) -> list[int]:
        """The postmaster and every process it started (backends, checkpointer, ...)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                # The command name (in parentheses) may hold spaces: the fields after its ')' are fixed.
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    children.append(int(stat.parent.name))
        return [postmaster, *children]

    def freeze(self) -> None:
        """SIGSTOP the whole server: it keeps its sockets (the kernel still accepts and acknowledges) but answers
        nothing, as a hung host or a stalled disk would."""
        self._frozen = self.processes()
        for pid in self._frozen:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._frozen = []

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.thaw()
            self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A started cluster, stopped and removed at the end."""
    cluster = PostgresCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
