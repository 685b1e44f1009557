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
import signal
import sys
import threading
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_client import JsonFormatter, OrbitClient, RetryableError, TaskContext, Worker
from outbox_adapter import is_transient_db_error

from . import flow
from .db import business_engine, journal_entries
from .providers import Providers, StaleGeneration

__all__ = ["FAULT_ENV", "durable_step", "main", "make_flow_handlers", "make_handler", "settle_outcome"]

NAMESPACE, QUEUE, HANDLER = "shop", "fulfilment", "orders.fulfil"

#: Demo-only fault hook: ``hang-after-charge`` makes the first charge of this process block,
#: after the provider performed it and before the journal records it, and announces it on
#: stderr, so the demo can SIGKILL the worker in the middle of a step.
#: ``hang-after-charge@FILE`` (``bench.chaos``) blocks the first charge made after the file
#: ``FILE`` appears (the file is removed: one arming, one hang). ``stop-after-reserve`` (the fencing
#: test) makes the process SIGSTOP itself once, after its first reserve call and before the journal
#: entry: a worker that loses its lease while stopped and is resumed later (SIGCONT).
FAULT_ENV = "ORDER_SERVICE_FAULT"

log = logging.getLogger("order_service.worker")


def durable_step(
    engine: Engine, ctx: TaskContext, index: int, name: str, run: Callable[[], dict[str, Any]],
    *, after_run: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run step ``index`` of the task once: return its journaled result, or run it and journal it.

    The step runs outside any transaction; its result is written in a short one. If
    another attempt journaled the step first, its result is the one that counts.

    Fencing: the journal refuses an attempt older than one it has already seen for the task
    (an entry of a higher generation): a worker that lost its lease and resumed (a stopped
    process, a long pause) raises :class:`~.providers.StaleGeneration` instead of running or
    journaling a step after a newer attempt has.
    """
    task_id = ctx.task.id
    where = (journal_entries.c.task_id == task_id, journal_entries.c.step_index == index)
    with engine.begin() as conn:
        _refuse_stale(conn, task_id, ctx.generation, name)
        done = conn.scalar(sa.select(journal_entries.c.result).where(*where))
    if done is not None:
        log.info("step %s of task %s already journaled; skipped", name, task_id)
        return dict(done)
    result = run()
    if after_run is not None:
        after_run()
    try:
        with engine.begin() as conn:
            _refuse_stale(conn, task_id, ctx.generation, name)
            conn.execute(
                journal_entries.insert().values(
                    task_id=task_id, step_index=index, step_name=name, status="COMPLETED", result=result,
                    generation=ctx.generation,
                )
            )  # fmt: skip
    except sa.exc.IntegrityError:
        with engine.begin() as conn:
            return dict(conn.scalar(sa.select(journal_entries.c.result).where(*where)))
    return result


def _refuse_stale(conn: sa.Connection, task_id: str, generation: int, name: str) -> None:
    """Raise :class:`~.providers.StaleGeneration` if the journal holds an entry of the task from a
    newer attempt than ``generation``."""
    newest = conn.scalar(
        sa.select(sa.func.max(journal_entries.c.generation)).where(journal_entries.c.task_id == task_id)
    )
    if newest is not None and generation < newest:
        raise StaleGeneration(
            f"step {name} of task {task_id}: generation {generation} < {newest} already journaled (lease lost)"
        )


def _fault_hook(fault: str | None) -> Callable[[], None]:
    """The ``hang-after-charge`` hook of :data:`FAULT_ENV`: called after a charge was performed and
    before it is journaled; blocks (once per arming) until the demo kills the process."""
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

    return hang_if_asked


def _stop_hook(fault: str | None) -> Callable[[], None] | None:
    """The ``stop-after-reserve`` hook of :data:`FAULT_ENV` (once per process), else ``None``."""
    if fault != "stop-after-reserve":
        return None
    once = threading.Event()

    def stop() -> None:
        if not once.is_set():
            once.set()
            print(f"{FAULT_ENV} stopped-after-reserve", file=sys.stderr, flush=True)
            # The whole process, until SIGCONT. Sent to this thread (not the process): a process-wide
            # SIGSTOP is taken by whichever thread the kernel picks, and until that one is scheduled this
            # thread ran on; under load it journaled the step it was meant to stop before.
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    return stop


def _retry_when_the_database_is_down(
    step: Callable[[TaskContext], dict[str, Any]],
) -> Callable[[TaskContext], dict[str, Any]]:
    """Report an unavailable business database as retryable (see :func:`make_handler`)."""

    def run(ctx: TaskContext) -> dict[str, Any]:
        try:
            return step(ctx)
        except sa.exc.DBAPIError as exc:
            if is_transient_db_error(exc):  # the relay's and the consumer's list (README "Outages")
                raise RetryableError(f"business database unavailable: {exc.orig!r}") from exc
            raise

    return run


def make_handler(engine: Engine, *, fault: str | None = None) -> Callable[[TaskContext], dict[str, Any]]:
    """The ``orders.fulfil`` handler over the business database behind ``engine``.

    Params: ``{"order_id": str, "sku": str, "quantity": int, "amount": "12.34"}``.
    Returns ``{"reservation_id", "payment_id", "receipt_id"}``; raises
    :class:`~.providers.PaymentDeclined` (not retryable: the task fails) above the card limit, and
    :class:`~orbit_client.RetryableError` when the business database is unavailable (the task is
    attempted again; the journal and the providers' keys make that safe).
    """
    providers = Providers(engine)
    hang_if_asked = _fault_hook(fault)
    stop_if_asked = _stop_hook(fault)

    def fulfil(ctx: TaskContext) -> dict[str, Any]:
        try:
            return run_steps(ctx)
        except sa.exc.DBAPIError as exc:
            # The business database went away (a restart, a failover, a cut connection): every step is
            # journaled and every provider call idempotent, so the next attempt resumes safely. Reported
            # as not retryable, it would fail the order, perhaps after the card was charged.
            # The one list of transient errors, shared with the relay and the consumer (a read-only
            # old primary during a failover is one: MariaDB 1290).
            if is_transient_db_error(exc):
                raise RetryableError(f"business database unavailable: {exc.orig!r}") from exc
            raise

    def run_steps(ctx: TaskContext) -> dict[str, Any]:
        p = ctx.params
        order_id, generation = p["order_id"], ctx.generation
        reservation = durable_step(
            engine, ctx, 0, "reserve_inventory",
            lambda: {"reservation_id": providers.reserve(order_id, p["sku"], p["quantity"], task_id=ctx.task.id, generation=generation)},
            after_run=stop_if_asked,
        )  # fmt: skip
        ctx.raise_if_cancelled()
        payment = durable_step(
            engine, ctx, 1, "charge_payment",
            lambda: {"payment_id": providers.charge(order_id, Decimal(p["amount"]), task_id=ctx.task.id, generation=generation)},
            after_run=hang_if_asked,
        )  # fmt: skip
        receipt = durable_step(
            engine, ctx, 2, "issue_receipt",
            lambda: {"receipt_id": providers.issue_receipt(order_id, payment["payment_id"], task_id=ctx.task.id, generation=generation)},
        )  # fmt: skip
        return {**reservation, **payment, **receipt}

    return fulfil


def make_flow_handlers(
    engine: Engine, *, fault: str | None = None
) -> dict[str, Callable[[TaskContext], dict[str, Any]]]:
    """The step handlers of the ``order-fulfilment`` flow (:mod:`.flow`), by handler name.

    Each step is one task with one side effect, journaled once per task (:func:`durable_step`, step
    index 0) and sent to its provider with a key per order and step plus the attempt's fencing
    generation, so a retried or crashed step repeats nothing. Every result carries ``order_id``.

    - ``orders.reserve`` ``{order_id, sku, quantity}`` → ``{order_id, reservation_id}``
    - ``orders.charge`` ``{order_id, amount}`` → ``{order_id, payment_id}``; raises
      :class:`~.providers.PaymentDeclined` (not retryable: the step fails, the flow reminds the customer)
    - ``orders.receipt`` ``{order_id, payment_id}`` → ``{order_id, receipt_id}``
    - ``orders.notify`` ``{order_id, customer, kind}`` → ``{order_id, message_id, kind}``
    - ``orders.release`` ``{order_id, reason}`` → ``{order_id, release_id}``
    - ``orders.settle`` ``{order_id, instance_id, status, reason, reserve?, charge?, receipt?}`` (the
      earlier steps as ``{status, result, error}``) → the order's outcome ``{order_id,
      flow_instance_id, status, reservation_id, payment_id, receipt_id, reason}``, applied by the result consumer; no side effect. A completed
      order whose receipt step failed settles ``NEEDS_REVIEW`` (charged, no receipt).
    """
    providers = Providers(engine)
    hang_if_asked = _fault_hook(fault)

    Step = Callable[[TaskContext], dict[str, Any]]

    def step(name: str, run: Step, after_run: Callable[[], None] | None = None) -> Step:
        def handler(ctx: TaskContext) -> dict[str, Any]:
            result = durable_step(engine, ctx, 0, name, lambda: run(ctx), after_run=after_run)
            return {"order_id": ctx.params["order_id"], **result}

        return _retry_when_the_database_is_down(handler)

    def reserve(ctx: TaskContext) -> dict[str, Any]:
        p = ctx.params
        return {
            "reservation_id": providers.reserve(
                p["order_id"], p["sku"], p["quantity"], task_id=ctx.task.id, generation=ctx.generation
            )
        }

    def charge(ctx: TaskContext) -> dict[str, Any]:
        p = ctx.params
        return {
            "payment_id": providers.charge(
                p["order_id"], Decimal(p["amount"]), task_id=ctx.task.id, generation=ctx.generation
            )
        }

    def receipt(ctx: TaskContext) -> dict[str, Any]:
        p = ctx.params
        return {
            "receipt_id": providers.issue_receipt(
                p["order_id"], p["payment_id"], task_id=ctx.task.id, generation=ctx.generation
            )
        }

    def notify(ctx: TaskContext) -> dict[str, Any]:
        p = ctx.params
        return {
            "message_id": providers.notify(
                p["order_id"], p["kind"], task_id=ctx.task.id, generation=ctx.generation
            ),
            "kind": p["kind"],
        }

    def release(ctx: TaskContext) -> dict[str, Any]:
        return {
            "release_id": providers.release(
                ctx.params["order_id"], task_id=ctx.task.id, generation=ctx.generation
            )
        }

    def settle(ctx: TaskContext) -> dict[str, Any]:
        return settle_outcome(ctx.params)

    return {
        flow.RESERVE: step("reserve_inventory", reserve),
        flow.CHARGE: step("charge_payment", charge, after_run=hang_if_asked),
        flow.RECEIPT: step("issue_receipt", receipt),
        flow.NOTIFY: step("notify_customer", notify),
        flow.RELEASE: step("release_inventory", release),
        flow.SETTLE_HANDLER: settle,
    }


def _result_of(step: Any, key: str) -> Any:
    if isinstance(step, dict) and step.get("status") == "SUCCEEDED" and isinstance(step.get("result"), dict):
        return step["result"].get(key)
    return None


def _error_of(step: Any) -> str | None:
    if not isinstance(step, dict) or step.get("status") == "SUCCEEDED":
        return None
    error = step.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or error)[:500]
    return str(error)[:500] if error is not None else str(step.get("status"))


def settle_outcome(params: dict[str, Any]) -> dict[str, Any]:
    """The order's outcome from the settle step's params (pure: see :func:`make_flow_handlers`)."""
    status, reason = params["status"], params.get("reason")
    outcome = {
        "order_id": params["order_id"],
        "flow_instance_id": params.get("instance_id"),
        "reservation_id": _result_of(params.get("reserve"), "reservation_id"),
        "payment_id": _result_of(params.get("charge"), "payment_id"),
        "receipt_id": _result_of(params.get("receipt"), "receipt_id"),
    }
    if status == "COMPLETED" and outcome["receipt_id"] is None:
        status = "NEEDS_REVIEW"
        reason = (
            f"charged, but the receipt was not issued ({_error_of(params.get('receipt'))}); issue it by hand"
        )
    details = (
        [e for e in (_error_of(params.get(n)) for n in ("reserve", "charge")) if e]
        if status == "FAILED"
        else []
    )
    if details:
        reason = f"{reason}: {'; '.join(details)}"
    return {**outcome, "status": status, "reason": reason}


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
    fault = os.environ.get(FAULT_ENV)
    # Both ways of fulfilling an order on one queue: the single handler and the flow's steps.
    handlers = {HANDLER: make_handler(engine, fault=fault), **make_flow_handlers(engine, fault=fault)}
    with OrbitClient(args.orbit_url, api_key=args.api_key) as client:
        Worker(
            client, NAMESPACE, QUEUE, handlers, concurrency=args.concurrency,
            lease_seconds=args.lease_seconds, metrics_port=args.metrics_port,
        ).run()  # fmt: skip
    engine.dispose()


if __name__ == "__main__":
    main()
