"""Task priority through the outbox (README "Task priority"), on SQLite, MariaDB and PostgreSQL business
databases: ``enqueue(options={"priority": n})`` stores it with the row's options, the relay sends it
(batched, and one by one to a server without the batch route), and the server's leases grant the
highest first; a bad priority is refused at enqueue with nothing written."""

from __future__ import annotations

import uuid

import pytest

from orbit_client import OrbitClient
from orbit_server.tasks import store
from outbox_adapter import Outbox, OutboxTables, OutboxUsageError, enqueue
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.outbox_support import run_fault_proxy
from tests.servers import RunningServer

NOT_FOUND = {"title": "Not Found", "status": 404, "code": "not_found"}


@pytest.mark.parametrize("route", ["batch", "single"])
def test_the_relay_carries_each_rows_priority_to_the_server(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory, route: str
) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    with orbit.engine.begin() as conn:
        store.create_queue(conn, ns.name, queue)
    sent = [("none", None), ("low", -50), ("top", 100), ("zero", 0), ("mid", 20)]
    with biz.engine.begin() as conn:
        for label, priority in sent:
            options = {"priority": priority} if priority is not None else None
            enqueue(conn, tables=tables, namespace=ns.name, queue=queue, handler="h", params={"label": label},
                    options=options)  # fmt: skip
    rows = Outbox(biz.engine, tables=tables).list_rows(limit=10)
    assert [(r.options or {}).get("priority") for r in rows] == [None, -50, 100, 0, 20]
    with run_fault_proxy(orbit.base_url) as (url, proxy):
        if route == "single":  # an older server: the batch route does not exist
            proxy.add("respond", path_contains="/tasks/batch", status=404, body=NOT_FOUND)
        stats = make_relay(base_url=url).run_once()
    assert stats.delivered == len(sent)
    with OrbitClient(orbit.base_url, api_key=ns.keys["work"]) as client:
        grants = client.lease_tasks(ns.name, queue, worker_id="w", max_tasks=10)
    got = [(g.task.params["label"], g.task.priority) for g in grants]  # type: ignore[index,call-overload]
    # The two at 0 (one without a priority) are due at the same time when batched: their order is their ids'.
    assert got[:2] == [("top", 100), ("mid", 20)] and got[4] == ("low", -50)
    assert sorted(got[2:4]) == [("none", 0), ("zero", 0)]


@pytest.mark.parametrize("priority", [101, -101, 2.5, "1", True])
def test_a_bad_priority_is_refused_at_enqueue_and_nothing_is_written(
    biz: Biz, tables: OutboxTables, ns: Namespace, priority: object
) -> None:
    with biz.engine.begin() as conn, pytest.raises(OutboxUsageError, match=r"invalid submission: priority: "):
        enqueue(conn, tables=tables, namespace=ns.name, queue="default", handler="h", params={},
                options={"priority": priority})  # fmt: skip
    assert Outbox(biz.engine, tables=tables).list_rows(limit=10) == []
