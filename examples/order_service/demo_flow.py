"""The flow half of ``make demo DEMO_ARGS=--flow``: the customers' cancel signals, and the
invariants of orders fulfilled as instances of the ``order-fulfilment`` flow (:mod:`.flow`).

Invariants (README "The order service as a flow"): every order is terminal; exactly one flow
instance per order; every task on the queue for an order is a step of its instance, and no step
(node, activation) has two tasks; the order's status is its instance's (``COMPLETED`` or, when
the receipt failed, ``NEEDS_REVIEW`` ↔ ``COMPLETED``; ``FAILED`` ↔ ``FAILED``; ``CANCELLED`` ↔
``CANCELLED``); each provider acted at most once per order; every completed order was charged and
no cancelled order was; no charged order is left ``PENDING``; only orders whose customer asked to
cancel are cancelled.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from orbit_client import FlowInstance, OrbitClient, OrbitError

from .db import business_orders, provider_tally
from .flow import CANCEL_SIGNAL, FLOW_NAME, NAMESPACE, QUEUE, STEP_HANDLERS

__all__ = ["Canceller", "check_flow", "describe_failures", "failed_invariants", "show_flow", "summarise_flow"]

log = logging.getLogger("order_service.demo")
PROVIDERS = ("reserve", "charge", "receipt", "notify", "remind", "release")
#: The instance status each order status goes with.
INSTANCE_STATUS = {
    "COMPLETED": "COMPLETED",
    "NEEDS_REVIEW": "COMPLETED",
    "FAILED": "FAILED",
    "CANCELLED": "CANCELLED",
}


def fulfilment_key(order_id: str) -> str:
    """The outbox idempotency key of an order's fulfilment (``api._insert_order``): also the flow start's."""
    return f"{order_id}:fulfil"


class Canceller:
    """Sends ``cancel`` to an order's instance as soon as the relay has started it (found by its start
    key), from a thread of its own. The signal's key is per order, so a resend is a replay."""

    def __init__(self, orbit_url: str, api_key: str, *, timeout: float = 60.0) -> None:
        self.requested: list[str] = []
        self._waiting: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._orbit_url, self._api_key, self._timeout = orbit_url, api_key, timeout
        threading.Thread(target=self._run, daemon=True, name="demo-canceller").start()

    def request(self, order_id: str) -> None:
        """Cancel ``order_id`` (asked by its customer right after ordering)."""
        self.requested.append(order_id)
        self._waiting.put(order_id)

    def _run(self) -> None:
        pending: dict[str, float] = {}  # order id -> give up at (monotonic)
        with OrbitClient(self._orbit_url, api_key=self._api_key) as client:
            while True:
                with contextlib.suppress(queue.Empty):
                    while True:
                        pending[self._waiting.get(timeout=0.05)] = time.monotonic() + self._timeout
                for order_id, give_up in list(pending.items()):
                    if self._send(client, order_id) or time.monotonic() > give_up:
                        del pending[order_id]

    @staticmethod
    def _send(client: OrbitClient, order_id: str) -> bool:
        """Whether the cancel is settled: sent (or the instance already finished)."""
        try:
            found = client.find_flow_instance(NAMESPACE, fulfilment_key(order_id))
            if found is None:
                return False
            client.signal_flow(NAMESPACE, found.id, CANCEL_SIGNAL, {"reason": "the customer changed their mind"},
                               idempotency_key=f"{order_id}:cancel")  # fmt: skip
        except OrbitError as exc:  # the server restarting, or the instance finished already
            log.warning("cancel of %s not sent yet: %s", order_id, exc)
            return getattr(exc, "code", None) == "invalid_transition"
        return True


def _instances(client: OrbitClient, wanted: set[str]) -> dict[str, list[FlowInstance]]:
    by_order: dict[str, list[FlowInstance]] = {}
    cursor = None
    while True:
        page = client.list_flow_instances(NAMESPACE, flow=FLOW_NAME, limit=200, cursor=cursor)
        for item in page.items:
            order_id = item.input.get("order_id") if isinstance(item.input, dict) else None
            if order_id in wanted:
                by_order.setdefault(str(order_id), []).append(item)
        if page.next_cursor is None:
            return by_order
        cursor = page.next_cursor


def summarise_flow(
    engine: sa.Engine,
    orbit_url: str,
    api_key: str,
    order_ids: list[str],
    cancels: list[str],
    faults: int,
    elapsed: float,
) -> dict[str, Any]:
    """The demo's summary for ``--flow`` (the counts :func:`check_flow` judges)."""
    wanted = set(order_ids)
    with engine.connect() as conn:
        status_of = dict(
            conn.execute(
                sa.select(business_orders.c.order_id, business_orders.c.status).where(
                    business_orders.c.order_id.in_(order_ids)
                )
            ).all()
        )
        effects, requests = provider_tally(conn, order_ids)
    statuses = Counter(status_of.values())
    with OrbitClient(orbit_url, api_key=api_key) as client:
        instances = _instances(client, wanted)
        tasks_of: dict[str, list[str]] = {}
        cursor = None
        while True:
            page = client.list_tasks(NAMESPACE, queue=QUEUE, limit=500, cursor=cursor)
            for task in page.items:
                order_id = task.params.get("order_id") if isinstance(task.params, dict) else None
                if order_id in wanted and task.handler in STEP_HANDLERS:
                    tasks_of.setdefault(order_id, []).append(task.id)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        full = {
            order_id: client.get_flow_instance(NAMESPACE, found[0].id)
            for order_id, found in instances.items()
        }
        sample = _history_sample(client, full, status_of)
    duplicate_steps = orphan_tasks = steps = 0
    mismatches: list[str] = []
    broken: dict[str, set[str]] = {name: set() for name in FLOW_INVARIANTS}
    for order_id, found in instances.items():
        if len(found) > 1:
            broken["one instance per order"].add(order_id)
    broken["every order has an instance"] = wanted - set(instances)
    broken["every order is terminal"] = {o for o, st in status_of.items() if st == "PENDING"}
    for order_id, inst in full.items():
        step_tasks = [s.task_id for s in inst.steps if s.task_id]
        steps += len(step_tasks)
        activations = Counter((s.node, s.activation, s.round) for s in inst.steps)
        extra = sum(n - 1 for n in activations.values() if n > 1) + len(step_tasks) - len(set(step_tasks))
        orphans = len(set(tasks_of.get(order_id, [])) - set(step_tasks))
        duplicate_steps += extra
        orphan_tasks += orphans
        if extra or orphans:
            broken["one task per step, every task a step"].add(order_id)
        expected = INSTANCE_STATUS.get(str(status_of.get(order_id)))
        if expected != inst.status.value:
            mismatches.append(f"{order_id}: order {status_of.get(order_id)}, instance {inst.status.value}")
            broken["the order's status is its instance's"].add(order_id)
    most: Counter[str] = Counter()
    per_provider: Counter[str] = Counter()
    by_provider: dict[str, set[str]] = {p: set() for p in PROVIDERS}
    for provider, order_id, n in effects:
        per_provider[provider] += n
        most[provider] = max(most[provider], n)
        by_provider.setdefault(provider, set()).add(order_id)
        if n > 1:
            broken["each provider acted at most once per order"].add(order_id)
    completed = {o for o, s in status_of.items() if s in ("COMPLETED", "NEEDS_REVIEW")}
    cancelled = {o for o, s in status_of.items() if s == "CANCELLED"}
    broken["every completed order was charged"] = completed - by_provider["charge"]
    broken["no cancelled order was charged"] = cancelled & by_provider["charge"]
    # Money taken and the business not told: never (the settle step has no deadline and a review twin).
    broken["no charged order left PENDING"] = {
        o for o, s in status_of.items() if s == "PENDING"
    } & by_provider["charge"]
    broken["every cancelled order had its stock released"] = cancelled - by_provider["release"]
    broken["no order was cancelled without a request"] = cancelled - set(cancels)
    return {
        "mode": "flow",
        "orders_total": len(order_ids),
        "orders_completed": statuses.get("COMPLETED", 0),
        "orders_failed": statuses.get("FAILED", 0),
        "orders_cancelled": statuses.get("CANCELLED", 0),
        "orders_needs_review": statuses.get("NEEDS_REVIEW", 0),
        "orders_pending": statuses.get("PENDING", 0),
        "cancel_requested": len(cancels),
        "cancelled_without_request": len(cancelled - set(cancels)),
        # Asked to cancel, but the signal came after the cancel window: charged and completed (legitimate).
        "cancel_too_late": len(set(cancels) - cancelled),
        "flow_instances": sum(len(v) for v in instances.values()),
        "duplicate_instances": sum(len(v) - 1 for v in instances.values() if len(v) > 1),
        "orders_without_instance": len(wanted - set(instances)),
        "instance_status": dict(Counter(inst.status.value for inst in full.values())),
        "status_mismatches": mismatches[:10],
        "steps": steps,
        "tasks_created": sum(len(v) for v in tasks_of.values()),
        "duplicate_tasks": duplicate_steps + orphan_tasks,
        "provider_calls": {p: per_provider.get(p, 0) for p in PROVIDERS},
        "provider_max_per_order": {p: most.get(p, 0) for p in PROVIDERS},
        "provider_requests": dict(requests),
        "completed_orders_charged_once": completed <= by_provider["charge"],
        # Money taken and the business not told: never (the settle step has no deadline and a review twin).
        "charged_orders_pending": len(
            {o for o, s in status_of.items() if s == "PENDING"} & by_provider["charge"]
        ),
        "cancelled_orders_uncharged": not (cancelled & by_provider["charge"]),
        "cancelled_orders_released": cancelled <= by_provider["release"],
        "failed_invariants": failed_invariants(broken),
        "faults_injected": faults,
        "history_sample": sample,
        "elapsed_s": round(elapsed, 1),
    }


#: The ``--flow`` demo's invariants, in the order the closing message names them (README "The order service as
#: a flow").
FLOW_INVARIANTS = (
    "every order is terminal",
    "every order has an instance",
    "one instance per order",
    "one task per step, every task a step",
    "the order's status is its instance's",
    "each provider acted at most once per order",
    "every completed order was charged",
    "no charged order left PENDING",
    "no cancelled order was charged",
    "every cancelled order had its stock released",
    "no order was cancelled without a request",
)


def failed_invariants(broken: dict[str, set[str]]) -> list[dict[str, Any]]:
    """``[{"invariant": name, "orders": [order ids, sorted]}]`` for every invariant with an order that broke
    it, in the order ``broken`` names them: what the closing message and ``--json`` report."""
    return [{"invariant": name, "orders": sorted(orders)} for name, orders in broken.items() if orders]


def describe_failures(failed: list[dict[str, Any]], *, shown: int = 10) -> str:
    """One line per failed invariant, naming up to ``shown`` of its orders."""
    lines = []
    for item in failed:
        orders = item["orders"]
        more = f" and {len(orders) - shown} more" if len(orders) > shown else ""
        lines.append(f"  - {item['invariant']}: {len(orders)} order(s): {', '.join(orders[:shown])}{more}")
    return "\n".join(lines)


def _history_sample(
    client: OrbitClient, full: dict[str, FlowInstance], status_of: dict[str, Any]
) -> list[str]:
    """One instance's history, one line per entry (a completed order's: its fork and join are the most
    telling), for the summary and the closing note."""
    if not full:
        return []
    order_id = next((o for o in full if status_of.get(o) == "COMPLETED"), next(iter(full)))
    inst = full[order_id]
    page = client.get_flow_history(NAMESPACE, inst.id, limit=100)
    lines = [f"instance {inst.id} (order {order_id}, {inst.status.value})"]
    for entry in page.items:
        change = f"{entry.from_state or '-'} → {entry.to_state}" if entry.to_state else ""
        where = f"{entry.node}#{entry.activation}" if entry.node else ""
        lines.append(f"{entry.at:%H:%M:%S.%f}"[:-3] + f" {entry.event} {where} {change}".rstrip())
    return lines


def check_flow(s: dict[str, Any]) -> bool:
    """Whether every invariant of the ``--flow`` demo held (module docstring)."""
    return not s["failed_invariants"]


def show_flow(s: dict[str, Any], ok: bool) -> None:
    out = Console()
    table = Table("measure", "value", title="Order service demo (fulfilment as a flow)")
    for key in ("orders_total", "orders_completed", "orders_failed", "orders_cancelled", "orders_needs_review",
                "orders_pending", "charged_orders_pending", "cancel_requested", "cancel_too_late", "flow_instances", "duplicate_instances", "steps",
                "tasks_created", "duplicate_tasks", "faults_injected", "elapsed_s"):  # fmt: skip
        table.add_row(key, str(s[key]))
    table.add_row("instance status", ", ".join(f"{k} {v}" for k, v in sorted(s["instance_status"].items())))
    for provider, n in s["provider_calls"].items():
        table.add_row(
            f"provider effects: {provider}", f"{n} (at most {s['provider_max_per_order'][provider]}/order)"
        )
    table.add_row(
        "provider requests", ", ".join(f"{k} {v}" for k, v in sorted(s["provider_requests"].items()))
    )
    out.print(table)
    if s["history_sample"]:
        out.print("History of one instance:\n  " + "\n  ".join(s["history_sample"]), highlight=False)
    if ok:
        out.print(
            "[green]Every order is terminal; one instance per order and one task per step; no provider acted "
            "twice for an order; no cancelled order was charged.[/green]"
        )
    else:
        out.print(
            "[red]These invariants did not hold (see the logs under .demo/order_service/):[/red]\n"
            + describe_failures(s["failed_invariants"]),
            highlight=False,
        )
