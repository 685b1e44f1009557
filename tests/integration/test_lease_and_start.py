"""Lease-and-start and report-and-lease against a real server, on SQLite and MariaDB (DESIGN §4,
README "Workers": fewer calls per task).

Lease-and-start: a lease request with ``start: true`` answers grants of retry-safe tasks already
``RUNNING`` (the others ``LEASED``, to be started explicitly). The
attempt is unconfirmed until its first heartbeat or report; one whose lease lapses unconfirmed
(its answer was lost) is settled as a never-started attempt: the task waits again (or fails when
its budget is spent), never ``NEEDS_REVIEW``, and ``started_at`` stays empty.

Report-and-lease: a ``complete``/``fail`` batch with a ``lease`` commits its reports, then
grants; a grant failure is answered as ``lease_error`` beside the reports, which stay done.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import AttemptError, BatchLease, CompleteItem, FailItem, OrbitClient, RetryPolicy
from orbit_server.db.schema import namespaces, task_attempts, tasks, worker_sightings
from orbit_server.tasks import permits
from tests.conftest import DatabaseFactory
from tests.execution_support import check_attempt_history
from tests.integration.conftest import BACKENDS
from tests.integration.test_worker_sdk import Env
from tests.servers import run_server


@pytest.fixture(scope="module", params=BACKENDS)
def env(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Env]:
    with run_server(make_database(request.param), sweep_interval_seconds=0.1) as server:
        environment = Env(server)
        yield environment
        environment.admin.close()


@pytest.fixture
def worker_client(env: Env) -> Iterator[OrbitClient]:
    with env.client() as client:
        yield client


def test_the_server_says_it_offers_the_newer_worker_calls(worker_client: OrbitClient) -> None:
    info = worker_client.get_settings()
    assert info.lease_and_start and info.report_and_lease and info.item_task_ids


def test_grants_come_back_running_and_need_no_start(env: Env, worker_client: OrbitClient) -> None:
    queue = env.queue()
    ids = [env.submit(queue, "h", {"n": n}, retry_safe=True) for n in range(3)]
    grants = worker_client.lease_tasks(env.ns, queue, worker_id="w", max_tasks=3, start=True)
    assert sorted(g.task.id for g in grants) == sorted(ids)
    assert {g.task.status for g in grants} == {"RUNNING"}
    assert {env.admin.get_task(env.ns, i).status for i in ids} == {"RUNNING"}
    results = worker_client.complete_attempts(
        env.ns,
        [CompleteItem(attempt_id=g.attempt.id, lease_token=g.attempt.lease_token, result=1) for g in grants],
    )
    assert [r.status for r in results] == [200] * 3
    for task_id in ids:
        task = env.admin.get_task(env.ns, task_id)
        (attempt,) = env.admin.list_attempts(env.ns, task_id)
        assert task.status == "SUCCEEDED" and attempt.status == "SUCCEEDED"
        # The report confirmed the start: started_at is the grant's time.
        assert attempt.started_at == attempt.leased_at
        events = [e.event for e in env.admin.list_task_events(env.ns, task_id)]
        assert events == ["accepted", "leased", "started", "completed"]
    check_attempt_history(env.server.engine, ids)


def test_a_lost_lease_and_start_answer_lapses_as_never_started(env: Env, worker_client: OrbitClient) -> None:
    # Retry-safe with a backoff of an hour: a started attempt that lapsed would wait an hour.
    # Unconfirmed, it is a never-started one: the task waits again at once.
    queue = env.queue()
    task_id = env.submit(queue, "h", retry_safe=True, max_attempts=2, backoff_base_seconds=3600)
    (lost,) = worker_client.lease_tasks(env.ns, queue, worker_id="w", lease_seconds=0.3, start=True)
    # The answer never reaches a handler: nothing heartbeats, nothing reports.
    env.wait(task_id, "WAITING")
    (attempt,) = env.admin.list_attempts(env.ns, task_id)
    assert attempt.id == lost.attempt.id
    assert attempt.status == "EXPIRED" and attempt.started_at is None
    # What is known, not that nothing started (issue 30, item 5): the grant may have reached a worker
    # that ran its handler and died before its first heartbeat.
    assert isinstance(attempt.error, dict) and attempt.error["type"] == "unconfirmed"
    assert "granted RUNNING" in attempt.error["message"] and "unknown" in attempt.error["message"]
    (lapse,) = [e for e in env.admin.list_task_events(env.ns, task_id) if e.event == "lease_expired"]
    assert lapse.reason is not None and "may have run" in lapse.reason
    (again,) = worker_client.lease_tasks(env.ns, queue, worker_id="w", start=True)
    assert again.attempt.generation == 2
    worker_client.complete_attempt(env.ns, again.attempt.id, again.attempt.lease_token, "ok")
    assert env.admin.get_task(env.ns, task_id).status == "SUCCEEDED"
    # The lost grant's token is spent: a late report is only evidence.
    check_attempt_history(env.server.engine, [task_id])


def test_a_lost_answer_with_the_budget_spent_fails_the_task_as_a_lapsed_lease_does(
    env: Env, worker_client: OrbitClient
) -> None:
    queue = env.queue()
    task_id = env.submit(queue, "h", retry_safe=True, max_attempts=1)
    worker_client.lease_tasks(env.ns, queue, worker_id="w", lease_seconds=0.3, start=True)
    task = env.wait(task_id, "FAILED", "NEEDS_REVIEW")
    assert task.status == "FAILED" and task.error is not None and task.error["type"] == "attempts_exhausted"


def _lapse(env: Env, task_id: str, attempt_id: str) -> None:
    """Wait until the sweeper has settled the attempt's lapsed lease (no event exists for this)."""
    deadline = time.monotonic() + 20
    while {a.id: a.status for a in env.admin.list_attempts(env.ns, task_id)}[attempt_id] != "EXPIRED":
        assert time.monotonic() < deadline, f"attempt {attempt_id} never lapsed"
        time.sleep(0.05)


@pytest.mark.parametrize("max_attempts", [3, 1])
def test_a_cancel_of_an_unconfirmed_lease_and_start_task_survives_its_lapse(
    env: Env, worker_client: OrbitClient, max_attempts: int
) -> None:
    # Regression (issue 30, item 1): the cancel only set cancel_requested; the unconfirmed attempt's lapse
    # then put the task back to WAITING as never started, it was leased and run again, and could succeed.
    # With the budget spent it ended FAILED attempts_exhausted instead of CANCELLED.
    queue = env.queue()
    task_id = env.submit(queue, "h", retry_safe=True, max_attempts=max_attempts)
    # 3 s: the cancel must arrive inside the lease (with 0.5 s, a test or server stalled by a loaded machine
    # let it lapse first; the cancel then finds the task WAITING and ends it at once, not RUNNING).
    (grant,) = worker_client.lease_tasks(env.ns, queue, worker_id="w", lease_seconds=3, start=True)
    cancelled = env.admin.cancel_task(env.ns, task_id, reason="not wanted any more")
    assert cancelled.status == "RUNNING" and cancelled.cancel_requested
    _lapse(env, task_id, grant.attempt.id)
    assert worker_client.lease_tasks(env.ns, queue, worker_id="w", max_tasks=5, start=True) == []
    task = env.admin.get_task(env.ns, task_id)
    assert task.status == "CANCELLED"
    (attempt,) = env.admin.list_attempts(env.ns, task_id)
    assert attempt.status == "EXPIRED"
    events = [e.event for e in env.admin.list_task_events(env.ns, task_id)]
    assert events == ["accepted", "leased", "started", "cancel_requested", "cancelled"]
    check_attempt_history(env.server.engine, [task_id])


def test_a_cancel_of_a_confirmed_retry_safe_task_survives_its_lapse_with_the_budget_spent(
    env: Env, worker_client: OrbitClient
) -> None:
    # Confirmed by a heartbeat and with no attempt left, the lapse of a retry-safe task that was asked to
    # stop ends CANCELLED (it was NEEDS_REVIEW: a review of a task nobody wants any more).
    queue = env.queue()
    task_id = env.submit(queue, "h", retry_safe=True, max_attempts=1)
    # 3 s: the heartbeat must land inside the lease (0.5 s was missed once at load 7-10; a loaded machine can
    # stall the test or the server 1-2 s).
    (grant,) = worker_client.lease_tasks(env.ns, queue, worker_id="w", lease_seconds=3, start=True)
    worker_client.heartbeat(env.ns, grant.attempt.id, grant.attempt.lease_token)
    env.admin.cancel_task(env.ns, task_id, reason="not wanted any more")
    _lapse(env, task_id, grant.attempt.id)
    assert env.admin.get_task(env.ns, task_id).status == "CANCELLED"


@pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])
def test_a_lease_never_grants_a_waiting_task_with_a_cancel_requested(
    env: Env, worker_client: OrbitClient, limited: bool
) -> None:
    # What a server before the fix above left (a task WAITING again with its cancel requested) is not
    # granted, on the plain path and on a queue with a concurrency limit; a second cancel then ends it.
    queue = env.queue()
    if limited:
        with env.server.engine.begin() as conn:
            ns_id = conn.scalar(sa.select(namespaces.c.id).where(namespaces.c.name == env.ns))
            permits.set_limits(conn, ns_id, queue, {"max_concurrency": 5}, actor="test")
    task_id = env.submit(queue, "h", retry_safe=True)
    with env.server.engine.begin() as conn:
        conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(cancel_requested=True))
    assert worker_client.lease_tasks(env.ns, queue, worker_id="w", max_tasks=5) == []
    assert worker_client.lease_tasks(env.ns, queue, worker_id="w", max_tasks=5, start=True) == []
    assert env.admin.list_attempts(env.ns, task_id) == []
    assert env.admin.cancel_task(env.ns, task_id, reason="again").status == "CANCELLED"


def test_the_first_heartbeat_confirms_the_start(env: Env, worker_client: OrbitClient) -> None:
    # Confirmed, the attempt is an ordinary running one: a lapse with no attempt left then means
    # NEEDS_REVIEW (invariant 7), where an unconfirmed one fails as attempts_exhausted.
    queue = env.queue()
    task_id = env.submit(queue, "h", retry_safe=True, max_attempts=1)
    # 3 s: the heartbeat must land inside the lease on a loaded machine too (as above).
    (grant,) = worker_client.lease_tasks(env.ns, queue, worker_id="w", lease_seconds=3, start=True)
    state = worker_client.heartbeat(env.ns, grant.attempt.id, grant.attempt.lease_token)
    assert state.status == "RUNNING"
    with env.server.engine.connect() as conn:
        started = conn.scalar(
            sa.select(task_attempts.c.started_at).where(task_attempts.c.id == grant.attempt.id)
        )
    assert started is not None
    task = env.wait(task_id, "NEEDS_REVIEW", "WAITING")
    assert task.status == "NEEDS_REVIEW"


def test_report_and_lease_commits_the_reports_then_grants(env: Env, worker_client: OrbitClient) -> None:
    queue = env.queue()
    first = [env.submit(queue, "h", {"n": n}, retry_safe=True) for n in range(2)]
    grants = worker_client.lease_tasks(env.ns, queue, worker_id="w", max_tasks=2, start=True)
    later = [env.submit(queue, "h", {"n": n}, retry_safe=True) for n in range(2, 5)]
    lease = BatchLease(queue=queue, worker_id="w", max_tasks=3, start=True)
    answer = worker_client.complete_attempts_and_lease(
        env.ns,
        [
            CompleteItem(attempt_id=g.attempt.id, lease_token=g.attempt.lease_token, result=g.task.params)
            for g in grants
        ],
        lease=lease,
    )
    assert [r.status for r in answer.items] == [200, 200]
    assert answer.lease_error is None
    assert sorted(g.task.id for g in answer.grants) == sorted(later)
    assert {g.task.status for g in answer.grants} == {"RUNNING"}
    assert {env.admin.get_task(env.ns, i).status for i in first} == {"SUCCEEDED"}
    fails = worker_client.fail_attempts_and_lease(
        env.ns,
        [FailItem(attempt_id=g.attempt.id, lease_token=g.attempt.lease_token,
                  error=AttemptError(type="boom", message="no", retryable=False)) for g in answer.grants],
        lease=lease,
    )  # fmt: skip
    assert [r.status for r in fails.items] == [200] * 3
    assert fails.grants == [] and fails.lease_error is None  # nothing left to grant
    assert {env.admin.get_task(env.ns, i).status for i in later} == {"FAILED"}
    check_attempt_history(env.server.engine, first + later)


class _LoseOneAnswer(httpx.BaseTransport):
    """Forwards every request; the answer to the first one to ``path`` is lost after the server
    committed it (the client sees a read timeout: outcome unknown, retried)."""

    def __init__(self, inner: httpx.BaseTransport, path: str) -> None:
        self._inner, self._path, self.lost = inner, path, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        if request.url.path == self._path and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost on the way back", request=request)
        return response

    def close(self) -> None:
        self._inner.close()


def test_a_lost_report_and_lease_answer_is_retried_without_its_lease(env: Env) -> None:
    # Regression (issue 30, item 2): the retry of a report batch whose answer was lost carried its lease
    # again: every retry granted up to max_tasks more tasks while the lost answer's grants lapsed unused,
    # each spending an attempt. Now the lease part is sent once: the retry carries the reports alone.
    queue = env.queue()
    first = env.submit(queue, "h", retry_safe=True)
    with OrbitClient(env.server.base_url, api_key=env.keys["work"], retry=RetryPolicy.no_wait()) as client:
        (grant,) = client.lease_tasks(env.ns, queue, worker_id="w", start=True)
        later = [env.submit(queue, "h", {"n": n}, retry_safe=True, max_attempts=2) for n in range(6)]
        path = f"/v1/namespaces/{env.ns}/attempts/complete"
        lose = _LoseOneAnswer(client._http._transport, path)
        client._http._transport = lose
        answer = client.complete_attempts_and_lease(
            env.ns,
            [CompleteItem(attempt_id=grant.attempt.id, lease_token=grant.attempt.lease_token, result="done")],
            lease=BatchLease(queue=queue, worker_id="w", max_tasks=3, start=True),
        )
    assert lose.lost == 1
    assert [r.status for r in answer.items] == [200] and answer.grants == [] and answer.lease_error is None
    assert env.admin.get_task(env.ns, first).status == "SUCCEEDED"
    # The lost answer's three grants are the only ones: no retry granted a second set.
    spent = {task_id: env.admin.get_task(env.ns, task_id).attempt_count for task_id in later}
    assert sorted(spent.values()) == [0, 0, 0, 1, 1, 1], spent
    check_attempt_history(env.server.engine, [first, *later])


def test_a_failed_grant_never_undoes_the_reports(env: Env, worker_client: OrbitClient) -> None:
    queue = env.queue()
    ids = [env.submit(queue, "h", retry_safe=True) for _ in range(2)]
    grants = worker_client.lease_tasks(env.ns, queue, worker_id="w", max_tasks=2, start=True)
    answer = worker_client.complete_attempts_and_lease(
        env.ns,
        [
            CompleteItem(attempt_id=g.attempt.id, lease_token=g.attempt.lease_token, result="done")
            for g in grants
        ],
        lease=BatchLease(queue="no-such-queue", worker_id="w", max_tasks=2, start=True),
    )
    assert [r.status for r in answer.items] == [200, 200]
    assert answer.grants == []
    assert answer.lease_error is not None and answer.lease_error.code == "queue_not_found"
    assert answer.lease_error.status == 404
    for task_id in ids:
        assert env.admin.get_task(env.ns, task_id).status == "SUCCEEDED"
    check_attempt_history(env.server.engine, ids)


def test_tasks_not_declared_retry_safe_come_back_leased(env: Env, worker_client: OrbitClient) -> None:
    # A worker killed after such a handler began must leave it for review, so its start is confirmed first.
    queue = env.queue()
    env.submit(queue, "h")
    (grant,) = worker_client.lease_tasks(env.ns, queue, worker_id="w", start=True)
    assert grant.task.status == "LEASED"


def test_one_lease_of_retry_safe_and_default_tasks_writes_each_its_own_rows(
    env: Env, worker_client: OrbitClient
) -> None:
    # One statement grants both kinds (a CASE on retry_safe): each task, attempt and event row must be
    # the one its kind gets on its own (issue 30, item 6: no test leased both in one request).
    queue = env.queue()
    safe = [env.submit(queue, "h", {"n": n}, retry_safe=True) for n in range(2)]
    default = [env.submit(queue, "h", {"n": n}) for n in range(2, 4)]
    grants = worker_client.lease_tasks(env.ns, queue, worker_id="w", max_tasks=4, start=True)
    by_task = {g.task.id: g for g in grants}
    assert set(by_task) == {*safe, *default}
    with env.server.engine.connect() as conn:
        attempts = {
            row.task_id: row
            for row in conn.execute(
                sa.select(task_attempts).where(task_attempts.c.task_id.in_([*safe, *default]))
            )
        }
        versions = dict(
            conn.execute(sa.select(tasks.c.id, tasks.c.state_version).where(tasks.c.id.in_(by_task))).all()
        )
    for task_id in safe:
        assert (
            by_task[task_id].task.status == "RUNNING"
            and env.admin.get_task(env.ns, task_id).status == "RUNNING"
        )
        assert attempts[task_id].status == "RUNNING" and attempts[task_id].started_at is None  # unconfirmed
        assert [e.event for e in env.admin.list_task_events(env.ns, task_id)] == [
            "accepted",
            "leased",
            "started",
        ]
        assert versions[task_id] == by_task[task_id].task.state_version == 3
    for task_id in default:
        assert (
            by_task[task_id].task.status == "LEASED"
            and env.admin.get_task(env.ns, task_id).status == "LEASED"
        )
        assert attempts[task_id].status == "LEASED" and attempts[task_id].started_at is None
        assert [e.event for e in env.admin.list_task_events(env.ns, task_id)] == ["accepted", "leased"]
        assert versions[task_id] == by_task[task_id].task.state_version == 2
    for task_id in [*safe, *default]:
        row = attempts[task_id]
        assert row.id == by_task[task_id].attempt.id and row.generation == 1 and row.worker_id == "w"
        assert row.lease_expires_at > row.leased_at
    # Each kind goes on as it must: the default ones need their start, the retry-safe ones do not.
    for task_id in default:
        grant = by_task[task_id]
        worker_client.start_attempt(env.ns, grant.attempt.id, grant.attempt.lease_token)
    results = worker_client.complete_attempts(
        env.ns,
        [CompleteItem(attempt_id=g.attempt.id, lease_token=g.attempt.lease_token, result=1) for g in grants],
    )
    assert [r.status for r in results] == [200] * 4
    assert {env.admin.get_task(env.ns, task_id).status for task_id in by_task} == {"SUCCEEDED"}
    check_attempt_history(env.server.engine, [*safe, *default])


def test_old_clients_are_answered_as_before(env: Env, worker_client: OrbitClient) -> None:
    # No ``start``: grants are LEASED and need their start; no ``lease``: no grants in the answer.
    queue = env.queue()
    task_id = env.submit(queue, "h")
    (grant,) = worker_client.lease_tasks(env.ns, queue, worker_id="w")
    assert grant.task.status == "LEASED"
    worker_client.start_attempt(env.ns, grant.attempt.id, grant.attempt.lease_token)
    response = worker_client._http.post(
        f"/v1/namespaces/{env.ns}/attempts/complete",
        json={
            "items": [{"attempt_id": grant.attempt.id, "lease_token": grant.attempt.lease_token, "result": 1}]
        },
    )
    assert response.status_code == 200
    assert set(response.json()) == {"items"}
    assert env.admin.get_task(env.ns, task_id).status == "SUCCEEDED"


def test_report_and_lease_grants_are_counted_and_the_worker_is_seen(
    env: Env, worker_client: OrbitClient
) -> None:
    # Regression: a lease carried by a report batch counted its grants without the namespace label of
    # orbit_lease_grants: a 500 after the reports and the grants were committed (the grants then lapsed),
    # and a worker whose every lease rode on its reports never showed as alive on the console.
    queue = env.queue()
    env.submit(queue, "h", retry_safe=True)
    (grant,) = worker_client.lease_tasks(env.ns, queue, worker_id="w-first", start=True)
    later = env.submit(queue, "h", retry_safe=True)
    answer = worker_client.complete_attempts_and_lease(
        env.ns,
        [CompleteItem(attempt_id=grant.attempt.id, lease_token=grant.attempt.lease_token, result=1)],
        lease=BatchLease(queue=queue, worker_id="w-riding", max_tasks=1, start=True),
    )
    assert [g.task.id for g in answer.grants] == [later] and answer.lease_error is None
    with httpx.Client(base_url=env.server.base_url) as http:
        text = http.get("/metrics").text
    series = f'orbit_lease_grants_total{{namespace="{env.ns}",queue="{queue}"}} '
    assert any(line.startswith(series) and float(line.split()[-1]) == 2 for line in text.splitlines()), text
    with env.server.engine.connect() as conn:
        seen = set(
            conn.execute(
                sa.select(worker_sightings.c.worker_id).where(worker_sightings.c.queue == queue)
            ).scalars()
        )
    assert seen == {"w-first", "w-riding"}
