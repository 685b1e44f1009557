"""What one task costs the server on the worker path: HTTP requests, transactions and SQL statements.

    python -m bench.worker_path [--database sqlite|mariadb] [--tasks 200] [--concurrency 8]
                                [--linger none 0 0.003]

Serves the API in this process (uvicorn in a thread, on a real port) so that the server's
engine can be watched: a ``before_cursor_execute`` listener counts statements and a ``begin``
listener counts transactions. A :class:`orbit_client.Worker` with a no-op handler drains
``--tasks`` tasks through a counting transport, once per ``--linger`` value (the worker's
``report_linger`` in seconds; ``none`` sends every report as its own single call, as before
batching; 0 batches only reports that are waiting anyway). Prints
requests, transactions and statements per task (lease + start + complete), and the
statements per request kind. Counts, not times: they do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import inspect
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import uvicorn
from sqlalchemy import event
from sqlalchemy.engine import Engine

from bench._support import MYSQL_SERVER
from orbit_client import OrbitClient, TaskContext, Worker
from orbit_server import ServerSettings, create_app
from orbit_server.db import migrate
from orbit_server.db.engine import create_engine
from orbit_server.tasks import store

_DONE = sa.text(
    "SELECT COUNT(*) FROM tasks t JOIN queues q ON q.id = t.queue_id WHERE q.name = :q AND t.status = 'SUCCEEDED'"
)


class Counts:
    """Statements and transactions of the server's engine, attributed to the request kind running."""

    def __init__(self, engine: Engine) -> None:
        self.statements: Counter[str] = Counter()
        self.transactions = 0
        self.kind = threading.local()
        event.listen(engine, "before_cursor_execute", self._statement)
        event.listen(engine, "begin", self._begin)

    def _statement(self, *_args: Any) -> None:
        self.statements[getattr(self.kind, "name", "other")] += 1

    def _begin(self, *_args: Any) -> None:
        self.transactions += 1

    def reset(self) -> None:
        self.statements.clear()
        self.transactions = 0


class CountingTransport(httpx.BaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests: Counter[str] = Counter()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        kind = "lease" if path.endswith("/leases") else path.rsplit("/", 1)[-1]
        if "/attempts/" in path and path.split("/attempts/")[1].count("/") == 0:
            kind = f"{kind} (batch)"
        self.requests[kind] += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@contextmanager
def serve(url: str) -> Iterator[tuple[str, Engine]]:
    engine = create_engine(url, pool_size=20)
    migrate.upgrade(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    app = create_app(ServerSettings(database_url=url, sweep_interval_seconds=0), engine=engine)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        engine.dispose()


def run(base: str, engine: Engine, counts: Counts, keys: dict[str, str], tasks: int, concurrency: int,
        linger: float | None) -> dict[str, Any]:  # fmt: skip
    queue = f"q-{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        store.create_queue(conn, "bench", queue)
    with OrbitClient(base, api_key=keys["submit"], timeout=60) as submitter:
        for n in range(tasks):
            submitter.submit_task("bench", queue, "noop", {"n": n}, idempotency_key=f"{queue}-{n}")
    transport = CountingTransport()
    counts.reset()

    def noop(ctx: TaskContext) -> Any:
        return None

    options: dict[str, Any] = {}
    if "report_linger" in inspect.signature(Worker).parameters:
        options["report_linger"] = linger
    with OrbitClient(base, api_key=keys["work"], timeout=60, transport=transport) as client:
        worker = Worker(client, "bench", queue, {"noop": noop}, concurrency=concurrency, poll_wait_seconds=0.2,
                        install_signal_handlers=False, **options)  # fmt: skip
        started = time.perf_counter()
        thread = threading.Thread(target=worker.run)
        thread.start()
        while True:
            with engine.connect() as conn:
                done = conn.execute(_DONE, {"q": queue}).scalar_one()
            if done >= tasks:
                break
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        worker.stop()
        thread.join()
    # The completion poll above runs on the same engine: one statement and one transaction per poll.
    return {"requests": transport.requests, "elapsed": elapsed, "tasks": tasks}


def _linger(value: str) -> float | None:
    return None if value.lower() == "none" else float(value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database", choices=["mariadb", "sqlite"], default="sqlite")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--linger", type=_linger, nargs="*", default=[None, 0.0, 0.003],
                        help="report_linger values to compare, in seconds, or none (ignored by a worker without it)")  # fmt: skip
    args = parser.parse_args()

    admin = None
    if args.database == "mariadb":
        name = f"orbit_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        url = sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(hide_password=False)
    else:
        url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='orbit-bench-')) / 'bench.db'}"
    try:
        with serve(url) as (base, engine):
            with engine.begin() as conn:
                store.create_namespace(conn, "bench")
                keys = {role: store.create_api_key(conn, "bench", role) for role in ("submit", "work")}
            counts = Counts(engine)
            # Statements are attributed by polling thread: the completion poll runs on this thread.
            counts.kind.name = "poll"
            print(f"database={args.database} tasks={args.tasks} concurrency={args.concurrency}")
            print(
                f"{'report_linger':>14}{'requests/task':>15}{'tx/task':>10}{'stmts/task':>12}{'tasks/s':>10}  requests"
            )
            for linger in args.linger:
                out = run(base, engine, counts, keys, args.tasks, args.concurrency, linger)
                polls = counts.statements.pop("poll", 0)
                statements = sum(counts.statements.values())
                transactions = counts.transactions - polls
                n = out["tasks"]
                requests = sum(out["requests"].values())
                print(f"{linger!s:>14}{requests / n:>15.2f}{transactions / n:>10.2f}{statements / n:>12.2f}"
                      f"{n / out['elapsed']:>10.1f}  {dict(out['requests'])}")  # fmt: skip
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
            admin.dispose()


if __name__ == "__main__":
    main()
