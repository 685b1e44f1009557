"""The whole of Orbit on realistic input, with real crashes: ``make demo``.

    python -m examples.order_service.demo [--orders N] [--json] [--flow]
        [--database-url URL --orbit-database-url URL] [--trace-file traces.jsonl]

Starts the Orbit server, the order API, an outbox relay, a worker and a result
consumer as real processes (by default on SQLite files under ``.demo/``); places the
orders of ``data/orders.csv`` through the order API (a few of them sent twice, as a
client retry would); SIGKILLs the relay once while it has a batch in hand (after a
send, before recording it) and the worker once in the middle of a step (after the
payment provider charged, before the journal recorded it), and restarts both; waits
until every order is terminal; checks the invariants and prints a summary.

Exit status 0 only when every order is terminal, no order got two tasks, and each
provider acted at most once per order (charge exactly once per completed order).

With ``--flow`` each order is fulfilled as an instance of the ``order-fulfilment`` flow
(:mod:`.flow`, README "The order service as a flow"): the demo publishes the graph, the API
enqueues flow starts, the same crashes are injected (the relay between a flow start and its
record, the worker in the middle of the charge step), a few customers send ``cancel`` right
after ordering, and the invariants become: one instance per order, one task per step, the
order's status the instance's, each provider at most once per order, no charge for a
cancelled order.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import sqlalchemy as sa
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from examples._ports import free_port
from orbit_client import OrbitClient

from . import flow as fulfilment_flow
from .db import business_engine, business_orders, create_business_tables, provider_tally
from .demo_flow import Canceller, check_flow, describe_failures, failed_invariants, show_flow, summarise_flow
from .tracing import TRACE_FILE_ENV, load_spans, order_trace, render_tree

ORDERS_CSV = Path(__file__).parent / "data" / "orders.csv"
WORK_DIR = Path(".demo") / "order_service"
NAMESPACE, QUEUE, SUBSCRIPTION = "shop", "fulfilment", "order-results"
TERMINAL = ("COMPLETED", "FAILED", "NEEDS_REVIEW", "CANCELLED")
console = Console(stderr=True)


METRICS_AT = re.compile(rb"metrics at (http://\S+/metrics)")


def wait_for_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers (a process has no start-up signal to await)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode} during start-up; see {WORK_DIR}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.1)


@dataclass
class Process:
    """A child process whose stderr is copied to a log file and watched for one marker line."""

    name: str
    argv: list[str]
    env: dict[str, str]
    marker: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    seen: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0
    #: Where the process serves its metrics, from its "metrics at URL" log line (it binds a free
    #: port of its own, ``--metrics-port 0``: a port chosen here could be taken before it starts).
    metrics_url: str | None = None
    serving: threading.Event = field(default_factory=threading.Event)

    def start(self, *, fault: dict[str, str] | None = None) -> None:
        log: IO[bytes] = (WORK_DIR / f"{self.name}.log").open("ab")
        self.seen.clear()
        self.proc = subprocess.Popen(
            self.argv, env={**os.environ, **self.env, **(fault or {})}, stdout=log, stderr=subprocess.PIPE
        )
        threading.Thread(target=self._pump, args=(self.proc, log), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.write(line)
            log.flush()
            if self.marker and self.marker.encode() in line:
                self.seen.set()
            found = METRICS_AT.search(line)
            if found:
                self.metrics_url = found.group(1).decode()
                self.serving.set()
        log.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_cli(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True)
    if done.returncode != 0 and "already exists" not in done.stderr:
        raise SystemExit(f"{' '.join(argv[:3])} failed: {done.stderr.strip()}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def check_database(url: str, what: str, flag: str) -> None:
    """Connect once; on failure exit with one line that says what to do (not a 140-line traceback)."""
    try:
        parsed = sa.make_url(url)
        engine = sa.create_engine(parsed)
    except (sa.exc.ArgumentError, ModuleNotFoundError) as exc:
        raise SystemExit(
            f"error: {flag} {url!r} is not a usable SQLAlchemy URL ({exc}); see --help"
        ) from None
    shown = parsed.render_as_string(hide_password=True)
    try:
        with engine.connect():
            pass
    except sa.exc.DBAPIError as exc:
        hint = (
            f"create it first (e.g. CREATE DATABASE {parsed.database}) or pass {flag} with one that exists"
            if parsed.database and ("nknown database" in str(exc.orig) or "does not exist" in str(exc.orig))
            else f"check that the server runs and the URL, or pass another {flag}"
        )
        raise SystemExit(f"error: cannot use the {what} at {shown}: {exc.orig}; {hint}") from None
    finally:
        engine.dispose()


def load_orders(limit: int | None) -> list[dict[str, str]]:
    with ORDERS_CSV.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows[:limit] if limit else rows


@contextmanager
def stopping(processes: list[Process]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in reversed(processes):
            p.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--orders", type=int, default=None, help="place only the first N orders of the CSV")
    parser.add_argument("--json", action="store_true", help="print only the summary, as JSON")
    parser.add_argument("--database-url", help="business database (default: SQLite under .demo/)")
    parser.add_argument("--orbit-database-url", help="Orbit server database (default: SQLite under .demo/)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every order")
    parser.add_argument(
        "--trace-file",
        type=Path,
        help="record every process's OpenTelemetry spans into this JSON-lines file (needs opentelemetry-sdk) "
        'and print one order\'s trace as a tree at the end (README "Tracing")',
    )
    parser.add_argument(
        "--kill-server",
        action="store_true",
        help="also SIGKILL the Orbit server mid-way (1 s after the last order, or a third terminal) and restart it",
    )
    parser.add_argument(
        "--flow",
        action="store_true",
        help='fulfil each order as an instance of the order-fulfilment flow (README "The order service as a flow")',
    )
    args = parser.parse_args(argv)
    if args.json:
        console.quiet = True

    shutil.rmtree(WORK_DIR, ignore_errors=True)
    WORK_DIR.mkdir(parents=True)
    business_url = args.database_url or f"sqlite:///{WORK_DIR / 'business.db'}"
    orbit_db_url = args.orbit_database_url or f"sqlite:///{WORK_DIR / 'orbit.db'}"
    for url, what, flag in ((business_url, "business database", "--database-url"),
                            (orbit_db_url, "Orbit server database", "--orbit-database-url")):  # fmt: skip
        if not url.startswith("sqlite"):
            check_database(url, what, flag)
    orders = load_orders(args.orders)
    started = time.monotonic()
    traced: dict[str, str] = {}
    if args.trace_file is not None:
        try:
            import opentelemetry.sdk.trace  # noqa: F401
        except ImportError:
            raise SystemExit(
                "error: --trace-file needs opentelemetry-sdk: pip install opentelemetry-sdk"
            ) from None
        args.trace_file = args.trace_file.resolve()
        args.trace_file.unlink(missing_ok=True)
        # With the spans, JSON logs (the trace_id and span_id of each line's trace) from every process.
        traced = {
            TRACE_FILE_ENV: str(args.trace_file),
            "ORBIT_LOG_FORMAT": "json",
            "ORBIT_OUTBOX_LOG_FORMAT": "json",
        }

    console.rule("Set up Orbit and the business database")
    run_cli("orbit_server", "migrate", "--database-url", orbit_db_url)
    run_cli("orbit_server", "namespace", "create", NAMESPACE, "--database-url", orbit_db_url)
    run_cli("orbit_server", "queue", "create", NAMESPACE, QUEUE, "--database-url", orbit_db_url)
    keys = {
        role: run_cli(
            "orbit_server", "api-key", "create", NAMESPACE, "--role", role, "--database-url", orbit_db_url
        )
        for role in ("submit", "work", "admin")
    }
    engine = business_engine(business_url)
    create_business_tables(engine)
    run_cli("outbox_adapter.cli", "migrate", "--database-url", business_url)

    orbit_port = free_port()
    orbit_url = f"http://127.0.0.1:{orbit_port}"
    py = sys.executable
    server = Process("orbit-server", [py, "-m", "orbit_server", "--log-level", "warning", "serve",
                                      "--database-url", orbit_db_url, "--port", str(orbit_port)],
                     {"ORBIT_SWEEP_INTERVAL_SECONDS": "0.5"})  # fmt: skip
    api = Process("order-api", [py, "-m", "examples.order_service.api", "--database-url", business_url,
                                "--port", "PORT"], {"ORDER_FULFILMENT": "flow" if args.flow else "task"})  # fmt: skip
    relay = Process("relay", [py, "-m", "outbox_adapter.cli", "relay", "--batch-size", "20", "--concurrency", "4",
                              "--lease-seconds", "5", "--poll-interval", "0.2",
                              "--metrics-port", "0", "--metrics-sample-interval", "1"],
                    {"ORBIT_OUTBOX_DATABASE_URL": business_url, "ORBIT_URL": orbit_url,
                     "ORBIT_API_KEY": keys["submit"]}, marker="paused-after-send")  # fmt: skip
    worker = Process("worker", [py, "-m", "examples.order_service.worker", "--concurrency", "4",
                                "--lease-seconds", "3", "--metrics-port", "0"],
                     {"ORDER_DATABASE_URL": business_url, "ORBIT_URL": orbit_url, "ORBIT_API_KEY": keys["work"]},
                     marker="paused-after-charge")  # fmt: skip
    consumer = Process(
        "consumer",
        [py, "-m", "outbox_adapter.cli", "consume", "--namespace", NAMESPACE, "--subscription", SUBSCRIPTION,
         "--handler", "examples.order_service.consumer:apply_result", "--lease-seconds", "10",
         "--poll-interval", "0.2", "--metrics-port", "0"],
        {"ORBIT_OUTBOX_DATABASE_URL": business_url, "ORBIT_URL": orbit_url, "ORBIT_API_KEY": keys["work"]},
    )  # fmt: skip
    processes = [server, api, relay, worker, consumer]
    if (
        traced
    ):  # each process records its spans (python -m examples.order_service.tracing run NAME MODULE ...)
        for p in processes:
            module = p.argv[2]
            p.argv[1:3] = ["-m", "examples.order_service.tracing", "run", p.name, module]
            p.env.update(traced)
    faults = 0
    with stopping(processes), ExitStack():
        console.rule(f"Start the processes (Orbit at {orbit_url})")
        server.start()
        wait_for_http(f"{orbit_url}/readyz", server.proc)  # type: ignore[arg-type]
        with OrbitClient(orbit_url, api_key=keys["admin"]) as admin:
            admin.create_subscription(NAMESPACE, SUBSCRIPTION, queues=[QUEUE])
            if args.flow:
                version = fulfilment_flow.publish(admin)
                console.log(f"Published flow {fulfilment_flow.FLOW_NAME!r} version {version.version}")
        # A port chosen now, not with the server's: under load another process may bind a free port
        # in the seconds the server takes to be ready.
        api_port = free_port()
        api.argv[api.argv.index("--port") + 1] = str(api_port)
        api_url = f"http://127.0.0.1:{api_port}"
        api.start()
        wait_for_http(f"{api_url}/docs", api.proc)  # type: ignore[arg-type]
        relay.start(fault={"ORBIT_OUTBOX_FAULT": "pause-after-send"})
        worker.start(fault={"ORDER_SERVICE_FAULT": "hang-after-charge"})
        consumer.start()
        # Each long-running process serves Prometheus metrics on a port of its own (README "Operations"),
        # a free one it binds itself and logs; a restarted process logs its new one.
        serving = [relay, worker, consumer]
        for p in serving:
            deadline = time.monotonic() + 60
            while not p.serving.wait(0.2):
                assert p.proc is not None
                if p.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{p.name} did not serve its metrics; see {WORK_DIR / p.name}.log")

        def endpoints() -> dict[str, str]:
            return {"server": f"{orbit_url}/metrics"} | {p.name: p.metrics_url or "" for p in serving}

        console.log("Prometheus metrics: " + ", ".join(f"{name} {url}" for name, url in endpoints().items()))
        scraped: dict[str, dict[str, Any]] = {}

        console.rule(f"Place {len(orders)} orders through the order API")
        placed: dict[str, str] = {}
        # With --flow, the customers of orders ending in 3 change their mind at once: a cancel signal right
        # after the order, honoured while the flow waits before the charge.
        canceller = Canceller(orbit_url, keys["submit"]) if args.flow else None

        def place(row: dict[str, str]) -> None:
            body = {"sku": row["sku"], "quantity": int(row["quantity"]), "amount": row["amount"],
                    "customer": row["customer"]}  # fmt: skip
            with httpx.Client(base_url=api_url, timeout=30) as http:
                sends = 2 if row["order_ref"].endswith("7") else 1  # a client retry of the same request
                for _ in range(sends):
                    response = http.post("/orders", json=body, headers={"Idempotency-Key": row["order_ref"]})
                    response.raise_for_status()
                placed[row["order_ref"]] = response.json()["order_id"]
            if canceller is not None and row["order_ref"].endswith("3"):
                canceller.request(placed[row["order_ref"]])

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(place, orders))

        order_ids = list(placed.values())
        cancels = canceller.requested if canceller is not None else []
        placed_at = time.monotonic()
        relay_killed = worker_killed = False
        server_killed = not args.kill_server
        deadline = time.monotonic() + args.timeout
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())  # fmt: skip
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("orders terminal", total=len(order_ids))
            while True:
                if not relay_killed and relay.seen.is_set():
                    relay.kill()
                    relay.start()
                    relay_killed, faults = True, faults + 1
                    progress.console.log("SIGKILLed the relay between a send and its record; restarted it")
                if not worker_killed and worker.seen.is_set():
                    worker.kill()
                    worker.start()
                    worker_killed, faults = True, faults + 1
                    progress.console.log(
                        "SIGKILLed the worker in the middle of the charge step; restarted it"
                    )
                with engine.connect() as conn:
                    done = conn.scalar(
                        sa.select(sa.func.count()).select_from(business_orders).where(
                            business_orders.c.order_id.in_(order_ids), business_orders.c.status.in_(TERMINAL)
                        )
                    )  # fmt: skip
                progress.update(bar, completed=done)
                scrape(endpoints(), scraped)
                if done == len(order_ids):
                    break
                # A second after the last order was placed (or a third of them terminal, if sooner): every order
                # is still in flight then; a count of terminal orders alone can jump past any threshold at once.
                if not server_killed and (done >= len(order_ids) // 3 or time.monotonic() - placed_at >= 1.0):
                    server.kill()  # mid-way: tasks leased, results unapplied, timers pending, signals waiting
                    server.start()
                    wait_for_http(f"{orbit_url}/readyz", server.proc)  # type: ignore[arg-type]
                    server_killed, faults = True, faults + 1
                    progress.console.log(
                        f"SIGKILLed the Orbit server with {done} of {len(order_ids)} orders terminal; restarted it"
                    )
                for p in processes:
                    if (
                        p.proc is not None
                        and p.proc.poll() is not None
                        and p.proc.returncode != -signal.SIGKILL
                    ):
                        raise SystemExit(
                            f"{p.name} exited with {p.proc.returncode}; see {WORK_DIR / p.name}.log"
                        )
                if time.monotonic() > deadline:
                    break
                time.sleep(0.25)

        scrape(endpoints(), scraped, final=True)
        if args.flow:
            summary = summarise_flow(
                engine, orbit_url, keys["admin"], order_ids, cancels, faults, time.monotonic() - started
            )
        else:
            summary = summarise(
                engine, orbit_url, keys["admin"], order_ids, faults, time.monotonic() - started
            )
        summary["metrics"] = scraped
    engine.dispose()
    ok = check_flow(summary) if args.flow else check(summary)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif args.flow:
        show_flow(summary, ok)
    else:
        show(summary, ok)
        if args.trace_file is not None and args.trace_file.exists():
            spans = load_spans(args.trace_file)
            try:
                Console().print(render_tree(spans, order_trace(spans, None)), highlight=False)
            except SystemExit as exc:
                console.print(f"no complete order trace in {args.trace_file}: {exc}")
            console.print(
                f"{len(spans)} spans in {args.trace_file}; one order's trace: "
                f"python -m examples.order_service.tracing tree {args.trace_file} --order ORDER_ID"
            )
    return 0 if ok else 1


#: One metric each process must export for its scrape to count (README "Operations").
EXPECTED_METRIC = {
    "server": "orbit_tasks",
    "relay": "orbit_relay_rows_delivered_total",
    "worker": "orbit_worker_tasks_succeeded_total",
    "consumer": "orbit_consumer_events_applied_total",
}


def scrape(endpoints: dict[str, str], scraped: dict[str, dict[str, Any]], *, final: bool = False) -> None:
    """Read each process's /metrics while the demo runs (once each, and once more with ``final``):
    whether it answered with its expected metric, and that metric's total (summed over labels)."""
    for name, url in endpoints.items():
        if name in scraped and not final:
            continue
        try:
            text = httpx.get(url, timeout=2).text
        except httpx.TransportError:
            continue  # not up yet, or just restarted after its SIGKILL
        wanted = EXPECTED_METRIC[name]
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith((wanted + " ", wanted + "{"))]  # fmt: skip
        family = wanted.removesuffix("_total")
        if f"# TYPE {family} " in text or f"# TYPE {wanted} " in text:  # even before its first sample
            scraped[name] = {"url": url, "answered": True, wanted: sum(values)}


def summarise(
    engine: sa.Engine, orbit_url: str, api_key: str, order_ids: list[str], faults: int, elapsed: float
) -> dict[str, Any]:
    with engine.connect() as conn:
        statuses = Counter(
            dict(
                conn.execute(
                    sa.select(business_orders.c.status, sa.func.count())
                    .where(business_orders.c.order_id.in_(order_ids))
                    .group_by(business_orders.c.status)
                ).all()
            )
        )
        effects, requests = provider_tally(conn, order_ids)
        status_of = dict(
            conn.execute(
                sa.select(business_orders.c.order_id, business_orders.c.status).where(
                    business_orders.c.order_id.in_(order_ids)
                )
            ).all()
        )
        completed_ids = {o for o, status in status_of.items() if status == "COMPLETED"}
    wanted = set(order_ids)
    tasks_per_order: Counter[str] = Counter()
    with OrbitClient(orbit_url, api_key=api_key) as client:
        cursor = None
        while True:
            page = client.list_tasks(NAMESPACE, queue=QUEUE, limit=500, cursor=cursor)
            for task in page.items:
                order_id = task.params.get("order_id") if isinstance(task.params, dict) else None
                if order_id in wanted:
                    tasks_per_order[order_id] += 1
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    per_provider: Counter[str] = Counter()
    most_per_order: Counter[str] = Counter()
    charged: set[str] = set()
    twice: set[str] = set()
    for provider, order_id, n in effects:
        per_provider[provider] += n
        most_per_order[provider] = max(most_per_order[provider], n)
        if provider == "charge":
            charged.add(order_id)
        if n > 1:
            twice.add(order_id)
    broken = {
        "every order is terminal": {o for o, status in status_of.items() if status == "PENDING"},
        "one task per order": {o for o, n in tasks_per_order.items() if n > 1},
        "every order has a task": wanted - set(tasks_per_order),
        "each provider acted at most once per order": twice,
        "every completed order was charged": completed_ids - charged,
    }
    return {
        "orders_total": len(order_ids),
        "orders_completed": statuses.get("COMPLETED", 0),
        "orders_failed": statuses.get("FAILED", 0),
        "orders_needs_review": statuses.get("NEEDS_REVIEW", 0),
        "orders_pending": statuses.get("PENDING", 0),
        "tasks_created": sum(tasks_per_order.values()),
        "duplicate_tasks": sum(n - 1 for n in tasks_per_order.values() if n > 1),
        "orders_without_task": len(wanted - set(tasks_per_order)),
        "provider_calls": {p: per_provider.get(p, 0) for p in ("reserve", "charge", "receipt")},
        "provider_max_per_order": {p: most_per_order.get(p, 0) for p in ("reserve", "charge", "receipt")},
        "provider_requests": dict(requests),
        "completed_orders_charged_once": completed_ids <= charged,
        "failed_invariants": failed_invariants(broken),
        "faults_injected": faults,
        "elapsed_s": round(elapsed, 1),
    }


def check(s: dict[str, Any]) -> bool:
    return not s["failed_invariants"]


def show(s: dict[str, Any], ok: bool) -> None:
    out = Console()
    table = Table("measure", "value", title="Order service demo")
    for key in ("orders_total", "orders_completed", "orders_failed", "orders_needs_review", "orders_pending",
                "tasks_created", "duplicate_tasks", "faults_injected", "elapsed_s"):  # fmt: skip
        table.add_row(key, str(s[key]))
    for provider, n in s["provider_calls"].items():
        table.add_row(
            f"provider effects: {provider}", f"{n} (at most {s['provider_max_per_order'][provider]}/order)"
        )
    table.add_row(
        "provider requests", ", ".join(f"{k} {v}" for k, v in sorted(s["provider_requests"].items()))
    )
    out.print(table)
    if ok:
        out.print(
            "[green]Every order is terminal; one task per order; no provider acted twice for an order.[/green]"
        )
    else:
        out.print(
            "[red]These invariants did not hold (see the logs under .demo/order_service/):[/red]\n"
            + describe_failures(s["failed_invariants"]),
            highlight=False,
        )


if __name__ == "__main__":
    sys.exit(main())
