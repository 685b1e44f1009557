"""A long-polling lease of a queue with a concurrency limit is woken by the commit that releases a permit
(README "Concurrency limits and pausing a queue"), on SQLite, MariaDB and PostgreSQL.

The server polls every 60 s (``ORBIT_LEASE_POLL_INTERVAL_SECONDS``) and the lease waits 10 s, so a lease that
answers with the waiting task within a second of the attempt's end was woken by that end, not by polling or by
the end of its wait. The lease is known to be waiting (its first look found nothing: the queue is at its limit)
when the server writes the long-polling worker's first sighting, which it does after that look and before it
waits.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_client import LeaseGrant, OrbitClient, TaskStatus
from orbit_server.tasks import attempt_sets, store
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

NS = "permits"
#: The long-poll's wait, in seconds: without the wake-up it answers the waiting task only when this ends.
WAIT = 10.0
#: How soon after the attempt's end the long-poll must answer, in seconds: far under ``WAIT`` and the poll.
WOKEN_WITHIN = 1.0


@pytest.fixture(scope="module", params=BACKENDS)
def slow_poll(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    """A server that polls every 60 s and runs no background loop that could wake a long-poll."""
    settings = {
        "lease_poll_interval_seconds": 60,
        "sweep_interval_seconds": 0,
        "scheduler_interval_seconds": 0,
        "flow_interval_seconds": 0,
        "api_key_cache_seconds": 300,
    }
    with run_server(make_database(request.param), **settings) as running:
        yield running


@pytest.fixture(scope="module")
def clients(slow_poll: RunningServer) -> Iterator[dict[str, OrbitClient]]:
    keys = slow_poll.add_namespace(NS)
    made = {
        role: OrbitClient(slow_poll.base_url, api_key=key, timeout=WAIT + 30) for role, key in keys.items()
    }
    yield made
    for client in made.values():
        client.close()


@contextmanager
def _sighted(engine: sa.Engine, worker_id: str) -> Iterator[threading.Event]:
    """An event set once the server writes ``worker_id``'s sighting (listened to inside the block)."""
    seen = threading.Event()

    def statement(_conn: Any, _cursor: Any, sql: str, parameters: Any, *_: Any) -> None:
        if "worker_sightings" in sql and worker_id in str(parameters):
            seen.set()

    sa.event.listen(engine, "after_cursor_execute", statement)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "after_cursor_execute", statement)


@pytest.mark.parametrize(
    "ending", ["complete", "fail", "cancel_leased", "batch_complete", "complete_no_returning"]
)
def test_a_released_permit_wakes_the_long_poll_of_its_queue(
    slow_poll: RunningServer, clients: dict[str, OrbitClient], ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue ``max_concurrency`` n (3 for the set-based batch complete, else 1), n + 1 tasks: n are leased
    (and started, but for ``cancel_leased``), so a long-poll for the last one waits; ending the n attempts
    (single complete, non-retryable fail, an operator's cancel of a leased task, one batched complete taking
    the set-based path) releases their permits and makes the long-poll answer the last task at once.
    ``complete_no_returning``: a complete on a database without ``DELETE ... RETURNING`` (MySQL), which reads
    the permits' queues before deleting them."""
    submit, work, admin = clients["submit"], clients["work"], clients["admin"]
    holders = 3 if ending == "batch_complete" else 1  # 3: the fewest items a batch writes set-based
    queue = f"q-{uuid.uuid4().hex[:10]}"
    with slow_poll.engine.begin() as conn:
        store.create_queue(conn, NS, queue, max_concurrency=holders)
    ids = [
        submit.submit_task(NS, queue, "h", {"i": i}, idempotency_key=str(uuid.uuid4())).task.id
        for i in range(holders + 1)
    ]
    held = work.lease_tasks(NS, queue, worker_id="w", max_tasks=holders + 1)
    assert [g.task.id for g in held] == ids[:holders]
    if ending != "cancel_leased":
        for grant in held:
            work.start_attempt(NS, grant.attempt.id, grant.attempt.lease_token)
    assert work.lease_tasks(NS, queue, worker_id="w") == []  # the queue is at its limit
    set_based: list[object] = []
    if ending == "batch_complete":
        complete_all = attempt_sets.complete_all

        def spied(*args: Any, **kwargs: Any) -> Any:
            set_based.append(answer := complete_all(*args, **kwargs))
            return answer

        monkeypatch.setattr(attempt_sets, "complete_all", spied)

    if ending == "complete_no_returning":
        monkeypatch.setattr(slow_poll.engine.dialect, "delete_returning", False)
    poller = f"w-{uuid.uuid4().hex[:8]}"
    with _sighted(slow_poll.engine, poller) as sighted, ThreadPoolExecutor(max_workers=1) as pool:
        lease = pool.submit(work.lease_tasks, NS, queue, worker_id=poller, wait_seconds=WAIT)
        assert sighted.wait(WAIT), "the long-poll never looked for tasks"
        assert not lease.done(), lease.result()
        ended = time.monotonic()
        _end(ending, work, admin, held)
        grants: list[LeaseGrant] = lease.result(timeout=WAIT + 20)
        answered = time.monotonic() - ended
    assert [g.task.id for g in grants] == [ids[-1]]
    assert answered < WOKEN_WITHIN, f"the long-poll answered {answered:.2f} s after the permits were released"
    if ending == "batch_complete":
        assert len(set_based) == 1 and set_based[0] is not None, "the batch did not take the set-based path"


def _end(ending: str, work: OrbitClient, admin: OrbitClient, held: list[LeaseGrant]) -> None:
    if ending in ("complete", "complete_no_returning"):
        (grant,) = held
        work.complete_attempt(NS, grant.attempt.id, grant.attempt.lease_token, {"ok": True})
    elif ending == "fail":
        (grant,) = held
        error = {"type": "boom", "message": "gave up", "retryable": False}
        assert work.fail_attempt(NS, grant.attempt.id, grant.attempt.lease_token, error).task_status is (
            TaskStatus.FAILED
        )
    elif ending == "cancel_leased":
        (grant,) = held
        assert admin.cancel_task(NS, grant.task.id, reason="no longer wanted").status is TaskStatus.CANCELLED
    else:
        items = [
            {"attempt_id": g.attempt.id, "lease_token": g.attempt.lease_token, "result": {}} for g in held
        ]
        assert [r.status for r in work.complete_attempts(NS, items)] == [200] * len(held)
