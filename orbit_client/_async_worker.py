"""The asyncio worker: :class:`AsyncWorker` runs coroutine handlers as tasks on one event loop.

Its rules are shared with :class:`Worker` in :mod:`._worker`; this module holds its tasks and waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from orbit_client import _tracing
from orbit_client._attempt_models import AttemptState, LeaseGrant
from orbit_client._client import AsyncOrbitClient
from orbit_client._exceptions import OrbitError, OrbitUsageError
from orbit_client._reports import AsyncReports
from orbit_client._worker import (
    _DOC_ARGS,
    DEFAULT_REPORT_LINGER,
    TaskContext,
    _Config,
    _WorkerCore,
    logger,
)

__all__ = ["AsyncWorker"]


class AsyncWorker(_WorkerCore):
    """The asyncio twin of :class:`Worker`: coroutine handlers (``async def handler(ctx)``) on one loop.

    ``await worker.run()`` until :meth:`stop` (thread-safe) or SIGTERM; up to ``concurrency``
    handlers run as tasks at once, with a heartbeat task renewing their leases.
    """

    __doc__ = (__doc__ or "") + _DOC_ARGS

    def __init__(
        self,
        client: AsyncOrbitClient,
        namespace: str,
        queue: str,
        handlers: Mapping[str, Callable[[TaskContext], Awaitable[Any]]],
        *,
        concurrency: int = 1,
        lease_seconds: float = 30.0,
        poll_wait_seconds: float = 2.0,
        shutdown_timeout: float | None = None,
        worker_id: str | None = None,
        install_signal_handlers: bool = True,
        error_backoff_cap: float = 10.0,
        report_linger: float | None = DEFAULT_REPORT_LINGER,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        for name, fn in handlers.items():
            if not inspect.iscoroutinefunction(fn):
                raise OrbitUsageError(
                    f"handler {name!r} must be a coroutine function (async def) for AsyncWorker"
                )
        config = _Config(
            namespace,
            queue,
            handlers,
            concurrency=concurrency,
            lease_seconds=lease_seconds,
            poll_wait_seconds=poll_wait_seconds,
            shutdown_timeout=shutdown_timeout,
            worker_id=worker_id,
            error_backoff_cap=error_backoff_cap,
            report_linger=report_linger,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
        )
        super().__init__(config, install_signal_handlers=install_signal_handlers)
        self._client = client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False
        #: Tasks leased and not yet done (their reports included); ``_running``: handler slots taken.
        self._in_flight: set[asyncio.Task[None]] = set()
        self._running = 0
        self._slot_freed: asyncio.Event | None = None
        self._reports = AsyncReports(
            client,
            namespace,
            linger=report_linger,
            in_flight=lambda: len(self._in_flight),
            starting=lambda: self._starting,
        )

    def stop(self) -> None:
        """Ask :meth:`run` to stop: no new leases; running handlers finish. Thread-safe, idempotent."""
        self._stop_requested = True
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stopping.set)

    async def run(self) -> None:
        """Async twin of :meth:`Worker.run` (same behaviour and errors)."""
        config = self._config
        loop = asyncio.get_running_loop()
        self._loop, self._stopping, self._slot_freed = loop, asyncio.Event(), asyncio.Event()
        if self._stop_requested:
            self._stopping.set()
        signals = self._add_signal_handlers(loop)
        beater = asyncio.create_task(self._heartbeat_loop(), name="orbit-heartbeat")
        in_flight = self._in_flight
        logger.info("worker %s serving %s/%s", config.worker_id, config.namespace, config.queue)
        try:
            self._metrics_bound = config.serve_metrics()
            await self._lease_loop(in_flight)
        finally:
            if in_flight:
                _, pending = await asyncio.wait(in_flight, timeout=config.shutdown_timeout)
                if pending:
                    logger.warning(
                        "shutdown_timeout passed with %d handlers still running; cancelling them",
                        len(pending),
                    )
                    for pending_task in pending:
                        pending_task.cancel()
                    await asyncio.wait(pending)
            beater.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beater
            for sig in signals:
                loop.remove_signal_handler(sig)
            self._stop_requested = False
            self._release_metrics()
            logger.info("worker %s stopped", config.worker_id)

    def _add_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> list[signal.Signals]:
        if not self._install_signal_handlers or threading.current_thread() is not threading.main_thread():
            return []
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (NotImplementedError, RuntimeError):  # e.g. Windows, or not the main thread
                continue
            installed.append(sig)
        return installed

    async def _lease_loop(self, in_flight: set[asyncio.Task[None]]) -> None:
        config, stopping = self._config, self._stopping
        assert stopping is not None
        failures = 0
        while not stopping.is_set():
            free = config.concurrency - self._running
            if free <= 0:
                assert self._slot_freed is not None
                self._slot_freed.clear()
                stop_wait = asyncio.ensure_future(stopping.wait())
                slot_wait = asyncio.ensure_future(self._slot_freed.wait())
                await asyncio.wait({slot_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                slot_wait.cancel()
                if config.report_linger and self._running:
                    # Handlers that finish together free their slots one after the other: lease them together.
                    await asyncio.sleep(config.report_linger)
                continue
            try:
                grants = await self._client.lease_tasks(
                    config.namespace, config.queue, **self._lease_arguments(free)
                )
            except OrbitError as exc:
                failures += 1
                delay = self._lease_failed(exc, failures)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay)
                continue
            failures = 0
            self._starting += self._leased(grants)
            self._running += len(grants)
            for grant in grants:
                task = asyncio.create_task(self._execute(grant), name=f"orbit-task-{grant.task.id}")
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)

    async def _execute(self, grant: LeaseGrant) -> None:
        held = True

        def free_slot() -> None:
            nonlocal held
            if held:
                held = False
                self._running -= 1
                if self._slot_freed is not None:
                    self._slot_freed.set()

        try:
            if _tracing.AVAILABLE:
                with _tracing.use_span(_tracing.run_span(grant, self._config.worker_id)):
                    await self._run_one(grant, free_slot)
            else:
                await self._run_one(grant, free_slot)
        except Exception:
            logger.exception("unexpected error while running task %s", grant.task.id)
        finally:
            free_slot()
            self._active.pop(grant.attempt.id, None)

    async def _run_one(self, grant: LeaseGrant, free_slot: Callable[[], None]) -> None:
        config, reports = self._config, self._reports
        task, attempt = grant.task, grant.attempt
        handler = config.handlers.get(task.handler)
        if handler is None:
            error = self._unknown_handler_error(grant)
            free_slot()
            await self._report(grant, lambda: reports.fail(attempt, error))
            return
        try:
            await reports.start(attempt)
        except OrbitError as exc:
            logger.warning("could not start task %s attempt %d: %s", task.id, attempt.generation, exc)
            return
        finally:
            self._starting -= 1
        active = self._active[attempt.id] = self._running_attempt(grant)
        began = time.monotonic()
        try:
            result = await handler(active.ctx)
        except Exception as exc:
            self._handler_ran(task.handler, began)
            free_slot()
            error = self._handler_failed(grant, exc)
            await self._report(grant, lambda: reports.fail(attempt, error))
            return
        self._handler_ran(task.handler, began)
        free_slot()
        try:
            await self._report(grant, lambda: reports.complete(attempt, result))
        except OrbitUsageError as exc:  # the result is not JSON
            error = self._invalid_result(grant, exc)
            await self._report(grant, lambda: reports.fail(attempt, error))

    async def _report(self, grant: LeaseGrant, call: Callable[[], Awaitable[AttemptState]]) -> None:
        give_up = self._report_give_up_at()
        failures = 0
        while True:
            try:
                state = await call()
            except OrbitUsageError:  # nothing was sent (e.g. a result that is not JSON): the caller decides
                raise
            except OrbitError as exc:
                failures += 1
                delay = self._report_failed(grant, exc, failures, give_up)
                if delay is None:
                    return
                await asyncio.sleep(delay)
            else:
                self._reported(state)
                return

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_tick)
            due = self._due_heartbeats()
            if not due:
                continue
            outcomes = await self._reports.heartbeats([active.grant.attempt for active in due])
            for active, outcome in zip(due, outcomes, strict=True):
                self._heartbeat_answered(active, outcome, self._forget)

    def _forget(self, attempt_id: str) -> bool:
        return self._active.pop(attempt_id, None) is not None
