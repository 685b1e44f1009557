"""Batch acceptance vs single submissions: statements, round trips and tasks per second.

    python -m bench.batch_accept [--database mariadb|sqlite] [--items 100] [--clients 4] [--tasks 20000]

Two parts, on a fresh database:

1. **Counted, in-process** (one client, one request at a time): ``--items`` single
   submissions, then one batch of ``--items`` new items, then both again as replays. A
   SQLAlchemy ``before_cursor_execute`` listener on the server's engine counts statements;
   commits, rollbacks (pool resets) and connection checkouts (a pre-ping each on MariaDB)
   are counted from engine and pool events. Wall times here include the client in the same
   process: compare them with each other only.
2. **Throughput, real server process** (``orbit-server serve``): ``--clients`` threads
   sending single submissions, then batches of ``--items`` and of 500, ``--tasks`` tasks in
   all per phase; tasks accepted per second.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import uvicorn

from bench._support import cli, migrated_mariadb, orbit_servers
from orbit_server import ServerSettings, create_app
from orbit_server.db.engine import create_engine


@contextmanager
def database(kind: str) -> Iterator[str]:
    """A migrated database with namespace ``bench``, queue ``q``; yields its URL."""
    if kind == "sqlite":
        url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='orbit-bench-')) / 'bench.db'}"
        cli("migrate", url=url)
        yield url
        return
    with migrated_mariadb("orbit_bench") as url:
        yield url


def _item(run: str, n: int) -> dict[str, Any]:
    return {"idempotency_key": f"{run}-{n}", "queue": "q", "handler": "bench.noop", "params": {"n": n}}


def _single(http: httpx.Client, item: dict[str, Any]) -> httpx.Response:
    body = {k: v for k, v in item.items() if k != "idempotency_key"}
    response = http.post(
        "/v1/namespaces/bench/tasks", json=body, headers={"Idempotency-Key": item["idempotency_key"]}
    )
    if response.status_code not in (200, 201):
        raise SystemExit(f"single submission failed: {response.status_code} {response.text[:300]}")
    return response


def _batch(http: httpx.Client, items: list[dict[str, Any]]) -> httpx.Response:
    response = http.post("/v1/namespaces/bench/tasks/batch", json={"items": items})
    if response.status_code != 200 or any(r["status"] not in (200, 201) for r in response.json()["items"]):
        raise SystemExit(f"batch failed: {response.status_code} {response.text[:300]}")
    return response


class Tally:
    """Statements, commits, rollbacks and checkouts seen on one engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.counts: Counter[str] = Counter()
        sa.event.listen(engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine, "commit", lambda _conn: self.counts.update(["COMMIT"]))
        sa.event.listen(engine.pool, "checkout", lambda *_: self.counts.update(["checkout"]))
        sa.event.listen(engine.pool, "reset", lambda *_: self.counts.update(["reset"]))

    def _statement(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.counts.update(["statement", " ".join(statement.split()[:3])])

    @contextmanager
    def measure(self) -> Iterator[dict[str, Any]]:
        before = self.counts.copy()
        found: dict[str, Any] = {}
        started = time.perf_counter()
        yield found
        found["seconds"] = time.perf_counter() - started
        found["counts"] = self.counts - before


def counted(url: str, items: int) -> list[tuple[str, int, dict[str, Any]]]:
    """Part 1: the server in this process, its engine's statements counted."""
    engine = create_engine(url, pool_size=4)
    tally = Tally(engine)
    with engine.begin() as conn:
        from orbit_server.tasks import store

        key = store.create_api_key(conn, "bench", "submit")
    app = create_app(
        ServerSettings(database_url=url, sweep_interval_seconds=0, scheduler_interval_seconds=0),
        engine=engine,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    rows: list[tuple[str, int, dict[str, Any]]] = []
    run = uuid.uuid4().hex[:8]
    singles = [_item(f"s{run}", n) for n in range(items)]
    batch = [_item(f"b{run}", n) for n in range(items)]
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        ) as http:
            _single(http, _item(f"w{run}", 0))  # warm-up: key cache, pool, statement cache
            _batch(http, [_item(f"w{run}", n) for n in range(1, items + 1)])
            for label, call, n in (
                ("single, new", lambda: [_single(http, i) for i in singles], items),
                ("batch, new", lambda: _batch(http, batch), items),
                ("single, replay", lambda: [_single(http, i) for i in singles], items),
                ("batch, replay", lambda: _batch(http, batch), items),
            ):
                with tally.measure() as found:
                    call()
                rows.append((label, n, found))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        engine.dispose()
    return rows


def throughput(url: str, clients: int, tasks: int, sizes: list[int]) -> list[tuple[str, float]]:
    """Part 2: tasks accepted per second by a real server process."""
    key = cli("api-key", "create", "bench", "--role", "submit", url=url)
    rates: list[tuple[str, float]] = []
    with orbit_servers(url) as (base,):
        for size in [1, *sizes]:
            run = uuid.uuid4().hex[:8]
            per_client = tasks // clients // size

            barrier = threading.Barrier(clients + 1)

            def work(
                index: int,
                size: int = size,
                run: str = run,
                per_client: int = per_client,
                barrier: threading.Barrier = barrier,
            ) -> None:
                with httpx.Client(
                    base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120
                ) as http:
                    barrier.wait()
                    for r in range(per_client):
                        first = (index * per_client + r) * size
                        if size == 1:
                            _single(http, _item(run, first))
                        else:
                            _batch(http, [_item(run, first + n) for n in range(size)])

            threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            barrier.wait()
            started = time.perf_counter()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - started
            label = "single submissions" if size == 1 else f"batches of {size}"
            rates.append((label, per_client * clients * size / elapsed))
    return rates


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database", choices=["mariadb", "sqlite"], default="mariadb")
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=20000)
    args = parser.parse_args(argv)
    with database(args.database) as url:
        cli("namespace", "create", "bench", url=url)
        cli("queue", "create", "bench", "q", url=url)
        rows = counted(url, args.items)
        rates = throughput(url, args.clients, args.tasks, [args.items, 500])
    out(f"database={args.database} items={args.items}")
    out(f"{'part 1 (in-process)':<18}{'tasks':>6}{'ms':>9}{'stmts':>7}{'per task':>9}{'commits':>8}"
        f"{'checkouts':>10}{'resets':>7}  statements")  # fmt: skip
    for label, n, found in rows:
        c = found["counts"]
        kinds = ", ".join(
            f"{k} ×{v}" for k, v in sorted(c.items()) if k not in ("statement", "COMMIT", "checkout", "reset")
        )
        out(f"{label:<18}{n:>6}{found['seconds'] * 1000:>9.1f}{c['statement']:>7}{c['statement'] / n:>9.2f}"
            f"{c['COMMIT']:>8}{c['checkout']:>10}{c['reset']:>7}  {kinds}")  # fmt: skip
    out(f"part 2 (server process, {args.clients} clients)")
    for label, rate in rates:
        out(f"  {label:<22}{rate:>10.0f} tasks/s  ({rate / rates[0][1]:.1f}x single)")


if __name__ == "__main__":
    main()
