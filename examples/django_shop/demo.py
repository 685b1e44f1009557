"""``python -m examples.django_shop.demo``: the Django shop end to end on SQLite, with crashes.

An Orbit server, then orders placed through the ORM, each with its fulfilment enqueued in the same
``transaction.atomic()`` (some orders are refused and rolled back: their tasks must never run); a
relay killed between a send and its record, a worker killed right after charging a card; then a
fresh relay and worker, and the result consumer applying results to the orders through the ORM.
It checks: every placed order COMPLETED exactly once, charged exactly once, one Orbit task each;
no task for a rolled-back order. Exit 0 when all hold (README "Django").
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from examples._ports import free_port

NAMESPACE, QUEUE, SUBSCRIPTION = "shop", "fulfilment", "order-results"


@dataclass
class Process:
    """A child process, its stderr copied to a log file and watched for one marker line."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    marker: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    seen: threading.Event = field(default_factory=threading.Event)

    def start(self, **extra_env: str) -> None:
        log: IO[bytes] = (self.log_dir / f"{self.name}.log").open("ab")
        self.seen.clear()
        self.proc = subprocess.Popen(
            self.argv, env={**os.environ, **self.env, **extra_env}, stdout=log, stderr=subprocess.PIPE
        )
        threading.Thread(target=self._pump, args=(self.proc, log), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.write(line)
            log.flush()
            if self.marker and self.marker.encode() in line:
                self.seen.set()
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


def _run(*argv: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def _wait(what: str, predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _wait_for_http(url: str, proc: Process, timeout: float = 60.0) -> None:
    def answers() -> bool:
        if proc.proc is not None and proc.proc.poll() is not None:
            raise SystemExit(f"{proc.name} exited with {proc.proc.returncode}; see {proc.log_dir}")
        try:
            return httpx.get(url, timeout=2).status_code < 500
        except httpx.TransportError:
            return False

    _wait(url, answers, timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--orders", type=int, default=12, help="Orders to place (default 12; every 4th is refused)."
    )
    parser.add_argument("--dir", default=".demo/django_shop", help="Working directory (emptied first).")
    parser.add_argument("--timeout", type=float, default=180.0, help="Seconds for every order to finish.")
    args = parser.parse_args(argv)

    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    py = sys.executable
    orbit_db = f"sqlite:///{work / 'orbit.db'}"
    _run("orbit_server", "migrate", "--database-url", orbit_db)
    _run("orbit_server", "namespace", "create", NAMESPACE, "--database-url", orbit_db)
    _run("orbit_server", "queue", "create", NAMESPACE, QUEUE, "--database-url", orbit_db)
    keys = {
        role: _run("orbit_server", "api-key", "create", NAMESPACE, "--role", role, "--database-url", orbit_db)
        for role in ("submit", "work", "admin")
    }
    port = free_port()
    orbit_url = f"http://127.0.0.1:{port}"
    env = {
        "DJANGO_SETTINGS_MODULE": "examples.django_shop.settings",
        "DJANGO_SHOP_DIR": str(work),
        "ORBIT_URL": orbit_url,
        "ORBIT_API_KEY": keys["work"],
        "ORBIT_NAMESPACE": NAMESPACE,
    }
    os.environ.update(env)
    manage = [py, "-m", "examples.django_shop.manage"]
    server = Process("orbit-server", [py, "-m", "orbit_server", "--log-level", "warning", "serve", "--database-url",
                                      orbit_db, "--port", str(port)], {"ORBIT_SWEEP_INTERVAL_SECONDS": "0.5"}, work)  # fmt: skip
    relay = Process("relay", [*manage, "orbit_outbox", "relay", "--lease-seconds", "2", "--poll-interval", "0.2",
                              "--api-key", keys["submit"]], {}, work, marker="paused-after-send")  # fmt: skip
    worker = Process("worker", [*manage, "orbit_worker", "--queue", QUEUE, "--concurrency", "2",
                                "--lease-seconds", "2"], {}, work, marker="paused-after-charge")  # fmt: skip
    consumer = Process("consumer", [*manage, "orbit_consume", "--subscription", SUBSCRIPTION, "--handler",
                                    "examples.django_shop.orders.results:apply", "--lease-seconds", "5"], {}, work)  # fmt: skip
    running = [server]
    try:
        server.start()
        _wait_for_http(f"{orbit_url}/healthz", server)
        from orbit_client import OrbitClient

        with OrbitClient(orbit_url, api_key=keys["admin"]) as admin:
            admin.create_subscription(NAMESPACE, SUBSCRIPTION, queues=[QUEUE])
        # The shop's models and, by the outbox_adapter.django app's migration, the outbox and inbox tables.
        _run("examples.django_shop.manage", "migrate", "--verbosity", "0")

        import django

        django.setup()
        placed, refused = place_orders(args.orders)
        print(f"placed {len(placed)} orders, refused (rolled back) {len(refused)}")

        # 1. A relay killed after a send, before recording it: the row is sent again with the same key.
        relay.start(ORBIT_OUTBOX_FAULT="pause-after-send")
        running.append(relay)
        _wait("the relay to pause after a send", relay.seen.is_set, 60)
        relay.kill()
        print("relay killed between a send and its record")
        # 2. A worker killed right after charging a card: the next attempt skips the charge.
        gate = work / "crash-after-charge"
        gate.write_text("armed")
        worker.start(DJANGO_SHOP_CRASH_AFTER_CHARGE=str(gate))
        running.append(worker)
        relay.start()
        _wait("the worker to pause after a charge", worker.seen.is_set, 60)
        worker.kill()
        print("worker killed after a charge, before finishing its task")
        worker.start()
        consumer.start()
        running.append(consumer)
        _wait("every order to finish", lambda: finished(placed), args.timeout)
        ok = check(placed, refused, orbit_url, keys["admin"])
    finally:
        for proc in reversed(running):
            proc.stop()
    print("all invariants hold" if ok else f"INVARIANTS BROKEN: see {work}")
    return 0 if ok else 1


def place_orders(count: int) -> tuple[list[int], list[str]]:
    """``count`` orders, each saved with its fulfilment in one atomic block; every 4th is refused
    after the enqueue (a card check failing), so its block rolls back with the task in it."""
    from django.db import transaction

    from examples.django_shop.orders.models import Order
    from examples.django_shop.orders.tasks import fulfil

    class Refused(Exception):
        pass

    placed: list[int] = []
    refused: list[str] = []
    for n in range(1, count + 1):
        reference = f"order-{n:04d}"
        try:
            with transaction.atomic():
                order = Order.objects.create(reference=reference, amount_cents=1000 + n)
                result = fulfil.enqueue(order.pk)
                Order.objects.filter(pk=order.pk).update(task_result_id=result.id)
                if n % 4 == 0:
                    raise Refused(reference)
            placed.append(order.pk)
        except Refused:
            refused.append(reference)
    return placed, refused


def finished(placed: list[int]) -> bool:
    from examples.django_shop.orders.models import Order

    return Order.objects.filter(pk__in=placed).exclude(status="PENDING").count() == len(placed)


def check(placed: list[int], refused: list[str], orbit_url: str, admin_key: str) -> bool:
    from django.db import connection

    from examples.django_shop.orders.models import Charge, Order
    from orbit_client import OrbitClient

    problems: list[str] = []
    for order in Order.objects.filter(pk__in=placed):
        charges = Charge.objects.filter(order=order).count()
        if order.status != "COMPLETED" or order.results_applied != 1 or charges != 1 or not order.receipt:
            problems.append(
                f"{order.reference}: {order.status}, {order.results_applied} results, {charges} charges"
            )
    if Order.objects.filter(reference__in=refused).exists():
        problems.append("a refused order was saved")
    with connection.cursor() as cursor:
        cursor.execute("SELECT state, COUNT(*) FROM orbit_outbox GROUP BY state")
        states: dict[str, Any] = dict(cursor.fetchall())
    if states != {"DELIVERED": len(placed)}:
        problems.append(f"outbox rows {states}, expected {len(placed)} DELIVERED and nothing else")
    with OrbitClient(orbit_url, api_key=admin_key) as client:
        tasks = client.list_tasks(NAMESPACE, limit=500).items
    if len(tasks) != len(placed):
        problems.append(f"{len(tasks)} Orbit tasks for {len(placed)} orders")
    print(f"{len(placed)} orders COMPLETED once, charged once, {len(tasks)} Orbit tasks; outbox {states}")
    for problem in problems:
        print(f"  PROBLEM {problem}")
    return not problems


if __name__ == "__main__":
    sys.exit(main())
