"""Typed task definitions end to end (README "Typed tasks"): ``enqueue(task=...)`` refuses wrong params
in the business transaction, a relay delivers the model's JSON, and a real worker hands the handler the
model; a task of that type with wrong params (a plain-string submission) fails without reaching it."""

from __future__ import annotations

import threading
import uuid
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel

from orbit_client import OrbitClient, TaskContext, TaskDefinition, TaskStatus, Worker
from outbox_adapter import Outbox, OutboxTables, OutboxUsageError, enqueue
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.outbox_support import wait_until
from tests.servers import RunningServer


class FulfilParams(BaseModel):
    order_id: int
    amount: Decimal


FULFIL = TaskDefinition("orders.fulfil", FulfilParams, queue="other", options={"max_attempts": 2})


def test_enqueue_checks_params_and_the_worker_receives_the_model(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    with pytest.raises(OutboxUsageError, match=r"order_id: Input should be a valid integer.*nothing was written"), biz.engine.begin() as conn:  # fmt: skip
        enqueue(
            conn,
            namespace=ns.name,
            task=FULFIL,
            params={"order_id": "forty-two", "amount": "1"},
            tables=tables,
        )
    with pytest.raises(OutboxUsageError, match="not the task definition's"), biz.engine.begin() as conn:
        enqueue(conn, namespace=ns.name, task=FULFIL, handler="orders.other", params={}, tables=tables)
    assert Outbox(biz.engine, tables=tables).list_rows() == []  # nothing written

    with biz.engine.begin() as conn:
        entry = enqueue(conn, namespace=ns.name, task=FULFIL, params=FulfilParams(order_id=42, amount=Decimal("9.90")),
                        options={"retry_safe": True}, tables=tables)  # fmt: skip
    row = Outbox(biz.engine, tables=tables).get(entry.id)
    assert (row.handler, row.queue) == ("orders.fulfil", "other")  # from the definition
    assert row.params == {"order_id": 42, "amount": "9.90"}
    assert row.options == {"max_attempts": 2, "retry_safe": True}  # the definition's, then the call's
    assert make_relay().run_once().delivered == 1
    row = Outbox(biz.engine, tables=tables).get(entry.id)

    with OrbitClient(orbit.base_url, api_key=ns.keys["submit"]) as submitter:
        # Submitted by a plain string and wrong params: the typed handler never sees it.
        bad = submitter.submit_task(
            ns.name, "other", "orders.fulfil", {"order_id": "x"}, idempotency_key=str(uuid.uuid4())
        )
        # Through the definition, by the client: checked before it is sent.
        with pytest.raises(Exception, match="amount"):
            FULFIL.submit(submitter, ns.name, {"order_id": 1}, idempotency_key=str(uuid.uuid4()))
        typed = FULFIL.submit(
            submitter, ns.name, {"order_id": 7, "amount": 1}, idempotency_key=str(uuid.uuid4())
        )

    seen: list[Any] = []

    def fulfil(ctx: TaskContext, params: FulfilParams) -> dict[str, Any]:
        seen.append(params)
        return {"order_id": params.order_id, "charged": str(params.amount)}

    with OrbitClient(orbit.base_url, api_key=ns.keys["work"]) as client:
        worker = Worker(client, ns.name, "other", {FULFIL.handler: FULFIL.handle(fulfil)}, poll_wait_seconds=0.2,
                        install_signal_handlers=False)  # fmt: skip
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            ids = [row.orbit_task_id, bad.task.id, typed.task.id]
            wait_until(lambda: all(client.get_task(ns.name, i).status.is_terminal for i in ids if i))  # type: ignore[arg-type]
        finally:
            worker.stop()
            thread.join(timeout=30)
        done = client.get_task(ns.name, row.orbit_task_id or "")
        refused = client.get_task(ns.name, bad.task.id)
    assert done.status == TaskStatus.SUCCEEDED and done.result == {"order_id": 42, "charged": "9.90"}
    assert sorted(p.order_id for p in seen) == [7, 42] and all(isinstance(p, FulfilParams) for p in seen)
    assert refused.status == TaskStatus.FAILED and refused.attempt_count == 1
    assert isinstance(refused.error, dict) and refused.error["type"] == "OrbitUsageError"
    assert "FulfilParams" in refused.error["message"]
