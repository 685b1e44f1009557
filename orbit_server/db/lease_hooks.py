"""The wake-up of long-polling leases when a transaction makes room in a limited queue (a permit released).

A lease call of a queue with a concurrency limit that found nothing waits (:mod:`orbit_server.api.wakeup`)
until a commit may have made a task leasable. A submission or a resumed queue says so where it commits; but
a permit is released deep inside the transaction that ends its attempt (complete, fail, a confirmed cancel,
the expiry of a lapsed lease, a lease given back on a paused queue, single or set-based:
:func:`orbit_server.tasks.permits.release`), whose callers do not know the queue. So the release marks its
connection with the ``(namespace id, queue name)`` of the queues it made room in (:func:`mark`), and
:func:`orbit_server.db.transact.transact` calls :func:`after_commit` once the transaction committed, which
hands those keys to the listeners registered for the engine (the app's lifespan registers its
:class:`~orbit_server.api.wakeup.Wakeup`, which also tells the other server processes on PostgreSQL). A
transaction that releases no permit (every one of a queue without limits) pays one dictionary lookup.

It lives in ``db`` for the reason :mod:`orbit_server.db.flow_hooks` does: ``tasks`` marks and
:func:`~orbit_server.db.transact.transact` fires, and it imports nothing of the server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from sqlalchemy.engine import Connection, Engine

__all__ = ["ROOM_MADE", "QueueKey", "add_listener", "after_commit", "forget", "mark", "remove_listener"]

log = logging.getLogger("orbit_server.wakeup")

#: ``(namespace id, queue name)``: the key of a queue's long-polls (:data:`orbit_server.api.wakeup.QueueKey`).
QueueKey = tuple[int, str]
#: Key in ``Connection.info``: the :data:`QueueKey` set of the queues this transaction released permits in.
ROOM_MADE = "orbit_queue_room_made"

_lock = threading.Lock()
_listeners: list[tuple[Engine, Callable[[frozenset[QueueKey]], None]]] = []


def mark(conn: Connection, keys: Iterable[QueueKey]) -> None:
    """Note that this transaction released permits in the queues ``keys`` (woken once it commits)."""
    conn.info.setdefault(ROOM_MADE, set()).update(keys)


def forget(conn: Connection) -> None:
    """Drop the marks of a transaction that did not commit (``Connection.info`` outlives it in the pool)."""
    conn.info.pop(ROOM_MADE, None)


def add_listener(engine: Engine, listener: Callable[[frozenset[QueueKey]], None]) -> None:
    """Call ``listener(keys)`` after each commit on ``engine`` that released permits in the queues ``keys``.

    It is called from the committing thread (a worker thread of the server) and must be thread-safe and
    return at once (:meth:`orbit_server.api.wakeup.Wakeup.notify` is); an exception it raises is logged, never
    raised to the call whose transaction committed.
    """
    with _lock:
        _listeners.append((engine, listener))


def remove_listener(engine: Engine, listener: Callable[[frozenset[QueueKey]], None]) -> None:
    with _lock:
        if (engine, listener) in _listeners:
            _listeners.remove((engine, listener))


def after_commit(conn: Connection) -> None:
    """Hand the queues the transaction just committed on ``conn`` made room in to the engine's listeners."""
    keys = conn.info.pop(ROOM_MADE, None)
    if not keys:
        return
    engine = conn.engine
    with _lock:
        listeners = [listener for owner, listener in _listeners if owner is engine]
    made = frozenset(keys)
    for listener in listeners:
        try:
            listener(made)
        except Exception:  # a wake-up is only a hint (the long-polls still poll): never fail a committed call
            log.exception("waking the long-polls of %s failed", sorted(made))
