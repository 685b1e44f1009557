"""Flow rows against a real Orbit server (README "Starting flows from the outbox"), on each business
database: the relay starts one instance per row with the row's key, a resend replays it, an unknown
flow ends the row DEAD, and reconcile finds an instance by the key."""

from __future__ import annotations

import json
from datetime import datetime

import sqlalchemy as sa

from orbit_client import OrbitClient
from outbox_adapter import Outbox, OutboxTables, enqueue_flow
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.servers import RunningServer

GRAPH = {
    "start": "wait",
    "nodes": {"wait": {"type": "timer", "seconds": 3600, "next": "done"}, "done": {"type": "end"}},
}


def test_the_relay_starts_one_instance_per_flow_row_and_reconcile_finds_it_by_key(
    orbit: RunningServer, ns: Namespace, biz: Biz, tables: OutboxTables, make_relay: RelayFactory
) -> None:
    with OrbitClient(orbit.base_url, api_key=ns.keys["submit"]) as client:
        client.publish_flow(ns.name, "parked", GRAPH)
        with biz.engine.begin() as conn:
            ids = [
                enqueue_flow(conn, namespace=ns.name, flow="parked", input={"i": i}, idempotency_key=f"{ns.name}-{i}",
                             tables=tables).id
                for i in range(3)
            ]  # fmt: skip
            unknown = enqueue_flow(conn, namespace=ns.name, flow="never-published", tables=tables).id
        stats = make_relay().run_once()
        assert (stats.delivered, stats.dead) == (3, 1)
        outbox = Outbox(biz.engine, tables=tables)
        for i, row_id in enumerate(ids):
            row = outbox.get(row_id)
            instance = client.get_flow_instance(ns.name, row.orbit_task_id or "")
            assert (instance.flow, instance.input, instance.idempotency_key) == (
                "parked",
                {"i": i},
                f"{ns.name}-{i}",
            )
        assert "orbit-server flow publish" in (outbox.get(unknown).last_error or "")
        # The record of a send lost (a relay that died after the server started the instance): the row is
        # sent again with the same key and the server replays the same instance; nothing new is started.
        o = tables.outbox
        with biz.engine.begin() as conn:
            conn.execute(
                sa.update(o)
                .where(o.c.id == ids[0])
                .values(
                    state="PENDING", orbit_task_id=None, lease_token=None, available_at=datetime(2000, 1, 1)
                )
            )
        first = client.find_flow_instance(ns.name, f"{ns.name}-0")
        assert make_relay().run_once().replayed == 1
        assert outbox.get(ids[0]).orbit_task_id == (first.id if first else None)
        # Outcome unknown and the budget spent: reconcile asks the server by the key.
        with biz.engine.begin() as conn:
            conn.execute(
                sa.update(o).where(o.c.id == ids[1]).values(state="NEEDS_RECONCILE", orbit_task_id=None)
            )
        [decision] = outbox.reconcile(client, actor="test")
        assert (decision.row_id, decision.decision, decision.applied) == (ids[1], "delivered", True)
        page = client.list_flow_instances(ns.name, flow="parked")
        assert len(page.items) == 3  # one instance per row, however often it was sent


def test_orbit_outbox_relays_and_shows_flow_rows(orbit: RunningServer, ns: Namespace, biz: Biz) -> None:
    from click.testing import CliRunner

    from outbox_adapter.cli import main

    table = f"cli_{ns.name[3:]}"
    db = ["--database-url", biz.url.render_as_string(hide_password=False), "--table", table]
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["submit"], "ORBIT_OUTBOX_BACKOFF_BASE": "0"}
    runner = CliRunner()
    assert runner.invoke(main, ["migrate", *db]).exit_code == 0
    with OrbitClient(orbit.base_url, api_key=ns.keys["submit"]) as client:
        client.publish_flow(ns.name, "parked", GRAPH)
    with biz.engine.begin() as conn:
        row_id = enqueue_flow(
            conn, namespace=ns.name, flow="parked", input={"x": 1}, tables=OutboxTables(name=table)
        ).id
    relayed = runner.invoke(main, ["relay", *db, "--once", "--json"], env=env, catch_exceptions=False)
    assert json.loads(relayed.stdout)["delivered"] == 1
    [shown] = json.loads(runner.invoke(main, ["list", *db, "--json"], catch_exceptions=False).stdout)
    assert (shown["id"], shown["kind"], shown["flow"], shown["state"]) == (
        row_id,
        "flow",
        "parked",
        "DELIVERED",
    )
    table_view = runner.invoke(main, ["list", *db], env={"COLUMNS": "250"}, catch_exceptions=False).stdout
    assert f"{ns.name}/flow:parked" in table_view and "(flow start)" in table_view
