"""The flow engine's hook in a step task's terminal transition, and the in-process wake-up of the loop.

A task created by a flow step carries ``flow_instance_id``, ``flow_token_id`` and ``flow_activation``
(NULL for plain tasks). Every transition reads them with the task row it locks anyway, so
:func:`record_events` is called only for a step task's transition to ``SUCCEEDED``, ``FAILED``,
``CANCELLED`` or ``NEEDS_REVIEW``, and writes its internal event (``flow_events``, seed 001 §6.3) in
that transaction: a plain task's transition gets no statement more (README "Flows: running them").

The transaction that wrote an event marks its connection; :func:`orbit_server.db.transact.transact`
calls :func:`after_commit` once it committed, which wakes the flow loops of this process at once. Other
processes find the event by polling, every ``ORBIT_FLOW_INTERVAL_SECONDS``, or sooner on PostgreSQL: a
publisher (:func:`add_publisher`, :mod:`orbit_server.db.pg_notify`) hands every wake-up on to them, and
their listener wakes their loops with :func:`wake_local` (which does not publish again).

It lives in ``db`` because both the task transitions (``tasks``) and :func:`~orbit_server.db.transact.transact`
call it, and it imports nothing of the server but the schema.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Connection

from orbit_server.db.schema import flow_events

__all__ = [
    "WROTE_EVENT", "add_listener", "add_publisher", "after_commit", "notify", "record_events",
    "remove_listener", "remove_publisher", "wake_local",
]  # fmt: skip

#: Key in ``Connection.info``: this transaction wrote a flow event (or otherwise has work for the loop).
WROTE_EVENT = "orbit_flow_event"

_INSERT = flow_events.insert()
_lock = threading.Lock()
_listeners: list[Callable[[], None]] = []
_publishers: list[Callable[[], None]] = []


def record_events(conn: Connection, changed: Sequence[tuple[Mapping[str, Any], str]], now: datetime) -> None:
    """Write the internal event of each step task's transition that just happened, in its transaction.

    Args:
        changed: ``(task row as written, result event id)`` pairs; the row has ``id``, ``status``,
            ``state_version`` and the three flow columns (set: only step tasks are passed).
        now: the transition's database time (naive UTC).
    """
    conn.execute(
        _INSERT,
        [
            {
                "id": event_id, "instance_id": task["flow_instance_id"], "token_id": task["flow_token_id"],
                "activation": task["flow_activation"], "task_id": task["id"], "status": task["status"],
                "state_version": task["state_version"], "created_at": now,
            }
            for task, event_id in changed
        ],
    )  # fmt: skip
    conn.info[WROTE_EVENT] = True


def add_listener(listener: Callable[[], None]) -> None:
    """Call ``listener()`` (from any thread, so it must be thread-safe) after each commit that wrote work
    for the flow loop in this process."""
    with _lock:
        _listeners.append(listener)


def remove_listener(listener: Callable[[], None]) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def add_publisher(publisher: Callable[[], None]) -> None:
    """Call ``publisher()`` (thread-safe, returning at once) on every :func:`notify`: it tells the flow loops
    of the other server processes."""
    with _lock:
        _publishers.append(publisher)


def remove_publisher(publisher: Callable[[], None]) -> None:
    with _lock:
        if publisher in _publishers:
            _publishers.remove(publisher)


def notify() -> None:
    """Wake every flow loop of this process, and with a publisher those of the other processes."""
    with _lock:
        listeners = [*_listeners, *_publishers]
    for listener in listeners:
        listener()


def wake_local() -> None:
    """Wake every flow loop of this process only (a wake-up another process sent)."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener()


def after_commit(conn: Connection) -> None:
    """Wake the loops if the transaction just committed on ``conn`` wrote flow work (one dict lookup)."""
    if conn.info.pop(WROTE_EVENT, False):
        notify()
