"""Workers: lease tasks from a queue, run their handlers, heartbeat, report the outcome.

:class:`Worker` runs handlers in a thread pool; :class:`AsyncWorker` runs coroutine handlers
on an asyncio loop. Both share the non-I/O parts here (context, error classification,
configuration) and follow the long-running-loop habits of the house style: ``run()`` /
``stop()``, a poll interval, a graceful-shutdown timeout and an ``install_signal_handlers``
switch.

What the server guarantees and what a handler must still do (§3 of the reliability model):
each grant carries a ``generation`` (fencing number) that grows with every attempt of the
task. A stale attempt cannot change the task, but it can still touch the outside world, so a
handler should pass ``ctx.generation`` on to the resources it writes (and they should refuse
writes from a lower generation than one they have seen), and stop when ``ctx.lease_lost``
or ``ctx.cancel_requested`` becomes true.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import random
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from orbit_client import _tracing
from orbit_client._attempt_models import AttemptError, AttemptState, LeaseGrant
from orbit_client._client import AsyncOrbitClient, OrbitClient
from orbit_client._exceptions import LeaseLostError, OrbitError, OrbitUsageError
from orbit_client._metrics import WorkerMetrics, release_server, serve
from orbit_client._reports import AsyncReports, Reports
from orbit_client._task_models import Task

__all__ = ["AsyncWorker", "RetryableError", "TaskCancelled", "TaskContext", "Worker"]

logger = logging.getLogger("orbit_client.worker")

#: Longest error message reported to the server, in characters.
_MESSAGE_MAX = 10_000
#: Most tasks one lease call may ask for (``LeaseRequest.max_tasks``).
_MAX_LEASE = 100
#: Default ``report_linger`` of :class:`AsyncWorker`, in seconds (its handlers share one event loop).
DEFAULT_REPORT_LINGER = 0.003
#: Default ``report_linger`` of :class:`Worker`, in seconds: its pool threads, woken together, can wait
#: several milliseconds each for a core on a loaded machine, and a wait shorter than that splits the
#: batches (a no-op drain at concurrency 4 beside two busy processes: 0.003 gave 1.0-1.4 HTTP calls per
#: task, 0.010 gave 0.75, the unsplit figure, and a third less server CPU per task).
DEFAULT_THREAD_REPORT_LINGER = 0.010


class RetryableError(Exception):
    """Raise it from a handler to report a failure that is safe to retry.

    The attempt is reported with ``retryable=True``: the server schedules another attempt
    after the task's backoff, while its attempt budget and deadline allow. Any exception
    with a true ``retryable`` attribute is treated the same way; every other exception is
    reported as not retryable, and the task fails.
    """


class TaskCancelled(Exception):
    """Raise it from a handler that stopped because cancellation was requested.

    The attempt is reported as failed with error type ``"cancelled"``; the server then
    marks the task ``CANCELLED`` (§2 of the reliability model). :meth:`TaskContext.raise_if_cancelled`
    raises it.
    """


@dataclass(eq=False)
class TaskContext:
    """What a handler gets: the task, its attempt, and the signals to stop.

    Attributes:
        task: the task as leased (``task.params`` holds the parameters).
        namespace: the namespace the worker serves.
        attempt_id: the attempt's id.
        generation: the fencing number of this attempt (1, 2, ... per task). Pass it to the
            resources the handler writes, so they can refuse a stale attempt's writes.
        worker_id: the id this worker leases under.
    """

    task: Task
    namespace: str
    attempt_id: str
    generation: int
    worker_id: str
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _lost: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def params(self) -> Any:
        """The task's parameters (any JSON value)."""
        return self.task.params

    @property
    def cancel_requested(self) -> bool:
        """``True`` once a heartbeat reported that cancellation of the task was requested."""
        return self._cancel.is_set()

    @property
    def lease_lost(self) -> bool:
        """``True`` once the server refused a heartbeat: another attempt may own the task now."""
        return self._lost.is_set()

    def should_stop(self) -> bool:
        """``True`` when the handler should stop: cancellation requested or lease lost."""
        return self._cancel.is_set() or self._lost.is_set()

    def raise_if_cancelled(self) -> None:
        """Raise :class:`TaskCancelled` if cancellation was requested; otherwise do nothing."""
        if self._cancel.is_set():
            raise TaskCancelled("cancellation was requested")

    def wait_for_stop(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until the handler should stop; return :meth:`should_stop`.

        Use it instead of ``time.sleep`` in a sync handler that waits.
        """
        deadline = time.monotonic() + timeout
        while not self.should_stop():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cancel.wait(min(remaining, 0.05))
        return self.should_stop()


def _error_for(exc: BaseException) -> AttemptError:
    """How a handler's exception is reported: type, message, whether a retry is safe, and its
    traceback (the end of it past ``TRACEBACK_MAX_LENGTH`` characters)."""
    if isinstance(exc, TaskCancelled):
        return AttemptError(type="cancelled", message=str(exc)[:_MESSAGE_MAX], retryable=False)
    retryable = isinstance(exc, RetryableError) or getattr(exc, "retryable", False) is True
    text = AttemptError.bounded_traceback("".join(traceback.format_exception(exc)))
    return AttemptError(
        type=type(exc).__name__, message=str(exc)[:_MESSAGE_MAX], retryable=retryable, traceback=text
    )


def _unknown_handler(worker_id: str, handler: str, handlers: Mapping[str, object]) -> AttemptError:
    """The error of a task whose handler this worker does not have; it names the ones it has."""
    known = ", ".join(repr(name) for name in sorted(handlers)) or "none"
    message = f"worker {worker_id} has no handler {handler!r}; its handlers: {known}"
    return AttemptError(type="unknown_handler", message=message[:_MESSAGE_MAX], retryable=False)


def _log_failure(
    task: Task, attempt_id: str, generation: int, exc: BaseException, error: AttemptError
) -> None:
    """Every failed attempt at WARNING with its ids and traceback; a cancelled one at INFO."""
    if error.type == "cancelled":
        logger.info("task %s attempt %s (generation %d) stopped: cancelled", task.id, attempt_id, generation)
        return
    logger.warning(
        "task %s (%s) attempt %s (generation %d) failed: %s: %s",
        task.id, task.handler, attempt_id, generation, error.type, error.message,
        exc_info=exc,
    )  # fmt: skip


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class _Config:
    """Arguments shared by both workers, checked once (keyword-only, STYLE habit 7)."""

    def __init__(
        self,
        namespace: str,
        queue: str,
        handlers: Mapping[str, Callable[..., Any]],
        *,
        concurrency: int,
        lease_seconds: float,
        poll_wait_seconds: float,
        shutdown_timeout: float | None,
        worker_id: str | None,
        error_backoff_cap: float,
        report_linger: float | None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        if not handlers:
            raise OrbitUsageError("handlers must map at least one handler name to a function")
        if concurrency < 1:
            raise OrbitUsageError(f"concurrency must be at least 1, not {concurrency!r}")
        if not 0.1 <= lease_seconds <= 3600:
            raise OrbitUsageError(f"lease_seconds must be between 0.1 and 3600, not {lease_seconds!r}")
        if not 0 <= poll_wait_seconds <= 60:
            raise OrbitUsageError(f"poll_wait_seconds must be between 0 and 60, not {poll_wait_seconds!r}")
        if shutdown_timeout is not None and shutdown_timeout < 0:
            raise OrbitUsageError("shutdown_timeout is in seconds and cannot be negative")
        if report_linger is not None and not 0 <= report_linger <= 1:
            raise OrbitUsageError(
                f"report_linger must be None or between 0 and 1 second, not {report_linger!r}"
            )
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise OrbitUsageError(f"metrics_port must be None or 0-65535, not {metrics_port!r}")
        self.namespace = namespace
        self.queue = queue
        self.handlers = dict(handlers)
        self.concurrency = concurrency
        self.lease_seconds = float(lease_seconds)
        #: Heartbeat every third of the lease (DESIGN §4).
        self.heartbeat_interval = self.lease_seconds / 3
        self.poll_wait_seconds = float(poll_wait_seconds)
        self.shutdown_timeout = shutdown_timeout
        self.worker_id = worker_id or _default_worker_id()
        self.error_backoff_cap = error_backoff_cap
        self.report_linger = report_linger
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        #: The worker's counters, when it serves metrics (prometheus-client imported only then).
        self.metrics = WorkerMetrics(namespace, queue) if metrics_port is not None else None

    def serve_metrics(self) -> int | None:
        """Start (or join) the metrics server of ``metrics_port``; the port bound, or ``None``."""
        if self.metrics_port is None:
            return None
        port = serve(self.metrics_host, self.metrics_port)
        logger.info("worker %s metrics at http://%s:%d/metrics", self.worker_id, self.metrics_host, port)
        return port

    def backoff(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failed lease calls (full jitter, 0.2 s base)."""
        return random.uniform(0, min(self.error_backoff_cap, 0.2 * 2.0 ** (failures - 1)))

    def context(self, grant: LeaseGrant) -> TaskContext:
        return TaskContext(
            task=grant.task,
            namespace=self.namespace,
            attempt_id=grant.attempt.id,
            generation=grant.attempt.generation,
            worker_id=self.worker_id,
        )


@dataclass(eq=False)
class _Active:
    grant: LeaseGrant
    ctx: TaskContext
    next_beat: float


_DOC_ARGS = """
    Args:
        client: the client to talk to the server through (a ``work`` key); not closed by the worker.
        namespace: the namespace of the queue.
        queue: the queue to lease tasks from.
        handlers: handler name → function; a task whose ``handler`` is not here fails
            (error type ``unknown_handler``, not retryable) without being started.
        concurrency: most handlers running at the same time. Default 1. A task's slot is free
            again once its handler returns, while its report is still on its way.
        lease_seconds: lease asked for each task, in seconds; the worker heartbeats every
            third of it while the handler runs. Default 30.
        poll_wait_seconds: how long one lease call long-polls when nothing is due, in seconds;
            also the longest :meth:`stop` waits for that call. Default 2.
        shutdown_timeout: after :meth:`stop`, how long ``run()`` waits for running handlers, in
            seconds; ``None`` (the default) waits for all of them. Handlers still running after it
            are left behind without heartbeats, so their leases lapse.
        worker_id: the id leases are taken under; ``None`` means ``host:pid:random``.
        install_signal_handlers: when ``True`` (the default) and run from the main thread,
            SIGTERM and SIGINT call :meth:`stop` for the duration of ``run()``.
        error_backoff_cap: longest pause after failed lease calls, in seconds (full jitter from
            0.2 s, doubling). Default 10.
        report_linger: how long a ``start``, ``complete`` or ``fail`` report may wait for other
            reports of the same kind to share one batched call (``POST .../attempts/start`` etc.),
            in seconds (0-1); it waits less once every task in flight has reported. Heartbeats due
            together always share one call. Default 0.010 for :class:`Worker` (pool threads may
            wait milliseconds for a core on a busy machine), 0.003 for :class:`AsyncWorker`. ``0``
            batches only what is waiting anyway; ``None`` sends every report as its own single call
            (needed for no server, kept for comparison: a server without the batched calls is
            detected, and the worker falls back to single calls by itself).
        metrics_port: serve Prometheus metrics at ``http://metrics_host:metrics_port/metrics``
            while ``run()`` runs (``0``: a free port, logged; :attr:`metrics_port` tells which).
            Workers of one process share a port and one registry, labelled by namespace and
            queue. ``None`` (the default) counts nothing. Needs ``pip install 'orbit[metrics]'``
            (prometheus-client); README "Operations".
        metrics_host: address the metrics server listens on. Default ``"127.0.0.1"``.

    Raises:
        OrbitUsageError: an argument is out of range, or ``metrics_port`` is set and
            prometheus-client is not installed.
"""


class Worker:
    """Run handlers for a queue's tasks in a thread pool, until :meth:`stop` (or SIGTERM).

    Each task: lease → ``start`` → ``handler(ctx)`` in a pool thread, with heartbeats every
    third of the lease from a separate thread → ``complete`` with the returned JSON value, or
    ``fail`` when the handler raised (``retryable`` per :class:`RetryableError`; type
    ``"cancelled"`` per :class:`TaskCancelled`). Reports are retried by the client: the server
    answers a repeated report with the same body alike.

    One lease call asks for as many tasks as there are free slots. The ``start``, ``complete``
    and ``fail`` reports made within ``report_linger`` of each other travel as one batched call
    per kind, and the heartbeats due together as one (README "Workers", "Batched attempt calls"); each
    report still gets its own outcome, so a ``lease_lost`` reaches its own task only. The start
    is always confirmed by its own report after the lease: a lease whose answer is lost leaves
    its tasks ``LEASED`` until their leases lapse, never ``RUNNING``.
    """

    __doc__ = (__doc__ or "") + _DOC_ARGS

    def __init__(
        self,
        client: OrbitClient,
        namespace: str,
        queue: str,
        handlers: Mapping[str, Callable[[TaskContext], Any]],
        *,
        concurrency: int = 1,
        lease_seconds: float = 30.0,
        poll_wait_seconds: float = 2.0,
        shutdown_timeout: float | None = None,
        worker_id: str | None = None,
        install_signal_handlers: bool = True,
        error_backoff_cap: float = 10.0,
        report_linger: float | None = DEFAULT_THREAD_REPORT_LINGER,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        for name, fn in handlers.items():
            if inspect.iscoroutinefunction(fn):
                raise OrbitUsageError(f"handler {name!r} is a coroutine function; use AsyncWorker for it")
        self._client = client
        self._config = _Config(
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
        self._metrics = self._config.metrics
        self._metrics_bound: int | None = None
        self._install_signal_handlers = install_signal_handlers
        self._stopping = threading.Event()
        self._lock = threading.Condition()
        self._active: dict[str, _Active] = {}
        #: Tasks leased and not yet done (their reports included); ``_running``: handler slots taken.
        self._in_flight = 0
        self._running = 0
        #: Leased tasks with a handler whose start is not answered yet (the start batch waits for them).
        self._starting = 0
        self._reports = Reports(
            client,
            namespace,
            linger=report_linger,
            in_flight=lambda: self._in_flight,
            starting=lambda: self._starting,
        )

    @property
    def worker_id(self) -> str:
        """The id this worker leases under."""
        return self._config.worker_id

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on while :meth:`run` runs (else the one asked for; ``None``: none)."""
        return self._metrics_bound if self._metrics_bound is not None else self._config.metrics_port

    def _handler_ran(self, handler: str, began: float) -> None:
        if self._metrics is not None:
            self._metrics.handler_ran(handler, time.monotonic() - began)

    def __repr__(self) -> str:
        c = self._config
        return f"Worker(namespace={c.namespace!r}, queue={c.queue!r}, worker_id={c.worker_id!r})"

    def stop(self) -> None:
        """Ask :meth:`run` to stop: no new leases; running handlers finish (thread-safe, idempotent)."""
        if not self._stopping.is_set():
            logger.info("worker %s stopping", self._config.worker_id)
        self._stopping.set()
        with self._lock:
            self._lock.notify_all()

    def run(self) -> None:
        """Lease and run tasks until :meth:`stop`; then wait for running handlers and return.

        Raises:
            OrbitAPIError: a lease call was refused for a reason retrying cannot fix (401, 403,
                404: wrong key, role, namespace or queue). Retryable failures are retried with
                backoff instead.
        """
        config = self._config
        self._stopping.clear()
        beat_stop = threading.Event()
        beater = threading.Thread(
            target=self._heartbeat_loop, args=(beat_stop,), name="orbit-heartbeat", daemon=True
        )
        beater.start()
        # A task frees its slot when its handler returns, before its report is answered, so the next
        # task can be leased meanwhile: up to twice as many threads as slots, half of them reporting.
        pool = ThreadPoolExecutor(max_workers=2 * config.concurrency, thread_name_prefix="orbit-handler")
        logger.info("worker %s serving %s/%s", config.worker_id, config.namespace, config.queue)
        try:
            self._metrics_bound = config.serve_metrics()
            with self._signals():
                self._lease_loop(pool)
        finally:
            pool.shutdown(wait=False)
            self._drain()
            beat_stop.set()
            beater.join(timeout=5)
            self._release_metrics()
            logger.info("worker %s stopped", config.worker_id)

    def _release_metrics(self) -> None:
        if self._metrics_bound is not None:
            release_server(self._config.metrics_host, self._metrics_bound)
            self._metrics_bound = None

    # --- internals -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if not self._install_signal_handlers or threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            logger.info("received %s", signal.Signals(signum).name)
            self.stop()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _lease_loop(self, pool: ThreadPoolExecutor) -> None:
        config = self._config
        failures = 0
        while not self._stopping.is_set():
            with self._lock:
                while self._running >= config.concurrency and not self._stopping.is_set():
                    self._lock.wait()
                # Handlers that finish together free their slots one after the other: lease them together.
                linger = config.report_linger or 0.0
                until = time.monotonic() + linger
                while 0 < self._running < config.concurrency and not self._stopping.is_set():
                    left = until - time.monotonic()
                    if left <= 0 or not self._lock.wait(left):
                        break
                free = config.concurrency - self._running
            if self._stopping.is_set():
                return
            try:
                grants = self._client.lease_tasks(
                    config.namespace,
                    config.queue,
                    worker_id=config.worker_id,
                    max_tasks=min(free, _MAX_LEASE),
                    lease_seconds=config.lease_seconds,
                    wait_seconds=config.poll_wait_seconds,
                )
            except OrbitError as exc:
                if not exc.retryable:
                    raise
                failures += 1
                delay = config.backoff(failures)
                logger.warning("lease call failed (%s); retrying in %.2f s", type(exc).__name__, delay)
                self._stopping.wait(delay)
                continue
            failures = 0
            if self._metrics is not None:
                self._metrics.leased(len(grants))
            with self._lock:  # all at once: a report waits for the others of its batch (Reports)
                self._in_flight += len(grants)
                self._running += len(grants)
                self._starting += sum(grant.task.handler in config.handlers for grant in grants)
            for grant in grants:
                pool.submit(self._execute, grant)

    def _drain(self) -> None:
        timeout = self._config.shutdown_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    logger.warning(
                        "shutdown_timeout passed with %d handlers still running; their leases will lapse",
                        self._in_flight,
                    )
                    return
                self._lock.wait(remaining)

    def _execute(self, grant: LeaseGrant) -> None:
        held = True

        def free_slot() -> None:
            nonlocal held
            if held:
                held = False
                with self._lock:
                    self._running -= 1
                    self._lock.notify_all()

        try:
            if _tracing.AVAILABLE:
                with _tracing.use_span(_tracing.run_span(grant, self._config.worker_id)):
                    self._run_one(grant, free_slot)
            else:
                self._run_one(grant, free_slot)
        except Exception:  # never let one task kill the pool thread silently
            logger.exception("unexpected error while running task %s", grant.task.id)
        finally:
            free_slot()
            with self._lock:
                self._active.pop(grant.attempt.id, None)
                self._in_flight -= 1
                self._lock.notify_all()

    def _run_one(self, grant: LeaseGrant, free_slot: Callable[[], None]) -> None:
        config, reports = self._config, self._reports
        task, attempt = grant.task, grant.attempt
        handler = config.handlers.get(task.handler)
        if handler is None:
            error = _unknown_handler(config.worker_id, task.handler, config.handlers)
            logger.warning(
                "task %s attempt %s (generation %d) failed: %s",
                task.id,
                attempt.id,
                attempt.generation,
                error.message,
            )
            free_slot()
            self._report(grant, lambda: reports.fail(attempt, error))
            return
        try:
            reports.start(attempt)
        except OrbitError as exc:
            logger.warning("could not start task %s attempt %d: %s", task.id, attempt.generation, exc)
            return
        finally:
            with self._lock:
                self._starting -= 1
        ctx = config.context(grant)
        with self._lock:
            self._active[attempt.id] = _Active(grant, ctx, time.monotonic() + config.heartbeat_interval)
        logger.debug("running task %s (%s) attempt %d", task.id, task.handler, attempt.generation)
        began = time.monotonic()
        try:
            result = handler(ctx)
        except Exception as exc:
            self._handler_ran(task.handler, began)
            free_slot()
            error = _error_for(exc)
            if _tracing.AVAILABLE:
                _tracing.handler_failed(exc, error.type)
            _log_failure(task, attempt.id, attempt.generation, exc, error)
            self._report(grant, lambda: reports.fail(attempt, error))
            return
        self._handler_ran(task.handler, began)
        free_slot()
        try:
            self._report(grant, lambda: reports.complete(attempt, result))
        except OrbitUsageError as exc:  # the result is not JSON
            error = AttemptError(type="invalid_result", message=str(exc)[:_MESSAGE_MAX], retryable=False)
            logger.warning(
                "task %s attempt %s (generation %d) failed: invalid_result: %s",
                task.id,
                attempt.id,
                attempt.generation,
                error.message,
            )
            self._report(grant, lambda: reports.fail(attempt, error))

    def _report(self, grant: LeaseGrant, call: Callable[[], AttemptState]) -> None:
        """Send a complete/fail report; keep retrying retryable failures for up to one lease."""
        give_up = time.monotonic() + self._config.lease_seconds
        failures = 0
        while True:
            try:
                state = call()
                if self._metrics is not None:
                    self._metrics.reported(state.task_status)
                return
            except OrbitUsageError:  # nothing was sent (e.g. a result that is not JSON): the caller decides
                raise
            except LeaseLostError as exc:
                if self._metrics is not None:
                    self._metrics.lease_lost()
                logger.warning(
                    "task %s attempt %d lost its lease before reporting (evidence kept: %s)",
                    grant.task.id,
                    grant.attempt.generation,
                    exc.evidence_recorded,
                )
                return
            except OrbitError as exc:
                failures += 1
                if not exc.retryable or time.monotonic() >= give_up:
                    logger.error(
                        "could not report task %s attempt %d: %s",
                        grant.task.id,
                        grant.attempt.generation,
                        exc,
                    )
                    return
                time.sleep(self._config.backoff(failures))

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        config = self._config
        tick = min(0.1, config.heartbeat_interval / 4)
        while not stop.wait(tick):
            now = time.monotonic()
            with self._lock:
                due = [a for a in self._active.values() if a.next_beat <= now]
            if not due:
                continue
            outcomes = self._reports.heartbeats([active.grant.attempt for active in due])
            for active, outcome in zip(due, outcomes, strict=True):
                attempt = active.grant.attempt
                try:
                    if isinstance(outcome, OrbitError):
                        raise outcome
                    state = outcome
                except LeaseLostError:
                    with self._lock:
                        still_running = self._active.pop(attempt.id, None) is not None
                    if still_running:  # not merely finished while the heartbeat was on its way
                        if self._metrics is not None:
                            self._metrics.lease_lost()
                        logger.warning(
                            "task %s attempt %d lost its lease", active.grant.task.id, attempt.generation
                        )
                        active.ctx._lost.set()
                    continue
                except OrbitError as exc:
                    if self._metrics is not None:
                        self._metrics.heartbeat_failed()
                    logger.warning("heartbeat of task %s failed (%s); retrying", active.grant.task.id, exc)
                    active.next_beat = time.monotonic() + min(1.0, config.heartbeat_interval / 2)
                    continue
                active.next_beat = time.monotonic() + config.heartbeat_interval
                if state.cancel_requested and not active.ctx._cancel.is_set():
                    logger.info("cancellation requested for task %s", active.grant.task.id)
                    active.ctx._cancel.set()


class AsyncWorker:
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
        self._client = client
        self._config = _Config(
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
        self._metrics = self._config.metrics
        self._metrics_bound: int | None = None
        self._install_signal_handlers = install_signal_handlers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False
        self._active: dict[str, _Active] = {}
        #: Tasks leased and not yet done (their reports included); ``_running``: handler slots taken.
        self._in_flight: set[asyncio.Task[None]] = set()
        self._running = 0
        self._slot_freed: asyncio.Event | None = None
        #: Leased tasks with a handler whose start is not answered yet (the start batch waits for them).
        self._starting = 0
        self._reports = AsyncReports(
            client,
            namespace,
            linger=report_linger,
            in_flight=lambda: len(self._in_flight),
            starting=lambda: self._starting,
        )

    @property
    def worker_id(self) -> str:
        """The id this worker leases under."""
        return self._config.worker_id

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on while :meth:`run` runs (else the one asked for; ``None``: none)."""
        return self._metrics_bound if self._metrics_bound is not None else self._config.metrics_port

    def _handler_ran(self, handler: str, began: float) -> None:
        if self._metrics is not None:
            self._metrics.handler_ran(handler, time.monotonic() - began)

    def __repr__(self) -> str:
        c = self._config
        return f"AsyncWorker(namespace={c.namespace!r}, queue={c.queue!r}, worker_id={c.worker_id!r})"

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
            if self._metrics_bound is not None:
                release_server(config.metrics_host, self._metrics_bound)
                self._metrics_bound = None
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
                    config.namespace,
                    config.queue,
                    worker_id=config.worker_id,
                    max_tasks=min(free, _MAX_LEASE),
                    lease_seconds=config.lease_seconds,
                    wait_seconds=config.poll_wait_seconds,
                )
            except OrbitError as exc:
                if not exc.retryable:
                    raise
                failures += 1
                delay = config.backoff(failures)
                logger.warning("lease call failed (%s); retrying in %.2f s", type(exc).__name__, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay)
                continue
            failures = 0
            if self._metrics is not None:
                self._metrics.leased(len(grants))
            self._running += len(grants)
            self._starting += sum(grant.task.handler in config.handlers for grant in grants)
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
        attempt_id = attempt.id
        if handler is None:
            error = _unknown_handler(config.worker_id, task.handler, config.handlers)
            logger.warning(
                "task %s attempt %s (generation %d) failed: %s",
                task.id,
                attempt_id,
                attempt.generation,
                error.message,
            )
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
        ctx = config.context(grant)
        self._active[attempt_id] = _Active(grant, ctx, time.monotonic() + config.heartbeat_interval)
        began = time.monotonic()
        try:
            result = await handler(ctx)
        except Exception as exc:
            self._handler_ran(task.handler, began)
            free_slot()
            error = _error_for(exc)
            if _tracing.AVAILABLE:
                _tracing.handler_failed(exc, error.type)
            _log_failure(task, attempt.id, attempt.generation, exc, error)
            await self._report(grant, lambda: reports.fail(attempt, error))
            return
        self._handler_ran(task.handler, began)
        free_slot()
        try:
            await self._report(grant, lambda: reports.complete(attempt, result))
        except OrbitUsageError as exc:
            error = AttemptError(type="invalid_result", message=str(exc)[:_MESSAGE_MAX], retryable=False)
            logger.warning(
                "task %s attempt %s (generation %d) failed: invalid_result: %s",
                task.id,
                attempt.id,
                attempt.generation,
                error.message,
            )
            await self._report(grant, lambda: reports.fail(attempt, error))

    async def _report(self, grant: LeaseGrant, call: Callable[[], Awaitable[AttemptState]]) -> None:
        give_up = time.monotonic() + self._config.lease_seconds
        failures = 0
        while True:
            try:
                state = await call()
                if self._metrics is not None:
                    self._metrics.reported(state.task_status)
                return
            except OrbitUsageError:  # nothing was sent (e.g. a result that is not JSON): the caller decides
                raise
            except LeaseLostError as exc:
                if self._metrics is not None:
                    self._metrics.lease_lost()
                logger.warning(
                    "task %s attempt %d lost its lease before reporting (evidence kept: %s)",
                    grant.task.id,
                    grant.attempt.generation,
                    exc.evidence_recorded,
                )
                return
            except OrbitError as exc:
                failures += 1
                if not exc.retryable or time.monotonic() >= give_up:
                    logger.error(
                        "could not report task %s attempt %d: %s",
                        grant.task.id,
                        grant.attempt.generation,
                        exc,
                    )
                    return
                await asyncio.sleep(self._config.backoff(failures))

    async def _heartbeat_loop(self) -> None:
        config = self._config
        tick = min(0.1, config.heartbeat_interval / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            due = [a for a in self._active.values() if a.next_beat <= now]
            if not due:
                continue
            outcomes = await self._reports.heartbeats([active.grant.attempt for active in due])
            for active, outcome in zip(due, outcomes, strict=True):
                attempt = active.grant.attempt
                try:
                    if isinstance(outcome, OrbitError):
                        raise outcome
                    state = outcome
                except LeaseLostError:
                    if self._active.pop(attempt.id, None) is not None:
                        if self._metrics is not None:
                            self._metrics.lease_lost()
                        logger.warning(
                            "task %s attempt %d lost its lease", active.grant.task.id, attempt.generation
                        )
                        active.ctx._lost.set()
                    continue
                except OrbitError as exc:
                    if self._metrics is not None:
                        self._metrics.heartbeat_failed()
                    logger.warning("heartbeat of task %s failed (%s); retrying", active.grant.task.id, exc)
                    active.next_beat = time.monotonic() + min(1.0, config.heartbeat_interval / 2)
                    continue
                active.next_beat = time.monotonic() + config.heartbeat_interval
                if state.cancel_requested and not active.ctx._cancel.is_set():
                    logger.info("cancellation requested for task %s", active.grant.task.id)
                    active.ctx._cancel.set()
