"""Orbit beside procrastinate, side by side in one run: hand-off, relay, worker, end to end.

    python -m bench.compare [--n 2000] [--concurrency 4] [--worker-rounds 3] [--skip-claim] [--only SECTION,...]
                            [--server-db {mariadb,postgres}] [--json]

Needs the ``bench`` extra (``pip install -e '.[bench]'``: procrastinate and psycopg), MariaDB at
``ORBIT_TEST_MYSQL_URL`` (default ``mysql+pymysql://root@127.0.0.1:3306``) and PostgreSQL at
``BENCH_POSTGRES_CONNINFO`` (default ``host=127.0.0.1 user=postgres``). Every database is new,
uniquely named, and dropped at the end.

``--server-db postgres`` runs Orbit on that same PostgreSQL instance instead of MariaDB (its server
database and its business database, each a database of its own beside the peer's), so that both
sides meet the same database: each side's database CPU counts the backends of its own databases
(told apart by the database name in their process titles) and the instance's WAL writer and
checkpointer, and Orbit's database round trips are not counted (PostgreSQL keeps no global statement counter
without ``pg_stat_statements``). The ``claim`` section stays on MariaDB. The results file records
``server_db`` in its settings.

Sections (``--only`` takes their names):

- ``peer``: procrastinate on PostgreSQL: ``--n`` jobs each deferred in its own transaction
  (defer/s); one worker process (``--concurrency``) draining no-op jobs (processed/s, from the
  database's event timestamps, so process start-up is not counted); end to end: the worker
  running, ``--n`` jobs deferred one after the other, until the last one is done.
- ``orbit``: Orbit on MariaDB (a server database and a business database): ``--n`` business
  transactions each inserting an order row, alternated in chunks with the same transaction
  plus ``enqueue`` (the ratio is the price of the hand-off); the relay draining ``--n`` rows at
  batch 1 and at batch 100; direct single submissions (8 threads) and, where the client has
  ``submit_tasks``, batch submissions of 100; one worker process (``--concurrency``) with a
  no-op handler (processed/s from the database's timestamps, first lease to last finish), ``--worker-rounds`` times, each
  drain beside one of the peer's worker (alternating which goes first) when ``peer`` runs too,
  so that the worker ratio is the median of ratios whose two drains met the same load (the
  machine's speed moves by 2x within minutes; the peer section's own drain ran minutes
  earlier), with the server + worker CPU per task; then the same paired rounds with tasks declared
  retry-safe (their grants come back ``RUNNING``: lease-and-start, no ``start`` call; the peer's own
  semantics, as its worker marks a job ``doing`` when it fetches it); end to end: worker and relay
  processes running, ``--n`` business transactions with ``enqueue`` one after the other,
  until the last task has succeeded (``--worker-rounds`` rounds with default tasks, as many with retry-safe
  ones, each beside one of the peer's end to end in alternating order when ``peer`` runs too: the ratio
  judged is the median of the rounds' ratios). Also the peak RSS of the server, relay (batch 500) and
  worker processes, and statements and round trips per submission (MariaDB's global
  counters: other clients of the same MariaDB count too, so run it on a quiet machine).
- ``workers`` (needs ``orbit``; beside the peer when ``peer`` runs too): a concurrency sweep
  (``--sweep``, default 1, 4, 16, 64) of both workers with each side's CPU per task (Orbit: server +
  worker, and with MariaDB; the peer: worker + PostgreSQL, its backends sampled while they live),
  Orbit's HTTP requests and round trips per task, two Orbit worker processes against one, two server
  processes (``--workers 2``) against one at concurrency 16; and each
  side at its best (``best``): 1, 2 and 4 worker processes at ``--concurrency``, the peer's pool at
  the size its docs recommend (:mod:`bench.compare_workers`).
- ``claim``: the relay's claim with 1,000 vs 1,000,000 terminal (``DELIVERED``) rows in the
  outbox, and its ``EXPLAIN`` (loading a million rows takes a while: ``--skip-claim``).

Every figure is printed with its ratio to a baseline measured in the same run (these machines
are noisy: compare ratios) and, where the issue sets one, its target with pass/miss. The relay's
rates stand beside the peer's ``defer`` rate (a hand-over without execution on both sides), end to
end beside end to end. Each run writes its figures, with its date, commit, load averages, command and
every setting that differs from a default (:data:`SETTINGS`), to ``bench/results/`` (``--json-file``);
the docs quote only figures from a committed results file.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench._compare import (
    HANDLER,
    NS,
    QUEUE,
    Cost,
    Report,
    _orbit_worker_drain,
    _peer_last_job,
    _stop,
    _stop_when_exits,
    _succeeded,
    _timed,
    _wait_until,
    _worker,
    _worker_queue,
    _worker_registered,
    direct_batch,
    mysql_databases,
    orbit_vacuum,
    peer_database,
    peer_vacuum,
    peer_worker_drain,
    postgres_databases,
)
from bench._support import MYSQL_SERVER, cli, orbit_server_processes, peak_rss_mb, run_provenance
from bench.compare_workers import run_workers
from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter import Backoff, Outbox, OutboxTables, Relay, enqueue

SECTIONS = ("peer", "orbit", "workers", "claim")


# ------------------------------------------------------------------ helpers


# --------------------------------------------------------------------- peer


def run_peer(report: Report, n: int, concurrency: int, conninfo: str) -> None:
    from bench import _peer_app

    app = _peer_app.app
    noop = app.tasks["bench.noop"]
    after = _peer_last_job(conninfo)
    with app.open():
        elapsed = _timed(lambda: [noop.defer(n=i) for i in range(n)])
    report.add("peer", "peer: defer", n / elapsed, "jobs/s", "each job its own transaction")

    # One worker drains the n jobs; rate from the events' timestamps (no start-up counted).
    peer_vacuum(conninfo)
    rate, worker_rss, _cpu = peer_worker_drain(conninfo, n, concurrency, after=after)
    report.add("peer", "peer: worker processed", rate, "jobs/s",
               f"1 worker process, concurrency {concurrency}")  # fmt: skip
    report.add("peer", "peer: worker RSS", worker_rss, "MiB")

    # End to end: the worker waits for jobs; defer n, one after the other, until all are done.
    report.add("peer", "peer: end to end", peer_end_to_end(conninfo, n, concurrency), "jobs/s",
               "defer → done, worker running")  # fmt: skip


def peer_end_to_end(conninfo: str, n: int, concurrency: int) -> float:
    """The peer's end to end (jobs/s): its worker (``concurrency``) waiting for jobs on its database, vacuumed
    first (:func:`~bench._compare.peer_vacuum`); ``n`` jobs deferred one after the other, each in its own
    transaction, until all have succeeded."""
    import psycopg

    from bench import _peer_app

    env = {**os.environ, "BENCH_PEER_CONNINFO": conninfo, "BENCH_PEER_CONCURRENCY": str(concurrency)}
    app = _peer_app.app
    noop = app.tasks["bench.noop"]
    peer_vacuum(conninfo)
    worker = subprocess.Popen(
        [sys.executable, "-m", "bench._peer_app", "--wait"], env=env, stdout=subprocess.DEVNULL
    )
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:

            def all_succeeded() -> int:
                row = conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
                return int(row.fetchone()[0])  # type: ignore[index]

            done_before = all_succeeded()  # earlier drains'

            def succeeded() -> int:
                return all_succeeded() - done_before

            _wait_until(lambda: _worker_registered(conn), "the peer worker to start", timeout=60)
            with app.open():
                started = time.perf_counter()
                for i in range(n):
                    noop.defer(n=i)
                _wait_until(lambda: succeeded() >= n, "the peer's end-to-end jobs")
                elapsed = time.perf_counter() - started
    finally:
        _stop(worker)
    return n / elapsed


# -------------------------------------------------------------------- orbit


def _orders_table(metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        f"bench_orders_{uuid.uuid4().hex[:8]}",
        metadata,
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("ref", sa.String(64), nullable=False),
        sa.Column("amount_cents", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False, server_default=sa.func.current_timestamp()),
    )


def _new_outbox(engine: sa.Engine) -> OutboxTables:
    tables = OutboxTables(name=f"bench_{uuid.uuid4().hex[:8]}")
    Outbox(engine, tables=tables).migrate()
    return tables


def _fill_outbox(engine: sa.Engine, tables: OutboxTables, n: int) -> None:
    with engine.begin() as conn:
        for i in range(n):
            enqueue(conn, namespace=NS, queue=QUEUE, handler=HANDLER, params={"n": i}, tables=tables)


@dataclass(frozen=True)
class Business:
    """A business database's order table and two new outboxes (keyed rows apart: the relay rounds
    drain exactly the rows of ``tables``)."""

    engine: sa.Engine
    insert: sa.Insert
    tables: OutboxTables
    keyed_tables: OutboxTables
    #: This process's CPU seconds in the transactions of each kind so far (without, with, with a key).
    cpu: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    @classmethod
    def create(cls, engine: sa.Engine) -> Business:
        metadata = sa.MetaData()
        orders = _orders_table(metadata)
        metadata.create_all(engine)
        return cls(engine, orders.insert(), _new_outbox(engine), _new_outbox(engine))

    def chunk(self, start: int, count: int) -> tuple[float, float, float]:
        """``count`` order transactions without ``enqueue``, ``count`` with it and ``count`` with it and
        an ordering key (100 customers, one key each), numbered from ``start``: their seconds."""
        engine, insert = self.engine, self.insert

        def without() -> None:
            for i in range(start, start + count):
                with engine.begin() as conn:
                    conn.execute(insert, {"ref": f"order-{i}", "amount_cents": i})

        def with_() -> None:
            for i in range(start, start + count):
                with engine.begin() as conn:
                    conn.execute(insert, {"ref": f"order-e-{i}", "amount_cents": i})
                    enqueue(
                        conn, namespace=NS, queue=QUEUE, handler=HANDLER, params={"n": i}, tables=self.tables
                    )

        def with_key() -> None:
            for i in range(start, start + count):
                with engine.begin() as conn:
                    conn.execute(insert, {"ref": f"order-k-{i}", "amount_cents": i})
                    enqueue(conn, namespace=NS, queue=QUEUE, handler=HANDLER, params={"n": i},
                            tables=self.keyed_tables, ordering_key=f"customer-{i % 100}")  # fmt: skip

        seconds = []
        for i, run in enumerate((without, with_, with_key)):
            cpu = time.process_time()
            seconds.append(_timed(run))
            self.cpu[i] += time.process_time() - cpu
        return seconds[0], seconds[1], seconds[2]


#: Transactions of each kind per chunk of :func:`business_transactions`.
BUSINESS_CHUNK = 50


def business_transactions(report: Report, engine: sa.Engine, n: int) -> OutboxTables:
    """``n`` order transactions without and ``n`` with ``enqueue`` (and ``n`` with an ordering key),
    alternated in chunks of 50; returns the outbox tables holding the ``n`` rows without a key."""
    business = Business.create(engine)
    plain = with_enqueue = keyed = 0.0
    for start in range(0, n, BUSINESS_CHUNK):
        without, with_, with_key = business.chunk(start, min(BUSINESS_CHUNK, n - start))
        plain += without
        with_enqueue += with_
        keyed += with_key
    add_business_figures(report, n, plain, with_enqueue, keyed)
    return business.tables


def add_business_figures(report: Report, n: int, plain: float, with_enqueue: float, keyed: float) -> None:
    """The figures of ``n`` transactions of each kind that took ``plain``, ``with_enqueue`` and ``keyed`` seconds."""
    report.add("orbit", "business txn without enqueue (base)", n / plain, "txn/s", "INSERT order, COMMIT")
    report.add("orbit", "business txn with enqueue", n / with_enqueue, "txn/s", "INSERT order + enqueue")
    report.add("orbit", "enqueue cost (time with / without)", with_enqueue / plain, "×")
    report.add("orbit", "business txn with enqueue + ordering key", n / keyed, "txn/s",
               "INSERT order + key upsert + enqueue")  # fmt: skip
    report.add("orbit", "enqueue cost with ordering key (time / without)", keyed / plain, "×")


def relay_round(engine: sa.Engine, base: str, key: str, tables: OutboxTables, n: int, batch: int) -> float:
    with OrbitClient(base, api_key=key, retry=RetryPolicy(max_attempts=1)) as client:
        relay = Relay(
            client=client, engine=engine, tables=tables, batch_size=batch, backoff=Backoff.no_wait()
        )
        started = time.perf_counter()
        stats = relay.run_once()
        elapsed = time.perf_counter() - started
    if stats.delivered != n:
        raise SystemExit(f"relay batch {batch}: delivered {stats.delivered} of {n}: {stats}")
    return n / elapsed


def direct_single(base: str, key: str, n: int, threads: int = 8) -> float:
    run = uuid.uuid4().hex[:8]
    per = n // threads
    barrier = threading.Barrier(threads + 1)

    def work(index: int) -> None:
        with OrbitClient(base, api_key=key, retry=RetryPolicy(max_attempts=1)) as client:
            barrier.wait()
            for i in range(per):
                client.submit_task(NS, QUEUE, HANDLER, {"n": i}, idempotency_key=f"d-{run}-{index}-{i}")

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in pool:
        thread.join()
    return per * threads / (time.perf_counter() - started)


def _paired_rounds(
    server: sa.Engine, base: str, keys: dict[str, str], n: int, concurrency: int, *, server_pid: int,
    rounds: int, peer: str | None, retry_safe: bool, load: list[float],
) -> tuple[list[float], list[float], list[float], float, Cost]:  # fmt: skip
    """``rounds`` drains of ``n`` tasks by one worker process, each beside a drain of ``n`` jobs by the
    peer's worker (``peer``: its database's conninfo; ``None``: Orbit alone), in alternating order, so
    that both meet the same load: this machine's speed moves by 2x within minutes, and a drain's
    batches shrink when its threads wait for a core. The 1-minute load average after each round is
    appended to ``load``. Returns Orbit's rates, the peer's rates, Orbit's
    CPU ms per task, the first round's worker RSS (MiB) and the first round's :class:`Cost`."""
    orbit: list[float] = []
    peers: list[float] = []
    cpu: list[float] = []
    for round_ in range(1, rounds + 1):
        queue = f"safe-{round_}" if retry_safe else _worker_queue(round_)
        if peer is not None and round_ % 2 == 0:
            peers.append(peer_worker_drain(peer, n, concurrency)[0])
        drain = _orbit_worker_drain(
            server, base, keys, n, concurrency, queue, server_pid, retry_safe=retry_safe
        )
        if round_ == 1:
            first_cost, first_rss = drain.cost, drain.rss
        rate, ms = drain.rate, drain.server_ms + drain.worker_ms
        orbit.append(rate)
        cpu.append(ms)
        if peer is not None and round_ % 2 == 1:
            peers.append(peer_worker_drain(peer, n, concurrency)[0])
        load.append(os.getloadavg()[0])
    return orbit, peers, cpu, first_rss, first_cost


def worker_rounds(
    report: Report, server: sa.Engine, base: str, keys: dict[str, str], n: int, concurrency: int, *,
    server_pid: int, rounds: int, peer: str | None,
) -> None:  # fmt: skip
    """The paired worker rounds (:func:`_paired_rounds`), with default tasks, then with tasks declared
    retry-safe. The first round's cost is counted.

    Retry-safe tasks' grants come back ``RUNNING`` (lease-and-start), the peer's own semantics (its
    worker marks a job ``doing`` as it fetches it). Tasks not declared retry-safe (the default) are
    confirmed by a ``start`` call before their handler runs: one more round trip in each task's serial
    cycle, for a guarantee the peer does not give (a worker lost mid-handler sends the task to review,
    not to a second run)."""
    rounds_of = functools.partial(
        _paired_rounds, server, base, keys, n, concurrency, server_pid=server_pid, rounds=rounds, peer=peer
    )
    load = [os.getloadavg()[0]]
    orbit, peers, cpu, rss, cost = rounds_of(retry_safe=False, load=load)
    report.meta["worker_rounds"] = {"orbit": orbit, "peer": peers, "cpu_ms_per_task": cpu, "loadavg_1m": load}
    report.add("orbit", "orbit: worker processed", statistics.median(orbit), "tasks/s",
               f"1 worker process, concurrency {concurrency}; median of {rounds}: "
               + ", ".join(f"{r:.0f}" for r in orbit))  # fmt: skip
    cost.report(report, "task (worker: lease, start, complete)", n)
    report.add("orbit", "orbit: worker CPU per task (server + worker)", statistics.median(cpu), "ms",
               "median; grows as batches shrink under load")  # fmt: skip
    report.add("orbit", "orbit: worker RSS", rss, "MiB", "the bench's own progress polls count in the trips")
    if peers:
        report.add("orbit", "peer: worker processed, paired", statistics.median(peers), "jobs/s",
                   "beside each Orbit drain: " + ", ".join(f"{r:.0f}" for r in peers))  # fmt: skip
        ratios = [o / p for o, p in zip(orbit, peers, strict=True)]
        report.add("orbit", "orbit worker / peer worker, paired", statistics.median(ratios), "×",
                   "median of the rounds' ratios: " + ", ".join(f"{r:.2f}" for r in ratios))  # fmt: skip

    load = [os.getloadavg()[0]]
    orbit, peers, _cpu, _rss, cost = rounds_of(retry_safe=True, load=load)
    report.meta["retry_safe_rounds"] = {"orbit": orbit, "peer": peers, "loadavg_1m": load}
    report.add("orbit", "orbit: worker processed, retry-safe tasks", statistics.median(orbit), "tasks/s",
               f"lease-and-start; median of {rounds}: " + ", ".join(f"{r:.0f}" for r in orbit))  # fmt: skip
    cost.report(report, "retry-safe task (worker: lease-and-start, complete)", n)
    if peers:
        ratios = [o / p for o, p in zip(orbit, peers, strict=True)]
        report.add("orbit", "orbit worker / peer worker, retry-safe tasks, paired", statistics.median(ratios), "×",
                   "median of the rounds' ratios: " + ", ".join(f"{r:.2f}" for r in ratios))  # fmt: skip


def end_to_end(
    business: sa.Engine, business_url: str, server: sa.Engine, base: str, keys: dict[str, str], n: int,
    concurrency: int, queue: str, *, retry_safe: bool = False,
) -> float:  # fmt: skip
    """Business commits with ``enqueue`` one after the other, a relay and a worker process running,
    until every task succeeded (tasks/s); ``retry_safe``: the tasks are declared retry-safe (lease-and-start)."""
    options = {"retry_safe": True} if retry_safe else None
    tables = _new_outbox(business)
    relay_env = {
        **os.environ,
        "ORBIT_OUTBOX_DATABASE_URL": business_url,
        "ORBIT_URL": base,
        "ORBIT_API_KEY": keys["submit"],
        "ORBIT_OUTBOX_TABLE": tables.name,
        "ORBIT_OUTBOX_BATCH_SIZE": "100",
        "ORBIT_OUTBOX_POLL_INTERVAL": "0.05",
    }
    orbit_outbox = str(Path(sys.executable).with_name("orbit-outbox"))
    orbit_vacuum(server)  # on PostgreSQL, as the peer's end to end starts vacuumed
    worker = _worker(base, keys["work"], queue, concurrency)
    relay = subprocess.Popen([orbit_outbox, "--log-level", "warning", "relay"], env=relay_env,
                             stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        time.sleep(1.0)  # let both processes start (their start-up is not what is measured)
        started = time.perf_counter()
        for i in range(n):
            with business.begin() as conn:
                enqueue(conn, namespace=NS, queue=queue, handler=HANDLER, params={"n": i}, tables=tables,
                        options=options)  # fmt: skip
        _wait_until(lambda: _succeeded(server, queue) >= n, "the end-to-end tasks")
        elapsed = time.perf_counter() - started
    finally:
        _stop(relay)
        _stop(worker)
    return n / elapsed


def _e2e_queue(round_: int, retry_safe: bool) -> str:
    return f"e2e-safe-{round_}" if retry_safe else f"e2e-{round_}"


def end_to_end_rounds(
    report: Report, business: sa.Engine, business_url: str, server: sa.Engine, base: str,
    keys: dict[str, str], n: int, concurrency: int, *, rounds: int, peer: str | None, retry_safe: bool = False,
) -> None:  # fmt: skip
    """``rounds`` of Orbit's end to end (:func:`end_to_end`), each beside one of the peer's
    (:func:`peer_end_to_end`; ``peer``: its conninfo, ``None``: Orbit alone), in alternating order, as the
    worker rounds are: the peer's end to end moved from 325 to 679 jobs/s between runs with the machine's
    load, so only a ratio of two runs that met the same load means anything. Orbit's figure is the median of
    its rounds (its name kept: scripts read it); with the peer, its paired rates and the median of the
    rounds' ratios beside it."""
    orbit: list[float] = []
    peers: list[float] = []
    for round_ in range(1, rounds + 1):
        if peer is not None and round_ % 2 == 0:
            peers.append(peer_end_to_end(peer, n, concurrency))
        queue = _e2e_queue(round_, retry_safe)
        orbit.append(end_to_end(business, business_url, server, base, keys, n, concurrency, queue,
                                retry_safe=retry_safe))  # fmt: skip
        if peer is not None and round_ % 2 == 1:
            peers.append(peer_end_to_end(peer, n, concurrency))
    rounds_note = f"median of {rounds}: " + ", ".join(f"{rate:.0f}" for rate in orbit)
    if retry_safe:
        name, what = (
            "orbit: end to end, retry-safe tasks",
            "as above, tasks declared retry-safe (lease-and-start)",
        )
    else:
        name, what = "orbit: end to end", "enqueue → relay (batch 100) → worker → SUCCEEDED"
    report.add("orbit", name, statistics.median(orbit), "tasks/s", f"{what}; {rounds_note}")
    if peer is None:
        return
    kind = ", retry-safe rounds" if retry_safe else ""
    report.add("orbit", f"peer: end to end, paired{kind}", statistics.median(peers), "jobs/s",
               "beside each Orbit round: " + ", ".join(f"{rate:.0f}" for rate in peers))  # fmt: skip
    ratios = [o / p for o, p in zip(orbit, peers, strict=True)]
    report.add("orbit", f"orbit / peer, end to end{', retry-safe tasks' if retry_safe else ''}, paired",
               statistics.median(ratios), "×",
               "median of the rounds' ratios: " + ", ".join(f"{r:.2f}" for r in ratios))  # fmt: skip


def relay_rss(business: sa.Engine, business_url: str, base: str, key: str, n: int) -> tuple[float, float]:
    """The relay CLI at batch 500 over ``n`` rows (``--once``): its rows/s and peak RSS."""
    tables = _new_outbox(business)
    _fill_outbox(business, tables, n)
    env = {**os.environ, "ORBIT_OUTBOX_DATABASE_URL": business_url, "ORBIT_URL": base, "ORBIT_API_KEY": key,
           "ORBIT_OUTBOX_TABLE": tables.name, "ORBIT_OUTBOX_BATCH_SIZE": "500"}  # fmt: skip
    orbit_outbox = str(Path(sys.executable).with_name("orbit-outbox"))
    started = time.perf_counter()
    proc = subprocess.Popen([orbit_outbox, "--log-level", "warning", "relay", "--once"], env=env,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    rss, _cpu = _stop_when_exits(proc)
    return n / (time.perf_counter() - started), rss


def run_orbit(
    report: Report, n: int, concurrency: int, serve_args: list[str], driver: str, *,
    worker_rounds_: int = 3, peer: str | None = None, sweep: tuple[int, ...] | None = None,
    server_db: str = "mariadb",
) -> None:  # fmt: skip
    databases = postgres_databases if server_db == "postgres" else mysql_databases
    with databases("server", "business") as urls:
        server_url = urls["server"]
        cli("migrate", url=server_url)
        cli("namespace", "create", NS, url=server_url)
        rounds_queues = [_worker_queue(r) for r in range(1, worker_rounds_ + 1)]
        rounds_queues += [f"safe-{r}" for r in range(1, worker_rounds_ + 1)]
        rounds_queues += [_e2e_queue(r, safe) for r in range(1, worker_rounds_ + 1) for safe in (False, True)]
        for queue in (QUEUE, *rounds_queues):
            cli("queue", "create", NS, queue, url=server_url)
        keys = {
            role: cli("api-key", "create", NS, "--role", role, url=server_url) for role in ("submit", "work")
        }
        business = sa.create_engine(urls["business"])
        server_engine = sa.create_engine(server_url)
        try:
            serve_url = (
                sa.make_url(server_url)
                .set(drivername=f"mysql+{driver}")
                .render_as_string(hide_password=False)
                if server_db == "mariadb"
                else server_url
            )
            Cost.count_http = "--workers" not in serve_args or serve_args[
                serve_args.index("--workers") + 1 :
            ][:1] == ["1"]
            with orbit_server_processes(serve_url, serve_args=serve_args) as (server,):
                base = server.base
                with httpx.Client(base_url=base) as http:
                    elapsed = _timed(lambda: [http.get("/healthz") for _ in range(500)])
                report.add(
                    "orbit", "server GET /healthz (base)", 500 / elapsed, "req/s", "1 client, no database"
                )

                tables = business_transactions(report, business, n)
                with Cost(server_engine, base) as cost:
                    rate = relay_round(business, base, keys["submit"], tables, n, 100)
                report.add(
                    "orbit",
                    "relay batch 100",
                    rate,
                    "rows/s",
                    "in-process Relay.run_once, defaults otherwise",
                )
                cost.report(report, "relayed row, batch 100", n)
                tables = _new_outbox(business)
                _fill_outbox(business, tables, n)
                with Cost(server_engine, base) as cost:
                    rate = relay_round(business, base, keys["submit"], tables, n, 1)
                report.add("orbit", "relay batch 1", rate, "rows/s")
                cost.report(report, "relayed row, batch 1", n)

                with Cost(server_engine, base) as cost:
                    rate = direct_single(base, keys["submit"], n)
                report.add("orbit", "direct single submissions", rate, "tasks/s", "8 threads")
                cost.report(report, "single submission", n)
                if hasattr(OrbitClient, "submit_tasks"):
                    with Cost(server_engine, base) as cost:
                        rate = direct_batch(base, keys["submit"], n)
                    report.add(
                        "orbit", "direct batch submissions", rate, "tasks/s", "batches of 100, 2 threads"
                    )
                    cost.report(report, "batch-submitted task", n)
                else:
                    report.add("orbit", "direct batch submissions", None, "tasks/s", "n/a (no submit_tasks)")

                worker_rounds(report, server_engine, base, keys, n, concurrency, server_pid=server.proc.pid,
                              rounds=worker_rounds_, peer=peer)  # fmt: skip
                if sweep:  # the workers section (bench.compare_workers)
                    run_workers(report, server_engine, base, keys, n, concurrency, server_pid=server.proc.pid,
                                peer=peer, sweep=sweep, serve_url=serve_url, serve_args=serve_args)  # fmt: skip
                for retry_safe in (False, True):
                    end_to_end_rounds(report, business, urls["business"], server_engine, base, keys, n, concurrency,
                                      rounds=worker_rounds_, peer=peer, retry_safe=retry_safe)  # fmt: skip
                rate, rss = relay_rss(business, urls["business"], base, keys["submit"], n)
                report.add(
                    "orbit", "relay CLI batch 500 (--once)", rate, "rows/s", "process start-up included"
                )
                report.add("orbit", "relay RSS at batch 500", rss, "MiB")
                report.add("orbit", "server RSS", peak_rss_mb(server.proc.pid), "MiB",
                           f"peak over the run; driver {driver} {' '.join(serve_args)}")  # fmt: skip
        finally:
            business.dispose()
            server_engine.dispose()


# -------------------------------------------------------------------- claim


def _claim_kwargs() -> dict[str, Any]:
    from outbox_adapter import _queries

    accepted = inspect.signature(_queries.claim_batch).parameters
    kwargs: dict[str, Any] = {"owner": "bench", "lease_seconds": 60.0, "limit": 100,
                              "default_max_attempts": 5, "actor": "bench"}  # fmt: skip
    return {k: v for k, v in kwargs.items() if k in accepted}


def _claim_once(engine: sa.Engine, tables: OutboxTables) -> float:
    """Time one claim of 100 rows (``claim_batch``), rolled back so the next sees the same rows."""
    from outbox_adapter import _queries

    with engine.connect() as conn:
        tx = conn.begin()
        started = time.perf_counter()
        claims, _spent = _queries.claim_batch(conn, tables, **_claim_kwargs())
        elapsed = time.perf_counter() - started
        tx.rollback()
    if len(claims) != 100:
        raise SystemExit(f"the claim found {len(claims)} rows, expected 100")
    return elapsed


def _load_delivered(engine: sa.Engine, tables: OutboxTables, first: int, last: int) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO `{tables.name}` (idempotency_key, namespace, queue, handler, params, state, attempts, "
            "send_count, available_at, orbit_task_id, created_at, updated_at, delivered_at) "
            f"SELECT CONCAT('done-', seq), '{NS}', '{QUEUE}', '{HANDLER}', '{{}}', 'DELIVERED', 1, 1, "
            "UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, UUID(), UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, "
            f"UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq_{first}_to_{last}"
        )
    with engine.connect() as conn:
        conn.exec_driver_sql(f"ANALYZE TABLE `{tables.name}`").all()


def run_claim(report: Report, repeats: int = 30) -> None:
    with mysql_databases("claim") as urls:
        engine = sa.create_engine(urls["claim"])
        try:
            tables = _new_outbox(engine)
            _load_delivered(engine, tables, 1, 1000)
            _fill_outbox(engine, tables, 100)  # the due rows the claim finds
            _claim_once(engine, tables)  # warm up
            small = statistics.median(_claim_once(engine, tables) for _ in range(repeats))
            report.add(
                "claim", "claim of 100, 1k DELIVERED rows (base)", small * 1000, "ms", f"median of {repeats}"
            )
            report.explain["claim at 1k"] = _explain_claim(engine, tables)
            started = time.perf_counter()
            for first in range(1001, 1_000_001, 100_000):
                _load_delivered(engine, tables, first, min(first + 99_999, 1_000_000))
            load = time.perf_counter() - started
            big = statistics.median(_claim_once(engine, tables) for _ in range(repeats))
            report.add("claim", "claim of 100, 1M DELIVERED rows", big * 1000, "ms",
                       f"median of {repeats}; 1M rows loaded in {load:.0f} s")  # fmt: skip
            report.explain["claim at 1M"] = _explain_claim(engine, tables)
        finally:
            engine.dispose()


def _explain_claim(engine: sa.Engine, tables: OutboxTables) -> list[dict[str, Any]]:
    """EXPLAIN the claim's ``SELECT ... FOR UPDATE`` as the driver received it."""
    statements: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FOR UPDATE" in statement:
            statements.append((statement, parameters))

    with engine.connect() as conn:
        sa.event.listen(conn, "before_cursor_execute", record)
        tx = conn.begin()
        from outbox_adapter import _queries

        _queries.claim_batch(conn, tables, **_claim_kwargs())
        tx.rollback()
        sa.event.remove(conn, "before_cursor_execute", record)
        if not statements:
            return []
        statement, parameters = statements[0]
        result = conn.exec_driver_sql("EXPLAIN " + statement, parameters)
        return [{k: (str(v) if v is not None else None) for k, v in row._mapping.items()} for row in result]


# -------------------------------------------------------------------- table


def judge(report: Report) -> None:
    r = report
    r.compare("peer: worker processed", "peer: defer")
    r.compare("peer: end to end", "peer: defer")
    r.compare("business txn with enqueue", "business txn without enqueue (base)")
    # Like for like: a hand-over without execution beside the peer's defer (end to end beside end to end).
    r.compare("relay batch 100", "peer: defer")
    r.compare("relay batch 1", "peer: defer")
    r.compare("direct single submissions", "server GET /healthz (base)")
    r.compare("direct batch submissions", "direct single submissions")
    if r.value("peer: worker processed, paired") is not None:  # the peer's drains beside Orbit's
        r.compare("orbit: worker processed", "peer: worker processed, paired")
    else:
        r.compare("orbit: worker processed", "peer: worker processed")
    if r.value("peer: end to end, paired") is not None:  # the peer's end to end beside each Orbit round
        r.compare("orbit: end to end", "peer: end to end, paired")
        r.compare("orbit: end to end, retry-safe tasks", "peer: end to end, paired, retry-safe rounds")
    else:
        r.compare("orbit: end to end", "peer: end to end")
        r.compare("orbit: end to end, retry-safe tasks", "peer: end to end")
    r.compare("claim of 100, 1M DELIVERED rows", "claim of 100, 1k DELIVERED rows (base)")
    b1, b100 = r.value("relay batch 1"), r.value("relay batch 100")
    if b1 and b100:
        r.add("orbit", "relay batching gain (batch 100 / batch 1)", b100 / b1, "×")
    r.target("relay batch 100", "≥ 2,000 rows/s", lambda f: f.value is not None and f.value >= 2000)
    r.target("relay batching gain (batch 100 / batch 1)", "≥ 10×", lambda f: (f.value or 0) >= 10)
    r.target("direct batch submissions", "≥ 4,000 tasks/s", lambda f: (f.value or 0) >= 4000)
    if r.value("orbit worker / peer worker, paired") is not None:  # the ratio that both drains' load shares
        r.target("orbit worker / peer worker, paired", "≥ 1.5×", lambda f: (f.value or 0) >= 1.5)
    else:
        r.target(
            "orbit: worker processed", "≥ 1.5× peer", lambda f: None if f.ratio is None else f.ratio >= 1.5
        )
    r.target("orbit / peer, concurrency 1", "≥ 1.5×", lambda f: (f.value or 0) >= 1.5)
    r.target("orbit / peer, concurrency 4", "≥ 1.5×", lambda f: (f.value or 0) >= 1.5)
    r.target("orbit CPU per task, concurrency 1 (server + worker)", "≤ 3 ms", lambda f: (f.value or 99) <= 3)
    r.target("orbit worker / peer worker, retry-safe tasks, paired", "≥ 3×", lambda f: (f.value or 0) >= 3)
    r.target("orbit at its best / peer at its best", "≥ 1.5×", lambda f: (f.value or 0) >= 1.5)
    r.target("orbit best / peer best", "≥ 1.5×", lambda f: (f.value or 0) >= 1.5)
    r.target("orbit HTTP requests per task, concurrency 4", "≤ 0.3", lambda f: (f.value or 99) <= 0.3)
    r.target("orbit DB round trips per task, concurrency 4", "≤ 3", lambda f: (f.value or 99) <= 3)
    r.target("orbit: 2 worker processes / 1", "≥ 1.7×", lambda f: (f.value or 0) >= 1.7)
    r.target("orbit: 2 server processes / 1", "≥ 1.6×", lambda f: (f.value or 0) >= 1.6)
    r.target("enqueue cost with ordering key (time / without)", "≤ 1.6×", lambda f: (f.value or 99) <= 1.6)
    if r.value("orbit / peer, end to end, paired") is not None:  # the ratios that both runs' load shares
        r.target("orbit / peer, end to end, paired", "≥ 1.5×", lambda f: (f.value or 0) >= 1.5)
        r.target("orbit / peer, end to end, retry-safe tasks, paired", "≥ 2×", lambda f: (f.value or 0) >= 2)
    else:
        r.target("orbit: end to end", "≥ 1.5× peer", lambda f: None if f.ratio is None else f.ratio >= 1.5)
        r.target(
            "orbit: end to end, retry-safe tasks",
            "≥ 2× peer",
            lambda f: None if f.ratio is None else f.ratio >= 2,
        )
    r.target("enqueue cost (time with / without)", "≤ 1.3×", lambda f: (f.value or 99) <= 1.3)
    r.target(
        "claim of 100, 1M DELIVERED rows",
        "≤ 1.5× claim at 1k",
        lambda f: None if f.ratio is None else f.ratio <= 1.5,
    )
    r.target("relay RSS at batch 500", "≤ 150 MiB", lambda f: (f.value or 0) <= 150)


def print_report(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 170))
    table = Table(title="Orbit vs procrastinate, one run", show_lines=False)
    for column, justify in (("figure", "left"), ("value", "right"), ("unit", "left"), ("ratio", "right"),
                            ("against", "left"), ("target", "left"), ("", "left"), ("note", "left")):  # fmt: skip
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for f in report.figures:
        value = "n/a" if f.value is None else (f"{f.value:,.0f}" if f.value >= 100 else f"{f.value:,.2f}")
        verdict = "" if f.passed is None else ("[green]pass[/]" if f.passed else "[red]miss[/]")
        ratio = "" if f.ratio is None else f"{f.ratio:.2f}×"
        table.add_row(f.name, value, f.unit, ratio, f.base or "", f.target or "", verdict, f.note)
    console.print(table)
    console.print(report.meta)
    for label, rows in report.explain.items():
        console.print(f"EXPLAIN ({label}):")
        for row in rows:
            console.print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))


#: Where each run's figures go (``--json-file``): the docs quote only figures from a committed file here.
RESULTS = Path(__file__).resolve().parent / "results"

#: Every setting of this benchmark that differs from a default, on either side (disclosed in the results).
SETTINGS = {
    "orbit server": "orbit-server serve defaults (1 process; --serve-args adds to them), on this machine's "
    "MariaDB (--server-db mariadb) or on the peer's PostgreSQL instance (--server-db postgres)",
    "orbit worker": "bench.worker_process: Worker defaults but concurrency (--concurrency, the sweep) and a no-op handler",
    "orbit relay, end to end": "ORBIT_OUTBOX_POLL_INTERVAL=0.05 s (default 1.0 s), ORBIT_OUTBOX_BATCH_SIZE=100",
    "orbit relay, relay rows": "in-process Relay.run_once at batch 1 and 100, defaults otherwise",
    "peer": "procrastinate defaults (PsycopgConnector, psycopg_pool's 4 connections, LISTEN/NOTIFY wake-ups); "
    "concurrency as Orbit's; the 'best' section: 1, 2, 4 processes with a pool of concurrency + 1",
    "maintenance": "the peer's database is VACUUM (ANALYZE)d before each of its drains and its end to end (untimed; "
    "its CPU counted with the drain's where CPU is), as autovacuum would: this machine's PostgreSQL runs with "
    "autovacuum off (postgres settings below), and a drain's dead rows slowed the next one by half; Orbit's "
    "server database too when it is on PostgreSQL; on MariaDB InnoDB purges in the background",
    "peer task": "bench._peer_app.noop is an async def (the peer runs a plain function through a thread hop: "
    "5-10% fewer jobs/s); Orbit's handler is a plain function, run in the worker's own threads",
    "cpu per task": "Orbit: server + worker processes (+ mariadbd, or with --server-db postgres its databases' "
    "postgres backends, where labelled); peer: worker + its database's postgres backends; each side's PostgreSQL "
    "share adds the instance's WAL writer, background writer and checkpointer; backends sampled while they live "
    "(bench._compare.database_cpu)",
}


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    """When, on what code and what machine load this run was made, and with which settings."""
    settings = {**SETTINGS, "serve_args": args.serve_args, "server_driver": args.server_driver,
                "server_db": args.server_db}  # fmt: skip
    return run_provenance("bench.compare", settings)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=2000, help="jobs / rows / tasks per figure (default 2000)")
    parser.add_argument(
        "--concurrency", type=int, default=4, help="worker concurrency, both sides (default 4)"
    )
    parser.add_argument("--worker-rounds", type=int, default=3,
                        help="worker drains of --n tasks, each beside one of the peer's when the peer runs too (default 3)")  # fmt: skip
    parser.add_argument("--skip-claim", action="store_true", help="skip the 1M-row claim section")
    parser.add_argument("--sweep", default="1,4,16,64",
                        help="worker concurrencies of the workers section (default 1,4,16,64)")  # fmt: skip
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}"
    )
    parser.add_argument(
        "--serve-args", default="", help="extra `orbit-server serve` arguments, e.g. '--workers 2'"
    )
    parser.add_argument("--server-driver", choices=["pymysql", "mysqldb"], default="pymysql",
                        help="MySQL driver of the Orbit server (mysqldb: the mysqlclient extra)")  # fmt: skip
    parser.add_argument("--server-db", choices=["mariadb", "postgres"], default="mariadb",
                        help="Orbit's databases: MariaDB (default) or the peer's PostgreSQL instance, a database "
                             "of their own beside the peer's")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--json-file",
                        help="write the figures as JSON to this file (default: bench/results/compare-<UTC time>-<commit>.json; "
                             "'-' writes none)")  # fmt: skip
    args = parser.parse_args()
    sections = [s for s in args.only.split(",") if s]
    if args.skip_claim and "claim" in sections:
        sections.remove("claim")
    report = Report(meta={"n": args.n, "concurrency": args.concurrency, "cpus": os.cpu_count(),
                          "python": platform.python_version(), "sections": sections, **provenance(args)})  # fmt: skip
    report.meta["server_db"] = args.server_db
    if args.server_db == "mariadb" or "claim" in sections:
        admin = sa.create_engine(MYSQL_SERVER)
        with admin.connect() as conn:
            report.meta["mariadb"] = dict(
                conn.exec_driver_sql(
                    "SELECT VERSION() AS version, @@innodb_flush_log_at_trx_commit AS flush_log_at_trx_commit, "
                    "@@sync_binlog AS sync_binlog"
                )
                .one()
                ._mapping
            )
        admin.dispose()
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(peer_database(report)) if "peer" in sections else None
        if peer is not None:
            run_peer(report, args.n, args.concurrency, peer)
        if "orbit" in sections:
            sweep = tuple(int(c) for c in args.sweep.split(",") if c) if "workers" in sections else None
            run_orbit(report, args.n, args.concurrency, args.serve_args.split(), args.server_driver,
                      worker_rounds_=args.worker_rounds, peer=peer, sweep=sweep, server_db=args.server_db)  # fmt: skip
    if "claim" in sections:
        run_claim(report)
    judge(report)
    report.meta["loadavg_at_end"] = os.getloadavg()
    report.meta["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    document = {
        "figures": [asdict(f) for f in report.figures],
        "explain": report.explain,
        "meta": report.meta,
    }
    json_file = args.json_file or str(RESULTS / f"compare-{report.meta['started_at'][:16].replace(':', '')}-"
                                              f"{report.meta['commit'][:7]}.json")  # fmt: skip
    if json_file != "-":
        Path(json_file).parent.mkdir(parents=True, exist_ok=True)
        Path(json_file).write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"figures written to {json_file}", file=sys.stderr)
    if args.json:
        print(json.dumps(document, indent=2, default=str))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
