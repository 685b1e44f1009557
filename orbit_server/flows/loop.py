"""The flow loop that runs inside every server process, beside the scheduler (README "Flows: running them").

Every ``ORBIT_FLOW_INTERVAL_SECONDS`` (and at once when this process wrote a flow event, forked a
token or resumed an instance: :mod:`.hooks`) a pass

1. applies pending internal events (task results) of instances that are not paused, oldest first;
2. fires due timers (timers, signal timeouts, poll rounds) of running instances;
3. enters ``ACTIVE`` tokens of running instances (a fork's children; an entry a crash interrupted);
4. every ~5 s, gives buffered signals to waits that can take them (after a resume a crash cut short).

Each item is one transaction (:mod:`.engine`), run by a few threads at once; any number of processes
may run the loop on one database, since every claim is a conditional update. Recovery after a crash
is just this loop: nothing lives in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_server.db import faults as _faults
from orbit_server.db import flow_hooks
from orbit_server.db.engine import db_now_expression
from orbit_server.db.schema import flow_events, flow_instances, flow_signals, flow_timers, flow_tokens
from orbit_server.db.transact import transact
from orbit_server.flows import engine
from orbit_server.settings import ServerSettings

__all__ = ["PassResult", "run_flow_loop", "run_pass"]

log = logging.getLogger("orbit_server.flows.loop")

#: Most items of each kind one pass takes.
BATCH = 200
#: Seconds between two scans for buffered signals that a waiting token could take.
_SIGNAL_SCAN_EVERY = 5.0
#: Longest wait after failed passes, in seconds.
_MAX_BACKOFF = 5.0

_PENDING_EVENTS = (
    sa.select(flow_events.c.id)
    .join(flow_instances, flow_instances.c.id == flow_events.c.instance_id)
    .where(flow_events.c.consumed_at.is_(None), flow_instances.c.status != engine.PAUSED)
    .order_by(flow_events.c.created_at)
    .limit(BATCH)
)
_ACTIVE_TOKENS = (
    sa.select(flow_tokens.c.id)
    .join(flow_instances, flow_instances.c.id == flow_tokens.c.instance_id)
    .where(flow_tokens.c.state == engine.ACTIVE, flow_instances.c.status == engine.RUNNING)
    .limit(BATCH)
)
_SIGNAL_WAITS = (
    sa.select(flow_tokens.c.id)
    .join(flow_instances, flow_instances.c.id == flow_tokens.c.instance_id)
    .where(
        flow_tokens.c.state == engine.WAITING,
        flow_tokens.c.waiting_for.like("signal:%"),
        flow_instances.c.status == engine.RUNNING,
        sa.exists().where(
            flow_signals.c.instance_id == flow_tokens.c.instance_id,
            flow_signals.c.consumed_at.is_(None),
            sa.literal("signal:") + flow_signals.c.name == flow_tokens.c.waiting_for,
        ),
    )
    .limit(BATCH)
)


#: Built once per dialect: the work of a pass in one statement, ``(kind, id)`` rows: pending events
#: ("e"), due timers ("t") by the database clock, ACTIVE tokens ("a"), each at most BATCH.
_WORK: dict[str, sa.CompoundSelect[Any]] = {}


def _work_statement(db: Engine) -> sa.CompoundSelect[Any]:
    name = db.dialect.name
    statement = _WORK.get(name)
    if statement is None:
        due = (
            sa.select(flow_timers.c.id)
            .join(flow_instances, flow_instances.c.id == flow_timers.c.instance_id)
            .where(
                flow_timers.c.state == engine.PENDING,
                flow_timers.c.fire_at <= db_now_expression(db.dialect),
                flow_instances.c.status == engine.RUNNING,
            )
            .order_by(flow_timers.c.fire_at)
            .limit(BATCH)
        )

        def part(kind: str, query: sa.Select[Any]) -> sa.Select[str, str]:
            inner = query.subquery()
            return sa.select(sa.literal(kind).label("kind"), sa.cast(inner.c.id, sa.String).label("id"))

        statement = _WORK[name] = sa.union_all(
            part("e", _PENDING_EVENTS), part("t", due), part("a", _ACTIVE_TOKENS)
        )
    return statement


@dataclass
class PassResult:
    """What a pass did: items handled, tasks created, and whether a batch was full (more may be due)."""

    handled: int = 0
    created_tasks: int = 0
    full: bool = False
    failed: int = 0


def _one(
    db: Engine, work: Callable[..., engine.Outcome], item: Any, settings: engine.EngineSettings
) -> engine.Outcome:
    outcome = transact(db, work, item, settings)
    _faults.flow_point("after-commit")
    return outcome


def run_pass(
    db: Engine, settings: engine.EngineSettings, *, executor: ThreadPoolExecutor | None = None,
    scan_signals: bool = False,
) -> PassResult:  # fmt: skip
    """One pass of the loop (module docstring); an item that fails is logged and left for the next pass."""
    with db.connect() as conn:
        found: dict[str, list[str]] = {"e": [], "t": [], "a": []}
        for kind, item in conn.execute(_work_statement(db)):
            found[kind].append(item)
        waits = list(conn.execute(_SIGNAL_WAITS).scalars()) if scan_signals else []
        conn.rollback()
    events, active = found["e"], found["a"]
    timers = [int(t) for t in found["t"]]
    items: list[tuple[Callable[..., engine.Outcome], Any]] = [
        *((engine.apply_event, e) for e in events),
        *((engine.fire_timer, t) for t in timers),
        *((engine.enter_token, t) for t in active),
        *((engine.match_signal, t) for t in waits),
    ]
    result = PassResult(full=any(len(batch) >= BATCH for batch in (events, timers, active)))
    if not items:
        return result

    def run(work: Callable[..., engine.Outcome], item: Any) -> engine.Outcome | None:
        try:
            return _one(db, work, item, settings)
        except Exception:
            engine.ADVANCES.labels("failed").inc()
            log.exception("a flow advance failed (%s %s); the next pass tries again", work.__name__, item)
            return None

    outcomes = (
        list(executor.map(lambda pair: run(*pair), items))
        if executor is not None
        else [run(*p) for p in items]
    )
    for outcome in outcomes:
        if outcome is None:
            result.failed += 1
        elif outcome.outcome != "none":
            result.handled += 1
            result.created_tasks += outcome.created_tasks
    return result


async def run_flow_loop(db: Engine, settings: ServerSettings, on_created: Callable[[], None]) -> None:
    """Run passes every ``settings.flow_interval_seconds``, and at once when woken, until cancelled.

    ``on_created`` is called after a pass that created step tasks (it wakes lease long-polls).
    """
    interval = settings.flow_interval_seconds
    engine_settings = engine.EngineSettings(
        default_max_attempts=settings.default_max_attempts,
        key_ttl=timedelta(seconds=settings.submission_key_ttl_seconds),
        max_value_bytes=settings.max_body_bytes,
    )
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop is shutting down
            loop.call_soon_threadsafe(woken.set)

    flow_hooks.add_listener(wake)
    executor = ThreadPoolExecutor(max_workers=settings.flow_workers, thread_name_prefix="orbit-flow")
    last_scan = 0.0
    failures = 0  # consecutive failed passes: the wait grows to 5 s and only the first logs a traceback
    try:
        while True:
            woken.clear()
            scan = time.monotonic() - last_scan >= _SIGNAL_SCAN_EVERY
            wait = interval
            try:
                result = await run_in_threadpool(
                    run_pass, db, engine_settings, executor=executor, scan_signals=scan
                )
                failures = 0
                if scan:
                    last_scan = time.monotonic()
                if result.created_tasks:
                    on_created()
                if result.full:
                    continue  # more is due at once
            except Exception as exc:
                failures += 1
                wait = min(_MAX_BACKOFF, interval * 2 ** min(failures - 1, 16))
                if failures == 1:
                    log.exception("a flow loop pass failed; the next one runs in %s s", wait)
                else:
                    log.error("a flow loop pass failed again (%d in a row: %s); the next one runs in %s s",
                              failures, type(exc).__name__, wait)  # fmt: skip
                woken.clear()  # a failing database is not helped by passes on every wake-up
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), wait)
    finally:
        flow_hooks.remove_listener(wake)
        executor.shutdown(wait=False, cancel_futures=True)
