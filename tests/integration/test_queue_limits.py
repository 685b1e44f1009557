"""Concurrency limits and the queue's execution gate over HTTP, on SQLite and MariaDB
(DESIGN §9; seed 001 §3, §5 "领取 … 取得额度", "完成 … 额度释放", invariant 12).

- ``options.concurrency_key`` is part of the request digest (single and batch acceptance).
- A key at its ``max_concurrency_per_key`` gets no grant while its attempt is live; the permit
  comes back with the transaction that ends the attempt: complete (single and set-based batch),
  retryable failure, cancel, expiry; ``max_concurrency`` bounds the whole queue.
- A paused queue grants nothing (a long-poll waits and gets the task after resume), refuses
  starts (the lease is given back), and still records the result of an attempt in flight and
  delivers its result event. Pause, resume and limit changes are audited.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_client import (
    AttemptError,
    LeaseGrant,
    LeaseLostError,
    OrbitClient,
    TaskStatus,
    UnprocessableEntityError,
)
from orbit_server.db.schema import concurrency_permits, queue_events, queues
from orbit_server.tasks import store
from tests.servers import RunningServer

NS = "limits"


@pytest.fixture(scope="module")
def clients(server: RunningServer) -> Iterator[dict[str, OrbitClient]]:
    keys = server.add_namespace(NS)
    made = {role: OrbitClient(server.base_url, api_key=key, timeout=30) for role, key in keys.items()}
    yield made
    for client in made.values():
        client.close()


def _queue(server: RunningServer, **limits: int | None) -> str:
    name = f"q-{uuid.uuid4().hex[:10]}"
    with server.engine.begin() as conn:
        store.create_queue(conn, NS, name, **limits)  # type: ignore[arg-type]
    return name


def _submit(client: OrbitClient, queue: str, key: str | None, **options: Any) -> str:
    if key is not None:
        options["concurrency_key"] = key
    result = client.submit_task(NS, queue, "h", {}, idempotency_key=str(uuid.uuid4()), options=options)
    return result.task.id


def _lease(client: OrbitClient, queue: str, n: int = 10, **kw: Any) -> list[LeaseGrant]:
    return client.lease_tasks(NS, queue, worker_id="w", max_tasks=n, **kw)


def _permits(server: RunningServer) -> int:
    with server.engine.begin() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(concurrency_permits)).scalar_one())


def test_concurrency_key_is_part_of_the_request_digest(clients: dict[str, OrbitClient]) -> None:
    client = clients["submit"]
    first = client.submit_task(
        NS, "default", "h", {}, idempotency_key="ck-1", options={"concurrency_key": "c-1"}
    )
    assert first.task.concurrency_key == "c-1"
    again = client.submit_task(
        NS, "default", "h", {}, idempotency_key="ck-1", options={"concurrency_key": "c-1"}
    )
    assert again.replayed and again.task.id == first.task.id
    with pytest.raises(UnprocessableEntityError):
        client.submit_task(NS, "default", "h", {}, idempotency_key="ck-1", options={"concurrency_key": "c-2"})
    batch = client.submit_tasks(
        NS,
        [
            {
                "idempotency_key": "ck-2",
                "queue": "default",
                "handler": "h",
                "options": {"concurrency_key": "c-1"},
            },
            {
                "idempotency_key": "ck-1",
                "queue": "default",
                "handler": "h",
                "options": {"concurrency_key": "c-1"},
            },
        ],
    )
    assert [item.status for item in batch] == [201, 200]
    assert batch[0].task is not None and batch[0].task.concurrency_key == "c-1"
    assert client.get_task(NS, first.task.id).concurrency_key == "c-1"


def test_one_live_attempt_per_key_and_the_permit_returns_when_the_attempt_ends(
    server: RunningServer, clients: dict[str, OrbitClient]
) -> None:
    submit, work, admin = clients["submit"], clients["work"], clients["admin"]
    queue = _queue(server, max_concurrency_per_key=1)
    a = [_submit(submit, queue, "a", retry_safe=True, backoff_base_seconds=0) for _ in range(4)]
    b = _submit(submit, queue, "b")
    free = _submit(submit, queue, None)
    granted = _lease(work, queue)
    assert [g.task.id for g in granted] == [a[0], b, free]  # one of key a, in queue order
    assert _lease(work, queue) == []
    by_id = {g.task.id: g.attempt for g in granted}

    # Set-based batch complete ends a[0]'s attempt: a[1] may go.
    work.start_attempts(NS, [{"attempt_id": by_id[a[0]].id, "lease_token": by_id[a[0]].lease_token}])
    [done] = work.complete_attempts(
        NS, [{"attempt_id": by_id[a[0]].id, "lease_token": by_id[a[0]].lease_token, "result": "ok"}]
    )
    assert done.status == 200
    [g1] = _lease(work, queue)
    assert g1.task.id == a[1]
    # A retryable failure (retry at once) gives the permit back, and the task waits again.
    work.fail_attempt(
        NS, g1.attempt.id, g1.attempt.lease_token, AttemptError(type="x", message="m", retryable=True)
    )
    [g2] = _lease(work, queue)
    assert g2.task.id in (a[1], a[2])
    # Cancel of a leased task ends its attempt too.
    admin.cancel_task(NS, g2.task.id, reason="test")
    [g3] = _lease(work, queue, lease_seconds=0.2)
    # An expired lease is swept by the next lease call: the key is free again.
    time.sleep(0.3)  # the lease must lapse by the database clock
    [g4] = _lease(work, queue)
    assert g4.task.concurrency_key == "a"
    assert work.get_task(NS, g3.task.id).status in (TaskStatus.WAITING, TaskStatus.LEASED)
    assert _lease(work, queue) == []
    for grant in granted[1:]:
        work.fail_attempt(
            NS, grant.attempt.id, grant.attempt.lease_token, AttemptError(type="x", message="m")
        )
    current, finished = g4, 0
    while True:  # the rest of key a, one at a time
        work.start_attempt(NS, current.attempt.id, current.attempt.lease_token)
        work.complete_attempt(NS, current.attempt.id, current.attempt.lease_token, "ok")
        finished += 1
        following = _lease(work, queue)
        if not following:
            break
        assert len(following) == 1 and following[0].task.concurrency_key == "a"
        current = following[0]
    assert finished == 2  # a[1], a[2] and a[3], less the cancelled one
    # A manual retry keeps the key, so it is limited like its original.
    assert admin.retry_task(NS, b, reason="again").concurrency_key == "b"
    with server.engine.begin() as conn:
        held = conn.execute(
            sa.select(sa.func.count())
            .select_from(concurrency_permits.join(queues, queues.c.id == concurrency_permits.c.queue_id))
            .where(queues.c.name == queue)
        ).scalar_one()
    assert held == 0


def test_max_concurrency_bounds_the_whole_queue_and_can_be_changed(
    server: RunningServer, clients: dict[str, OrbitClient]
) -> None:
    submit, work, admin = clients["submit"], clients["work"], clients["admin"]
    queue = _queue(server, max_concurrency=2)
    ids = [_submit(submit, queue, None) for _ in range(5)]
    first = _lease(work, queue)
    assert [g.task.id for g in first] == ids[:2]
    assert _lease(work, queue) == []
    updated = admin.update_queue(NS, queue, max_concurrency=3, reason="more room", actor="ops@example.com")
    assert (updated.max_concurrency, updated.max_concurrency_per_key, updated.control_version) == (3, None, 2)
    assert [g.task.id for g in _lease(work, queue)] == [ids[2]]
    # Removing the limit: the plain lease path, no permit taken.
    admin.update_queue(NS, queue, max_concurrency=None)
    before = _permits(server)
    assert [g.task.id for g in _lease(work, queue)] == ids[3:]
    assert _permits(server) == before
    with pytest.raises(UnprocessableEntityError):
        admin.update_queue(NS, queue)
    with pytest.raises(UnprocessableEntityError):
        admin.update_queue(NS, queue, max_concurrency_per_key=0)
    with server.engine.begin() as conn:
        audit = conn.execute(
            sa.select(queue_events.c.event, queue_events.c.actor, queue_events.c.data)
            .where(queue_events.c.queue_name == queue)
            .order_by(queue_events.c.id)
        ).all()
    assert [row.event for row in audit] == ["created", "limits_changed", "limits_changed"]
    change = audit[1]
    assert change.actor.startswith("api_key:")
    assert (change.data["before"], change.data["after"]) == ({"max_concurrency": 2}, {"max_concurrency": 3})
    assert change.data["reason"] == "more room" and change.data["on_behalf_of"] == "ops@example.com"


def test_a_paused_queue_grants_and_starts_nothing_but_records_results_in_flight(
    server: RunningServer, clients: dict[str, OrbitClient]
) -> None:
    submit, work, admin = clients["submit"], clients["work"], clients["admin"]
    queue = _queue(server)
    subscription = f"s-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(NS, subscription, queues=[queue])
    running_id, leased_id = _submit(submit, queue, None), _submit(submit, queue, None)
    running, leased = _lease(work, queue, 2)
    work.start_attempt(NS, running.attempt.id, running.attempt.lease_token)

    paused = admin.pause_queue(NS, queue, reason="maintenance")
    assert paused.paused and admin.get_queue(NS, queue).paused
    waiting_id = _submit(submit, queue, None)
    assert _lease(work, queue) == []
    # A leased attempt may not start: its lease is given back and the task waits for resume.
    with pytest.raises(LeaseLostError) as lost:
        work.start_attempt(NS, leased.attempt.id, leased.attempt.lease_token)
    assert lost.value.problem is not None and lost.value.problem.model_extra["queue_paused"] is True  # type: ignore[index]
    assert work.get_task(NS, leased_id).status is TaskStatus.WAITING
    # The attempt in flight still heartbeats and completes; its result event is delivered.
    work.heartbeat(NS, running.attempt.id, running.attempt.lease_token)
    work.complete_attempt(NS, running.attempt.id, running.attempt.lease_token, {"done": True})
    assert work.get_task(NS, running_id).status is TaskStatus.SUCCEEDED
    deliveries = work.lease_deliveries(NS, subscription)
    assert [(d.event.task_id, d.event.status) for d in deliveries] == [(running_id, TaskStatus.SUCCEEDED)]

    # A long-poll on the paused queue waits, and gets the tasks once the queue is resumed.
    got: list[LeaseGrant] = []
    poll = threading.Thread(target=lambda: got.extend(_lease(work, queue, wait_seconds=20)))
    started = time.monotonic()
    poll.start()
    time.sleep(0.5)  # let the poll wait on the paused queue a while (nothing to await: it must not answer)
    assert poll.is_alive()
    resumed = admin.resume_queue(NS, queue, actor="ops@example.com")
    assert not resumed.paused
    poll.join(timeout=20)
    assert {g.task.id for g in got} == {leased_id, waiting_id}
    assert time.monotonic() - started < 10
    assert admin.resume_queue(NS, queue).control_version == resumed.control_version  # no change, no audit
    with server.engine.begin() as conn:
        audit = conn.execute(
            sa.select(queue_events.c.event, queue_events.c.actor, queue_events.c.data)
            .where(queue_events.c.queue_name == queue)
            .order_by(queue_events.c.id)
        ).all()
    assert [(row.event, row.data.get("reason"), row.data.get("on_behalf_of")) for row in audit] == [
        ("paused", "maintenance", None),
        ("resumed", None, "ops@example.com"),
    ]
    assert all(row.actor.startswith("api_key:") for row in audit)


def test_a_batched_start_on_a_paused_queue_is_refused_item_by_item(
    server: RunningServer, clients: dict[str, OrbitClient]
) -> None:
    submit, work, admin = clients["submit"], clients["work"], clients["admin"]
    queue = _queue(server, max_concurrency_per_key=1)
    _submit(submit, queue, "k")
    [grant] = _lease(work, queue)
    admin.pause_queue(NS, queue)
    [item] = work.start_attempts(
        NS, [{"attempt_id": grant.attempt.id, "lease_token": grant.attempt.lease_token}]
    )
    assert item.status == 409 and item.error is not None and item.error.code == "lease_lost"
    assert work.get_task(NS, grant.task.id).status is TaskStatus.WAITING
    admin.resume_queue(NS, queue)
    [again] = _lease(work, queue)  # the permit came back with the given-back lease
    assert again.task.id == grant.task.id
