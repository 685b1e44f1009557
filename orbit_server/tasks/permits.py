"""Concurrency permits and the queue's execution gate (DESIGN §9; §3, §5 and invariant 12 of seed 001).

**Permits.** A queue may set ``max_concurrency_per_key`` (live attempts per task
``concurrency_key``) and ``max_concurrency`` (live attempts in the whole queue), on its row of
``queue_gates``. A lease of such a queue (:func:`orbit_server.tasks.leases.lease_tasks`):

1. locks the queue's gate row (``SELECT ... FOR UPDATE``): every grant of a limited queue, in
   any server process, is serialised on it, and it re-reads the limits and the paused flag
   under the lock;
2. in the next statement (so, at ``READ COMMITTED``, seeing every grant committed before the
   lock was granted) reads the due tasks together with how many permits their key holds and
   how many the queue holds, leaving out keys that are full; then picks, in lease order (the
   highest priority first, then the oldest due: :data:`LEASE_ORDER`), the
   tasks whose key and queue still have room. When the rows read are used up before the lease
   has what it asked for (one key fills the head of the queue and reaches its limit at the first
   pick), it reads on after the last row, leaving out the keys this lease filled, for up to
   :data:`_ROUNDS` bounded reads: a lease for 5 gets 5 when other keys have due tasks;
3. claims them with the same conditional ``UPDATE`` as every lease (status and
   ``state_version`` as read, row count checked: correctness never rests on ``SKIP LOCKED``),
   setting ``holds_permit``, and inserts one ``concurrency_permits`` row per grant in one
   multi-row ``INSERT``.

A permit is released in the transaction that ends its attempt: every transition out of
``LEASED``/``RUNNING`` goes through :func:`orbit_server.tasks.transitions.apply_transition` (or the
set-based complete of :mod:`orbit_server.tasks.attempt_sets`), which deletes the permit row when the
task ``holds_permit``. Releases need no lock: they only ever make room, and a grant that does
not see one yet grants less, never more. On SQLite every transaction is the single writer.
Once that transaction commits, the queue's long-polling leases are woken (:func:`release`,
:mod:`orbit_server.db.lease_hooks`): a task that waited for the permit is granted at once, not at
the next poll.

A queue without limits pays nothing: its lease reads the gate in the statement it runs anyway
and takes the plain path; completions read ``holds_permit`` from the task row they lock anyway.

**Gate.** A paused queue grants no leases and refuses starts (:func:`orbit_server.tasks.attempts.
start_attempt` gives the lease back); heartbeats, completes and fails go on, so results in
flight are recorded and delivered (invariant 12). Pause, resume and limit changes lock the gate
row, bump ``control_version`` and append a ``queue_events`` row (who, when, before and after)
in the same transaction.

What a limit cannot stop: an attempt whose lease lapsed no longer holds its permit, but its
process may still be running (§3: 同业务键的并发限制只约束平台授予的有效许可). See README
"Concurrency limits and pausing a queue".
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_client import Queue, TaskStatus
from orbit_server import errors
from orbit_server.db import lease_hooks
from orbit_server.db.engine import db_now
from orbit_server.db.schema import concurrency_permits, namespaces, queue_events, queue_gates, queues, tasks
from orbit_server.tasks import store

__all__ = ["LEASE_ORDER", "claim_limited", "release", "set_limits", "set_paused"]

log = logging.getLogger("orbit_server.permits")

#: How many due tasks a limited lease reads per task it may grant (rows of full keys are skipped).
_OVERSAMPLE = 4
#: Most reads of one limited lease: after the first, each reads on past the last row, leaving out the
#: keys the lease filled (a head of many tasks of one key no longer costs a round trip per grant).
_ROUNDS = 4

#: The order in which a lease grants a queue's due tasks (README "Task priority"): the highest priority
#: first, then the oldest due; the order of ``ix_tasks_claim_order``, so it is read with no sort.
LEASE_ORDER = (tasks.c.priority.desc(), tasks.c.available_at, tasks.c.id)

_LOCK_GATE = (
    sa.select(queue_gates.c.paused, queue_gates.c.max_concurrency_per_key, queue_gates.c.max_concurrency)
    .where(queue_gates.c.queue_id == sa.bindparam("queue_id"))
    .with_for_update()
)
_HELD_BY_KEY = (
    sa.select(sa.func.count())
    .where(
        concurrency_permits.c.queue_id == tasks.c.queue_id,
        concurrency_permits.c.concurrency_key == tasks.c.concurrency_key,
    )
    .scalar_subquery()
)
#: Uncorrelated (``:queue_id``), so it is counted once per statement, not once per row.
_HELD_IN_QUEUE = (
    sa.select(sa.func.count())
    .where(concurrency_permits.c.queue_id == sa.bindparam("queue_id", type_=sa.BigInteger))
    .scalar_subquery()
)


def claim_limited(
    conn: Connection, queue_id: int, now: datetime, max_tasks: int, clock: sa.ColumnElement[Any]
) -> tuple[list[dict[str, Any]], datetime] | None:
    """The due tasks a lease of a limited queue may grant, in lease order (:data:`LEASE_ORDER`).

    Locks the queue's gate row first. Returns ``None`` when the gate, read under its lock,
    has no limit any more (take the plain path), else the tasks (none when it is paused or no
    task has room) and the database clock read after the lock was granted (``clock``, as a
    column): the grants' ``leased_at``, so a grant is never dated before the release of the
    permit it reuses. The rows are not locked: every limited grant holds the gate, and the
    caller's conditional ``UPDATE`` catches a row that changed otherwise (cancel, deadline sweep).
    """
    gate = conn.execute(_LOCK_GATE, {"queue_id": queue_id}).first()
    if gate is None:
        return None
    if gate.paused:
        return [], now
    per_key, in_queue = gate.max_concurrency_per_key, gate.max_concurrency
    if per_key is None and in_queue is None:
        return None
    held_in_queue = _HELD_IN_QUEUE if in_queue is not None else sa.literal(0)
    due = sa.select(
        tasks, _HELD_BY_KEY.label("held_by_key"), held_in_queue.label("held_in_queue"), clock.label("db_now")
    ).where(
        tasks.c.queue_id == queue_id,
        tasks.c.status == TaskStatus.WAITING.value,
        tasks.c.available_at <= now,
        tasks.c.cancel_requested == sa.false(),  # a cancel asked for is never granted
        sa.or_(tasks.c.deadline.is_(None), tasks.c.deadline > now),
    )
    if per_key is not None:
        due = due.where(sa.or_(tasks.c.concurrency_key.is_(None), per_key > _HELD_BY_KEY))
    read = max_tasks if per_key is None else min(max_tasks * _OVERSAMPLE, 1000)
    chosen: list[dict[str, Any]] = []
    taken: dict[str, int] = {}
    filled: set[str] = set()  # keys this lease brought to their limit: left out of the next read
    room = max_tasks
    after: tuple[int, Any, str] | None = None
    for round_ in range(_ROUNDS if per_key is not None else 1):
        query = due
        if after is not None:  # read on past the last row of the previous read, in LEASE_ORDER
            priority, available_at, task_id = after
            query = query.where(
                tasks.c.priority <= priority,
                sa.or_(
                    tasks.c.priority < priority,
                    tasks.c.available_at > available_at,
                    sa.and_(tasks.c.available_at == available_at, tasks.c.id > task_id),
                ),
            )
        if filled:
            query = query.where(
                sa.or_(tasks.c.concurrency_key.is_(None), tasks.c.concurrency_key.not_in(filled))
            )
        rows = conn.execute(query.order_by(*LEASE_ORDER).limit(read), {"queue_id": queue_id}).mappings().all()
        if not rows:
            break
        if round_ == 0:
            now = _naive(rows[0]["db_now"])
            if in_queue is not None:
                room = min(max_tasks, in_queue - int(rows[0]["held_in_queue"]))
        for row in rows:
            if len(chosen) >= room:
                break
            key = row["concurrency_key"]
            if key is not None and per_key is not None:
                if int(row["held_by_key"]) + taken.get(key, 0) >= per_key:
                    continue
                taken[key] = taken.get(key, 0) + 1
                if int(row["held_by_key"]) + taken[key] >= per_key:
                    filled.add(key)
            task = dict(row)
            del task["held_by_key"], task["held_in_queue"], task["db_now"]
            chosen.append(task)
        if len(chosen) >= room or len(rows) < read:
            break
        after = (rows[-1]["priority"], rows[-1]["available_at"], rows[-1]["id"])
    return chosen, now


def _naive(value: Any) -> datetime:
    if isinstance(value, str):  # SQLite
        return datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=None)


def permit_rows(granted: Sequence[tuple[Mapping[Any, Any], str]], now: datetime) -> list[dict[str, Any]]:
    """The ``concurrency_permits`` rows of ``(task row, attempt id)`` grants."""
    return [
        {
            "attempt_id": attempt_id,
            "queue_id": task["queue_id"],
            "concurrency_key": task["concurrency_key"],
            "task_id": task["id"],
            "granted_at": now,
        }
        for task, attempt_id in granted
    ]


def release(conn: Connection, attempt_ids: Sequence[str]) -> None:
    """Delete the permits of attempts that end in this transaction (their tasks ``holds_permit``), and mark
    the transaction as one that made room in their queues: once it commits, their long-polling leases are
    woken (:mod:`orbit_server.db.lease_hooks`).

    The queues are read from the deleted rows (``DELETE ... RETURNING``; MySQL, which has none, reads them
    first: a statement more, and only for a queue with a limit), their names from a per-engine cache
    (:func:`_queue_keys`).
    """
    where = concurrency_permits.c.attempt_id.in_(list(attempt_ids))
    if conn.dialect.delete_returning:
        queue_ids = list(
            conn.execute(concurrency_permits.delete().where(where).returning(concurrency_permits.c.queue_id))
            .scalars()
            .all()
        )
    else:
        queue_ids = list(conn.execute(sa.select(concurrency_permits.c.queue_id).where(where)).scalars().all())
        conn.execute(concurrency_permits.delete().where(where))
    if len(queue_ids) != len(attempt_ids):  # pragma: no cover - a permit row is written with its flag
        log.warning("released %d permits of %d attempts %s", len(queue_ids), len(attempt_ids), attempt_ids)
    if queue_ids:
        lease_hooks.mark(conn, _queue_keys(conn, set(queue_ids)))


#: Per engine: queue id → ``(namespace id, queue name)`` (a queue is never renamed or deleted, so an entry
#: never goes stale), filled by :func:`_queue_keys`.
_QUEUE_KEYS: weakref.WeakKeyDictionary[Engine, dict[int, lease_hooks.QueueKey]] = weakref.WeakKeyDictionary()
_QUEUE_KEYS_LOCK = threading.Lock()


def _queue_keys(conn: Connection, queue_ids: set[int]) -> list[lease_hooks.QueueKey]:
    """The long-poll keys of ``queue_ids``: read from ``queues`` (one statement) only for ids this process has
    not met yet on this engine, so a queue costs it once per process."""
    with _QUEUE_KEYS_LOCK:
        known = _QUEUE_KEYS.setdefault(conn.engine, {})
    missing = [queue_id for queue_id in queue_ids if queue_id not in known]
    if missing:
        rows = conn.execute(
            sa.select(queues.c.id, queues.c.namespace_id, queues.c.name).where(queues.c.id.in_(missing))
        )
        for queue_id, namespace_id, name in rows:
            known[int(queue_id)] = (int(namespace_id), str(name))
    return [known[queue_id] for queue_id in queue_ids if queue_id in known]


# ------------------------------------------------------------------ the gate


def _lock(conn: Connection, namespace_id: int, queue: str) -> tuple[int, dict[str, Any], datetime]:
    """Lock a queue's gate row (created open when missing); ``(queue id, gate, now)``."""
    queue_id = conn.execute(
        sa.select(queues.c.id).where(queues.c.namespace_id == namespace_id, queues.c.name == queue)
    ).scalar()
    if queue_id is None:
        raise errors.QueueNotFound(f"queue {queue!r} does not exist in this namespace")
    read = sa.select(queue_gates).where(queue_gates.c.queue_id == queue_id).with_for_update()
    gate = conn.execute(read).mappings().first()
    # The clock after the lock: a change is dated after every grant that held the gate before it
    # (read before, a pause could be dated before grants that its lock waited for).
    now = db_now(conn)
    if gate is None:  # a queue created by hand, without its gate
        conn.execute(
            queue_gates.insert().values(queue_id=queue_id, paused=False, control_version=1, updated_at=now)
        )
        gate = conn.execute(read).mappings().one()
    return int(queue_id), dict(gate), now


def _change(
    conn: Connection, namespace_id: int, queue: str, event: str, actor: str, reason: str | None,
    changes: Mapping[str, Any], on_behalf_of: str | None,
) -> None:  # fmt: skip
    queue_id, gate, now = _lock(conn, namespace_id, queue)
    before = {name: gate[name] for name in changes}
    if before == dict(changes):
        return  # nothing to change: no version, no audit row
    version = int(gate["control_version"]) + 1
    done = conn.execute(
        queue_gates.update()
        .where(queue_gates.c.queue_id == queue_id, queue_gates.c.control_version == gate["control_version"])
        .values(control_version=version, updated_at=now, updated_by=actor, **changes)
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"queue {queue!r} changed while it was being updated")
    data: dict[str, Any] = {"before": before, "after": dict(changes)}
    if reason is not None:
        data["reason"] = reason
    if on_behalf_of is not None:
        data["on_behalf_of"] = on_behalf_of
    conn.execute(
        queue_events.insert().values(
            namespace_id=namespace_id, queue_id=queue_id, queue_name=queue, event=event,
            control_version=version, actor=actor, data=data, created_at=now,
        )
    )  # fmt: skip


def _answer(conn: Connection, namespace_id: int, queue: str) -> Queue:
    namespace = conn.execute(sa.select(namespaces.c.name).where(namespaces.c.id == namespace_id)).scalar()
    found = store.get_queue(conn, str(namespace), namespace_id, queue)
    assert found is not None
    return found


def set_paused(
    conn: Connection, namespace_id: int, queue: str, *, paused: bool, actor: str, reason: str | None = None,
    on_behalf_of: str | None = None,
) -> Queue:  # fmt: skip
    """Pause or resume a queue (audited as ``paused``/``resumed``); the queue as it is now.

    Pausing a paused queue (or resuming an open one) changes nothing and writes no audit row.
    ``actor`` is who acts (``api_key:<id>``, ``cli:<login>``); ``on_behalf_of`` the person, if
    given; both are audited with ``reason`` in ``queue_events``.
    The gate row is locked, so a pause waits for grants of a limited queue in progress, and
    any lease that starts after it commits grants nothing.

    Raises:
        errors.QueueNotFound: no such queue in the namespace (404).
    """
    event = "paused" if paused else "resumed"
    _change(conn, namespace_id, queue, event, actor, reason, {"paused": paused}, on_behalf_of)
    return _answer(conn, namespace_id, queue)


def set_limits(
    conn: Connection, namespace_id: int, queue: str, changes: Mapping[str, int | None], *, actor: str,
    reason: str | None = None, on_behalf_of: str | None = None,
) -> Queue:  # fmt: skip
    """Change ``max_concurrency_per_key`` and/or ``max_concurrency`` (``None`` removes it), audited.

    A lowered limit takes no permit back: attempts in flight finish, and new grants wait until
    the key (or queue) is under the new limit. Permits count only attempts granted while the
    queue had a limit; attempts in flight when the first limit is set are not counted.

    Raises:
        errors.QueueNotFound: no such queue in the namespace (404).
    """
    allowed = {"max_concurrency_per_key", "max_concurrency"}
    _change(conn, namespace_id, queue, "limits_changed", actor, reason,
            {k: v for k, v in changes.items() if k in allowed}, on_behalf_of)  # fmt: skip
    return _answer(conn, namespace_id, queue)
