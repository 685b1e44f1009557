"""Flow retention, on SQLite and MariaDB (issue 20 #10): a finished instance is purged with its tokens,
steps, timers, signals, internal events and history, in the inventory's counts; its start key is kept as a
tombstone for the key window, so a replayed start answers 410 and never starts a second instance."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_client import OrbitClient
from orbit_server.db.engine import db_now
from orbit_server.db.schema import (
    flow_events,
    flow_history,
    flow_instances,
    flow_signals,
    flow_start_tombstones,
    flow_steps,
    flow_tokens,
)
from orbit_server.retention import purge as retention
from outbox_adapter import _flow_sending as flow_sending
from outbox_adapter import _queries as q
from outbox_adapter._outcomes import Verdict
from tests.conftest import DatabaseFactory
from tests.flow_support import FlowApi, ok
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

QUEUE = "steps"
GRAPH = {"start": "a", "nodes": {
    "a": {"type": "task", "queue": QUEUE, "handler": "a", "next": "e"},
    "e": {"type": "end"}}}  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def orbit(
    request: pytest.FixtureRequest, make_database: DatabaseFactory
) -> Iterator[tuple[RunningServer, FlowApi]]:
    with run_server(make_database(request.param)) as server:
        ns = f"ret{uuid.uuid4().hex[:6]}"
        api = FlowApi(server.base_url, ns, server.add_namespace(ns, queues=(QUEUE,)))
        yield server, api
        api.close()


def server_key(api: FlowApi) -> str:
    """The submit key of the test's namespace (as the relay holds it)."""
    return str(api.http["submit"].headers["Authorization"]).removeprefix("Bearer ")


def _rows(server: RunningServer, instance_id: str) -> dict[str, int]:
    with server.engine.connect() as conn:
        return {
            t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t).where(
                (t.c.id if t is flow_instances else t.c.instance_id) == instance_id)).scalar_one())
            for t in (flow_instances, flow_tokens, flow_steps, flow_signals, flow_events, flow_history)
        }  # fmt: skip


def _finished_instance(api: FlowApi, flow: str, key: str) -> dict[str, Any]:
    instance = api.start(flow, {"n": 1}, key=key)
    api.signal(instance["id"], "spare")  # a buffered, never consumed signal: owned too
    assert api.work(QUEUE, ok(), wait=5)
    return api.wait_status(instance["id"], "COMPLETED")


def test_a_purged_instance_leaves_a_tombstone_and_a_replayed_start_answers_410(
    orbit: tuple[RunningServer, FlowApi],
) -> None:
    server, api = orbit
    flow = f"f{uuid.uuid4().hex[:6]}"
    api.publish(flow, GRAPH)
    key = f"order-{uuid.uuid4().hex[:8]}:fulfil"
    done = _finished_instance(api, flow, key)
    running = api.start(flow, {"n": 2})  # its step task waits: not finished, never purged
    before = _rows(server, done["id"])
    assert before["flow_instances"] == 1 and before["flow_steps"] == 1 and before["flow_history"] > 0
    with server.engine.begin() as conn:
        cutoff = db_now(conn) + timedelta(seconds=1)
        found = retention.inventory(conn, cutoff)
    assert found.finished_flow_instances >= 1 and found.purge.flow_instances == found.finished_flow_instances
    _, deleted = retention.purge(server.engine, actor="test", tasks_before=cutoff, keys=False, batch_size=1)
    assert deleted.flow_instances == found.purge.flow_instances
    assert deleted.flow_history == found.purge.flow_history and deleted.flow_steps == found.purge.flow_steps
    assert _rows(server, done["id"]) == dict.fromkeys(before, 0)
    assert _rows(server, running["id"])["flow_instances"] == 1
    with server.engine.connect() as conn:
        tomb = conn.execute(
            sa.select(flow_start_tombstones).where(flow_start_tombstones.c.instance_id == done["id"])
        ).mappings().one()  # fmt: skip
    assert tomb["idempotency_key"] == key and tomb["expires_at"] > tomb["finished_at"]

    replay = api.post("submit", f"/flows/{flow}/instances", {"input": {"n": 1}}, **{"Idempotency-Key": key})
    assert replay.status_code == 410, replay.text
    assert replay.json()["code"] == "flow_instance_purged" and replay.json()["instance_id"] == done["id"]
    other = api.post("submit", f"/flows/{flow}/instances", {"input": {"n": 9}}, **{"Idempotency-Key": key})
    assert other.status_code == 409, other.text  # another request under the key: a conflict, as before
    # The relay's resend of a flow row whose answer was lost: DELIVERED with the purged instance.
    claim = q.Claim(
        id=1, idempotency_key=key, namespace=api.ns, queue="", handler="", ordering_key=None, business_ref=None,
        attempts=2, send_count=2, budget=5, token="t", lease_expires_at=datetime.now(UTC), params={"n": 1},
        kind="flow", flow=flow,
    )  # fmt: skip
    with OrbitClient(server.base_url, api_key=server_key(api)) as client:
        outcome = flow_sending.start_flow(client, claim, None, None)
    assert (outcome.verdict, outcome.task_id, outcome.status_code) == (Verdict.DELIVERED, done["id"], 410)
    with server.engine.connect() as conn:
        again = conn.execute(
            sa.select(sa.func.count()).where(flow_instances.c.idempotency_key == key)
        ).scalar()
    assert again == 0  # never a second instance


def test_expired_tombstones_go_with_the_keys(orbit: tuple[RunningServer, FlowApi]) -> None:
    server, api = orbit
    flow = f"f{uuid.uuid4().hex[:6]}"
    api.publish(flow, GRAPH)
    done = _finished_instance(api, flow, f"k-{uuid.uuid4().hex[:8]}")
    with server.engine.begin() as conn:
        cutoff = db_now(conn) + timedelta(seconds=1)
    retention.purge(server.engine, actor="test", tasks_before=cutoff, keys=False)
    with server.engine.begin() as conn:  # the key window has passed
        conn.execute(
            flow_start_tombstones.update()
            .where(flow_start_tombstones.c.instance_id == done["id"])
            .values(expires_at=flow_start_tombstones.c.finished_at)
        )
        assert retention.inventory(conn, None).purge.flow_start_tombstones >= 1
    _, deleted = retention.purge(server.engine, actor="test", tasks_before=None, keys=True)
    assert deleted.flow_start_tombstones >= 1
    with server.engine.connect() as conn:
        left = conn.execute(
            sa.select(sa.func.count()).where(flow_start_tombstones.c.instance_id == done["id"])
        ).scalar()
    assert left == 0
