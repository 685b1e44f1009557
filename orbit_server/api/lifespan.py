"""The app's lifespan: the background loops of one server process, started and stopped with the app.

The lease expiry sweep, the ``/metrics`` sampler, the scheduler and the flow loop, each turned off by
its interval setting ``0`` (README "Running the server"). They read the engine, settings, metrics and
wake-up from ``app.state`` (set by :func:`orbit_server.api.app.create_app`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_server.api.metrics import Metrics
from orbit_server.api.wakeup import Wakeup
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
        if state.owns_engine:
            engine.dispose()
