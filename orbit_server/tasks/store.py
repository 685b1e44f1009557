"""All of the server's SQL for namespaces, keys, queues and task acceptance.

Each function names what it does; the transaction boundary is visible at the
call site (``with engine.begin() as conn``), except :func:`submit_task`, which
owns its transactions because it must retry them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, RowMapping

from orbit_client import Queue, Task, TaskPage, TaskStatus, TaskSubmission, is_valid_idempotency_key
from orbit_server import _ids, errors
from orbit_server.db.cluster import causal_reads, is_galera
from orbit_server.db.engine import (
    as_db_time,
    db_now,
    db_now_expression,
    insert_unique,
    is_lock_conflict,
    is_unavailable,
    to_naive_utc,
    to_utc,
)
from orbit_server.db.schema import (
    api_keys,
    namespaces,
    queue_events,
    queue_gates,
    queues,
    submission_keys,
    task_events,
    tasks,
)

__all__ = [
    "API_KEY_LABEL_MAX_LENGTH",
    "ROLES",
    "Principal",
    "accepted_event_row",
    "authenticate",
    "create_api_key",
    "create_namespace",
    "create_queue",
    "decode_cursor",
    "encode_cursor",
    "find_submission",
    "get_namespace_id",
    "get_queue",
    "get_task",
    "get_tasks",
    "key_reused",
    "key_row",
    "list_tasks",
    "lookup_statement",
    "queue_missing",
    "request_digest",
    "same_request",
    "submit_task",
    "task_from_row",
    "task_gone",
    "task_row",
]

log = logging.getLogger("orbit_server.store")

#: Roles of DESIGN §8, and what each may do.
ROLES = ("read", "submit", "work", "admin")
_ALLOWED: dict[str, frozenset[str]] = {
    "read": frozenset(ROLES),
    "submit": frozenset({"submit", "admin"}),
    "work": frozenset({"work", "admin"}),
    "admin": frozenset({"admin"}),
}

_SUBMIT_TRIES = 5


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the namespace the API key belongs to and its role."""

    key_id: int
    namespace_id: int
    namespace: str
    role: str

    def can(self, action: str) -> bool:
        """Whether this key's role allows ``action`` (one of :data:`ROLES`)."""
        return self.role in _ALLOWED[action]


# --------------------------------------------------------------------- admin


def create_namespace(conn: Connection, name: str) -> int:
    """Insert a namespace; raises :class:`errors.NameTaken` if it exists."""
    taken = errors.NameTaken(f"namespace {name!r} already exists")
    if conn.execute(sa.select(namespaces.c.id).where(namespaces.c.name == name)).first():
        raise taken
    result = insert_unique(conn, namespaces.insert().values(name=name, created_at=db_now(conn)), taken)
    assert result.inserted_primary_key is not None
    return int(result.inserted_primary_key[0])


def get_namespace_id(conn: Connection, name: str) -> int:
    """The id of namespace ``name``; raises :class:`errors.NamespaceNotFound`."""
    ns_id = conn.execute(sa.select(namespaces.c.id).where(namespaces.c.name == name)).scalar()
    if ns_id is None:
        raise errors.NamespaceNotFound(f"namespace {name!r} does not exist")
    return int(ns_id)


def create_queue(
    conn: Connection,
    namespace: str,
    name: str,
    *,
    max_concurrency_per_key: int | None = None,
    max_concurrency: int | None = None,
    actor: str | None = None,
) -> Queue:
    """Insert a queue and its open gate with the given limits (``None``: no limit).

    Raises NamespaceNotFound or NameTaken.
    """
    ns_id = get_namespace_id(conn, namespace)
    exists = conn.execute(
        sa.select(queues.c.id).where(queues.c.namespace_id == ns_id, queues.c.name == name)
    ).first()
    taken = errors.NameTaken(f"queue {name!r} already exists in namespace {namespace!r}")
    if exists:
        raise taken
    now = db_now(conn)
    created = insert_unique(
        conn, queues.insert().values(namespace_id=ns_id, name=name, created_at=now), taken
    )
    assert created.inserted_primary_key is not None
    queue_id = int(created.inserted_primary_key[0])
    limits = {"max_concurrency_per_key": max_concurrency_per_key, "max_concurrency": max_concurrency}
    conn.execute(
        queue_gates.insert().values(
            queue_id=queue_id, paused=False, control_version=1, updated_at=now, updated_by=actor, **limits
        )
    )
    if max_concurrency_per_key is not None or max_concurrency is not None:
        conn.execute(
            queue_events.insert().values(
                namespace_id=ns_id, queue_id=queue_id, queue_name=name, event="created", control_version=1,
                actor=actor, data={"limits": limits}, created_at=now,
            )
        )  # fmt: skip
    return Queue(namespace=namespace, name=name, created_at=to_utc(now), counts={}, **limits)


def _hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


#: Longest API key label, in characters (the ``api_keys.label`` column).
API_KEY_LABEL_MAX_LENGTH = 255


def create_api_key(conn: Connection, namespace: str, role: str, label: str | None = None) -> str:
    """Create an API key and return it in clear; only its SHA-256 is stored.

    The key looks like ``orbit_<43 url-safe characters>`` (256 random bits).

    Raises:
        ValueError: an unknown role, or a label longer than :data:`API_KEY_LABEL_MAX_LENGTH`
            characters (refused on every database, before anything is written).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    if label is not None and len(label) > API_KEY_LABEL_MAX_LENGTH:
        raise ValueError(f"a label has at most {API_KEY_LABEL_MAX_LENGTH} characters, not {len(label)}")
    ns_id = get_namespace_id(conn, namespace)
    key = "orbit_" + secrets.token_urlsafe(32)
    conn.execute(
        api_keys.insert().values(
            namespace_id=ns_id,
            role=role,
            key_hash=_hash_key(key),
            key_prefix=key[:12],
            label=label,
            created_at=db_now(conn),
        )
    )
    return key


def authenticate(conn: Connection, key: str) -> Principal | None:
    """The principal an API key stands for, or ``None`` for an unknown or revoked key."""
    row = conn.execute(
        sa.select(api_keys.c.id, api_keys.c.role, namespaces.c.id.label("ns_id"), namespaces.c.name)
        .join(namespaces, namespaces.c.id == api_keys.c.namespace_id)
        .where(api_keys.c.key_hash == _hash_key(key), api_keys.c.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return Principal(key_id=row.id, namespace_id=row.ns_id, namespace=row.name, role=row.role)


# --------------------------------------------------------------------- reads


def _task_select() -> sa.Select[Any]:
    return sa.select(
        tasks,
        namespaces.c.name.label("namespace_name"),
        queues.c.name.label("queue_name"),
    ).select_from(
        tasks.join(namespaces, namespaces.c.id == tasks.c.namespace_id).join(
            queues, queues.c.id == tasks.c.queue_id
        )
    )


def task_from_row(row: RowMapping) -> Task:
    """Turn a row of :func:`_task_select` into the wire model."""
    return Task(
        id=row["id"],
        namespace=row["namespace_name"],
        queue=row["queue_name"],
        handler=row["handler"],
        params=row["params"],
        status=TaskStatus(row["status"]),
        state_version=row["state_version"],
        attempt_count=row["attempt_count"],
        max_attempts=row["max_attempts"],
        retry_safe=bool(row["retry_safe"]),
        available_at=to_utc(row["available_at"]),
        deadline=to_utc(row["deadline"]),
        cancel_requested=bool(row["cancel_requested"]),
        result=row["result"],
        error=row["error"],
        retry_of=row["retry_of"],
        created_at=to_utc(row["created_at"]),
        updated_at=to_utc(row["updated_at"]),
        current_attempt_id=row["current_attempt_id"],
        cancel_reason=row["cancel_reason"],
        backoff_base_seconds=row["backoff_base_seconds"],
        backoff_cap_seconds=row["backoff_cap_seconds"],
        finished_at=to_utc(row["finished_at"]),
        concurrency_key=row.get("concurrency_key"),
        traceparent=row.get("traceparent"),
        tracestate=row.get("tracestate"),
    )


def get_task(conn: Connection, namespace_id: int, task_id: str) -> Task | None:
    """The task ``task_id`` of one namespace, or ``None``."""
    if not _ids.can_exist(task_id):  # never a row; MariaDB would not even compare it
        return None
    row = (
        conn.execute(_task_select().where(tasks.c.id == task_id, tasks.c.namespace_id == namespace_id))
        .mappings()
        .first()
    )
    return task_from_row(row) if row else None


def get_tasks(conn: Connection, namespace_id: int, task_ids: Sequence[str]) -> list[Task]:
    """The tasks ``task_ids`` of one namespace, in the order given (missing ones left out)."""
    task_ids = [task_id for task_id in task_ids if _ids.can_exist(task_id)]
    if not task_ids:
        return []
    rows = conn.execute(
        _task_select().where(tasks.c.id.in_(list(task_ids)), tasks.c.namespace_id == namespace_id)
    ).mappings()
    by_id = {row["id"]: task_from_row(row) for row in rows}
    return [by_id[task_id] for task_id in task_ids if task_id in by_id]


def encode_cursor(created_at: datetime, task_id: str) -> str:
    """An opaque page cursor: the position after the task created at ``created_at`` with id ``task_id``."""
    raw = json.dumps([created_at.isoformat(), task_id], separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The ``(created_at, task_id)`` a cursor of :func:`encode_cursor` names.

    Raises:
        errors.InvalidCursor: ``cursor`` is not one this server produced (400).
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, task_id = json.loads(raw)
        if not isinstance(task_id, str) or not _ids.can_exist(task_id):
            raise ValueError("not a task id")
        return datetime.fromisoformat(created_at), task_id
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise errors.InvalidCursor("pass back the cursor of an earlier page unchanged") from exc


def list_tasks(
    conn: Connection,
    namespace_id: int,
    *,
    status: TaskStatus | None = None,
    queue: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> TaskPage:
    """A page of a namespace's tasks, oldest first (by ``created_at``, then id).

    Args:
        status, queue: filters; ``None`` means any.
        limit: most tasks on the page.
        cursor: ``next_cursor`` of the previous page; ``None`` starts at the oldest task.

    Raises:
        errors.InvalidCursor: ``cursor`` is not one this function produced (400).
    """
    query = _task_select().where(tasks.c.namespace_id == namespace_id)
    if status is not None:
        query = query.where(tasks.c.status == status.value)
    if queue is not None:
        query = query.where(queues.c.name == queue)
    if cursor is not None:
        after, after_id = decode_cursor(cursor)
        query = query.where(
            sa.or_(tasks.c.created_at > after, sa.and_(tasks.c.created_at == after, tasks.c.id > after_id))
        )
    rows = conn.execute(query.order_by(tasks.c.created_at, tasks.c.id).limit(limit + 1)).mappings().all()
    items = [task_from_row(row) for row in rows[:limit]]
    next_cursor = (
        encode_cursor(rows[limit - 1]["created_at"], rows[limit - 1]["id"]) if len(rows) > limit else None
    )
    return TaskPage(items=items, next_cursor=next_cursor)


def find_submission(conn: Connection, namespace_id: int, idempotency_key: str) -> Task | None:
    """The task an idempotency key created in a namespace, or ``None`` (DESIGN §3).

    Raises:
        errors.TaskPurged: the key is remembered but its task was purged (410, with ``task_id``).
    """
    if not is_valid_idempotency_key(idempotency_key):  # no such key was ever accepted
        return None
    row = (
        conn.execute(
            _task_select()
            .join(submission_keys, submission_keys.c.task_id == tasks.c.id)
            .where(
                submission_keys.c.namespace_id == namespace_id,
                submission_keys.c.idempotency_key == idempotency_key,
            )
        )
        .mappings()
        .first()
    )
    if row is not None:
        return task_from_row(row)
    purged = conn.execute(
        sa.select(submission_keys.c.task_id).where(
            submission_keys.c.namespace_id == namespace_id,
            submission_keys.c.idempotency_key == idempotency_key,
        )
    ).scalar()
    if purged is not None:
        raise task_gone(purged)
    return None


def get_queue(conn: Connection, namespace: str, namespace_id: int, name: str) -> Queue | None:
    """A queue with its task count per status, or ``None``."""
    row = conn.execute(
        sa.select(
            queues.c.id, queues.c.created_at, queue_gates.c.paused, queue_gates.c.max_concurrency_per_key,
            queue_gates.c.max_concurrency, queue_gates.c.control_version,
        )
        .select_from(queues.outerjoin(queue_gates, queue_gates.c.queue_id == queues.c.id))
        .where(queues.c.namespace_id == namespace_id, queues.c.name == name)
    ).first()  # fmt: skip
    if row is None:
        return None
    counts = {
        TaskStatus(status): int(n)
        for status, n in conn.execute(
            sa.select(tasks.c.status, sa.func.count())
            .where(tasks.c.queue_id == row.id)
            .group_by(tasks.c.status)
        )
    }
    return Queue(
        namespace=namespace, name=name, created_at=to_utc(row.created_at), counts=counts,
        paused=bool(row.paused), max_concurrency_per_key=row.max_concurrency_per_key,
        max_concurrency=row.max_concurrency, control_version=row.control_version or 1,
    )  # fmt: skip


# ---------------------------------------------------------------- acceptance


def request_digest(submission: TaskSubmission) -> str:
    """SHA-256 (hex) of the canonical JSON of what a submission means.

    Canonical: keys sorted, no insignificant white space, UTF-8, options left
    unset dropped (DESIGN §3). Two submissions digest alike exactly when they ask
    for the same task.
    """
    text = json.dumps(
        submission.canonical_meaning(),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def same_request(stored_digest: str, digest: str, submission: TaskSubmission) -> bool:
    """Whether a key's stored digest is that of ``submission`` (whose digest is ``digest``).

    Before ``params`` defaulted to ``{}``, a submission without ``params`` stored ``null``
    and digested as ``"params": null``. So that such a submission, replayed after the
    upgrade, is still a replay (not ``422 idempotency_key_reused``), a submission whose
    params are ``{}`` also matches the digest it had with ``null`` params. Computed only
    when the digests differ: the common path costs nothing.
    """
    if stored_digest == digest:
        return True
    if submission.params != {}:
        return False
    return stored_digest == request_digest(submission.model_copy(update={"params": None}))


def _replay(
    conn: Connection, principal: Principal, found: RowMapping, digest: str, submission: TaskSubmission
) -> Task:
    """The original task of a key seen before (``found``: its digest and task id)."""
    if not same_request(found["request_digest"], digest, submission):
        raise key_reused()
    task = get_task(conn, principal.namespace_id, found["task_id"])
    if task is None:  # the task was purged; its key is kept until it expires
        raise task_gone(found["task_id"])
    return task


#: Built once per dialect: the database clock, the key's digest and task (if any) and the queue's
#: id, in one round trip (scalar subqueries, so it answers one row whatever exists).
_LOOKUPS: dict[str, sa.Select[Any]] = {}
_INSERT_KEY = submission_keys.insert()
_INSERT_TASK = tasks.insert()
_INSERT_EVENT = task_events.insert()
#: Task columns a new task leaves NULL.
_UNSET_ON_ACCEPT = ("result", "error", "retry_of", "current_attempt_id", "cancel_reason", "finished_at")


def _lookup(conn: Connection) -> sa.Select[Any]:
    name = conn.dialect.name
    statement = _LOOKUPS.get(name)
    if statement is None:
        ns = sa.bindparam("ns", type_=sa.BigInteger)
        key, queue = sa.bindparam("key", type_=sa.String), sa.bindparam("queue", type_=sa.String)
        is_key = sa.and_(submission_keys.c.namespace_id == ns, submission_keys.c.idempotency_key == key)
        built: sa.Select[Any] = sa.select(
            db_now_expression(conn.dialect).label("now"),
            sa.select(submission_keys.c.request_digest)
            .where(is_key)
            .scalar_subquery()
            .label("request_digest"),
            sa.select(submission_keys.c.task_id).where(is_key).scalar_subquery().label("task_id"),
            sa.select(queues.c.id)
            .where(queues.c.namespace_id == ns, queues.c.name == queue)
            .scalar_subquery()
            .label("queue_id"),
        )
        statement = _LOOKUPS[name] = built
    return statement


def lookup_statement(conn: Connection) -> sa.Select[Any]:
    """The acceptance look-up (database clock, the key's digest and task, the queue's id: one round trip),
    with ``:ns``, ``:key`` and ``:queue``; shared with the flow engine, which creates step tasks with it."""
    return _lookup(conn)


def _answer_is_exact(conn: Connection, submission: TaskSubmission) -> bool:
    """Whether the task built from what was inserted equals what a replay reads back.

    MariaDB, SQLite and PostgreSQL (``json``, not ``jsonb``) keep JSON text as written and their
    timestamps keep microseconds; MySQL's binary JSON reorders object keys, and the backoff columns
    are single-precision ``FLOAT`` there.
    """
    options = submission.options
    if options and (options.backoff_base_seconds is not None or options.backoff_cap_seconds is not None):
        return False
    dialect = conn.dialect
    return dialect.name in ("sqlite", "postgresql") or (
        dialect.name == "mysql" and bool(getattr(dialect, "is_mariadb", False))
    )


# Acceptance pieces shared with the batch path (tasks/acceptance_batch.py), so both answer and write alike.


def key_reused() -> errors.IdempotencyKeyReused:
    """The 422 for a key already used with a different request digest."""
    return errors.IdempotencyKeyReused(
        "this Idempotency-Key was already used with a different queue, handler, params or options; "
        "use a new key for a new task"
    )


def task_gone(task_id: str) -> errors.TaskPurged:
    """The 410 for a key whose task was purged (the key outlives it: README "Retention and the key window")."""
    return errors.TaskPurged(
        f"this Idempotency-Key created task {task_id}, which has finished and was purged; nothing new was "
        "created",
        task_id=task_id,
    )


def queue_missing(principal: Principal, queue: str) -> errors.QueueNotFound:
    """The 404 for a submission to a queue the namespace does not have."""
    return errors.QueueNotFound(
        f"queue {queue!r} does not exist in namespace {principal.namespace!r}; "
        "create it with `orbit-server queue create`"
    )


def key_row(
    principal: Principal, key: str, digest: str, task_id: str, now: datetime, key_ttl: timedelta
) -> dict[str, Any]:
    """The ``submission_keys`` row of an accepted submission."""
    return {
        "namespace_id": principal.namespace_id,
        "idempotency_key": key,
        "request_digest": digest,
        "task_id": task_id,
        "created_at": now,
        "expires_at": now + key_ttl,
    }


def task_row(
    principal: Principal,
    submission: TaskSubmission,
    task_id: str,
    queue_id: int,
    now: datetime,
    default_max_attempts: int,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> dict[str, Any]:
    """The ``tasks`` row of an accepted submission: ``WAITING``, version 1, with its trace context
    (already checked: :func:`orbit_client._tracing.clean`)."""
    options = submission.options
    return {
        "id": task_id,
        "namespace_id": principal.namespace_id,
        "queue_id": queue_id,
        "handler": submission.handler,
        "params": submission.params,
        "status": TaskStatus.WAITING.value,
        "state_version": 1,
        "attempt_count": 0,
        "max_attempts": (options and options.max_attempts) or default_max_attempts,
        "retry_safe": bool(options and options.retry_safe),
        "backoff_base_seconds": options.backoff_base_seconds if options else None,
        "backoff_cap_seconds": options.backoff_cap_seconds if options else None,
        "available_at": to_naive_utc(options.available_at) if options and options.available_at else now,
        "deadline": to_naive_utc(options.deadline) if options else None,
        "concurrency_key": options.concurrency_key if options else None,
        "cancel_requested": False,
        "created_at": now,
        "updated_at": now,
        "traceparent": traceparent,
        "tracestate": tracestate,
    }


def accepted_event_row(principal: Principal, task_id: str, now: datetime) -> dict[str, Any]:
    """The ``task_events`` row that records a task's acceptance."""
    return {
        "task_id": task_id,
        "state_version": 1,
        "event": "accepted",
        "from_status": None,
        "to_status": TaskStatus.WAITING.value,
        "actor": f"api_key:{principal.key_id}",
        "created_at": now,
    }


def submit_task(
    engine: Engine,
    principal: Principal,
    submission: TaskSubmission,
    idempotency_key: str,
    *,
    default_max_attempts: int,
    key_ttl: timedelta,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> tuple[Task, bool]:
    """Accept a submission exactly once per ``(namespace, idempotency_key)``.

    One transaction writes the submission key, the ``WAITING`` task and its
    ``accepted`` event (invariant 1 of the reliability model). The key is inserted
    first: a concurrent first submission with the same key blocks on its unique
    index and, once the winner commits, fails and replays the winner's task.

    Round trips of a first submission: one ``SELECT`` (database clock, the key, the
    queue), three ``INSERT`` s and the ``COMMIT``. The answer is built from the values
    written; where the database might store them differently (see
    :func:`_answer_is_exact`) the task is read back, so a replay's answer is always
    identical to the first one. A connection lost mid-way is retried like a lock
    conflict: the key makes the retry a replay if the lost ``COMMIT`` had succeeded.

    ``traceparent``/``tracestate`` (W3C Trace Context, checked) are stored with a new task; a
    replay keeps the original task's (README "Tracing").

    Returns:
        ``(task, replayed)``: ``replayed`` is ``True`` when the key was seen before
        with the same request digest and ``task`` is the original task.

    Raises:
        errors.IdempotencyKeyReused: the key was used with a different request (422).
        errors.QueueNotFound: the queue does not exist in the namespace (404).
        errors.RequestInProgress: the key's first request has not committed yet, or
            the database kept reporting lock conflicts (409, retryable).
    """
    digest = request_digest(submission)
    lookup_params = {"ns": principal.namespace_id, "key": idempotency_key, "queue": submission.queue}
    lost: sa.exc.DBAPIError | None = None
    recheck = False
    for attempt in range(_SUBMIT_TRIES):
        try:
            with engine.begin() as conn:
                # A retry after a conflict reads causally, to see the submission it lost to; so does
                # a look-up again after "no such queue", which refuses for good (README "Scaling out").
                causal = attempt > 0 or recheck
                with causal_reads(conn, wanted=causal):
                    found = conn.execute(_lookup(conn), lookup_params).mappings().one()
                if found["task_id"] is None and found["queue_id"] is None and not causal and is_galera(conn):
                    recheck = True
                    continue
                if found["task_id"] is not None:
                    return _replay(conn, principal, found, digest, submission), True
                if found["queue_id"] is None:
                    raise queue_missing(principal, submission.queue)
                now = as_db_time(found["now"])
                task_id = str(uuid.uuid4())
                values = task_row(
                    principal, submission, task_id, found["queue_id"], now, default_max_attempts,
                    traceparent, tracestate,
                )  # fmt: skip
                conn.execute(_INSERT_KEY, key_row(principal, idempotency_key, digest, task_id, now, key_ttl))
                conn.execute(_INSERT_TASK, values)
                conn.execute(_INSERT_EVENT, accepted_event_row(principal, task_id, now))
                if _answer_is_exact(conn, submission):
                    row = dict.fromkeys(_UNSET_ON_ACCEPT) | values
                    row.update(namespace_name=principal.namespace, queue_name=submission.queue)
                    task = task_from_row(cast(RowMapping, row))
                else:
                    read = get_task(conn, principal.namespace_id, task_id)
                    assert read is not None
                    task = read
            log.info(
                "task accepted task_id=%s namespace=%s queue=%s",
                task_id,
                principal.namespace,
                submission.queue,
            )
            return task, False
        except sa.exc.IntegrityError:
            # A concurrent first submission inserted the key and committed first.
            with engine.begin() as conn:
                found = conn.execute(_lookup(conn), lookup_params).mappings().one()
                if found["task_id"] is not None:
                    return _replay(conn, principal, found, digest, submission), True
            raise errors.RequestInProgress(
                "another request with this Idempotency-Key is being processed; retry shortly"
            ) from None
        except sa.exc.DBAPIError as exc:
            if not (exc.connection_invalidated or is_lock_conflict(exc)):
                if lost is not None and is_unavailable(exc):
                    # An earlier try lost its connection: that loss decides the answer (503 only if
                    # it came before the try's COMMIT was sent; see nothing_committed).
                    raise lost from exc
                raise
            if exc.connection_invalidated:
                lost = exc
            log.debug("lock conflict or lost connection while accepting a submission; retrying")
    raise errors.RequestInProgress(
        "the submission kept meeting concurrent requests with the same key; retry shortly"
    )
