"""A private PostgreSQL server for a fault-injection run: its own data directory, port and durability settings.

Never the shared server: :class:`PostgreSQL` runs ``initdb`` into a fresh data directory and starts
``postgres`` (the postmaster) on a free port with ``fsync=on``, ``synchronous_commit=on`` and
``full_page_writes=on`` (PostgreSQL's defaults, set explicitly: the durability baseline, so that a
SIGKILL loses nothing a client saw committed). PostgreSQL refuses to run as root, so when this
process is root the server runs as the ``postgres`` OS user, and its directory (a temporary directory
of its own, owned by that user: a run directory under root's private temporary directory is not
reachable for it) is linked from the run directory as ``<name>-db``.

:meth:`crash` SIGKILLs the postmaster and, at the same instant, every process it started (each backend
is a session leader of its own; one left running would keep the shared memory and the new postmaster
would refuse to start): the whole server gone at once, like a machine losing power. :meth:`start`
brings it back on the same data directory (WAL crash recovery) and port. The binaries are found under
``/usr/lib/postgresql/<version>/bin`` (Debian's layout), the newest version first, or on ``PATH``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from examples._ports import free_port

__all__ = ["PostgreSQL", "postgres_bin"]

#: The OS user the server runs as when this process is root (PostgreSQL refuses to run as root).
OS_USER = "postgres"


def postgres_bin() -> Path:
    """The directory holding ``initdb``, ``postgres`` and ``pg_ctl``.

    Raises:
        SystemExit: no PostgreSQL server binaries were found (the message says what to install).
    """
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for candidate in reversed(versions):
        if (candidate / "initdb").exists() and (candidate / "postgres").exists():
            return candidate
    on_path = shutil.which("initdb")
    if on_path is not None:
        return Path(on_path).parent
    raise SystemExit(
        "error: initdb is not installed; bench.chaos --server-db postgres needs a local PostgreSQL 15+ server "
        "(Debian: apt-get install postgresql)"
    )


class PostgreSQL:
    """One PostgreSQL server of its own (listening on 127.0.0.1:``port``), linked from ``root``.

    The same face as :class:`bench.chaos.mariadb.MariaDB`: ``launch``/``wait_ready``/``start``,
    ``create_database``, ``crash``, ``settings``, ``stop``, ``url`` and the ``crashes`` counter.
    """

    def __init__(self, name: str, root: Path) -> None:
        self.bin = postgres_bin()
        self.name = name
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.crashes = 0
        self._as_root = os.geteuid() == 0
        self.home = Path(tempfile.mkdtemp(prefix=f"orbit-chaos-{name}-pg-"))
        if self._as_root:
            shutil.chown(self.home, OS_USER, OS_USER)
        root.parent.mkdir(parents=True, exist_ok=True)
        #: Where the run directory points at this server's directory (its logs are there).
        self.link = root
        root.symlink_to(self.home, target_is_directory=True)
        self.datadir = self.home / "data"
        self._install = subprocess.Popen(
            [str(self.bin / "initdb"), "-D", str(self.datadir), "-U", "postgres", "--auth=trust",
             "--encoding=UTF8", "--locale=C", "--no-instructions"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **self._user(),
        )  # fmt: skip

    def _user(self) -> dict[str, str]:
        return {"user": OS_USER, "group": OS_USER} if self._as_root else {}

    def installed(self) -> None:
        """Wait for ``initdb`` (started by the constructor, so that it runs while the rest sets up)."""
        if self._install.returncode is not None:
            return
        out, _ = self._install.communicate()
        if self._install.returncode != 0:
            raise SystemExit(f"error: initdb failed for the {self.name} database: {out[-2000:]}")

    def url(self, database: str, port: int | None = None) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{port or self.port}/{database or 'postgres'}"

    def start(self, timeout: float = 120.0) -> None:
        """Start the server (WAL crash recovery if it was killed) and wait until it answers."""
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        self.installed()
        log_path = self.home / "postgres.log"
        log = log_path.open("ab")
        if self._as_root:
            shutil.chown(log_path, OS_USER, OS_USER)
        self.proc = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(self.datadir), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.home}",
             "-c", "fsync=on", "-c", "synchronous_commit=on", "-c", "full_page_writes=on",
             "-c", "max_connections=300", "-c", "shared_buffers=128MB",
             "-c", "log_min_messages=warning"],
            stdout=log, stderr=log, start_new_session=True, cwd=self.home, **self._user(),
        )  # fmt: skip
        log.close()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        engine = sa.create_engine(self.url("postgres"), poolclass=sa.pool.NullPool)
        try:
            while True:
                try:
                    with engine.connect() as conn:
                        conn.exec_driver_sql("SELECT 1")
                    return
                except sa.exc.OperationalError:
                    pass
                if self.proc is not None and self.proc.poll() is not None:
                    raise SystemExit(
                        f"error: postgres ({self.name}) exited; see {self.home / 'postgres.log'}"
                    )
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: postgres ({self.name}) not ready within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            engine.dispose()

    def create_database(self, database: str) -> None:
        engine = sa.create_engine(
            self.url("postgres"), poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT"
        )
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE \"{database}\" ENCODING 'UTF8'")
        engine.dispose()

    def crash(self) -> None:
        """SIGKILL the postmaster and every process it started, at once (no shutdown, no checkpoint)."""
        assert self.proc is not None
        children = _children(self.proc.pid)
        self.proc.send_signal(signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        _wait_gone(children)
        self.crashes += 1

    def settings(self) -> dict[str, str]:
        engine = sa.create_engine(self.url("postgres"), poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            row = conn.exec_driver_sql(
                "SELECT current_setting('fsync'), current_setting('synchronous_commit'), "
                "current_setting('full_page_writes'), current_setting('wal_level'), "
                "current_setting('server_version')"
            ).one()
        engine.dispose()
        return {"fsync": str(row[0]), "synchronous_commit": str(row[1]), "full_page_writes": str(row[2]),
                "wal_level": str(row[3]), "version": f"PostgreSQL {row[4]}"}  # fmt: skip

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown: roll back open transactions, checkpoint
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.crash()

    def remove(self) -> None:
        """Delete the server's directory and its link (the server must be stopped)."""
        self.link.unlink(missing_ok=True)
        shutil.rmtree(self.home, ignore_errors=True)


def remove_linked(root: Path) -> None:
    """Delete the directories that the run directory ``root`` links to (private PostgreSQL servers
    live outside it); then ``root`` itself can go."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.is_symlink():
            target = entry.resolve()
            entry.unlink()
            shutil.rmtree(target, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from ``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until none of ``pids`` exists any more (a SIGKILLed process ends in a moment; an orphan is
    reaped by init)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
