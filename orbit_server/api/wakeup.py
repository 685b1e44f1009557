"""The in-process wake-up of long-polling lease calls."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class Wakeup:
    """Wakes long-polling lease calls when this process makes a task due (thread-safe ``notify``).

    Tasks made due by another server process are found by polling instead.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event | None:
        """The event the next :meth:`notify` sets; take it *before* looking for due tasks."""
        return self._event

    def notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        if event is not None:
            event.set()

    @staticmethod
    async def wait(event: asyncio.Event | None, timeout: float) -> None:
        if event is None:
            await asyncio.sleep(timeout)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
