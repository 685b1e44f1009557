"""PostgreSQL's autocommitted lease: a plain queue's lease call in two statements, each its own transaction
(no ``BEGIN``, no ``COMMIT``): the probe (:func:`_pg_probe`, one ``SELECT``: the queue, its gate, the clock,
whether a sweep is due and how many tasks are due) and, when tasks are due, the claim
(:func:`_pg_claim_statement`: the grants, their attempts and events in one statement); and the sweep-due
read of the transaction path's queue lookup on PostgreSQL (:data:`_PG_FIND_QUEUE`).

:func:`orbit_server.tasks.leases.lease` dispatches here (:func:`_lease_postgres`) and runs
:func:`~orbit_server.tasks.leases.lease_tasks`'s transaction for every other case (a sweep due, a limited
queue, another database). Apart from :mod:`.leases` because it is a second idea there: hand-written SQL
tuned to PostgreSQL's planner, with its measurements; what both paths read is in :mod:`.lease_rows`.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_client import AttemptLease, LeaseGrant, TaskStatus
from orbit_server import errors
from orbit_server.db import faults as _faults
from orbit_server.db.engine import is_lock_conflict, note_autocommitted_write
from orbit_server.db.schema import tasks
from orbit_server.tasks import store
from orbit_server.tasks.lease_rows import _QUEUE_INFO, _lease_order, _QueueRow
from orbit_server.tasks.transitions import _at, _hash_token, _naive


def _due_at_level(queue: str, priority: str, now: str) -> str:
    """PostgreSQL: the condition that a task is one of queue ``queue``'s due tasks (at time ``now``) of
    priority ``priority`` (each an SQL expression): with ``ix_tasks_claim_order``'s first three columns
    fixed, ``available_at <= now`` bounds a range of that index, which holds exactly those tasks in lease
    order (``available_at``, ``id``) but for the filtered few (a cancel asked for, a deadline passed)."""
    return (
        f"tasks.queue_id = {queue} AND tasks.status = 'WAITING' AND tasks.priority = {priority}"
        f" AND tasks.available_at <= {now} AND tasks.cancel_requested = false"
        f" AND (tasks.deadline IS NULL OR tasks.deadline > {now})"
    )


def _next_level(queue: str, above: str | None) -> str:
    """PostgreSQL: a ``SELECT`` of the highest priority of queue ``queue``'s waiting tasks (below
    ``above``, when given; each an SQL expression), due or not, and the earliest ``available_at`` of that
    priority's waiting tasks: the first entry of that priority in ``ix_tasks_claim_order``, one descent;
    no row when there is none."""
    below = f" AND tasks.priority < {above}" if above is not None else ""
    return (
        f"SELECT tasks.priority, tasks.available_at FROM tasks WHERE tasks.queue_id = {queue}"
        f" AND tasks.status = 'WAITING'{below} ORDER BY tasks.priority DESC, tasks.available_at LIMIT 1"
    )


#: PostgreSQL: whether a sweep of the queue ``queues`` is due at ``clock.now`` (:data:`_PG_PROBE`'s comment).
_PG_SWEEP_DUE = (
    "(EXISTS (SELECT FROM (SELECT FROM task_attempts JOIN tasks ON tasks.id = task_attempts.task_id"
    " WHERE task_attempts.status IN ('LEASED', 'RUNNING') AND task_attempts.lease_expires_at <= clock.now"
    " AND tasks.queue_id = queues.id"
    " ORDER BY task_attempts.status, task_attempts.lease_expires_at OFFSET 0) AS lapsed)"
    " OR EXISTS (SELECT FROM (SELECT FROM tasks WHERE tasks.status = 'WAITING'"
    " AND tasks.deadline IS NOT NULL AND tasks.deadline <= clock.now AND tasks.queue_id = queues.id"
    " ORDER BY tasks.status, tasks.deadline OFFSET 0) AS overdue))"
)
#: PostgreSQL: the clock and the queue ``:queue`` of ``:namespace_id`` with its namespace and gate.
_PG_QUEUE_FROM = (
    " FROM (SELECT timezone('UTC', clock_timestamp()) AS now OFFSET 0) AS clock,"
    " queues JOIN namespaces ON namespaces.id = queues.namespace_id"
    " LEFT OUTER JOIN queue_gates ON queue_gates.queue_id = queues.id"
    " WHERE queues.namespace_id = :namespace_id AND queues.name = :queue"
)
#: PostgreSQL: ``:namespace_id``'s queue ``:queue`` as :func:`.leases._find_queue_statement` reads it (columns
#: :data:`_QUEUE_INFO`) and ``q_due``: how many of its tasks are due, up to ``:max_tasks`` (read through
#: ``ix_tasks_claim_order``, locking nothing; ``NULL`` unless its gate is plain and no sweep is due). One
#: ``SELECT`` (so, autocommitted, it writes nothing); the clock is read once (the ``clock`` subquery). Run
#: as :func:`_pg_probe` writes it, ``:max_tasks`` a number. Whether a sweep is due: a live attempt of the
#: queue whose lease has lapsed, or a waiting task past its deadline, each read as a range of its index
#: (``ix_task_attempts_status_expiry``, ``ix_tasks_status_deadline``) up to the clock, so telling whether a
#: sweep is due reads no more with a million live attempts or waiting tasks than with ten (issue 28). Each
#: is an ``EXISTS`` over a fenced (``OFFSET 0``) read ordered as its index: the planner cannot estimate the
#: range's bound (the clock, read in the same statement) and, asked for any one row, preferred a sequential
#: scan of the table (with 22,500 live attempts, none lapsed: all 25,000 attempts read, 4.6 ms of the
#: probe's 5.6); asked for rows in index order (the ``ORDER BY``, which an ``EXISTS`` of its own would
#: drop), it reads the index range, which a scan could match only by sorting the whole table (4 index pages,
#: the probe 0.4 ms).
#: How many tasks are due is counted level by level (issue 28): ``levels`` walks the priorities of the
#: queue's waiting tasks from the highest down (a loose index scan: the priorities in use are few, at most
#: 201), one descent of ``ix_tasks_claim_order`` each to its first entry (:func:`_next_level`), whose
#: ``available_at`` is the level's earliest; only a level whose earliest task is due has its due tasks read,
#: a range of that index up to the clock (:func:`_due_at_level`), up to ``:max_tasks``; the walk stops as
#: soon as ``:max_tasks`` are counted (no ``ORDER BY``: a count needs no order, so the ``LIMIT`` stops the
#: nested loop, and the walk with it). One read of the index in lease order, bounded by the clock only after
#: the priority, read every waiting task not yet due that came before the ``:max_tasks``-th due one: with
#: 50,000 tasks scheduled an hour ahead and none due, 718 pages and 1.6-4 ms (EXPLAIN ANALYZE, load 1-2); by
#: level, 16 pages and 0.07 ms, as with 10 (12 pages before). Each further priority in use costs a descent
#: (3 pages): with all 201 in use, 630-690 pages and 0.6-1 ms however many tasks wait (29 pages with 1,000
#: tasks before, 708 with 50,000).
_PG_PROBE = sa.text(
    "SELECT q.*, CASE WHEN NOT q.q_sweep_due AND q.q_paused IS NOT TRUE AND q.q_per_key IS NULL"
    " AND q.q_max IS NULL THEN (WITH RECURSIVE levels (priority, earliest) AS"
    f" (({_next_level('q.q_id', None)}) UNION ALL SELECT below.priority, below.available_at FROM levels"
    f" CROSS JOIN LATERAL ({_next_level('q.q_id', 'levels.priority')}) AS below)"
    " SELECT count(*) FROM (SELECT FROM levels CROSS JOIN LATERAL (SELECT FROM tasks"
    f" WHERE {_due_at_level('q.q_id', 'levels.priority', 'q.q_now')}"
    " ORDER BY tasks.available_at, tasks.id LIMIT :max_tasks) AS level WHERE levels.earliest <= q.q_now"
    " LIMIT :max_tasks) AS due) END AS q_due"
    " FROM (SELECT queues.id AS q_id, namespaces.name AS q_namespace, clock.now AS q_now,"
    " queue_gates.paused AS q_paused, queue_gates.max_concurrency_per_key AS q_per_key,"
    " queue_gates.max_concurrency AS q_max,"
    f" {_PG_SWEEP_DUE} AS q_sweep_due{_PG_QUEUE_FROM} OFFSET 0) AS q"
)
#: PostgreSQL: :func:`.leases._find_queue_statement`, its sweep due read as :data:`_PG_PROBE` reads it.
#: Built from SQLAlchemy's constructs, its two ``EXISTS`` were planned as reads of the tables: 4-7 ms per
#: lease with 100,000 tasks (``bench.lease_scheduled``'s column "10 asked, 3 due", which takes this path),
#: on every lease of a limited queue and every one with a sweep due.
_PG_FIND_QUEUE = sa.text(
    "SELECT queues.id AS id, namespaces.name AS name, clock.now AS db_now, queue_gates.paused AS paused,"
    " queue_gates.max_concurrency_per_key AS max_concurrency_per_key,"
    f" queue_gates.max_concurrency AS max_concurrency, {_PG_SWEEP_DUE} AS sweep_due{_PG_QUEUE_FROM}"
)
#: :func:`_pg_probe`'s statements, by ``max_tasks``.
_PG_PROBES: dict[int, sa.TextClause] = {}


def _pg_probe(max_tasks: int) -> sa.TextClause:
    """:data:`_PG_PROBE` for ``max_tasks`` (1-100), written as a number in its text, not a parameter.

    A statement run 5 times on a connection is prepared (psycopg), and PostgreSQL then keeps one plan for
    all its parameters (a generic plan) only when that plan's estimated cost is no more than the plans made
    for each call's values and their planning. Not knowing a ``LIMIT``, a generic plan takes it to return a
    tenth of the rows it limits, which made the walk's generic plan (165) dearer than a plan made for each
    call (97, plus planning), so each probe was planned again: 0.25 ms of the backend's CPU, four times its
    execution (``bench.pg_lease``: an empty lease's database CPU 0.10 -> 0.43 ms). With the number both
    plans are the same and the generic one is kept. One statement per ``max_tasks`` a worker asks for."""
    statement = _PG_PROBES.get(max_tasks)
    if statement is None:
        statement = _PG_PROBES[max_tasks] = sa.text(_PG_PROBE.text.replace(":max_tasks", str(int(max_tasks))))
    return statement


#: :func:`_pg_claim_statement`'s statements, by ``(start, slots)``.
_PG_CLAIM: dict[tuple[bool, int], sa.TextClause] = {}


def _pg_claim_statement(start: bool, slots: int) -> sa.TextClause:
    """PostgreSQL: a plain queue's lease of up to ``slots`` tasks (1-100, as many as ``:attempt_ids``) in one
    statement (autocommitted, so one transaction). ``slots`` is written as a number in its text, as
    :func:`_pg_probe` writes ``max_tasks`` and for the same reason: with a parameter, each lease's statement
    was planned again (``bench.pg_lease``, a lease with one grant: 1.13 ms of the database's CPU, 0.73
    before this walk); with the number 0.45-0.53 ms (0.55-0.78 before, in the same runs).

    Its ``WITH`` queries: ``clock`` (the database time ``now`` and the leases' expiry, read once); ``found``
    (:data:`_PG_PROBE`'s queue row and gate, read again; not whether a sweep is due: the probe found none a
    moment before, and a lease that lapsed since is the next lease's to sweep, as one that lapses just after
    this statement is); ``picked``: up to ``slots`` due tasks in lease order, read only when the gate read
    here is neither paused nor limited (so a pause or a limit committed after the probe is honoured). Its
    own ``levels`` walks the priorities of the queue's waiting tasks from the highest down as
    :data:`_PG_PROBE` walks them, each with how many due tasks were counted above it (``before``) and up to
    it (``seen``; each level's counted up to ``slots``, and not read when its earliest task is not yet due),
    and stops at the level where ``seen`` reaches ``slots``; then each level with due tasks gives its range
    of them (:func:`_due_at_level`) in index order, up to the ``slots - before`` it may give (``FOR UPDATE
    SKIP LOCKED``, so a task a concurrent lease holds is stepped over and the range read on), sorted (at
    most ``slots`` rows) by level and within it. One read of the index in lease order (bounded by the clock
    only after the priority) read every waiting task not yet due of a higher priority than the due ones:
    with 50,000 tasks scheduled an hour ahead at priority 5 and 3 due at priority 0, the statement read 798
    pages in 1.6-4 ms; by level, 104 pages (most of them its writes) in 0.3 ms, as with 10 (92 pages
    before). A level whose counted tasks a concurrent lease holds gives fewer, and the walk, which counted
    them (read without a lock), does not go down for more: this lease then grants fewer than
    :data:`_PG_PROBE` counted, as when a concurrent lease took them just before, never a wrong task (the one
    read in lease order read on past them into the lower priorities).
    ``claimed``: the conditional ``UPDATE`` of each picked task, still ``WAITING`` at the
    ``state_version`` it was picked at, to ``LEASED`` (with ``start``: ``RUNNING`` if retry-safe), its
    ``attempt_count`` (the new attempt's generation) counted and its ``current_attempt_id`` one of
    ``:attempt_ids`` (the token digest of the same place in ``:token_hashes`` goes with it), ``RETURNING``
    the changed rows; then the attempt and the event(s) of each changed row (``leased``; and ``started`` for
    a started one, as :func:`.leases.lease_tasks` writes them), inserted from ``claimed`` alone. The
    answer: the queue row (columns :data:`_QUEUE_INFO` and ``q_expires``) joined to each claimed task's new
    row (one row with ``NULL`` task columns when none). No row: no such queue.

    A row that changed after it was picked (possible only when claims lock nothing, test-only) is not
    updated, so it gets no attempt and no event, and is not granted: correctness never rests on
    ``SKIP LOCKED``."""
    statement = _PG_CLAIM.get((start, slots))
    if statement is None:
        slots = int(slots)
        waiting, leased, running = (
            s.value for s in (TaskStatus.WAITING, TaskStatus.LEASED, TaskStatus.RUNNING)
        )
        status = (
            f"CASE WHEN tasks.retry_safe THEN '{running}' ELSE '{leased}' END" if start else f"'{leased}'"
        )
        steps = "CASE WHEN tasks.retry_safe THEN 2 ELSE 1 END" if start else "1"
        lock = " FOR UPDATE OF tasks SKIP LOCKED" if _faults.LOCK_CLAIMS else ""
        columns = ", ".join(f"tasks.{c.name}" for c in tasks.c)

        def due(queue: str, priority: str) -> str:
            return _due_at_level(queue, priority, "(SELECT now FROM clock)")

        def count(queue: str, level: str) -> str:  # how many of the level's tasks are due, up to slots
            return (
                f"CASE WHEN {level}.available_at <= (SELECT now FROM clock) THEN (SELECT count(*)"
                f" FROM (SELECT FROM tasks WHERE {due(queue, level + '.priority')} LIMIT {slots}) AS due)"
                " ELSE 0 END"
            )

        statement = _PG_CLAIM[(start, slots)] = sa.text(
            "WITH clock AS MATERIALIZED (SELECT now, now + make_interval(secs => :lease_seconds) AS expires"
            " FROM (SELECT timezone('UTC', clock_timestamp()) AS now) AS c),"
            " found AS MATERIALIZED (SELECT queues.id, namespaces.name, queue_gates.paused,"
            " queue_gates.max_concurrency_per_key, queue_gates.max_concurrency, false AS sweep_due"
            " FROM queues JOIN namespaces ON namespaces.id = queues.namespace_id"
            " LEFT OUTER JOIN queue_gates ON queue_gates.queue_id = queues.id"
            " WHERE queues.namespace_id = :namespace_id AND queues.name = :queue),"
            " picked AS MATERIALIZED (WITH RECURSIVE levels (queue_id, priority, before, seen) AS"
            " (SELECT plain.id, top.priority, CAST(0 AS bigint),"
            f" {count('plain.id', 'top')} FROM (SELECT found.id FROM found WHERE found.paused IS NOT TRUE"
            " AND found.max_concurrency_per_key IS NULL AND found.max_concurrency IS NULL) AS plain"
            f" CROSS JOIN LATERAL ({_next_level('plain.id', None)}) AS top"
            " UNION ALL SELECT levels.queue_id, below.priority, levels.seen,"
            f" levels.seen + {count('levels.queue_id', 'below')}"
            f" FROM levels CROSS JOIN LATERAL ({_next_level('levels.queue_id', 'levels.priority')}) AS below"
            f" WHERE levels.seen < {slots})"
            " SELECT level.id, level.state_version FROM levels CROSS JOIN LATERAL"
            " (SELECT tasks.id, tasks.state_version, tasks.available_at FROM tasks"
            f" WHERE {due('levels.queue_id', 'levels.priority')}"
            f" ORDER BY tasks.available_at, tasks.id LIMIT {slots} - levels.before{lock}) AS level"
            " WHERE levels.seen > levels.before ORDER BY levels.priority DESC, level.available_at, level.id"
            f" LIMIT {slots}),"
            " slots AS (SELECT numbered.id, numbered.state_version, given.attempt_id, given.token_hash"
            " FROM (SELECT picked.id, picked.state_version, row_number() OVER () AS n FROM picked) AS numbered"
            " JOIN unnest(CAST(:attempt_ids AS text[]), CAST(:token_hashes AS text[])) WITH ORDINALITY"
            " AS given (attempt_id, token_hash, n) ON given.n = numbered.n),"
            f" claimed AS (UPDATE tasks SET status = {status}, state_version = tasks.state_version + {steps},"
            " attempt_count = tasks.attempt_count + 1, current_attempt_id = slots.attempt_id,"
            " updated_at = (SELECT now FROM clock) FROM slots"
            " WHERE tasks.id = slots.id AND tasks.state_version = slots.state_version"
            f" AND tasks.status = '{waiting}' RETURNING {columns}, slots.token_hash),"
            " attempted AS (INSERT INTO task_attempts (id, task_id, generation, lease_token_hash, worker_id,"
            " status, lease_seconds, leased_at, lease_expires_at)"
            " SELECT claimed.current_attempt_id, claimed.id, claimed.attempt_count, claimed.token_hash,"
            " :worker_id, claimed.status, :lease_seconds, clock.now, clock.expires FROM claimed, clock),"
            " logged AS (INSERT INTO task_events (task_id, state_version, event, from_status, to_status, actor,"
            " reason, data, created_at)"
            " SELECT claimed.id, claimed.state_version"
            + (f" - CASE WHEN claimed.status = '{running}' THEN 1 ELSE 0 END" if start else "")
            + f", 'leased', '{waiting}', '{leased}', :actor, NULL,"
            " json_build_object('attempt_id', claimed.current_attempt_id, 'generation', claimed.attempt_count),"
            " clock.now FROM claimed, clock"
            + (
                f" UNION ALL SELECT claimed.id, claimed.state_version, 'started', '{leased}', '{running}', :actor,"
                " 'lease-and-start', json_build_object('attempt_id', claimed.current_attempt_id), clock.now"
                f" FROM claimed, clock WHERE claimed.status = '{running}'"
                if start
                else ""
            )
            + ")"
            " SELECT found.id AS q_id, found.name AS q_namespace, clock.now AS q_now, found.paused AS q_paused,"
            " found.max_concurrency_per_key AS q_per_key, found.max_concurrency AS q_max,"
            " found.sweep_due AS q_sweep_due, clock.expires AS q_expires, claimed.*"
            " FROM found CROSS JOIN clock LEFT OUTER JOIN claimed ON true"
        )
    return statement


def _lease_postgres(
    engine: Engine, namespace_id: int, queue: str, *, worker_id: str, max_tasks: int, lease_seconds: float,
    start: bool,
) -> tuple[_QueueRow | None, list[LeaseGrant] | None]:  # fmt: skip
    """:func:`.leases.lease`'s autocommitted statements (PostgreSQL): ``(the queue's row, the grants)``;
    the grants are ``None`` when :func:`.leases.lease_tasks`'s transaction must lease (a sweep due, a limited
    queue, a lock conflict), the queue's row ``None`` when that must read it again."""
    params: dict[str, Any] = {"namespace_id": namespace_id, "queue": queue}
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        probed = conn.execute(_pg_probe(max_tasks), params).first()
        if probed is None:
            raise errors.QueueNotFound(f"queue {queue!r} does not exist in this namespace")
        found = _QueueRow(*probed[:7])
        if probed.q_due is None:  # a sweep due, the gate paused or limited
            return found, [] if found.paused and not found.sweep_due else None
        if not probed.q_due:
            return found, []  # an empty lease: that one statement, which wrote nothing
        tokens = [secrets.token_urlsafe(32) for _ in range(probed.q_due)]
        attempt_ids = [str(uuid.uuid4()) for _ in tokens]
        note_autocommitted_write()
        values = {
            **params, "attempt_ids": attempt_ids, "token_hashes": [_hash_token(t) for t in tokens],
            "lease_seconds": lease_seconds, "worker_id": worker_id, "actor": f"worker:{worker_id}",
        }  # fmt: skip
        try:
            rows = conn.execute(_pg_claim_statement(start, len(attempt_ids)), values).mappings().all()
        except sa.exc.DBAPIError as exc:
            if not is_lock_conflict(exc):  # possible only when claims lock nothing (test-only)
                raise
            return None, None
    if not rows:
        raise errors.QueueNotFound(f"queue {queue!r} does not exist in this namespace")
    head = rows[0]
    if head["id"] is None:  # nothing claimed: the gate may have changed since the probe
        again = _QueueRow(*(head[name] for name in _QUEUE_INFO))
        limited = again.max_concurrency_per_key is not None or again.max_concurrency is not None
        return again, None if limited and not again.paused else []
    token_of = dict(zip(attempt_ids, tokens, strict=True))
    expires = _at(_naive(head["q_expires"]))
    grants = []
    for row in sorted(rows, key=_lease_order):
        task = store.task_from_row({**row, "namespace_name": head["q_namespace"], "queue_name": queue})  # type: ignore[arg-type]
        attempt = AttemptLease(
            id=row["current_attempt_id"], generation=row["attempt_count"],
            lease_token=token_of[row["current_attempt_id"]], lease_expires_at=expires,
        )  # fmt: skip
        grants.append(LeaseGrant(task=task, attempt=attempt))
    return None, grants
