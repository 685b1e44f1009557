"""What ``bench.compare`` and its ``workers`` section (``bench.compare_workers``) share: the report,
the cost counters, new databases, and the drains of both workers (each a process of its own).

Nothing here prints or judges; ``bench.compare`` does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import sqlalchemy as sa

from bench._support import MYSQL_SERVER, ProcessCpu, cpu_seconds, peak_rss_mb
from bench.worker_process import STARTUP_CPU_ENV
from orbit_client import OrbitClient, RetryPolicy

POSTGRES_CONNINFO = os.environ.get("BENCH_POSTGRES_CONNINFO", "host=127.0.0.1 user=postgres")

#: The PostgreSQL databases of each side (``"orbit"``, ``"peer"``), as they are created: with
#: ``--server-db postgres`` both sides share one PostgreSQL instance, and a side's database CPU
#: counts the backends of its own databases only (:func:`database_cpu`).
PG_DATABASES: dict[str, set[str]] = {"orbit": set(), "peer": set()}

#: Title words of the PostgreSQL instance's own processes that work for whoever writes: WAL and checkpoints.
INSTANCE_WRITERS = ("walwriter", "checkpointer", "writer")


def database_cpu(side: str, dialect: str = "postgresql") -> ProcessCpu:
    """A :class:`ProcessCpu` of ``side``'s database server: ``mariadbd`` for a MySQL ``dialect``;
    else the ``postgres`` processes of ``side``'s databases (their connection backends and autovacuum
    workers, told apart by the database name in their titles: other databases of the instance, the
    other side's among them, do not count) and the instance's WAL writer, background writer and
    checkpointer (the two sides drain one after the other, so these work for the one draining)."""
    if dialect == "mysql":
        return ProcessCpu("mariadbd")
    return ProcessCpu("postgres", titles=(*sorted(PG_DATABASES[side]), *INSTANCE_WRITERS))


NS, QUEUE, HANDLER = "bench", "q", "bench.echo"


@dataclass
class Figure:
    """One line of the table."""

    section: str
    name: str
    value: float | None
    unit: str
    base: str | None = None  # the figure this one is compared with
    ratio: float | None = None
    target: str | None = None
    passed: bool | None = None
    note: str = ""


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    explain: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, section: str, name: str, value: float | None, unit: str, note: str = "") -> Figure:
        figure = Figure(section, name, value, unit, note=note)
        self.figures.append(figure)
        return figure

    def value(self, name: str) -> float | None:
        return next((f.value for f in self.figures if f.name == name), None)

    def compare(self, name: str, base: str, *, inverse: bool = False) -> None:
        """Set ``name``'s ratio to ``base`` (``inverse``: base / value, for durations)."""
        figure = next((f for f in self.figures if f.name == name), None)
        base_value = self.value(base)
        if figure is None or figure.value is None or not base_value:
            return
        figure.base = base
        figure.ratio = base_value / figure.value if inverse else figure.value / base_value

    def target(self, name: str, text: str, check: Callable[[Figure], bool | None]) -> None:
        figure = next((f for f in self.figures if f.name == name), None)
        if figure is None:
            return
        figure.target = text
        if figure.value is not None:
            figure.passed = check(figure)


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 900, every: float = 0.02) -> None:
    """Poll ``check`` (a database count: there is no event to await across processes)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(every)


def _stop(proc: subprocess.Popen[Any]) -> float:
    """SIGTERM ``proc``, wait for it; return its peak RSS in MiB (``wait4``'s ``ru_maxrss``)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return usage.ru_maxrss / 1024
    except ChildProcessError:  # already reaped
        proc.wait(timeout=60)
        return 0.0


def _mysql_counters(engine: sa.Engine) -> dict[str, int]:
    names = ("Questions", "Com_admin_commands", "Com_commit", "Com_rollback", "Com_select", "Com_insert")
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name IN (" + ",".join(f"'{n}'" for n in names) + ")"
        ).all()
    return {name: int(value) for name, value in rows}


def _http_calls(base: str) -> float:
    """API requests the server answered so far (its /metrics; one process's count under --workers)."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("orbit_http_request_duration_seconds_count{") and "/v1/" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class Cost:
    """Database round trips (MariaDB's global counters: both Orbit databases, and any other client
    of the same MariaDB, so run on a quiet machine) and Orbit HTTP calls spent by a block of work.
    On PostgreSQL (``--server-db postgres``) no global statement counter exists without
    ``pg_stat_statements``: the round trips are then not counted (``db`` is empty)."""

    #: False under ``serve --workers N``: each process counts only its own requests in /metrics.
    count_http = True

    def __init__(self, admin: sa.Engine, base: str) -> None:
        self.admin, self.base = admin, base

    def _counters(self) -> dict[str, int]:
        return _mysql_counters(self.admin) if self.admin.dialect.name == "mysql" else {}

    def __enter__(self) -> Cost:
        self._db, self._http = self._counters(), _http_calls(self.base)
        return self

    def __exit__(self, *_exc: object) -> None:
        after = self._counters()
        self.db = {k: after[k] - self._db[k] for k in after}
        self.http = _http_calls(self.base) - self._http

    def trips(self, n: int) -> float | None:
        """Database round trips per unit of ``n`` (``None``: not counted, on PostgreSQL)."""
        if not self.db:
            return None
        return (self.db["Questions"] + self.db["Com_admin_commands"]) / n

    def report(self, report: Report, what: str, n: int) -> None:
        trips = self.trips(n)
        if trips is None:
            report.add("orbit", f"DB round trips per {what}", None, "round trips",
                       "not counted on PostgreSQL (no global statement counter)")  # fmt: skip
            self._report_http(report, what, n)
            return
        report.add("orbit", f"DB round trips per {what}", trips, "round trips",
                   f"pings {self.db['Com_admin_commands'] / n:.2f}, COMMIT {self.db['Com_commit'] / n:.2f}, "
                   f"ROLLBACK {self.db['Com_rollback'] / n:.2f}")  # fmt: skip
        self._report_http(report, what, n)

    def _report_http(self, report: Report, what: str, n: int) -> None:
        if self.count_http:
            report.add("orbit", f"HTTP calls per {what}", self.http / n, "calls")
        else:
            report.add(
                "orbit", f"HTTP calls per {what}", None, "calls", "n/a under --workers (per-process /metrics)"
            )


@contextlib.contextmanager
def mysql_databases(*roles: str) -> Iterator[dict[str, str]]:
    """New MariaDB databases, one per role; yields their URLs; drops them on exit."""
    admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
    names = {role: f"orbit_cmp_{role}_{uuid.uuid4().hex[:8]}" for role in roles}
    try:
        with admin.connect() as conn:
            for name in names.values():
                conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        yield {
            role: sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(hide_password=False)
            for role, name in names.items()
        }
    finally:
        with admin.connect() as conn:
            for name in names.values():
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        admin.dispose()


@contextlib.contextmanager
def postgres_databases(*roles: str) -> Iterator[dict[str, str]]:
    """New PostgreSQL databases for Orbit on the peer's instance (``BENCH_POSTGRES_CONNINFO``), one
    per role; yields their ``postgresql+psycopg://`` URLs; drops them on exit."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(POSTGRES_CONNINFO)
    names = {role: f"orbit_cmp_{role}_{uuid.uuid4().hex[:8]}" for role in roles}
    PG_DATABASES["orbit"].update(names.values())
    try:
        with psycopg.connect(POSTGRES_CONNINFO, autocommit=True) as admin:
            for name in names.values():
                admin.execute(f'CREATE DATABASE "{name}"')
        yield {
            role: sa.engine.URL.create(
                "postgresql+psycopg", username=str(params.get("user") or "postgres"),
                password=str(params["password"]) if params.get("password") else None,
                host=str(params.get("host") or "127.0.0.1"), port=int(params.get("port") or 5432), database=name,
            ).render_as_string(hide_password=False)
            for role, name in names.items()
        }  # fmt: skip
    finally:
        with psycopg.connect(POSTGRES_CONNINFO, autocommit=True) as admin:
            for name in names.values():
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        PG_DATABASES["orbit"].difference_update(names.values())


@contextlib.contextmanager
def peer_database(report: Report) -> Iterator[str]:
    """A new PostgreSQL database with procrastinate's schema; yields its conninfo; drops it on exit."""
    import psycopg

    name = f"orbit_cmp_peer_{uuid.uuid4().hex[:8]}"
    PG_DATABASES["peer"].add(name)
    with psycopg.connect(POSTGRES_CONNINFO, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        report.meta["postgres"] = {
            "version": admin.execute("SHOW server_version").fetchone()[0],  # type: ignore[index]
            "synchronous_commit": admin.execute("SHOW synchronous_commit").fetchone()[0],  # type: ignore[index]
            "fsync": admin.execute("SHOW fsync").fetchone()[0],  # type: ignore[index]
            # off on this project's machines (their CI configuration): peer_vacuum does its work before each drain
            "autovacuum": admin.execute("SHOW autovacuum").fetchone()[0],  # type: ignore[index]
        }
    conninfo = f"{POSTGRES_CONNINFO} dbname={name}"
    os.environ["BENCH_PEER_CONNINFO"] = conninfo  # read by bench._peer_app at import
    try:
        from bench import _peer_app

        with _peer_app.app.open():
            _peer_app.app.schema_manager.apply_schema()
        yield conninfo
    finally:
        with psycopg.connect(POSTGRES_CONNINFO, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _peer_last_job(conninfo: str) -> int:
    import psycopg

    with psycopg.connect(conninfo) as conn:
        return int(conn.execute("SELECT coalesce(max(id), 0) FROM procrastinate_jobs").fetchone()[0])  # type: ignore[index]


@contextlib.contextmanager
def peer_vacuumed(conninfo: str) -> Iterator[None]:
    """``VACUUM (ANALYZE)`` the peer's database (its tables are procrastinate's), as autovacuum would between
    two drains, on a connection kept open for the block: a :func:`database_cpu` around the block counts the
    vacuum's CPU with the drain's (a backend is sampled while it lives). Each job is written three times
    (deferred, started, finished), and a drain's dead rows slowed the next drain by half (at concurrency 1, 540
    jobs/s on a new database, 230 after 22,000 jobs, 500 again after a ``VACUUM``) on this project's machines,
    whose PostgreSQL runs with ``autovacuum = off`` (their CI configuration; recorded in the results'
    ``postgres`` settings). PostgreSQL's default is on: the peer is measured as it runs with its maintenance
    done."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")
        yield


def peer_vacuum(conninfo: str) -> None:
    """:func:`peer_vacuumed`, where no CPU is counted."""
    with peer_vacuumed(conninfo):
        pass


def orbit_vacuum(server: sa.Engine) -> None:
    """Orbit's server database on PostgreSQL (``--server-db postgres``): ``VACUUM (ANALYZE)`` it before a
    drain, as :func:`peer_vacuum` does the peer's. On MariaDB nothing: InnoDB purges old row versions in
    the background as it goes."""
    if server.dialect.name != "postgresql":
        return
    with server.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM (ANALYZE)")


def peer_defer(conninfo: str, n: int, *, vacuum: bool = True) -> int:
    """Defer ``n`` no-op jobs (untimed), each in its own transaction, then (``vacuum``) vacuum the peer's
    database (:func:`peer_vacuum`); the last job id before them."""
    from bench import _peer_app

    after = _peer_last_job(conninfo)
    with _peer_app.app.open():
        for i in range(n):
            _peer_app.noop.defer(n=i)
    if vacuum:
        peer_vacuum(conninfo)
    return after


def peer_worker_drain(
    conninfo: str, n: int, concurrency: int, *, after: int | None = None, processes: int = 1,
    pool: int | None = None,
) -> tuple[float, float, float]:  # fmt: skip
    """``processes`` worker processes drain ``n`` no-op jobs: (jobs/s from the events' timestamps, so no
    start-up is counted; the largest worker's peak RSS in MiB; their CPU seconds from their worker loops'
    start, :func:`_startup_cpu`). ``after``: the jobs
    after that id are already deferred (:func:`peer_defer`); ``None``: defer ``n`` first. ``pool``: the
    connections of each worker's pool (``None``: the library's default). Repeatable on one database."""
    import psycopg

    env = {**os.environ, "BENCH_PEER_CONNINFO": conninfo, "BENCH_PEER_CONCURRENCY": str(concurrency)}
    if pool is not None:
        env["BENCH_PEER_POOL"] = str(pool)
    if after is None:
        after = peer_defer(conninfo, n)
    with tempfile.TemporaryDirectory() as startup:
        files = [os.path.join(startup, str(i)) for i in range(processes)]
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "bench._peer_app"],
                env={**env, STARTUP_CPU_ENV: path},
                stdout=subprocess.DEVNULL,
            )
            for path in files
        ]
        usage = [_stop_when_exits(worker) for worker in workers]
        before_loop = sum(_startup_cpu(path) for path in files)
    with psycopg.connect(conninfo) as conn:
        first, last, done = conn.execute(
            "SELECT min(at) FILTER (WHERE type = 'started'), max(at) FILTER (WHERE type = 'succeeded'), "
            "count(*) FILTER (WHERE type = 'succeeded') FROM procrastinate_events WHERE job_id > %s",
            (after,),
        ).fetchone()  # type: ignore[misc]
    if done != n:
        raise SystemExit(f"peer workers finished {done} of {n} jobs")
    return (
        n / (last - first).total_seconds(),
        max(rss for rss, _ in usage),
        sum(cpu for _, cpu in usage) - before_loop,
    )


def _worker_registered(conn: Any) -> bool:
    return bool(conn.execute("SELECT count(*) FROM procrastinate_workers").fetchone()[0])


def _stop_when_exits(proc: subprocess.Popen[Any]) -> tuple[float, float]:
    """Wait for ``proc`` to exit (a non-zero status ends the run): its peak RSS in MiB and CPU seconds."""
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{proc.args!r} exited with status {proc.returncode}")
    return usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def direct_batch(
    base: str,
    key: str,
    n: int,
    queue: str = QUEUE,
    size: int = 100,
    threads: int = 2,
    *,
    retry_safe: bool = False,
) -> float:
    run = uuid.uuid4().hex[:8]
    options = {"options": {"retry_safe": True}} if retry_safe else {}
    batches = [
        [
            {
                "idempotency_key": f"b-{run}-{i}",
                "queue": queue,
                "handler": HANDLER,
                "params": {"n": i},
                **options,
            }
            for i in range(start, min(start + size, n))
        ]
        for start in range(0, n, size)
    ]
    lock = threading.Lock()
    failures: list[str] = []

    def work() -> None:
        with OrbitClient(base, api_key=key, retry=RetryPolicy(max_attempts=1)) as client:
            while True:
                with lock:
                    if not batches:
                        return
                    items = batches.pop()
                for result in client.submit_tasks(NS, items):
                    if result.status not in (200, 201):
                        failures.append(str(result.status))

    pool = [threading.Thread(target=work) for _ in range(threads)]
    started = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise SystemExit(f"{len(failures)} batch items failed, e.g. {failures[0]}")
    return n / elapsed


def _submit_untimed(base: str, key: str, n: int, queue: str, *, retry_safe: bool = False) -> None:
    if hasattr(OrbitClient, "submit_tasks"):
        direct_batch(base, key, n, queue=queue, retry_safe=retry_safe)
        return
    assert not retry_safe, "retry-safe rounds need submit_tasks"
    run = uuid.uuid4().hex[:8]
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:

        def submit(i: int) -> None:
            http.post(f"/v1/namespaces/{NS}/tasks", json={"queue": queue, "handler": HANDLER, "params": {"n": i}},
                      headers={"Idempotency-Key": f"w-{run}-{i}"}).raise_for_status()  # fmt: skip

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(submit, range(n)))


def _succeeded(server: sa.Engine, queue: str) -> int:
    with server.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT COUNT(*) FROM tasks t JOIN queues q ON q.id = t.queue_id "
                    "WHERE q.name = :q AND t.status = 'SUCCEEDED'"
                ),
                {"q": queue},
            ).scalar_one()
        )


def _startup_cpu(path: str) -> float:
    """The CPU seconds a worker process wrote to ``path`` before its worker loop (0 if it wrote none): Orbit's
    (``bench.worker_process``) and the peer's (``bench._peer_app``) each write it where
    :data:`~bench.worker_process.STARTUP_CPU_ENV` says, and the drains leave it out of their CPU per task.
    Orbit's worker imports cost about 440 ms of CPU, the peer's about 240: a 1,000-task drain counted 0.45
    against 0.25 ms per task of start-up."""
    try:
        with open(path) as written:
            return float(written.read() or 0)
    except FileNotFoundError:
        return 0.0


def _worker(
    base: str, key: str, queue: str, concurrency: int, startup: str | None = None
) -> subprocess.Popen[bytes]:
    """A ``bench.worker_process`` on ``queue``; ``startup``: the file for its start-up CPU (:data:`STARTUP_CPU_ENV`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench.worker_process", base, key, NS, queue, str(concurrency)],
        stdout=subprocess.DEVNULL,
        env={**os.environ, STARTUP_CPU_ENV: startup} if startup else None,
    )


def _worker_queue(round_: int) -> str:
    return "worker" if round_ == 1 else f"worker-{round_}"


@dataclass
class Drain:
    """What one drain by Orbit worker processes measured (:func:`_orbit_worker_drain`)."""

    n: int
    rate: float  # tasks/s, from the first lease to the last finish (the database's timestamps)
    rss: float  # the largest worker's peak RSS, MiB
    server_ms: float  # server CPU per task
    worker_ms: float  # worker CPU per task (all worker processes, from their worker loops' start)
    cost: Cost
    #: The server database's CPU per task (``mariadbd``, or the ``postgres`` processes but the peer's
    #: backends: :func:`database_cpu`; other clients of it count too).
    db_ms: float = 0.0
    #: Which database that was: ``"MariaDB"`` or ``"PostgreSQL"``.
    db_name: str = "MariaDB"

    @property
    def http(self) -> float:
        """Orbit HTTP requests per task (NaN under ``serve --workers N``)."""
        return self.cost.http / self.n if Cost.count_http else float("nan")

    @property
    def trips(self) -> float | None:
        """Database round trips per task (MariaDB's global counters; ``None`` on PostgreSQL)."""
        return self.cost.trips(self.n)


def _orbit_worker_drain(
    server: sa.Engine, base: str, keys: dict[str, str], n: int, concurrency: int, queue: str, server_pid: int,
    *, processes: int = 1, retry_safe: bool = False,
) -> Drain:  # fmt: skip
    """``processes`` worker processes drain ``n`` tasks submitted (untimed) to the empty ``queue``.
    ``retry_safe``: the tasks are declared retry-safe, so their grants come back ``RUNNING``
    (lease-and-start, no ``start`` call)."""
    _submit_untimed(base, keys["submit"], n, queue, retry_safe=retry_safe)
    orbit_vacuum(server)
    server_cpu = cpu_seconds(server_pid)
    with (
        Cost(server, base) as cost,
        database_cpu("orbit", server.dialect.name) as database,
        tempfile.TemporaryDirectory() as startup,
    ):
        files = [os.path.join(startup, str(i)) for i in range(processes)]
        workers = [_worker(base, keys["work"], queue, concurrency, path) for path in files]
        try:
            _wait_until(lambda: _succeeded(server, queue) >= n, "the workers to finish", every=0.2)
            rss = max(peak_rss_mb(w.pid) for w in workers)
            worker_cpu = sum(cpu_seconds(w.pid) for w in workers) - sum(_startup_cpu(path) for path in files)
            server_cpu = cpu_seconds(server_pid) - server_cpu
        finally:
            for w in workers:
                _stop(w)
    with server.connect() as conn:
        first, last = conn.execute(
            sa.text(
                "SELECT MIN(a.leased_at), MAX(t.finished_at) FROM tasks t JOIN queues q ON q.id = t.queue_id "
                "JOIN task_attempts a ON a.task_id = t.id WHERE q.name = :q"
            ),
            {"q": queue},
        ).one()
    return Drain(
        n, n / (last - first).total_seconds(), rss, server_cpu / n * 1000, worker_cpu / n * 1000, cost,
        database.seconds / n * 1000, "MariaDB" if server.dialect.name == "mysql" else "PostgreSQL",
    )  # fmt: skip
