"""The scheduler loop that runs inside every server process (README "Schedules").

Every ``ORBIT_SCHEDULER_INTERVAL_SECONDS`` it fires the due schedules
(:func:`orbit_server.schedules.schedules.fire_due`). Any number of processes may run it on one database:
each fire time still gives exactly one task. A pass that created tasks wakes this process's
lease long-polls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_server.schedules import schedules
from orbit_server.settings import ServerSettings

__all__ = ["run_scheduler"]

log = logging.getLogger("orbit_server.scheduler")


async def run_scheduler(engine: Engine, settings: ServerSettings, on_created: Callable[[], None]) -> None:
    """Fire due schedules every ``settings.scheduler_interval_seconds`` until cancelled.

    A failed pass is logged and the loop goes on; ``on_created`` is called (from the event
    loop's thread pool) after a pass that created at least one task.
    """
    interval = settings.scheduler_interval_seconds
    key_ttl = timedelta(seconds=settings.submission_key_ttl_seconds)
    while True:
        try:
            created = await run_in_threadpool(
                schedules.fire_due,
                engine,
                default_max_attempts=settings.default_max_attempts,
                key_ttl=key_ttl,
            )
            if created:
                on_created()
        except Exception:
            log.exception("a scheduler pass failed; the next one runs in %s s", interval)
        await asyncio.sleep(interval)
