"""The ``workers`` section of ``bench.compare``: Orbit's worker beside procrastinate's, in depth.

For each concurrency of the sweep (default 1, 4, 16, 64), the same run drains ``--n`` no-op tasks
with one Orbit worker process and ``--n`` no-op jobs with one procrastinate worker process
(alternating which goes first), and reports, for each side:

- the drain rate (from the databases' own timestamps, so process start-up is not counted);
- CPU per task, each side's database included: Orbit's server + worker processes + MariaDB
  (``mariadbd``), or with ``--server-db postgres`` + PostgreSQL; the peer's worker process +
  PostgreSQL. A side's PostgreSQL is the backends of its own databases (told apart by the database
  name in their titles), sampled while they live, and the instance's WAL writer, background writer
  and checkpointer (:func:`bench._compare.database_cpu`). Other users of MariaDB, and of the shared
  writers, count too, so run it on a quiet machine;
- for Orbit, HTTP requests and database round trips (MariaDB's global counters; not counted on
  PostgreSQL) per task;
- Orbit's drain rate with tasks declared retry-safe too (lease-and-start: no ``start`` call, the peer's own
  semantics), and its ratio to the peer's drain at the same concurrency.

Then two Orbit worker processes against one, at the base concurrency; and two server processes
(``orbit-server serve --workers 2``, a second server on the same database) against the run's one, each
drained by one worker process at concurrency 16 (:data:`SERVERS_AT`), the one-process drain first and
last and their mean taken, so that a load that moves during the run weighs on both sides. The 1-minute
load average before and after each step is printed beside it, because these machines are shared.
"""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa

from bench._compare import _orbit_worker_drain, database_cpu, peer_defer, peer_vacuumed, peer_worker_drain
from bench._support import cli, orbit_server_processes

__all__ = ["SERVERS_AT", "SWEEP", "run_workers"]

SWEEP = (1, 4, 16, 64)
#: The worker concurrency at which two server processes are set against one (issue 28: ≥ 1.6×).
SERVERS_AT = 16


def _peer_drain(
    conninfo: str, n: int, concurrency: int, *, processes: int = 1, pool: int | None = None
) -> tuple[float, float]:
    """The peer's worker drains ``n`` fresh jobs: (jobs/s, CPU ms per job of worker from its worker loop's
    start + PostgreSQL: the backends of its database, sampled while they live, the vacuum before the drain
    among them, and the instance's writers, :func:`~bench._compare.database_cpu`)."""
    after = peer_defer(conninfo, n, vacuum=False)
    with database_cpu("peer") as pg, peer_vacuumed(conninfo):  # the vacuum's CPU counts as the peer's
        rate, _rss, worker_cpu = peer_worker_drain(
            conninfo, n, concurrency, after=after, processes=processes, pool=pool
        )
    return rate, (worker_cpu + pg.seconds) / n * 1000


#: The worker processes of :func:`at_best`'s drains.
PROCESSES = (1, 2, 4)


def at_best(
    report: Any, server: sa.Engine, base: str, keys: dict[str, str], n: int, concurrency: int, *,
    server_pid: int, peer: str,
) -> None:  # fmt: skip
    """Each side at its best, not at its defaults only: 1, 2 and 4 worker processes at ``concurrency``
    each, the peer's pool holding ``concurrency + 1`` connections (its how-to: a worker uses up to its
    pool's size, plus one for LISTEN/NOTIFY); each pair drained in alternating order; then each side's
    best and their ratio."""
    best = {"orbit": 0.0, "peer": 0.0}
    for index, processes in enumerate(PROCESSES):
        load = os.getloadavg()[0]
        queue = f"best-{processes}"
        cli("queue", "create", "bench", queue, url=server.url.render_as_string(hide_password=False))
        if index % 2:
            peer_rate = _peer_drain(peer, n, concurrency, processes=processes, pool=concurrency + 1)[0]
        orbit = _orbit_worker_drain(
            server, base, keys, n, concurrency, queue, server_pid, processes=processes
        )
        if not index % 2:
            peer_rate = _peer_drain(peer, n, concurrency, processes=processes, pool=concurrency + 1)[0]
        note = f"concurrency {concurrency} each; load {load:.1f} → {os.getloadavg()[0]:.1f}"
        report.add("best", f"orbit, {processes} worker process(es)", orbit.rate, "tasks/s", note)
        report.add("best", f"peer, {processes} worker process(es), pool {concurrency + 1}", peer_rate, "jobs/s",
                   note)  # fmt: skip
        best["orbit"], best["peer"] = max(best["orbit"], orbit.rate), max(best["peer"], peer_rate)
    report.add("best", "orbit at its best", best["orbit"], "tasks/s", f"of {PROCESSES} processes")
    report.add(
        "best",
        "peer at its best",
        best["peer"],
        "jobs/s",
        f"of {PROCESSES} processes, pool {concurrency + 1}",
    )
    report.add("best", "orbit at its best / peer at its best", best["orbit"] / best["peer"], "×")


def server_processes(
    report: Any, server: sa.Engine, base: str, keys: dict[str, str], n: int, *,
    server_pid: int, serve_url: str, serve_args: list[str],
) -> None:  # fmt: skip
    """Two server processes against one (module docstring): ``serve_url`` and ``serve_args`` are those of the
    run's server (``serve_args`` without its own ``--workers``)."""
    url = server.url.render_as_string(hide_password=False)
    for queue in ("servers-1a", "servers-2", "servers-1b"):
        cli("queue", "create", "bench", queue, url=url)
    args = list(serve_args)
    if "--workers" in args:
        del args[args.index("--workers") : args.index("--workers") + 2]
    load = os.getloadavg()[0]
    first = _orbit_worker_drain(server, base, keys, n, SERVERS_AT, "servers-1a", server_pid)
    with orbit_server_processes(serve_url, serve_args=[*args, "--workers", "2"]) as (two_server,):
        two = _orbit_worker_drain(
            server, two_server.base, keys, n, SERVERS_AT, "servers-2", two_server.proc.pid
        )
    last = _orbit_worker_drain(server, base, keys, n, SERVERS_AT, "servers-1b", server_pid)
    one = (first.rate + last.rate) / 2
    note = f"1 worker process, concurrency {SERVERS_AT}; load {load:.1f} → {os.getloadavg()[0]:.1f}"
    report.add("workers", f"orbit: 1 server process, concurrency {SERVERS_AT}", one, "tasks/s",
               f"{note}; mean of the drains before and after: {first.rate:.0f}, {last.rate:.0f}")  # fmt: skip
    report.add("workers", f"orbit: 2 server processes, concurrency {SERVERS_AT}", two.rate, "tasks/s",
               f"{note}; server CPU per task {two.server_ms:.2f} ms (vs {first.server_ms:.2f}, {last.server_ms:.2f})")  # fmt: skip
    report.add("workers", "orbit: 2 server processes / 1", two.rate / one, "×", f"{os.cpu_count()} cores")


def run_workers(
    report: Any, server: sa.Engine, base: str, keys: dict[str, str], n: int, concurrency: int, *,
    server_pid: int, peer: str | None, sweep: tuple[int, ...] = SWEEP,
    serve_url: str | None = None, serve_args: list[str] | None = None,
) -> None:  # fmt: skip
    """The section (module docstring); ``report`` is ``bench.compare``'s :class:`Report`. Without
    ``serve_url`` (the run's server's database URL, as served) two server processes are not measured."""
    url = server.url.render_as_string(hide_password=False)
    # A queue per drain: the sweep's, and the two of "two processes against one" (whatever the sweep holds).
    queues = [f"sweep-{level}" for level in sweep] + [f"sweep-safe-{level}" for level in sweep]
    for queue in [*queues, "processes-1", "processes-2"]:
        cli("queue", "create", "bench", queue, url=url)
    best: dict[str, float] = {"orbit": 0.0, "peer": 0.0}
    for index, level in enumerate(sweep):
        load = os.getloadavg()[0]
        peer_first = peer is not None and index % 2 == 1
        peer_rate = peer_ms = None
        if peer_first:
            assert peer is not None
            peer_rate, peer_ms = _peer_drain(peer, n, level)
        orbit = _orbit_worker_drain(server, base, keys, n, level, f"sweep-{level}", server_pid)
        # The same with tasks declared retry-safe (lease-and-start, no start call: the peer's own semantics)
        safe = _orbit_worker_drain(
            server, base, keys, n, level, f"sweep-safe-{level}", server_pid, retry_safe=True
        )
        if peer is not None and not peer_first:
            peer_rate, peer_ms = _peer_drain(peer, n, level)
        load_after = os.getloadavg()[0]
        best["orbit"] = max(best["orbit"], orbit.rate)
        note = f"load {load:.1f} → {load_after:.1f}"
        report.add("workers", f"orbit worker, concurrency {level}", orbit.rate, "tasks/s", note)
        if peer_rate is not None:
            best["peer"] = max(best["peer"], peer_rate)
            report.add("workers", f"peer worker, concurrency {level}", peer_rate, "jobs/s", note)
            report.add("workers", f"orbit / peer, concurrency {level}", orbit.rate / peer_rate, "×")
        report.add("workers", f"orbit worker, concurrency {level}, retry-safe tasks", safe.rate, "tasks/s",
                   f"{note}; CPU per task {safe.server_ms + safe.worker_ms:.2f} ms (server + worker)")  # fmt: skip
        if peer_rate is not None:
            report.add(
                "workers", f"orbit / peer, concurrency {level}, retry-safe tasks", safe.rate / peer_rate, "×"
            )
        report.add("workers", f"orbit CPU per task, concurrency {level} (server + worker)",
                   orbit.server_ms + orbit.worker_ms, "ms",
                   f"server {orbit.server_ms:.2f}, worker {orbit.worker_ms:.2f}")  # fmt: skip
        report.add("workers", f"orbit CPU per task, concurrency {level} (server + worker + {orbit.db_name})",
                   orbit.server_ms + orbit.worker_ms + orbit.db_ms, "ms", f"{orbit.db_name} {orbit.db_ms:.2f}")  # fmt: skip
        if peer_ms is not None:
            report.add(
                "workers", f"peer CPU per job, concurrency {level} (worker + PostgreSQL)", peer_ms, "ms"
            )
        report.add("workers", f"orbit HTTP requests per task, concurrency {level}", orbit.http, "requests")
        report.add("workers", f"orbit DB round trips per task, concurrency {level}", orbit.trips, "round trips",
                   "MariaDB's global counters (other clients count too)" if orbit.trips is not None
                   else "not counted on PostgreSQL (no global statement counter)")  # fmt: skip
    report.add("workers", "orbit worker, best of the sweep", best["orbit"], "tasks/s")
    if peer is not None:
        report.add("workers", "peer worker, best of the sweep", best["peer"], "jobs/s")
        report.add(
            "workers", "orbit best / peer best", best["orbit"] / best["peer"] if best["peer"] else None, "×"
        )
    load = os.getloadavg()[0]
    one = _orbit_worker_drain(server, base, keys, n, concurrency, "processes-1", server_pid).rate
    two = _orbit_worker_drain(server, base, keys, 2 * n, concurrency, "processes-2", server_pid, processes=2)
    report.add("workers", f"orbit: 1 worker process, concurrency {concurrency}", one, "tasks/s",
               f"load {load:.1f}")  # fmt: skip
    report.add("workers", f"orbit: 2 worker processes, concurrency {concurrency} each", two.rate, "tasks/s",
               f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    report.add("workers", "orbit: 2 worker processes / 1", two.rate / one, "×")
    if serve_url is not None:
        server_processes(report, server, base, keys, n, server_pid=server_pid, serve_url=serve_url,
                         serve_args=serve_args or [])  # fmt: skip
    if peer is not None:
        at_best(report, server, base, keys, n, concurrency, server_pid=server_pid, peer=peer)
    report.meta["workers_sweep_done_at"] = time.time()
