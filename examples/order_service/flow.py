"""Fulfilment as an Orbit flow (README "The order service as a flow"): ``make demo DEMO_ARGS=--flow``.

The same business process as the ``orders.fulfil`` handler, with each step a task of its own and the
platform owning the order of steps, the waits and the fork/join::

    reserve ──▶ wait_cancel ──(signal "cancel")──▶ release ──▶ settle_cancelled ──▶ cancelled (CANCELLED)
       │            └──(no cancel within CANCEL_WINDOW s)──▶ charge ──▶ fanout ─┬─ receipt ─┐
       │                                                         │              └─ notify ──┴▶ joined ──▶ settle ──▶ done
       │                                              (declined) ▼
       │        payment_grace (timer) ──▶ remind_payment ──▶ wait_payment ──(signal "payment_updated")──▶ charge
       │                                                         └──(none within PAYMENT_WAIT s)──▶ release_unpaid
       │                                                                                   ──▶ settle_unpaid ──▶ failed
       └──(reservation failed)──▶ settle_reserve_failed ──▶ failed (FAILED)

Decisions (documented in the README):

- **Cancel before the charge** is a ``signal`` node with a timeout: the flow waits ``CANCEL_WINDOW``
  seconds for ``cancel`` after the stock is reserved (signals are buffered, so a cancel sent before the
  wait began counts); the timeout branch goes on to the charge. A ``choice`` on ``$.signals.cancel``
  would only see a cancel that had already arrived, with no window for the customer. A cancel that
  arrives after the window stays recorded and unconsumed: the order is charged and completes.
- **Payment reminder**: a declined charge does not fail the order at once. A ``timer`` waits
  ``PAYMENT_GRACE`` seconds (in production: hours), the customer is reminded (``orders.notify`` with
  ``kind: payment_reminder``), and the flow waits ``PAYMENT_WAIT`` seconds for ``payment_updated``: with
  it the charge runs again (a new activation of ``charge``); without it the stock is released and the
  order FAILS.
- **Results back to the order service** go through the inbox as today: every path ends in an
  ``orders.settle`` step whose result is the order's outcome (``{order_id, status, ids, reason}``);
  the result consumer applies that task's result event to ``business_orders`` exactly once
  (:func:`~.consumer.apply_result`). The settle step has no side effect, so it is always safe to run:
  it has **no deadline** and up to :data:`SETTLE_ATTEMPTS` attempts, and should it fail all the same,
  its ``on_failure`` is its review twin (``settle_review`` for ``settle``, ...), a settle step with
  the same steps that tells the order service ``NEEDS_REVIEW`` ("the settle step failed"). No path
  ends with the card charged and the order ``PENDING``.
- **Deadlines** of the other steps are :data:`STEP_DEADLINE` seconds (each task's whole life, queue
  time included): long enough for a loaded machine, where 60 s was not.
- **Idempotent steps**: each step is one task; its side effect goes to a provider with a key per order
  and step (``{order_id}:charge``) and the attempt's fencing generation, and is journaled per task,
  exactly like the steps of ``orders.fulfil``. A receipt or notification that keeps failing does not
  undo a charge: ``receipt`` fails over to the join and the order ends ``NEEDS_REVIEW`` ("charged,
  no receipt"); a failed notification is skipped.
"""

from __future__ import annotations

from typing import Any

from orbit_client import FlowGraph, FlowVersion, OrbitClient

__all__ = [
    "CANCEL_SIGNAL",
    "CANCEL_WINDOW",
    "FLOW_NAME",
    "GRAPH",
    "PAYMENT_GRACE",
    "PAYMENT_SIGNAL",
    "PAYMENT_WAIT",
    "SETTLE_ATTEMPTS",
    "SETTLE_HANDLER",
    "STEP_DEADLINE",
    "STEP_HANDLERS",
    "graph",
    "publish",
]

FLOW_NAME = "order-fulfilment"
NAMESPACE, QUEUE = "shop", "fulfilment"
CANCEL_SIGNAL, PAYMENT_SIGNAL = "cancel", "payment_updated"
#: Seconds after the reservation during which a ``cancel`` signal releases the order uncharged.
CANCEL_WINDOW = 2.0
#: Seconds between a declined charge and the payment reminder (in production: hours).
PAYMENT_GRACE = 1.0
#: Seconds the flow waits for ``payment_updated`` after the reminder before it gives the order up.
PAYMENT_WAIT = 3.0
#: Seconds a step task may take, queueing and all its attempts included (its deadline).
STEP_DEADLINE = 900
#: Attempts of a settle step (the most a task node takes); it has no deadline.
SETTLE_ATTEMPTS = 100

RESERVE, CHARGE, RECEIPT, NOTIFY, RELEASE = (
    "orders.reserve", "orders.charge", "orders.receipt", "orders.notify", "orders.release",
)  # fmt: skip
SETTLE_HANDLER = "orders.settle"
STEP_HANDLERS = (RESERVE, CHARGE, RECEIPT, NOTIFY, RELEASE, SETTLE_HANDLER)

_ORDER = "$.input.order_id"


def _task(handler: str, params: dict[str, Any], next_: str, **extra: Any) -> dict[str, Any]:
    # Retry-safe steps (the providers' keys make a rerun harmless), 5 attempts as orders.fulfil has.
    node = {"type": "task", "queue": QUEUE, "handler": handler, "params": params, "max_attempts": 5,
            "retry_safe": True, "timeout_seconds": STEP_DEADLINE, "next": next_}  # fmt: skip
    return node | extra


def _settle(status: str, reason: str | None, next_: str, **steps: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "order_id": _ORDER,
        "instance_id": "$.instance.id",
        "status": status,
        "reason": reason,
    }
    params |= {name: path for name, path in steps.items()}
    node = _task(SETTLE_HANDLER, params, next_, max_attempts=SETTLE_ATTEMPTS)
    del node["timeout_seconds"]  # no deadline: the business must always be told
    return node


_REVIEW_REASON = "the settle step failed; check the order (it may be charged) and its flow instance by hand"


def _with_reviews(nodes: dict[str, Any]) -> dict[str, Any]:
    """Give every settle node an ``on_failure``: its twin ``<name>_review`` (same steps, status
    ``NEEDS_REVIEW``), which ends the instance at ``reviewed``."""
    out = dict(nodes)
    for name, node in nodes.items():
        if node.get("handler") == SETTLE_HANDLER:
            out[name] = node | {"on_failure": f"{name}_review"}
            review = node | {"next": "reviewed"}
            review["params"] = node["params"] | {"status": "NEEDS_REVIEW", "reason": _REVIEW_REASON}
            out[f"{name}_review"] = review
    out["reviewed"] = {"type": "end", "output": {"order_id": _ORDER}}
    return out


def graph(
    *,
    cancel_window: float = CANCEL_WINDOW,
    payment_grace: float = PAYMENT_GRACE,
    payment_wait: float = PAYMENT_WAIT,
) -> dict[str, Any]:
    """The fulfilment graph as JSON data (README "Flows: graph format"); the waits in seconds."""
    return {
        "start": "reserve",
        "nodes": _with_reviews(
            {
                "reserve": _task(
                    RESERVE,
                    {"order_id": _ORDER, "sku": "$.input.sku", "quantity": "$.input.quantity"},
                    "wait_cancel",
                    on_failure="settle_reserve_failed",
                ),
                "wait_cancel": {
                    "type": "signal",
                    "signal": CANCEL_SIGNAL,
                    "timeout_seconds": cancel_window,
                    "next": "release",
                    "on_timeout": "charge",
                },
                "charge": _task(
                    CHARGE,
                    {"order_id": _ORDER, "amount": "$.input.amount"},
                    "fanout",
                    on_failure="payment_grace",
                ),
                "fanout": {"type": "parallel", "branches": ["receipt", "notify"], "join": "joined"},
                "receipt": _task(
                    RECEIPT,
                    {"order_id": _ORDER, "payment_id": "$.steps.charge.result.payment_id"},
                    "joined",
                    on_failure="joined",
                ),
                "notify": _task(
                    NOTIFY,
                    {"order_id": _ORDER, "customer": "$.input.customer", "kind": "order_confirmation"},
                    "joined",
                    on_failure="joined",
                ),
                "joined": {"type": "join", "next": "settle"},
                "settle": _settle(
                    "COMPLETED",
                    None,
                    "done",
                    reserve="$.steps.reserve",
                    charge="$.steps.charge",
                    receipt="$.steps.receipt",
                ),
                "done": {
                    "type": "end",
                    "output": {"order_id": _ORDER, "payment_id": "$.steps.charge.result.payment_id"},
                },
                # Cancelled before the charge: give the stock back, then tell the order service.
                "release": _task(RELEASE, {"order_id": _ORDER, "reason": "cancelled"}, "settle_cancelled"),
                "settle_cancelled": _settle(
                    "CANCELLED",
                    "cancelled by the customer before the charge",
                    "cancelled",
                    reserve="$.steps.reserve",
                ),
                "cancelled": {"type": "end", "status": "CANCELLED", "output": {"order_id": _ORDER}},
                # Declined: remind after a grace period, wait for a new card, else give the order up.
                "payment_grace": {"type": "timer", "seconds": payment_grace, "next": "remind_payment"},
                "remind_payment": _task(
                    NOTIFY,
                    {"order_id": _ORDER, "customer": "$.input.customer", "kind": "payment_reminder"},
                    "wait_payment",
                    on_failure="wait_payment",
                ),
                "wait_payment": {
                    "type": "signal",
                    "signal": PAYMENT_SIGNAL,
                    "timeout_seconds": payment_wait,
                    "next": "charge",
                    "on_timeout": "release_unpaid",
                },
                "release_unpaid": _task(RELEASE, {"order_id": _ORDER, "reason": "unpaid"}, "settle_unpaid"),
                "settle_unpaid": _settle(
                    "FAILED",
                    "payment declined and not updated after the reminder",
                    "failed",
                    reserve="$.steps.reserve",
                    charge="$.steps.charge",
                ),
                "settle_reserve_failed": _settle(
                    "FAILED", "the stock could not be reserved", "failed", reserve="$.steps.reserve"
                ),
                "failed": {"type": "end", "status": "FAILED", "output": {"order_id": _ORDER}},
            }
        ),
    }


#: The graph with the default waits, validated by the client's model at import (a typo fails here).
GRAPH = FlowGraph.model_validate(graph()).model_dump(mode="json", exclude_none=True)


def publish(client: OrbitClient, *, graph_data: dict[str, Any] | None = None) -> FlowVersion:
    """Publish the fulfilment graph (idempotent: the identical graph returns its existing version)."""
    return client.publish_flow(NAMESPACE, FLOW_NAME, graph_data or GRAPH, description="order fulfilment")
