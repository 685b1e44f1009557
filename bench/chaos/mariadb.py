"""A private MariaDB server for a fault-injection run: its own datadir, port and durability settings.

Never the shared server: :class:`MariaDB` runs ``mariadb-install-db`` into a fresh datadir and
starts ``mariadbd`` on a free port with ``innodb_flush_log_at_trx_commit=1`` and a binary log
written with ``sync_binlog=1`` (DESIGN §2, the durability baseline), so that a SIGKILL of
``mariadbd`` loses nothing a client saw committed. :meth:`crash` SIGKILLs it; :meth:`start`
brings it back on the same datadir (InnoDB crash recovery) and port.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import sqlalchemy as sa

from examples._ports import free_port

__all__ = ["MariaDB", "free_port"]


class MariaDB:
    """One ``mariadbd`` under ``root`` (a directory of its own), listening on 127.0.0.1:``port``."""

    def __init__(self, name: str, root: Path) -> None:
        for tool in ("mariadb-install-db", "mariadbd"):
            if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
                raise SystemExit(f"error: {tool} is not installed; bench.chaos needs a local MariaDB 10.6+")
        self.name = name
        self.root = root
        self.datadir = root / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.crashes = 0
        root.mkdir(parents=True)
        # Its own temporary directory: the bootstrap's temporary tables in the shared /tmp once met a
        # leftover of the same name ("Could not remove temporary table", install failed).
        self.tmpdir = root / "tmp"
        self.tmpdir.mkdir()
        self._install = subprocess.Popen(
            ["mariadb-install-db", "--no-defaults", f"--datadir={self.datadir}", "--auth-root-authentication-method=normal",
             "--skip-test-db", "--user=" + _user(), f"--tmpdir={self.tmpdir}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def installed(self) -> None:
        """Wait for ``mariadb-install-db`` (started by the constructor, so that two install at once)."""
        if self._install.returncode is not None:
            return
        out, _ = self._install.communicate()
        if self._install.returncode != 0:
            raise SystemExit(f"error: mariadb-install-db failed for the {self.name} database: {out[-2000:]}")

    def url(self, database: str, port: int | None = None) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{port or self.port}/{database}"

    def start(self, timeout: float = 120.0) -> None:
        """Start ``mariadbd`` (crash recovery if it was killed) and wait until it answers."""
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        self.installed()
        mariadbd = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        log = (self.root / "mariadbd.log").open("ab")
        self.proc = subprocess.Popen(
            [mariadbd, "--no-defaults", f"--datadir={self.datadir}", f"--port={self.port}", "--bind-address=127.0.0.1",
             f"--socket={self.root / 'mysqld.sock'}", f"--pid-file={self.root / 'mysqld.pid'}", "--user=" + _user(),
             f"--tmpdir={self.tmpdir}",
             "--innodb-flush-log-at-trx-commit=1", f"--log-bin={self.datadir / 'binlog'}", "--server-id=1",
             "--sync-binlog=1", "--binlog-format=ROW", "--skip-name-resolve", "--max-connections=500",
             "--innodb-buffer-pool-size=256M", "--innodb-lock-wait-timeout=20", "--character-set-server=utf8mb4",
             "--collation-server=utf8mb4_general_ci", f"--log-error={self.root / 'mariadbd.err'}"],
            stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        log.close()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        engine = sa.create_engine(self.url(""), poolclass=sa.pool.NullPool)
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
                        f"error: mariadbd ({self.name}) exited; see {self.root / 'mariadbd.err'}"
                    )
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: mariadbd ({self.name}) not ready within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            engine.dispose()

    def create_database(self, database: str) -> None:
        engine = sa.create_engine(self.url(""), poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        engine.dispose()

    def crash(self) -> None:
        """SIGKILL ``mariadbd`` (no shutdown, no flush beyond what each commit already did)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.crashes += 1

    def settings(self) -> dict[str, str]:
        engine = sa.create_engine(self.url(""), poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            row = conn.exec_driver_sql(
                "SELECT @@innodb_flush_log_at_trx_commit, @@sync_binlog, @@log_bin, @@version"
            ).one()
        engine.dispose()
        return {"innodb_flush_log_at_trx_commit": str(row[0]), "sync_binlog": str(row[1]), "log_bin": str(row[2]),
                "version": str(row[3])}  # fmt: skip

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _user() -> str:
    import getpass

    return getpass.getuser()
