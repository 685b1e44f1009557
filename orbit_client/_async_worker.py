"""The asyncio worker: :class:`AsyncWorker`, the twin of :class:`~orbit_client.Worker` (pipelined alike).

One event loop: a lease task keeps the next lease request outstanding; ``concurrency`` slot
tasks each take the next grant in hand and run its coroutine handler; each outcome is reported
from a task of its own (the slot moves on at once); a heartbeat task renews the running attempts
and the grants waiting past a quarter of their lease (:mod:`._pipeline`). Its rules are shared
with :class:`Worker` in :mod:`._worker`.
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
from orbit_client._attempt_models import AttemptState, BatchLease, LeaseGrant
from orbit_client._client import AsyncOrbitClient
from orbit_client._exceptions import LeaseLostError, NotFoundError, OrbitError, OrbitUsageError
from orbit_client._pipeline import Held, Pipeline
from orbit_client._reports import AsyncReports
from orbit_client._worker import (
    _DOC_ARGS,
    DEFAULT_REPORT_LINGER,
    TaskContext,
    _Active,
    _Config,
    _WorkerCore,
    logger,
)

__all__ = ["AsyncWorker"]


class AsyncWorker(_WorkerCore):
    """The asyncio twin of :class:`Worker`: coroutine handlers (``async def handler(ctx)``) on one loop.

    ``await worker.run()`` until :meth:`stop` (thread-safe) or SIGTERM; up to ``concurrency``
    handlers run as tasks at once, with a heartbeat task renewing their leases. Pipelined exactly
    as :class:`Worker` is (lease-and-start, report-and-lease, a bounded prefetch).
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
        prefetch: int | None = None,
        lease_and_start: bool = True,
    ) -> None:
        for name, fn in handlers.items():
            if not inspect.iscoroutinefunction(fn):
                raise OrbitUsageError(
                    f"handler {name!r} must be a coroutine function (async def) for AsyncWorker"
                )
        config = _Config(
            namespace, queue, handlers, concurrency=concurrency, lease_seconds=lease_seconds,
            poll_wait_seconds=poll_wait_seconds, shutdown_timeout=shutdown_timeout, worker_id=worker_id,
            error_backoff_cap=error_backoff_cap, report_linger=report_linger, metrics_port=metrics_port,
            metrics_host=metrics_host, prefetch=prefetch, lease_and_start=lease_and_start,
        )  # fmt: skip
        super().__init__(config, install_signal_handlers=install_signal_handlers)
        self._client = client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False
        self._changed: asyncio.Event | None = None
        self._pipe = Pipeline(config.concurrency, config.lease_seconds, config.prefetch_cap)
        self._reporting_tasks: set[asyncio.Task[None]] = set()
        self._start_on_lease = False
        self._riding = False
        #: Running mean of report batches' round trips, in seconds (``None``: none answered yet).
        self._report_rtt: float | None = None
        self._reports = self._new_reports(None)

    def _new_reports(self, body_limit: int | None) -> AsyncReports:
        return AsyncReports(
            self._client, self._config.namespace, linger=self._config.report_linger,
            in_flight=lambda: self._pipe.running + self._pipe.reporting, starting=self._may_start,
            rider=self if self._riding else None, body_limit=body_limit, busy=self._may_report,
        )  # fmt: skip

    def stop(self) -> None:
        """Ask :meth:`run` to stop: no new leases; running handlers and grants in hand finish. Thread-safe, idempotent."""
        self._stop_requested = True
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stop_now)

    def _stop_now(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        self._pulse()

    def _pulse(self) -> None:
        """Wake every task waiting for a change of what the worker holds."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            assert self._changed is not None
            await self._changed.wait()

    def _stopped(self) -> bool:
        return self._stopping is not None and self._stopping.is_set()

    async def run(self) -> None:
        """Async twin of :meth:`Worker.run` (same behaviour and errors).

        Cancelling the task that awaits it stops the worker as :meth:`stop` does, and at once
        abandons the outstanding lease request (a long poll of up to ``poll_wait_seconds``): grants
        it may have made lapse unstarted on the server. Running handlers and grants in hand still
        finish (within ``shutdown_timeout``), then ``run()`` raises :class:`asyncio.CancelledError`;
        cancelling it again while it waits for them cancels the handlers (their leases lapse).
        """
        config = self._config
        loop = asyncio.get_running_loop()
        self._loop, self._stopping, self._changed = loop, asyncio.Event(), asyncio.Event()
        if self._stop_requested:
            self._stopping.set()
        signals = self._add_signal_handlers(loop)
        tasks: list[asyncio.Task[None]] = []
        logger.info("worker %s serving %s/%s", config.worker_id, config.namespace, config.queue)
        try:
            self._metrics_bound = config.serve_metrics()
            if await self._learn_server():
                tasks.append(asyncio.create_task(self._heartbeat_loop(), name="orbit-heartbeat"))
                tasks += [
                    asyncio.create_task(self._slot(), name=f"orbit-slot-{n}")
                    for n in range(config.concurrency)
                ]
                await self._lease_loop()
        finally:
            self._stop_now()
            try:
                await self._drain(tasks[1:])
            finally:  # also when cancelled again while draining: no slot or heartbeat task is left behind
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
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

    async def _sleep_unless_stopped(self, delay: float) -> None:
        assert self._stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    async def _learn_server(self) -> bool:
        failures = 0
        while not self._stopped():
            try:
                features = await self._client.get_settings()
            except NotFoundError:
                features = None
            except OrbitError as exc:
                if not exc.retryable:
                    raise
                failures += 1
                delay = self._config.backoff(failures)
                logger.warning("could not read the server's settings (%s); retrying in %.2f s", exc, delay)
                await self._sleep_unless_stopped(delay)
                continue
            config = self._config
            self._start_on_lease = bool(features and features.lease_and_start and config.lease_and_start)
            self._riding = bool(features and features.report_and_lease and config.report_linger is not None)
            self._item_task_ids = bool(features and features.item_task_ids)
            self._reports = self._new_reports(features.max_body_bytes if features else None)
            return True
        return False

    # report-and-lease: the LeaseRider protocol of orbit_client._reports

    def ask(self, reports: int) -> BatchLease | None:
        config, pipe = self._config, self._pipe
        if pipe.asking or self._stopped() or not self._quick_reports() or self._drained:
            return None
        want = pipe.want(freeing=reports)
        if want <= 0:
            return None
        pipe.asking, pipe.asked = True, want
        return BatchLease(queue=config.queue, worker_id=config.worker_id, max_tasks=want,
                          lease_seconds=config.lease_seconds, start=self._start_on_lease)  # fmt: skip

    def _first_beat(self, held: Held) -> float:
        """When a starting grant's first heartbeat is due: a third of its lease after the lease
        began as this worker sees it (the request's send time), not after the handler's start:
        a lease-and-start grant had no start call to renew it."""
        config = self._config
        return min(time.monotonic() + config.heartbeat_interval, held.expires - 2 * config.heartbeat_interval)

    def timed(self, seconds: float) -> None:
        """A report batch took ``seconds`` (the running mean decides whether reports carry leases)."""
        self._report_rtt = seconds if self._report_rtt is None else 0.7 * self._report_rtt + 0.3 * seconds

    def got(self, ask: BatchLease, sent_at: float, grants: list[LeaseGrant] | None, error: object) -> None:
        if error is not None and not isinstance(error, BaseException):
            logger.warning("the lease carried by a report batch was refused: %s", error)
        self._took(grants or [], sent_at)

    def _took(self, grants: list[LeaseGrant], sent_at: float) -> None:
        """As :meth:`Worker._took`."""
        pipe = self._pipe
        try:
            self._drained = len(grants) < pipe.asked
            pipe.hold(grants, sent_at)
            self._starting += sum(
                grant.task.status != "RUNNING" and grant.task.handler in self._config.handlers
                for grant in grants
            )
        finally:
            pipe.asking, pipe.asked = False, 0
            self._pulse()
        if self._metrics is not None and grants:
            self._metrics.leased(len(grants))

    async def _lease_loop(self) -> None:
        config, pipe = self._config, self._pipe
        failures = 0
        while not self._stopped():
            await self._until(lambda: self._stopped() or not (
                pipe.asking or pipe.want() <= 0 or (pipe.reporting > 0 and self._lease_after_reports())
                or self._starts_first()
            ))  # fmt: skip
            if self._stopped():
                return
            want = pipe.want()
            pipe.asking, pipe.asked = True, want
            sent_at = time.monotonic()
            try:
                grants = await self._client.lease_tasks(
                    config.namespace, config.queue, worker_id=config.worker_id, max_tasks=want,
                    lease_seconds=config.lease_seconds, wait_seconds=config.poll_wait_seconds,
                    **({"start": True} if self._start_on_lease else {}),
                )  # fmt: skip
            except OrbitError as exc:
                self._took([], sent_at)
                failures += 1
                await self._sleep_unless_stopped(self._lease_failed(exc, failures))
                continue
            except (
                BaseException
            ) as exc:  # cancelled (the long poll is abandoned), a bug, an untranslated error
                self._lease_call_broke(exc, sent_at)
                raise
            failures = 0
            self._took(grants, sent_at)

    async def _drain(self, slots: list[asyncio.Task[None]]) -> None:
        pipe = self._pipe
        if not slots:
            pipe.waiting.clear()

        async def settled() -> None:
            await self._until(lambda: not pipe.held and not pipe.asking)

        try:
            await asyncio.wait_for(settled(), self._config.shutdown_timeout)
        except TimeoutError:
            logger.warning("shutdown_timeout passed with %d tasks still held; cancelling them", pipe.held)
            for task in list(self._reporting_tasks):
                task.cancel()

    async def _slot(self) -> None:
        pipe = self._pipe
        while True:
            await self._until(lambda: bool(pipe.waiting) or (self._stopped() and not pipe.asking))
            held, lapsed = pipe.next()
            for gone in lapsed:
                self._starting -= not gone.started and gone.grant.task.handler in self._config.handlers
                logger.warning(
                    "task %s attempt %d waited past its lease for a slot; not started (it lapses unstarted)",
                    gone.grant.task.id, gone.grant.attempt.generation,
                )  # fmt: skip
            if held is None:
                self._pulse()
                if lapsed:
                    continue
                return
            pipe.running += 1
            self._in_start += self._needs_start(held)
            self._pulse()  # the lease loop may go now, or once this start is answered (_starts_first)
            try:
                await self._execute(held)
            finally:
                if held.confirming:  # its start was never reached (an unexpected error)
                    self._in_start -= 1
                    held.confirming = False
                self._free(held)

    async def _execute(self, held: Held) -> None:
        grant = held.grant
        try:
            if _tracing.AVAILABLE:
                with _tracing.use_span(_tracing.run_span(grant, self._config.worker_id)):
                    await self._run_one(held)
            else:
                await self._run_one(held)
        except Exception:
            logger.exception("unexpected error while running task %s", grant.task.id)
            self._active.pop(grant.attempt.id, None)

    def _hand_off(self, grant: LeaseGrant, send: Callable[[], Awaitable[None]]) -> None:
        self._pipe.reporting += 1
        self._pipe.handing += 1

        async def report() -> None:
            self._pipe.handing -= 1  # joins its batch now, before its first await (Pipeline.may_report)
            try:
                await send()
            except Exception:
                logger.exception("unexpected error while reporting task %s", grant.task.id)
            finally:
                self._active.pop(grant.attempt.id, None)
                self._pipe.reporting -= 1
                self._pulse()

        task = asyncio.create_task(report(), name=f"orbit-report-{grant.task.id}")
        self._reporting_tasks.add(task)
        task.add_done_callback(self._reporting_tasks.discard)

    async def _run_one(self, held: Held) -> None:
        config, reports = self._config, self._reports
        grant = held.grant
        task, attempt = grant.task, grant.attempt
        handler = config.handlers.get(task.handler)
        if handler is None:
            error = self._unknown_handler_error(grant)
            self._hand_off(grant, lambda: self._report(grant, lambda: reports.fail(attempt, error)))
            return
        if not held.started:  # counted in _in_start by _slot (_needs_start)
            try:
                await reports.start(attempt, self._named_task(grant))
            except OrbitError as exc:
                logger.warning("could not start task %s attempt %d: %s", task.id, attempt.generation, exc)
                return
            finally:
                self._starting -= 1
                self._in_start -= held.confirming
                held.confirming = False
                self._pulse()  # a lease deferred behind this start may go (_starts_first)
                reports.wake()  # and a report waiting for it (_may_report)
        ctx = config.context(grant)
        self._active[attempt.id] = _Active(grant, ctx, self._first_beat(held))
        began = time.monotonic()
        try:
            result = await handler(ctx)
        except Exception as exc:
            self._ran(held, began)
            error = self._handler_failed(grant, exc)
            self._hand_off(grant, lambda: self._report(grant, lambda: reports.fail(attempt, error)))
            return
        self._ran(held, began)
        self._hand_off(grant, lambda: self._complete(grant, result))

    def _ran(self, held: Held, began: float) -> None:
        """As :meth:`Worker._ran`."""
        seconds = time.monotonic() - began
        active = self._active.get(held.grant.attempt.id)
        if active is not None:
            active.done = True
        self._free(held)
        self._pipe.observe(seconds)
        if self._metrics is not None:
            self._metrics.handler_ran(held.grant.task.handler, seconds)

    def _free(self, held: Held) -> None:
        if not held.freed:
            held.freed = True
            self._pipe.running -= 1
            self._pulse()

    async def _complete(self, grant: LeaseGrant, result: Any) -> None:
        reports, attempt = self._reports, grant.attempt
        try:
            await self._report(grant, lambda: reports.complete(attempt, result, self._named_task(grant)))
        except OrbitUsageError as exc:  # the result is not JSON
            error = self._invalid_result(grant, exc)
            await self._report(grant, lambda: reports.fail(attempt, error))

    async def _report(self, grant: LeaseGrant, call: Callable[[], Awaitable[AttemptState]]) -> None:
        """Async twin of :meth:`Worker._report`."""
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
        config = self._config
        while True:
            await asyncio.sleep(self._heartbeat_tick)
            now = time.monotonic()
            due = [a for a in self._active.values() if a.next_beat <= now]
            overdue = self._pipe.overdue(now)
            if not due and not overdue:
                continue
            sent_at = time.monotonic()
            outcomes = await self._reports.heartbeats(
                [active.grant.attempt for active in due] + [held.grant.attempt for held in overdue]
            )
            for held, outcome in zip(overdue, outcomes[len(due) :], strict=True):
                if isinstance(outcome, LeaseLostError):
                    with contextlib.suppress(ValueError):
                        self._pipe.waiting.remove(held)
                        self._starting -= not held.started and held.grant.task.handler in config.handlers
                elif not isinstance(outcome, OrbitError):
                    held.renewed(sent_at, config.lease_seconds)
                    held.started = held.started or outcome.status == "RUNNING"
            for active, outcome in zip(due, outcomes[: len(due)], strict=True):
                self._heartbeat_answered(active, outcome, self._forget)

    def _forget(self, attempt_id: str) -> bool:
        return self._active.pop(attempt_id, None) is not None
