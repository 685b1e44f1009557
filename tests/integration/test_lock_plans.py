"""The batch statements of the task path lock only their own rows on MariaDB (regression test).

A set-based ``UPDATE ... WHERE (id, fence) IN (...) AND status = ...`` and the ``SELECT ... FOR UPDATE``
that locks a report batch's tasks choose rows by primary key, but they also test a status or a
namespace column. On a table with few rows at that status the optimizer read them through the
status index instead, locking every ``RUNNING`` task and attempt, not only the batch's: batches of
four worker processes deadlocked (one in thirteen ``complete`` batches met a deadlock; some
answered 409 after five). Each such statement, captured from a real lease, start batch, complete
batch and report-and-lease, must read ``tasks`` and ``task_attempts`` through ``PRIMARY``
(``orbit_server.db.engine.by_primary_key``).

And each reads a range of that key, never the whole index, for one item as for many: MariaDB plans a
one-tuple row ``IN`` as no range, so a one-item batch (every report of a ``Worker`` at concurrency 1)
read every task the retention window keeps (EXPLAIN ``type=index``, 23,219 rows at 21,855 tasks).

On PostgreSQL a row lock is taken only on the rows a statement returns or updates, whatever the plan, so
the deadlock above cannot happen there; the same statements are still checked to find their rows through
the primary key (an index scan of ``tasks_pkey`` / ``task_attempts_pkey``, or a bitmap scan that reads
it, never a sequential scan or the status index alone), on a table of a busy queue's size with statistics
as a database in use has them (``ANALYZE``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_server.db.transact import transact
from orbit_server.tasks import leases
from tests.conftest import DatabaseFactory
from tests.integration.test_execution_api import Api
from tests.servers import run_server

#: A statement that locks rows it picks by id: an UPDATE/SELECT FOR UPDATE whose WHERE names the id.
_BY_ID = re.compile(r"WHERE \(?(tasks|task_attempts)\.id(,| IN| =)")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def api(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Api]:
    with (
        run_server(make_database(request.param), sweep_interval_seconds=0) as server,
        Api.in_new_namespace(server) as helper,
    ):
        yield helper


#: The head of PostgreSQL's one-statement lease (``postgres_leases._pg_claim_statement``): its ``claimed``
#: UPDATE updates tasks by id, joined to the ones its ``picked`` read locked with ``SKIP LOCKED``.
_PG_LEASE = "WITH CLOCK AS MATERIALIZED"


def _locking_by_id(statement: str) -> bool:
    head = statement.lstrip().upper()
    if head.startswith(_PG_LEASE):
        return True
    # (INSERT ... SELECT ... FOR UPDATE: a single complete's first statement on MariaDB, writing its result event)
    selects = head.startswith(("SELECT", "INSERT INTO RESULT_EVENTS")) and "FOR UPDATE" in head
    locking = head.startswith(("UPDATE", "WITH LIVE AS (UPDATE")) or selects
    return locking and "SKIP LOCKED" not in head and bool(_BY_ID.search(statement))


@pytest.mark.parametrize("size", [1, 4])
def test_batch_statements_lock_tasks_and_attempts_through_the_primary_key(api: Api, size: int) -> None:
    engine = api.server.engine
    _seed_finished_tasks(api, 300)
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if not many and _locking_by_id(statement):
            captured.append((statement, parameters))

    queue = api.queue()
    for n in range(size + 2):
        api.submit(queue, params={"n": n}, retry_safe=n % 2 == 0)
    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        grants = api.lease(queue, size)
        r = api.http["work"].post(
            f"/v1/namespaces/{api.ns}/attempts/start",
            json={"items": [{"attempt_id": g["attempt"]["id"], "lease_token": g["attempt"]["lease_token"]}
                            for g in grants]},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        r = api.http["work"].post(
            f"/v1/namespaces/{api.ns}/attempts/complete",
            json={
                "items": [
                    {"attempt_id": g["attempt"]["id"], "lease_token": g["attempt"]["lease_token"], "result": 1}
                    for g in grants
                ],
                "lease": {"queue": queue, "worker_id": "w-plans", "max_tasks": size, "lease_seconds": 30,
                          "start": True},
            },
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert len(r.json()["grants"]) == 2 if size > 2 else size
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)

    statements = {statement for statement, _ in captured}
    # the claim: an UPDATE of its own, or (PostgreSQL) the lease's statement's
    assert any(s.lstrip().upper().startswith(("UPDATE TASKS", _PG_LEASE)) for s in statements), statements
    # an attempt update: of its own, or with its task in one statement (the single path on MariaDB)
    assert any(
        re.match(r"\s*(WITH live AS \()?UPDATE (tasks FORCE INDEX \(PRIMARY\), )?task_attempts", s)
        for s in statements
    ), statements
    assert any("FOR UPDATE" in s for s in statements), statements
    # the single complete locks, reads and writes its result event in one INSERT on MariaDB
    if size == 1 and engine.dialect.name == "mysql":
        assert any(s.lstrip().startswith("INSERT INTO result_events") for s in statements), statements
    if engine.dialect.name == "postgresql":
        _check_postgres_plans(engine, captured, size)
        return
    with engine.connect() as conn:
        for statement, parameters in captured:
            plan = conn.exec_driver_sql(f"EXPLAIN {statement}", parameters).mappings().all()
            if " JOIN task_attempts" in statement:  # a set-based batch's lock: each task, then its attempt
                assert [row["table"] for row in plan][:2] == ["tasks", "task_attempts"], plan
            for row in plan:  # the rows it locks (a subquery's rows are read without locks)
                if row["table"] in ("tasks", "task_attempts") and row["select_type"] in ("SIMPLE", "PRIMARY"):
                    assert row["key"] == "PRIMARY", (
                        f"{statement[:60]}...{statement[-300:]}\n{[dict(r) for r in plan]}"
                    )
                    # a range of the key (or one row), not the whole index ("index") or table ("ALL")
                    assert row["type"] in ("range", "eq_ref", "const", "ref"), (
                        f"{size} item(s) scan: {statement[:60]}...{statement[-300:]}\n{[dict(r) for r in plan]}"
                    )
                if row["table"] in ("namespaces", "queues", "subscriptions"):
                    # the shared locks of a result event, taken by the single complete's first statement
                    # (tasks/result_events.locked_subscribers): the task's own rows, by key
                    assert row["type"] in ("eq_ref", "const", "ref"), (
                        f"{statement[:60]}...{statement[-300:]}\n{[dict(r) for r in plan]}"
                    )


def _check_postgres_plans(engine: sa.Engine, captured: list[tuple[str, Any]], size: int) -> None:
    """Each captured statement's rows of ``tasks`` / ``task_attempts`` (those it updates or locks; a
    subquery's are read without locks) are found by an index scan of the table's primary key."""
    with engine.connect() as conn:
        _seed_finished_rows(conn, 20_000)
        conn.exec_driver_sql("ANALYZE tasks")
        conn.exec_driver_sql("ANALYZE task_attempts")
        conn.commit()
        for statement, parameters in captured:
            (plan,) = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar_one()
            if (
                statement.lstrip().upper().startswith(_PG_LEASE)
            ):  # the rows its claim updates (test_claim_plan
                # checks the read that picks them, from ix_tasks_claim_order)
                scans = [scan for cte in _ctes(plan["Plan"], "CTE claimed") for scan in _row_scans(cte)]
            else:
                scans = list(_row_scans(plan["Plan"]))
            assert scans, (statement, plan)
            for node in scans:
                where = f"{size} item(s): {statement[:60]}...{statement[-300:]}\n{plan}"
                assert node["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan"), where
                # a bitmap scan may AND the key's probe with the status index (a cost; PostgreSQL locks
                # only the rows it updates or returns): the key must be among what it reads
                # (the single path's attempt, fenced on its task too, may be found by its unique key
                # (task_id, generation): the task's own few attempts)
                keys = {f"{node['Relation Name']}_pkey", "uq_task_attempts_task_generation"}
                assert keys & _indexes(node), where


def _seed_finished_rows(conn: sa.Connection, count: int) -> None:
    """``count`` finished tasks with their finished attempts, as a retention window keeps them, and a
    busy queue's live work beside them (a tenth as many tasks waiting, leased and running, each live
    one with its live attempt): a few hundred rows fit in a few pages, which PostgreSQL rightly reads
    whole, and an idle table makes every status look rare (once per module)."""
    if conn.exec_driver_sql("SELECT count(*) FROM tasks WHERE handler = 'plan-seed'").scalar_one():
        return
    live = count // 10
    conn.exec_driver_sql(
        "INSERT INTO tasks (id, namespace_id, queue_id, handler, params, status, state_version, attempt_count,"
        " max_attempts, retry_safe, available_at, cancel_requested, created_at, updated_at, finished_at)"
        " SELECT gen_random_uuid()::text, namespace_id, queue_id, 'plan-seed', '{}',"
        f" CASE WHEN n <= {count} THEN 'SUCCEEDED' WHEN mod(n, 3) = 0 THEN 'WAITING' WHEN mod(n, 3) = 1 THEN 'LEASED'"
        " ELSE 'RUNNING' END, 3, 1, 3, false, created_at, false, created_at, created_at,"
        f" CASE WHEN n <= {count} THEN created_at END"
        " FROM (SELECT namespace_id, queue_id, created_at FROM tasks LIMIT 1) AS one,"
        f" generate_series(1, {count + live}) AS numbers(n)"
    )
    conn.exec_driver_sql(
        "INSERT INTO task_attempts (id, task_id, generation, lease_token_hash, worker_id, status, lease_seconds,"
        " leased_at, lease_expires_at, finished_at) SELECT gen_random_uuid()::text, id, 1, 'x', 'w', status,"
        " 30, created_at, created_at + interval '1 hour', finished_at"
        " FROM tasks WHERE handler = 'plan-seed' AND status <> 'WAITING'"
    )


def _indexes(node: dict[str, Any]) -> set[str]:
    """The indexes a scan node reads (a bitmap scan's, under its BitmapAnd/BitmapOr)."""
    found = {node["Index Name"]} if "Index Name" in node else set()
    for child in node.get("Plans", []):
        found |= _indexes(child)
    return found


def _row_scans(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The scans of ``tasks`` and ``task_attempts`` in ``node``'s plan, not counting sub- and init-plans."""
    if node.get("Relation Name") in ("tasks", "task_attempts") and "Scan" in node["Node Type"]:
        yield node
    for child in node.get("Plans", []):
        # a data-modifying WITH (the attempt's UPDATE beside its task's) is an init plan "CTE ..." that locks
        if child.get("Parent Relationship") not in ("SubPlan", "InitPlan") or str(
            child.get("Subplan Name", "")
        ).startswith("CTE"):
            yield from _row_scans(child)


def test_the_expiry_sweep_locks_only_the_tasks_it_settles_by_their_primary_key(api: Api) -> None:
    """The sweep's locking reads name each task by id (regression: its read of the overdue waiting tasks was a
    ``FOR UPDATE SKIP LOCKED`` over ``status``/``deadline``; on MariaDB every row its plan examined was locked for
    a moment, and a lease's claim, which skips locked rows, answered empty beside a due task: 5 leases in
    2,400, each taken just after a submit, while the background sweep ran)."""
    engine = api.server.engine
    queue = api.queue()
    waiting = [api.submit(queue, params={"n": n})["id"] for n in range(3)]
    overdue = api.submit(queue, params={"n": "late"}, deadline="2001-01-01T00:00:00Z")["id"]
    locking: list[str] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if "FOR UPDATE" in statement.upper():
            locking.append(" ".join(statement.split()))

    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        assert transact(engine, leases.expire_leases) == 1
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)
    assert api.task(overdue)["status"] == "FAILED"
    assert [api.task(task_id)["status"] for task_id in waiting] == ["WAITING"] * 3
    assert locking, "the sweep settled the overdue task without locking it"
    assert all(_BY_ID.search(statement) for statement in locking), locking


def _seed_finished_tasks(api: Api, count: int) -> None:
    """``count`` finished tasks in a queue of their own, so that a scan of the key reads more than the
    batch's rows (once per module)."""
    if getattr(api, "_seeded", False):
        return
    queue = api.queue()
    for n in range(0, count, 100):
        r = api.http["submit"].post(
            f"/v1/namespaces/{api.ns}/tasks/batch",
            json={"items": [{"queue": queue, "handler": "seed", "idempotency_key": f"seed-{n + i}"}
                            for i in range(100)]},
        )  # fmt: skip
        assert r.status_code == 200, r.text
    api._seeded = True  # type: ignore[attr-defined]


def _ctes(node: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """The init plans named ``name`` (``CTE claimed``) anywhere in ``node``'s plan."""
    if node.get("Subplan Name") == name:
        yield node
    for child in node.get("Plans", []):
        yield from _ctes(child, name)
