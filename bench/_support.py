"""What the benchmarks share: the MySQL server to use, the admin CLI, real server processes and
their peak memory."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "MYSQL_SERVER",
    "ServerProcess",
    "cli",
    "cpu_seconds",
    "orbit_server_processes",
    "orbit_servers",
    "peak_rss_mb",
    "run_provenance",
]

MYSQL_SERVER = os.environ.get("ORBIT_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
#: Where the benchmarks write their results files (bench/results/README.md).
RESULTS = Path(__file__).resolve().parent / "results"


def cli(*args: str, url: str) -> str:
    """Run one ``orbit-server`` admin command against ``url``; return the last line of stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "orbit_server", *args, "--database-url", url],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def _vm_hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            direct = [int(p) for p in children.read().split()]
    except OSError:
        return []
    return direct + [grandchild for child in direct for grandchild in _children(child)]


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory (``VmHWM``) of process ``pid`` so far, in MiB: the largest of the
    process and its descendants (``serve --workers N`` runs one process per worker)."""
    return max(_vm_hwm_kb(p) for p in [pid, *_children(pid)]) / 1024


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) used so far by process ``pid`` and its live descendants, in seconds."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def _named_cpu_ticks(name: str, titles: tuple[str, ...] | None = None) -> dict[tuple[int, int], int]:
    """``{(pid, start time): CPU ticks}`` of every live process called ``name`` (``/proc/<pid>/stat``);
    with ``titles``, only those whose command line (for a PostgreSQL process its title, ``postgres:
    user database host(port) state`` for a backend) holds one of its words."""
    found: dict[tuple[int, int], int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        if text[text.find("(") + 1 : text.rfind(")")] != name:
            continue
        if titles is not None and not _title_has(entry, titles):
            continue
        fields = text.rpartition(")")[2].split()
        found[(int(entry), int(fields[19]))] = int(fields[11]) + int(fields[12])  # starttime; utime + stime
    return found


def _title_has(pid: str, words: tuple[str, ...]) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            title = cmdline.read().replace(b"\0", b" ").decode(errors="replace").split()
    except OSError:
        return False
    return any(word in title for word in words)


class ProcessCpu:
    """CPU seconds used by every process called ``name`` while this is running (a context manager),
    including processes that start and exit in between: a database's connection backends.

    A sampling thread reads ``/proc`` every ``every`` seconds and keeps each process's last reading
    (keyed by pid and start time, so a reused pid is a new process); a process that was already
    running at the start counts from its first reading, a new one from zero. What a backend uses
    after its last sample and before it exits (at most ``every`` seconds of it) is missed, so the
    figure is a slight undercount. ``seconds`` is the total once the block has ended.

    ``titles`` (``None``: every process called ``name``): words of a process title, one of which a
    process must have to count, e.g. the names of one side's databases when two systems share one
    PostgreSQL instance (each backend's title names its database), with ``walwriter`` and
    ``checkpointer`` for the instance's own work.
    """

    def __init__(self, name: str, every: float = 0.05, *, titles: tuple[str, ...] | None = None) -> None:
        self.name = name
        self.every = every
        self.titles = titles
        self.seconds = 0.0
        self._baseline: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cpu-{name}", daemon=True)

    def __enter__(self) -> ProcessCpu:
        self._baseline = _named_cpu_ticks(self.name, self.titles)
        self._last = dict(self._baseline)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._last.update(_named_cpu_ticks(self.name, self.titles))

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._last.update(_named_cpu_ticks(self.name, self.titles))
        ticks = sum(value - self._baseline.get(key, 0) for key, value in self._last.items())
        self.seconds = ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class ServerProcess:
    """One running ``orbit-server serve``: its base URL and process."""

    base: str
    proc: subprocess.Popen[bytes]


@contextmanager
def orbit_server_processes(
    url: str, count: int = 1, *, serve_args: Sequence[str] = (), env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> Iterator[list[ServerProcess]]:  # fmt: skip
    """Start ``count`` ``orbit-server serve`` processes on ``url`` (``serve_args`` added to each
    command line); yield them once all answer ``/readyz`` (polled: a process has no start-up
    signal to await); stop them on exit. ``cwd``: their working directory (default: this one; ``python
    -m`` imports from it before ``PYTHONPATH``, so an A/B run that sets ``PYTHONPATH`` needs another)."""
    servers: list[ServerProcess] = []
    try:
        for _ in range(count):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            command = [sys.executable, "-m", "orbit_server", "--log-level", "warning", "serve",
                       "--database-url", url, "--port", str(port), *serve_args]  # fmt: skip
            proc = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
            )
            servers.append(ServerProcess(f"http://127.0.0.1:{port}", proc))
        for server in servers:
            deadline = time.monotonic() + 120  # a loaded shared machine: start-up took 37 s once
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{server.base}/readyz").status_code == 200:
                        break
                if time.monotonic() > deadline or server.proc.poll() is not None:
                    raise SystemExit("server did not start")
                time.sleep(0.1)
        yield servers
    finally:
        for server in servers:
            server.proc.terminate()
        for server in servers:
            server.proc.wait(timeout=30)


@contextmanager
def migrated_mariadb(prefix: str) -> Iterator[str]:
    """A new database on the MariaDB at ``ORBIT_TEST_MYSQL_URL`` (``<prefix>_<8 hex>``), migrated by
    ``orbit-server migrate``; yields its URL and drops it on exit."""
    import uuid

    import sqlalchemy as sa

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    try:
        url = sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(hide_password=False)
        cli("migrate", url=url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        admin.dispose()


@contextmanager
def orbit_servers(url: str, count: int = 1) -> Iterator[list[str]]:
    """Start ``count`` ``orbit-server serve`` processes on ``url``; yield their base URLs."""
    with orbit_server_processes(url, count) as servers:
        yield [server.base for server in servers]


def run_provenance(module: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A results file's ``meta``: when (UTC), on what commit, machine and load this run of ``python -m
    module`` was made, its command line, and ``settings`` (every setting that differs from a default)."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        try:
            return subprocess.run(
                ["git", *argv], cwd=root, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    started = datetime.now(UTC)
    return {
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "started_at": started.isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu or platform.processor(),
            "cores": os.cpu_count(),
        },
        "commit": git("rev-parse", "HEAD") or "unknown",
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "loadavg_at_start": os.getloadavg(),
        "command": f"python -m {module} " + " ".join(sys.argv[1:]),
        "settings": settings,
    }


def write_results(kind: str, meta: dict[str, Any], figures: Any, json_file: str | None) -> Path | None:
    """Write a run's ``{"meta": meta, "figures": figures}`` as JSON, with the load average at its end
    added to ``meta`` (unless there already): to ``json_file``, or (``None``) to ``bench/results/<kind>-<UTC start,
    YYYY-MM-DDTHHMM>-<commit>.json`` (``meta`` from :func:`run_provenance`); ``"-"``: nowhere.
    Returns the path written, if any."""
    meta.setdefault("loadavg_at_end", os.getloadavg())
    if json_file == "-":
        return None
    started = datetime.fromisoformat(meta["started_at"])
    name = f"{kind}-{started.strftime('%Y-%m-%dT%H%M')}-{meta['commit'][:7]}.json"
    path = Path(json_file) if json_file else RESULTS / name
    path.write_text(json.dumps({"meta": meta, "figures": figures}, indent=2) + "\n")
    print(f"wrote {path}")
    return path
