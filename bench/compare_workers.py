"""The ``workers`` section of ``bench.compare``: Orbit's worker beside procrastinate's, in depth.

For each concurrency of the sweep (default 1, 4, 16, 64), the same run drains ``--n`` no-op tasks
with one Orbit worker process and ``--n`` no-op jobs with one procrastinate worker process
(alternating which goes first), and reports, for each side:

- the drain rate (from the databases' own timestamps, so process start-up is not counted);
- CPU per task: Orbit's server + worker processes; the peer's worker process + PostgreSQL (every
  ``postgres`` process of the machine, before and after: its backend, WAL writer and checkpointer;
  other users of that PostgreSQL count too, so run it on a quiet machine);
- for Orbit, HTTP requests and database round trips (MariaDB's global counters) per task.

Then two Orbit worker processes against one, at the base concurrency. The 1-minute load average
before and after each step is printed beside it, because these machines are shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import sqlalchemy as sa

from bench._support import cli, cpu_seconds

__all__ = ["SWEEP", "postgres_cpu_seconds", "run_workers"]

SWEEP = (1, 4, 16, 64)


def postgres_cpu_seconds() -> float:
    """CPU seconds used so far by every live process named ``postgres`` on this machine."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        name = text[text.find("(") + 1 : text.rfind(")")]
        if name != "postgres":
            continue
        fields = text.rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _peer_drain(conninfo: str, n: int, concurrency: int) -> tuple[float, float]:
    """The peer's worker drains ``n`` fresh jobs: (jobs/s, CPU ms per job of worker + PostgreSQL)."""
    import psycopg

    from bench import _peer_app
    from bench.compare import _peer_last_job

    after = _peer_last_job(conninfo)
    with _peer_app.app.open():
        for i in range(n):
            _peer_app.noop.defer(n=i)
    env = {**os.environ, "BENCH_PEER_CONNINFO": conninfo, "BENCH_PEER_CONCURRENCY": str(concurrency)}
    pg_before = postgres_cpu_seconds()
    worker = subprocess.Popen([sys.executable, "-m", "bench._peer_app"], env=env, stdout=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(worker.pid, 0)
    pg_cpu = postgres_cpu_seconds() - pg_before
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the peer's worker exited with status {status}")
    with psycopg.connect(conninfo) as conn:
        first, last, done = conn.execute(
            "SELECT min(at) FILTER (WHERE type = 'started'), max(at) FILTER (WHERE type = 'succeeded'), "
            "count(*) FILTER (WHERE type = 'succeeded') FROM procrastinate_events WHERE job_id > %s",
            (after,),
        ).fetchone()  # type: ignore[misc]
    if done != n:
        raise SystemExit(f"peer worker finished {done} of {n} jobs")
    worker_cpu = usage.ru_utime + usage.ru_stime
    return n / (last - first).total_seconds(), (worker_cpu + pg_cpu) / n * 1000


def _orbit_drain(
    server: sa.Engine, base: str, keys: dict[str, str], n: int, concurrency: int, queue: str, server_pid: int,
    *, processes: int = 1,
) -> dict[str, float]:  # fmt: skip
    """``processes`` Orbit worker processes drain ``n`` tasks submitted (untimed) to the empty ``queue``."""
    from bench.compare import Cost, _stop, _submit_untimed, _succeeded, _wait_until, _worker

    _submit_untimed(base, keys["submit"], n, queue)
    server_cpu = cpu_seconds(server_pid)
    with Cost(server, base) as cost:
        workers = [_worker(base, keys["work"], queue, concurrency) for _ in range(processes)]
        try:
            _wait_until(lambda: _succeeded(server, queue) >= n, "the workers to finish", every=0.2)
            worker_cpu = sum(cpu_seconds(w.pid) for w in workers)
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
    trips = (cost.db["Questions"] + cost.db["Com_admin_commands"]) / n
    return {
        "rate": n / (last - first).total_seconds(),
        "server_ms": server_cpu / n * 1000,
        "worker_ms": worker_cpu / n * 1000,
        "http": cost.http / n if Cost.count_http else float("nan"),
        "trips": trips,
    }


def run_workers(
    report: Any, server: sa.Engine, base: str, keys: dict[str, str], n: int, concurrency: int, *,
    server_pid: int, peer: str | None, sweep: tuple[int, ...] = SWEEP,
) -> None:  # fmt: skip
    """The section (module docstring); ``report`` is ``bench.compare``'s :class:`Report`."""
    url = server.url.render_as_string(hide_password=False)
    for level in sweep:
        for p in (1, 2):
            cli("queue", "create", "bench", f"sweep-{level}-{p}", url=url)
    best: dict[str, float] = {"orbit": 0.0, "peer": 0.0}
    for index, level in enumerate(sweep):
        load = os.getloadavg()[0]
        peer_first = peer is not None and index % 2 == 1
        peer_rate = peer_ms = None
        if peer_first:
            assert peer is not None
            peer_rate, peer_ms = _peer_drain(peer, n, level)
        orbit = _orbit_drain(server, base, keys, n, level, f"sweep-{level}-1", server_pid)
        if peer is not None and not peer_first:
            peer_rate, peer_ms = _peer_drain(peer, n, level)
        load_after = os.getloadavg()[0]
        best["orbit"] = max(best["orbit"], orbit["rate"])
        note = f"load {load:.1f} → {load_after:.1f}"
        report.add("workers", f"orbit worker, concurrency {level}", orbit["rate"], "tasks/s", note)
        if peer_rate is not None:
            best["peer"] = max(best["peer"], peer_rate)
            report.add("workers", f"peer worker, concurrency {level}", peer_rate, "jobs/s", note)
            report.add("workers", f"orbit / peer, concurrency {level}", orbit["rate"] / peer_rate, "×")
        report.add("workers", f"orbit CPU per task, concurrency {level} (server + worker)",
                   orbit["server_ms"] + orbit["worker_ms"], "ms",
                   f"server {orbit['server_ms']:.2f}, worker {orbit['worker_ms']:.2f}")  # fmt: skip
        if peer_ms is not None:
            report.add(
                "workers", f"peer CPU per job, concurrency {level} (worker + PostgreSQL)", peer_ms, "ms"
            )
        report.add("workers", f"orbit HTTP requests per task, concurrency {level}", orbit["http"], "requests")
        report.add("workers", f"orbit DB round trips per task, concurrency {level}", orbit["trips"], "round trips",
                   "MariaDB's global counters (other clients count too)")  # fmt: skip
    report.add("workers", "orbit worker, best of the sweep", best["orbit"], "tasks/s")
    if peer is not None:
        report.add("workers", "peer worker, best of the sweep", best["peer"], "jobs/s")
        report.add(
            "workers", "orbit best / peer best", best["orbit"] / best["peer"] if best["peer"] else None, "×"
        )
    load = os.getloadavg()[0]
    one = _orbit_drain(server, base, keys, n, concurrency, f"sweep-{concurrency}-2", server_pid)["rate"]
    two = _orbit_drain(server, base, keys, 2 * n, concurrency, f"sweep-{SWEEP[0]}-2", server_pid, processes=2)
    report.add("workers", f"orbit: 1 worker process, concurrency {concurrency}", one, "tasks/s",
               f"load {load:.1f}")  # fmt: skip
    report.add("workers", f"orbit: 2 worker processes, concurrency {concurrency} each", two["rate"], "tasks/s",
               f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    report.add("workers", "orbit: 2 worker processes / 1", two["rate"] / one, "×")
    report.meta["workers_sweep_done_at"] = time.time()
