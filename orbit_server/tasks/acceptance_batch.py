"""Batch acceptance: many submissions in one transaction with set-based SQL (DESIGN §3).

The rules are exactly those of :func:`orbit_server.tasks.store.submit_task`, item by item and in
request order: the same request digest, a replay for a known key with the same digest,
``idempotency_key_reused`` for a known key with another digest, ``queue_not_found``. Two
items with one key behave as two single submissions one after the other.

One transaction per batch, whatever its size:

1. one ``SELECT`` of the submission keys named (``namespace_id, idempotency_key IN ...``);
2. one ``SELECT`` of the queues named by the items whose key is new (skipped if none);
3. one database clock read, then one multi-row ``INSERT`` each into ``submission_keys``
   (in key order, so concurrent batches take their unique-index locks in the same order),
   ``tasks`` and ``task_events`` (skipped if nothing is new);
4. one ``SELECT`` of every task answered, new and replayed alike, so a new task's answer is
   what a later replay returns.

A concurrent batch or single submission that inserted one of the keys first makes the
``INSERT`` fail (unique index) once it commits; a deadlock or lock wait timeout can also
end the transaction. Either way the whole transaction is rolled back and run again; the
new run sees the winner's keys as replays. After :data:`TRIES` runs, a read-only run
answers what is settled and each item that would create a task gets one transaction of its
own; an item that still meets a concurrent request with its key answers
``409 request_in_progress`` (retryable, as on the single endpoint). Every statement is built
once, at import.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_client import Task, TaskSubmission
from orbit_server import errors
from orbit_server.db.cluster import causal_reads
from orbit_server.db.engine import db_now, is_lock_conflict
from orbit_server.db.schema import queues, submission_keys, task_events, tasks
from orbit_server.tasks import store

__all__ = ["TRIES", "Accepted", "Pending", "submit_batch"]

log = logging.getLogger("orbit_server.acceptance_batch")

#: Transactions tried before the items still in conflict answer 409 (the single path tries 5 too).
TRIES = 5

_SELECT_KEYS = sa.select(
    submission_keys.c.idempotency_key, submission_keys.c.request_digest, submission_keys.c.task_id
).where(
    submission_keys.c.namespace_id == sa.bindparam("namespace_id"),
    submission_keys.c.idempotency_key.in_(sa.bindparam("keys", expanding=True)),
)
_SELECT_QUEUES = sa.select(queues.c.name, queues.c.id).where(
    queues.c.namespace_id == sa.bindparam("namespace_id"),
    queues.c.name.in_(sa.bindparam("names", expanding=True)),
)
_INSERT_KEYS = submission_keys.insert()
_INSERT_TASKS = tasks.insert()
_INSERT_EVENTS = task_events.insert()
_SELECT_TASKS = store._task_select().where(
    tasks.c.namespace_id == sa.bindparam("namespace_id"),
    tasks.c.id.in_(sa.bindparam("ids", expanding=True)),
)


@dataclass(frozen=True, slots=True)
class Pending:
    """A valid item of a batch: its key, its submission and the submission's request digest."""

    key: str
    submission: TaskSubmission
    digest: str
    #: W3C Trace Context of the item (checked), stored with a new task; not part of the digest.
    traceparent: str | None = None
    tracestate: str | None = None

    @classmethod
    def of(
        cls,
        key: str,
        submission: TaskSubmission,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> Pending:
        return cls(key, submission, store.request_digest(submission), traceparent, tracestate)


@dataclass(frozen=True, slots=True)
class Accepted:
    """What became of a valid item: ``created`` (201) or ``replayed`` (200), with its task."""

    outcome: Literal["created", "replayed"]
    task: Task


def submit_batch(
    engine: Engine,
    principal: store.Principal,
    items: Sequence[Pending],
    *,
    default_max_attempts: int,
    key_ttl: timedelta,
) -> list[Accepted | errors.OrbitServerError]:
    """Accept ``items`` in one transaction; one answer per item, in order.

    Returns:
        For each item, :class:`Accepted` or the error the single endpoint would raise
        for it alone (:class:`errors.IdempotencyKeyReused`, :class:`errors.QueueNotFound`,
        :class:`errors.RequestInProgress` when it still met a concurrent request with the
        same key after :data:`TRIES` transactions and one of its own).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: a database failure that is not a lock conflict or
            a lost race for a key (the request as a whole fails, nothing is written).
    """
    if not items:
        return []
    for _ in range(TRIES):
        try:
            with engine.begin() as conn, causal_reads(conn):
                # On a Galera cluster a batch reads causally (a few waits per batch): its "no such
                # queue" answers, and its retries after a conflict, see every commit made elsewhere.
                return _run(conn, principal, items, default_max_attempts, key_ttl, create=True)
        except sa.exc.IntegrityError:
            # A concurrent request inserted one of the keys and committed first.
            log.debug("a batch met a concurrent submission with one of its keys; retrying")
        except sa.exc.OperationalError as exc:
            if not is_lock_conflict(exc):
                raise
            log.debug("lock conflict while accepting a batch; retrying")
    # Still conflicting: answer what is settled, then try each item that would create a task
    # on its own (in order, so a repeated key replays its first item), so only the items that
    # really meet a concurrent request answer 409.
    with engine.begin() as conn:
        answers = _run(conn, principal, items, default_max_attempts, key_ttl, create=False)
    for position, answer in enumerate(answers):
        if isinstance(answer, errors.RequestInProgress):
            answers[position] = _alone(engine, principal, items[position], default_max_attempts, key_ttl)
    return answers


def _alone(
    engine: Engine, principal: store.Principal, item: Pending, default_max_attempts: int, key_ttl: timedelta
) -> Accepted | errors.OrbitServerError:
    """One try of one item in its own transaction; 409 if it still meets a concurrent request."""
    try:
        with engine.begin() as conn:
            return _run(conn, principal, [item], default_max_attempts, key_ttl, create=True)[0]
    except sa.exc.IntegrityError:
        pass
    except sa.exc.OperationalError as exc:
        if not is_lock_conflict(exc):
            raise
    with engine.begin() as conn:  # the other request may have committed by now: then it is a replay
        return _run(conn, principal, [item], default_max_attempts, key_ttl, create=False)[0]


def _run(
    conn: Connection,
    principal: store.Principal,
    items: Sequence[Pending],
    default_max_attempts: int,
    key_ttl: timedelta,
    *,
    create: bool,
) -> list[Accepted | errors.OrbitServerError]:
    """One try: plan every item against the keys that exist, write the new ones, read the tasks.

    With ``create=False`` nothing is written: items that would create a task answer 409.
    """
    ns_id = principal.namespace_id
    known: dict[str, tuple[str, str]] = {
        row.idempotency_key: (row.request_digest, row.task_id)
        for row in conn.execute(_SELECT_KEYS, {"namespace_id": ns_id, "keys": sorted({i.key for i in items})})
    }
    new_queues = sorted({i.submission.queue for i in items if i.key not in known})
    queue_ids: dict[str, int] = (
        {
            row.name: row.id
            for row in conn.execute(_SELECT_QUEUES, {"namespace_id": ns_id, "names": new_queues})
        }
        if new_queues
        else {}
    )

    # Walk the items in request order, as single submissions one after the other would go.
    plan: list[tuple[str, str] | errors.OrbitServerError] = []
    created: list[tuple[Pending, str, int]] = []
    for item in items:
        seen = known.get(item.key)
        if seen is not None:
            digest, task_id = seen
            same = store.same_request(digest, item.digest, item.submission)
            plan.append(("replayed", task_id) if same else store.key_reused())
            continue
        queue_id = queue_ids.get(item.submission.queue)
        if queue_id is None:
            plan.append(store.queue_missing(principal, item.submission.queue))
        elif not create:
            plan.append(
                errors.RequestInProgress(
                    "another request with this Idempotency-Key is being processed; retry shortly"
                )
            )
        else:
            task_id = str(uuid.uuid4())
            known[item.key] = (item.digest, task_id)
            created.append((item, task_id, queue_id))
            plan.append(("created", task_id))

    if created:
        now = db_now(conn)
        created.sort(key=lambda entry: entry[0].key)  # one lock order for every batch
        conn.execute(
            _INSERT_KEYS,
            [store.key_row(principal, i.key, i.digest, task_id, now, key_ttl) for i, task_id, _ in created],
        )
        conn.execute(
            _INSERT_TASKS,
            [
                store.task_row(
                    principal,
                    i.submission,
                    task_id,
                    queue_id,
                    now,
                    default_max_attempts,
                    i.traceparent,
                    i.tracestate,
                )
                for i, task_id, queue_id in created
            ],
        )
        conn.execute(
            _INSERT_EVENTS, [store.accepted_event_row(principal, task_id, now) for _, task_id, _ in created]
        )

    wanted = sorted({step[1] for step in plan if isinstance(step, tuple)})
    found: dict[str, Task] = (
        {
            row["id"]: store.task_from_row(row)
            for row in conn.execute(_SELECT_TASKS, {"namespace_id": ns_id, "ids": wanted}).mappings()
        }
        if wanted
        else {}
    )
    answers: list[Accepted | errors.OrbitServerError] = []
    for step in plan:
        if not isinstance(step, tuple):
            answers.append(step)
        elif (task := found.get(step[1])) is None:  # purged: its key is kept until it expires
            answers.append(store.task_gone(step[1]))
        else:
            answers.append(Accepted("created" if step[0] == "created" else "replayed", task))
    if created:
        log.info(
            "batch accepted created=%d of %d items namespace=%s",
            len(created),
            len(items),
            principal.namespace,
        )
        if log.isEnabledFor(logging.DEBUG):
            for item, task_id, _ in created:
                log.debug("task accepted task_id=%s namespace=%s queue=%s", task_id, principal.namespace,
                          item.submission.queue)  # fmt: skip
    return answers
