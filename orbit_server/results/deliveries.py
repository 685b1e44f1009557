"""All of the server's SQL for result events, subscriptions and their deliveries.

Sources: DESIGN §4 "Result events" and §6.2 of the reliability model (seed 001): a result
event is saved in the same transaction as the task's terminal state, delivery is tracked
per receiver, an unacknowledged delivery is handed out again, and receivers dedupe by the
event's id. Nothing relies on in-memory notification, nor on "everything below the largest
auto-increment id is processed" (ids commit out of order).

**Events.** :func:`record_result_event` is called by
:func:`orbit_server.tasks.transitions.apply_transition`, the one place a task changes state, for
every transition to ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``NEEDS_REVIEW``
(:data:`RESULT_STATUSES`). It writes one ``result_events`` row (a copy of the task's
status, result, error and ``state_version`` as just updated) in the caller's transaction: the
event exists if and only if the transition committed.

**Fan-out: eager, in the transition's transaction.** The same call writes one
``event_deliveries`` row (``PENDING``) for each subscription of the namespace that matches
the task's queue and was created at or before the event (``created_at <= occurred_at``,
both by the database clock). A subscription therefore receives *exactly* the matching
events with ``occurred_at >= created_at``, and here is why that holds under concurrency:

- The fan-out first takes a **shared** lock on the namespace row, then reads the
  subscriptions with a locking read (which sees the latest committed rows at any
  isolation level). :func:`create_subscription` takes an **exclusive** lock on the same
  row *before* it reads the clock for ``created_at``. (A worker's single ``complete`` or
  ``fail`` takes the shared locks in the statement that locks its task, and on
  MySQL/MariaDB reads the subscriptions there too, after the namespace's lock:
  :func:`orbit_server.tasks.result_events.locked_subscribers`. On PostgreSQL, where a
  statement sees only rows committed before it began, the subscriptions are read by a
  later statement. The argument below needs only that the event's time is read before
  its transaction commits and the subscriptions after the shared lock is granted.)
- If the transition locks first, the new subscription waits for it to commit and its
  ``created_at`` is read afterwards, so it is later than the event's ``occurred_at``
  (taken at the start of the transition): the event is rightly not its own.
- If the subscription locks first, the transition waits until it commits, then sees it,
  and the ``created_at <= occurred_at`` test decides.

Shared locks do not conflict with each other, so transitions never wait for one another
here; only subscription creation (rare) serialises with them. On SQLite the single writer
(``BEGIN IMMEDIATE``) gives the same order. The alternative, creating delivery rows lazily
at lease time from "events newer than the subscription", needs either an anti-join over the
whole event history on every lease or a cursor, and a cursor on ids or times skips events
whose transactions commit out of order (§6.2); the eager rows need neither. Their cost is
one row per (event, matching subscription), written in a transaction that already writes.

**Deliveries.** :func:`lease_deliveries` claims the oldest leasable deliveries of one
subscription (``PENDING`` whose lease is absent or past, by the database clock) with
``FOR UPDATE SKIP LOCKED`` on MySQL/MariaDB, so concurrent consumers never get the same
delivery while it is leased, and counts the delivery. :func:`ack_delivery` makes a delivery
``ACKED`` for good; acking again changes nothing. A delivery is thus handed out at least once
and possibly more (after a lost ack or a crash): receivers must dedupe by event id.

Each function takes the caller's connection and does one short unit of work; run it with
:func:`orbit_server.db.transact.transact`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import Delivery, DeliveryAck, ResultEvent, Subscription, TaskStatus
from orbit_server import errors
from orbit_server.db import faults as _faults
from orbit_server.db.engine import BIGINT_MAX, db_now
from orbit_server.db.schema import (
    event_deliveries,
    namespaces,
    queues,
    result_events,
    submission_keys,
    subscriptions,
    tasks,
)
from orbit_server.tasks.result_events import _MAX_ID_DIGITS, ACKED, PENDING, _at

__all__ = ["ack_delivery", "create_subscription", "get_subscription", "lease_deliveries"]

# --------------------------------------------------------------- subscriptions


def _subscription(namespace: str, row: Any) -> Subscription:
    return Subscription(namespace=namespace, name=row.name, queues=row.queues, created_at=_at(row.created_at))


def _find_subscription(conn: Connection, namespace_id: int, name: str) -> Any:
    return conn.execute(
        sa.select(
            subscriptions.c.id, subscriptions.c.name, subscriptions.c.queues, subscriptions.c.created_at
        ).where(subscriptions.c.namespace_id == namespace_id, subscriptions.c.name == name)
    ).first()


def _subscription_id(conn: Connection, namespace_id: int, name: str) -> int:
    found = conn.execute(
        sa.select(subscriptions.c.id).where(
            subscriptions.c.namespace_id == namespace_id, subscriptions.c.name == name
        )
    ).scalar()
    if found is None:
        raise errors.SubscriptionNotFound(f"no subscription {name!r} in this namespace")
    return int(found)


def create_subscription(
    conn: Connection, namespace_id: int, namespace: str, name: str, queue_names: Sequence[str] | None
) -> tuple[Subscription, bool]:
    """Create a subscription, or find the same one (idempotent).

    Takes an exclusive lock on the namespace row first and only then reads the database
    clock for ``created_at``, so that every result event is either written before the
    subscription exists (and not delivered to it) or sees it (module docstring).

    Args:
        namespace_id, namespace: the caller's namespace (id and name).
        name: the subscription's name.
        queue_names: the queues it receives events of (order and repeats ignored); ``None``
            means every queue of the namespace.

    Returns:
        ``(subscription, created)``: ``created`` is ``False`` when one with this name and the
        same queues already existed (it is returned unchanged).

    Raises:
        errors.QueueNotFound: a named queue does not exist in the namespace (404).
        errors.SubscriptionExists: the name is taken by a subscription with other queues (409).
    """
    conn.execute(sa.select(namespaces.c.id).where(namespaces.c.id == namespace_id).with_for_update())
    wanted = sorted(set(queue_names)) if queue_names is not None else None
    if wanted:
        known = set(
            conn.execute(
                sa.select(queues.c.name).where(
                    queues.c.namespace_id == namespace_id, queues.c.name.in_(wanted)
                )
            ).scalars()
        )
        missing = [queue for queue in wanted if queue not in known]
        if missing:
            raise errors.QueueNotFound(
                f"queue {missing[0]!r} does not exist in namespace {namespace!r}; create it first"
            )
    existing = _find_subscription(conn, namespace_id, name)
    if existing is not None:
        if existing.queues != wanted:

            def which(names: list[str] | None) -> str:
                return "every queue" if names is None else "queues " + ", ".join(map(repr, names))

            raise errors.SubscriptionExists(
                f"subscription {name!r} already exists for {which(existing.queues)}, not {which(wanted)}; "
                "choose another name to receive other queues"
            )
        return _subscription(namespace, existing), False
    now = db_now(conn)
    conn.execute(
        subscriptions.insert().values(namespace_id=namespace_id, name=name, queues=wanted, created_at=now)
    )
    return Subscription(namespace=namespace, name=name, queues=wanted, created_at=_at(now)), True


def get_subscription(conn: Connection, namespace_id: int, namespace: str, name: str) -> Subscription:
    """One subscription of the namespace.

    Raises:
        errors.SubscriptionNotFound: no such subscription in the namespace (404).
    """
    row = _find_subscription(conn, namespace_id, name)
    if row is None:
        raise errors.SubscriptionNotFound(f"no subscription {name!r} in namespace {namespace!r}")
    return _subscription(namespace, row)


# ------------------------------------------------------------------ deliveries


def lease_deliveries(
    conn: Connection,
    namespace_id: int,
    namespace: str,
    subscription: str,
    *,
    max_deliveries: int,
    lease_seconds: float,
    leased_by: str,
) -> list[Delivery]:
    """Hand out up to ``max_deliveries`` deliveries of one subscription, oldest first.

    Claims ``PENDING`` deliveries whose lease is absent or has lapsed (database clock), with
    ``FOR UPDATE SKIP LOCKED`` on MySQL/MariaDB (the single writer on SQLite), so a delivery
    is never handed to two callers while its lease runs. Each claimed delivery gets
    ``lease_expires_at = now + lease_seconds``, one more ``delivery_count`` and
    ``leased_by``. A delivery not acked before its lease lapses is handed out again.

    Args:
        namespace_id, namespace: the caller's namespace (id and name).
        subscription: the subscription's name.
        max_deliveries: most deliveries handed out, at least 1.
        lease_seconds: the lease, in seconds from now (database clock).
        leased_by: who leases, for operators (e.g. ``api_key:12``).

    Returns:
        The deliveries, oldest first; empty when none is due.

    Raises:
        errors.SubscriptionNotFound: no such subscription in the namespace (404).
        errors.ConcurrentUpdate: a claimed row changed under the claim (nothing written).
    """
    subscription_id = _subscription_id(conn, namespace_id, subscription)
    now = db_now(conn)
    d = event_deliveries
    leasable = sa.and_(
        d.c.state == PENDING, sa.or_(d.c.lease_expires_at.is_(None), d.c.lease_expires_at <= now)
    )
    ids = list(
        conn.execute(
            _faults.skip_locked(
                sa.select(d.c.id)
                .where(d.c.subscription_id == subscription_id, leasable)
                .order_by(d.c.id)
                .limit(max_deliveries)
            )
        ).scalars()
    )
    if not ids:
        return []
    expires = now + timedelta(seconds=lease_seconds)
    claimed = conn.execute(
        d.update()
        .where(d.c.id.in_(ids), leasable)
        .values(delivery_count=d.c.delivery_count + 1, leased_by=leased_by, lease_expires_at=expires)
    )
    if claimed.rowcount != len(ids):
        raise errors.ConcurrentUpdate("deliveries changed while they were being leased")
    e, k = result_events, submission_keys
    rows = conn.execute(
        sa.select(
            d.c.id.label("delivery_id"), d.c.delivery_count, e.c.id, e.c.task_id, queues.c.name.label("queue"),
            e.c.handler, e.c.status, e.c.result, e.c.error, e.c.occurred_at, e.c.retry_of,
            sa.func.coalesce(e.c.idempotency_key, k.c.idempotency_key).label("idempotency_key"),
            tasks.c.traceparent, tasks.c.tracestate,
        )
        .select_from(
            d.join(e, e.c.id == d.c.event_id)
            .join(queues, queues.c.id == e.c.queue_id)
            .join(tasks, tasks.c.id == e.c.task_id)
            .outerjoin(k, sa.and_(k.c.task_id == e.c.task_id, k.c.namespace_id == e.c.namespace_id))
        )
        .where(d.c.id.in_(ids))
        .order_by(d.c.id)
    ).all()  # fmt: skip
    lease_expires_at = _at(expires)
    return [
        Delivery(
            id=str(row.delivery_id),
            subscription=subscription,
            delivery_count=row.delivery_count,
            lease_expires_at=lease_expires_at,
            event=ResultEvent(
                id=row.id,
                task_id=row.task_id,
                namespace=namespace,
                queue=row.queue,
                handler=row.handler,
                status=TaskStatus(row.status),
                result=row.result,
                error=row.error,
                occurred_at=_at(row.occurred_at),
                idempotency_key=row.idempotency_key,
                retry_of=row.retry_of,
                traceparent=row.traceparent,
                tracestate=row.tracestate,
            ),
        )
        for row in rows
    ]


def ack_delivery(conn: Connection, namespace_id: int, subscription: str, delivery_id: str) -> DeliveryAck:
    """Mark a delivery ``ACKED``: it is never handed out again. Idempotent.

    Accepted whoever holds the lease, and after the lease lapsed: an ack says that the
    event was processed durably, which is true whichever delivery of it got there first.

    Args:
        subscription: the subscription's name.
        delivery_id: the delivery's id as handed out (a decimal string).

    Returns:
        The delivery's id and when it was first acked (UTC, database clock); acking again
        answers the same.

    Raises:
        errors.SubscriptionNotFound: no such subscription in the namespace (404).
        errors.DeliveryNotFound: no such delivery in the subscription (404).
    """
    subscription_id = _subscription_id(conn, namespace_id, subscription)
    well_formed = delivery_id.isascii() and delivery_id.isdigit() and len(delivery_id) <= _MAX_ID_DIGITS
    if not well_formed or str(int(delivery_id)) != delivery_id or int(delivery_id) > BIGINT_MAX:
        raise errors.DeliveryNotFound(f"no delivery {delivery_id!r} in subscription {subscription!r}")
    d = event_deliveries
    mine = sa.and_(d.c.id == int(delivery_id), d.c.subscription_id == subscription_id)
    conn.execute(d.update().where(mine, d.c.state == PENDING).values(state=ACKED, acked_at=db_now(conn)))
    acked_at = conn.execute(sa.select(d.c.acked_at).where(mine)).scalar()
    if acked_at is None:
        raise errors.DeliveryNotFound(f"no delivery {delivery_id!r} in subscription {subscription!r}")
    return DeliveryAck(id=delivery_id, subscription=subscription, acked_at=_at(acked_at))
