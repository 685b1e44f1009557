"""The order-fulfilment flow's paths on a real server with the worker's step handlers (README "The order
service as a flow"), with short waits: a cancel before the charge, a declined charge reminded after the
timer and given up after the payment wait, and a declined charge whose customer updated the card (the
charge runs again, a second activation). The settle step's result is the outcome the consumer applies."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from examples.order_service import flow
from examples.order_service.db import create_business_tables, provider_effects
from examples.order_service.worker import make_flow_handlers
from orbit_client import FlowInstance, FlowInstanceStatus, OrbitClient, Worker
from tests.conftest import DatabaseFactory
from tests.flow_support import until
from tests.servers import RunningServer, run_server

NS = flow.NAMESPACE


@pytest.fixture(scope="module")
def orbit(make_database: DatabaseFactory) -> Iterator[tuple[RunningServer, dict[str, str]]]:
    with run_server(make_database("sqlite")) as running:
        yield running, running.add_namespace(NS, (flow.QUEUE,))


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'shop.db'}", connect_args={"check_same_thread": False})
    create_business_tables(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def client(orbit: tuple[RunningServer, dict[str, str]], shop: sa.Engine) -> Iterator[OrbitClient]:
    """A submit client, with the flow (short waits, as a new flow name per test) served by a worker thread."""
    running, keys = orbit
    with OrbitClient(running.base_url, api_key=keys["work"]) as work:
        worker = Worker(work, NS, flow.QUEUE, make_flow_handlers(shop), concurrency=4, lease_seconds=10,
                        poll_wait_seconds=0.2, install_signal_handlers=False)  # fmt: skip
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        with OrbitClient(running.base_url, api_key=keys["submit"]) as submit:
            yield submit
        worker.stop()
        thread.join(timeout=30)


def _start(client: OrbitClient, amount: str, **waits: float) -> tuple[str, FlowInstance]:
    name = f"order-fulfilment-{uuid.uuid4().hex[:6]}"
    client.publish_flow(NS, name, flow.graph(**waits))
    order_id = f"ord_{uuid.uuid4().hex[:12]}"
    started = client.start_flow(NS, name, {"order_id": order_id, "sku": "SKU-1", "quantity": 1, "amount": amount,
                                           "customer": "Ada"}, idempotency_key=f"{order_id}:fulfil")  # fmt: skip
    return order_id, started.instance


def _finished(client: OrbitClient, instance: FlowInstance) -> FlowInstance:
    def done() -> FlowInstance | None:
        now = client.get_flow_instance(NS, instance.id)
        return now if now.status is not FlowInstanceStatus.RUNNING else None

    result: FlowInstance = until(done, timeout=60, interval=0.05, what="the instance to finish")
    return result


def _path(instance: FlowInstance) -> list[tuple[str, str]]:
    return [(step.node, str(step.status)) for step in sorted(instance.steps, key=lambda s: s.created_at)]


def _settled(instance: FlowInstance) -> dict[str, Any]:
    [step] = [s for s in instance.steps if s.node.startswith("settle")]
    assert isinstance(step.result, dict)
    return step.result


def _effects(shop: sa.Engine, order_id: str) -> list[str]:
    with shop.connect() as conn:
        return sorted(
            conn.scalars(
                sa.select(provider_effects.c.provider).where(provider_effects.c.order_id == order_id)
            )
        )


def test_a_cancel_before_the_charge_releases_the_stock_uncharged(
    client: OrbitClient, shop: sa.Engine
) -> None:
    order_id, instance = _start(client, "10.00", cancel_window=30)
    client.signal_flow(
        NS, instance.id, "cancel", {"reason": "changed my mind"}, idempotency_key=f"{order_id}:c"
    )
    done = _finished(client, instance)
    assert done.status is FlowInstanceStatus.CANCELLED
    assert [node for node, _ in _path(done)] == ["reserve", "release", "settle_cancelled"]
    assert _settled(done)["status"] == "CANCELLED" and _settled(done)["flow_instance_id"] == instance.id
    assert _effects(shop, order_id) == ["release", "reserve"]


def test_a_declined_charge_is_reminded_then_given_up(client: OrbitClient, shop: sa.Engine) -> None:
    order_id, instance = _start(client, "900.00", cancel_window=0.1, payment_grace=0.2, payment_wait=0.5)
    done = _finished(client, instance)
    assert done.status is FlowInstanceStatus.FAILED
    assert _path(done) == [("reserve", "SUCCEEDED"), ("charge", "FAILED"), ("remind_payment", "SUCCEEDED"),
                           ("release_unpaid", "SUCCEEDED"), ("settle_unpaid", "SUCCEEDED")]  # fmt: skip
    outcome = _settled(done)
    assert outcome["status"] == "FAILED" and "card limit exceeded" in outcome["reason"]
    assert _effects(shop, order_id) == ["release", "remind", "reserve"]  # never charged
    events = [entry.event for entry in client.get_flow_history(NS, instance.id, limit=200).items]
    assert "timer_fired" in events  # the payment grace timer


def test_an_updated_card_runs_the_charge_again(client: OrbitClient, shop: sa.Engine) -> None:
    order_id, instance = _start(client, "900.00", cancel_window=0.1, payment_grace=0.2, payment_wait=30)

    def waiting_for_payment() -> bool:
        now = client.get_flow_instance(NS, instance.id)
        return any(t.waiting_for == "signal:payment_updated" for t in now.tokens)

    until(waiting_for_payment, timeout=30, what="the wait for payment_updated")
    client.signal_flow(
        NS, instance.id, "payment_updated", {"card": "new"}, idempotency_key=f"{order_id}:card"
    )
    # The card limit still declines it: a second activation of charge, a second wait; then no update.
    until(lambda: [n for n, _ in _path(client.get_flow_instance(NS, instance.id))].count("charge") == 2,
          timeout=30, what="the second charge")  # fmt: skip
    charges = [s for s in client.get_flow_instance(NS, instance.id).steps if s.node == "charge"]
    assert len({s.task_id for s in charges}) == 2 and len({s.activation for s in charges}) == 2


def test_a_settle_step_that_fails_tells_the_order_service_to_review_a_charged_order(
    orbit: tuple[RunningServer, dict[str, str]], shop: sa.Engine
) -> None:
    """Regression (issue 20 #9): under load the settle step itself failed (deadline_exceeded), so the
    instance failed with the card charged and the order PENDING for ever. A settle step has no deadline
    and 100 attempts, and its failure goes to a twin that settles the order NEEDS_REVIEW."""
    running, _ = orbit
    ns = f"shop-{uuid.uuid4().hex[:6]}"
    keys = running.add_namespace(ns, (flow.QUEUE,))
    graph = flow.graph(cancel_window=0.1)
    assert all(
        "timeout_seconds" not in n for n in graph["nodes"].values() if n.get("handler") == flow.SETTLE_HANDLER
    )
    handlers = make_flow_handlers(shop)
    settle = handlers[flow.SETTLE_HANDLER]

    def broken_settle(ctx: Any) -> dict[str, Any]:
        if ctx.params["status"] == "COMPLETED":
            raise ValueError("settle broke")  # not retryable: the task fails at once
        return settle(ctx)

    handlers[flow.SETTLE_HANDLER] = broken_settle
    with (
        OrbitClient(running.base_url, api_key=keys["work"]) as work,
        OrbitClient(running.base_url, api_key=keys["submit"]) as submit,
    ):
        worker = Worker(work, ns, flow.QUEUE, handlers, concurrency=4, lease_seconds=10,
                        poll_wait_seconds=0.2, install_signal_handlers=False)  # fmt: skip
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            submit.publish_flow(ns, "order-fulfilment", graph)
            order_id = f"ord_{uuid.uuid4().hex[:12]}"
            started = submit.start_flow(ns, "order-fulfilment", {"order_id": order_id, "sku": "SKU-1", "quantity": 1,
                                        "amount": "10.00", "customer": "Ada"}, idempotency_key=f"{order_id}:f")  # fmt: skip

            def done() -> FlowInstance | None:
                now = submit.get_flow_instance(ns, started.instance.id)
                return now if now.status is not FlowInstanceStatus.RUNNING else None

            finished: FlowInstance = until(done, timeout=60, interval=0.05, what="the instance to finish")
        finally:
            worker.stop()
            thread.join(timeout=30)
    assert finished.status is FlowInstanceStatus.COMPLETED  # not FAILED with the card charged
    [review] = [s for s in finished.steps if s.node == "settle_review"]
    assert isinstance(review.result, dict)
    assert review.result["status"] == "NEEDS_REVIEW" and review.result["payment_id"] is not None
    assert "settle step failed" in review.result["reason"]
    assert "charge" in _effects(shop, order_id)
