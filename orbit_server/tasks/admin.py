"""Operator reads and key administration, shared by the web console (``/ui``) and the
``orbit-server`` admin commands.

Every function takes an open connection (the caller owns the transaction) and a
``namespace_id``: the console passes its key's namespace, so a key never sees another
namespace's rows (DESIGN §8); the CLI, which has the database itself, may pass ``None``
for every namespace. Ages and windows are measured on the database clock. Timestamps
in the results are aware UTC datetimes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import NAME_PATTERN, Attempt, Task, TaskEvent, TaskStatus, is_valid_idempotency_key
from orbit_server import _ids, errors
from orbit_server.db.engine import db_now, to_utc
from orbit_server.db.schema import (
    api_keys,
    console_sessions,
    event_deliveries,
    namespaces,
    queue_gates,
    queues,
    result_events,
    submission_keys,
    subscriptions,
    tasks,
)
from orbit_server.tasks import operations, store

__all__ = [
    "ApiKeyInfo",
    "ApiKeyNotFound",
    "DeliveryInfo",
    "NamespaceInfo",
    "Overview",
    "QueueStats",
    "SubscriptionStats",
    "TaskDetail",
    "TaskFilter",
    "TaskListPage",
    "api_key_principal",
    "aware",
    "get_task_detail",
    "list_api_keys",
    "list_namespaces",
    "list_tasks",
    "namespace_ids",
    "needs_review",
    "overview",
    "queue_stats",
    "revoke_api_key",
    "subscription_stats",
    "task_namespace_id",
]

log = logging.getLogger("orbit_server.admin")


class ApiKeyNotFound(errors.OrbitServerError):
    status, code, title = 404, "api_key_not_found", "API key not found"


#: The window of the overview's completion and failure counts.
RECENT_WINDOW = timedelta(hours=1)


def _age(now: datetime, then: datetime | None) -> float | None:
    """Seconds from ``then`` to ``now`` (both naive UTC from the database), never negative."""
    if then is None:
        return None
    return max(0.0, (now - then.replace(tzinfo=None)).total_seconds())


def _in_namespace(column: sa.ColumnElement[Any], namespace_id: int | None) -> sa.ColumnElement[bool]:
    return sa.true() if namespace_id is None else column == namespace_id


# ------------------------------------------------------------------ overview


@dataclass(frozen=True, slots=True)
class QueueStats:
    """One queue: its tasks per status, how long the oldest due ``WAITING`` task has waited
    (seconds, ``None`` when none waits), and the tasks that ended in the last hour."""

    namespace: str
    name: str
    created_at: datetime
    counts: dict[str, int]
    oldest_waiting_seconds: float | None
    needs_review: int
    succeeded_last_hour: int
    failed_last_hour: int
    #: The queue's gate and concurrency limits (README "Concurrency limits and pausing a queue").
    paused: bool = False
    max_concurrency_per_key: int | None = None
    max_concurrency: int | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True, slots=True)
class SubscriptionStats:
    """One subscription's backlog: deliveries never handed out (``undelivered``), handed out but
    not acked (``unacked``), and the age of the oldest of either, in seconds."""

    namespace: str
    name: str
    queues: list[str] | None
    created_at: datetime
    undelivered: int
    unacked: int
    acked: int
    oldest_pending_seconds: float | None

    @property
    def backlog(self) -> int:
        return self.undelivered + self.unacked


@dataclass(frozen=True, slots=True)
class Overview:
    now: datetime
    queues: list[QueueStats]
    subscriptions: list[SubscriptionStats]


def queue_stats(
    conn: Connection, namespace_id: int | None, *, now: datetime | None = None
) -> list[QueueStats]:
    """Every queue (of one namespace, or all), by namespace and name, with its counts.

    Four grouped queries whatever the number of queues.
    """
    now = now or db_now(conn)
    since = now - RECENT_WINDOW
    rows = conn.execute(
        sa.select(
            queues.c.id,
            queues.c.name,
            queues.c.created_at,
            namespaces.c.name.label("ns"),
            queue_gates.c.paused,
            queue_gates.c.max_concurrency_per_key,
            queue_gates.c.max_concurrency,
        )
        .join(namespaces, namespaces.c.id == queues.c.namespace_id)
        .outerjoin(queue_gates, queue_gates.c.queue_id == queues.c.id)
        .where(_in_namespace(queues.c.namespace_id, namespace_id))
        .order_by(namespaces.c.name, queues.c.name)
    ).all()
    in_ns = _in_namespace(tasks.c.namespace_id, namespace_id)
    counts: dict[int, dict[str, int]] = {}
    for queue_id, status, n in conn.execute(
        sa.select(tasks.c.queue_id, tasks.c.status, sa.func.count())
        .where(in_ns)
        .group_by(tasks.c.queue_id, tasks.c.status)
    ):
        counts.setdefault(queue_id, {})[status] = int(n)
    oldest = dict(
        conn.execute(
            sa.select(tasks.c.queue_id, sa.func.min(tasks.c.available_at))
            .where(in_ns, tasks.c.status == TaskStatus.WAITING.value, tasks.c.available_at <= now)
            .group_by(tasks.c.queue_id)
        ).all()
    )
    recent: dict[int, dict[str, int]] = {}
    for queue_id, status, n in conn.execute(
        sa.select(tasks.c.queue_id, tasks.c.status, sa.func.count())
        .where(
            in_ns,
            tasks.c.finished_at >= since,
            tasks.c.status.in_([TaskStatus.SUCCEEDED.value, TaskStatus.FAILED.value]),
        )
        .group_by(tasks.c.queue_id, tasks.c.status)
    ):
        recent.setdefault(queue_id, {})[status] = int(n)
    return [
        QueueStats(
            namespace=row.ns,
            name=row.name,
            created_at=_utc(row.created_at),
            counts=counts.get(row.id, {}),
            oldest_waiting_seconds=_age(now, oldest.get(row.id)),
            needs_review=counts.get(row.id, {}).get(TaskStatus.NEEDS_REVIEW.value, 0),
            succeeded_last_hour=recent.get(row.id, {}).get(TaskStatus.SUCCEEDED.value, 0),
            failed_last_hour=recent.get(row.id, {}).get(TaskStatus.FAILED.value, 0),
            paused=bool(row.paused),
            max_concurrency_per_key=row.max_concurrency_per_key,
            max_concurrency=row.max_concurrency,
        )
        for row in rows
    ]


def subscription_stats(
    conn: Connection, namespace_id: int | None, *, name: str | None = None, now: datetime | None = None
) -> list[SubscriptionStats]:
    """Every subscription (of one namespace, or all; or the one named ``name``) with its backlog."""
    now = now or db_now(conn)
    query = (
        sa.select(
            subscriptions.c.id,
            subscriptions.c.name,
            subscriptions.c.queues,
            subscriptions.c.created_at,
            namespaces.c.name.label("ns"),
        )
        .join(namespaces, namespaces.c.id == subscriptions.c.namespace_id)
        .where(_in_namespace(subscriptions.c.namespace_id, namespace_id))
        .order_by(namespaces.c.name, subscriptions.c.name)
    )
    if name is not None:
        query = query.where(subscriptions.c.name == name)
    rows = conn.execute(query).all()
    if not rows:
        return []
    ids = [row.id for row in rows]
    pending = event_deliveries.c.state == "PENDING"
    stats = {
        row.subscription_id: row
        for row in conn.execute(
            sa.select(
                event_deliveries.c.subscription_id,
                sa.func.sum(
                    sa.case((sa.and_(pending, event_deliveries.c.delivery_count == 0), 1), else_=0)
                ).label("undelivered"),
                sa.func.sum(
                    sa.case((sa.and_(pending, event_deliveries.c.delivery_count > 0), 1), else_=0)
                ).label("unacked"),
                sa.func.sum(sa.case((event_deliveries.c.state == "ACKED", 1), else_=0)).label("acked"),
                sa.func.min(sa.case((pending, event_deliveries.c.created_at), else_=None)).label("oldest"),
            )
            .where(event_deliveries.c.subscription_id.in_(ids))
            .group_by(event_deliveries.c.subscription_id)
        )
    }
    out = []
    for row in rows:
        s = stats.get(row.id)
        oldest = s.oldest if s is not None else None
        if isinstance(oldest, str):  # SQLite returns MIN over a CASE as text
            oldest = datetime.fromisoformat(oldest)
        out.append(
            SubscriptionStats(
                namespace=row.ns,
                name=row.name,
                queues=row.queues,
                created_at=_utc(row.created_at),
                undelivered=int(s.undelivered or 0) if s is not None else 0,
                unacked=int(s.unacked or 0) if s is not None else 0,
                acked=int(s.acked or 0) if s is not None else 0,
                oldest_pending_seconds=_age(now, oldest),
            )
        )
    return out


def overview(conn: Connection, namespace_id: int | None) -> Overview:
    """The console's first page: :func:`queue_stats` and :func:`subscription_stats` at one instant."""
    now = db_now(conn)
    return Overview(
        now=_utc(now),
        queues=queue_stats(conn, namespace_id, now=now),
        subscriptions=subscription_stats(conn, namespace_id, now=now),
    )


# --------------------------------------------------------------------- tasks


@dataclass(frozen=True, slots=True)
class TaskFilter:
    """What :func:`list_tasks` keeps; ``None`` means any. ``created_since`` is aware (any zone)."""

    status: TaskStatus | None = None
    queue: str | None = None
    handler: str | None = None
    idempotency_key: str | None = None
    created_since: datetime | None = None


@dataclass(frozen=True, slots=True)
class TaskListPage:
    items: list[Task]
    next_cursor: str | None


def _task_select() -> sa.Select[Any]:
    return sa.select(
        tasks, namespaces.c.name.label("namespace_name"), queues.c.name.label("queue_name")
    ).select_from(
        tasks.join(namespaces, namespaces.c.id == tasks.c.namespace_id).join(
            queues, queues.c.id == tasks.c.queue_id
        )
    )


_NAME = re.compile(NAME_PATTERN)


def _can_exist(filters: TaskFilter) -> bool:
    """Whether a task could match: no queue has a name outside the name rule, and no key that
    :func:`orbit_client.is_valid_idempotency_key` refuses was ever accepted (the API's
    ``GET .../submissions/{key}`` answers such a key ``404`` the same way)."""
    if filters.queue and not _NAME.fullmatch(filters.queue):
        return False
    return not filters.idempotency_key or is_valid_idempotency_key(filters.idempotency_key)


def list_tasks(
    conn: Connection,
    namespace_id: int | None,
    filters: TaskFilter = TaskFilter(),
    *,
    limit: int = 50,
    cursor: str | None = None,
    order: str = "newest",
) -> TaskListPage:
    """A page of tasks, newest first (by ``created_at``, then id, both descending), or in lease order.

    Args:
        filters: see :class:`TaskFilter`; the idempotency key is matched exactly.
        limit: most tasks on the page (1-1000).
        cursor: ``next_cursor`` of the previous page (of the same ``order``); ``None`` starts at the first.
        order: ``"newest"`` (default), or ``"lease"``: the order in which a lease grants waiting tasks, the
            highest ``priority`` first, then the oldest due (``available_at``, then id; README "Task
            priority"). Filtered to one queue and ``WAITING``, it is the queue's line, read from the claim index
            (due or not: a task due later is listed where its priority puts it).

    Raises:
        errors.InvalidCursor: ``cursor`` is not one this function produced (400).
    """
    limit = max(1, min(limit, 1000))
    if not _can_exist(filters):  # compared with an ASCII column, MariaDB refuses the query (1267)
        return TaskListPage(items=[], next_cursor=None)
    query = _task_select().where(_in_namespace(tasks.c.namespace_id, namespace_id))
    if filters.status is not None:
        query = query.where(tasks.c.status == filters.status.value)
    if filters.queue:
        query = query.where(queues.c.name == filters.queue)
    if filters.handler:
        query = query.where(tasks.c.handler == filters.handler)
    if filters.idempotency_key:
        query = query.join(
            submission_keys,
            sa.and_(
                submission_keys.c.task_id == tasks.c.id,
                submission_keys.c.namespace_id == tasks.c.namespace_id,
            ),
        ).where(submission_keys.c.idempotency_key == filters.idempotency_key)
    if filters.created_since is not None:
        query = query.where(tasks.c.created_at >= _naive(filters.created_since))
    if order == "lease":
        return _in_lease_order(conn, query, limit, cursor)
    if order != "newest":
        raise ValueError(f"order is 'newest' or 'lease', not {order!r}")
    if cursor:
        before, before_id = store.decode_cursor(cursor)
        query = query.where(
            sa.or_(tasks.c.created_at < before, sa.and_(tasks.c.created_at == before, tasks.c.id < before_id))
        )
    rows = (
        conn.execute(query.order_by(tasks.c.created_at.desc(), tasks.c.id.desc()).limit(limit + 1))
        .mappings()
        .all()
    )
    items = [store.task_from_row(row) for row in rows[:limit]]
    next_cursor = (
        store.encode_cursor(rows[limit - 1]["created_at"], rows[limit - 1]["id"])
        if len(rows) > limit
        else None
    )
    return TaskListPage(items=items, next_cursor=next_cursor)


def _in_lease_order(conn: Connection, query: sa.Select[Any], limit: int, cursor: str | None) -> TaskListPage:
    """:func:`list_tasks` in lease order (``priority`` descending, ``available_at``, id); its cursor is the
    last task's ``(priority, available_at, id)``, made by :func:`store.encode_cursor` with the priority
    folded into the id (``"<priority>:<id>"``)."""
    if cursor:
        available_at, marked = store.decode_cursor(cursor, check_id=False)
        priority, _, task_id = marked.partition(":")
        try:
            after = int(priority)
            if not _ids.can_exist(task_id):
                raise ValueError("not a task id")
        except ValueError:
            raise errors.InvalidCursor("pass back the cursor of an earlier page unchanged") from None
        query = query.where(
            tasks.c.priority <= after,
            sa.or_(
                tasks.c.priority < after,
                tasks.c.available_at > available_at,
                sa.and_(tasks.c.available_at == available_at, tasks.c.id > task_id),
            ),
        )
    order = (tasks.c.priority.desc(), tasks.c.available_at, tasks.c.id)
    rows = conn.execute(query.order_by(*order).limit(limit + 1)).mappings().all()
    last = rows[limit - 1] if len(rows) > limit else None
    return TaskListPage(
        items=[store.task_from_row(row) for row in rows[:limit]],
        next_cursor=store.encode_cursor(last["available_at"], f"{last['priority']}:{last['id']}")
        if last
        else None,
    )


def needs_review(conn: Connection, namespace_id: int | None, *, limit: int = 200) -> list[Task]:
    """The ``NEEDS_REVIEW`` tasks, the longest waiting first (by the time they entered review)."""
    rows = conn.execute(
        _task_select()
        .where(
            _in_namespace(tasks.c.namespace_id, namespace_id), tasks.c.status == TaskStatus.NEEDS_REVIEW.value
        )
        .order_by(tasks.c.updated_at, tasks.c.id)
        .limit(limit)
    ).mappings()
    return [store.task_from_row(row) for row in rows]


@dataclass(frozen=True, slots=True)
class DeliveryInfo:
    """One delivery of one of the task's result events to a subscription."""

    subscription: str
    event_id: str
    event_status: str
    state: str
    delivery_count: int
    leased_by: str | None
    lease_expires_at: datetime | None
    acked_at: datetime | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class TaskDetail:
    """Everything the console's task page and ``task show`` display."""

    task: Task
    idempotency_key: str | None
    attempts: list[Attempt]
    events: list[TaskEvent]
    #: The tasks this one retries, nearest first (its ``retry_of``, that task's ``retry_of``, ...).
    predecessors: list[Task] = field(default_factory=list)
    #: The retries of this task, nearest first (its successor, that task's successor, ...).
    successors: list[Task] = field(default_factory=list)
    deliveries: list[DeliveryInfo] = field(default_factory=list)

    @property
    def can_cancel(self) -> bool:
        status = self.task.status
        return status in (TaskStatus.WAITING, TaskStatus.LEASED) or (
            status is TaskStatus.RUNNING and not self.task.cancel_requested
        )

    @property
    def can_review(self) -> bool:
        return self.task.status is TaskStatus.NEEDS_REVIEW

    @property
    def can_retry(self) -> bool:
        return self.task.status in (TaskStatus.FAILED, TaskStatus.CANCELLED) and not self.successors


_CHAIN_LIMIT = 100


def task_namespace_id(conn: Connection, task_id: str) -> int:
    """The namespace of task ``task_id`` (for the CLI, which is given an id alone).

    Raises:
        errors.TaskNotFound: no such task (404).
    """
    found = conn.execute(sa.select(tasks.c.namespace_id).where(tasks.c.id == task_id)).scalar()
    if found is None:
        raise errors.TaskNotFound(f"no task {task_id!r}")
    return int(found)


def get_task_detail(conn: Connection, namespace_id: int, task_id: str) -> TaskDetail:
    """A task with its attempts, events, ``retry_of`` chain both ways and result-event deliveries.

    Raises:
        errors.TaskNotFound: no such task in the namespace (404).
    """
    task = store.get_task(conn, namespace_id, task_id)
    if task is None:
        raise errors.TaskNotFound(f"no task {task_id!r} in this namespace")
    key = conn.execute(
        sa.select(submission_keys.c.idempotency_key).where(
            submission_keys.c.task_id == task_id, submission_keys.c.namespace_id == namespace_id
        )
    ).scalar()
    predecessors: list[Task] = []
    back = task.retry_of
    while back is not None and len(predecessors) < _CHAIN_LIMIT:
        found = store.get_task(conn, namespace_id, back)
        if found is None:  # purged
            break
        predecessors.append(found)
        back = found.retry_of
    successors: list[Task] = []
    forward = task.id
    while len(successors) < _CHAIN_LIMIT:
        row = (
            conn.execute(
                _task_select().where(tasks.c.retry_of == forward, tasks.c.namespace_id == namespace_id)
            )
            .mappings()
            .first()
        )
        if row is None:
            break
        successors.append(store.task_from_row(row))
        forward = row["id"]
    deliveries = [
        DeliveryInfo(
            subscription=row.name,
            event_id=row.event_id,
            event_status=row.status,
            state=row.state,
            delivery_count=row.delivery_count,
            leased_by=row.leased_by,
            lease_expires_at=to_utc(row.lease_expires_at),
            acked_at=to_utc(row.acked_at),
            created_at=_utc(row.created_at),
        )
        for row in conn.execute(
            sa.select(
                subscriptions.c.name,
                event_deliveries.c.event_id,
                result_events.c.status,
                event_deliveries.c.state,
                event_deliveries.c.delivery_count,
                event_deliveries.c.leased_by,
                event_deliveries.c.lease_expires_at,
                event_deliveries.c.acked_at,
                event_deliveries.c.created_at,
            )
            .select_from(
                event_deliveries.join(result_events, result_events.c.id == event_deliveries.c.event_id).join(
                    subscriptions, subscriptions.c.id == event_deliveries.c.subscription_id
                )
            )
            .where(result_events.c.task_id == task_id)
            .order_by(event_deliveries.c.id)
        )
    ]
    return TaskDetail(
        task=task,
        idempotency_key=key,
        attempts=operations.list_attempts(conn, namespace_id, task_id),
        events=operations.list_events(conn, namespace_id, task_id),
        predecessors=predecessors,
        successors=successors,
        deliveries=deliveries,
    )


# ---------------------------------------------------------------- namespaces


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    name: str
    created_at: datetime
    queues: int
    tasks: int
    api_keys: int


def list_namespaces(conn: Connection) -> list[NamespaceInfo]:
    """Every namespace by name, with its number of queues, tasks and active (unrevoked) keys."""

    def per_namespace(column: sa.ColumnElement[Any], *where: sa.ColumnElement[bool]) -> dict[int, int]:
        return {
            ns: int(n)
            for ns, n in conn.execute(sa.select(column, sa.func.count()).where(*where).group_by(column))
        }

    queue_counts = per_namespace(queues.c.namespace_id)
    task_counts = per_namespace(tasks.c.namespace_id)
    key_counts = per_namespace(api_keys.c.namespace_id, api_keys.c.revoked_at.is_(None))
    return [
        NamespaceInfo(
            name=row.name,
            created_at=_utc(row.created_at),
            queues=queue_counts.get(row.id, 0),
            tasks=task_counts.get(row.id, 0),
            api_keys=key_counts.get(row.id, 0),
        )
        for row in conn.execute(sa.select(namespaces).order_by(namespaces.c.name))
    ]


# ------------------------------------------------------------------ API keys


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    """An API key as operators see it: never the key, only its first characters."""

    id: int
    namespace: str
    role: str
    prefix: str
    label: str | None
    created_at: datetime
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


def list_api_keys(conn: Connection, namespace_id: int | None) -> list[ApiKeyInfo]:
    """The keys (of one namespace, or all), oldest first, revoked ones included."""
    rows = conn.execute(
        sa.select(api_keys, namespaces.c.name.label("ns"))
        .join(namespaces, namespaces.c.id == api_keys.c.namespace_id)
        .where(_in_namespace(api_keys.c.namespace_id, namespace_id))
        .order_by(api_keys.c.id)
    )
    return [
        ApiKeyInfo(
            id=row.id,
            namespace=row.ns,
            role=row.role,
            prefix=row.key_prefix,
            label=row.label,
            created_at=_utc(row.created_at),
            revoked_at=to_utc(row.revoked_at),
        )
        for row in rows
    ]


def revoke_api_key(conn: Connection, namespace_id: int | None, key_id: int, *, actor: str) -> ApiKeyInfo:
    """Set ``revoked_at`` (database clock) of key ``key_id``; revoking a revoked key changes nothing.

    Servers stop accepting the key within ``ORBIT_API_KEY_CACHE_SECONDS``. Logged with ``actor``.

    Raises:
        ApiKeyNotFound: no such key (in the namespace) (404).
    """
    where = [api_keys.c.id == key_id, _in_namespace(api_keys.c.namespace_id, namespace_id)]
    if conn.execute(sa.select(api_keys.c.id).where(*where)).first() is None:
        raise ApiKeyNotFound(
            f"no API key with id {key_id}" + ("" if namespace_id is None else " for this key")
        )
    done = conn.execute(
        api_keys.update().where(*where, api_keys.c.revoked_at.is_(None)).values(revoked_at=db_now(conn))
    )
    ended = conn.execute(console_sessions.delete().where(console_sessions.c.api_key_id == key_id)).rowcount
    if done.rowcount == 1:
        log.info("API key %s revoked by %s (%d console sessions ended)", key_id, actor, ended)
    return next(key for key in list_api_keys(conn, namespace_id) if key.id == key_id)


def api_key_principal(conn: Connection, key_hash: str) -> store.Principal | None:
    """The principal of the unrevoked key whose SHA-256 (hex) is ``key_hash``, or ``None``.

    The digest is how the server finds a key without storing it (the console's session cookie holds a
    random session token, never the key nor this digest: ``orbit_server.console._session``).
    """
    row = conn.execute(
        sa.select(api_keys.c.id, api_keys.c.role, namespaces.c.id.label("ns_id"), namespaces.c.name)
        .join(namespaces, namespaces.c.id == api_keys.c.namespace_id)
        .where(api_keys.c.key_hash == key_hash, api_keys.c.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return store.Principal(key_id=row.id, namespace_id=row.ns_id, namespace=row.name, role=row.role)


# --------------------------------------------------------------------- helpers


def aware(value: datetime) -> datetime:
    """A naive-UTC database time (e.g. of ``db_now``) as an aware UTC datetime."""
    return _utc(value)


def _utc(value: datetime) -> datetime:
    converted = to_utc(value)
    assert converted is not None
    return converted


def _naive(value: datetime) -> datetime:
    from orbit_server.db.engine import to_naive_utc

    converted = to_naive_utc(value)
    assert converted is not None
    return converted


def namespace_ids(conn: Connection, names: Sequence[str]) -> dict[str, int]:
    """Namespace name → id for the names that exist."""
    return {
        row.name: row.id
        for row in conn.execute(
            sa.select(namespaces.c.id, namespaces.c.name).where(namespaces.c.name.in_(list(names)))
        )
    }
