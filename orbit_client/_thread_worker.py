"""The thread worker: :class:`Worker` runs sync handlers in a thread pool, with a heartbeat thread.

Its rules are shared with :class:`AsyncWorker` in :mod:`._worker`; this module holds its threads,
locks and waits.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any

from orbit_client import _tracing
from orbit_client._attempt_models import AttemptState, LeaseGrant
from orbit_client._client import OrbitClient
from orbit_client._exceptions import OrbitError, OrbitUsageError
from orbit_client._reports import Reports
from orbit_client._worker import (
    _DOC_ARGS,
    DEFAULT_THREAD_REPORT_LINGER,
    TaskContext,
    _Config,
    _WorkerCore,
    logger,
)

__all__ = ["Worker"]


class Worker(_WorkerCore):
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
        self._stopping = threading.Event()
        self._lock = threading.Condition()
        #: Tasks leased and not yet done (their reports included); ``_running``: handler slots taken.
        self._in_flight = 0
        self._running = 0
        self._reports = Reports(
            client,
            namespace,
            linger=report_linger,
            in_flight=lambda: self._in_flight,
            starting=lambda: self._starting,
        )

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
                    config.namespace, config.queue, **self._lease_arguments(free)
                )
            except OrbitError as exc:
                failures += 1
                self._stopping.wait(self._lease_failed(exc, failures))
                continue
            failures = 0
            starting = self._leased(grants)
            with self._lock:  # all at once: a report waits for the others of its batch (Reports)
                self._in_flight += len(grants)
                self._running += len(grants)
                self._starting += starting
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
            error = self._unknown_handler_error(grant)
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
        active = self._running_attempt(grant)
        with self._lock:
            self._active[attempt.id] = active
        logger.debug("running task %s (%s) attempt %d", task.id, task.handler, attempt.generation)
        began = time.monotonic()
        try:
            result = handler(active.ctx)
        except Exception as exc:
            self._handler_ran(task.handler, began)
            free_slot()
            error = self._handler_failed(grant, exc)
            self._report(grant, lambda: reports.fail(attempt, error))
            return
        self._handler_ran(task.handler, began)
        free_slot()
        try:
            self._report(grant, lambda: reports.complete(attempt, result))
        except OrbitUsageError as exc:  # the result is not JSON
            error = self._invalid_result(grant, exc)
            self._report(grant, lambda: reports.fail(attempt, error))

    def _report(self, grant: LeaseGrant, call: Callable[[], AttemptState]) -> None:
        """Send a complete/fail report; keep retrying retryable failures for up to one lease."""
        give_up = self._report_give_up_at()
        failures = 0
        while True:
            try:
                state = call()
            except OrbitUsageError:  # nothing was sent (e.g. a result that is not JSON): the caller decides
                raise
            except OrbitError as exc:
                failures += 1
                delay = self._report_failed(grant, exc, failures, give_up)
                if delay is None:
                    return
                time.sleep(delay)
            else:
                self._reported(state)
                return

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self._heartbeat_tick):
            with self._lock:
                due = self._due_heartbeats()
            if not due:
                continue
            outcomes = self._reports.heartbeats([active.grant.attempt for active in due])
            for active, outcome in zip(due, outcomes, strict=True):
                self._heartbeat_answered(active, outcome, self._forget)

    def _forget(self, attempt_id: str) -> bool:
        with self._lock:
            return self._active.pop(attempt_id, None) is not None
