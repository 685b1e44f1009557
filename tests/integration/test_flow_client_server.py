"""The flow calls of OrbitClient / AsyncOrbitClient against a real server (SQLite and MariaDB), and the
README's flow client example as written."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orbit_client import (
    AsyncOrbitClient,
    FlowInstanceStatus,
    IdempotencyConflictError,
    InvalidTransitionError,
    NotFoundError,
    OrbitClient,
    PermissionDeniedError,
    TaskStatus,
)
from tests.conftest import DatabaseFactory
from tests.flow_support import until
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

REPO = Path(__file__).resolve().parents[2]
GRAPH: dict[str, Any] = {
    "start": "approval",
    "nodes": {
        "approval": {"type": "signal", "signal": "approve", "timeout_seconds": 3600, "next": "ship",
                     "on_timeout": "expired"},
        "ship": {"type": "task", "queue": "fulfilment", "handler": "orders.ship",
                 "params": {"order_id": "$.input.order_id", "by": "$.signals.approve.by"}, "next": "done"},
        "done": {"type": "end"},
        "expired": {"type": "end", "status": "CANCELLED"},
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database(request.param)) as running:
        running.keys = running.add_namespace("shop", ("fulfilment",))
        yield running


def client(server: RunningServer, role: str) -> OrbitClient:
    return OrbitClient(server.base_url, api_key=server.keys[role], timeout=30)


def test_publish_start_signal_run_and_read_the_history(server: RunningServer) -> None:
    flow = f"approval-{uuid.uuid4().hex[:6]}"
    with client(server, "submit") as submit, client(server, "work") as work, client(server, "admin") as admin:
        first = submit.publish_flow("shop", flow, GRAPH, description="first")
        assert (first.version, first.description) == (1, "first")
        assert submit.publish_flow("shop", flow, GRAPH).digest == first.digest  # identical: the same version
        assert [(f.name, f.latest_version) for f in submit.list_flows("shop") if f.name == flow] == [
            (flow, 1)
        ]
        assert [v.version for v in submit.list_flow_versions("shop", flow)] == [1]
        assert submit.get_flow_version("shop", flow, 1).graph.start == "approval"
        with pytest.raises(NotFoundError) as missing:
            submit.get_flow_version("shop", flow, 9)
        assert missing.value.code == "flow_version_not_found"

        key = f"order-{uuid.uuid4()}"
        started = submit.start_flow("shop", flow, {"order_id": 7}, idempotency_key=key)
        again = submit.start_flow("shop", flow, {"order_id": 7}, idempotency_key=key)
        assert (started.replayed, again.replayed) == (False, True)
        assert (
            again.instance.id == started.instance.id and started.instance.status is FlowInstanceStatus.RUNNING
        )
        with pytest.raises(IdempotencyConflictError) as conflict:
            submit.start_flow("shop", flow, {"order_id": 8}, idempotency_key=key)
        assert conflict.value.outcome_known and not conflict.value.retryable
        with pytest.raises(NotFoundError) as unknown:
            submit.start_flow("shop", "no-such-flow", idempotency_key=str(uuid.uuid4()))
        assert unknown.value.code == "flow_not_found"
        found = submit.find_flow_instance("shop", key)
        assert found is not None and found.id == started.instance.id
        assert submit.find_flow_instance("shop", f"{key}-never") is None
        instance_id = started.instance.id
        assert started.instance.tokens[0].waiting_for == "signal:approve"

        sent = submit.signal_flow("shop", instance_id, "approve", {"by": "ops"}, idempotency_key=f"{key}:a")
        replay = submit.signal_flow("shop", instance_id, "approve", {"by": "ops"}, idempotency_key=f"{key}:a")
        assert (sent.replayed, replay.replayed) == (False, True) and replay.signal.id == sent.signal.id
        with pytest.raises(IdempotencyConflictError):
            submit.signal_flow(
                "shop", instance_id, "approve", {"by": "someone else"}, idempotency_key=f"{key}:a"
            )

        with_step = until(
            lambda: (i := submit.get_flow_instance("shop", instance_id)).steps and i, what="step"
        )
        [step] = with_step.steps
        assert step.node == "ship" and with_step.tokens[0].task_id == step.task_id
        [grant] = until(
            lambda: work.lease_tasks("shop", "fulfilment", worker_id="w", max_tasks=1), what="lease"
        )
        assert grant.task.id == step.task_id and grant.task.params == {"order_id": 7, "by": "ops"}
        work.start_attempt("shop", grant.attempt.id, grant.attempt.lease_token)
        work.complete_attempt("shop", grant.attempt.id, grant.attempt.lease_token, {"shipped": True})
        done = until(
            lambda: (i := submit.get_flow_instance("shop", instance_id)).status is FlowInstanceStatus.COMPLETED and i,
            what="completed",
        )  # fmt: skip
        assert done.finished_at is not None and done.steps[0].status is TaskStatus.SUCCEEDED
        assert done.pending_events == 0

        entries, cursor = [], None
        while True:  # pages of two, oldest first
            page = submit.get_flow_history("shop", instance_id, limit=2, cursor=cursor)
            assert len(page.items) <= 2
            entries.extend(page.items)
            if (cursor := page.next_cursor) is None:
                break
        events = [e.event for e in entries]
        assert events[0] == "instance_started" and "signal_received" in events
        assert [e.id for e in entries] == sorted(e.id for e in entries)
        assert entries[-1].to_state == "COMPLETED"

        with pytest.raises(InvalidTransitionError):
            submit.signal_flow("shop", instance_id, "approve", idempotency_key=f"{key}:late")
        with pytest.raises(InvalidTransitionError):
            admin.cancel_flow_instance("shop", instance_id, reason="too late")


def test_pause_resume_cancel_and_roles(server: RunningServer) -> None:
    flow = f"approval-{uuid.uuid4().hex[:6]}"
    with client(server, "submit") as submit, client(server, "admin") as admin, client(server, "read") as read:
        submit.publish_flow("shop", flow, GRAPH)
        instance = submit.start_flow("shop", flow, idempotency_key=str(uuid.uuid4())).instance
        with pytest.raises(PermissionDeniedError):
            submit.pause_flow_instance("shop", instance.id)
        paused = admin.pause_flow_instance("shop", instance.id, reason="stock audit", actor="ops@example.com")
        assert paused.paused and paused.status is FlowInstanceStatus.PAUSED
        assert admin.pause_flow_instance("shop", instance.id).control_version == paused.control_version
        listed = read.list_flow_instances("shop", flow=flow, status="PAUSED")
        assert [i.id for i in listed.items] == [instance.id]
        resumed = admin.resume_flow_instance("shop", instance.id)
        assert (
            resumed.status is FlowInstanceStatus.RUNNING
            and resumed.control_version == paused.control_version + 1
        )
        cancelled = admin.cancel_flow_instance("shop", instance.id, reason="customer left")
        assert cancelled.status is FlowInstanceStatus.CANCELLED
        history = read.get_flow_history("shop", instance.id, limit=1000).items
        paused_entry = next(e for e in history if e.event == "instance_paused")
        assert "ops@example.com" in (paused_entry.actor or "")
        with pytest.raises(NotFoundError):
            read.get_flow_instance("shop", str(uuid.uuid4()))


async def test_the_async_client(server: RunningServer) -> None:
    flow = f"approval-{uuid.uuid4().hex[:6]}"
    async with AsyncOrbitClient(server.base_url, api_key=server.keys["submit"], timeout=30) as submit:
        version = await submit.publish_flow("shop", flow, GRAPH)
        started = await submit.start_flow("shop", flow, {"order_id": 1}, idempotency_key="async-1", version=1)
        assert started.instance.version == version.version and not started.replayed
        page = await submit.list_flow_instances("shop", flow=flow)
        assert [i.id for i in page.items] == [started.instance.id]
        sent = await submit.signal_flow(
            "shop", started.instance.id, "approve", {"by": "a"}, idempotency_key="s"
        )
        assert sent.signal.name == "approve"
        assert (await submit.get_flow_history("shop", started.instance.id)).items[
            0
        ].event == "instance_started"


def test_the_readme_flow_client_example_runs(server: RunningServer) -> None:
    env = {**os.environ, "ORBIT_URL": server.base_url, "ORBIT_API_KEY": server.keys["admin"]}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "flow_client_example.py")], env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, *history = done.stdout.splitlines()
    instance_id, version, node, handler, approved_by = first.split()
    assert uuid.UUID(instance_id) and version.startswith("v") and node == "ship"
    assert (handler, approved_by) == ("orders.ship", "ops@example.com")
    assert history[0].split()[0] == "instance_started" and any("signal_received" in line for line in history)
