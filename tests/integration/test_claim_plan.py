"""The lease's claim reads a queue's waiting tasks from ``ix_tasks_claim_order`` in lease order, with no
sort and no scan, on MariaDB and SQLite (issue 31 item 5, README "Task priority").

The claim is ``... WHERE queue_id = ? AND status = 'WAITING' AND available_at <= ? ... ORDER BY priority
DESC, available_at, id LIMIT n``. Served by ``(queue_id, status, priority DESC, available_at, id)`` it reads
the first due rows of the index and stops; without the DESC (or with the column order of the old
``ix_tasks_claim``) MariaDB sorts every waiting task of the queue for each lease (``Using filesort``).
Each statement is captured from a real :func:`orbit_server.tasks.leases.lease_tasks` (the plain path and
the concurrency-limited one of :mod:`orbit_server.tasks.permits`), over a table holding finished tasks of
the same queue and waiting tasks of every priority, some not yet due, then EXPLAINed and, on MariaDB,
run again to count the index entries it read and the rows it sorted (``Handler_read_*``, ``Sort_rows``).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_server.db import migrate as _migrate
from orbit_server.db.engine import create_engine, db_now
from orbit_server.db.schema import queues, task_attempts, tasks
from orbit_server.tasks import leases, postgres_leases, store
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS

FINISHED = 6000
WAITING = 3000
LEASE = 10
QUEUES = ("plain", "limited", "crowded")


class Seeded:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ns = f"ns-{uuid.uuid4().hex[:8]}"
        with engine.begin() as conn:
            self.namespace_id = store.create_namespace(conn, self.ns)
            store.create_queue(conn, self.ns, "plain")
            store.create_queue(conn, self.ns, "limited", max_concurrency_per_key=1)
            store.create_queue(conn, self.ns, "crowded", max_concurrency_per_key=1)
            now = db_now(conn)
            for name in QUEUES:
                queue_id = conn.execute(
                    sa.select(queues.c.id).where(
                        queues.c.namespace_id == self.namespace_id, queues.c.name == name
                    )
                ).scalar_one()
                conn.execute(tasks.insert(), list(_rows(self.namespace_id, queue_id, now, keys=name)))
        if engine.dialect.name == "mysql":
            with engine.connect() as conn:
                conn.exec_driver_sql("ANALYZE TABLE tasks")
        else:
            with engine.begin() as conn:
                conn.exec_driver_sql("ANALYZE")


def _rows(namespace_id: int, queue_id: int, now: datetime, *, keys: str) -> Iterator[dict[str, Any]]:
    """``FINISHED`` succeeded tasks, then ``WAITING`` waiting ones of random priorities, due over the last
    hour except one in ten (due in an hour). ``keys``: ``plain`` none; ``limited`` 500 keys;
    ``crowded`` two waiting tasks in three of one key at priority 100 (a lease's first read finds that key
    alone, it is full after one grant, and the lease reads on past it), the others of 500 keys."""
    picks = random.Random(31)
    for n in range(FINISHED + WAITING):
        waiting = n >= FINISHED
        due = now + (
            timedelta(hours=1) if waiting and n % 10 == 0 else -timedelta(seconds=picks.uniform(0, 3600))
        )
        hot = keys == "crowded" and waiting and n % 3 != 0
        key = "hot" if hot else (f"k{n % 500}" if keys != "plain" else None)
        priority = 100 if hot else picks.randint(-100, 100)
        yield {
            "id": str(uuid.uuid4()), "namespace_id": namespace_id, "queue_id": queue_id, "handler": "h",
            "params": {}, "status": "WAITING" if waiting else "SUCCEEDED", "state_version": 1 if waiting else 4,
            "attempt_count": 0 if waiting else 1, "max_attempts": 3, "available_at": due, "created_at": due,
            "updated_at": now, "finished_at": None if waiting else now,
            "priority": priority if waiting else 0, "concurrency_key": key,
        }  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def seeded(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Seeded]:
    engine = create_engine(make_database(request.param), pool_size=4)
    _migrate.upgrade(engine)
    yield Seeded(engine)
    engine.dispose()


def _claim_statements(seeded: Seeded, queue: str) -> tuple[list[tuple[str, Any]], list[Any]]:
    """Lease ``LEASE`` tasks of ``queue`` (rolled back) and return the claim ``SELECT`` s as the driver got
    them (one, or one per read of a limited lease), and the grants' ``(priority, available_at)`` in order."""
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().startswith(("SELECT", "(SELECT")) and (
            "ORDER BY tasks.priority DESC" in statement or "ORDER BY tasks.available_at" in statement
        ):
            captured.append((statement, parameters))

    sa.event.listen(seeded.engine, "before_cursor_execute", capture)
    try:
        with seeded.engine.connect() as conn, conn.begin() as transaction:
            grants = leases.lease_tasks(
                conn, seeded.namespace_id, queue, worker_id="w", max_tasks=LEASE, lease_seconds=30
            )
            transaction.rollback()
    finally:
        sa.event.remove(seeded.engine, "before_cursor_execute", capture)
    order = [(g.task.priority, g.task.available_at) for g in grants]
    return captured, order


@pytest.mark.parametrize("queue", QUEUES)
def test_the_claim_reads_the_index_in_lease_order_without_a_sort(seeded: Seeded, queue: str) -> None:
    """Every claim read: the plain lease's one, a limited lease's first and, in ``crowded``, its read past the
    full key (whose later rows it steps over: the key is no column of the index, so that read is bounded by
    the queue's waiting tasks, never by the finished ones)."""
    statements, order = _claim_statements(seeded, queue)
    assert len(order) == LEASE and order == sorted(order, key=lambda g: (-g[0], g[1]))
    # on MariaDB a limited queue's lease also runs the plain claim's read (with the queue's lookup, in one
    # statement), which the gate's subquery keeps from reading any task
    mysql = seeded.engine.dialect.name == "mysql"
    merged = queue != "plain" and mysql
    # the plain claim: one read per priority range (above, at and below the default), on MySQL/MariaDB in
    # the one statement with the queue's lookup
    plain = 1 if mysql else 3
    assert len(statements) == {"plain": plain, "limited": 1, "crowded": 2}[queue] + merged, [
        s for s, _ in statements
    ]
    for statement, parameters in statements:
        # plain: ~LEASE entries; limited: 4 x LEASE entries, each with its key's permit count looked up
        most = {"plain": 100, "limited": 400, "crowded": WAITING}[queue]
        _assert_indexed(seeded.engine, statement, parameters, most_reads=most)


def test_postgres_lease_statements_read_the_index_in_lease_order(seeded: Seeded) -> None:
    """PostgreSQL's plain lease (``leases.lease``, autocommitted): the probe's count of due tasks and the
    claim statement's walk of the queue's priorities (``levels``) and its ``picked`` read (``FOR UPDATE
    SKIP LOCKED``) read ``ix_tasks_claim_order``, with no sort but ``picked``'s merge of its levels' reads
    (at most ``slots`` rows; EXPLAINed, not run: the claim statement writes). The probe's sweep-due reads
    (``lapsed``, ``overdue``: index ranges in index order, which over this module's table, with no attempt
    and no deadline, the planner may as well sort) are the next test's."""
    if seeded.engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL's statements")
    params = {"namespace_id": seeded.namespace_id, "queue": "plain"}
    slots = [str(uuid.uuid4()) for _ in range(LEASE)]
    claim = {
        **params, "attempt_ids": slots, "token_hashes": ["0" * 64] * LEASE, "lease_seconds": 30.0,
        "worker_id": "w", "actor": "worker:w",
    }  # fmt: skip
    with seeded.engine.connect() as conn:
        for statement, values, part in (
            (postgres_leases._pg_probe(LEASE), params, None),
            *((postgres_leases._pg_claim_statement(start, LEASE), claim, cte) for start in (False, True)
              for cte in ("CTE levels", "CTE picked")),
        ):  # fmt: skip
            compiled = statement.compile(dialect=seeded.engine.dialect)
            [[document]] = conn.exec_driver_sql(
                f"EXPLAIN (FORMAT JSON) {compiled}", compiled.construct_params(values)
            ).all()
            plan = document[0]["Plan"]
            read = next(n for n in _plan_nodes(plan) if n.get("Subplan Name") == part) if part else plan
            # (picked's walk, a CTE of its own, is checked as such)
            past = ("lapsed", "overdue", *(["CTE levels"] if part == "CTE picked" else []))
            nodes = list(_plan_nodes(read, past=past))
            scans = [
                n for n in nodes if n.get("Relation Name") == "tasks" and n.get("Index Name") != "tasks_pkey"
            ]
            assert any(n.get("Index Name") == "ix_tasks_claim_order" for n in scans), nodes
            assert all(n["Node Type"] in ("Index Scan", "Index Only Scan") for n in scans), nodes
            sorts = [n for n in nodes if n["Node Type"] in ("Sort", "Incremental Sort")]
            if part == "CTE picked":  # the merge of the levels' reads, each a range of one priority
                [merge] = [n for n in read["Plans"] if n["Parent Relationship"] == "Outer"]
                assert read["Node Type"] == "Limit" and sorts == [merge], nodes
                assert all("priority = " in n["Index Cond"] for n in scans), nodes
            else:
                assert not sorts, nodes
            if part:
                assert all(n.get("Index Name") == "ix_tasks_claim_order" for n in scans), nodes


BUSY = 20000


def test_postgres_probe_reads_no_table_to_tell_whether_a_sweep_is_due(seeded: Seeded) -> None:
    """The PostgreSQL probe's two ``EXISTS`` (a lapsed live attempt of the queue, an overdue waiting task)
    read a range of ``ix_task_attempts_status_expiry`` and ``ix_tasks_status_deadline`` up to the clock,
    never the table, in a busy queue: ``BUSY`` tasks, nine in ten live (``LEASED``/``RUNNING``, their
    leases an hour from lapsing; the others finished), and ``BUSY // 4`` waiting ones due in an hour, half
    with a deadline in two hours, so no sweep is due and the lease is empty (issue 28: an empty lease must not cost more as the tables
    grow). Before, the planner, unable to estimate a range bound read in the same statement, scanned
    task_attempts (all 20,000 rows) for any one match (and tasks too, with more waiting tasks with a
    deadline). EXPLAIN ANALYZE (the probe writes nothing), in a transaction rolled back with the rows and
    their ANALYZE."""
    if seeded.engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL's statement")
    with seeded.engine.connect() as conn, conn.begin() as transaction:
        store.create_queue(conn, seeded.ns, "busy")
        queue_id = conn.execute(
            sa.select(queues.c.id).where(
                queues.c.namespace_id == seeded.namespace_id, queues.c.name == "busy"
            )
        ).scalar_one()
        now = db_now(conn)
        rows, attempts = [], []
        for n in range(BUSY + BUSY // 4):
            task_id, attempt_id = str(uuid.uuid4()), str(uuid.uuid4())
            status = "WAITING" if n >= BUSY else "SUCCEEDED" if n % 10 == 0 else ("LEASED", "RUNNING")[n % 2]
            waiting, finished = status == "WAITING", status == "SUCCEEDED"
            rows.append({
                "id": task_id, "namespace_id": seeded.namespace_id, "queue_id": queue_id, "handler": "h",
                "params": {}, "status": status, "state_version": 1, "attempt_count": 0 if waiting else 1,
                "max_attempts": 3, "available_at": now + timedelta(hours=1) if waiting else now,
                "created_at": now, "updated_at": now, "finished_at": now if finished else None,
                "deadline": now + timedelta(hours=2) if waiting and n % 2 else None,
                "current_attempt_id": None if waiting else attempt_id,
            })  # fmt: skip
            if not waiting:
                attempts.append({
                    "id": attempt_id, "task_id": task_id, "generation": 1, "lease_token_hash": "0" * 64,
                    "worker_id": "w", "status": status, "lease_seconds": 3600.0, "leased_at": now,
                    "lease_expires_at": now + timedelta(hours=-1 if finished else 1),
                    "finished_at": now if finished else None,
                })  # fmt: skip
        conn.execute(tasks.insert(), rows)
        conn.execute(task_attempts.insert(), attempts)
        conn.exec_driver_sql("ANALYZE tasks")
        conn.exec_driver_sql("ANALYZE task_attempts")
        values = {"namespace_id": seeded.namespace_id, "queue": "busy"}
        documents = []
        # the probe, and the queue's lookup of lease_tasks's transaction (a limited queue's lease, or one
        # with a sweep due), which reads whether a sweep is due the same way (before: 4-7 ms, the tables read)
        for statement in (postgres_leases._pg_probe(LEASE), postgres_leases._PG_FIND_QUEUE):
            compiled = statement.compile(dialect=seeded.engine.dialect)
            [[document]] = conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {compiled}", compiled.construct_params(values)
            ).all()
            documents.append(document)
        probed = conn.execute(postgres_leases._pg_probe(LEASE), values).one()
        found = conn.execute(postgres_leases._PG_FIND_QUEUE, values).one()
        transaction.rollback()
    assert probed.q_sweep_due is False and probed.q_due == 0, probed
    assert found.id == probed.q_id and found.sweep_due is False, found
    for document in documents:
        nodes = list(_plan_nodes(document[0]["Plan"]))
        read = [n for n in nodes if n.get("Relation Name") in ("tasks", "task_attempts")]
        scans = [(n["Node Type"], n["Relation Name"], n.get("Index Name")) for n in read]
        assert all(kind in ("Index Scan", "Index Only Scan") for kind, _, _ in scans), scans  # no Seq Scan
        ranges = {
            "task_attempts": ("ix_task_attempts_status_expiry", "lease_expires_at <="),
            "tasks": ("ix_tasks_status_deadline", "deadline <="),
        }
        for relation, (index, bound) in ranges.items():
            [scan] = [n for n in read if n.get("Index Name") == index]
            assert scan["Relation Name"] == relation and bound in scan["Index Cond"], scan
            assert scan["Actual Rows"] == 0 and not scan.get("Rows Removed by Filter"), scan
        # the sweep's reads of tasks: by primary key (an attempt's task) or the deadline range, nothing else
        used = {n.get("Index Name") for n in read}
        assert used <= {"tasks_pkey", "ix_tasks_claim_order", *(index for index, _ in ranges.values())}, nodes


SCHEDULED = 20000


def test_postgres_lease_reads_no_task_not_yet_due(seeded: Seeded) -> None:
    """PostgreSQL's lease reads no more with ``SCHEDULED`` waiting tasks not yet due than with 12 (issue 28):
    two queues, ``few`` and ``many``, hold 12 and ``SCHEDULED`` tasks due in an hour, of priorities 0 to 5;
    the probe is EXPLAIN ANALYZEd on each with no task due, then with 3 due at priority 0 (behind all the
    scheduled ones of higher priorities in lease order, before those of priority 0), and the claim
    statement (in a savepoint rolled back), which then runs and grants those 3. Each reads no more index
    and table pages in ``many`` than in ``few`` but for a few (a range may cross a leaf page more). Before,
    one read of ``ix_tasks_claim_order`` in lease order, bounded by the clock only after the priority, read
    every scheduled task the probe met before its ``max_tasks``-th due one (all of them) and the claim
    before its ``slots``-th (the higher priorities'): in ``many`` 305 pages (probe) and 252 (the claim's
    read), in ``few`` 12 and 7; walked by priority, 37-43 in both. In a transaction rolled back with the
    rows and their ANALYZE."""
    if seeded.engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL's statements")

    def pages(document: Any, cte: str | None = None) -> int:
        node = document[0]["Plan"]
        if cte is not None:
            node = next(n for n in _plan_nodes(node) if n.get("Subplan Name") == cte)
        return int(node["Shared Hit Blocks"] + node["Shared Read Blocks"])

    def explained(conn: Any, statement: Any, values: dict[str, Any]) -> Any:
        compiled = statement.compile(dialect=seeded.engine.dialect)
        with conn.begin_nested() as savepoint:  # the claim statement writes
            [[document]] = conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {compiled}", compiled.construct_params(values)
            ).all()
            savepoint.rollback()
        return document

    read: dict[str, dict[str, int]] = {}
    queue_ids: dict[str, int] = {}
    with seeded.engine.connect() as conn, conn.begin() as transaction:
        now = db_now(conn)
        for name, count in (("few", 12), ("many", SCHEDULED)):
            store.create_queue(conn, seeded.ns, name)
            queue_ids[name] = conn.execute(
                sa.select(queues.c.id).where(
                    queues.c.namespace_id == seeded.namespace_id, queues.c.name == name
                )
            ).scalar_one()
            later = now + timedelta(hours=1)
            rows = [
                _waiting(seeded.namespace_id, queue_ids[name], later, priority=n % 6) for n in range(count)
            ]
            conn.execute(tasks.insert(), rows)
        conn.exec_driver_sql("ANALYZE tasks")
        for name, queue_id in queue_ids.items():
            values, probe = (
                {"namespace_id": seeded.namespace_id, "queue": name},
                postgres_leases._pg_probe(LEASE),
            )
            assert conn.execute(probe, values).one().q_due == 0
            read[name] = {"probe, none due": pages(explained(conn, probe, values))}
            due = [_waiting(seeded.namespace_id, queue_id, now - timedelta(minutes=3 - n)) for n in range(3)]
            conn.execute(tasks.insert(), due)
            assert conn.execute(probe, values).one().q_due == 3
            read[name]["probe, 3 due"] = pages(explained(conn, probe, values))
            claim = {
                "namespace_id": seeded.namespace_id, "queue": name, "lease_seconds": 30.0,
                "attempt_ids": [str(uuid.uuid4()) for _ in due], "token_hashes": ["0" * 64] * 3,
                "worker_id": "w", "actor": "worker:w",
            }  # fmt: skip
            document = explained(conn, postgres_leases._pg_claim_statement(False, 3), claim)
            read[name]["claim's read"] = pages(document, "CTE picked")  # with the walk it ran (``levels``)
            granted = conn.execute(postgres_leases._pg_claim_statement(False, 3), claim).mappings().all()
            assert {row["id"] for row in granted} == {row["id"] for row in due}, granted
        transaction.rollback()
    for what, few in read["few"].items():
        assert read["many"][what] <= few + 8, read


def _waiting(
    namespace_id: int, queue_id: int, available_at: datetime, *, priority: int = 0
) -> dict[str, Any]:
    """A waiting task's row, due at ``available_at``."""
    return {
        "id": str(uuid.uuid4()), "namespace_id": namespace_id, "queue_id": queue_id, "handler": "h",
        "params": {}, "status": "WAITING", "state_version": 1,
        "attempt_count": 0, "max_attempts": 3, "available_at": available_at, "created_at": available_at,
        "updated_at": available_at, "priority": priority,
    }  # fmt: skip


def _assert_indexed(engine: Engine, statement: str, parameters: Any, *, most_reads: int) -> None:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            plan = [row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)]
            tasks_steps = [step for step in plan if "tasks" in step and "concurrency_permits" not in step]
            assert any("USING INDEX ix_tasks_claim_order" in step for step in tasks_steps), plan
            assert not any("TEMP B-TREE" in step for step in plan), plan
            return
        if engine.dialect.name == "postgresql":
            # The claim's tasks are read from the index in lease order: an Index Scan of ix_tasks_claim_order
            # feeding the LIMIT, and no Sort node anywhere in the plan.
            [[document]] = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).all()
            nodes = list(_plan_nodes(document[0]["Plan"]))
            scans = [n for n in nodes if n.get("Relation Name") == "tasks"]
            assert scans and all(n.get("Index Name") == "ix_tasks_claim_order" for n in scans), nodes
            assert all(n["Node Type"] in ("Index Scan", "Index Only Scan") for n in scans), nodes
            assert not [n for n in nodes if n["Node Type"] in ("Sort", "Incremental Sort")], nodes
            return
        plan = [dict(row) for row in conn.exec_driver_sql(f"EXPLAIN {statement}", parameters).mappings()]
        # the claim's own read (on MariaDB, the first part of a UNION with the queue's row, whose subqueries
        # read tasks through other indexes to tell whether a sweep is due)
        [claim] = [
            row for row in plan if row["table"] == "tasks" and row["select_type"] in ("SIMPLE", "PRIMARY")
        ]
        assert claim["key"] == "ix_tasks_claim_order", plan
        assert claim["type"] not in ("ALL", "index"), plan  # not a scan of the table or of a whole index
        assert "filesort" not in (claim["Extra"] or "") and "temporary" not in (claim["Extra"] or ""), plan
        # Run it: it reads a few entries past the first LEASE due rows (in the limited path up to the
        # oversampled read), never the queue's finished tasks, and sorts nothing (with the old index it
        # read and sorted all 2,700 due tasks).
        conn.exec_driver_sql("FLUSH STATUS")
        conn.exec_driver_sql(statement, parameters).all()
        status = dict(conn.exec_driver_sql("SHOW SESSION STATUS").all())
        conn.rollback()
        reads = {name: int(status[name]) for name in ("Handler_read_key", "Handler_read_next",
                                                      "Handler_read_prev", "Handler_read_rnd_next")}  # fmt: skip
        assert int(status["Sort_rows"]) == 0, status["Sort_rows"]
        assert sum(reads.values()) < most_reads, reads


def _plan_nodes(node: dict[str, Any], *, past: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    """A PostgreSQL JSON plan node and every node under it, but for the subtrees of the nodes whose
    ``Alias`` or ``Subplan Name`` is one of ``past``."""
    if node.get("Alias") in past or node.get("Subplan Name") in past:
        return
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child, past=past)


def test_a_lease_reads_no_default_priority_task_not_yet_due(seeded: Seeded) -> None:
    """MariaDB and SQLite (issue 28: no call that grows with the table): a queue of the default priority
    with ``SCHEDULED`` waiting tasks due in an hour and 3 due; a lease asks for ``LEASE`` (more than are due,
    as an idle worker's does). Its default-priority read is a range of ``ix_tasks_claim_order`` bounded by
    the clock (``queue_id``, ``status``, ``priority``, ``available_at``), so the tasks not yet due are never
    read. Before, one read in lease order, bounded by the clock only after the priority, read on past the
    due ones through every task not yet due to fill its ``LIMIT`` (on MariaDB 8 ms with 50,000 scheduled,
    0.8 with 10). In a transaction rolled back."""
    name = seeded.engine.dialect.name
    if name == "postgresql":
        pytest.skip("PostgreSQL walks the priorities (test_postgres_lease_reads_no_task_not_yet_due)")
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().startswith(("SELECT", "(SELECT")) and "tasks.available_at <=" in statement:
            captured.append((statement, parameters))

    with seeded.engine.connect() as conn, conn.begin() as transaction:
        now = db_now(conn)
        store.create_queue(conn, seeded.ns, "scheduled")
        queue_id = conn.execute(
            sa.select(queues.c.id).where(
                queues.c.namespace_id == seeded.namespace_id, queues.c.name == "scheduled"
            )
        ).scalar_one()
        later = [_waiting(seeded.namespace_id, queue_id, now + timedelta(hours=1)) for _ in range(SCHEDULED)]
        for start in range(0, SCHEDULED, 5000):
            conn.execute(tasks.insert(), later[start : start + 5000])
        due = [_waiting(seeded.namespace_id, queue_id, now - timedelta(minutes=3 - n)) for n in range(3)]
        conn.execute(tasks.insert(), due)
        sa.event.listen(seeded.engine, "before_cursor_execute", capture)
        try:
            grants = leases.lease_tasks(
                conn, seeded.namespace_id, "scheduled", worker_id="w", max_tasks=LEASE, lease_seconds=30
            )
        finally:
            sa.event.remove(seeded.engine, "before_cursor_execute", capture)
        assert sorted(g.task.id for g in grants) == sorted(row["id"] for row in due)
        if name == "sqlite":  # one statement per priority range (above, at and below the default)
            assert len(captured) == 3, captured
            plans = [
                [row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)]
                for statement, parameters in captured
            ]
            # each a range of the index with the priority bounded (a `priority != 0` read the whole queue)
            for plan in plans:
                assert any(
                    "ix_tasks_claim_order (queue_id=? AND status=? AND priority" in step for step in plan
                ), plan
            assert any(
                "ix_tasks_claim_order (queue_id=? AND status=? AND priority=? AND available_at<" in step
                for plan in plans
                for step in plan
            ), plans
        else:
            [(statement, parameters)] = captured
            [[document]] = conn.exec_driver_sql(f"EXPLAIN FORMAT=JSON {statement}", parameters).all()
            reads = [
                node for node in _json_nodes(json.loads(document))
                if node.get("table_name") == "tasks" and node.get("key") == "ix_tasks_claim_order"
            ]  # fmt: skip
            # The optimizer sizes each range by diving into the index: the default priority's is bounded by
            # the clock (its key covers available_at), a few rows; one read of the queue's waiting tasks
            # (the old claim) was sized at all of them.
            # each part's range (the default priority's, and the others': this queue has the default only)
            assert len(reads) == 2, reads
            assert all(read["access_type"] == "range" and int(read["rows"]) < 100 for read in reads), [
                (r["access_type"], r.get("key_length"), r.get("rows")) for r in reads
            ]
        transaction.rollback()


def _json_nodes(node: Any) -> Iterator[dict[str, Any]]:
    """Every object in a MariaDB ``EXPLAIN FORMAT=JSON`` document."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _json_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _json_nodes(value)
