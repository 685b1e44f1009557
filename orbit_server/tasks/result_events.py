"""The result event a task's terminal transition writes, with one delivery per subscription, in that
transaction (DESIGN §4 "Result events"). Subscribers lease and ack the deliveries through
:mod:`orbit_server.results.deliveries`; this half lives with the transitions that call it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import TaskStatus
from orbit_server import errors
from orbit_server.db.driver_sql import insert_of
from orbit_server.db.engine import to_utc
from orbit_server.db.schema import (
    Key,
    Timestamp,
    event_deliveries,
    namespaces,
    queues,
    result_events,
    submission_keys,
    subscriptions,
    tasks,
)

__all__ = [
    "COPIED",
    "RESULT_STATUSES",
    "Subscribers",
    "chain_key",
    "locked_subscribers",
    "mariadb_subscribers",
    "postgres_event_ctes",
    "record_result_event",
    "record_result_events",
    "subscribers",
]

#: The task states whose transitions write a result event (DESIGN §4).
RESULT_STATUSES: Final[frozenset[TaskStatus]] = frozenset(
    {TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.NEEDS_REVIEW}
)

PENDING: Final = "PENDING"
ACKED: Final = "ACKED"

#: Largest BIGINT: a longer delivery id cannot exist.
_MAX_ID_DIGITS = 19


def _at(value: datetime) -> datetime:
    aware = to_utc(value)
    assert aware is not None
    return aware


# ---------------------------------------------------------------------- events


class Subscribers(NamedTuple):
    """What :func:`record_result_event` reads under the namespace's shared lock, read ahead by the statement
    that locked the task (:func:`locked_subscribers`): the task's namespace and ``retry_of``, and the ids of
    the namespace's subscriptions that match the task's queue and were created at or before the transition's
    database time (MySQL/MariaDB); on PostgreSQL only the queue's name (``ids`` is ``None``): the
    subscriptions are read by a later statement (below)."""

    namespace_id: int
    retry_of: str | None
    ids: Sequence[int] | None
    queue_name: str | None = None


def locked_subscribers(clock: sa.ColumnElement[Any], dialect: str) -> sa.Label[Any]:
    """A column of a ``SELECT ... FROM tasks ... FOR UPDATE`` that takes :func:`record_result_event`'s shared
    locks (the namespace and queue rows) in the statement that locks the task. Read through :func:`subscribers`.

    On MySQL/MariaDB it also makes the locking read of the namespace's subscriptions created at or before
    ``clock`` (the statement's own clock) and gives the ids of those that match the task's queue,
    comma-separated (``''`` for none; ``NULL`` when the namespace or queue row is missing): the subscriptions
    are the inner side of an outer join on the namespace, so they are read after its lock is granted, and a
    locking read sees the newest committed rows. On PostgreSQL it gives the queue's name: a statement sees
    the rows committed before it began, so the subscriptions must be read by a later statement, once the
    lock is held (:func:`record_result_event` does).

    A subquery with its own locking clause: the outer ``FOR UPDATE`` locks no row of a nested subquery,
    and the clause here locks the namespace and queue rows shared, not exclusively (a ``SELECT ... FOR
    UPDATE`` joining them would serialise every transition of the namespace). Why these locks make the
    fan-out exact: the module docstring of :mod:`orbit_server.results.deliveries`."""
    n, q, s = namespaces, queues, subscriptions
    if dialect == "postgresql":
        return (
            sa.select(q.c.name)
            .select_from(n.join(q, q.c.namespace_id == n.c.id))
            .where(n.c.id == tasks.c.namespace_id, q.c.id == tasks.c.queue_id)
            .with_for_update(read=True)
            .scalar_subquery()
            .label("subscribers")
        )
    matches = sa.or_(
        s.c.queues.is_(None), sa.func.json_contains(s.c.queues, sa.func.json_quote(q.c.name)) == 1
    )
    ids = sa.func.coalesce(sa.func.group_concat(s.c.id), sa.literal_column("''"))
    return (
        sa.select(sa.case((sa.func.count(q.c.id) == 0, sa.null()), else_=ids))
        .select_from(
            n.join(q, q.c.namespace_id == n.c.id).outerjoin(
                s, sa.and_(s.c.namespace_id == n.c.id, s.c.created_at <= clock, matches)
            )
        )
        .where(n.c.id == tasks.c.namespace_id, q.c.id == tasks.c.queue_id)
        .with_for_update(read=True)
        .scalar_subquery()
        .label("subscribers")
    )


def mariadb_subscribers(task_id: str) -> str:
    """MariaDB: :func:`locked_subscribers` (MySQL/MariaDB form) as the text of a scalar subquery for a statement
    that has already locked the task whose id is the SQL expression ``task_id``: the same shared locks (the
    task's namespace and queue rows) and the same locking read of the namespace's subscriptions created at or
    before the statement's ``UTC_TIMESTAMP(6)``, in the same order (the subscriptions are the inner side of an
    outer join on the namespace and queue, so they are read after both locks are granted), with the same
    value, read through :func:`subscribers`. Used in the ``RETURNING`` clause of
    :func:`orbit_server.tasks.attempt_locks._lock_and_record`'s ``INSERT``, which locks the task first."""
    return (
        "(SELECT CASE WHEN COUNT(q.id) = 0 THEN NULL ELSE COALESCE(GROUP_CONCAT(s.id), '') END"
        " FROM tasks t JOIN namespaces n ON n.id = t.namespace_id JOIN queues q ON q.id = t.queue_id"
        " AND q.namespace_id = n.id LEFT OUTER JOIN subscriptions s ON s.namespace_id = n.id"
        " AND s.created_at <= UTC_TIMESTAMP(6) AND (s.queues IS NULL OR JSON_CONTAINS(s.queues, JSON_QUOTE(q.name)) = 1)"
        f" WHERE t.id = {task_id} LOCK IN SHARE MODE)"
    )


def subscribers(task: Mapping[str, Any], column: str | None, dialect: str) -> Subscribers:
    """The value of :func:`locked_subscribers`, with ``task``'s ``namespace_id`` and ``retry_of``.

    Raises:
        errors.ConcurrentUpdate: the task's namespace or queue row was not found.
    """
    if column is None:
        raise errors.ConcurrentUpdate(f"the queue of task {task['id']} vanished while it was being read")
    if dialect == "postgresql":
        return Subscribers(int(task["namespace_id"]), task["retry_of"], None, column)
    ids = [int(part) for part in column.split(",")] if column else []
    return Subscribers(int(task["namespace_id"]), task["retry_of"], ids)


def record_result_event(
    conn: Connection,
    task_id: str,
    now: datetime,
    *,
    read: Subscribers | None = None,
    written: str | None = None,
) -> str:
    """Write the result event of a transition that just happened, and its deliveries.

    Call it in the transition's transaction, after the task row was updated (and while it is
    locked): the event copies the row's status, result, error, handler, queue, ``state_version``
    and ``retry_of``; for a task created by manual retry it also gets the idempotency key of the
    chain's first task (:func:`chain_key`), so a receiver finds the business record of a retried
    task by the key it knows. Then one ``PENDING`` delivery per subscription of the namespace that
    matches the task's queue and was created at or before ``now`` (the module docstring
    explains why that is exact under concurrency).

    Args:
        task_id: the task that changed state.
        now: the transition's database time (naive UTC); becomes ``occurred_at``.
        read: the subscriptions, read ahead under the same locks by the statement that locked the task
            (:func:`locked_subscribers`), in this transaction and at ``now``: one statement less here.
        written: the id of the event, already written (as this would copy it) by the statement that locked the
            task (:func:`orbit_server.tasks.attempt_locks._lock_and_record`): only its deliveries (and the
            chain's key) are written here. Only with ``read``.

    Returns:
        The new event's id (a UUID).

    Raises:
        errors.ConcurrentUpdate: the task row was not found (nothing sensible was written;
            the caller's transaction must roll back).
    """
    if written is not None:
        assert read is not None, "an event written ahead comes with its subscribers"
        event_id = written
    else:
        event_id = str(uuid.uuid4())
        copied = conn.execute(_COPY_EVENT, {"event_id": event_id, "task_id": task_id, "occurred_at": now})
        if copied.rowcount != 1:
            raise errors.ConcurrentUpdate(f"task {task_id} vanished while its result event was written")
    # Shared lock on the namespace row: serialises with create_subscription's exclusive lock. Then a
    # locking read of the subscriptions, so it sees the newest committed ones whatever the isolation
    # level: on MySQL/MariaDB and SQLite both in one statement (the subscriptions outer-joined), in the
    # same lock order; PostgreSQL cannot lock the nullable side of an outer join, so two statements there.
    if read is not None and read.ids is not None:  # read with the task's lock (locked_subscribers)
        namespace_id, retry_of = read.namespace_id, read.retry_of
        matching: Sequence[int] = read.ids
    elif read is not None:  # PostgreSQL: the locks were taken with the task's; the subscriptions now
        namespace_id, queue_name, retry_of = read.namespace_id, read.queue_name, read.retry_of
        subscribed: Sequence[Any] = conn.execute(
            _LOCK_SUBSCRIPTIONS, {"namespace_id": namespace_id, "now": now}
        ).all()
    elif conn.dialect.name == "postgresql":
        namespace_id, queue_name, retry_of = conn.execute(_LOCK_TASK_NAMESPACE, {"task_id": task_id}).one()
        subscribed = conn.execute(_LOCK_SUBSCRIPTIONS, {"namespace_id": namespace_id, "now": now}).all()
    else:
        rows = conn.execute(_LOCK_TASK_NAMESPACE_SUBSCRIPTIONS, {"task_id": task_id, "now": now}).all()
        if not rows:
            raise errors.ConcurrentUpdate(f"task {task_id} vanished while its result event was written")
        namespace_id, queue_name, retry_of = rows[0].ns_id, rows[0].queue_name, rows[0].retry_of
        subscribed = [row for row in rows if row.id is not None]
    if read is None or read.ids is None:
        matching = [row.id for row in subscribed if row.queues is None or queue_name in row.queues]
    if retry_of is not None:  # a manual retry: the event carries the key of the chain's first task
        conn.execute(
            result_events.update()
            .where(result_events.c.id == event_id)
            .values(idempotency_key=chain_key(conn, namespace_id, retry_of))
        )
    if matching:
        _INSERT_DELIVERIES.execute(
            conn,
            [
                {
                    "subscription_id": subscription_id,
                    "event_id": event_id,
                    "state": PENDING,
                    "delivery_count": 0,
                    "created_at": now,
                }
                for subscription_id in matching
            ],
        )
    return event_id


#: The columns of the task row a result event copies (:data:`_COPY_EVENT`, :func:`postgres_event_ctes`).
COPIED = ("namespace_id", "queue_id", "handler", "status", "result", "error", "state_version", "retry_of")


def postgres_event_ctes(source: str) -> tuple[str, tuple[sa.BindParameter[Any], ...]]:
    """PostgreSQL: :func:`record_result_event`'s writes as data-modifying ``WITH`` queries of the statement
    that updates the task (``source``: the name of its ``UPDATE tasks ... RETURNING`` query, which must return
    ``id`` and the copied columns, and gives one row when the task changed, none otherwise).

    Returns ``(sql, bind parameters)``: the text ``copied AS (...), subs AS (...), delivered AS (...)`` to put
    after the caller's own queries, with parameters ``:r_id`` (the new event's id), ``:r_now`` (the
    transition's database time), ``:r_namespace_id`` and ``:r_queue`` (the task's namespace and queue name,
    read under the shared locks of :func:`locked_subscribers` by the statement that locked the task). The
    event is the changed row's copy; the deliveries go to the namespace's subscriptions created at or before
    ``:r_now`` that match the queue, read with ``FOR SHARE``, exactly as :func:`record_result_event` reads
    them with :data:`_LOCK_SUBSCRIPTIONS`: this statement begins after the locking read took the
    namespace's shared lock, so it sees every subscription committed before that lock was granted, and
    none can be created until this transaction ends (the module docstring of
    :mod:`orbit_server.results.deliveries`). Not for a task with ``retry_of`` (its event carries the key of
    the chain's first task: :func:`record_result_event` writes it)."""
    copied = ", ".join(f"{source}.{c}" for c in COPIED)
    sql = (
        f"copied AS (INSERT INTO result_events (id, task_id, {', '.join(COPIED)}, occurred_at)"
        f" SELECT :r_id, {source}.id, {copied}, :r_now FROM {source} RETURNING result_events.id),"
        " subs AS (SELECT subscriptions.id, subscriptions.queues FROM subscriptions"
        " WHERE subscriptions.namespace_id = :r_namespace_id AND subscriptions.created_at <= :r_now FOR SHARE),"
        " delivered AS (INSERT INTO event_deliveries (subscription_id, event_id, state, delivery_count, created_at)"
        f" SELECT subs.id, copied.id, '{PENDING}', 0, :r_now FROM subs, copied"
        " WHERE subs.queues IS NULL OR CAST(subs.queues AS jsonb) ? :r_queue)"
    )
    return sql, (
        sa.bindparam("r_id", type_=Key(36)),
        sa.bindparam("r_now", type_=Timestamp),
        sa.bindparam("r_namespace_id", type_=sa.BigInteger),
        sa.bindparam("r_queue", type_=sa.String),
    )


#: :func:`record_result_event`'s copy of the task row: ``:event_id``, ``:task_id``, ``:occurred_at``.
_COPY_EVENT = result_events.insert().from_select(
    [
        "id", "task_id", "namespace_id", "queue_id", "handler", "status", "result", "error",
        "state_version", "occurred_at", "retry_of",
    ],
    sa.select(
        sa.bindparam("event_id", type_=Key(36)), tasks.c.id, tasks.c.namespace_id, tasks.c.queue_id,
        tasks.c.handler, tasks.c.status, tasks.c.result, tasks.c.error, tasks.c.state_version,
        sa.bindparam("occurred_at", type_=Timestamp), tasks.c.retry_of,
    ).where(tasks.c.id == sa.bindparam("task_id", type_=Key(36))),
)  # fmt: skip


def record_result_events(
    conn: Connection, namespace_id: int, changed: Sequence[Mapping[str, Any]], now: datetime
) -> list[str]:
    """:func:`record_result_event` for many tasks of one namespace, set-based (3 statements at most; 4 on
    PostgreSQL).

    Call it in the transitions' transaction, after the task rows were updated (and while they
    are locked). ``changed`` are the task rows as written: ``id``, ``queue_id``, ``handler``,
    ``status``, ``result``, ``error``, ``state_version`` and (optional) ``retry_of``. The rows written are exactly those
    of one :func:`record_result_event` per task, in the same lock order: the events, then a
    shared lock on the namespace and the tasks' queues, then the locking read of the
    subscriptions.

    Returns:
        The new events' ids, in the order of ``changed``.

    Raises:
        errors.ConcurrentUpdate: a task's queue was not found in the namespace.
    """
    events = [
        {
            "id": str(uuid.uuid4()), "task_id": task["id"], "namespace_id": namespace_id,
            "queue_id": task["queue_id"], "handler": task["handler"], "status": task["status"],
            "result": task["result"], "error": task["error"], "state_version": task["state_version"],
            "occurred_at": now, "retry_of": task.get("retry_of"),
            "idempotency_key": chain_key(conn, namespace_id, task["retry_of"]) if task.get("retry_of") else None,
        }
        for task in changed
    ]  # fmt: skip
    _INSERT_EVENTS.execute(conn, events)
    queue_ids = sorted({task["queue_id"] for task in changed})
    params = {"namespace_id": namespace_id, "queue_ids": queue_ids, "now": now}
    if conn.dialect.name == "postgresql":  # a statement sees the rows committed before it began: two
        names = dict(conn.execute(_LOCK_QUEUES, params).all())
        subscribed = [(row.id, row.queues) for row in conn.execute(_LOCK_SUBSCRIPTIONS, params)]
    else:  # the subscriptions are the inner side of an outer join: read once the shared locks are granted
        rows = conn.execute(_LOCK_QUEUES_SUBSCRIPTIONS, params).all()
        names = {row.queue_id: row.queue_name for row in rows}
        subscribed = list({row.id: (row.id, row.queues) for row in rows if row.id is not None}.values())
    if len(names) != len(queue_ids):
        raise errors.ConcurrentUpdate("a task's queue vanished while its result event was written")
    deliveries = [
        {"subscription_id": subscription_id, "event_id": event["id"], "state": PENDING, "delivery_count": 0,
         "created_at": now}
        for event in events
        for subscription_id, subscribed_queues in subscribed
        if subscribed_queues is None or names[event["queue_id"]] in subscribed_queues
    ]  # fmt: skip
    if deliveries:
        _INSERT_DELIVERIES.execute(conn, deliveries)
    return [event["id"] for event in events]


_INSERT_EVENTS = insert_of(
    result_events,
    ("id", "task_id", "namespace_id", "queue_id", "handler", "status", "result", "error", "state_version",
     "occurred_at", "retry_of", "idempotency_key"),
)  # fmt: skip
_INSERT_DELIVERIES = insert_of(
    event_deliveries, ("subscription_id", "event_id", "state", "delivery_count", "created_at")
)
#: :func:`record_result_events`: the shared lock on the namespace and the tasks' queues.
_LOCK_QUEUES = (
    sa.select(queues.c.id, queues.c.name)
    .select_from(namespaces.join(queues, queues.c.namespace_id == namespaces.c.id))
    .where(
        namespaces.c.id == sa.bindparam("namespace_id"),
        queues.c.id.in_(sa.bindparam("queue_ids", expanding=True)),
    )
    .with_for_update(read=True)
)
#: :func:`record_result_events`: the locking read of the namespace's subscriptions.
_LOCK_SUBSCRIPTIONS = (
    sa.select(subscriptions.c.id, subscriptions.c.queues)
    .where(
        subscriptions.c.namespace_id == sa.bindparam("namespace_id"),
        subscriptions.c.created_at <= sa.bindparam("now", type_=subscriptions.c.created_at.type),
    )
    .with_for_update(read=True)
)


#: :func:`record_result_events` on MariaDB and SQLite: both, in one statement (the namespace and the queues
#: locked before the subscriptions: the outer join reads them first); one row per queue and subscription, or one
#: row of ``NULL`` subscription columns for a queue when there is none.
_LOCK_QUEUES_SUBSCRIPTIONS = (
    sa.select(
        queues.c.id.label("queue_id"), queues.c.name.label("queue_name"), subscriptions.c.id,
        subscriptions.c.queues,
    )
    .select_from(
        namespaces.join(queues, queues.c.namespace_id == namespaces.c.id).outerjoin(
            subscriptions,
            sa.and_(
                subscriptions.c.namespace_id == namespaces.c.id,
                subscriptions.c.created_at <= sa.bindparam("now", type_=subscriptions.c.created_at.type),
            ),
        )
    )
    .where(
        namespaces.c.id == sa.bindparam("namespace_id"),
        queues.c.id.in_(sa.bindparam("queue_ids", expanding=True)),
    )
    .with_for_update(read=True)
)  # fmt: skip


#: :func:`record_result_event` (PostgreSQL): the task's namespace, queue name and ``retry_of``, with a shared
#: lock on the namespace and queue rows.
_LOCK_TASK_NAMESPACE = (
    sa.select(namespaces.c.id, queues.c.name, tasks.c.retry_of)
    .select_from(
        tasks.join(namespaces, namespaces.c.id == tasks.c.namespace_id).join(
            queues, queues.c.id == tasks.c.queue_id
        )
    )
    .where(tasks.c.id == sa.bindparam("task_id"))
    .with_for_update(read=True)
)
#: :func:`record_result_event` elsewhere: the same, with the subscriptions of the namespace created at or
#: before ``:now`` (one row per subscription, or one row of ``NULL`` subscription columns when none),
#: the namespace and queue locked before the subscriptions (the join reads them first).
_LOCK_TASK_NAMESPACE_SUBSCRIPTIONS = (
    sa.select(
        namespaces.c.id.label("ns_id"), queues.c.name.label("queue_name"), tasks.c.retry_of,
        subscriptions.c.id, subscriptions.c.queues,
    )
    .select_from(
        tasks.join(namespaces, namespaces.c.id == tasks.c.namespace_id)
        .join(queues, queues.c.id == tasks.c.queue_id)
        .outerjoin(
            subscriptions,
            sa.and_(
                subscriptions.c.namespace_id == namespaces.c.id,
                subscriptions.c.created_at <= sa.bindparam("now", type_=subscriptions.c.created_at.type),
            ),
        )
    )
    .where(tasks.c.id == sa.bindparam("task_id"))
    .with_for_update(read=True)
)  # fmt: skip


#: Longest retry chain followed back to its first task (a chain is one manual retry per link).
_MAX_CHAIN = 1000


def chain_key(conn: Connection, namespace_id: int, predecessor: str) -> str | None:
    """The ``Idempotency-Key`` of the first task of a retry chain, given a manual retry's predecessor.

    Follows ``retry_of`` back from ``predecessor`` (one indexed read per link; a chain is as long
    as the number of manual retries) to the task that has none, or that was purged, and returns
    the key its submission was made with (submission keys outlive their tasks for the key
    window); ``None`` when that task was not created by a submission or its key expired.
    """
    first = predecessor
    for _ in range(_MAX_CHAIN):
        earlier = conn.execute(
            sa.select(tasks.c.retry_of).where(tasks.c.id == first, tasks.c.namespace_id == namespace_id)
        ).scalar()
        if earlier is None:
            break
        first = earlier
    return conn.execute(
        sa.select(submission_keys.c.idempotency_key).where(
            submission_keys.c.task_id == first, submission_keys.c.namespace_id == namespace_id
        )
    ).scalar()
