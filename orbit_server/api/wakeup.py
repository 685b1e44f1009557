"""The wake-up of long-polling lease calls: at once in this process, over ``NOTIFY`` to the others.

A lease call that found nothing waits on the event of its ``(namespace id, queue)``; a commit that made a
task of that queue due (a submission, a resumed queue) wakes it, and so does one that released a
concurrency permit in it (an attempt of a limited queue ended: complete, fail, cancel, expiry, a lease
given back), which the app's lifespan hears of through :mod:`orbit_server.db.lease_hooks`
(:meth:`Wakeup.notify_queues`). Commits that do not know the queue (a flow step, a schedule firing, the
expiry sweep, a batch) wake every queue. On PostgreSQL the same wake-up is handed to
:class:`orbit_server.db.pg_notify.PgNotifier` (``publisher``), which tells the other server processes;
elsewhere they find the task by polling (``ORBIT_LEASE_POLL_INTERVAL_SECONDS``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

__all__ = ["QueueKey", "Wakeup"]

#: ``(namespace id, queue name)``.
QueueKey = tuple[int, str]


class Wakeup:
    """Wakes long-polling lease calls (``notify`` is thread-safe).

    ``publisher`` (set by the lifespan on PostgreSQL) is called with the same key by every :meth:`notify`,
    from the notifying thread, and must return at once.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[QueueKey, asyncio.Event] = {}
        self.publisher: Callable[[QueueKey | None], None] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events = {}

    def current(self, key: QueueKey) -> asyncio.Event | None:
        """The event the next wake-up of ``key`` sets; take it *before* looking for due tasks (on the loop)."""
        if self._loop is None:
            return None
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = asyncio.Event()
        return event

    def notify(self, key: QueueKey | None = None) -> None:
        """Wake the long-polls of ``key`` (``None``: of every queue) here and, with a publisher, elsewhere."""
        self.wake_local(key)
        publisher = self.publisher
        if publisher is not None:
            publisher(key)

    def notify_queues(self, keys: Iterable[QueueKey]) -> None:
        """:meth:`notify` each of ``keys`` (a :mod:`orbit_server.db.lease_hooks` listener: thread-safe)."""
        for key in keys:
            self.notify(key)

    def wake_local(self, key: QueueKey | None = None) -> None:
        """Wake this process's long-polls of ``key`` (``None``: every queue) only; thread-safe."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(self._fire, key)

    def wake_on_loop(self, keys: frozenset[QueueKey] | None) -> None:
        """:meth:`wake_local` for calls already on the event loop (the notifier's listener)."""
        if keys is None:
            self._fire(None)
        else:
            for key in keys:
                self._fire(key)

    def _fire(self, key: QueueKey | None) -> None:
        if key is None:
            events, self._events = self._events, {}
            for event in events.values():
                event.set()
        else:
            found = self._events.pop(key, None)  # None: nobody waits on it
            if found is not None:
                found.set()

    @staticmethod
    async def wait(event: asyncio.Event | None, timeout: float) -> None:
        if event is None:
            await asyncio.sleep(timeout)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
