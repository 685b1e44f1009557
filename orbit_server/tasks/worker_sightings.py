"""Worker liveness from lease calls: who leases from which queue, and when it last did (README "Web console").

A lease call that names an existing queue is a sighting of its ``worker_id`` on that queue, whether or not it
got a task: an idle worker long-polling an empty queue is alive. :class:`Sightings` writes the sighting's
database time to ``worker_sightings`` at most once per ``every_seconds`` (default 10 s) per worker and queue in
each server process, so the cost is one short transaction per worker per 10 s, not one per lease call. The
console's overview reads :func:`liveness`: per queue, the last sighting and the workers seen within the last
minute (so "last seen" is exact to about 10 s).

Rows of workers not seen for a day are deleted when a new worker appears on the queue.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_server.db.engine import db_now
from orbit_server.db.schema import worker_sightings

__all__ = ["QueueLiveness", "Sightings", "liveness", "record_sighting", "sightings_for"]

#: "Workers seen" counts the workers whose last lease call is at most this old.
RECENT = timedelta(minutes=1)
_FORGET = timedelta(days=1)


def record_sighting(conn: Connection, namespace_id: int, queue: str, worker_id: str) -> None:
    """Set the worker's last sighting on ``queue`` to now (database clock): an update, else an insert."""
    now = db_now(conn)
    key = (
        (worker_sightings.c.namespace_id == namespace_id)
        & (worker_sightings.c.queue == queue)
        & (worker_sightings.c.worker_id == worker_id)
    )
    if conn.execute(worker_sightings.update().where(key).values(last_seen_at=now)).rowcount:
        return
    conn.execute(
        worker_sightings.delete().where(
            (worker_sightings.c.namespace_id == namespace_id)
            & (worker_sightings.c.queue == queue)
            & (worker_sightings.c.last_seen_at < now - _FORGET)
        )
    )
    conn.execute(
        worker_sightings.insert().values(
            namespace_id=namespace_id, queue=queue, worker_id=worker_id, last_seen_at=now
        )
    )


class Sightings:
    """Records sightings for one server process, at most once per ``every_seconds`` per worker and queue."""

    def __init__(self, engine: Engine, *, every_seconds: float = 10.0) -> None:
        self._engine = engine
        self._every = every_seconds
        self._last: dict[tuple[int, str, str], float] = {}
        self._lock = threading.Lock()

    def due(self, namespace_id: int, queue: str, worker_id: str) -> bool:
        """Whether this sighting should be written (and, if so, marks it written now)."""
        key = (namespace_id, queue, worker_id)
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self._every) < self._every:
                return False
            if len(self._last) > 100_000:  # workers that come and go: never an unbounded map
                self._last.clear()
            self._last[key] = now
            return True

    def write(self, namespace_id: int, queue: str, worker_id: str) -> None:
        """Write a sighting :meth:`due` allowed; a failure is swallowed (liveness is advisory, a lease is not)."""
        try:
            with self._engine.begin() as conn:
                record_sighting(conn, namespace_id, queue, worker_id)
        except sa.exc.SQLAlchemyError:  # a concurrent first sighting, a lock timeout: the next call writes it
            with self._lock:
                self._last.pop((namespace_id, queue, worker_id), None)


_BY_ENGINE: weakref.WeakKeyDictionary[Engine, Sightings] = weakref.WeakKeyDictionary()
_BY_ENGINE_LOCK = threading.Lock()


def sightings_for(engine: Engine) -> Sightings:
    """This process's :class:`Sightings` of ``engine`` (one per engine, made on first use)."""
    with _BY_ENGINE_LOCK:
        found = _BY_ENGINE.get(engine)
        if found is None:
            found = _BY_ENGINE[engine] = Sightings(engine)
        return found


@dataclass(frozen=True)
class QueueLiveness:
    """A queue's workers as its lease calls show them."""

    queue: str
    last_seen_at: datetime | None
    last_seen_seconds: float | None
    workers_recent: int
    recent_workers: tuple[str, ...]


def liveness(conn: Connection, namespace_id: int, queues: list[str]) -> dict[str, QueueLiveness]:
    """Per queue name: the last sighting (and its age in seconds) and the workers seen in the last minute."""
    now = db_now(conn)
    rows = conn.execute(
        sa.select(worker_sightings.c.queue, worker_sightings.c.worker_id, worker_sightings.c.last_seen_at)
        .where(worker_sightings.c.namespace_id == namespace_id)
        .where(worker_sightings.c.last_seen_at >= now - _FORGET)
        .order_by(worker_sightings.c.last_seen_at.desc())
    ).all()
    found: dict[str, QueueLiveness] = {}
    for name in queues:
        mine = [r for r in rows if r.queue == name]
        last = mine[0].last_seen_at if mine else None
        recent = tuple(r.worker_id for r in mine if r.last_seen_at >= now - RECENT)
        found[name] = QueueLiveness(
            queue=name,
            last_seen_at=last,
            last_seen_seconds=max(0.0, (now - last).total_seconds()) if last else None,
            workers_recent=len(recent),
            recent_workers=recent[:10],
        )
    return found
