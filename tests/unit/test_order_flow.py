"""The order service as a flow (README "The order service as a flow"): the graph is valid and has the
documented shape, each step handler repeats no side effect when run again (a retried or crashed
attempt), the settle step's outcome, and the result consumer applying it once, never over a final order."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from examples.order_service import flow
from examples.order_service.consumer import apply_result
from examples.order_service.db import (
    business_orders,
    create_business_tables,
    provider_calls,
    provider_effects,
)
from examples.order_service.providers import PaymentDeclined
from examples.order_service.worker import make_flow_handlers, settle_outcome
from orbit_client import FlowGraph, ResultEvent, TaskStatus


@pytest.fixture
def engine(tmp_path: Path) -> sa.Engine:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'shop.db'}")
    create_business_tables(engine)
    return engine


def ctx(params: dict[str, Any], *, task_id: str = "t1", generation: int = 1) -> Any:
    return SimpleNamespace(task=SimpleNamespace(id=task_id), generation=generation, params=params,
                           raise_if_cancelled=lambda: None)  # fmt: skip


def test_the_graph_is_valid_and_honours_cancel_before_the_charge() -> None:
    graph = FlowGraph.model_validate(flow.GRAPH)
    nodes = graph.nodes
    assert graph.start == "reserve" and nodes["reserve"].next == "wait_cancel"  # type: ignore[union-attr]
    wait = nodes["wait_cancel"]
    assert (wait.type, wait.signal, wait.next, wait.on_timeout) == ("signal", "cancel", "release", "charge")  # type: ignore[union-attr]
    assert nodes["charge"].next == "fanout" and nodes["charge"].on_failure == "payment_grace"  # type: ignore[union-attr]
    assert nodes["fanout"].branches == ["receipt", "notify"] and nodes["fanout"].join == "joined"  # type: ignore[union-attr]
    assert nodes["payment_grace"].type == "timer" and nodes["payment_grace"].next == "remind_payment"  # type: ignore[union-attr]
    ends = {name: node.status for name, node in nodes.items() if node.type == "end"}  # type: ignore[union-attr]
    assert ends == {
        "done": "COMPLETED",
        "cancelled": "CANCELLED",
        "failed": "FAILED",
        "reviewed": "COMPLETED",
    }
    # Every path to an end passes a settle step: the order service always hears the outcome.
    settles = {name for name, node in nodes.items() if getattr(node, "handler", None) == flow.SETTLE_HANDLER}
    firsts = {"settle", "settle_cancelled", "settle_unpaid", "settle_reserve_failed"}
    assert settles == firsts | {f"{name}_review" for name in firsts}
    assert all(node.next in ends for name, node in nodes.items() if name in settles)  # type: ignore[union-attr]
    # ...and a settle step that fails goes to its review twin (NEEDS_REVIEW), never to a failed instance.
    assert all(nodes[name].on_failure == f"{name}_review" for name in firsts)  # type: ignore[union-attr]
    assert all(nodes[name].timeout_seconds is None for name in settles)  # type: ignore[union-attr]


def _effects(engine: sa.Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.select(provider_effects.c.provider, provider_effects.c.order_id)).all())  # type: ignore[arg-type]


def test_each_step_acts_once_however_often_it_runs(engine: sa.Engine) -> None:
    handlers = make_flow_handlers(engine)
    assert set(handlers) == set(flow.STEP_HANDLERS)
    order = {"order_id": "ord_1"}
    steps = [
        (flow.RESERVE, {**order, "sku": "SKU", "quantity": 2}, "reservation_id"),
        (flow.CHARGE, {**order, "amount": "12.50"}, "payment_id"),
        (flow.RECEIPT, {**order, "payment_id": "pay_x"}, "receipt_id"),
        (flow.NOTIFY, {**order, "customer": "Chen Wei", "kind": "order_confirmation"}, "message_id"),
        (flow.NOTIFY, {**order, "customer": "Chen Wei", "kind": "payment_reminder"}, "message_id"),
        (flow.RELEASE, {**order, "reason": "cancelled"}, "release_id"),
    ]
    for index, (handler, params, key) in enumerate(steps):
        first = handlers[handler](ctx(params, task_id=f"t{index}"))
        again = handlers[handler](ctx(params, task_id=f"t{index}", generation=2))  # journaled: skipped
        retried = handlers[handler](
            ctx(params, task_id=f"t{index}b", generation=3)
        )  # new task: provider replays
        assert first == again == retried and first["order_id"] == "ord_1" and first[key]
    assert _effects(engine) == sorted(
        (p, "ord_1") for p in ("reserve", "charge", "receipt", "notify", "remind", "release")
    )
    with engine.connect() as conn:
        outcomes = conn.scalars(sa.select(provider_calls.c.outcome)).all()
    assert outcomes.count("replayed") == len(steps)


def test_a_declined_charge_fails_its_step_without_an_effect(engine: sa.Engine) -> None:
    with pytest.raises(PaymentDeclined):
        make_flow_handlers(engine)[flow.CHARGE](ctx({"order_id": "ord_2", "amount": "900.00"}))
    assert _effects(engine) == []


def _step(status: str, result: Any = None, error: Any = None) -> dict[str, Any]:
    return {"status": status, "result": result, "error": error}


def test_settle_names_the_outcome_the_flow_reached() -> None:
    common = {"order_id": "o", "instance_id": "i", "reserve": _step("SUCCEEDED", {"reservation_id": "res_1"})}
    done = settle_outcome({**common, "status": "COMPLETED", "reason": None,
                           "charge": _step("SUCCEEDED", {"payment_id": "pay_1"}),
                           "receipt": _step("SUCCEEDED", {"receipt_id": "rct_1"})})  # fmt: skip
    assert done == {"order_id": "o", "flow_instance_id": "i", "status": "COMPLETED", "reservation_id": "res_1",
                    "payment_id": "pay_1", "receipt_id": "rct_1", "reason": None}  # fmt: skip
    no_receipt = settle_outcome({**common, "status": "COMPLETED", "reason": None,
                                 "charge": _step("SUCCEEDED", {"payment_id": "pay_1"}),
                                 "receipt": _step("FAILED", error={"message": "printer on fire"})})  # fmt: skip
    assert no_receipt["status"] == "NEEDS_REVIEW" and "printer on fire" in no_receipt["reason"]
    unpaid = settle_outcome({**common, "status": "FAILED", "reason": "payment declined",
                             "charge": _step("FAILED", error={"type": "PaymentDeclined", "message": "card limit"})})  # fmt: skip
    assert unpaid["status"] == "FAILED" and unpaid["reason"] == "payment declined: card limit"
    assert unpaid["payment_id"] is None


def _order(engine: sa.Engine, order_id: str, status: str = "PENDING") -> None:
    with engine.begin() as conn:
        conn.execute(business_orders.insert().values(
            order_id=order_id, request_key=uuid.uuid4().hex, sku="SKU", quantity=1, amount="10.00", status=status,
            fulfilment_key=f"{order_id}:fulfil"))  # fmt: skip


def _settled(result: Any, status: TaskStatus = TaskStatus.SUCCEEDED) -> ResultEvent:
    return ResultEvent(id=uuid.uuid4().hex, task_id=uuid.uuid4().hex, namespace="shop", queue="fulfilment",
                       handler=flow.SETTLE_HANDLER, status=status, result=result,
                       occurred_at=datetime.now(UTC), idempotency_key="flow:i:settle:t.1")  # fmt: skip


def test_the_consumer_applies_a_settled_outcome_once_and_never_over_a_final_order(engine: sa.Engine) -> None:
    _order(engine, "o1")
    _order(engine, "o2", status="COMPLETED")
    outcome = {"order_id": "o1", "flow_instance_id": "inst-1", "status": "CANCELLED", "reservation_id": "res_1",
               "payment_id": None, "receipt_id": None, "reason": "cancelled by the customer before the charge"}  # fmt: skip
    with engine.begin() as conn:
        apply_result(conn, _settled(outcome))
        apply_result(conn, _settled({**outcome, "status": "COMPLETED"}))  # a late second outcome: ignored
        apply_result(conn, _settled({**outcome, "order_id": "o2", "status": "FAILED"}))
        apply_result(conn, _settled(None, TaskStatus.FAILED))  # no outcome: nothing to apply
        # The flow's other steps change nothing in the order.
        apply_result(conn, _settled(outcome).model_copy(update={"handler": flow.CHARGE}))
    with engine.connect() as conn:
        rows = {r.order_id: r for r in conn.execute(sa.select(business_orders))}
    assert (rows["o1"].status, rows["o1"].flow_instance_id, rows["o1"].reservation_id) == (
        "CANCELLED",
        "inst-1",
        "res_1",
    )
    assert rows["o1"].failure_reason == "cancelled by the customer before the charge"
    assert rows["o2"].status == "COMPLETED"


def test_the_order_api_writes_the_order_and_its_flow_start_in_one_transaction(engine: sa.Engine) -> None:
    from examples.order_service.api import OrderRequest, _insert_order
    from outbox_adapter import Outbox

    Outbox(engine).migrate()
    order = OrderRequest(sku="SAKE-純米-720", quantity=3, amount="87.48", customer="Chen Wei")  # type: ignore[arg-type]
    with (
        pytest.raises(RuntimeError),
        engine.begin() as conn,
    ):  # a rollback leaves neither the order nor the row
        _insert_order(conn, order, "ORD-0", as_flow=True)
        raise RuntimeError
    with engine.begin() as conn:
        order_id = _insert_order(conn, order, "ORD-1", as_flow=True).order_id
    [row] = Outbox(engine).list_rows()
    assert (row.kind, row.flow, row.idempotency_key, row.business_ref) == (
        "flow",
        flow.FLOW_NAME,
        f"{order_id}:fulfil",
        f"order:{order_id}",
    )
    assert row.params == {"order_id": order_id, "sku": "SAKE-純米-720", "quantity": 3, "amount": "87.48",
                          "customer": "Chen Wei"}  # fmt: skip
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(business_orders)) == 1
