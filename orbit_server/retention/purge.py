"""Retention of the server's own data: inventory and purge (DESIGN §9 "Retention", §7 of seed 001).

What a purge at cut-off ``T`` (UTC) deletes, and what the inventory at ``T`` counts:

- **tasks** ``SUCCEEDED``, ``FAILED`` or ``CANCELLED`` whose ``finished_at`` is before ``T``
  (``NEEDS_REVIEW`` is never terminal), with their attempts, events, result events, the
  (all acked) deliveries of those events and their schedule occurrences; plus ``skipped``
  schedule occurrences (no task) scheduled before ``T``;
- **never** a task with a result event that has a delivery not yet ``ACKED`` (§7: an event
  with unacknowledged deliveries is not silently dropped; it is counted as protected and
  purged by a later run once acked); nor a flow step's task whose internal event its
  instance has not applied yet (a paused instance applies it on resume, README "Flows:
  running them");
- **never** one task of a manual-retry chain (``retry_of``) alone: a chain is purged whole,
  in one batch, once every task in it may be purged; while one member may not (it still
  runs, is too young or is protected), the whole chain stays;
- **flow instances** finished before ``T`` with everything they own, keeping a tombstone of their
  start key for the key window (:mod:`orbit_server.retention.flows`);
- **submission keys** independently of any cut-off, only after their own ``expires_at``
  (database clock: the key window, ``ORBIT_SUBMISSION_KEY_TTL_SECONDS``) *and* once accepted longer
  ago than the key window in force now (so raising the TTL never lets a key made under the shorter
  one go before the window the relay is told, ``GET /v1/settings``), and only when
  their task is gone or terminal with every delivery acked: a key is carried by its task's
  result events, so it stays as long as one may still be delivered; with them, flow start
  tombstones past their ``expires_at``.

A purge runs in bounded batches, each its own short transaction: one set-based select of up
to ``batch_size`` candidates (walked by ``(finished_at, id)``, so protected tasks never hold
it up), a locking re-check of exactly those rows (so a concurrent manual retry either sees
the task gone or the purge sees its new successor), one ``DELETE ... WHERE ... IN`` per
table, the task delete conditional on the task still being terminal and old (row count
checked; a mismatch rolls the batch back and it is done again), and the run's audit row
(``purge_runs``) updated in the same transaction, so its counts are exactly what was
committed. The inventory counts with the same predicates, so on a quiet database a purge
deletes exactly what the inventory at the same cut-off counted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_client import TaskStatus
from orbit_server.db.engine import db_now, is_lock_conflict, to_naive_utc, to_utc
from orbit_server.db.schema import (
    event_deliveries,
    flow_events,
    purge_runs,
    result_events,
    schedule_occurrences,
    submission_keys,
    task_attempts,
    task_events,
    tasks,
)
from orbit_server.retention import flows as flow_retention
from orbit_server.tasks.result_events import ACKED

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "Inventory",
    "PurgeCounts",
    "PurgeRun",
    "inventory",
    "list_purge_runs",
    "purge",
]

log = logging.getLogger("orbit_server.retention")

#: Tasks (with everything they own) deleted per transaction by default.
DEFAULT_BATCH_SIZE = 500
_TERMINAL = tuple(s.value for s in TaskStatus if s.is_terminal)
_TRIES = 5

_cutoff = sa.bindparam("cutoff", type_=tasks.c.finished_at.type)
_now = sa.bindparam("now", type_=submission_keys.c.expires_at.type)
_born_before = sa.bindparam("born_before", type_=submission_keys.c.created_at.type)
#: Past its own expiry *and* accepted longer ago than the key window now in force: a key made under a
#: shorter TTL (before a raise, or by a server configured otherwise) stays for the window the relay is
#: told (``GET /v1/settings``), so a resend of an old row still finds it.
_KEY_EXPIRED = sa.and_(submission_keys.c.expires_at < _now, submission_keys.c.created_at < _born_before)
_ids: sa.BindParameter[Any] = sa.bindparam("ids", expanding=True)


def _owed(task_id: sa.ColumnElement[Any]) -> tuple[sa.Exists, sa.Exists]:
    """What of the task ``task_id``'s result may still be owed to someone: a delivery of one of its
    result events not yet acked, and an internal event its flow has not applied yet (a paused
    instance applies it on resume, reading the task's result). Both only ever go from pending to
    done, never back."""
    undelivered = (
        sa.select(sa.literal(1))
        .select_from(event_deliveries.join(result_events, result_events.c.id == event_deliveries.c.event_id))
        .where(result_events.c.task_id == task_id, event_deliveries.c.state != ACKED)
        .exists()
    )
    # ix_flow_events_pending (consumed_at, ...): only the pending events are scanned.
    unapplied = (
        sa.select(sa.literal(1))
        .where(flow_events.c.consumed_at.is_(None), flow_events.c.task_id == task_id)
        .exists()
    )
    return undelivered, unapplied


def _nothing_owed(task_id: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """Nothing of the task's result is owed (:func:`_owed`): two ``NOT EXISTS``, never ``NOT (A OR
    B)``. MariaDB turns each ``NOT EXISTS`` into an anti-join, but not a negated ``OR``: it then
    scanned a materialized subquery once per task (retention inventory of 100,000 tasks: over 13
    minutes; as two ``NOT EXISTS``, 0.6 s)."""
    undelivered, unapplied = _owed(task_id)
    return sa.and_(~undelivered, ~unapplied)


#: Terminal and finished before the cut-off: what a purge at ``cutoff`` considers.
_OLD = sa.and_(tasks.c.status.in_(_TERMINAL), tasks.c.finished_at < _cutoff)
#: ... and without an unacked delivery: may be purged unless its retry chain holds it.
_ELIGIBLE = sa.and_(_OLD, _nothing_owed(tasks.c.id))


def _key_purgeable() -> sa.ColumnElement[bool]:
    """An expired submission key whose task is gone, or terminal with every delivery acked (each
    condition its own ``NOT EXISTS``, as :func:`_nothing_owed` says why)."""
    live = (
        sa.select(sa.literal(1))
        .where(tasks.c.id == submission_keys.c.task_id, tasks.c.status.not_in(_TERMINAL))
        .exists()
    )
    return sa.and_(_KEY_EXPIRED, ~live, _nothing_owed(submission_keys.c.task_id))


_KEY_PURGEABLE = _key_purgeable()


# ----------------------------------------------------------------- counts


@dataclass
class PurgeCounts:
    """Rows deleted (by a purge) or that a purge would delete (inventory), per kind."""

    tasks: int = 0
    task_attempts: int = 0
    task_events: int = 0
    result_events: int = 0
    event_deliveries: int = 0
    schedule_occurrences: int = 0
    submission_keys: int = 0
    flow_instances: int = 0
    flow_tokens: int = 0
    flow_steps: int = 0
    flow_timers: int = 0
    flow_signals: int = 0
    flow_events: int = 0
    flow_history: int = 0
    #: Expired tombstones of purged instances' start keys (the key pass).
    flow_start_tombstones: int = 0

    def add(self, other: PurgeCounts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Inventory:
    """What a purge at ``tasks_before`` would touch (read-only counts).

    Attributes:
        tasks_before: the cut-off (aware UTC): tasks finished before it are considered;
            ``None`` when only keys were counted.
        keys_before: the database clock when counted: keys that expired before it.
        terminal_tasks: terminal tasks finished before the cut-off.
        protected_tasks: of those, tasks kept because a result event of theirs has a
            delivery not yet acked.
        protected_result_events: result events of those tasks with a delivery not yet acked.
        chain_kept_tasks: tasks kept, though they could go, because another task of their
            retry chain must stay.
        protected_keys: expired keys kept because their task still runs or has an unacked delivery.
        finished_flow_instances: flow instances finished before the cut-off.
        protected_flow_instances: of those, instances kept because a step task is not terminal
            or an internal event is not consumed yet.
        purge: what a purge would delete: tasks, their attempts and events, their result
            events (every delivery acked) and those deliveries, occurrences, expired keys; flow
            instances with their tokens, steps, timers, signals, events and history; expired
            flow start tombstones.
    """

    tasks_before: datetime | None
    keys_before: datetime
    terminal_tasks: int
    protected_tasks: int
    protected_result_events: int
    chain_kept_tasks: int
    protected_keys: int
    purge: PurgeCounts
    finished_flow_instances: int = 0
    protected_flow_instances: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "tasks_before": self.tasks_before,
            "keys_before": self.keys_before,
            "terminal_tasks": self.terminal_tasks,
            "protected_tasks": self.protected_tasks,
            "protected_result_events": self.protected_result_events,
            "chain_kept_tasks": self.chain_kept_tasks,
            "protected_keys": self.protected_keys,
            "finished_flow_instances": self.finished_flow_instances,
            "protected_flow_instances": self.protected_flow_instances,
            "purge": self.purge.as_dict(),
        }


@dataclass(frozen=True)
class PurgeRun:
    """One audited purge run (a row of ``purge_runs``); times aware UTC."""

    id: int
    actor: str
    tasks_before: datetime | None
    keys_before: datetime | None
    batch_size: int
    status: str
    counts: dict[str, int]
    error: str | None
    started_at: datetime
    finished_at: datetime | None


# ----------------------------------------------------------------- chains


@dataclass
class _Chains:
    """The manual-retry chains that touch the cut-off: which eligible tasks must stay, and which
    tasks go together."""

    kept: set[str] = field(default_factory=set)
    together: dict[str, frozenset[str]] = field(default_factory=dict)


_CHAIN_ROWS = sa.select(
    tasks.c.id, tasks.c.retry_of, sa.case((_ELIGIBLE, 1), else_=0).label("eligible")
).where(
    sa.or_(
        tasks.c.retry_of.is_not(None),
        tasks.c.id.in_(sa.select(tasks.c.retry_of).where(tasks.c.retry_of.is_not(None)).scalar_subquery()),
    )
)


def _chains(conn: Connection, cutoff: datetime) -> _Chains:
    """Group every task that is part of a retry chain (``retry_of``) into its chain; a chain with
    a task that may not be purged keeps all of its eligible tasks. Reads only chain members (the
    unique ``retry_of`` index), so it costs little when retries are rare."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    eligible: dict[str, bool] = {}
    for row in conn.execute(_CHAIN_ROWS, {"cutoff": cutoff}):
        eligible[row.id] = bool(row.eligible)
        root(row.id)
        if row.retry_of is not None:
            parent[root(row.id)] = root(row.retry_of)
    groups: dict[str, set[str]] = {}
    for node in eligible:
        groups.setdefault(root(node), set()).add(node)
    chains = _Chains()
    for members in groups.values():
        if all(eligible.get(m, False) for m in members):
            frozen = frozenset(members)
            for m in members:
                chains.together[m] = frozen
        else:
            chains.kept.update(m for m in members if eligible.get(m, False))
    return chains


# -------------------------------------------------------------- inventory


def _count(conn: Connection, stmt: sa.Select[Any], params: dict[str, Any]) -> int:
    return int(conn.execute(stmt, params).scalar_one())


def _owned_counts(conn: Connection, where: sa.ColumnElement[bool], params: dict[str, Any]) -> PurgeCounts:
    """Rows owned by the tasks matching ``where``: tasks, attempts, events, result events,
    deliveries and occurrences (one count each, each a join from the owned table to ``tasks``,
    which both databases plan well)."""
    count = sa.func.count()

    def owned(table: sa.Table, column: sa.Column[Any]) -> int:
        joined = table.join(tasks, tasks.c.id == column)
        return _count(conn, sa.select(count).select_from(joined).where(where), params)

    deliveries = event_deliveries.join(result_events, result_events.c.id == event_deliveries.c.event_id).join(
        tasks, tasks.c.id == result_events.c.task_id
    )
    return PurgeCounts(
        tasks=_count(conn, sa.select(count).select_from(tasks).where(where), params),
        task_attempts=owned(task_attempts, task_attempts.c.task_id),
        task_events=owned(task_events, task_events.c.task_id),
        result_events=owned(result_events, result_events.c.task_id),
        event_deliveries=_count(conn, sa.select(count).select_from(deliveries).where(where), params),
        schedule_occurrences=owned(schedule_occurrences, schedule_occurrences.c.task_id),
    )


_SKIPPED_OCCURRENCES = sa.and_(
    schedule_occurrences.c.task_id.is_(None), schedule_occurrences.c.scheduled_at < _cutoff
)


def _chunks(items: Sequence[str], size: int = 500) -> Iterable[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def inventory(
    conn: Connection, tasks_before: datetime | None, *, key_ttl: timedelta = flow_retention.DEFAULT_KEY_TTL
) -> Inventory:
    """Count, read-only, what :func:`purge` at ``tasks_before`` would touch.

    Args:
        conn: a connection (the caller's transaction; nothing is written).
        tasks_before: the cut-off, an aware datetime (any zone) or naive UTC; tasks
            finished before it are considered. ``None``: count keys only.
        key_ttl: the key window in force (``ORBIT_SUBMISSION_KEY_TTL_SECONDS``): a key goes only
            once past its own ``expires_at`` and accepted longer ago than this.

    Returns:
        The :class:`Inventory`; keys are counted against the database clock now, whatever
        the cut-off.
    """
    now = db_now(conn)
    key_params = {"now": now, "born_before": now - key_ttl}
    count = sa.func.count()
    expired = _count(conn, sa.select(count).select_from(submission_keys).where(_KEY_EXPIRED), key_params)
    keys = _count(conn, sa.select(count).select_from(submission_keys).where(_KEY_PURGEABLE), key_params)
    cutoff = None
    if tasks_before is not None:
        cutoff = to_naive_utc(tasks_before) if tasks_before.tzinfo else tasks_before
    flows = flow_retention.counts(conn, cutoff, now)
    finished_flows = flows.pop("finished_flow_instances", 0)
    protected_flows = flows.pop("protected_flow_instances", 0)
    if cutoff is None:
        return Inventory(
            None, to_utc(now) or now, 0, 0, 0, 0, expired - keys, PurgeCounts(submission_keys=keys, **flows)
        )
    params = {"cutoff": cutoff}
    terminal = _count(conn, sa.select(count).select_from(tasks).where(_OLD), params)
    eligible = _count(conn, sa.select(count).select_from(tasks).where(_ELIGIBLE), params)
    protected_events = _count(
        conn,
        sa.select(count)
        .select_from(result_events.join(tasks, tasks.c.id == result_events.c.task_id))
        .where(
            _OLD,
            sa.select(sa.literal(1))
            .where(event_deliveries.c.event_id == result_events.c.id, event_deliveries.c.state != ACKED)
            .exists(),
        ),
        params,
    )
    counts = _owned_counts(conn, _ELIGIBLE, params)
    chains = _chains(conn, cutoff)
    for chunk in _chunks(sorted(chains.kept)):
        kept = _owned_counts(conn, tasks.c.id.in_(chunk), {})
        for f in dataclasses.fields(counts):
            setattr(counts, f.name, getattr(counts, f.name) - getattr(kept, f.name))
    counts.schedule_occurrences += _count(
        conn, sa.select(count).select_from(schedule_occurrences).where(_SKIPPED_OCCURRENCES), params
    )
    counts.submission_keys = keys
    for name, n in flows.items():
        setattr(counts, name, n)
    return Inventory(
        tasks_before=to_utc(cutoff),
        keys_before=to_utc(now) or now,
        terminal_tasks=terminal,
        protected_tasks=terminal - eligible,
        protected_result_events=protected_events,
        chain_kept_tasks=len(chains.kept),
        protected_keys=expired - keys,
        purge=counts,
        finished_flow_instances=finished_flows,
        protected_flow_instances=protected_flows,
    )


# ------------------------------------------------------------------ purge


def _walk(limit: int, *, first: bool) -> sa.Select[Any]:
    """The next ``limit`` eligible tasks of one terminal status by ``(finished_at, id)``: from the
    start (``first``) or after ``(after_f, after_id)``. One equality and one range on
    ``ix_tasks_finished (status, finished_at, id)``, read in index order: no sort, and the
    ``LIMIT`` stops the scan."""
    query = sa.select(tasks.c.id, tasks.c.finished_at).where(
        tasks.c.status == sa.bindparam("status", type_=tasks.c.status.type),
        tasks.c.finished_at < _cutoff,
        _nothing_owed(tasks.c.id),
    )
    if not first:
        after_f = sa.bindparam("after_f", type_=tasks.c.finished_at.type)
        after_id = sa.bindparam("after_id", type_=tasks.c.id.type)
        query = query.where(
            tasks.c.finished_at >= after_f, sa.or_(tasks.c.finished_at > after_f, tasks.c.id > after_id)
        )
    return query.order_by(tasks.c.finished_at, tasks.c.id).limit(limit)


# The walk saw these tasks eligible; a terminal task's deliveries only ever go from PENDING to ACKED,
# so locking them re-checks only that they are still there, terminal and old. (Should an unacked
# delivery ever appear, the delivery delete leaves it and the result-event delete fails on its
# foreign key: the batch rolls back and deletes nothing.)
_LOCK_ELIGIBLE = sa.select(tasks.c.id).where(tasks.c.id.in_(_ids), _OLD).with_for_update()
_SUCCESSORS = sa.select(tasks.c.retry_of).where(tasks.c.retry_of.in_(_ids), tasks.c.id.not_in(_ids))
_SELECT_RESULT_EVENTS = sa.select(result_events.c.id).where(result_events.c.task_id.in_(_ids))
_DELETE_DELIVERIES = event_deliveries.delete().where(
    event_deliveries.c.event_id.in_(_ids), event_deliveries.c.state == ACKED
)
_DELETE_RESULT_EVENTS = result_events.delete().where(result_events.c.task_id.in_(_ids))
_DELETE_ATTEMPTS = task_attempts.delete().where(task_attempts.c.task_id.in_(_ids))
_DELETE_EVENTS = task_events.delete().where(task_events.c.task_id.in_(_ids))
_DELETE_OCCURRENCES = schedule_occurrences.delete().where(schedule_occurrences.c.task_id.in_(_ids))
_DELETE_TASKS = tasks.delete().where(tasks.c.id.in_(_ids), _OLD)
_SELECT_SKIPPED = sa.select(schedule_occurrences.c.id).where(_SKIPPED_OCCURRENCES)
_DELETE_SKIPPED = schedule_occurrences.delete().where(
    schedule_occurrences.c.id.in_(_ids), schedule_occurrences.c.task_id.is_(None)
)
_SELECT_KEYS = sa.select(submission_keys.c.id).where(_KEY_PURGEABLE)
# Whether a key may go only changes one way (a finished task stays finished, an acked delivery acked),
# so the delete by id needs only the expiry again: no subquery in the DELETE, which MariaDB plans badly.
_DELETE_KEYS = submission_keys.delete().where(submission_keys.c.id.in_(_ids), _KEY_EXPIRED)


class _Retry(Exception):
    """A batch met a concurrent change: roll it back and do it again."""


def _purge_task_batch(conn: Connection, cutoff: datetime, ids: list[str], chains: _Chains) -> PurgeCounts:
    """Delete the tasks ``ids`` (and their chain mates) with what they own; one transaction."""
    wanted = set(ids) - chains.kept
    for task_id in list(wanted):
        wanted |= chains.together.get(task_id, frozenset())
    if not wanted:
        return PurgeCounts()
    params = {"cutoff": cutoff}
    locked = set(conn.scalars(_LOCK_ELIGIBLE, {**params, "ids": sorted(wanted)}))
    # A chain is purged whole or not at all; a task with a successor outside the batch stays
    # (a manual retry made since the chains were read).
    outside = set(conn.scalars(_SUCCESSORS, {"ids": sorted(locked)}))
    drop = (wanted - locked) | outside
    for task_id in list(drop):
        drop |= chains.together.get(task_id, frozenset())
    final = sorted(locked - drop)
    if not final:
        return PurgeCounts()
    p = {"ids": final}
    event_ids = list(conn.scalars(_SELECT_RESULT_EVENTS, p))
    counts = PurgeCounts(
        event_deliveries=conn.execute(_DELETE_DELIVERIES, {"ids": event_ids}).rowcount if event_ids else 0,
        result_events=conn.execute(_DELETE_RESULT_EVENTS, p).rowcount if event_ids else 0,
        task_attempts=conn.execute(_DELETE_ATTEMPTS, p).rowcount,
        task_events=conn.execute(_DELETE_EVENTS, p).rowcount,
        schedule_occurrences=conn.execute(_DELETE_OCCURRENCES, p).rowcount,
    )
    counts.tasks = conn.execute(_DELETE_TASKS, {**p, **params}).rowcount
    if counts.tasks != len(final):
        raise _Retry
    return counts


def _audit_start(
    engine: Engine, actor: str, cutoff: datetime | None, keys: bool, batch_size: int
) -> tuple[int, datetime]:
    with engine.begin() as conn:
        now = db_now(conn)
        result = conn.execute(
            purge_runs.insert().values(
                actor=actor,
                tasks_before=cutoff,
                keys_before=now if keys else None,
                batch_size=batch_size,
                status="running",
                counts=PurgeCounts().as_dict(),
                started_at=now,
            )
        )
        assert result.inserted_primary_key is not None
        return int(result.inserted_primary_key[0]), now


_AUDIT_COUNTS = purge_runs.update().where(purge_runs.c.id == sa.bindparam("run_id"))


def _in_batch(
    engine: Engine, run_id: int, totals: PurgeCounts, work: Callable[[Connection], PurgeCounts]
) -> PurgeCounts:
    """Run ``work`` in its own transaction with the audit row's counts; retried on conflicts."""
    for attempt in range(_TRIES):
        try:
            with engine.begin() as conn:
                done = work(conn)
                after = PurgeCounts(**totals.as_dict())
                after.add(done)
                conn.execute(_AUDIT_COUNTS, {"run_id": run_id, "counts": after.as_dict()})
            return done
        except (_Retry, flow_retention.Conflict):
            log.debug("a purge batch met a concurrent change; doing it again")
        except sa.exc.DBAPIError as exc:
            if not is_lock_conflict(exc) or attempt == _TRIES - 1:
                raise
    raise RuntimeError("a purge batch kept meeting concurrent changes; run the purge again")


def purge(
    engine: Engine,
    *,
    actor: str,
    tasks_before: datetime | None,
    keys: bool,
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_progress: Callable[[PurgeCounts], None] | None = None,
    key_ttl: timedelta = flow_retention.DEFAULT_KEY_TTL,
) -> tuple[int, PurgeCounts]:
    """Purge, in bounded batches, what :func:`inventory` counts (module docstring for the rules).

    Args:
        engine: the server database.
        actor: who purges, for the audit row (e.g. ``cli:alice``).
        tasks_before: purge terminal tasks finished before this time (aware, any zone);
            ``None``: no tasks.
        keys: also purge submission keys expired before the database clock at the start.
        batch_size: tasks (or keys, occurrences) per transaction, 1-10000.
        on_progress: called after every committed batch with what it deleted.
        key_ttl: the key window in force (``ORBIT_SUBMISSION_KEY_TTL_SECONDS``): a submission key
            goes only once past its own ``expires_at`` *and* accepted longer ago than this (a key
            made under a shorter TTL stays for the window the relay is told); a purged flow
            instance's start key is kept as a tombstone until its ``finished_at`` plus this.

    Returns:
        ``(run id, what was deleted)``; the run's ``purge_runs`` row says the same.

    Raises:
        ValueError: neither tasks nor keys asked for, or a bad ``batch_size``.
        sqlalchemy.exc.SQLAlchemyError: the database failed; the batches committed so far stay,
            and the audit row says ``failed`` with their counts.
    """
    if tasks_before is None and not keys:
        raise ValueError("nothing to purge: give a cut-off for tasks, or keys=True")
    if not 1 <= batch_size <= 10_000:
        raise ValueError("batch_size must be 1-10000")
    cutoff = to_naive_utc(tasks_before) if tasks_before is not None and tasks_before.tzinfo else tasks_before
    run_id, started = _audit_start(engine, actor, cutoff, keys, batch_size)
    totals = PurgeCounts()
    status, error = "finished", None

    def step(work: Callable[[Connection], PurgeCounts]) -> PurgeCounts:
        done = _in_batch(engine, run_id, totals, work)
        totals.add(done)
        if on_progress is not None:
            on_progress(done)
        return done

    try:
        if cutoff is not None:
            with engine.begin() as conn:
                chains = _chains(conn, cutoff)
            _walk_batches(
                step, (_walk(batch_size, first=True), _walk(batch_size, first=False)), _TERMINAL, cutoff,
                batch_size, lambda conn, ids: _purge_task_batch(conn, cutoff, ids, chains),
            )  # fmt: skip
            while True:
                done = step(lambda conn: _purge_skipped(conn, cutoff, batch_size))
                if done.schedule_occurrences < batch_size:
                    break
            _walk_batches(
                step, (flow_retention.walk(batch_size, first=True), flow_retention.walk(batch_size, first=False)),
                flow_retention.FINISHED, cutoff, batch_size,
                lambda conn, ids: PurgeCounts(
                    **flow_retention.purge_batch(conn, cutoff, ids, now=started, key_ttl=key_ttl)
                ),
            )  # fmt: skip
        if keys:
            while True:
                done = step(lambda conn: _purge_keys(conn, started, key_ttl, batch_size))
                if done.submission_keys < batch_size:
                    break
            while True:
                done = step(
                    lambda conn: PurgeCounts(
                        flow_start_tombstones=flow_retention.purge_tombstones(conn, started, batch_size)
                    )
                )
                if done.flow_start_tombstones < batch_size:
                    break
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        with engine.begin() as conn:
            conn.execute(
                purge_runs.update()
                .where(purge_runs.c.id == run_id)
                .values(status=status, error=error, finished_at=db_now(conn))
            )
        log.info("purge run %d %s: %s", run_id, status, totals.as_dict())
    return run_id, totals


def _walk_batches(
    step: Callable[[Callable[[Connection], PurgeCounts]], PurgeCounts],
    walks: tuple[sa.Select[Any], sa.Select[Any]],
    statuses: Sequence[str],
    cutoff: datetime,
    batch_size: int,
    purge_ids: Callable[[Connection, list[str]], PurgeCounts],
) -> None:
    """Purge, status by status, batches walked by ``(finished_at, id)`` (``walks``: from the start,
    and on after ``(:after_f, :after_id)``) with ``purge_ids(conn, ids)``. The walk's select runs in the
    batch's own transaction; its position moves on only once the batch committed (a retried batch
    walks from the same place)."""
    walk, walk_on = walks
    for terminal in statuses:
        position: dict[str, Any] = {}
        seen: list[Any] = []

        def batch(
            conn: Connection,
            status: str = terminal,
            position: dict[str, Any] = position,
            seen: list[Any] = seen,
        ) -> PurgeCounts:
            params = {"cutoff": cutoff, "status": status, **position}
            seen[:] = conn.execute(walk_on if position else walk, params).all()
            return purge_ids(conn, [row.id for row in seen])

        while True:
            step(batch)
            if len(seen) < batch_size:
                break
            position.update(after_f=seen[-1].finished_at, after_id=seen[-1].id)


def _purge_skipped(conn: Connection, cutoff: datetime, limit: int) -> PurgeCounts:
    ids = list(conn.scalars(_SELECT_SKIPPED.limit(limit), {"cutoff": cutoff}))
    if not ids:
        return PurgeCounts()
    return PurgeCounts(schedule_occurrences=conn.execute(_DELETE_SKIPPED, {"ids": ids}).rowcount)


def _purge_keys(conn: Connection, now: datetime, key_ttl: timedelta, limit: int) -> PurgeCounts:
    params = {"now": now, "born_before": now - key_ttl}
    ids = list(conn.scalars(_SELECT_KEYS.limit(limit), params))
    if not ids:
        return PurgeCounts()
    return PurgeCounts(submission_keys=conn.execute(_DELETE_KEYS, {"ids": ids, **params}).rowcount)


def list_purge_runs(conn: Connection, *, limit: int = 50) -> list[PurgeRun]:
    """The newest ``limit`` purge runs, newest first."""
    rows = conn.execute(sa.select(purge_runs).order_by(purge_runs.c.id.desc()).limit(limit)).mappings()
    return [
        PurgeRun(
            id=row["id"],
            actor=row["actor"],
            tasks_before=to_utc(row["tasks_before"]),
            keys_before=to_utc(row["keys_before"]),
            batch_size=row["batch_size"],
            status=row["status"],
            counts=dict(row["counts"] or {}),
            error=row["error"],
            started_at=to_utc(row["started_at"]) or row["started_at"],
            finished_at=to_utc(row["finished_at"]),
        )
        for row in rows
    ]
