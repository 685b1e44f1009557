"""The app's lifespan: the background loops of one server process, started and stopped with the app.

The lease expiry sweep, the ``/metrics`` sampler, the scheduler and the flow loop, each turned off by
its interval setting ``0`` (README "Running the server"); the wake-up of a queue's long-polls by a commit
that released a concurrency permit in it (:mod:`orbit_server.db.lease_hooks`); on PostgreSQL the
``LISTEN/NOTIFY`` wake-ups across server processes (:mod:`orbit_server.db.pg_notify`), turned off by
``ORBIT_NOTIFY=false``. They read the engine, settings, metrics and wake-up from ``app.state`` (set by
:func:`orbit_server.api.app.create_app`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_server.api.metrics import Metrics
from orbit_server.api.wakeup import Wakeup
from orbit_server.db import flow_hooks, lease_hooks
from orbit_server.db.engine import dispose_when_returned
from orbit_server.db.pg_notify import PgNotifier, Wake
from orbit_server.db.sampling import sample as sample_gauges
from orbit_server.db.transact import transact
from orbit_server.flows.loop import run_flow_loop
from orbit_server.schedules.loop import run_scheduler
from orbit_server.tasks import leases

__all__ = ["lifespan"]

log = logging.getLogger("orbit_server.app")


def sweep_all(engine: Engine) -> int:
    """Run the expiry sweep until a pass finds less than a full batch (DESIGN §4)."""
    total = 0
    while True:
        changed = transact(engine, leases.expire_leases, limit=200)
        total += changed
        if changed < 200:
            return total


async def sweep_forever(engine: Engine, wakeup: Wakeup, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            if await run_in_threadpool(sweep_all, engine):
                wakeup.notify()
        except Exception:
            log.exception("the lease expiry sweep failed; it runs again in %s s", interval)


def sample_once(engine: Engine, metrics: Metrics) -> None:
    with engine.connect() as conn:
        metrics.sampled.store(sample_gauges(conn))


async def sample_forever(engine: Engine, metrics: Metrics, interval: float) -> None:
    failing = False
    while True:
        try:
            await run_in_threadpool(sample_once, engine, metrics)
            failing = False
        except Exception:
            metrics.sampled.failures.inc()
            if not failing:
                log.exception("sampling the /metrics gauges failed; it runs again every %s s", interval)
            failing = True
        await asyncio.sleep(interval)


def notifier_for(engine: Engine, wakeup: Wakeup, *, enabled: bool, interval: float) -> PgNotifier | None:
    """The wake-ups across processes for a ``postgresql+psycopg`` engine (``None`` for any other database or
    when not ``enabled``): lease wake-ups and the flow loop's go out after commit and come in from the others."""
    if not enabled or engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
        return None

    def on_wake(wake: Wake) -> None:
        if wake.queues is None or wake.queues:
            wakeup.wake_on_loop(wake.queues)
        if wake.flow:
            flow_hooks.wake_local()

    return PgNotifier(engine, on_wake=on_wake, interval_seconds=interval)


def _publish_flow(notifier: PgNotifier) -> Callable[[], None]:
    return lambda: notifier.publish(flow=True, leases=False)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    engine, settings, wakeup = state.engine, state.settings, state.wakeup
    wakeup.bind(asyncio.get_running_loop())
    loops: list[tuple[float, str, Coroutine[Any, Any, None]]] = [
        (settings.metrics_sample_interval_seconds, "orbit-metrics-sampler",
         sample_forever(engine, state.metrics, settings.metrics_sample_interval_seconds)),
        (settings.sweep_interval_seconds, "orbit-expiry-sweep",
         sweep_forever(engine, wakeup, settings.sweep_interval_seconds)),
        (settings.scheduler_interval_seconds, "orbit-scheduler", run_scheduler(engine, settings, wakeup.notify)),
        (settings.flow_interval_seconds, "orbit-flow-loop", run_flow_loop(engine, settings, wakeup.notify)),
    ]  # fmt: skip
    notifier = state.notifier = notifier_for(
        engine, wakeup, enabled=settings.notify, interval=settings.notify_interval_seconds
    )
    publish_flow = None
    if notifier is not None:
        wakeup.publisher = notifier.publish
        publish_flow = _publish_flow(notifier)
        flow_hooks.add_publisher(publish_flow)
        loops.insert(0, (1.0, "orbit-notify", notifier.run()))
    # A commit that released a concurrency permit wakes the long-polls of its queue (orbit_server.db.lease_hooks).
    lease_hooks.add_listener(engine, wakeup.notify_queues)
    running = []
    for interval, name, coroutine in loops:
        if interval > 0:
            running.append(asyncio.create_task(coroutine, name=name))
        else:
            coroutine.close()
    try:
        yield
    finally:
        for task in reversed(running):  # stopped in the reverse order of their start, as before
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        lease_hooks.remove_listener(engine, wakeup.notify_queues)
        wakeup.publisher = None
        if publish_flow is not None:
            flow_hooks.remove_publisher(publish_flow)
        if state.owns_engine:  # after the loops' transactions still running in threads have ended
            await run_in_threadpool(dispose_when_returned, engine)
