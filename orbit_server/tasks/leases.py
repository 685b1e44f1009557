"""Leases: grant waiting tasks of a queue to a worker (:func:`lease_tasks`, in a transaction; :func:`lease`,
a lease call's unit of work, which on PostgreSQL leases a plain queue in autocommitted statements:
:mod:`orbit_server.tasks.postgres_leases`) and sweep expired attempts (:func:`expire_leases`); the rules are
in :mod:`orbit_server.tasks.transitions`.
"""

from __future__ import annotations

import functools
import secrets
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_client import (
    AttemptLease,
    AttemptStatus,
    LeaseGrant,
    TaskStatus,
)
from orbit_server import errors
from orbit_server.db import faults as _faults
from orbit_server.db.driver_sql import DriverSQL, insert_of
from orbit_server.db.engine import by_primary_key, db_now
from orbit_server.db.packed_rows import packed, packs, unpacked
from orbit_server.db.schema import (
    concurrency_permits,
    namespaces,
    queue_gates,
    queues,
    task_attempts,
    tasks,
)
from orbit_server.db.transact import transact
from orbit_server.tasks import permits, store
from orbit_server.tasks.lease_rows import _QUEUE_INFO, _lease_order, _QueueRow
from orbit_server.tasks.postgres_leases import _PG_FIND_QUEUE, _lease_postgres
from orbit_server.tasks.transitions import (
    _LIVE,
    APPEND_EVENTS,
    _at,
    _clock,
    _deadline_error,
    _expire_attempt,
    _hash_token,
    _lock_task,
    _naive,
    apply_transition,
)

__all__ = ["expire_leases", "lease", "lease_tasks"]

#: Most expired attempts (and overdue waiting tasks) one sweep pass handles.
_SWEEP_BATCH = 200


# ---------------------------------------------------------------------- leases

#: :func:`_find_queue_statement`'s statement, built once per dialect.
_FIND_QUEUE: dict[str, sa.Executable] = {}


def _find_queue_statement(conn: Connection) -> sa.Executable:
    """The queue named ``:queue`` in ``:namespace_id`` with its namespace's name, its gate, the database
    clock, and ``sweep_due``: whether an attempt of the queue holds a lapsed lease or a waiting task has
    passed its deadline (both read through indexes; the sweep itself then runs only when it is due, so a
    lease that finds nothing to settle costs no statement more)."""
    name = conn.dialect.name
    if name == "postgresql":
        return _PG_FIND_QUEUE
    statement = _FIND_QUEUE.get(name)
    if statement is None:
        clock = _clock(conn)
        lapsed = (
            sa.select(task_attempts.c.id)
            .join(tasks, tasks.c.id == task_attempts.c.task_id)
            .where(
                task_attempts.c.status.in_(_LIVE),
                task_attempts.c.lease_expires_at <= clock,
                tasks.c.queue_id == queues.c.id,
            )
            .exists()
        )
        overdue = (
            sa.select(tasks.c.id)
            .where(
                tasks.c.queue_id == queues.c.id,
                tasks.c.status == TaskStatus.WAITING.value,
                tasks.c.deadline <= clock,
            )
            .exists()
        )
        statement = _FIND_QUEUE[name] = (
            sa.select(
                queues.c.id, namespaces.c.name, clock.label("db_now"), queue_gates.c.paused,
                queue_gates.c.max_concurrency_per_key, queue_gates.c.max_concurrency,
                sa.or_(lapsed, overdue).label("sweep_due"),
            )
            .select_from(
                queues.join(namespaces, namespaces.c.id == queues.c.namespace_id).outerjoin(
                    queue_gates, queue_gates.c.queue_id == queues.c.id
                )
            )
            .where(queues.c.namespace_id == sa.bindparam("namespace_id"), queues.c.name == sa.bindparam("queue"))
        )  # fmt: skip
    return statement


_NOW = sa.bindparam("now", type_=tasks.c.available_at.type)
_DUE = sa.select(tasks).where(
    tasks.c.queue_id == sa.bindparam("queue_id"),
    tasks.c.status == TaskStatus.WAITING.value,
    tasks.c.available_at <= _NOW,
    tasks.c.cancel_requested == sa.false(),  # a cancel asked for is never granted
    sa.or_(tasks.c.deadline.is_(None), tasks.c.deadline > _NOW),
)
#: The plain claim's reads: ``:max_tasks`` due tasks of ``:queue_id`` at ``:now``, locked, of the priorities
#: above the default, of the default (0) and of those below, each in lease order (:func:`_claim_read` merges
#: them). One read in lease order would step over every waiting task not yet due of a priority above the last
#: one it takes: with the default priority only, every one of the queue's when fewer are due than asked for
#: (an idle worker's lease; ``bench.lease_scheduled``, results ``lease-scheduled-*``: 0.7 ms with 10 tasks
#: scheduled ahead, 7.9 ms with 50,000, MariaDB). Read apart, the default priority's due tasks are a range of
#: ``ix_tasks_claim_order`` bounded by the clock; each other part is a range of the index too (a single
#: ``priority != 0`` was one on MariaDB, but not on SQLite, which read the whole queue for it).
_LEVELS = (
    (tasks.c.priority > 0, permits.LEASE_ORDER),
    (tasks.c.priority == 0, permits.LEASE_ORDER[1:]),
    (tasks.c.priority < 0, permits.LEASE_ORDER),
)
#: MySQL/MariaDB: a ``priority != 0`` is two ranges of the index there, read in its order; one read fewer.
_MYSQL_LEVELS = (
    (tasks.c.priority == 0, permits.LEASE_ORDER[1:]),
    (tasks.c.priority != 0, permits.LEASE_ORDER),
)
_CLAIM_READS = tuple(
    _faults.skip_locked(_DUE.where(level).order_by(*order).limit(sa.bindparam("max_tasks")))
    for level, order in _LEVELS
)


def _claim_read(conn: Connection, params: Mapping[str, Any]) -> Sequence[Mapping[Any, Any]]:
    """Up to ``params["max_tasks"]`` due tasks of the queue, locked, in lease order (:data:`_CLAIM_READS`).
    The rows read beyond those stay locked until the lease's transaction ends, and are not granted."""
    due = [row for statement in _CLAIM_READS for row in conn.execute(statement, params).mappings()]
    due.sort(key=_lease_order)
    return due[: params["max_tasks"]]


#: The columns of its ``task_row`` (every column of ``tasks``), to read them back.
_TASK_ROW = tuple(tasks.c)
#: :func:`_find_queue_and_claim_statement`'s statements (MySQL/MariaDB), by whether they pack the task rows.
_FIND_QUEUE_AND_CLAIM: dict[bool, sa.Executable] = {}


def _find_queue_and_claim_statement(conn: Connection) -> sa.Executable:
    """MySQL/MariaDB: :func:`_find_queue_statement` and the plain claim's read in one statement (one round
    trip less per lease; an empty lease is this statement and its ``COMMIT``).

    ``(SELECT <task> ... FOR UPDATE SKIP LOCKED) UNION ALL (SELECT <task> ...) UNION ALL SELECT <queue row>``,
    on MariaDB each task row packed into one column, ``task_row`` (:mod:`~orbit_server.db.packed_rows`: the
    descriptions of every column of ``tasks`` were parsed on every lease, empty or not):
    the first two parts are the claim reads of :func:`lease_tasks` (:data:`_MYSQL_LEVELS`: up to
    ``:max_tasks`` due tasks of the queue named ``:queue`` in ``:namespace_id`` at the default priority, and
    of the others, each in lease order from ``ix_tasks_claim_order``; :func:`_find_queue_and_claim` merges
    them), made only when the queue's gate is neither paused nor limited (read by an uncorrelated
    subquery: such a queue takes its own path, under its gate's lock);
    the second is the queue's row as :func:`_find_queue_statement` reads it, its columns named
    :data:`~orbit_server.tasks.lease_rows._QUEUE_INFO` (``NULL`` in the task rows). Both parts read the
    clock of the same statement (MySQL's ``UTC_TIMESTAMP`` is the statement's time), and the subqueries
    lock nothing."""
    pack = packs(conn.dialect)
    statement = _FIND_QUEUE_AND_CLAIM.get(pack)
    if statement is None:
        clock = _clock(conn)
        namespace_id: sa.BindParameter[Any] = sa.bindparam("namespace_id")
        queue: sa.BindParameter[Any] = sa.bindparam("queue")
        queue_id = (
            sa.select(queues.c.id)
            .where(queues.c.namespace_id == namespace_id, queues.c.name == queue)
            .scalar_subquery()
        )
        gated = (
            sa.select(queue_gates.c.queue_id)
            .where(
                queue_gates.c.queue_id == queue_id,
                sa.or_(
                    queue_gates.c.paused == sa.true(),
                    queue_gates.c.max_concurrency_per_key.is_not(None),
                    queue_gates.c.max_concurrency.is_not(None),
                ),
            )
            .exists()
        )
        task: tuple[Any, ...] = (packed(_TASK_ROW).label("task_row"),) if pack else (tasks,)
        due = sa.select(*task, *(sa.null().label(name) for name in _QUEUE_INFO)).where(
            tasks.c.queue_id == queue_id,
            tasks.c.status == TaskStatus.WAITING.value,
            tasks.c.available_at <= clock,
            tasks.c.cancel_requested == sa.false(),
            sa.or_(tasks.c.deadline.is_(None), tasks.c.deadline > clock),
            ~gated,
        )
        # Two reads of the index (_MYSQL_LEVELS), each stopping at :max_tasks rows: the default priority's
        # due tasks, a range of the index bounded by the clock (so its tasks not yet due are never read),
        # and the other priorities' in lease order (the caller merges them in lease order and grants the
        # first).
        claims = [
            _faults.skip_locked(
                due.where(level)
                .order_by(*order)
                .limit(sa.bindparam("max_tasks"))
                .with_hint(tasks, "FORCE INDEX (ix_tasks_claim_order)", dialect_name="mysql")
            )
            for level, order in _MYSQL_LEVELS
        ]
        lookup = _find_queue_statement(conn)
        assert isinstance(lookup, sa.Select)
        found = lookup.subquery()
        row = sa.select(
            *(sa.null() for _ in (task if pack else tasks.c)),
            *(found.c[name].label(label) for name, label in zip(
                ("id", "name", "db_now", "paused", "max_concurrency_per_key", "max_concurrency", "sweep_due"),
                _QUEUE_INFO, strict=True,
            )),
        )  # fmt: skip
        statement = _FIND_QUEUE_AND_CLAIM[pack] = sa.union_all(*claims, row)
    return statement


def _find_queue_and_claim(
    conn: Connection, namespace_id: int, queue: str, max_tasks: int
) -> tuple[Any, Sequence[Mapping[Any, Any]] | None]:
    """The queue's row (:func:`_find_queue_statement`'s columns; ``None``: no such queue) and, on
    MySQL/MariaDB when its gate is plain and no sweep is due, the claimed due tasks (locked, in lease
    order); ``None`` for them otherwise (the caller reads them on its path), and also when a packed task row
    came back ``NULL`` (longer than ``max_allowed_packet``: :mod:`~orbit_server.db.packed_rows`); the caller's
    read gets its columns (the rows this statement locked stay locked by this transaction, not skipped)."""
    params = {"namespace_id": namespace_id, "queue": queue}
    if conn.dialect.name != "mysql":
        return conn.execute(_find_queue_statement(conn), params).first(), None
    statement = _find_queue_and_claim_statement(conn)
    params |= {"max_tasks": max_tasks}
    # packed (MariaDB): every column as the driver gives it is as this reads it (the flags for their truth)
    rows = (
        DriverSQL.of(statement).execute(conn, params)
        if packs(conn.dialect)
        else conn.execute(statement, params)
    ).mappings()
    due: list[Mapping[Any, Any]] = []
    found = None
    too_long = False
    for row in rows:
        if row["q_id"] is None:
            if "task_row" not in row:
                due.append(row)
            elif row["task_row"] is None:
                too_long = True
            else:
                due.append(unpacked(row["task_row"], _TASK_ROW))
        else:
            found = _QueueRow(
                row["q_id"], row["q_namespace"], row["q_now"], bool(row["q_paused"]), row["q_per_key"],
                row["q_max"], bool(row["q_sweep_due"]),
            )  # fmt: skip
    if (
        found is None
        or too_long
        or found.sweep_due
        or found.paused
        or found.max_concurrency_per_key is not None
        or (found.max_concurrency is not None)
    ):
        return found, None  # the sweep first, or the gate's own path: the caller reads the due tasks again
    due.sort(key=_lease_order)
    return found, due[:max_tasks]


_INSERT_ATTEMPTS = insert_of(
    task_attempts,
    ("id", "task_id", "generation", "lease_token_hash", "worker_id", "status", "lease_seconds", "leased_at",
     "lease_expires_at"),
)  # fmt: skip
_INSERT_PERMITS = insert_of(
    concurrency_permits, ("attempt_id", "queue_id", "concurrency_key", "task_id", "granted_at")
)


@functools.lru_cache(maxsize=128)
def _claim_statement(start: bool, limited: bool, n: int) -> sa.Update:
    """The conditional UPDATE that grants ``n`` tasks (``:id_i`` at ``:version_i``, each still ``WAITING``) their
    attempts (``:attempt_i``) at ``:now``; built once per size, as the leases of a server's workers come in a
    few sizes (a worker leases in bulk), so a lease skips building and keying it. The plain ``id IN`` beside
    the row ``IN`` lets MariaDB read a range of the key for one row as for many: with one tuple alone it
    reads the whole index (:func:`~orbit_server.db.engine.by_primary_key`)."""
    status: Any = (
        sa.case((tasks.c.retry_safe, TaskStatus.RUNNING.value), else_=TaskStatus.LEASED.value)
        if start else TaskStatus.LEASED.value
    )  # fmt: skip
    steps: Any = sa.case((tasks.c.retry_safe, 2), else_=1) if start else 1
    ids = [sa.bindparam(f"id_{i}", type_=tasks.c.id.type) for i in range(n)]
    versions = [sa.bindparam(f"version_{i}", type_=tasks.c.state_version.type) for i in range(n)]
    attempts = [sa.bindparam(f"attempt_{i}", type_=tasks.c.current_attempt_id.type) for i in range(n)]
    if n == 1:
        fence: list[Any] = [tasks.c.id == ids[0], tasks.c.state_version == versions[0]]
        attempt: Any = attempts[0]
    else:
        pairs = [sa.tuple_(i, v) for i, v in zip(ids, versions, strict=True)]
        fence = [tasks.c.id.in_(ids), sa.tuple_(tasks.c.id, tasks.c.state_version).in_(pairs)]
        attempt = sa.case(*zip(ids, attempts, strict=True), value=tasks.c.id)
    return by_primary_key(
        tasks.update()
        .where(*fence, tasks.c.status == TaskStatus.WAITING.value)
        .values(
            status=status,
            state_version=tasks.c.state_version + steps,
            attempt_count=tasks.c.attempt_count + 1,
            current_attempt_id=attempt,
            updated_at=sa.bindparam("now", type_=tasks.c.updated_at.type),
            **({"holds_permit": True} if limited else {}),
        )
    )


def lease_tasks(
    conn: Connection,
    namespace_id: int,
    queue: str,
    *,
    worker_id: str,
    max_tasks: int,
    lease_seconds: float,
    start: bool = False,
) -> list[LeaseGrant]:
    """Grant up to ``max_tasks`` due tasks of a queue to one worker (the "领取" transaction of §5).

    First sweeps the queue's expired leases (:func:`expire_leases`) when it has any, then claims ``WAITING``
    tasks whose ``available_at`` has come: the highest ``priority`` first, then the oldest due
    (``available_at``, then id), read in that order from ``ix_tasks_claim_order``; ``SKIP LOCKED`` on
    MySQL/MariaDB.
    Each grant moves the task ``WAITING → LEASED``, counts an attempt, and creates a
    ``task_attempts`` row with the next ``generation``, a new 256-bit lease token and
    ``lease_expires_at = now + lease_seconds`` (database clock).

    A paused queue grants nothing. A queue with a concurrency limit grants only tasks whose
    ``concurrency_key`` (and the queue) have room, and each grant takes a permit in this
    transaction (:mod:`orbit_server.tasks.permits`); a queue without one takes the plain path.

    With ``start`` (*lease-and-start*, README "Workers") each grant is made ``RUNNING`` in the same
    statements (``WAITING → LEASED → RUNNING``, both events written): its attempt is ``RUNNING``
    with ``started_at`` empty, *unconfirmed* until the worker's first heartbeat or ``complete``
    sets it to the grant's time. An unconfirmed attempt whose lease lapses is settled exactly as a
    ``LEASED`` one (``transitions._expire_attempt``): nothing is known to have started, and a
    cancellation requested meanwhile makes it ``CANCELLED``. A task whose cancellation was
    requested is never granted.

    Args:
        lease_seconds: the lease duration, in seconds.
        start: grant the tasks ``RUNNING`` (above). Default ``False``.

    Returns:
        The grants, in lease order (above); empty when nothing is due (or the queue is paused). The lease tokens appear
        here and nowhere else.

    Raises:
        errors.QueueNotFound: no such queue in the namespace (404).
    """
    found, due = _find_queue_and_claim(conn, namespace_id, queue, max_tasks)
    if found is None:
        raise errors.QueueNotFound(f"queue {queue!r} does not exist in this namespace")
    return _lease_found(
        conn,
        found,
        due,
        queue,
        worker_id=worker_id,
        max_tasks=max_tasks,
        lease_seconds=lease_seconds,
        start=start,
    )


def _lease_found(
    conn: Connection, found: _QueueRow, due: Sequence[Mapping[Any, Any]] | None, queue: str, *, worker_id: str,
    max_tasks: int, lease_seconds: float, start: bool,
) -> list[LeaseGrant]:  # fmt: skip
    """:func:`lease_tasks` once the queue's row was read (``found``; ``due``: the claimed due tasks when its
    statement read them, else ``None``)."""
    queue_id, namespace_name, now = found.id, found.name, _naive(found.db_now)
    if found.sweep_due:  # the sweep's own statements run only when it has something to settle
        _sweep(conn, now, queue_id=queue_id, limit=_SWEEP_BATCH)
    if found.paused:
        return []  # the execution gate is shut: no new grants (invariant 12)
    claimed_limited = None
    if found.max_concurrency_per_key is not None or found.max_concurrency is not None:
        claimed_limited = permits.claim_limited(conn, queue_id, now, max_tasks, _clock(conn))
    if claimed_limited is not None:
        due, now = claimed_limited
    limited = claimed_limited is not None
    if due is None:
        params = {"queue_id": queue_id, "now": now, "max_tasks": max_tasks}
        due = _claim_read(conn, params)
    if not due:
        return []
    # Set-based: one conditional UPDATE of every claimed row (each at the status and version it was
    # read at; the row count is checked, so correctness never rests on SKIP LOCKED alone), then one
    # multi-row INSERT of their events and one of their attempts (WAITING → LEASED, §2).
    expires = now + timedelta(seconds=lease_seconds)
    attempt_ids = {row["id"]: str(uuid.uuid4()) for row in due}
    # Lease-and-start starts only tasks declared retry-safe: a worker killed after its handler began
    # but before confirming would otherwise have its task run again as never started. Others are
    # granted LEASED, and their worker confirms each start before running it (README "Workers").
    claim: dict[str, Any] = {"now": now}
    for i, row in enumerate(due):
        claim |= {
            f"id_{i}": row["id"],
            f"version_{i}": row["state_version"],
            f"attempt_{i}": attempt_ids[row["id"]],
        }
    claimed = DriverSQL.of(_claim_statement(start, limited, len(due))).execute(conn, claim)
    if claimed.rowcount != len(due):
        raise errors.ConcurrentUpdate("a claimed task changed while it was being leased")
    actor = f"worker:{worker_id}"
    events: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    grants: list[LeaseGrant] = []
    for row in due:
        attempt_id = attempt_ids[row["id"]]
        token = secrets.token_urlsafe(32)
        generation = int(row["attempt_count"]) + 1
        version = int(row["state_version"]) + 1
        events.append(
            {
                "task_id": row["id"], "state_version": version, "event": "leased",
                "from_status": TaskStatus.WAITING.value, "to_status": TaskStatus.LEASED.value,
                "actor": actor, "reason": None, "data": {"attempt_id": attempt_id, "generation": generation},
                "created_at": now,
            }
        )  # fmt: skip
        started = start and bool(row["retry_safe"])
        granted = TaskStatus.RUNNING if started else TaskStatus.LEASED
        if started:
            version += 1
            events.append(
                {
                    "task_id": row["id"], "state_version": version, "event": "started",
                    "from_status": TaskStatus.LEASED.value, "to_status": TaskStatus.RUNNING.value,
                    "actor": actor, "reason": "lease-and-start", "data": {"attempt_id": attempt_id},
                    "created_at": now,
                }
            )  # fmt: skip
        attempts.append(
            {
                "id": attempt_id, "task_id": row["id"], "generation": generation,
                "lease_token_hash": _hash_token(token), "worker_id": worker_id,
                "status": (AttemptStatus.RUNNING if started else AttemptStatus.LEASED).value,
                "lease_seconds": lease_seconds, "leased_at": now, "lease_expires_at": expires,
            }
        )  # fmt: skip
        task = store.task_from_row(
            {
                **row, "status": granted.value, "state_version": version,
                "attempt_count": generation, "current_attempt_id": attempt_id, "updated_at": now,
                "namespace_name": namespace_name, "queue_name": queue,
            }  # type: ignore[arg-type]
        )  # fmt: skip
        lease = AttemptLease(
            id=attempt_id, generation=generation, lease_token=token, lease_expires_at=_at(expires)
        )
        grants.append(LeaseGrant(task=task, attempt=lease))
    APPEND_EVENTS.execute(conn, events)
    _INSERT_ATTEMPTS.execute(conn, attempts)
    if limited:  # the permits, taken in this transaction under the gate's lock (§5 "领取 … 取得额度")
        _INSERT_PERMITS.execute(
            conn, permits.permit_rows([(row, attempt_ids[row["id"]]) for row in due], now)
        )
    return grants


# ------------------------------------------------------------ PostgreSQL lease


def lease(
    engine: Engine,
    namespace_id: int,
    queue: str,
    *,
    worker_id: str,
    max_tasks: int,
    lease_seconds: float,
    start: bool = False,
) -> list[LeaseGrant]:
    """One lease call's grants: :func:`lease_tasks` on ``engine``, in its own transaction
    (:func:`~orbit_server.db.transact.transact`), with the same arguments, answer and errors.

    On PostgreSQL a queue whose gate is plain (not paused, no concurrency limit) and with no sweep due is
    leased in autocommitted statements instead, each its own transaction (no ``BEGIN``, no ``COMMIT``):
    :data:`~orbit_server.tasks.postgres_leases._PG_PROBE` reads the queue, its gate, the clock, whether a
    sweep is due and how many tasks are due (up to ``max_tasks``); an empty lease ends there. Otherwise
    :func:`~orbit_server.tasks.postgres_leases._pg_claim_statement` grants up to that many in one statement.
    Every other case (a sweep due, a limited queue) runs :func:`lease_tasks`'s transaction, a limited queue
    without its lookup (the probe read it); a paused queue grants nothing.

    Raises:
        errors.QueueNotFound: no such queue in the namespace (404).
    """
    options: dict[str, Any] = {
        "worker_id": worker_id,
        "max_tasks": max_tasks,
        "lease_seconds": lease_seconds,
        "start": start,
    }
    if engine.dialect.name != "postgresql":
        return transact(engine, lease_tasks, namespace_id, queue, **options)
    found, grants = _lease_postgres(engine, namespace_id, queue, **options)
    if grants is not None:
        return grants
    if found is None or found.sweep_due:
        return transact(engine, lease_tasks, namespace_id, queue, **options)
    return transact(engine, _lease_found, found, None, queue, **options)  # limited: under the gate's lock


def expire_leases(conn: Connection, *, limit: int = _SWEEP_BATCH) -> int:
    """The expiry sweep: settle up to ``limit`` lapsed attempts and overdue waiting tasks.

    For an attempt whose ``lease_expires_at`` has passed (database clock):

    - ``LEASED`` (nothing started) → the task goes back to ``WAITING`` while attempts remain
      and the deadline allows, else ``FAILED`` (``attempts_exhausted``/``deadline_exceeded``);
    - ``RUNNING`` → ``WAITING`` (after the task's backoff) only when the task is
      ``retry_safe``, attempts remain and the deadline allows; otherwise ``NEEDS_REVIEW``,
      because silence is no proof that nothing happened (invariant 7, DESIGN §4);
    - either, when cancellation was requested → ``CANCELLED``, unless the attempt was confirmed
      ``RUNNING`` and the task is not ``retry_safe`` (then ``NEEDS_REVIEW``: its outcome is unknown).
      An unconfirmed lease-and-start attempt counts as never started.

    The attempt becomes ``EXPIRED``. Each update re-checks what it read (attempt status and
    expiry, task status and ``state_version``), so a heartbeat or completion that committed
    first wins and the sweep leaves that task alone. Tasks locked by a concurrent request are
    skipped until the next pass. ``WAITING`` tasks past their deadline become ``FAILED``
    (``deadline_exceeded``).

    Returns:
        How many tasks changed state.
    """
    return _sweep(conn, db_now(conn), queue_id=None, limit=limit)


def _sweep(conn: Connection, now: datetime, *, queue_id: int | None, limit: int) -> int:
    expired = sa.select(task_attempts.c.id, task_attempts.c.task_id).where(
        task_attempts.c.status.in_(_LIVE), task_attempts.c.lease_expires_at <= now
    )
    # Read without a lock, then each task locked by its primary key and read again: a locking read of the
    # WAITING rows (FOR UPDATE SKIP LOCKED) locked, on MariaDB, each row its plan examined, if only for a
    # moment, and a lease's claim (SKIP LOCKED) skipped a due task it met locked: an empty answer.
    overdue = sa.select(tasks.c.id).where(tasks.c.status == TaskStatus.WAITING.value, tasks.c.deadline <= now)
    if queue_id is not None:
        expired = expired.join(tasks, tasks.c.id == task_attempts.c.task_id).where(
            tasks.c.queue_id == queue_id
        )
        overdue = overdue.where(tasks.c.queue_id == queue_id)
    changed = 0
    for attempt_id, task_id in conn.execute(
        expired.order_by(task_attempts.c.lease_expires_at).limit(limit)
    ).all():
        task = _lock_task(conn, task_id, skip_locked=True)
        if task is None or task["current_attempt_id"] != attempt_id:
            continue  # locked by a concurrent request: the next pass will see it
        attempt = (
            conn.execute(sa.select(task_attempts).where(task_attempts.c.id == attempt_id)).mappings().one()
        )
        if (
            attempt["status"] in _LIVE
            and attempt["lease_expires_at"] <= now
            and _expire_attempt(conn, task, attempt, now)
        ):
            changed += 1
    for task_id in conn.execute(overdue.limit(limit)).scalars().all():
        task = _lock_task(conn, task_id, skip_locked=True)
        if task is None or task["status"] != TaskStatus.WAITING.value or not _overdue(task, now):
            continue  # locked by a concurrent request (the next pass will see it), or changed since the read
        apply_transition(
            conn,
            task,
            TaskStatus.FAILED,
            event="deadline_exceeded",
            now=now,
            actor="sweeper",
            values={"error": _deadline_error()},
        )
        changed += 1
    return changed


def _overdue(task: Mapping[str, Any], now: datetime) -> bool:
    """Whether ``task``'s deadline has passed at ``now`` (naive UTC)."""
    deadline = task["deadline"]
    return deadline is not None and deadline <= now
