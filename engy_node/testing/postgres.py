"""A throwaway PostgreSQL cluster on loopback, for the store's tests, the multi-host tests and the
fleet benchmark: `initdb` into a temporary directory, `pg_ctl start` on a free 127.0.0.1 port,
one database per caller, and everything removed afterwards.

Why it is shaped so. The store's PostgreSQL backend is tested against the real server the
operator runs, not a lookalike, so the same suite proves both backends. The server refuses to
run as root, and CI runs as root: there the cluster belongs to the `postgres` system user (who
owns the temporary directory) and every server command runs through `runuser`; anyone else runs
it as themselves. Authentication is `trust` on loopback only (the cluster listens on 127.0.0.1
and on a Unix socket inside its own directory), which is right for a cluster that lives as long
as one test session and holds nothing but test data.

Where the binaries are not installed, `PostgresUnavailable` says what to install, so a caller
outside CI can skip with that reason (CI installs them: `scripts/bootstrap.sh`).

Nothing in the product imports this module.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

BIN_DIRS = (Path("/usr/lib/postgresql/15/bin"), Path("/usr/lib/postgresql/16/bin"), Path("/usr/lib/postgresql/17/bin"))
SUPERUSER = "engy"
START_TIMEOUT_S = 60


class PostgresUnavailable(RuntimeError):
    """This machine cannot run a throwaway cluster; the message says what is missing."""


def find_bin_dir() -> Path:
    for directory in BIN_DIRS:
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).parent
    raise PostgresUnavailable(
        "PostgreSQL's server binaries are not installed (initdb, pg_ctl): "
        "apt-get install postgresql-15, or run scripts/bootstrap.sh"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster:
    """A running throwaway cluster. `url(database)` names a database in it; `create_database`
    makes a fresh one."""

    def __init__(self, root: Path, *, port: int, bin_dir: Path, run_as: str | None) -> None:
        self.root = root
        self.port = port
        self.bin_dir = bin_dir
        self.run_as = run_as

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _command(self, tool: str, *args: str) -> list[str]:
        command = [str(self.bin_dir / tool), *args]
        return ["runuser", "-u", self.run_as, "--", *command] if self.run_as else command

    def _run(self, tool: str, *args: str, timeout: float = START_TIMEOUT_S) -> None:
        done = subprocess.run(
            self._command(tool, *args), capture_output=True, text=True, timeout=timeout, cwd=self.root
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
            )

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; returns its URL."""
        name = name or f"engy_{uuid.uuid4().hex[:12]}"
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, name)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self._run("dropdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, "--force", name)

    def start(self) -> None:
        log = self.root / "server.log"
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=on -c max_connections=300"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(log),
            "-o",
            options,
            "-w",
            "-t",
            str(START_TIMEOUT_S),
            "start",
            timeout=START_TIMEOUT_S + 10,
        )

    def stop(self, mode: str = "fast") -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-m",
            mode,
            "-w",
            "-t",
            str(START_TIMEOUT_S),
            "stop",
            timeout=START_TIMEOUT_S + 10,
        )


def _owner() -> str | None:
    """The system user the server must run as: `postgres` when we are root, else ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable(
            "running as root, PostgreSQL needs an unprivileged `postgres` system user to own its "
            "cluster (apt-get install postgresql-15 creates it)"
        ) from None
    return "postgres"


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[Cluster]:
    """A fresh cluster on a free loopback port, stopped and deleted on exit."""
    bin_dir = find_bin_dir()
    run_as = _owner()
    root = Path(tempfile.mkdtemp(prefix="engy-pg-"))
    if run_as:
        record = pwd.getpwnam(run_as)
        os.chown(root, record.pw_uid, record.pw_gid)
    root.chmod(0o700)
    cluster = Cluster(root, port=_free_port(), bin_dir=bin_dir, run_as=run_as)
    try:
        # C collation: text sorts by code point, as SQLite sorts it, whatever the machine's locale.
        cluster._run(
            "initdb",
            "-D",
            str(cluster.data_dir),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--locale=C",
            "--encoding=UTF8",
            "--no-sync",
        )
        cluster.start()
        try:
            yield cluster
        finally:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
