"""Retention of finished flow instances (README "Retention and the key window"), called by
:mod:`orbit_server.retention.purge` in its bounded-batch style.

What a purge at cut-off ``T`` (UTC) deletes, and what the inventory at ``T`` counts:

- **instances** ``COMPLETED``, ``FAILED`` or ``CANCELLED`` whose ``finished_at`` is before ``T``, with
  their tokens, steps, timers, signals, internal events and history;
- **never** an instance one of whose step tasks is not terminal yet (a task still running after a
  cancel, or waiting for a review), nor one with an internal event not consumed yet: both are
  counted as protected and purged by a later run;
- the **step tasks** are tasks: the task rules purge them (a task whose internal event is not
  applied yet is kept by those rules);
- the instance's **start key** is not forgotten with it: the batch that deletes the instance writes
  a tombstone (``flow_start_tombstones``: key, request digest, instance id) that lives for the key
  window after the instance finished (``finished_at`` + the key TTL), so a replayed start (a relay
  resending a flow row whose answer was lost) answers ``410 flow_instance_purged``, never starts a
  second instance. An instance finished longer ago than the key window gets no tombstone (a relay
  does not resend a row that old). Expired tombstones go with the expired submission keys.

Each batch is one short transaction: a walk by ``(status, finished_at, id)`` over
``ix_flow_instances_finished``, a locking re-check of exactly those instances, one ``DELETE ... IN``
per owned table, the tombstones, and the instance delete conditional on the instance still being
finished and old (row count checked; a mismatch raises :class:`Conflict` and the batch is redone).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import TaskStatus
from orbit_server.db.schema import (
    flow_events,
    flow_history,
    flow_instances,
    flow_signals,
    flow_start_tombstones,
    flow_steps,
    flow_timers,
    flow_tokens,
    tasks,
)

__all__ = [
    "DEFAULT_KEY_TTL",
    "FINISHED",
    "OWNED",
    "Conflict",
    "counts",
    "purge_batch",
    "purge_tombstones",
    "walk",
]

#: The key window a purge uses for tombstones when it is given none: the server's default
#: ``ORBIT_SUBMISSION_KEY_TTL_SECONDS``.
DEFAULT_KEY_TTL = timedelta(days=7)
FINISHED = ("COMPLETED", "FAILED", "CANCELLED")
_TERMINAL_TASKS = tuple(s.value for s in TaskStatus if s.is_terminal)

_cutoff = sa.bindparam("cutoff", type_=flow_instances.c.finished_at.type)
_now = sa.bindparam("now", type_=flow_start_tombstones.c.expires_at.type)
_ids: sa.BindParameter[Any] = sa.bindparam("ids", expanding=True)


class Conflict(Exception):
    """A batch met a concurrent change: roll it back and do it again."""


def _idle(instance_id: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """The instance has no step task that is not terminal and no internal event not consumed: two
    ``NOT EXISTS``, never ``NOT (A OR B)``, which MariaDB cannot turn into anti-joins
    (``orbit_server.retention.purge._nothing_owed``)."""
    # Aliases: counting an owned table (flow_steps, flow_events) must not correlate these with it.
    steps, events = flow_steps.alias("busy_steps"), flow_events.alias("busy_events")
    running_step = (
        sa.select(sa.literal(1))
        .select_from(steps.join(tasks, tasks.c.id == steps.c.task_id))
        .where(steps.c.instance_id == instance_id, tasks.c.status.not_in(_TERMINAL_TASKS))
        .exists()
    )
    pending_event = (
        sa.select(sa.literal(1))
        .where(events.c.instance_id == instance_id, events.c.consumed_at.is_(None))
        .exists()
    )
    return sa.and_(~running_step, ~pending_event)


#: Finished before the cut-off: what a purge at ``cutoff`` considers.
_OLD = sa.and_(flow_instances.c.status.in_(FINISHED), flow_instances.c.finished_at < _cutoff)
_ELIGIBLE = sa.and_(_OLD, _idle(flow_instances.c.id))

#: What an instance owns, deleted before it (child tables first: tokens, steps, timers and signals
#: have foreign keys to the instance).
OWNED: tuple[tuple[str, sa.Table], ...] = (
    ("flow_history", flow_history),
    ("flow_events", flow_events),
    ("flow_signals", flow_signals),
    ("flow_timers", flow_timers),
    ("flow_steps", flow_steps),
    ("flow_tokens", flow_tokens),
)


def walk(limit: int, *, first: bool) -> sa.Select[Any]:
    """The next ``limit`` eligible instances of one status (``:status``) by ``(finished_at, id)``, from
    the start (``first``) or after ``(:after_f, :after_id)``."""
    i = flow_instances
    query = sa.select(i.c.id, i.c.finished_at).where(
        i.c.status == sa.bindparam("status", type_=i.c.status.type), i.c.finished_at < _cutoff, _idle(i.c.id)
    )
    if not first:
        after_f = sa.bindparam("after_f", type_=i.c.finished_at.type)
        after_id = sa.bindparam("after_id", type_=i.c.id.type)
        query = query.where(i.c.finished_at >= after_f, sa.or_(i.c.finished_at > after_f, i.c.id > after_id))
    return query.order_by(i.c.finished_at, i.c.id).limit(limit)


_LOCK = (
    sa.select(
        flow_instances.c.id,
        flow_instances.c.namespace_id,
        flow_instances.c.idempotency_key,
        flow_instances.c.request_digest,
        flow_instances.c.finished_at,
    )
    .where(flow_instances.c.id.in_(_ids), _OLD)
    .with_for_update()
)
_DELETE_INSTANCES = flow_instances.delete().where(flow_instances.c.id.in_(_ids), _OLD)


def purge_batch(
    conn: Connection, cutoff: datetime, ids: list[str], *, now: datetime, key_ttl: timedelta
) -> dict[str, int]:
    """Delete the instances ``ids`` (re-checked under lock) with what they own, and write their start
    keys' tombstones; one transaction (the caller's). Returns rows deleted per table. Raises
    :class:`Conflict` when an instance changed meanwhile."""
    if not ids:
        return {}
    locked = conn.execute(_LOCK, {"ids": ids, "cutoff": cutoff}).all()
    final = sorted(row.id for row in locked)
    if not final:
        return {}
    done: dict[str, int] = {}
    for name, table in OWNED:
        done[name] = conn.execute(table.delete().where(table.c.instance_id.in_(final))).rowcount
    tombstones = [
        {"namespace_id": row.namespace_id, "idempotency_key": row.idempotency_key,
         "request_digest": row.request_digest, "instance_id": row.id, "finished_at": row.finished_at,
         "expires_at": row.finished_at + key_ttl}
        for row in locked
        if row.finished_at + key_ttl > now
    ]  # fmt: skip
    if tombstones:
        conn.execute(flow_start_tombstones.insert(), tombstones)
    done["flow_instances"] = conn.execute(_DELETE_INSTANCES, {"ids": final, "cutoff": cutoff}).rowcount
    if done["flow_instances"] != len(final):
        raise Conflict
    return done


_SELECT_EXPIRED = sa.select(flow_start_tombstones.c.id).where(flow_start_tombstones.c.expires_at < _now)
_DELETE_EXPIRED = flow_start_tombstones.delete().where(
    flow_start_tombstones.c.id.in_(_ids), flow_start_tombstones.c.expires_at < _now
)


def purge_tombstones(conn: Connection, now: datetime, limit: int) -> int:
    """Delete up to ``limit`` tombstones expired before ``now``; how many went."""
    ids = list(conn.scalars(_SELECT_EXPIRED.limit(limit), {"now": now}))
    if not ids:
        return 0
    return int(conn.execute(_DELETE_EXPIRED, {"ids": ids, "now": now}).rowcount)


def counts(conn: Connection, cutoff: datetime | None, now: datetime) -> dict[str, int]:
    """The inventory's flow figures: finished instances before ``cutoff`` (``finished_flow_instances``),
    those kept (``protected_flow_instances``), the rows a purge would delete per table, and the
    tombstones expired by ``now`` (``flow_start_tombstones``)."""
    count = sa.func.count()
    out: dict[str, int] = {}
    if cutoff is not None:
        params = {"cutoff": cutoff}
        finished = int(
            conn.execute(sa.select(count).select_from(flow_instances).where(_OLD), params).scalar_one()
        )
        eligible = int(
            conn.execute(sa.select(count).select_from(flow_instances).where(_ELIGIBLE), params).scalar_one()
        )
        out["finished_flow_instances"], out["protected_flow_instances"] = finished, finished - eligible
        out["flow_instances"] = eligible
        for name, table in OWNED:
            joined = table.join(flow_instances, flow_instances.c.id == table.c.instance_id)
            out[name] = int(
                conn.execute(sa.select(count).select_from(joined).where(_ELIGIBLE), params).scalar_one()
            )
    expired = (
        sa.select(count).select_from(flow_start_tombstones).where(flow_start_tombstones.c.expires_at < _now)
    )
    out["flow_start_tombstones"] = int(conn.execute(expired, {"now": now}).scalar_one())
    return out
