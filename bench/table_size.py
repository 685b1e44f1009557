"""Is a worker's call flat in the size of the task table? One-item report batches with 1,000 and with
1,000,000 finished tasks kept, in one run.

    python -m bench.table_size [--kept 1000 1000000] [--tasks 300] [--json-file PATH]

For each size, a fresh MariaDB database: ``--kept`` ``SUCCEEDED`` tasks (with their attempts) are
inserted set-based (MariaDB's ``seq`` engine), the tables analysed. Then ``--rounds`` rounds per size,
the sizes alternating (so that they meet the same machine load): ``--tasks`` tasks are submitted and
each is leased, started and completed by one-item batches (``POST .../attempts/start`` and
``.../complete`` with one item: what a ``Worker`` at concurrency 1 sends), one after the other, through a
real ``orbit-server serve`` process. Prints the median and 90th percentile of each call's wall time and
the ratio of the largest table's to the smallest's (the issue's target: ≤ 1.2×). Before the one-tuple
fix (``db/engine.by_primary_key``) a one-item batch read the whole primary key: 438 ms at 21,855 tasks.
Writes its figures, with date, commit and load averages, to ``bench/results/`` unless ``--json-file -``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench._support import MYSQL_SERVER, cli, orbit_server_processes

RESULTS = Path(__file__).resolve().parent / "results"


def _seed(url: str, kept: int) -> None:
    """``kept`` finished tasks of a queue of their own, and one attempt each, inserted set-based, their
    ids from MariaDB's ``UUID()`` (scattered over the key space, as the server's random ids are)."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        ns = conn.execute(sa.text("SELECT id FROM namespaces WHERE name = 'bench'")).scalar_one()
        queue = conn.execute(sa.text("SELECT id FROM queues WHERE name = 'kept'")).scalar_one()
        for done in range(0, kept, 100_000):  # in transactions of 100,000 rows
            conn.execute(
                sa.text(
                    "INSERT INTO tasks (id, namespace_id, queue_id, handler, params, status, state_version, "
                    "attempt_count, max_attempts, retry_safe, available_at, cancel_requested, result, created_at, "
                    "updated_at, finished_at, holds_permit) "
                    "SELECT UUID(), :ns, :queue, 'kept', '{}', 'SUCCEEDED', 4, 1, 3, 0, NOW(6), 0, '1', NOW(6), "
                    f"NOW(6), NOW(6), 0 FROM seq_1_to_{min(100_000, kept - done)}"
                ),
                {"ns": ns, "queue": queue},
            )
            conn.commit()
        conn.execute(
            sa.text(
                "INSERT INTO task_attempts (id, task_id, generation, lease_token_hash, worker_id, status, "
                "lease_seconds, leased_at, lease_expires_at, started_at, finished_at, result) "
                "SELECT UUID(), id, 1, REPEAT('0', 64), 'w', 'SUCCEEDED', 30, NOW(6), NOW(6), NOW(6), NOW(6), '1' "
                "FROM tasks WHERE queue_id = :queue"
            ),
            {"queue": queue},
        )
        conn.commit()
        conn.execute(sa.text("ANALYZE TABLE tasks, task_attempts"))
    engine.dispose()


def _settle(url: str, timeout: float = 120) -> None:
    """Wait (up to ``timeout`` seconds) until InnoDB has flushed what the seed left dirty, so that the
    first measured commits do not compete with that flush."""
    engine = sa.create_engine(url)
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            dirty = conn.execute(sa.text("SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_pages_dirty'")).one()[1]
            if int(dirty) < 100:
                break
            time.sleep(1)
    engine.dispose()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _prepare(admin: sa.Engine, kept: int) -> tuple[str, str, dict[str, str], float]:
    """A new database with ``kept`` finished tasks: (its name, URL, API keys, seconds the seed took)."""
    name = f"orbit_size_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    url = sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(hide_password=False)
    cli("migrate", url=url)
    cli("namespace", "create", "bench", url=url)
    for queue in ("kept", "q"):
        cli("queue", "create", "bench", queue, url=url)
    keys = {role: cli("api-key", "create", "bench", "--role", role, url=url) for role in ("submit", "work")}
    began = time.perf_counter()
    _seed(url, kept)
    return name, url, keys, time.perf_counter() - began


def _round(url: str, keys: dict[str, str], tasks: int, round_: int, times: dict[str, list[float]]) -> None:
    """``tasks`` new tasks, each leased, started and completed one after the other (one-item batches)."""
    with orbit_server_processes(url) as (server,):
        submit = httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {keys['submit']}"})
        work = httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {keys['work']}"})
        items = [{"queue": "q", "handler": "h", "idempotency_key": f"r{round_}-{i}"} for i in range(tasks)]
        for i in range(0, tasks, 100):
            submit.post(
                "/v1/namespaces/bench/tasks/batch", json={"items": items[i : i + 100]}
            ).raise_for_status()
        for _ in range(tasks):
            began = time.perf_counter()
            r = work.post("/v1/namespaces/bench/queues/q/leases",
                          json={"worker_id": "w", "max_tasks": 1, "lease_seconds": 30})  # fmt: skip
            r.raise_for_status()
            times["lease"].append(time.perf_counter() - began)
            attempt = r.json()[0]["attempt"]
            item = {"attempt_id": attempt["id"], "lease_token": attempt["lease_token"]}
            for action, body in (("start", item), ("complete", {**item, "result": 1})):
                began = time.perf_counter()
                r = work.post(f"/v1/namespaces/bench/attempts/{action}", json={"items": [body]})
                r.raise_for_status()
                assert r.json()["items"][0]["status"] == 200, r.text
                times[action].append(time.perf_counter() - began)
        submit.close()
        work.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kept", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--tasks", type=int, default=200, help="tasks per round (default 200)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per size, alternating (default 4)")
    parser.add_argument(
        "--json-file", help="default bench/results/table-size-<UTC time>-<commit>.json; '-': none"
    )
    args = parser.parse_args()
    commit = (
        subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        or "unknown"
    )
    started = datetime.now(UTC)
    meta = {
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "started_at": started.isoformat(timespec="seconds"),
        "commit": commit, "command": "python -m bench.table_size " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "loadavg_at_start": os.getloadavg(), "tasks": args.tasks, "rounds": args.rounds,
        "settings": {"orbit server": "orbit-server serve defaults, MariaDB on this machine (its buffer pool as configured)"},
    }  # fmt: skip
    admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
    prepared: list[tuple[str, str, dict[str, str], float]] = []
    rows: list[dict[str, Any]] = []
    try:
        for kept in args.kept:
            prepared.append(_prepare(admin, kept))
        _settle(prepared[0][1])
        samples: list[dict[str, list[float]]] = [
            {"lease": [], "start": [], "complete": []} for _ in args.kept
        ]
        for round_ in range(args.rounds):  # the sizes' rounds alternate, so that they meet the same load
            order = range(len(args.kept)) if round_ % 2 == 0 else reversed(range(len(args.kept)))
            for index in order:
                _name, url, keys, _seconds = prepared[index]
                _round(url, keys, args.tasks, round_, samples[index])
        for kept, (_name, _url, _keys, seconds), times in zip(args.kept, prepared, samples, strict=True):
            rows.append({
                "kept": kept, "seed_seconds": round(seconds, 1),
                **{f"{call} median ms": statistics.median(v) * 1000 for call, v in times.items()},
                **{f"{call} p90 ms": _percentile(v, 0.9) * 1000 for call, v in times.items()},
            })  # fmt: skip
    finally:
        with admin.connect() as conn:
            for name, *_ in prepared:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()
    meta["loadavg_at_end"] = os.getloadavg()
    first, last = rows[0], rows[-1]
    ratios = {
        call: last[f"{call} median ms"] / first[f"{call} median ms"]
        for call in ("lease", "start", "complete")
    }
    print(f"{'kept':>10} {'lease ms':>10} {'start ms':>10} {'complete ms':>12}   (median / p90)")
    for row in rows:
        print(f"{row['kept']:>10,} " + " ".join(
            f"{row[f'{c} median ms']:>6.1f}/{row[f'{c} p90 ms']:<5.1f}" for c in ("lease", "start", "complete")))  # fmt: skip
    print(f"{last['kept']:,} / {first['kept']:,} kept (median): " + ", ".join(f"{c} {r:.2f}×" for c, r in ratios.items())
          + "  (target ≤ 1.2×)")  # fmt: skip
    figures = [
        {"section": "table size", "name": f"{call} (one-item batch), {row['kept']:,} finished tasks kept",
         "value": row[f"{call} median ms"], "unit": "ms", "note": f"median; p90 {row[f'{call} p90 ms']:.1f} ms",
         "base": None, "ratio": None, "target": None, "passed": None}
        for row in rows
        for call in ("lease", "start", "complete")
    ]  # fmt: skip
    for call, ratio in ratios.items():
        figures.append({
            "section": "table size", "name": f"{call}: {last['kept']:,} kept / {first['kept']:,} kept", "value": ratio,
            "unit": "×", "note": "medians", "base": None, "ratio": None, "target": "≤ 1.2×", "passed": ratio <= 1.2,
        })  # fmt: skip
    document = {"figures": figures, "rows": rows, "ratios": ratios, "meta": meta}
    stamp = meta["started_at"][:16].replace(":", "")
    json_file = args.json_file or str(RESULTS / f"table-{stamp}-{commit[:7]}.json")
    if json_file != "-":
        Path(json_file).parent.mkdir(parents=True, exist_ok=True)
        Path(json_file).write_text(json.dumps(document, indent=2) + "\n")
        print(f"figures written to {json_file}")


if __name__ == "__main__":
    main()
