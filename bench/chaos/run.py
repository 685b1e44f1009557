"""The chaos run: the order service at scale, with processes and databases crashed for real.

See :mod:`bench.chaos` for what it does and ``docs/explanation/fault-suite.md`` for the figures. Its
command line is :mod:`bench.chaos.__main__`; its table, evidence and results file :mod:`bench.chaos.summary`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from rich.console import Console

from bench.cluster.galera import GaleraCluster
from examples.order_service.db import business_orders, create_business_tables
from orbit_client import OrbitClient
from orbit_server.db import migrate as server_migrate
from orbit_server.tasks import store
from outbox_adapter import Outbox, OutboxTables

from .checks import Placed, Report, check
from .consumer import CONFIRM_QUEUE, chaos_metadata
from .galera import NODE_FAULTS, ClusterDatabases, cluster_schedule
from .mariadb import MariaDB, free_port
from .postgres import PostgreSQL
from .procs import Service

__all__ = ["Chaos", "Options", "run"]

NAMESPACE, QUEUE, SUBSCRIPTION = "shop", "fulfilment", "order-results"
console = Console(stderr=True)

#: Fault kinds. The hooked ones pause a process at a precise point (announced on stderr), then it is
#: SIGKILLed there; the others SIGKILL at whatever moment the schedule reaches them.
HOOKED = {
    "relay_between_send_and_record": ("relay", "paused-after-send"),
    "worker_between_provider_call_and_journal": ("worker", "paused-after-charge"),
    "consumer_between_commit_and_ack": ("consumer", "paused-after-commit"),
    "server_mid_transaction": ("server", "paused-before-commit"),
}
KILLS = {f"{kind}_killed": kind for kind in ("api", "relay", "server", "worker", "consumer")}
CUTS = {"business_db_connections_cut": "business", "orbit_db_connections_cut": "orbit"}
CRASHES = {"business_db_crashed": "business", "orbit_db_crashed": "orbit"}
KINDS = [*HOOKED, *KILLS, *CUTS, *CRASHES]
#: A run in which no order became terminal for this long is stuck: the faults stop and the checks say why.
STALL_SECONDS = 300
#: The faults are paced over this share of the orders; the rest is the traffic that retries of a hooked
#: fault not reached at first need (faults armed after the last order were never reached).
FAULT_SHARE = 0.8
#: This share of the orders is held back while faults are left to inject, and let out a few at a time
#: whenever a hooked fault was not reached: a fast run cannot finish every order before a hooked
#: fault's point (a charge, a send, a commit) came round again.
RESERVE_SHARE = 0.15
#: While a hooked fault is armed and not reached, a few orders of the reserve are let out this often.
RELEASE_EVERY_SECONDS = 5.0


def schedule(rng: random.Random, faults: int, crashes_per_db: int) -> list[str]:
    """``faults`` fault kinds in a seeded random order: ``crashes_per_db`` crashes of each database,
    the rest spread evenly over the other kinds."""
    crashes = min(crashes_per_db, faults // 2)
    plan = ["business_db_crashed", "orbit_db_crashed"] * crashes
    others = [k for k in KINDS if k not in CRASHES]
    plan += [others[i % len(others)] for i in range(faults - len(plan))]
    rng.shuffle(plan)
    return plan


@dataclass
class Options:
    orders: int
    faults: int
    seed: int
    crashes_per_db: int
    relays: int
    workers: int
    servers: int
    no_skip_locked: bool
    drain_timeout: float
    keep: bool
    root: Path
    #: ``"galera"``: both databases on one 3-node Galera cluster (:mod:`bench.chaos.galera`).
    cluster: str | None = None
    #: With ``cluster``: the node fault kinds to draw from (empty: all of ``NODE_FAULTS``).
    node_kinds: tuple[str, ...] = ()
    #: The Orbit server's database: ``"mariadb"`` or ``"postgres"`` (a private PostgreSQL,
    #: :mod:`bench.chaos.postgres`); the business database stays a private MariaDB.
    server_db: str = "mariadb"


@dataclass
class Stats:
    faults: Counter[str] = field(default_factory=Counter)
    missed: Counter[str] = field(default_factory=Counter)
    #: Seconds spent in each kind of fault (arming, waiting for the point, kill, restart).
    seconds: Counter[str] = field(default_factory=Counter)
    #: Seconds the fault loop waited for the orders to catch up.
    waited: float = 0.0
    placed: int = 0
    #: Orders terminal in the business database (COMPLETED, FAILED or NEEDS_REVIEW), polled.
    terminal: int = 0
    #: When :attr:`terminal` last grew (time.monotonic()).
    progressed_at: float = field(default_factory=time.monotonic)
    faults_done: int = 0
    placement_done: bool = False
    last_fault_at: float = 0.0
    #: Orders that may be placed so far (all of them once the faults are done; see RESERVE_SHARE).
    released: int = 0


class Placer:
    """The order API's clients: place every order, retrying (same Idempotency-Key) until the API answers.

    A few requests are meant to be refused: an acknowledged key sent again with another amount
    (422), and an order with quantity 0 (422). What was refused must not exist afterwards.
    """

    def __init__(self, api_url: str, opts: Options, stats: Stats, may_place: Callable[[int], bool]) -> None:
        self.api_url = api_url
        self.opts = opts
        self.stats = stats
        self.may_place = may_place
        self.placed = Placed()
        self._lock = threading.Lock()
        self._local = threading.local()
        #: Every placing thread's client, closed when placement ends (not left to the garbage
        #: collector, whose ResourceWarning would surface in whatever test runs next).
        self._clients: list[httpx.Client] = []
        #: Set when the run is abandoned: every placing thread stops at once.
        self.abandoned = threading.Event()
        self.unanswered: list[str] = []
        #: Seconds from the first send of an order to its acknowledgement (retries included).
        self.latencies: list[float] = []

    def body(self, j: int) -> dict[str, Any]:
        rng = random.Random(self.opts.seed * 1_000_003 + j)
        # About 1 in 10 is above the card limit: the payment provider declines it, the order FAILS.
        amount = rng.uniform(520, 900) if rng.random() < 0.1 else rng.uniform(1, 480)
        return {"sku": f"SKU-{rng.randrange(1, 200):04d}", "quantity": rng.randrange(1, 5), "amount": f"{amount:.2f}",
                "customer": f"customer-{rng.randrange(1, 5000)}"}  # fmt: skip

    def _post(self, http: httpx.Client, key: str, body: dict[str, Any]) -> httpx.Response | None:
        deadline = time.monotonic() + 600
        delay = 0.05
        while time.monotonic() < deadline and not self.abandoned.is_set():
            try:
                response = http.post("/orders", json=body, headers={"Idempotency-Key": key})
                if response.status_code < 500:
                    return response
            except httpx.TransportError:
                pass
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        return None

    def place(self, j: int) -> None:
        while not self.may_place(j):
            if self.abandoned.wait(0.05):
                return
        key = f"chaos-{self.opts.seed}-{j}"
        body = self.body(j)
        http = getattr(self._local, "http", None)
        if http is None:  # one client per placing thread (building one costs an SSL context)
            http = self._local.http = httpx.Client(base_url=self.api_url, timeout=10)
            with self._lock:
                self._clients.append(http)
        began = time.monotonic()
        response = self._post(http, key, body)
        self.latencies.append(time.monotonic() - began)
        if response is None:
            with self._lock:
                self.unanswered.append(key)
            return
        if response.status_code in (200, 201):
            with self._lock:
                self.placed.acknowledged[key] = (response.json()["order_id"], body)
        else:
            with self._lock:
                self.placed.refused.append((key, body, False))
        if j % 97 == 13 and response.status_code in (200, 201):  # the same key for another order
            other = {**body, "amount": f"{float(body['amount']) + 1:.2f}"}
            again = self._post(http, key, other)
            if again is not None:  # refused (422), or else the checks find the other amount stored
                with self._lock:
                    self.placed.refused.append((key, other, True))
        if j % 89 == 7:  # an order the API must refuse (quantity 0) and never store
            bad_key = f"chaos-{self.opts.seed}-bad-{j}"
            bad = self._post(http, bad_key, {**body, "quantity": 0})
            if bad is not None and bad.status_code == 422:
                with self._lock:
                    self.placed.refused.append((bad_key, {**body, "quantity": 0}, False))
        with self._lock:
            self.stats.placed += 1

    def run(self) -> None:
        began = time.monotonic()
        try:
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(self.place, range(self.opts.orders)))
        finally:
            with self._lock:
                clients, self._clients = self._clients, []
            for client in clients:
                client.close()
        self.stats.placement_done = True
        self.seconds = time.monotonic() - began
        console.log(f"{self.opts.orders} orders placed in {self.seconds:.1f} s")


class Chaos:
    def __init__(self, opts: Options, cluster: GaleraCluster | None = None) -> None:
        self.given_cluster = cluster
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.stats = Stats()
        self.logs = opts.root / "logs"
        self.arms = opts.root / "arms"
        self.logs.mkdir(parents=True)
        self.arms.mkdir()
        self.dbs: dict[str, MariaDB | PostgreSQL] = {}
        self.galera: ClusterDatabases | None = None
        self.proxies: dict[str, Service] = {}
        self.services: list[Service] = []
        self.reconciled = 0

    # --- set-up --------------------------------------------------------------------------------

    def start_databases(self) -> None:
        if self.opts.cluster == "galera":
            self.galera = ClusterDatabases(self.opts.root / "galera", cluster=self.given_cluster)
            self.galera.start()
            self.business_direct = self.galera.direct("shop")
            self.orbit_direct = self.galera.direct("orbit")
            return
        py = sys.executable
        for name in ("business", "orbit"):
            kind = PostgreSQL if name == "orbit" and self.opts.server_db == "postgres" else MariaDB
            self.dbs[name] = kind(name, self.opts.root / f"{name}-db")
        for db in self.dbs.values():
            db.launch()
        for (name, db), database in zip(self.dbs.items(), ("shop", "orbit"), strict=True):
            db.wait_ready(120)
            db.create_database(database)
            port = free_port()
            proxy = self.proxies[name] = Service(
                f"{name}-db-proxy", "proxy", [py, "-m", "bench.chaos.proxy", "--port", str(port), "--target-port",
                                              str(db.port)], {}, self.logs, port=port,
            )  # fmt: skip
            proxy.start()
        for proxy in self.proxies.values():
            _wait_port(proxy.port)
        self.business_direct = sa.create_engine(self.dbs["business"].url("shop"), pool_pre_ping=True)
        self.orbit_direct = sa.create_engine(self.dbs["orbit"].url("orbit"), pool_pre_ping=True)
        self.business_url = self.dbs["business"].url("shop", self.proxies["business"].port)
        self.orbit_db_url = self.dbs["orbit"].url("orbit", self.proxies["orbit"].port)

    def set_up_schemas(self) -> None:
        def orbit() -> None:
            server_migrate.upgrade(self.orbit_direct)
            with self.orbit_direct.begin() as conn:
                store.create_namespace(conn, NAMESPACE)
                for queue in (QUEUE, CONFIRM_QUEUE):
                    store.create_queue(conn, NAMESPACE, queue)
                self.keys = {
                    role: store.create_api_key(conn, NAMESPACE, role) for role in ("submit", "work", "admin")
                }

        def business() -> None:
            create_business_tables(self.business_direct)
            chaos_metadata.create_all(self.business_direct)
            Outbox(self.business_direct).migrate()

        orbit()  # one after the other: Alembic's context is global to the process
        business()

    def orbit_db_url_for(self, i: int) -> str:
        """The Orbit database URL of server ``i`` (on a cluster: node ``i``)."""
        return self.galera.url("orbit", i) if self.galera is not None else self.orbit_db_url

    def business_url_for(self, i: int) -> str:
        """The business database URL of the ``i``-th process of a kind (on a cluster: node ``i``)."""
        return self.galera.url("shop", i) if self.galera is not None else self.business_url

    def settings(self) -> dict[str, Any]:
        if self.galera is not None:
            return self.galera.settings()
        return {name: db.settings() for name, db in self.dbs.items()}

    def start_services(self) -> None:
        py = sys.executable
        locks = {"ORBIT_TEST_CLAIMS_WITHOUT_LOCKS": "1"} if self.opts.no_skip_locked else {}
        self.server_urls = []
        for i in range(self.opts.servers):
            port = free_port()
            arm = self.arms / "server"
            self.services.append(Service(
                f"server-{i}", "server",
                [py, "-m", "orbit_server", "--log-level", "warning", "serve", "--database-url",
                 self.orbit_db_url_for(i), "--port", str(port), "--wait-for-database", "300"],
                {"ORBIT_SWEEP_INTERVAL_SECONDS": "0.5", "ORBIT_SERVER_FAULT": f"pause-before-commit@{arm}", **locks},
                self.logs, marker="paused-before-commit", arm_file=arm,
            ))  # fmt: skip
            self.server_urls.append(f"http://127.0.0.1:{port}")
        servers = list(self.services)
        api_port = free_port()
        self.api_url = f"http://127.0.0.1:{api_port}"
        api = Service("api", "api", [py, "-m", "examples.order_service.api", "--database-url",
                                     self.business_url_for(0), "--port", str(api_port)], {}, self.logs)  # fmt: skip
        self.services.append(api)
        server = self._server_for
        for i in range(self.opts.relays):
            arm = self.arms / "relay"
            self.services.append(Service(
                f"relay-{i}", "relay",
                [py, "-m", "outbox_adapter.cli", "relay", "--batch-size", "50", "--concurrency", "2",
                 "--lease-seconds", "10", "--timeout", "4", "--poll-interval", "0.2", "--max-attempts", "1000",
                 "--backoff-base", "0.2", "--backoff-cap", "5"],
                {"ORBIT_OUTBOX_DATABASE_URL": self.business_url_for(i + 1), "ORBIT_URL": server(i),
                 "ORBIT_API_KEY": self.keys["submit"], "ORBIT_OUTBOX_FAULT": f"pause-after-send@{arm}", **locks},
                self.logs, marker="paused-after-send", arm_file=arm,
            ))  # fmt: skip
        for i in range(self.opts.workers):
            arm = self.arms / "worker"
            self.services.append(Service(
                f"worker-{i}", "worker",
                [py, "-m", "examples.order_service.worker", "--concurrency", "8", "--lease-seconds", "5"],
                {"ORDER_DATABASE_URL": self.business_url_for(i + 2), "ORBIT_URL": server(i + 1),
                 "ORBIT_API_KEY": self.keys["work"],
                 "ORDER_SERVICE_FAULT": f"hang-after-charge@{arm}"},
                self.logs, marker="paused-after-charge", arm_file=arm,
            ))  # fmt: skip
        arm = self.arms / "consumer"
        self.services.append(Service(
            "consumer-0", "consumer",
            [py, "-m", "outbox_adapter.cli", "consume", "--namespace", NAMESPACE, "--subscription", SUBSCRIPTION,
             "--handler", "bench.chaos.consumer:apply_result", "--batch-size", "50", "--lease-seconds", "6",
             "--poll-interval", "0.2"],
            {"ORBIT_OUTBOX_DATABASE_URL": self.business_url_for(2), "ORBIT_URL": server(0),
             "ORBIT_API_KEY": self.keys["work"], "ORBIT_OUTBOX_FAULT": f"pause-after-commit@{arm}"},
            self.logs, marker="paused-after-commit", arm_file=arm,
        ))  # fmt: skip
        for s in self.services:
            if s.kind != "consumer":
                s.start()
        for s, url in zip(servers, self.server_urls, strict=True):
            _wait_http(f"{url}/readyz", s)
        with OrbitClient(self.server_urls[0], api_key=self.keys["admin"]) as admin:
            admin.create_subscription(NAMESPACE, SUBSCRIPTION, queues=[QUEUE])
        for s in self.of_kind("consumer"):
            s.start()
        _wait_http(f"{self.api_url}/docs", api)

    def _server_for(self, i: int) -> str:
        return self.server_urls[i % len(self.server_urls)]

    # --- faults ----------------------------------------------------------------------------------

    def of_kind(self, kind: str) -> list[Service]:
        return [s for s in self.services if s.kind == kind]

    def watch(self) -> None:
        """Restart any process that exited by itself (recorded in its ``self_exits``)."""
        for s in self.services + list(self.proxies.values()):
            if not s.check():
                s.start()

    def release_reserve(self) -> None:
        """Let a few orders of the reserve out (:data:`RESERVE_SHARE`): traffic for a hooked fault's point."""
        self.stats.released = min(self.opts.orders, self.stats.released + max(2, self.opts.orders // 30))

    def in_flight(self) -> bool:
        """Orders are left to place, or placed orders are not terminal yet."""
        s = self.stats
        return s.released < self.opts.orders or not s.placement_done or s.terminal < self.opts.orders

    def hooked(self, kind: str) -> bool:
        """Arm ``kind``'s hook in every process of its kind at once, wait until one of them is paused
        at the point, then SIGKILL it there and start it again; ``True`` when that happened.

        The processes of a kind share one arming file and a hook takes it by removing it (atomic: of
        all the processes, exactly one pauses). The arming stays until the point is reached: while
        nobody reaches it, a few orders of the reserve are let out every :data:`RELEASE_EVERY_SECONDS`
        (a charge, a send, a commit needs new orders to come round). It is withdrawn, and the fault
        counted missed (``False``), only when no order is left in flight or none became terminal for
        :data:`STALL_SECONDS`. (Arming one process for a fixed window missed under load: its
        tasks had gone to the other worker, or came after the window.)"""
        process_kind, _ = HOOKED[kind]
        targets = self.of_kind(process_kind)
        arm = self.arms / process_kind
        for target in targets:
            target.paused.clear()
        arm.touch()
        released_at = time.monotonic()
        while not any(t.paused.is_set() for t in targets):
            self.watch()
            if time.monotonic() - released_at > RELEASE_EVERY_SECONDS:
                released_at = time.monotonic()
                self.release_reserve()
            stalled = time.monotonic() - self.stats.progressed_at > STALL_SECONDS
            if stalled or not self.in_flight():
                try:
                    arm.unlink()
                    return False  # nothing left to reach the point with
                except FileNotFoundError:  # a hook took the arming just now: its marker follows
                    deadline = time.monotonic() + 30
                    while not any(t.paused.is_set() for t in targets):
                        if time.monotonic() > deadline:
                            return False
                        time.sleep(0.05)
                    break
            time.sleep(0.05)
        paused = next(t for t in targets if t.paused.is_set())
        paused.kill()  # paused at the point: SIGKILL there
        paused.start()
        return True

    def fault(self, kind: str) -> bool:
        rng = self.rng
        if kind in HOOKED:
            return self.hooked(kind)
        if kind in KILLS:
            target = rng.choice(self.of_kind(KILLS[kind]))
            time.sleep(rng.uniform(0, 0.3))
            target.kill()
            time.sleep(rng.uniform(0, 0.3))
            target.start()
            return True
        if kind in NODE_FAULTS:
            assert self.galera is not None
            return self.galera.fault(kind, rng)
        if kind in CUTS:
            proxy = self.proxies[CUTS[kind]]
            assert proxy.proc is not None
            proxy.proc.send_signal(signal.SIGUSR1)
            return True
        db = self.dbs[CRASHES[kind]]
        db.crash()
        time.sleep(rng.uniform(0.2, 1.5))
        db.start()
        return True

    def run_faults(self, plan: list[str], may_fault: Callable[[int], bool]) -> None:
        """Inject ``plan`` in order; fault ``i`` waits until ``may_fault(i)``. A hooked fault whose point
        is not reached (no traffic of that kind just then) is tried again a little later, as often as it
        takes while orders are still in flight (the faults are paced over the first
        :data:`FAULT_SHARE` of the orders, so the rest is traffic for these retries); one still not
        reached when nothing is in flight any more is counted missed, and the run fails (a run injects
        exactly the faults it was asked for, or says so)."""
        queue: list[tuple[str, int, int]] = [
            (kind, slot, 0) for slot, kind in enumerate(plan)
        ]  # kind, slot, tries
        n = 0
        while n < len(queue):
            kind, slot, tries = queue[n]
            began = time.monotonic()
            while not may_fault(slot):
                self.watch()
                if time.monotonic() - self.stats.progressed_at > STALL_SECONDS:
                    console.log(f"[red]no order became terminal for {STALL_SECONDS} s; faults stopped[/red]")
                    return
                time.sleep(0.05)
            self.watch()
            self.stats.waited += time.monotonic() - began
            began = time.monotonic()
            done = self.fault(kind)
            self.stats.seconds[kind] += time.monotonic() - began
            with (self.logs / "faults.log").open("a") as log:  # when each fault happened, beside the logs
                log.write(f"{time.strftime('%H:%M:%S')} {slot} {kind} {'done' if done else 'not reached'}\n")
            if done:
                self.stats.faults[kind] += 1
            else:
                self.stats.missed[kind] += 1
                self.release_reserve()  # new traffic for the next try
                if self.in_flight():
                    queue.insert(min(len(queue), n + 3), (kind, slot, tries + 1))
            n += 1
            self.stats.faults_done = slot + 1
            self.stats.last_fault_at = time.monotonic()
            time.sleep(self.rng.uniform(0.05, 0.3))

    def poll_progress(self, stop: threading.Event) -> None:
        """Keep :attr:`Stats.terminal` current (a thread): the pacing of orders and faults follows it."""
        query = sa.select(sa.func.count()).where(business_orders.c.status != "PENDING")
        while not stop.wait(0.5):
            try:
                with self.business_direct.connect() as conn:
                    terminal = int(conn.scalar(query) or 0)
            except sa.exc.DBAPIError:
                continue  # the database is down (a crash of the schedule): try again
            if terminal > self.stats.terminal:
                self.stats.terminal, self.stats.progressed_at = terminal, time.monotonic()

    # --- drain -----------------------------------------------------------------------------------

    def pending(self) -> dict[str, int]:
        """What is still in flight, read from both databases (directly, not through the proxies)."""
        outbox = OutboxTables()
        with self.business_direct.connect() as conn:
            open_orders = conn.scalar(
                sa.select(sa.func.count()).where(
                    business_orders.c.status.not_in(("COMPLETED", "FAILED", "NEEDS_REVIEW"))
                )
            )
            rows = dict(
                conn.execute(
                    sa.select(outbox.outbox.c.state, sa.func.count())
                    .where(outbox.outbox.c.state != "DELIVERED")
                    .group_by(outbox.outbox.c.state)
                ).all()
            )
        with self.orbit_direct.connect() as conn:
            unacked = conn.scalar(sa.text("SELECT COUNT(*) FROM event_deliveries WHERE state <> 'ACKED'"))
            live = conn.scalar(sa.text("SELECT COUNT(*) FROM tasks WHERE status IN ('LEASED', 'RUNNING')"))
        return {"open_orders": int(open_orders or 0), "unacked_deliveries": int(unacked or 0), "live_tasks": int(live or 0),
                **{f"outbox_{k.lower()}": int(v) for k, v in rows.items()}}  # fmt: skip

    def drain(self, placer_thread: threading.Thread) -> tuple[bool, float]:
        placer_thread.join(self.opts.drain_timeout)
        start = self.stats.last_fault_at or time.monotonic()
        deadline = time.monotonic() + self.opts.drain_timeout
        last_reconcile = time.monotonic()
        while time.monotonic() < deadline:
            self.watch()
            try:
                left = self.pending()
            except sa.exc.OperationalError:
                time.sleep(0.5)
                continue
            if left.get("outbox_needs_reconcile") and time.monotonic() - last_reconcile > 10:
                last_reconcile = time.monotonic()
                self.reconcile(left["outbox_needs_reconcile"])
            if not any(left.values()):
                return True, time.monotonic() - start
            time.sleep(0.5)
        return False, time.monotonic() - start

    def reconcile(self, rows: int) -> None:
        """What an operator does with NEEDS_RECONCILE rows: ``orbit-outbox reconcile`` (the rows are counted)."""
        subprocess.run(
            [sys.executable, "-m", "outbox_adapter.cli", "reconcile", "--json", "--actor", "chaos"],
            env={**os.environ, "ORBIT_OUTBOX_DATABASE_URL": self.business_url_for(0), "ORBIT_URL": self.server_urls[0],
                 "ORBIT_API_KEY": self.keys["admin"]},
            capture_output=True, text=True,
        )  # fmt: skip
        self.reconciled += rows

    def stop(self) -> None:
        """SIGTERM every process at once (then SIGKILL what is left after 10 s), then the databases."""
        every = [*self.services, *self.proxies.values()]
        for s in every:
            s.terminate()
        for s in every:
            s.wait_or_kill(10)
        for db in self.dbs.values():
            db.stop()
        if self.galera is not None:
            self.galera.stop()

    def restart_databases(self) -> None:
        """Start the databases again from disk (after :meth:`stop`) for the checks."""
        if self.galera is not None:
            self.galera.restart_for_checks()
        for db in self.dbs.values():
            db.start()


def _wait_port(port: int, timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"error: nothing listens on port {port} after {timeout:.0f} s")


def _wait_http(url: str, service: Service, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        if service.proc is not None and service.proc.poll() is not None:
            raise SystemExit(
                f"error: {service.name} exited during start-up; see {service.logs / service.name}.log"
            )
        time.sleep(0.1)
    raise SystemExit(f"error: {url} did not answer within {timeout:.0f} s")


def run(opts: Options, cluster: GaleraCluster | None = None) -> tuple[dict[str, Any], Report]:
    """One chaos run; ``cluster``: a Galera cluster already running (a test session's) to use with
    ``opts.cluster == "galera"`` instead of starting one (its databases are dropped afterwards)."""
    chaos = Chaos(opts, cluster)
    started = time.monotonic()
    placer: Placer | None = None
    try:
        console.log(f"run directory {opts.root}")
        chaos.start_databases()
        settings = chaos.settings()
        console.log(f"databases ready after {time.monotonic() - started:.1f} s")
        chaos.set_up_schemas()
        console.log(f"schemas ready after {time.monotonic() - started:.1f} s")
        chaos.start_services()
        console.log(f"processes ready after {time.monotonic() - started:.1f} s")
        console.log(
            f"{opts.servers} servers, {opts.relays} relays, {opts.workers} workers, 1 consumer, 1 order API; "
            f"{opts.orders} orders, {opts.faults} faults (seed {opts.seed})"
        )
        if chaos.galera is not None:
            plan = cluster_schedule(chaos.rng, opts.faults, [*HOOKED, *KILLS], list(opts.node_kinds) or None)
        else:
            plan = schedule(chaos.rng, opts.faults, opts.crashes_per_db)
        kinds = KINDS if chaos.galera is None else [*HOOKED, *KILLS, *NODE_FAULTS]
        stats = chaos.stats
        per_fault = FAULT_SHARE * opts.orders / (len(plan) + 1)
        # Orders in flight at most: a steady load the pipeline keeps up with, so that faults land on
        # every stage all along the run (not on a backlog that drains long after the last fault).
        window = max(50, opts.orders // 50)
        stats.released = opts.orders - int(RESERVE_SHARE * opts.orders)

        def may_place(j: int) -> bool:
            return j < stats.terminal + window and j < stats.released

        def may_fault(i: int) -> bool:
            return stats.terminal >= min(opts.orders, (i + 1) * per_fault)

        polling = threading.Event()
        threading.Thread(target=chaos.poll_progress, args=(polling,), daemon=True).start()
        placer = Placer(chaos.api_url, opts, stats, may_place)
        placer_thread = threading.Thread(target=placer.run, daemon=True)
        placer_thread.start()
        faults_started = time.monotonic()
        last_log = 0.0

        def progress() -> None:
            nonlocal last_log
            if time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                console.log(
                    f"placed {stats.placed}/{opts.orders}, terminal {stats.terminal}, faults {stats.faults_done}/{len(plan)}"
                )

        def may_fault_logged(i: int) -> bool:
            progress()
            return may_fault(i)

        chaos.run_faults(plan, may_fault_logged)
        stats.released = opts.orders
        faults_seconds = time.monotonic() - faults_started
        console.log(f"faults done in {faults_seconds:.0f} s; draining")
        drained, drain_seconds = chaos.drain(placer_thread)
        polling.set()
        left = {} if drained else chaos.pending()
        console.log(f"drained={drained} after {drain_seconds:.1f} s")
        counters = chaos.galera.counters() if chaos.galera is not None else {}
        chaos.stop()
        chaos.restart_databases()  # the checks read the databases as they are on disk after the run
        console.log("checking the invariants")
        report = check(chaos.business_direct, chaos.orbit_direct, placer.placed, subscription=SUBSCRIPTION)
        if not drained:
            report.violations.insert(0, f"not drained within {opts.drain_timeout:.0f} s: {left}")
        for key in placer.unanswered[:5]:
            report.violations.append(f"order request {key} never answered")
        injected = sum(chaos.stats.faults.values())
        if injected != len(plan):
            report.violations.append(
                f"injected {injected} of the {len(plan)} faults asked for (not reached: {dict(chaos.stats.missed)})"
            )
        self_exits = [e for s in chaos.services for e in s.self_exits]
        f = report.figures
        summary = {
            "orders": opts.orders,
            "acknowledged_orders": f["orders"],
            "seed": opts.seed,
            "skip_locked": not opts.no_skip_locked,
            "cluster": opts.cluster,
            "server_db": opts.server_db,
            "faults": {k: chaos.stats.faults.get(k, 0) for k in kinds},
            "node_faults": sum(chaos.stats.faults.get(k, 0) for k in NODE_FAULTS),
            "nodes_restarted_after_pause": chaos.galera.restarted_after_pause if chaos.galera else 0,
            "operator_recoveries": chaos.galera.operator_recoveries if chaos.galera else 0,
            "cluster_counters": counters,
            "cert_failures_per_1000_tasks": round(
                1000 * counters.get("wsrep_local_cert_failures", 0) / max(1, f["tasks"]), 2
            ),
            "bf_aborts_per_1000_tasks": round(
                1000 * counters.get("wsrep_local_bf_aborts", 0) / max(1, f["tasks"]), 2
            ),
            "faults_total": sum(chaos.stats.faults.values()),
            "faults_missed": dict(chaos.stats.missed),
            "fault_seconds": {k: round(v, 1) for k, v in chaos.stats.seconds.items()},
            "waited_for_orders_seconds": round(chaos.stats.waited, 1),
            "db_crashes": {name: db.crashes for name, db in chaos.dbs.items()},
            "lost": f["lost"] + f["orders_lost"],
            "duplicated": f["duplicated"],
            "double_charged": f["double_charged"],
            "results_applied_twice": f["results_applied_twice"],
            "live_attempt_overlaps": f["live_attempt_overlaps"],
            "violations": report.violations,
            "violation_counts": report.counts,
            "drain_seconds": round(drain_seconds, 1),
            "faults_seconds": round(faults_seconds, 1),
            "total_seconds": round(time.monotonic() - started, 1),
            "order_statuses": f["order_statuses"],
            "order_api_seconds_p50_p99": _percentiles(placer.latencies),
            "charged_but_not_completed": f["charged_but_not_completed"],
            "failed_not_declined": f["failed_not_declined"],
            "refused_requests": f["refused_requests"],
            "tasks": f["tasks"],
            "attempts": f["attempts"],
            "attempts_expired": f["attempts_expired"],
            "task_events": f["task_events"],
            "result_events": f["result_events"],
            "follow_ups": f["follow_ups"],
            "outbox_rows": f["outbox_rows"],
            "resent_rows": f["resent_rows"],
            "reconciled_rows": chaos.reconciled,
            "process_starts": {s.name: s.starts for s in chaos.services},
            "self_exits": len(self_exits),
            "self_exit_details": self_exits[:10],
            "database_settings": settings,
        }
        for db in chaos.dbs.values():
            db.stop()
        chaos.business_direct.dispose()
        chaos.orbit_direct.dispose()
        if chaos.galera is not None:
            chaos.galera.drop()
            chaos.galera.stop()
        return summary, report
    except BaseException:
        console.log(f"[red]the run failed; its logs are kept under {opts.root}[/red]")
        opts.keep = True
        if placer is not None:
            placer.abandoned.set()
        chaos.stop()
        raise


def _percentiles(values: list[float]) -> list[float]:
    if not values:
        return [0.0, 0.0]
    ordered = sorted(values)
    return [
        round(ordered[len(ordered) // 2], 3),
        round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
    ]
