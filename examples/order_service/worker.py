"""The ``orders.fulfil`` handler: three durable steps, each journaled once.

reserve inventory → charge payment → issue receipt. Before a step runs, the
journal (unique on task id and step index, seed 000) is read: a finished step is
skipped and its recorded result used, so a rerun after a crash repeats no side
effect. Each provider call carries the attempt's fencing ``generation`` and an
idempotency key per order and step, so even a step that crashed between its
provider call and its journal entry is safe to run again.

Run it: ``python -m examples.order_service.worker --database-url URL --orbit-url URL --api-key KEY``
(or the ``ORDER_DATABASE_URL``, ``ORBIT_URL``, ``ORBIT_API_KEY`` variables).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_client import JsonFormatter, OrbitClient, RetryableError, TaskContext, Worker

from .db import business_engine, journal_entries
from .providers import Providers

__all__ = ["FAULT_ENV", "durable_step", "main", "make_handler"]

NAMESPACE, QUEUE, HANDLER = "shop", "fulfilment", "orders.fulfil"

#: Demo-only fault hook: ``hang-after-charge`` makes the first charge of this process block,
#: after the provider performed it and before the journal records it, and announces it on
#: stderr, so the demo can SIGKILL the worker in the middle of a step.
#: ``hang-after-charge@FILE`` (``bench.chaos``) blocks the first charge made after the file
#: ``FILE`` appears (the file is removed: one arming, one hang).
FAULT_ENV = "ORDER_SERVICE_FAULT"

log = logging.getLogger("order_service.worker")


def durable_step(
    engine: Engine, ctx: TaskContext, index: int, name: str, run: Callable[[], dict[str, Any]],
    *, after_run: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run step ``index`` of the task once: return its journaled result, or run it and journal it.

    The step runs outside any transaction; its result is written in a short one. If
    another attempt journaled the step first, its result is the one that counts.
    """
    where = (journal_entries.c.task_id == ctx.task.id, journal_entries.c.step_index == index)
    with engine.begin() as conn:
        done = conn.scalar(sa.select(journal_entries.c.result).where(*where))
    if done is not None:
        log.info("step %s of task %s already journaled; skipped", name, ctx.task.id)
        return dict(done)
    result = run()
    if after_run is not None:
        after_run()
    try:
        with engine.begin() as conn:
            conn.execute(
                journal_entries.insert().values(
                    task_id=ctx.task.id, step_index=index, step_name=name, status="COMPLETED", result=result,
                    generation=ctx.generation,
                )
            )  # fmt: skip
    except sa.exc.IntegrityError:
        with engine.begin() as conn:
            return dict(conn.scalar(sa.select(journal_entries.c.result).where(*where)))
    return result


def make_handler(engine: Engine, *, fault: str | None = None) -> Callable[[TaskContext], dict[str, Any]]:
    """The ``orders.fulfil`` handler over the business database behind ``engine``.

    Params: ``{"order_id": str, "sku": str, "quantity": int, "amount": "12.34"}``.
    Returns ``{"reservation_id", "payment_id", "receipt_id"}``; raises
    :class:`~.providers.PaymentDeclined` (not retryable: the task fails) above the card limit, and
    :class:`~orbit_client.RetryableError` when the business database is unavailable (the task is
    attempted again; the journal and the providers' keys make that safe).
    """
    providers = Providers(engine)
    hang_once = threading.Event()
    name, _, gate = (fault or "").partition("@")
    if name == "hang-after-charge" and not gate:
        hang_once.set()

    def armed() -> bool:
        if hang_once.is_set():
            hang_once.clear()
            return True
        if name != "hang-after-charge" or not gate:
            return False
        try:
            os.remove(gate)  # atomic: of the handler threads, exactly one takes the arming
        except FileNotFoundError:
            return False
        return True

    def hang_if_asked() -> None:
        if armed():
            print(f"{FAULT_ENV} paused-after-charge", file=sys.stderr, flush=True)
            threading.Event().wait()  # until the demo kills this process

    def fulfil(ctx: TaskContext) -> dict[str, Any]:
        try:
            return run_steps(ctx)
        except sa.exc.DBAPIError as exc:
            # The business database went away (a restart, a failover, a cut connection): every step is
            # journaled and every provider call idempotent, so the next attempt resumes safely. Reported
            # as not retryable, it would fail the order, perhaps after the card was charged.
            if exc.connection_invalidated or isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError):
                raise RetryableError(f"business database unavailable: {exc.orig!r}") from exc
            raise

    def run_steps(ctx: TaskContext) -> dict[str, Any]:
        p = ctx.params
        order_id, generation = p["order_id"], ctx.generation
        reservation = durable_step(
            engine, ctx, 0, "reserve_inventory",
            lambda: {"reservation_id": providers.reserve(order_id, p["sku"], p["quantity"], generation=generation)},
        )  # fmt: skip
        ctx.raise_if_cancelled()
        payment = durable_step(
            engine, ctx, 1, "charge_payment",
            lambda: {"payment_id": providers.charge(order_id, Decimal(p["amount"]), generation=generation)},
            after_run=hang_if_asked,
        )  # fmt: skip
        receipt = durable_step(
            engine, ctx, 2, "issue_receipt",
            lambda: {"receipt_id": providers.issue_receipt(order_id, payment["payment_id"], generation=generation)},
        )  # fmt: skip
        return {**reservation, **payment, **receipt}

    return fulfil


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the orders.fulfil worker.")
    parser.add_argument("--database-url", default=os.environ.get("ORDER_DATABASE_URL"))
    parser.add_argument("--orbit-url", default=os.environ.get("ORBIT_URL"))
    parser.add_argument("--api-key", default=os.environ.get("ORBIT_API_KEY"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lease-seconds", type=float, default=10.0)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ["ORDER_WORKER_METRICS_PORT"])
        if os.environ.get("ORDER_WORKER_METRICS_PORT")
        else None,
        help='serve Prometheus metrics at http://127.0.0.1:PORT/metrics (README "Operations")',
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=os.environ.get("ORBIT_LOG_FORMAT", "text"),
        help="json: one JSON object per line with trace_id and span_id (orbit_client.JsonFormatter)",
    )
    args = parser.parse_args(argv)
    missing = [n for n in ("database_url", "orbit_url", "api_key") if not getattr(args, n)]
    if missing:
        parser.error("missing " + ", ".join("--" + m.replace("_", "-") for m in missing))
    if args.log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = business_engine(args.database_url)
    handler = make_handler(engine, fault=os.environ.get(FAULT_ENV))
    with OrbitClient(args.orbit_url, api_key=args.api_key) as client:
        Worker(
            client, NAMESPACE, QUEUE, {HANDLER: handler}, concurrency=args.concurrency,
            lease_seconds=args.lease_seconds, metrics_port=args.metrics_port,
        ).run()  # fmt: skip
    engine.dispose()


if __name__ == "__main__":
    main()
